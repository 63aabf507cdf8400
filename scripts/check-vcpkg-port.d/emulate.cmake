# SPDX-License-Identifier: Apache-2.0
# Runs ports/tierkv/portfile.cmake in CMake script mode with stand-ins for the vcpkg helpers it
# calls, so the portfile's own text (source path, feature mapping, options, file steps) is
# executed without the vcpkg tool. The stand-ins do what vcpkg's helpers do for a one-config
# (release) build on Linux, no more; a helper or argument they do not know is an error.
#   cmake -DPORT_DIR=... -DSTAGE=... -DWORK=... [-DFEATURES=core;cuda] -P emulate.cmake
cmake_minimum_required(VERSION 3.25)
foreach(_v PORT_DIR STAGE WORK)
  if(NOT DEFINED ${_v})
    message(FATAL_ERROR "emulate.cmake: -D${_v}= is required")
  endif()
endforeach()
if(NOT DEFINED FEATURES)
  set(FEATURES core)
endif()
set(PORT tierkv)
set(TARGET_TRIPLET x64-linux)
set(CURRENT_PACKAGES_DIR "${STAGE}")
set(CURRENT_BUILDTREES_DIR "${WORK}/buildtrees")
file(READ "${PORT_DIR}/vcpkg.json" _manifest)
string(JSON VERSION GET "${_manifest}" version)

function(_tierkv_run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _out)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "failed (${_rc}): ${ARGN}\n${_out}")
  endif()
endfunction()

function(vcpkg_check_features)
  cmake_parse_arguments(PARSE_ARGV 0 A "" "OUT_FEATURE_OPTIONS" "FEATURES;INVERTED_FEATURES")
  if(A_UNPARSED_ARGUMENTS OR A_INVERTED_FEATURES)
    message(FATAL_ERROR "vcpkg_check_features stand-in: unsupported ${A_UNPARSED_ARGUMENTS}")
  endif()
  set(_opts "")
  list(LENGTH A_FEATURES _n)
  math(EXPR _last "${_n} - 1")
  foreach(_i RANGE 0 ${_last} 2)
    math(EXPR _j "${_i} + 1")
    list(GET A_FEATURES ${_i} _feature)
    list(GET A_FEATURES ${_j} _option)
    if(_feature IN_LIST FEATURES)
      list(APPEND _opts "-D${_option}=ON")
    else()
      list(APPEND _opts "-D${_option}=OFF")
    endif()
  endforeach()
  set(${A_OUT_FEATURE_OPTIONS} "${_opts}" PARENT_SCOPE)
endfunction()

function(vcpkg_cmake_configure)
  cmake_parse_arguments(PARSE_ARGV 0 A "" "SOURCE_PATH" "OPTIONS;OPTIONS_RELEASE")
  if(A_UNPARSED_ARGUMENTS)
    message(FATAL_ERROR "vcpkg_cmake_configure stand-in: unsupported ${A_UNPARSED_ARGUMENTS}")
  endif()
  if(NOT VCPKG_BUILD_TYPE STREQUAL "release")
    message(FATAL_ERROR "stand-in emulates a release-only build; the portfile must set VCPKG_BUILD_TYPE release")
  endif()
  # What vcpkg_cmake_configure passes besides the port's options (Linux, release config).
  set(_build "${CURRENT_BUILDTREES_DIR}/${TARGET_TRIPLET}-rel")
  _tierkv_run(${CMAKE_COMMAND} -S "${A_SOURCE_PATH}" -B "${_build}" -G Ninja
    -DCMAKE_BUILD_TYPE=Release "-DCMAKE_INSTALL_PREFIX=${CURRENT_PACKAGES_DIR}"
    -DCMAKE_INSTALL_BINDIR=bin -DCMAKE_INSTALL_LIBDIR=lib
    -DCMAKE_EXPORT_NO_PACKAGE_REGISTRY=ON -DCMAKE_FIND_PACKAGE_NO_PACKAGE_REGISTRY=ON
    -DFETCHCONTENT_FULLY_DISCONNECTED=ON -DBUILD_SHARED_LIBS=OFF
    ${A_OPTIONS} ${A_OPTIONS_RELEASE})
  file(WRITE "${WORK}/configure-options.txt" "${A_OPTIONS};${A_OPTIONS_RELEASE}")
  set_property(GLOBAL PROPERTY _tierkv_build "${_build}")
endfunction()

function(vcpkg_cmake_install)
  if(ARGN)
    message(FATAL_ERROR "vcpkg_cmake_install stand-in: unsupported ${ARGN}")
  endif()
  get_property(_build GLOBAL PROPERTY _tierkv_build)
  _tierkv_run(${CMAKE_COMMAND} --build "${_build}" --target install)
endfunction()

# The real helper also rewrites the configs' prefix computation for a moved CONFIG_PATH; here
# CONFIG_PATH must already be share/<package>, where nothing needs rewriting.
function(vcpkg_cmake_config_fixup)
  cmake_parse_arguments(PARSE_ARGV 0 A "" "CONFIG_PATH;PACKAGE_NAME" "")
  if(A_UNPARSED_ARGUMENTS)
    message(FATAL_ERROR "vcpkg_cmake_config_fixup stand-in: unsupported ${A_UNPARSED_ARGUMENTS}")
  endif()
  if(NOT A_PACKAGE_NAME)
    set(A_PACKAGE_NAME "${PORT}")
  endif()
  if(NOT A_CONFIG_PATH STREQUAL "share/${A_PACKAGE_NAME}")
    message(FATAL_ERROR "stand-in handles CONFIG_PATH share/${A_PACKAGE_NAME} only, got ${A_CONFIG_PATH}")
  endif()
  if(NOT EXISTS "${CURRENT_PACKAGES_DIR}/${A_CONFIG_PATH}/${A_PACKAGE_NAME}Config.cmake")
    message(FATAL_ERROR "'${CURRENT_PACKAGES_DIR}/${A_CONFIG_PATH}' holds no ${A_PACKAGE_NAME}Config.cmake")
  endif()
endfunction()

function(vcpkg_install_copyright)
  cmake_parse_arguments(PARSE_ARGV 0 A "" "" "FILE_LIST")
  list(LENGTH A_FILE_LIST _n)
  if(A_UNPARSED_ARGUMENTS OR NOT _n EQUAL 1)
    message(FATAL_ERROR "vcpkg_install_copyright stand-in: one FILE_LIST file only")
  endif()
  file(MAKE_DIRECTORY "${CURRENT_PACKAGES_DIR}/share/${PORT}")
  file(COPY_FILE "${A_FILE_LIST}" "${CURRENT_PACKAGES_DIR}/share/${PORT}/copyright")
endfunction()

# CMAKE_CURRENT_LIST_DIR inside the portfile is the port's folder, as under vcpkg.
include("${PORT_DIR}/portfile.cmake")
