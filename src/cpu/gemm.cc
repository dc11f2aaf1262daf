#include <weft/bf16.h>
#include <weft/cpu_kernels.h>
#include <weft/error.h>

#include <cblas.h>
#include <fmt/format.h>

#include <atomic>
#include <cstdlib>
#include <vector>

#include "weft_config.h"
#if WEFT_ONEDNN
#include <oneapi/dnnl/dnnl.h>
#endif

namespace weft::cpu {

namespace {

// -1 until the first use or set_gemm_library; then a GemmLibrary.
std::atomic<int> g_library{-1};

#if WEFT_ONEDNN
const char* isa_name(dnnl_cpu_isa_t isa) {
  switch (isa) {
    case dnnl_cpu_isa_sse41:
      return "sse41";
    case dnnl_cpu_isa_avx:
      return "avx";
    case dnnl_cpu_isa_avx2:
      return "avx2";
    case dnnl_cpu_isa_avx2_vnni:
      return "avx2_vnni";
    case dnnl_cpu_isa_avx512_mic:
      return "avx512_mic";
    case dnnl_cpu_isa_avx512_mic_4ops:
      return "avx512_mic_4ops";
    case dnnl_cpu_isa_avx512_core:
      return "avx512_core";
    case dnnl_cpu_isa_avx512_core_vnni:
      return "avx512_core_vnni";
    case dnnl_cpu_isa_avx512_core_bf16:
      return "avx512_core_bf16";
    case dnnl_cpu_isa_avx512_core_amx:
      return "avx512_core_amx";
    default:
      return "other";
  }
}
#endif

}  // namespace

bool onednn_built() { return WEFT_ONEDNN != 0; }

GemmLibrary default_gemm_library() {
  return onednn_built() ? GemmLibrary::OneDnn : GemmLibrary::OpenBlas;
}

GemmLibrary parse_gemm_library(std::string_view name, std::string_view what) {
  if (name == "auto") return default_gemm_library();
  if (name == "openblas") return GemmLibrary::OpenBlas;
  if (name == "onednn") {
    check(onednn_built(),
          "{} onednn: weft was built without oneDNN (install libdnnl-dev, then set up again)",
          what);
    return GemmLibrary::OneDnn;
  }
  throw Error("{} '{}' must be auto, openblas or onednn", what, name);
}

GemmLibrary gemm_library() {
  int v = g_library.load(std::memory_order_relaxed);
  if (v >= 0) return static_cast<GemmLibrary>(v);
  const char* env = std::getenv("WEFT_CPU_GEMM");
  const GemmLibrary chosen = env == nullptr || *env == 0 ? default_gemm_library()
                                                         : parse_gemm_library(env, "WEFT_CPU_GEMM");
  // A racing first use reads the same environment and stores the same value.
  g_library.store(static_cast<int>(chosen), std::memory_order_relaxed);
  return chosen;
}

void set_gemm_library(GemmLibrary library) {
  check(library != GemmLibrary::OneDnn || onednn_built(),
        "the oneDNN GEMM: weft was built without oneDNN (install libdnnl-dev, then set up again)");
  g_library.store(static_cast<int>(library), std::memory_order_relaxed);
}

std::string describe_gemm_library(GemmLibrary library) {
#if WEFT_ONEDNN
  if (library == GemmLibrary::OneDnn) {
    const dnnl_version_t* v = dnnl_version();
    return fmt::format("oneDNN {}.{}.{} ({})", v->major, v->minor, v->patch,
                       isa_name(dnnl_get_effective_cpu_isa()));
  }
#endif
  (void)library;
  // "OpenBLAS 0.3.21 NO_LAPACKE DYNAMIC_ARCH ... Prescott MAX_THREADS=64":
  // the version is its second word.
  std::string config = openblas_get_config();
  std::string version = config.substr(0, config.find(' ', config.find(' ') + 1));
  return fmt::format("{} ({} kernels)", version, openblas_get_corename());
}

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
          const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
          int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    // C = beta C (oneDNN 2.6's sgemm leaves C as it was for most transposes).
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == 0 ? 0.0f : beta * c[i * ldc + j];
    return;
  }
#if WEFT_ONEDNN
  if (gemm_library() == GemmLibrary::OneDnn) {
    const dnnl_status_t status = dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', m, n, k,
                                            alpha, a, lda, b, ldb, beta, c, ldc);
    check(status == dnnl_success, "oneDNN sgemm ({} x {} x {}) failed with status {}", m, n, k,
          static_cast<int>(status));
    return;
  }
#endif
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, static_cast<blasint>(m),
              static_cast<blasint>(n), static_cast<blasint>(k), alpha, a,
              static_cast<blasint>(lda), b, static_cast<blasint>(ldb), beta, c,
              static_cast<blasint>(ldc));
}

namespace {

template <Rounding R>
inline float round_as(float x) {
  if constexpr (R == Rounding::Bf16) return round_to_bf16(x);
  // GCC's float -> _Float16 conversion rounds once, to nearest even, and
  // gives +-inf past the largest finite half (65504).
  if constexpr (R == Rounding::Fp16) return static_cast<float>(static_cast<_Float16>(x));
  return x;
}

}  // namespace

float round_to(Rounding r, float x) {
  switch (r) {
    case Rounding::None: return x;
    case Rounding::Bf16:
      return round_as<Rounding::Bf16>(x);
    case Rounding::Fp16:
      return round_as<Rounding::Fp16>(x);
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
    for (int64_t j = 0; j < cols; ++j) dst[j] = round_as<R>(src[j]);
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
  gemm_rounded(r, r, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void gemm_rounded(Rounding round_a, Rounding round_b, bool trans_a, bool trans_b, int64_t m,
                  int64_t n, int64_t k, float alpha, const float* a, int64_t lda, const float* b,
                  int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0 || k == 0) round_a = round_b = Rounding::None;
  // One pair of buffers per thread (attention calls this from an OpenMP
  // loop); they grow to the largest operands once and stay.
  thread_local std::vector<float> ra, rb;
  if (round_a != Rounding::None) {
    const int64_t a_rows = trans_a ? k : m, a_cols = trans_a ? m : k;
    round_copy(round_a, a, a_rows, a_cols, lda, ra);
    a = ra.data(), lda = a_cols;
  }
  if (round_b != Rounding::None) {
    const int64_t b_rows = trans_b ? n : k, b_cols = trans_b ? k : n;
    round_copy(round_b, b, b_rows, b_cols, ldb, rb);
    b = rb.data(), ldb = b_cols;
  }
  gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

}  // namespace weft::cpu
