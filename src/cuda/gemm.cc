// Row-major GEMMs on cuBLAS (which is column-major).
//
// A row-major matrix read as column-major is its transpose, so the row-major
// C = op(A) op(B) is computed as the column-major C^T = op(B)^T op(A)^T: swap
// the operands (and m with n) and keep each operand's own transpose flag.
#include <weft/cuda/kernels.h>

#include "src/cuda/check.h"

#include <climits>

namespace weft::cuda {

const char* math_mode_name(MathMode m) {
  switch (m) {
    case MathMode::FP32: return "fp32";
    case MathMode::TF32: return "tf32";
    case MathMode::BF16: return "bf16";
    case MathMode::FP16: return "fp16";
  }
  return "?";
}

MathMode parse_math_mode(const std::string& name) {
  for (MathMode m : {MathMode::FP32, MathMode::TF32, MathMode::BF16, MathMode::FP16})
    if (name == math_mode_name(m)) return m;
  throw Error("math mode '{}' is not one of fp32, tf32, bf16, fp16", name);
}

namespace {

int as_int(int64_t v, const char* what) {
  check(v >= 0 && v <= INT_MAX, "gemm: {} ({}) does not fit cuBLAS's 32-bit int", what, v);
  return static_cast<int>(v);
}

cublasOperation_t op(bool trans) { return trans ? CUBLAS_OP_T : CUBLAS_OP_N; }

// fp32 operands in every mode: the fast compute types convert them inside
// the kernel (to tf32, bf16 or fp16) and accumulate in fp32.
cublasComputeType_t compute_type(MathMode mode) {
  switch (mode) {
    case MathMode::FP32: return CUBLAS_COMPUTE_32F;
    case MathMode::TF32: return CUBLAS_COMPUTE_32F_FAST_TF32;
    case MathMode::BF16: return CUBLAS_COMPUTE_32F_FAST_16BF;
    case MathMode::FP16: return CUBLAS_COMPUTE_32F_FAST_16F;
  }
  return CUBLAS_COMPUTE_32F;
}

// One cuBLAS call for every precision: A and B of type `ab` (fp32 or bf16),
// C of type `ct` (fp32, or bf16 with bf16 A and B); alpha and beta fp32 as
// every compute type here is 32F; batch 1 uses cublasGemmEx.
void gemm_any(Context& ctx, cublasComputeType_t compute, cudaDataType_t ab, cudaDataType_t ct,
              bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
              const void* a, int64_t lda, int64_t stride_a, const void* b, int64_t ldb,
              int64_t stride_b, float beta, void* c, int64_t ldc, int64_t stride_c,
              int64_t batch) {
  if (m == 0 || n == 0 || batch == 0) return;
  ctx.make_current();
  cublasHandle_t h = ctx.cublas();
  const int im = as_int(m, "m"), in = as_int(n, "n"), ik = as_int(k, "k");
  const int ilda = as_int(lda, "lda"), ildb = as_int(ldb, "ldb"), ildc = as_int(ldc, "ldc");
  if (batch == 1) {
    WEFT_CUBLAS_CHECK(cublasGemmEx(h, op(trans_b), op(trans_a), in, im, ik, &alpha, b, ab, ildb, a,
                                   ab, ilda, &beta, c, ct, ildc, compute,
                                   CUBLAS_GEMM_DEFAULT));
  } else {
    WEFT_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
        h, op(trans_b), op(trans_a), in, im, ik, &alpha, b, ab, ildb, stride_b, a, ab, ilda,
        stride_a, &beta, c, ct, ildc, stride_c, as_int(batch, "batch"), compute,
        CUBLAS_GEMM_DEFAULT));
  }
}

void gemm_mode(Context& ctx, MathMode mode, bool trans_a, bool trans_b, int64_t m, int64_t n,
               int64_t k, float alpha, const float* a, int64_t lda, int64_t stride_a,
               const float* b, int64_t ldb, int64_t stride_b, float beta, float* c, int64_t ldc,
               int64_t stride_c, int64_t batch) {
  gemm_any(ctx, compute_type(mode), CUDA_R_32F, CUDA_R_32F, trans_a, trans_b, m, n, k, alpha, a,
           lda, stride_a, b, ldb, stride_b, beta, c, ldc, stride_c, batch);
}

}  // namespace

void gemm(Context& ctx, MathMode mode, bool trans_a, bool trans_b, int64_t m, int64_t n,
          int64_t k, float alpha, const float* a, int64_t lda, const float* b, int64_t ldb,
          float beta, float* c, int64_t ldc) {
  gemm_mode(ctx, mode, trans_a, trans_b, m, n, k, alpha, a, lda, 0, b, ldb, 0, beta, c, ldc, 0, 1);
}

void gemm_bf16(Context& ctx, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
               float alpha, const bf16* a, int64_t lda, const bf16* b, int64_t ldb, float beta,
               float* c, int64_t ldc) {
  gemm_any(ctx, CUBLAS_COMPUTE_32F, CUDA_R_16BF, CUDA_R_32F, trans_a, trans_b, m, n, k, alpha, a,
           lda, 0, b, ldb, 0, beta, c, ldc, 0, 1);
}

void gemm_bf16_out(Context& ctx, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                   float alpha, const bf16* a, int64_t lda, const bf16* b, int64_t ldb,
                   float beta, bf16* c, int64_t ldc) {
  gemm_any(ctx, CUBLAS_COMPUTE_32F, CUDA_R_16BF, CUDA_R_16BF, trans_a, trans_b, m, n, k, alpha, a,
           lda, 0, b, ldb, 0, beta, c, ldc, 0, 1);
}

void gemm_strided_batched(Context& ctx, MathMode mode, bool trans_a, bool trans_b, int64_t m,
                          int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
                          int64_t stride_a, const float* b, int64_t ldb, int64_t stride_b,
                          float beta, float* c, int64_t ldc, int64_t stride_c, int64_t batch) {
  gemm_mode(ctx, mode, trans_a, trans_b, m, n, k, alpha, a, lda, stride_a, b, ldb, stride_b, beta,
            c, ldc, stride_c, batch);
}

}  // namespace weft::cuda
