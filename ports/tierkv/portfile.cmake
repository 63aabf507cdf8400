# SPDX-License-Identifier: Apache-2.0
# vcpkg overlay port for tierkv (header-only). By default it builds the source tree that holds
# this port (ports/tierkv/../..); TIERKV_SOURCE_PATH in the environment points it elsewhere
# (vcpkg clears the environment: pass VCPKG_KEEP_ENV_VARS=TIERKV_SOURCE_PATH).
#   vcpkg install tierkv --overlay-ports=<tierkv>/ports
# scripts/check-vcpkg-port emulates the configure / install steps below with plain CMake.
if(DEFINED ENV{TIERKV_SOURCE_PATH})
  set(SOURCE_PATH "$ENV{TIERKV_SOURCE_PATH}")
else()
  get_filename_component(SOURCE_PATH "${CMAKE_CURRENT_LIST_DIR}/../.." ABSOLUTE)
endif()
# Upstream (a registry port) would fetch a tagged release instead:
# vcpkg_from_github(
#   OUT_SOURCE_PATH SOURCE_PATH
#   REPO <owner>/tierkv
#   REF "v${VERSION}"
#   SHA512 <sha512 of the release tarball>
#   HEAD_REF main
# )

# Header-only: one configuration is enough, and nothing lands in lib/.
set(VCPKG_BUILD_TYPE release)

vcpkg_check_features(OUT_FEATURE_OPTIONS FEATURE_OPTIONS
  FEATURES
    cuda TIERKV_CUDA
)

vcpkg_cmake_configure(
  SOURCE_PATH "${SOURCE_PATH}"
  OPTIONS
    -DTIERKV_BUILD_TESTS=OFF
    -DTIERKV_BUILD_BENCH=OFF
    -DTIERKV_BUILD_EXAMPLES=OFF
    ${FEATURE_OPTIONS}
)
vcpkg_cmake_install()
vcpkg_cmake_config_fixup(CONFIG_PATH share/tierkv)

# The project installs its LICENSE under share/doc/tierkv; vcpkg's place for it is copyright.
file(REMOVE_RECURSE "${CURRENT_PACKAGES_DIR}/share/doc")
# Header-only: an empty lib/ (none today) would fail vcpkg's post-build checks.
file(GLOB _tierkv_lib "${CURRENT_PACKAGES_DIR}/lib/*")
if(NOT _tierkv_lib)
  file(REMOVE_RECURSE "${CURRENT_PACKAGES_DIR}/lib")
endif()
vcpkg_install_copyright(FILE_LIST "${SOURCE_PATH}/LICENSE")
file(INSTALL "${CMAKE_CURRENT_LIST_DIR}/usage" DESTINATION "${CURRENT_PACKAGES_DIR}/share/${PORT}")
