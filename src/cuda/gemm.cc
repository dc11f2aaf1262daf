// Row-major GEMMs on cuBLAS (which is column-major).
//
// A row-major matrix read as column-major is its transpose, so the row-major
// C = op(A) op(B) is computed as the column-major C^T = op(B)^T op(A)^T: swap
// the operands (and m with n) and keep each operand's own transpose flag.
//
// The bias GEMMs run on cuBLASLt with CUBLASLT_EPILOGUE_BIAS, in the same
// column-major view: row-major C (m, n) plus bias (n) in every row is
// column-major D (n x m) plus bias in every column, a vector of D's n rows,
// which is what the epilogue broadcasts.
#include <weft/cuda/kernels.h>

#include "src/cuda/check.h"

#include <cublasLt.h>
#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <compare>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>

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

// fp32 operands in every mode. TF32 converts them inside the kernel. The
// 16-bit modes do not use cuBLAS's CUBLAS_COMPUTE_32F_FAST_16BF / _16F,
// whose conversion is not the CPU's: on an H200 (CUDA 13.0) fp16 operands
// past 65504 did not overflow, so --fp16's loss scale never saw an overflow,
// and bf16 results were ~2e-3 of the norm away from rounding to nearest.
// Their operands are rounded here instead (Rounded16), to the
// nearest even bf16 or fp16 values kept as floats, and multiplied on TF32
// tensor cores: TF32's 10-bit mantissa and 8-bit exponent hold every bf16
// and fp16 value exactly, so the products are the 16-bit products, summed
// in fp32, as the CPU computes them.
cublasComputeType_t compute_type(MathMode mode) {
  return mode == MathMode::FP32 ? CUBLAS_COMPUTE_32F : CUBLAS_COMPUTE_32F_FAST_TF32;
}

bool narrows(MathMode mode) { return mode == MathMode::BF16 || mode == MathMode::FP16; }

// The elements from the first to the last that a stored operand of `rows`
// rows of `cols`, ld apart, in `batch` matrices `stride` apart, spans.
int64_t operand_span(int64_t rows, int64_t cols, int64_t ld, int64_t stride, int64_t batch) {
  if (rows == 0 || cols == 0 || batch == 0) return 0;
  return (batch - 1) * stride + (rows - 1) * ld + cols;
}

// A's and B's elements rounded to `mode`'s 16-bit values in scratch from
// the caching allocator, the same layout as the originals (the gaps between
// rows are rounded too, and not read); the scratch goes back when this
// goes, which is safe for the GEMM queued on the compute stream before.
struct Rounded16 {
  DeviceBuffer<float> a, b;
  Rounded16(Context& ctx, MathMode mode, bool trans_a, bool trans_b, int64_t m, int64_t n,
            int64_t k, const float* pa, int64_t lda, int64_t stride_a, const float* pb,
            int64_t ldb, int64_t stride_b, int64_t batch) {
    const int64_t na = operand_span(trans_a ? k : m, trans_a ? m : k, lda, stride_a, batch);
    const int64_t nb = operand_span(trans_b ? n : k, trans_b ? k : n, ldb, stride_b, batch);
    if (na > 0) {
      a = DeviceBuffer<float>(ctx, na);
      round_values(ctx, mode, pa, a.data(), na);
    }
    if (nb > 0) {
      b = DeviceBuffer<float>(ctx, nb);
      round_values(ctx, mode, pb, b.data(), nb);
    }
  }
};

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
  if (narrows(mode) && m > 0 && n > 0 && k > 0 && batch > 0) {
    const Rounded16 r(ctx, mode, trans_a, trans_b, m, n, k, a, lda, stride_a, b, ldb, stride_b,
                      batch);
    gemm_any(ctx, compute_type(mode), CUDA_R_32F, CUDA_R_32F, trans_a, trans_b, m, n, k, alpha,
             r.a.data(), lda, stride_a, r.b.data(), ldb, stride_b, beta, c, ldc, stride_c, batch);
    return;
  }
  gemm_any(ctx, compute_type(mode), CUDA_R_32F, CUDA_R_32F, trans_a, trans_b, m, n, k, alpha, a,
           lda, stride_a, b, ldb, stride_b, beta, c, ldc, stride_c, batch);
}

// --- the bias GEMMs ---

// A cuBLASLt object destroyed with its scope (on an exception too).
template <typename H>
using LtOwned = std::unique_ptr<std::remove_pointer_t<H>, cublasStatus_t (*)(H)>;

void lt_check(cublasStatus_t status, const char* call) {
  detail::check_cublas(status, call, __FILE__, __LINE__);
}

template <typename T>
void set_desc(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const T& value,
              const char* name) {
  lt_check(cublasLtMatmulDescSetAttribute(d, attr, &value, sizeof value), name);
}

template <typename T>
void set_pref(cublasLtMatmulPreference_t p, cublasLtMatmulPreferenceAttributes_t attr,
              const T& value, const char* name) {
  lt_check(cublasLtMatmulPreferenceSetAttribute(p, attr, &value, sizeof value), name);
}

LtOwned<cublasLtMatrixLayout_t> lt_layout(cudaDataType_t type, int64_t rows, int64_t cols,
                                          int64_t ld) {
  cublasLtMatrixLayout_t l = nullptr;
  lt_check(cublasLtMatrixLayoutCreate(&l, type, static_cast<uint64_t>(rows),
                                      static_cast<uint64_t>(cols), ld),
           "cublasLtMatrixLayoutCreate");
  return {l, cublasLtMatrixLayoutDestroy};
}

// The largest power of two, at most 256, that divides the address. cuBLASLt's
// heuristic assumes 256-byte aligned operands unless told otherwise, and a
// view into an arena may be less aligned.
uint32_t alignment_of(const void* p) {
  const auto u = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && u % a != 0) a /= 2;
  return a;
}

// What cuBLASLt adds after the product, in the row-major view:
//   Bias         C = op(A) op(B) + bias per row
//   GeluAuxBias  aux = op(A) op(B) + bias per row, C = gelu(aux)
//   DGelu        C = op(A) op(B) * gelu'(aux), element by element
//   BGradB       C = op(A) op(B) + beta C, and bias (n) = the sums of
//                op(B)'s k rows, written: a weight gradient and its bias's
// GELU is the tanh approximation, as weft's kernels compute it.
enum class Epilogue { Bias, GeluAuxBias, DGelu, BGradB };

// One epilogue GEMM, row-major as the others. `type` is A's, B's, C's, the
// bias's and aux's (fp32 or bf16), unless c_type says C's and the bias's
// (fp32 C of bf16 A and B); scale type fp32. aux is (m, n), ldaux apart
// (GeluAuxBias writes it, DGelu reads it); bias is null for DGelu. beta is
// BGradB's only (C is read then).
struct BiasGemm {
  const char* math;  // for the fallback's message: the MathMode, or "bf16"
  cublasComputeType_t compute;
  cudaDataType_t type;
  size_t elem;  // bytes of one element of `type`
  bool trans_a, trans_b;
  int64_t m, n, k;
  const void* a;
  int64_t lda;
  const void* b;
  int64_t ldb;
  const void* bias;
  void* c;
  int64_t ldc;
  Epilogue epilogue = Epilogue::Bias;
  void* aux = nullptr;
  int64_t ldaux = 0;
  int c_type = -1;  // a cudaDataType_t; -1: `type`
  float beta = 0.0f;
  cudaDataType_t ctype() const {
    return c_type < 0 ? type : static_cast<cudaDataType_t>(c_type);
  }
};

cublasLtEpilogue_t lt_epilogue(Epilogue e) {
  switch (e) {
    case Epilogue::Bias: return CUBLASLT_EPILOGUE_BIAS;
    case Epilogue::GeluAuxBias: return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case Epilogue::DGelu: return CUBLASLT_EPILOGUE_DGELU;
    // Column-major, cuBLASLt's A is our B (see the top): its bias gradient
    // sums A over k, one per row of D (n of them).
    case Epilogue::BGradB: return CUBLASLT_EPILOGUE_BGRADA;
  }
  return CUBLASLT_EPILOGUE_DEFAULT;
}

// What picks cuBLASLt's algorithm for a bias GEMM: everything but the
// addresses themselves, whose alignments count instead.
struct AlgoKey {
  int device;
  cublasComputeType_t compute;
  cudaDataType_t type;
  bool trans_a, trans_b;
  int64_t m, n, k, lda, ldb, ldc;
  uint32_t align_a, align_b, align_c;
  Epilogue epilogue;
  int64_t ldaux;
  uint32_t align_aux;
  cudaDataType_t c_type;
  uint32_t align_bias;  // the heuristic reads it from the bias pointer
  auto operator<=>(const AlgoKey&) const = default;
};

// The heuristic's algorithm for a key, or why there is none (then the key
// takes the two steps from then on, without asking again).
struct AlgoChoice {
  std::optional<cublasLtMatmulAlgo_t> algo;
  std::string why;
};

// The heuristic runs once per key and process: a training step repeats the
// same few shapes, and asking costs host time on every call.
class AlgoCache {
 public:
  std::optional<AlgoChoice> find(const AlgoKey& key) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = choices_.find(key);
    if (it == choices_.end()) return std::nullopt;
    return it->second;
  }
  void put(const AlgoKey& key, AlgoChoice choice) {
    std::lock_guard<std::mutex> lock(mu_);
    choices_[key] = std::move(choice);
  }

 private:
  std::mutex mu_;
  std::map<AlgoKey, AlgoChoice> choices_;
};

AlgoCache& algo_cache() {
  static AlgoCache cache;
  return cache;
}

// Runs g on cuBLASLt. Returns why it could not (no algorithm, or the
// algorithm refused: CUBLAS_STATUS_NOT_SUPPORTED), or nothing when it ran;
// any other failure throws.
std::optional<std::string> lt_bias_gemm(Context& ctx, const BiasGemm& g) {
  // cuBLASLt's heuristic can be told the alignment of A, B, C and D but not
  // of the bias vector or of aux: less aligned than a 16-byte load is not
  // risked.
  if (g.bias != nullptr && alignment_of(g.bias) < 16)
    return fmt::format("the bias at {} is not 16-byte aligned", g.bias);
  // bf16 operands not 16-byte aligned (their addresses or row strides):
  // cuBLASLt's epilogue kernels for them were measured on an H200 (CUDA
  // 13.0) up to 5 bf16 ulps of the product from the exact sum, where the
  // aligned ones and the separate steps round once.
  if (g.type == CUDA_R_16BF) {
    const uint32_t elem = static_cast<uint32_t>(g.elem);
    if (std::min({alignment_of(g.a), alignment_of(g.b), alignment_of(g.c)}) < 16 ||
        (static_cast<uint64_t>(g.lda) * elem) % 16 != 0 ||
        (static_cast<uint64_t>(g.ldb) * elem) % 16 != 0 ||
        (static_cast<uint64_t>(g.ldc) * (g.ctype() == CUDA_R_32F ? 4 : elem)) % 16 != 0)
      return std::string("a bf16 operand or row stride is not 16-byte aligned");
  }
  if (g.epilogue == Epilogue::GeluAuxBias || g.epilogue == Epilogue::DGelu) {
    if (alignment_of(g.aux) < 16)
      return fmt::format("the GELU input at {} is not 16-byte aligned", g.aux);
    // cuBLASLt's rule for the GELU input's leading dimension.
    if (g.ldaux % 8 != 0 || g.ldaux < g.n)
      return fmt::format("the GELU input's row stride {} is not a multiple of 8 of at least {}",
                         g.ldaux, g.n);
  }
  cublasLtHandle_t h = ctx.cublas_lt();
  cublasLtMatmulDesc_t d = nullptr;
  lt_check(cublasLtMatmulDescCreate(&d, g.compute, CUDA_R_32F), "cublasLtMatmulDescCreate");
  const LtOwned<cublasLtMatmulDesc_t> desc(d, cublasLtMatmulDescDestroy);
  // Column-major: cuBLASLt's A is our B and its B our A (see the top).
  set_desc(d, CUBLASLT_MATMUL_DESC_TRANSA, op(g.trans_b), "CUBLASLT_MATMUL_DESC_TRANSA");
  set_desc(d, CUBLASLT_MATMUL_DESC_TRANSB, op(g.trans_a), "CUBLASLT_MATMUL_DESC_TRANSB");
  set_desc(d, CUBLASLT_MATMUL_DESC_EPILOGUE, lt_epilogue(g.epilogue),
           "CUBLASLT_MATMUL_DESC_EPILOGUE");
  if (g.bias != nullptr) {
    set_desc(d, CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.bias, "CUBLASLT_MATMUL_DESC_BIAS_POINTER");
    const cudaDataType_t bias_type = g.ctype();
    set_desc(d, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, bias_type,
             "CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE");
  }
  if (g.epilogue == Epilogue::GeluAuxBias || g.epilogue == Epilogue::DGelu) {
    // aux is (m, n) row-major, column-major (n x m) as D is; its type is
    // D's (cuBLASLt's default for a GELU input), its leading dimension in
    // elements.
    set_desc(d, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, g.aux,
             "CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER");
    set_desc(d, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, g.ldaux,
             "CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD");
  }
  // As stored, before op(): our B is (n x k) column-major, (k x n) when
  // transposed; our A (k x m), (m x k) when transposed; C (n x m).
  const auto lb = lt_layout(g.type, g.trans_b ? g.k : g.n, g.trans_b ? g.n : g.k, g.ldb);
  const auto la = lt_layout(g.type, g.trans_a ? g.m : g.k, g.trans_a ? g.k : g.m, g.lda);
  const auto lc = lt_layout(g.ctype(), g.n, g.m, g.ldc);
  const uint64_t workspace = Context::cublas_lt_workspace_bytes();

  const AlgoKey key{ctx.device(), g.compute, g.type, g.trans_a, g.trans_b, g.m, g.n, g.k,
                    g.lda, g.ldb, g.ldc, alignment_of(g.a), alignment_of(g.b),
                    alignment_of(g.c), g.epilogue, g.ldaux,
                    g.aux != nullptr ? alignment_of(g.aux) : 0, g.ctype(),
                    g.bias != nullptr ? alignment_of(g.bias) : 0};
  std::optional<AlgoChoice> choice = algo_cache().find(key);
  if (!choice) {
    cublasLtMatmulPreference_t p = nullptr;
    lt_check(cublasLtMatmulPreferenceCreate(&p), "cublasLtMatmulPreferenceCreate");
    const LtOwned<cublasLtMatmulPreference_t> pref(p, cublasLtMatmulPreferenceDestroy);
    set_pref(p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, workspace,
             "CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES");
    set_pref(p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align_b,
             "CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES");
    set_pref(p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align_a,
             "CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES");
    set_pref(p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align_c,
             "CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES");
    set_pref(p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align_c,
             "CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES");
    cublasLtMatmulHeuristicResult_t best{};
    int found = 0;
    const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(h, d, lb.get(), la.get(), lc.get(),
                                                            lc.get(), p, 1, &best, &found);
    if (hs == CUBLAS_STATUS_NOT_SUPPORTED || (hs == CUBLAS_STATUS_SUCCESS && found == 0)) {
      choice = AlgoChoice{std::nullopt,
                          fmt::format("cublasLtMatmulAlgoGetHeuristic: {}, {} algorithms",
                                      cublasGetStatusName(hs), found)};
    } else {
      lt_check(hs, "cublasLtMatmulAlgoGetHeuristic");
      lt_check(best.state, "cublasLtMatmulAlgoGetHeuristic (its algorithm's state)");
      choice = AlgoChoice{best.algo, {}};
    }
    algo_cache().put(key, *choice);
  }
  if (!choice->algo) return choice->why;

  // D = 1 * op(A) op(B) + beta C, then the epilogue: C is D, and with beta
  // 0 (every epilogue but BGradB) it is not read.
  const float alpha = 1.0f, beta = g.beta;
  const cublasStatus_t ms =
      cublasLtMatmul(h, d, &alpha, g.b, lb.get(), g.a, la.get(), &beta, g.c, lc.get(), g.c,
                     lc.get(), &*choice->algo, ctx.cublas_lt_workspace(), workspace,
                     ctx.compute_stream());
  if (ms == CUBLAS_STATUS_NOT_SUPPORTED) {
    std::string why = fmt::format("cublasLtMatmul refused its algorithm: {}",
                                  cublasGetStatusName(ms));
    algo_cache().put(key, AlgoChoice{std::nullopt, why});
    return why;
  }
  lt_check(ms, "cublasLtMatmul");
  return std::nullopt;
}

// Every row of C (m rows, ldc apart) = bias (n elements of g.elem bytes):
// the bias copied into row 0, then rows [0, r) into [r, 2r) until all m are
// filled (log2 m copies, no kernel). The bias already has C's type, so this
// is exactly what zero + add_bias (fp32) or fill_rows (bf16) would write.
void fill_bias_rows(Context& ctx, const BiasGemm& g) {
  cudaStream_t s = ctx.compute_stream();
  const size_t width = static_cast<size_t>(g.n) * g.elem;
  const size_t pitch = static_cast<size_t>(g.ldc) * g.elem;
  auto* c = static_cast<char*>(g.c);
  WEFT_CUDA_CHECK(cudaMemcpyAsync(c, g.bias, width, cudaMemcpyDeviceToDevice, s));
  for (int64_t done = 1; done < g.m; done *= 2) {
    const auto rows = static_cast<size_t>(std::min(done, g.m - done));
    WEFT_CUDA_CHECK(cudaMemcpy2DAsync(c + static_cast<size_t>(done) * pitch, pitch, c, pitch, width,
                                      rows, cudaMemcpyDeviceToDevice, s));
  }
}

// The bias GEMM, on cuBLASLt where it can; else the bias rows, then the
// plain GEMM (beta 1) onto them.
void bias_gemm(Context& ctx, const BiasGemm& g, const char* name) {
  check(g.m >= 0 && g.n >= 0 && g.k >= 0, "{}: m, n, k ({}, {}, {}) must not be negative", name,
        g.m, g.n, g.k);
  if (g.m == 0 || g.n == 0) return;
  check(g.ldc >= g.n, "{}: ldc ({}) is less than n ({}): rows of C would overlap", name, g.ldc,
        g.n);
  ctx.make_current();
  if (g.k > 0) {
    const std::optional<std::string> why = lt_bias_gemm(ctx, g);
    if (!why) return;
    if (ctx.count_bias_epilogue_fallback() == 0)
      fmt::print(stderr,
                 "weft: cuBLASLt has no bias-epilogue algorithm for {} ({} math, m {}, n {}, k {}, "
                 "trans_a {}, trans_b {}, lda {}, ldb {}, ldc {}) ({}); adding the bias "
                 "separately\n",
                 name, g.math, g.m, g.n, g.k, g.trans_a, g.trans_b, g.lda, g.ldb, g.ldc, *why);
  }
  if (g.k > 0 && g.ctype() == CUDA_R_16BF) {
    // The fp32 product, then bf16(product + bias), rounded once: cuBLAS's
    // own beta-1 accumulation into bf16 C rounds the product first.
    const DeviceBuffer<float> prod(ctx, g.m * g.n);
    gemm_any(ctx, g.compute, g.type, CUDA_R_32F, g.trans_a, g.trans_b, g.m, g.n, g.k, 1.0f, g.a,
             g.lda, 0, g.b, g.ldb, 0, 0.0f, prod.data(), g.n, 0, 1);
    add_bias_bf16(ctx, prod.data(), static_cast<const bf16*>(g.bias), static_cast<bf16*>(g.c), g.m,
                  g.n, g.ldc);
    return;
  }
  fill_bias_rows(ctx, g);
  if (g.k == 0) return;  // C = the bias rows
  gemm_any(ctx, g.compute, g.type, g.type, g.trans_a, g.trans_b, g.m, g.n, g.k, 1.0f, g.a, g.lda,
           0, g.b, g.ldb, 0, 1.0f, g.c, g.ldc, 0, 1);
}

// A GELU epilogue GEMM (g.epilogue GeluAuxBias or DGelu; C and aux
// contiguous (m, n)), on cuBLASLt where it can; else the GEMM (with its bias
// rows, into aux, for GeluAuxBias) and then the GELU kernel, which compute
// the same up to where the product is rounded: there aux (or C) is rounded
// to C's type before GELU reads it, in the epilogue the fp32 product is.
void gelu_gemm(Context& ctx, const BiasGemm& g, const char* name) {
  check(g.m >= 0 && g.n >= 0 && g.k >= 0, "{}: m, n, k ({}, {}, {}) must not be negative", name,
        g.m, g.n, g.k);
  check(g.ldc == g.n && g.ldaux == g.n,
        "{}: C's and the GELU input's row strides ({}, {}) must be n ({})", name, g.ldc, g.ldaux,
        g.n);
  if (g.m == 0 || g.n == 0) return;
  ctx.make_current();
  if (g.k > 0) {
    const std::optional<std::string> why = lt_bias_gemm(ctx, g);
    if (!why) return;
    if (ctx.count_gelu_epilogue_fallback() == 0)
      fmt::print(stderr,
                 "weft: cuBLASLt has no GELU-epilogue algorithm for {} ({} math, m {}, n {}, k {}, "
                 "trans_a {}, trans_b {}, lda {}, ldb {}) ({}); running GELU separately\n",
                 name, g.math, g.m, g.n, g.k, g.trans_a, g.trans_b, g.lda, g.ldb, *why);
  }
  const int64_t count = g.m * g.n;
  if (g.epilogue == Epilogue::GeluAuxBias) {
    BiasGemm pre = g;  // aux = op(A) op(B) + bias
    pre.epilogue = Epilogue::Bias;
    pre.c = g.aux;
    pre.aux = nullptr;
    pre.ldaux = 0;
    bias_gemm(ctx, pre, name);
    gelu_forward(ctx, static_cast<const bf16*>(g.aux), static_cast<bf16*>(g.c), count);
    return;
  }
  // The fp32 product rounded to bf16 once (to_bf16), then gelu' times it.
  const DeviceBuffer<float> prod(ctx, count);
  gemm_any(ctx, g.compute, g.type, CUDA_R_32F, g.trans_a, g.trans_b, g.m, g.n, g.k, 1.0f, g.a,
           g.lda, 0, g.b, g.ldb, 0, 0.0f, prod.data(), g.n, 0, 1);
  auto* c = static_cast<bf16*>(g.c);
  to_bf16(ctx, prod.data(), c, count);
  gelu_backward(ctx, c, static_cast<const bf16*>(g.aux), c, count, false);
}

}  // namespace

void gemm_bias_gelu_bf16(Context& ctx, bool trans_a, bool trans_b, int64_t m, int64_t n,
                         int64_t k, const bf16* a, int64_t lda, const bf16* b, int64_t ldb,
                         const bf16* bias, bf16* pre, bf16* c) {
  gelu_gemm(ctx,
            {"bf16", CUBLAS_COMPUTE_32F, CUDA_R_16BF, sizeof(bf16), trans_a, trans_b, m, n, k, a,
             lda, b, ldb, bias, c, n, Epilogue::GeluAuxBias, pre, n},
            "gemm_bias_gelu_bf16");
}

void gemm_dgelu_bf16(Context& ctx, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                     const bf16* a, int64_t lda, const bf16* b, int64_t ldb, const bf16* pre,
                     bf16* c) {
  gelu_gemm(ctx,
            {"bf16", CUBLAS_COMPUTE_32F, CUDA_R_16BF, sizeof(bf16), trans_a, trans_b, m, n, k, a,
             lda, b, ldb, nullptr, c, n, Epilogue::DGelu, const_cast<bf16*>(pre), n},
            "gemm_dgelu_bf16");
}

bool gemm_bf16_bias_grad(Context& ctx, bool trans_a, int64_t m, int64_t n, int64_t k,
                         const bf16* a, int64_t lda, const bf16* b, int64_t ldb, float beta,
                         float* c, int64_t ldc, float* db) {
  const char* name = "gemm_bf16_bias_grad";
  check(m >= 0 && n >= 0 && k >= 0, "{}: m, n, k ({}, {}, {}) must not be negative", name, m, n,
        k);
  check(ldc >= n, "{}: ldc ({}) is less than n ({}): rows of C would overlap", name, ldc, n);
  if (m == 0 || n == 0 || k == 0) return false;  // the plain calls handle these
  ctx.make_current();
  BiasGemm g{"bf16", CUBLAS_COMPUTE_32F, CUDA_R_16BF, sizeof(bf16), trans_a, false, m, n, k, a,
             lda, b, ldb, db, c, ldc, Epilogue::BGradB, nullptr, 0, CUDA_R_32F, beta};
  const std::optional<std::string> why = lt_bias_gemm(ctx, g);
  if (!why) return true;
  if (ctx.count_bias_grad_epilogue_fallback() == 0)
    fmt::print(stderr,
               "weft: cuBLASLt has no bias-gradient-epilogue algorithm for {} (m {}, n {}, k {}, "
               "trans_a {}, lda {}, ldb {}, ldc {}) ({}); summing the bias gradient separately\n",
               name, m, n, k, trans_a, lda, ldb, ldc, *why);
  return false;
}

void gemm_bias(Context& ctx, MathMode mode, bool trans_a, bool trans_b, int64_t m, int64_t n,
               int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb,
               const float* bias, float* c, int64_t ldc) {
  std::optional<Rounded16> r;
  if (narrows(mode) && m > 0 && n > 0 && k > 0) {
    r.emplace(ctx, mode, trans_a, trans_b, m, n, k, a, lda, 0, b, ldb, 0, 1);
    a = r->a.data();
    b = r->b.data();
  }
  bias_gemm(ctx,
            {math_mode_name(mode), compute_type(mode), CUDA_R_32F, sizeof(float), trans_a, trans_b,
             m, n, k, a, lda, b, ldb, bias, c, ldc},
            "gemm_bias");
}

void gemm_bias_bf16(Context& ctx, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                    const bf16* a, int64_t lda, const bf16* b, int64_t ldb, const bf16* bias,
                    bf16* c, int64_t ldc) {
  bias_gemm(ctx,
            {"bf16", CUBLAS_COMPUTE_32F, CUDA_R_16BF, sizeof(bf16), trans_a, trans_b, m, n, k, a,
             lda, b, ldb, bias, c, ldc},
            "gemm_bias_bf16");
}

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
