# SPDX-License-Identifier: Apache-2.0
# Settings for tierkv's own tests, benchmarks and examples (never applied to consumers).

option(TIERKV_WERROR "Treat warnings as errors in tierkv's own translation units" ON)
option(TIERKV_SANITIZE "Build tierkv's own translation units with ASan + UBSan" OFF)
option(TIERKV_TSAN "Build tierkv's own translation units with ThreadSanitizer" OFF)
if(TIERKV_SANITIZE AND TIERKV_TSAN)
  message(FATAL_ERROR "TIERKV_SANITIZE (ASan) and TIERKV_TSAN cannot be combined")
endif()

add_library(tierkv_internal INTERFACE)
target_link_libraries(tierkv_internal INTERFACE tierkv::tierkv)

set(_tierkv_cxx_warnings -Wall -Wextra -Wpedantic -Wconversion -Wshadow)
if(TIERKV_WERROR)
  list(APPEND _tierkv_cxx_warnings -Werror)
endif()
target_compile_options(tierkv_internal INTERFACE $<$<COMPILE_LANGUAGE:CXX>:${_tierkv_cxx_warnings}>)
if(TIERKV_CUDA)
  # nvcc: its own warnings as errors, and the host compiler's -Wall -Wextra on host code.
  set(_tierkv_cuda_flags -Xcompiler=-Wall,-Wextra --expt-relaxed-constexpr -lineinfo)
  if(TIERKV_WERROR)
    list(APPEND _tierkv_cuda_flags --Werror=all-warnings -Xcompiler=-Werror)
  endif()
  target_compile_options(tierkv_internal INTERFACE $<$<COMPILE_LANGUAGE:CUDA>:${_tierkv_cuda_flags}>)
endif()
if(TIERKV_SANITIZE)
  set(_tierkv_san -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer)
  # GCC 12's -Wmaybe-uninitialized misfires under the sanitizers' instrumentation (seen in libstdc++'s
  # std::function inside Catch2); the plain builds keep the warning.
  target_compile_options(tierkv_internal INTERFACE $<$<COMPILE_LANGUAGE:CXX>:${_tierkv_san}
                         $<$<CXX_COMPILER_ID:GNU>:-Wno-maybe-uninitialized>>)
  target_link_options(tierkv_internal INTERFACE ${_tierkv_san})
endif()

if(TIERKV_TSAN)
  set(_tierkv_tsan -fsanitize=thread -fno-omit-frame-pointer)
  target_compile_options(tierkv_internal INTERFACE $<$<COMPILE_LANGUAGE:CXX>:${_tierkv_tsan}>)
  target_link_options(tierkv_internal INTERFACE ${_tierkv_tsan})
endif()

find_package(Threads REQUIRED)
target_link_libraries(tierkv_internal INTERFACE Threads::Threads)

# tierkv_add_program(NAME SOURCES... [LIBS ...]): an executable of ours with the internal settings.
function(tierkv_add_program name)
  cmake_parse_arguments(ARG "" "" "SOURCES;LIBS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE tierkv_internal ${ARG_LIBS})
  get_filename_component(_ext "${ARG_SOURCES}" LAST_EXT)
endfunction()
