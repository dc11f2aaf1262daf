// GPU emulator (tests/cuda_emu): cuBLAS's and cuBLASLt's GEMMs, as weft calls
// them, on the CPU. Written for weft from the libraries' documented
// behaviour; no NVIDIA code.
//
// Every GEMM is column-major as cuBLAS documents it: C (m x n) = alpha op(A)
// op(B) + beta C, op(A) m x k, op(B) k x n, ld* the column strides in
// elements; beta 0 means C is not read. The operands are read (and, for the
// FAST compute types, rounded: TF32 to 10 mantissa bits, nearest with ties
// away from zero; bf16 and fp16 to nearest even) into dense double buffers,
// every element's k products are summed in order in double (a product of
// two fp32 values is exact in double), and each result is rounded once to
// its output type. A GEMM is checked at the call and queued on its stream
// (the handle's, or cublasLtMatmul's), with the scalars and descriptors as
// they were at the call (streams.h); workspaces are accepted and ignored.
// There is no shared mutable state: each handle and descriptor is its own
// object.
#include <cublasLt.h>
#include <cublas_v2.h>

#include "streams.h"

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <vector>

struct cublasContext {
  cudaStream_t stream = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

struct cublasLtContext {
  int unused = 0;
};

struct cublasLtMatmulDescOpaque_t {
  cublasComputeType_t compute;
  cudaDataType_t scale_type;
  int32_t pointer_mode = CUBLASLT_POINTER_MODE_HOST;
  int32_t transa = CUBLAS_OP_N, transb = CUBLAS_OP_N, transc = CUBLAS_OP_N;
  int32_t fill_mode = 0;
  uint32_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;
  int64_t bias_batch_stride = 0;
  void* aux = nullptr;
  int64_t aux_ld = 0;
  int64_t aux_batch_stride = 0;
  int32_t aux_type = -1;   // -1: D's type
  int32_t bias_type = -1;  // -1: D's type
};

struct cublasLtMatrixLayoutOpaque_t {
  uint32_t type;
  int32_t order = CUBLASLT_ORDER_COL;
  uint64_t rows, cols;
  int64_t ld;
  int32_t batch_count = 1;
  int64_t batch_offset = 0;
};

struct cublasLtMatmulPreferenceOpaque_t {
  uint32_t search_mode = 0;
  uint64_t max_workspace = 0;
  uint32_t align_a = 256, align_b = 256, align_c = 256, align_d = 256;
};

namespace {

// The algorithm the heuristic returns carries this in data[0]; cublasLtMatmul
// refuses any other (uninitialised or foreign) algorithm.
constexpr uint64_t kAlgoMagic = 0x7765667445'6d75ull;

// ------------------------------------------------------------ number formats

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

float bf16_to_float(uint16_t b) { return float_of(static_cast<uint32_t>(b) << 16); }

// Round to nearest even; NaN stays a (quiet) NaN.
uint16_t float_to_bf16(float f) {
  uint32_t u = bits_of(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// A double rounded to fp32 toward zero with the last bit set where inexact
// (round to odd): rounding that to bf16 (nearest even) is then the same as
// rounding the double to bf16 directly, with no double rounding.
float to_float_round_odd(double d) {
  if (!std::isfinite(d) || d == 0.0) return static_cast<float>(d);
  float f = static_cast<float>(d);
  if (static_cast<double>(f) == d) return f;
  if (std::fabs(static_cast<double>(f)) > std::fabs(d)) f = std::nextafter(f, 0.0f);
  return float_of(bits_of(f) | 1u);
}

uint16_t double_to_bf16(double d) {
  if (std::isnan(d)) return 0x7fc0u;
  return float_to_bf16(to_float_round_odd(d));
}

// fp32 operand roundings of the FAST compute types.
float round_tf32(float f) {  // 10 mantissa bits, nearest, ties away from zero
  uint32_t u = bits_of(f);
  if ((u & 0x7f800000u) == 0x7f800000u) return f;  // inf, NaN
  u += 0x1000u;
  u &= 0xffffe000u;
  return float_of(u);
}

float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

float round_fp16(float f) {  // nearest even, with fp16's range and subnormals
  if (std::isnan(f) || std::isinf(f)) return f;
  const float a = std::fabs(f);
  if (a >= 65520.0f) return std::copysign(std::numeric_limits<float>::infinity(), f);
  if (a < 0x1p-14f) return std::nearbyint(f * 0x1p24f) * 0x1p-24f;  // subnormal: steps of 2^-24
  uint32_t u = bits_of(f);
  u += 0xfffu + ((u >> 13) & 1u);
  u &= 0xffffe000u;
  return float_of(u);
}

enum class Rounding { None, Tf32, Bf16, Fp16 };

// The operand rounding of a compute type whose scale type is fp32; false
// where the emulator does not support the compute type.
bool rounding_of(cublasComputeType_t compute, Rounding* r) {
  switch (compute) {
    case CUBLAS_COMPUTE_32F:
    case CUBLAS_COMPUTE_32F_PEDANTIC: *r = Rounding::None; return true;
    case CUBLAS_COMPUTE_32F_FAST_TF32: *r = Rounding::Tf32; return true;
    case CUBLAS_COMPUTE_32F_FAST_16BF: *r = Rounding::Bf16; return true;
    case CUBLAS_COMPUTE_32F_FAST_16F: *r = Rounding::Fp16; return true;
    default: return false;
  }
}

bool is_fast(cublasComputeType_t compute) {
  return compute == CUBLAS_COMPUTE_32F_FAST_TF32 || compute == CUBLAS_COMPUTE_32F_FAST_16BF ||
         compute == CUBLAS_COMPUTE_32F_FAST_16F;
}

// The (A and B type, C type) pairs of the 32F compute types that the emulator
// runs: fp32 everywhere (every 32F compute type), or bf16 A and B with bf16
// or fp32 C (CUBLAS_COMPUTE_32F only, as cuBLAS).
bool types_supported(cublasComputeType_t compute, int ab, int c) {
  if (ab == CUDA_R_32F && c == CUDA_R_32F) return true;
  if (is_fast(compute)) return false;
  return ab == CUDA_R_16BF && (c == CUDA_R_16BF || c == CUDA_R_32F);
}

bool is_storage_type(int t) { return t == CUDA_R_32F || t == CUDA_R_16BF; }

size_t type_size(int t) { return t == CUDA_R_32F ? 4 : 2; }

// Element idx of an array of type t (fp32 or bf16), widened.
double load(const void* base, int t, int64_t idx) {
  const char* p = static_cast<const char*>(base) + idx * static_cast<int64_t>(type_size(t));
  if (t == CUDA_R_32F) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  uint16_t b;
  std::memcpy(&b, p, 2);
  return bf16_to_float(b);
}

// v rounded once (to nearest even) to type t, stored at element idx.
void store(void* base, int t, int64_t idx, double v) {
  char* p = static_cast<char*>(base) + idx * static_cast<int64_t>(type_size(t));
  if (t == CUDA_R_32F) {
    const float f = static_cast<float>(v);
    std::memcpy(p, &f, 4);
  } else {
    const uint16_t b = double_to_bf16(v);
    std::memcpy(p, &b, 2);
  }
}

float apply(Rounding r, float f) {
  switch (r) {
    case Rounding::None: return f;
    case Rounding::Tf32: return round_tf32(f);
    case Rounding::Bf16: return round_bf16(f);
    case Rounding::Fp16: return round_fp16(f);
  }
  return f;
}

// ------------------------------------------------------------ the product

// One operand as `rows` dense rows of `depth` doubles: out[r * depth + l].
// With depth_contiguous, element (r, l) is x[l + r * ld], else x[r + l * ld]:
// op(A) (m x k) packs with depth_contiguous = transa; op(B)'s columns (n rows
// of k) with depth_contiguous = !transb.
void pack(const void* x, int t, int64_t ld, int64_t rows, int64_t depth, bool depth_contiguous,
          Rounding r, std::vector<double>& out) {
  out.assign(static_cast<size_t>(rows * depth), 0.0);
  if (depth_contiguous) {
    for (int64_t row = 0; row < rows; ++row)
      for (int64_t l = 0; l < depth; ++l)
        out[static_cast<size_t>(row * depth + l)] =
            apply(r, static_cast<float>(load(x, t, l + row * ld)));
  } else {
    for (int64_t l = 0; l < depth; ++l)
      for (int64_t row = 0; row < rows; ++row)
        out[static_cast<size_t>(row * depth + l)] =
            apply(r, static_cast<float>(load(x, t, row + l * ld)));
  }
}

// p (m x n, column-major, p[i + j m]) = a (m rows of k) times b (n rows of k)
// transposed; each element summed over l in order, in double. Two rows by
// four columns at a time (independent sums, for the CPU's pipelines).
void product(const std::vector<double>& av, const std::vector<double>& bv, int64_t m, int64_t n,
             int64_t k, std::vector<double>& p) {
  p.assign(static_cast<size_t>(m * n), 0.0);
  const double* a = av.data();
  const double* b = bv.data();
  int64_t i = 0;
  for (; i + 2 <= m; i += 2) {
    const double* a0 = a + i * k;
    const double* a1 = a0 + k;
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
      const double* b0 = b + j * k;
      const double* b1 = b0 + k;
      const double* b2 = b1 + k;
      const double* b3 = b2 + k;
      double s00 = 0, s01 = 0, s02 = 0, s03 = 0, s10 = 0, s11 = 0, s12 = 0, s13 = 0;
      for (int64_t l = 0; l < k; ++l) {
        const double x0 = a0[l], x1 = a1[l];
        const double y0 = b0[l], y1 = b1[l], y2 = b2[l], y3 = b3[l];
        s00 += x0 * y0, s01 += x0 * y1, s02 += x0 * y2, s03 += x0 * y3;
        s10 += x1 * y0, s11 += x1 * y1, s12 += x1 * y2, s13 += x1 * y3;
      }
      p[static_cast<size_t>(i + j * m)] = s00, p[static_cast<size_t>(i + 1 + j * m)] = s10;
      p[static_cast<size_t>(i + (j + 1) * m)] = s01;
      p[static_cast<size_t>(i + 1 + (j + 1) * m)] = s11;
      p[static_cast<size_t>(i + (j + 2) * m)] = s02;
      p[static_cast<size_t>(i + 1 + (j + 2) * m)] = s12;
      p[static_cast<size_t>(i + (j + 3) * m)] = s03;
      p[static_cast<size_t>(i + 1 + (j + 3) * m)] = s13;
    }
    for (; j < n; ++j) {
      const double* b0 = b + j * k;
      double s0 = 0, s1 = 0;
      for (int64_t l = 0; l < k; ++l) s0 += a0[l] * b0[l], s1 += a1[l] * b0[l];
      p[static_cast<size_t>(i + j * m)] = s0, p[static_cast<size_t>(i + 1 + j * m)] = s1;
    }
  }
  for (; i < m; ++i) {
    const double* a0 = a + i * k;
    for (int64_t j = 0; j < n; ++j) {
      const double* b0 = b + j * k;
      double s = 0;
      for (int64_t l = 0; l < k; ++l) s += a0[l] * b0[l];
      p[static_cast<size_t>(i + j * m)] = s;
    }
  }
}

// The product op(A) op(B) (m x n, column-major), zero where alpha is 0 (then
// A and B are not read, as in cuBLAS) or k is 0.
bool compute_product(bool transa, bool transb, int64_t m, int64_t n, int64_t k, float alpha,
                     const void* a, int at, int64_t lda, const void* b, int bt, int64_t ldb,
                     Rounding r, std::vector<double>& p) {
  if (alpha == 0.0f || k == 0) {
    p.assign(static_cast<size_t>(m * n), 0.0);
    return true;
  }
  try {
    std::vector<double> av, bv;
    pack(a, at, lda, m, k, transa, r, av);
    pack(b, bt, ldb, n, k, !transb, r, bv);
    product(av, bv, m, n, k, p);
  } catch (const std::bad_alloc&) {
    return false;
  }
  return true;
}

bool valid_op(int op) { return op == CUBLAS_OP_N || op == CUBLAS_OP_T || op == CUBLAS_OP_C; }

// ------------------------------------------------------------ GELU (tanh form)

constexpr double kSqrt2OverPi = 0.79788456080286535588;
constexpr double kGeluCoeff = 0.044715;

double gelu(double x) {
  return 0.5 * x * (1.0 + std::tanh(kSqrt2OverPi * (x + kGeluCoeff * x * x * x)));
}

double gelu_grad(double x) {
  const double t = std::tanh(kSqrt2OverPi * (x + kGeluCoeff * x * x * x));
  return 0.5 * (1.0 + t) +
         0.5 * x * (1.0 - t * t) * kSqrt2OverPi * (1.0 + 3.0 * kGeluCoeff * x * x);
}

// ------------------------------------------------------------ cuBLAS's GEMMs

cublasStatus_t gemm_batched(cublasHandle_t handle, cublasOperation_t transa,
                            cublasOperation_t transb, int m, int n, int k, const void* alpha,
                            const void* A, cudaDataType Atype, int lda, long long strideA,
                            const void* B, cudaDataType Btype, int ldb, long long strideB,
                            const void* beta, void* C, cudaDataType Ctype, int ldc,
                            long long strideC, int batch, cublasComputeType_t compute) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!valid_op(transa) || !valid_op(transb)) return CUBLAS_STATUS_INVALID_VALUE;
  if (m < 0 || n < 0 || k < 0 || batch < 0) return CUBLAS_STATUS_INVALID_VALUE;
  const bool ta = transa != CUBLAS_OP_N, tb = transb != CUBLAS_OP_N;
  const int a_rows = ta ? k : m, b_rows = tb ? n : k;
  if (lda < (a_rows > 1 ? a_rows : 1) || ldb < (b_rows > 1 ? b_rows : 1) ||
      ldc < (m > 1 ? m : 1))
    return CUBLAS_STATUS_INVALID_VALUE;
  Rounding r;
  if (!rounding_of(compute, &r)) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (Atype != Btype || !types_supported(compute, Atype, Ctype))
    return CUBLAS_STATUS_NOT_SUPPORTED;
  if (m == 0 || n == 0 || batch == 0) return CUBLAS_STATUS_SUCCESS;
  if (alpha == nullptr || beta == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  const float al = *static_cast<const float*>(alpha), be = *static_cast<const float*>(beta);
  if (!weft_emu::count(weft_emu::Work::gemm)) return CUBLAS_STATUS_SUCCESS;
  weft_emu::enqueue(handle->stream, [=] {
    std::vector<double> p;
    for (int bi = 0; bi < batch; ++bi) {
      const void* a =
          static_cast<const char*>(A) + bi * strideA * static_cast<long long>(type_size(Atype));
      const void* b =
          static_cast<const char*>(B) + bi * strideB * static_cast<long long>(type_size(Btype));
      void* c = static_cast<char*>(C) + bi * strideC * static_cast<long long>(type_size(Ctype));
      if (!compute_product(ta, tb, m, n, k, al, a, Atype, lda, b, Btype, ldb, r, p))
        weft_emu::fail("out of host memory for a GEMM's product");
      for (int64_t j = 0; j < n; ++j)
        for (int64_t i = 0; i < m; ++i) {
          const int64_t at = i + j * ldc;
          double v = static_cast<double>(al) * p[static_cast<size_t>(i + j * m)];
          if (be != 0.0f) v += static_cast<double>(be) * load(c, Ctype, at);
          store(c, Ctype, at, v);
        }
    }
  });
  return CUBLAS_STATUS_SUCCESS;
}

// ------------------------------------------------------------ cuBLASLt

template <typename T>
cublasStatus_t set(T* field, const void* buf, size_t size) {
  if (buf == nullptr || size != sizeof(T)) return CUBLAS_STATUS_INVALID_VALUE;
  std::memcpy(field, buf, sizeof(T));
  return CUBLAS_STATUS_SUCCESS;
}

bool is_known_epilogue(uint32_t e) {
  switch (e) {
    case CUBLASLT_EPILOGUE_DEFAULT:
    case CUBLASLT_EPILOGUE_RELU:
    case CUBLASLT_EPILOGUE_RELU_AUX:
    case CUBLASLT_EPILOGUE_BIAS:
    case CUBLASLT_EPILOGUE_RELU_BIAS:
    case CUBLASLT_EPILOGUE_RELU_AUX_BIAS:
    case CUBLASLT_EPILOGUE_DRELU:
    case CUBLASLT_EPILOGUE_DRELU_BGRAD:
    case CUBLASLT_EPILOGUE_GELU:
    case CUBLASLT_EPILOGUE_GELU_AUX:
    case CUBLASLT_EPILOGUE_GELU_BIAS:
    case CUBLASLT_EPILOGUE_GELU_AUX_BIAS:
    case CUBLASLT_EPILOGUE_DGELU:
    case CUBLASLT_EPILOGUE_DGELU_BGRAD:
    case CUBLASLT_EPILOGUE_BGRADA:
    case CUBLASLT_EPILOGUE_BGRADB: return true;
    default: return false;
  }
}

// The epilogues the emulator runs (the ReLU bit-mask ones it does not).
bool is_emulated_epilogue(uint32_t e) {
  switch (e) {
    case CUBLASLT_EPILOGUE_DEFAULT:
    case CUBLASLT_EPILOGUE_RELU:
    case CUBLASLT_EPILOGUE_BIAS:
    case CUBLASLT_EPILOGUE_RELU_BIAS:
    case CUBLASLT_EPILOGUE_GELU:
    case CUBLASLT_EPILOGUE_GELU_AUX:
    case CUBLASLT_EPILOGUE_GELU_BIAS:
    case CUBLASLT_EPILOGUE_GELU_AUX_BIAS:
    case CUBLASLT_EPILOGUE_DGELU:
    case CUBLASLT_EPILOGUE_DGELU_BGRAD:
    case CUBLASLT_EPILOGUE_BGRADA:
    case CUBLASLT_EPILOGUE_BGRADB: return true;
    default: return false;
  }
}

bool adds_bias(uint32_t e) {
  return e == CUBLASLT_EPILOGUE_BIAS || e == CUBLASLT_EPILOGUE_RELU_BIAS ||
         e == CUBLASLT_EPILOGUE_GELU_BIAS || e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
}
bool writes_bias_grad(uint32_t e) {
  return e == CUBLASLT_EPILOGUE_BGRADA || e == CUBLASLT_EPILOGUE_BGRADB ||
         e == CUBLASLT_EPILOGUE_DGELU_BGRAD;
}
bool uses_gelu_aux(uint32_t e) {
  return e == CUBLASLT_EPILOGUE_GELU_AUX || e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS ||
         e == CUBLASLT_EPILOGUE_DGELU || e == CUBLASLT_EPILOGUE_DGELU_BGRAD;
}

// What one cuBLASLt matmul computes, checked (shared by the heuristic and
// the matmul itself).
struct LtProblem {
  bool ta, tb;
  int64_t m, n, k;
  int ab_type, c_type;
  int bias_type, aux_type;
  Rounding rounding;
};

cublasStatus_t check_lt(cublasLtMatmulDesc_t d, cublasLtMatrixLayout_t a,
                        cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c,
                        cublasLtMatrixLayout_t dd, LtProblem* out) {
  if (d == nullptr || a == nullptr || b == nullptr || c == nullptr || dd == nullptr)
    return CUBLAS_STATUS_INVALID_VALUE;
  if (!valid_op(d->transa) || !valid_op(d->transb)) return CUBLAS_STATUS_INVALID_VALUE;
  if (d->transc != CUBLAS_OP_N) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (d->scale_type != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
  LtProblem p{};
  if (!rounding_of(d->compute, &p.rounding)) return CUBLAS_STATUS_NOT_SUPPORTED;
  for (cublasLtMatrixLayout_t l : {a, b, c, dd}) {
    if (l->order != CUBLASLT_ORDER_COL || l->batch_count != 1) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (l->ld < static_cast<int64_t>(l->rows > 1 ? l->rows : 1)) return CUBLAS_STATUS_INVALID_VALUE;
  }
  p.ta = d->transa != CUBLAS_OP_N;
  p.tb = d->transb != CUBLAS_OP_N;
  p.m = static_cast<int64_t>(p.ta ? a->cols : a->rows);
  p.k = static_cast<int64_t>(p.ta ? a->rows : a->cols);
  const auto kb = static_cast<int64_t>(p.tb ? b->cols : b->rows);
  p.n = static_cast<int64_t>(p.tb ? b->rows : b->cols);
  if (kb != p.k || static_cast<int64_t>(c->rows) != p.m || static_cast<int64_t>(c->cols) != p.n ||
      dd->rows != c->rows || dd->cols != c->cols)
    return CUBLAS_STATUS_INVALID_VALUE;
  if (a->type != b->type || c->type != dd->type) return CUBLAS_STATUS_NOT_SUPPORTED;
  p.ab_type = static_cast<int>(a->type);
  p.c_type = static_cast<int>(dd->type);
  if (!types_supported(d->compute, p.ab_type, p.c_type)) return CUBLAS_STATUS_NOT_SUPPORTED;

  const uint32_t e = d->epilogue;
  if (!is_known_epilogue(e)) return CUBLAS_STATUS_INVALID_VALUE;
  if (!is_emulated_epilogue(e)) return CUBLAS_STATUS_NOT_SUPPORTED;
  p.bias_type = d->bias_type < 0 ? p.c_type : d->bias_type;
  p.aux_type = d->aux_type < 0 ? p.c_type : d->aux_type;
  if (adds_bias(e) || writes_bias_grad(e)) {
    if (d->bias == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
    if (!is_storage_type(p.bias_type)) return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (uses_gelu_aux(e)) {
    if (d->aux == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
    if (!is_storage_type(p.aux_type)) return CUBLAS_STATUS_NOT_SUPPORTED;
    // cuBLASLt: the GELU input's leading dimension is divisible by 8 and at
    // least D's rows.
    if (d->aux_ld % 8 != 0 || d->aux_ld < p.m) return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  *out = p;
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace

// ============================================================ cuBLAS

cublasStatus_t cublasCreate(cublasHandle_t* handle) {
  if (handle == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *handle = new (std::nothrow) cublasContext();
  return *handle == nullptr ? CUBLAS_STATUS_ALLOC_FAILED : CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy(cublasHandle_t handle) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t stream) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetStream(cublasHandle_t handle, cudaStream_t* stream) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (stream == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *stream = handle->stream;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetWorkspace(cublasHandle_t handle, void* workspace,
                                  size_t workspaceSizeInBytes) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (workspace == nullptr && workspaceSizeInBytes != 0) return CUBLAS_STATUS_INVALID_VALUE;
  handle->workspace = workspace;
  handle->workspace_bytes = workspaceSizeInBytes;
  return CUBLAS_STATUS_SUCCESS;
}

const char* cublasGetStatusName(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
  }
  return "CUBLAS_STATUS_UNKNOWN";
}

const char* cublasGetStatusString(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS: return "success";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "the library was not initialized";
    case CUBLAS_STATUS_ALLOC_FAILED: return "the resource allocation failed";
    case CUBLAS_STATUS_INVALID_VALUE: return "an invalid value was used as an argument";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "an absent device architectural feature is required";
    case CUBLAS_STATUS_MAPPING_ERROR: return "an access to GPU memory space failed";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "the GPU program failed to execute";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "an internal operation failed";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "the functionality requested is not supported";
    case CUBLAS_STATUS_LICENSE_ERROR: return "error detected trying to check the license";
  }
  return "unknown error";
}

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa,
                            cublasOperation_t transb, int m, int n, int k, const void* alpha,
                            const void* A, cudaDataType Atype, int lda, const void* B,
                            cudaDataType Btype, int ldb, const void* beta, void* C,
                            cudaDataType Ctype, int ldc, cublasComputeType_t computeType,
                            cublasGemmAlgo_t /*algo*/) {
  return gemm_batched(handle, transa, transb, m, n, k, alpha, A, Atype, lda, 0, B, Btype, ldb, 0,
                      beta, C, Ctype, ldc, 0, 1, computeType);
}

cublasStatus_t cublasGemmStridedBatchedEx(
    cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
    int k, const void* alpha, const void* A, cudaDataType Atype, int lda, long long int strideA,
    const void* B, cudaDataType Btype, int ldb, long long int strideB, const void* beta, void* C,
    cudaDataType Ctype, int ldc, long long int strideC, int batchCount,
    cublasComputeType_t computeType, cublasGemmAlgo_t /*algo*/) {
  return gemm_batched(handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype,
                      ldb, strideB, beta, C, Ctype, ldc, strideC, batchCount, computeType);
}

// ============================================================ cuBLASLt

cublasStatus_t cublasLtCreate(cublasLtHandle_t* lightHandle) {
  if (lightHandle == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *lightHandle = new (std::nothrow) cublasLtContext();
  return *lightHandle == nullptr ? CUBLAS_STATUS_ALLOC_FAILED : CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtDestroy(cublasLtHandle_t lightHandle) {
  if (lightHandle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete lightHandle;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* matmulDesc,
                                        cublasComputeType_t computeType,
                                        cudaDataType_t scaleType) {
  if (matmulDesc == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  auto* d = new (std::nothrow) cublasLtMatmulDescOpaque_t();
  if (d == nullptr) return CUBLAS_STATUS_ALLOC_FAILED;
  d->compute = computeType;
  d->scale_type = scaleType;
  *matmulDesc = d;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t matmulDesc) {
  delete matmulDesc;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d,
                                              cublasLtMatmulDescAttributes_t attr,
                                              const void* buf, size_t size) {
  if (d == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  switch (attr) {
    case CUBLASLT_MATMUL_DESC_COMPUTE_TYPE: {
      int32_t v;
      const cublasStatus_t s = set(&v, buf, size);
      if (s == CUBLAS_STATUS_SUCCESS) d->compute = static_cast<cublasComputeType_t>(v);
      return s;
    }
    case CUBLASLT_MATMUL_DESC_SCALE_TYPE: {
      int32_t v;
      const cublasStatus_t s = set(&v, buf, size);
      if (s == CUBLAS_STATUS_SUCCESS) d->scale_type = static_cast<cudaDataType_t>(v);
      return s;
    }
    case CUBLASLT_MATMUL_DESC_POINTER_MODE: return set(&d->pointer_mode, buf, size);
    case CUBLASLT_MATMUL_DESC_TRANSA: return set(&d->transa, buf, size);
    case CUBLASLT_MATMUL_DESC_TRANSB: return set(&d->transb, buf, size);
    case CUBLASLT_MATMUL_DESC_TRANSC: return set(&d->transc, buf, size);
    case CUBLASLT_MATMUL_DESC_FILL_MODE: return set(&d->fill_mode, buf, size);
    case CUBLASLT_MATMUL_DESC_EPILOGUE: return set(&d->epilogue, buf, size);
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER: return set(&d->bias, buf, size);
    case CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE: return set(&d->bias_batch_stride, buf, size);
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER: return set(&d->aux, buf, size);
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD: return set(&d->aux_ld, buf, size);
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE:
      return set(&d->aux_batch_stride, buf, size);
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE: return set(&d->aux_type, buf, size);
    case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE: return set(&d->bias_type, buf, size);
  }
  return CUBLAS_STATUS_INVALID_VALUE;
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* matLayout, cudaDataType type,
                                          uint64_t rows, uint64_t cols, int64_t ld) {
  if (matLayout == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  auto* l = new (std::nothrow) cublasLtMatrixLayoutOpaque_t();
  if (l == nullptr) return CUBLAS_STATUS_ALLOC_FAILED;
  l->type = static_cast<uint32_t>(type);
  l->rows = rows;
  l->cols = cols;
  l->ld = ld;
  *matLayout = l;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t matLayout) {
  delete matLayout;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t l,
                                                cublasLtMatrixLayoutAttribute_t attr,
                                                const void* buf, size_t size) {
  if (l == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  switch (attr) {
    case CUBLASLT_MATRIX_LAYOUT_TYPE: return set(&l->type, buf, size);
    case CUBLASLT_MATRIX_LAYOUT_ORDER: return set(&l->order, buf, size);
    case CUBLASLT_MATRIX_LAYOUT_ROWS: return set(&l->rows, buf, size);
    case CUBLASLT_MATRIX_LAYOUT_COLS: return set(&l->cols, buf, size);
    case CUBLASLT_MATRIX_LAYOUT_LD: return set(&l->ld, buf, size);
    case CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT: return set(&l->batch_count, buf, size);
    case CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET: return set(&l->batch_offset, buf, size);
  }
  return CUBLAS_STATUS_INVALID_VALUE;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
  if (pref == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *pref = new (std::nothrow) cublasLtMatmulPreferenceOpaque_t();
  return *pref == nullptr ? CUBLAS_STATUS_ALLOC_FAILED : CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
  delete pref;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t attr,
                                                    const void* buf, size_t size) {
  if (p == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  switch (attr) {
    case CUBLASLT_MATMUL_PREF_SEARCH_MODE: return set(&p->search_mode, buf, size);
    case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES: return set(&p->max_workspace, buf, size);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES: return set(&p->align_a, buf, size);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES: return set(&p->align_b, buf, size);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES: return set(&p->align_c, buf, size);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES: return set(&p->align_d, buf, size);
  }
  return CUBLAS_STATUS_INVALID_VALUE;
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(
    cublasLtHandle_t lightHandle, cublasLtMatmulDesc_t operationDesc,
    cublasLtMatrixLayout_t Adesc, cublasLtMatrixLayout_t Bdesc, cublasLtMatrixLayout_t Cdesc,
    cublasLtMatrixLayout_t Ddesc, cublasLtMatmulPreference_t preference, int requestedAlgoCount,
    cublasLtMatmulHeuristicResult_t heuristicResultsArray[], int* returnAlgoCount) {
  if (lightHandle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (preference == nullptr || requestedAlgoCount < 1 || heuristicResultsArray == nullptr ||
      returnAlgoCount == nullptr)
    return CUBLAS_STATUS_INVALID_VALUE;
  *returnAlgoCount = 0;
  LtProblem p;
  const cublasStatus_t s = check_lt(operationDesc, Adesc, Bdesc, Cdesc, Ddesc, &p);
  if (s != CUBLAS_STATUS_SUCCESS) return s;
  // WEFT_EMU_NO_EPILOGUES=1: no algorithm for any epilogue but the default
  // and the bias (as a cuBLASLt without the fused ones would answer), so that
  // the callers' fallbacks run.
  if (const char* v = std::getenv("WEFT_EMU_NO_EPILOGUES"); v != nullptr && v[0] == '1' &&
      operationDesc->epilogue != CUBLASLT_EPILOGUE_DEFAULT &&
      operationDesc->epilogue != CUBLASLT_EPILOGUE_BIAS)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  cublasLtMatmulHeuristicResult_t r{};
  r.algo.data[0] = kAlgoMagic;
  r.workspaceSize = 0;
  r.state = CUBLAS_STATUS_SUCCESS;
  r.wavesCount = 1.0f;
  heuristicResultsArray[0] = r;
  *returnAlgoCount = 1;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t lightHandle, cublasLtMatmulDesc_t computeDesc,
                              const void* alpha, const void* A, cublasLtMatrixLayout_t Adesc,
                              const void* B, cublasLtMatrixLayout_t Bdesc, const void* beta,
                              const void* C, cublasLtMatrixLayout_t Cdesc, void* D,
                              cublasLtMatrixLayout_t Ddesc, const cublasLtMatmulAlgo_t* algo,
                              void* /*workspace*/, size_t /*workspaceSizeInBytes*/,
                              cudaStream_t stream) {
  if (lightHandle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  LtProblem p;
  const cublasStatus_t s = check_lt(computeDesc, Adesc, Bdesc, Cdesc, Ddesc, &p);
  if (s != CUBLAS_STATUS_SUCCESS) return s;
  if (algo != nullptr && algo->data[0] != kAlgoMagic) return CUBLAS_STATUS_INVALID_VALUE;
  if (alpha == nullptr || beta == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  if (p.m == 0 || p.n == 0) return CUBLAS_STATUS_SUCCESS;
  const float al = *static_cast<const float*>(alpha), be = *static_cast<const float*>(beta);
  if (!weft_emu::count(weft_emu::Work::gemm)) return CUBLAS_STATUS_SUCCESS;
  // The descriptors as they are now: the caller may change or destroy them
  // before the GEMM runs.
  weft_emu::enqueue(stream, [=, d = *computeDesc, a_ld = Adesc->ld, b_ld = Bdesc->ld,
                             ldc = Cdesc->ld, ldd = Ddesc->ld] {
    const uint32_t e = d.epilogue;

    std::vector<double> prod;
    if (!compute_product(p.ta, p.tb, p.m, p.n, p.k, al, A, p.ab_type, a_ld, B, p.ab_type,
                         b_ld, p.rounding, prod))
      weft_emu::fail("out of host memory for a GEMM's product");

    // The bias gradients of A and B: sums over k of op(A)'s rows (m of them)
    // and of op(B)'s columns (n), of the operands as stored.
    if (e == CUBLASLT_EPILOGUE_BGRADA) {
      for (int64_t i = 0; i < p.m; ++i) {
        double sum = 0;
        for (int64_t l = 0; l < p.k; ++l)
          sum += load(A, p.ab_type, p.ta ? l + i * a_ld : i + l * a_ld);
        store(const_cast<void*>(d.bias), p.bias_type, i, sum);
      }
    } else if (e == CUBLASLT_EPILOGUE_BGRADB) {
      for (int64_t j = 0; j < p.n; ++j) {
        double sum = 0;
        for (int64_t l = 0; l < p.k; ++l)
          sum += load(B, p.ab_type, p.tb ? j + l * b_ld : l + j * b_ld);
        store(const_cast<void*>(d.bias), p.bias_type, j, sum);
      }
    }

    const bool gelu_fwd = e == CUBLASLT_EPILOGUE_GELU || e == CUBLASLT_EPILOGUE_GELU_BIAS ||
                          e == CUBLASLT_EPILOGUE_GELU_AUX || e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    const bool relu = e == CUBLASLT_EPILOGUE_RELU || e == CUBLASLT_EPILOGUE_RELU_BIAS;
    const bool store_aux = e == CUBLASLT_EPILOGUE_GELU_AUX || e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    const bool dgelu = e == CUBLASLT_EPILOGUE_DGELU || e == CUBLASLT_EPILOGUE_DGELU_BGRAD;
    std::vector<double> row_sums(e == CUBLASLT_EPILOGUE_DGELU_BGRAD ? static_cast<size_t>(p.m) : 0,
                                 0.0);
    for (int64_t j = 0; j < p.n; ++j)
      for (int64_t i = 0; i < p.m; ++i) {
        double v = static_cast<double>(al) * prod[static_cast<size_t>(i + j * p.m)];
        if (be != 0.0f) v += static_cast<double>(be) * load(C, p.c_type, i + j * ldc);
        if (adds_bias(e)) v += load(d.bias, p.bias_type, i);
        if (store_aux) store(d.aux, p.aux_type, i + j * d.aux_ld, v);
        if (gelu_fwd) v = gelu(v);
        if (relu) v = v > 0.0 ? v : 0.0;
        if (dgelu) v *= gelu_grad(load(d.aux, p.aux_type, i + j * d.aux_ld));
        if (!row_sums.empty()) row_sums[static_cast<size_t>(i)] += v;
        store(D, p.c_type, i + j * ldd, v);
      }
    for (size_t i = 0; i < row_sums.size(); ++i)
      store(const_cast<void*>(d.bias), p.bias_type, static_cast<int64_t>(i), row_sums[i]);
  });
  return CUBLAS_STATUS_SUCCESS;
}
