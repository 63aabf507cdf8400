# tierkv/compaction/ calls LAPACK (compaction/lapack.hpp): Debian's OpenBLAS build of it
# (libopenblas-dev, installed by scripts/install-deps).
find_package(PkgConfig REQUIRED)
pkg_check_modules(TIERKV_OPENBLAS REQUIRED IMPORTED_TARGET openblas)
target_link_libraries(test_${_area} PRIVATE PkgConfig::TIERKV_OPENBLAS)
