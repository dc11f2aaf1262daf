#include <weft/bf16.h>
#include <weft/cpu_kernels.h>

#include <cblas.h>

#include <vector>

namespace weft::cpu {

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
          const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
          int64_t ldc) {
  if (m == 0 || n == 0) return;
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, static_cast<blasint>(m),
              static_cast<blasint>(n), static_cast<blasint>(k), alpha, a,
              static_cast<blasint>(lda), b, static_cast<blasint>(ldb), beta, c,
              static_cast<blasint>(ldc));
}

float round_to(Rounding r, float x) {
  switch (r) {
    case Rounding::None: return x;
    case Rounding::Bf16: return round_to_bf16(x);
    // GCC's float -> _Float16 conversion rounds once, to nearest even, and
    // gives +-inf past the largest finite half (65504).
    case Rounding::Fp16: return static_cast<float>(static_cast<_Float16>(x));
  }
  return x;
}

namespace {

// The stored (rows, cols) matrix at x with row stride ld, rounded into a
// dense copy (row stride cols).
template <Rounding R>
void round_copy(const float* x, int64_t rows, int64_t cols, int64_t ld, std::vector<float>& out) {
  out.resize(static_cast<size_t>(rows * cols));
  // Element by element, so threads change nothing but the time (inside the
  // attention's parallel loop this runs on the calling thread).
#pragma omp parallel for schedule(static) if (rows * cols >= (int64_t{1} << 16))
  for (int64_t i = 0; i < rows; ++i) {
    const float* src = x + i * ld;
    float* dst = out.data() + i * cols;
    for (int64_t j = 0; j < cols; ++j) dst[j] = round_to(R, src[j]);
  }
}

void round_copy(Rounding r, const float* x, int64_t rows, int64_t cols, int64_t ld,
                std::vector<float>& out) {
  if (r == Rounding::Bf16)
    round_copy<Rounding::Bf16>(x, rows, cols, ld, out);
  else
    round_copy<Rounding::Fp16>(x, rows, cols, ld, out);
}

}  // namespace

void gemm_rounded(Rounding r, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                  float alpha, const float* a, int64_t lda, const float* b, int64_t ldb,
                  float beta, float* c, int64_t ldc) {
  if (r == Rounding::None || m == 0 || n == 0 || k == 0) {
    gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  // One pair of buffers per thread (attention calls this from an OpenMP
  // loop); they grow to the largest operands once and stay.
  thread_local std::vector<float> ra, rb;
  const int64_t a_rows = trans_a ? k : m, a_cols = trans_a ? m : k;
  const int64_t b_rows = trans_b ? n : k, b_cols = trans_b ? k : n;
  round_copy(r, a, a_rows, a_cols, lda, ra);
  round_copy(r, b, b_rows, b_cols, ldb, rb);
  gemm(trans_a, trans_b, m, n, k, alpha, ra.data(), a_cols, rb.data(), b_cols, beta, c, ldc);
}

}  // namespace weft::cpu
