# This area's one unit registers a format from outside tierkv (tierkv/formats.hpp's
# TIERKV_USER_FORMATS); an executable of its own, so every unit in it sees the same registry.
target_include_directories(test_${_area} PRIVATE ${_dir})
target_compile_definitions(test_${_area} PRIVATE TIERKV_USER_FORMATS_HEADER="int8_twin.hpp"
                           TIERKV_USER_FORMATS=tierkv_test::formats::int8_twin)
