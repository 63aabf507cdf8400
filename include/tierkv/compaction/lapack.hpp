// SPDX-License-Identifier: Apache-2.0
// The few BLAS / LAPACK routines compaction uses (Cholesky factor and solve, SVD least
// squares, Gram and general products), declared against the Fortran ABI so that any LAPACK
// links them: Debian's OpenBLAS (libopenblas-dev, what the tests and measurements link), the
// reference LAPACK, MKL. No LAPACKE header is needed. Matrices are column-major doubles.
// Character arguments pass their hidden length (size_t, gfortran >= 8 convention); the C
// routines OpenBLAS substitutes for some of them ignore it.
//
// Only the headers under tierkv/compaction/ need LAPACK: link -lopenblas (or
// CMake's LAPACK::LAPACK) where they are used. The rest of tierkv stays header-only.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "tierkv/core/status.hpp"

extern "C" {
void dpotrf_(const char* uplo, const int* n, double* a, const int* lda, int* info, std::size_t);
void dpotrs_(const char* uplo, const int* n, const int* nrhs, const double* a, const int* lda,
             double* b, const int* ldb, int* info, std::size_t);
void dgelsd_(const int* m, const int* n, const int* nrhs, double* a, const int* lda, double* b,
             const int* ldb, double* s, const double* rcond, int* rank, double* work,
             const int* lwork, int* iwork, int* info);
void dgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k,
            const double* alpha, const double* a, const int* lda, const double* b, const int* ldb,
            const double* beta, double* c, const int* ldc, std::size_t, std::size_t);
void dsyrk_(const char* uplo, const char* trans, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* beta, double* c, const int* ldc,
            std::size_t, std::size_t);
}

namespace tierkv::compaction::lapack {

/// Dimensions reach LAPACK as 32-bit ints.
inline status check_dim(const char* what, std::int64_t v) {
  if (v < 0 || v > std::numeric_limits<int>::max())
    return status::make(errc::out_of_range, what, " = ", v, " exceeds the limit ",
                        std::numeric_limits<int>::max(), " (LAPACK's 32-bit dimensions)");
  return {};
}

/// C[m x n] = alpha op(A) op(B) + beta C, column-major; ta / tb 'N' or 'T'.
inline void gemm(char ta, char tb, int m, int n, int k, double alpha, const double* a, int lda,
                 const double* b, int ldb, double beta, double* c, int ldc) {
  if (m == 0 || n == 0) return;
  dgemm_(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc, 1, 1);
}

/// G[n x n] = A^T A for A[k x n] (column-major, lda >= k); both triangles are filled.
inline void gram(int n, int k, const double* a, int lda, double* g) {
  if (n == 0) return;
  const double one = 1.0, zero = 0.0;
  const char up = 'U', tr = 'T';
  dsyrk_(&up, &tr, &n, &k, &one, a, &lda, &zero, g, &n, 1, 1);
  for (int j = 0; j < n; ++j)
    for (int i = j + 1; i < n; ++i) g[std::size_t(j) * n + i] = g[std::size_t(i) * n + j];
}

/// Solves (G + ridge I) X = B in place (G symmetric positive semi-definite n x n, B n x nrhs),
/// by Cholesky. G is copied, not changed. When the factorization fails (G singular to working
/// precision) the ridge grows by 100x from max(ridge, 1e-14 max diag) up to 1e-4 max diag;
/// `used_ridge` gets the value that worked. Errors: invalid_argument when nothing works.
inline status solve_spd(int n, int nrhs, const double* g, double* b, double ridge = 0.0,
                        double* used_ridge = nullptr) {
  if (n == 0) return {};
  double dmax = 0;
  for (int i = 0; i < n; ++i) dmax = std::max(dmax, g[std::size_t(i) * n + i]);
  if (!(dmax > 0)) dmax = 1.0;
  std::vector<double> f(static_cast<std::size_t>(n) * n);
  double r = ridge;
  for (int attempt = 0; attempt < 12; ++attempt) {
    for (std::size_t i = 0; i < f.size(); ++i) f[i] = g[i];
    for (int i = 0; i < n; ++i) f[std::size_t(i) * n + i] += r;
    int info = 0;
    const char up = 'U';
    dpotrf_(&up, &n, f.data(), &n, &info, 1);
    if (info == 0) {
      dpotrs_(&up, &n, &nrhs, f.data(), &n, b, &n, &info, 1);
      if (info != 0)
        return status::make(errc::invalid_argument, "dpotrs: info = ", info, " (n = ", n, ")");
      if (used_ridge) *used_ridge = r;
      return {};
    }
    r = std::max(r * 100.0, 1e-14 * dmax);
    if (r > 1e-4 * dmax) break;
  }
  return status::make(errc::invalid_argument, "solve_spd: the ", n, " x ", n,
                      " Gram matrix is not positive definite even with a ridge of 1e-4 x its "
                      "largest diagonal entry ",
                      dmax);
}

/// Minimum-norm least squares min ||A x - b|| by SVD (dgelsd): A[m x n] column-major is
/// overwritten; b has max(m, n) rows x nrhs and returns x in its first n rows. Singular values
/// below rcond * s_max count as zero (rcond < 0: machine precision). Returns the rank.
inline result<int> least_squares(int m, int n, int nrhs, double* a, double* b, double rcond = -1) {
  const int ldb = std::max(1, std::max(m, n));
  std::vector<double> s(std::size_t(std::max(1, std::min(m, n))));
  int rank = 0, info = 0, lwork = -1;
  double wq = 0;
  int iwq = 0;
  const int lda = std::max(1, m);
  dgelsd_(&m, &n, &nrhs, a, &lda, b, &ldb, s.data(), &rcond, &rank, &wq, &lwork, &iwq, &info);
  if (info != 0)
    return status::make(errc::invalid_argument, "dgelsd workspace query: info = ", info);
  lwork = int(wq) + 1;
  std::vector<double> work(static_cast<std::size_t>(lwork));
  std::vector<int> iwork(static_cast<std::size_t>(std::max(1, iwq)));
  dgelsd_(&m, &n, &nrhs, a, &lda, b, &ldb, s.data(), &rcond, &rank, work.data(), &lwork,
          iwork.data(), &info);
  if (info != 0)
    return status::make(errc::invalid_argument, "dgelsd: info = ", info, " (the SVD of the ", m,
                        " x ", n, " matrix did not converge)");
  return rank;
}

}  // namespace tierkv::compaction::lapack
