# measure_compaction calls LAPACK (tierkv/compaction/lapack.hpp): Debian's OpenBLAS build of it.
find_package(PkgConfig REQUIRED)
pkg_check_modules(TIERKV_OPENBLAS REQUIRED IMPORTED_TARGET openblas)
target_link_libraries(measure_compaction PRIVATE PkgConfig::TIERKV_OPENBLAS)
