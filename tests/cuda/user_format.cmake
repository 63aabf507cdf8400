# test_cuda_user_format registers tests/unit/user_format/int8_twin.hpp through tierkv/formats.hpp's
# TIERKV_USER_FORMATS, in both of its halves (the Catch2 unit and the nvcc one), so the whole
# program sees one registry.
foreach(_t test_cuda_${target} test_cuda_${target}_kernels)
  target_include_directories(${_t} PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/unit/user_format)
  target_compile_definitions(${_t} PRIVATE TIERKV_USER_FORMATS_HEADER="int8_twin.hpp"
                             TIERKV_USER_FORMATS=tierkv_test::formats::int8_twin)
endforeach()
