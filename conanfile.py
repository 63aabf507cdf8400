# SPDX-License-Identifier: Apache-2.0
# Conan 2 recipe for tierkv (header-only). It packages what `cmake --install` installs, so a
# Conan consumer gets the same headers at include/tierkv/ and the same tierkv::tierkv target as
# a find_package consumer of a plain install. Needs nothing from a remote: CMake and the
# compiler come from the system (no tool_requires).
#
#   conan create . -s compiler.cppstd=20      (scripts/ci-packaging runs it offline)
#
# No `cuda` option: the CUDA headers (include/tierkv/cuda/*.cuh) are installed either way and
# TIERKV_CUDA only adds our own kernels' tests and benches, so an option would change nothing in
# the package. A consumer's CUDA translation units need its own CUDA toolkit.
import os
import re

from conan import ConanFile
from conan.errors import ConanException
from conan.tools.build import check_min_cppstd
from conan.tools.cmake import CMake, CMakeToolchain, cmake_layout
from conan.tools.files import copy, load, save

required_conan_version = ">=2.0"


class TierkvConan(ConanFile):
    name = "tierkv"
    description = "Tiered, paged KV-cache storage for LLM inference (header-only C++20/CUDA)"
    license = "Apache-2.0"
    topics = ("kv-cache", "llm", "inference", "cuda", "header-only")
    package_type = "header-library"
    settings = "os", "arch", "compiler", "build_type"
    no_copy_source = True
    exports_sources = "CMakeLists.txt", "cmake/*", "include/*", "LICENSE"

    def set_version(self):
        # One version in one place: project(tierkv VERSION x.y.z ...) in CMakeLists.txt.
        text = load(self, os.path.join(self.recipe_folder, "CMakeLists.txt"))
        m = re.search(r"project\(\s*tierkv\s+VERSION\s+([0-9]+\.[0-9]+\.[0-9]+)", text)
        if not m:
            raise ConanException("no project(tierkv VERSION x.y.z) in CMakeLists.txt")
        self.version = m.group(1)

    def layout(self):
        cmake_layout(self)

    def package_id(self):
        self.info.clear()

    def validate(self):
        check_min_cppstd(self, 20)

    def generate(self):
        tc = CMakeToolchain(self)
        # Only the library and its install rules: no tests, benches, examples or kernels.
        tc.cache_variables["TIERKV_BUILD_TESTS"] = "OFF"
        tc.cache_variables["TIERKV_BUILD_BENCH"] = "OFF"
        tc.cache_variables["TIERKV_BUILD_EXAMPLES"] = "OFF"
        tc.cache_variables["TIERKV_CUDA"] = "OFF"
        tc.generate()

    def build(self):
        cmake = CMake(self)
        cmake.configure()

    def package(self):
        cmake = CMake(self)
        cmake.install()
        copy(self, "LICENSE", self.source_folder, os.path.join(self.package_folder, "licenses"))
        # CMakeDeps writes its own tierkv::tierkv from package_info(), which knows include dirs
        # only; this module adds the usage requirements tierkv's own export carries (root
        # CMakeLists.txt: cxx_std_20, and for CUDA sources -std=c++20 --expt-relaxed-constexpr).
        # test_package fails if the two drift apart.
        save(self, os.path.join(self.package_folder, self._usage_module),
             "# Added by tierkv's conanfile.py: the usage requirements of tierkv's own export.\n"
             "target_compile_features(tierkv::tierkv INTERFACE cxx_std_20)\n"
             "target_compile_options(tierkv::tierkv INTERFACE\n"
             "  \"$<$<COMPILE_LANGUAGE:CUDA>:-std=c++20;--expt-relaxed-constexpr>\")\n")

    @property
    def _usage_module(self):
        return os.path.join("share", "conan", "tierkv-usage-requirements.cmake")

    def package_info(self):
        self.cpp_info.set_property("cmake_file_name", "tierkv")
        self.cpp_info.set_property("cmake_target_name", "tierkv::tierkv")
        self.cpp_info.set_property("cmake_build_modules", [self._usage_module])
        self.cpp_info.bindirs = []
        self.cpp_info.libdirs = []
