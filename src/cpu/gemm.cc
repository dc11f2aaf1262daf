#include <weft/bf16.h>
#include <weft/cpu_kernels.h>
#include <weft/error.h>

#include <cblas.h>
#include <fmt/format.h>

#include <atomic>
#include <cstdlib>
#include <map>
#include <tuple>
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

namespace {

std::atomic<int> g_bf16_gemm{-1};

#if WEFT_ONEDNN
void check_dnnl(dnnl_status_t status, const char* what) {
  check(status == dnnl_success, "oneDNN: {} failed with status {}", what, static_cast<int>(status));
}

// Per thread: a stream and a matmul primitive per shape, strides, alpha and
// beta, built at the thread's first use of them and kept (a training step
// runs the same few shapes every step). oneDNN 2.6's matmul primitives give
// wrong sums when two threads execute one at once (seen with a stream each):
// ranks that are threads, and attention's parallel loop, each use their own.
// One engine serves every thread.
class Bf16Matmuls {
 public:
  using Key =
      std::tuple<bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, float>;
  // The primitive and the memory descriptors of its operands.
  struct Entry {
    dnnl_primitive_t primitive = nullptr;
    dnnl_memory_desc_t a{}, b{}, c{};
  };
  static Bf16Matmuls& mine() {
    thread_local Bf16Matmuls m;
    return m;
  }
  static dnnl_engine_t engine() {
    static const dnnl_engine_t e = [] {
      dnnl_engine_t made = nullptr;
      check_dnnl(dnnl_engine_create(&made, dnnl_cpu, 0), "the CPU engine");
      return made;
    }();
    return e;
  }
  dnnl_stream_t stream() const { return stream_; }
  const Entry& find(const Key& key) {
    auto it = entries_.find(key);
    if (it != entries_.end()) return it->second;
    const auto [ta, tb, m, n, k, lda, ldb, ldc, alpha, beta] = key;
    Entry e;
    dnnl_dims_t da = {m, k}, db = {k, n}, dc = {m, n};
    dnnl_dims_t sa = {ta ? 1 : lda, ta ? lda : 1}, sb = {tb ? 1 : ldb, tb ? ldb : 1}, sc = {ldc, 1};
    check_dnnl(dnnl_memory_desc_init_by_strides(&e.a, 2, da, dnnl_bf16, sa), "the A operand");
    check_dnnl(dnnl_memory_desc_init_by_strides(&e.b, 2, db, dnnl_bf16, sb), "the B operand");
    check_dnnl(dnnl_memory_desc_init_by_strides(&e.c, 2, dc, dnnl_f32, sc), "the C operand");
    dnnl_matmul_desc_t desc;
    check_dnnl(dnnl_matmul_desc_init(&desc, &e.a, &e.b, nullptr, &e.c), "the matmul");
    dnnl_primitive_attr_t attr;
    check_dnnl(dnnl_primitive_attr_create(&attr), "the attributes");
    if (alpha != 1.0f)
      check_dnnl(dnnl_primitive_attr_set_output_scales(attr, 1, 0, &alpha), "alpha");
    dnnl_post_ops_t post = nullptr;
    if (beta != 0.0f) {
      check_dnnl(dnnl_post_ops_create(&post), "the post-ops");
      check_dnnl(dnnl_post_ops_append_sum(post, beta), "C's sum");
      check_dnnl(dnnl_primitive_attr_set_post_ops(attr, post), "the post-ops");
    }
    dnnl_primitive_desc_t pd;
    const dnnl_status_t made = dnnl_primitive_desc_create(&pd, &desc, attr, engine(), nullptr);
    if (post != nullptr) dnnl_post_ops_destroy(post);
    dnnl_primitive_attr_destroy(attr);
    check_dnnl(made, "a bf16 matmul's description");
    const dnnl_status_t built = dnnl_primitive_create(&e.primitive, pd);
    dnnl_primitive_desc_destroy(pd);
    check_dnnl(built, "a bf16 matmul");
    return entries_.emplace(key, e).first->second;
  }
  ~Bf16Matmuls() {
    for (auto& [key, e] : entries_) dnnl_primitive_destroy(e.primitive);
    dnnl_stream_destroy(stream_);
  }

 private:
  Bf16Matmuls() {
    check_dnnl(dnnl_stream_create(&stream_, engine(), dnnl_stream_default_flags), "a stream");
  }
  dnnl_stream_t stream_ = nullptr;
  std::map<Key, Entry> entries_;
};
#endif

}  // namespace

bool bf16_gemm_runs() {
#if WEFT_ONEDNN
  const dnnl_cpu_isa_t isa = dnnl_get_effective_cpu_isa();
  return isa == dnnl_cpu_isa_avx512_core_bf16 || isa == dnnl_cpu_isa_avx512_core_amx;
#else
  return false;
#endif
}

Bf16Gemm default_bf16_gemm() {
#if WEFT_ONEDNN
  if (dnnl_get_effective_cpu_isa() == dnnl_cpu_isa_avx512_core_amx) return Bf16Gemm::OneDnn;
#endif
  return Bf16Gemm::Emulated;
}

Bf16Gemm bf16_gemm() {
  int v = g_bf16_gemm.load(std::memory_order_relaxed);
  if (v >= 0) return static_cast<Bf16Gemm>(v);
  Bf16Gemm chosen = default_bf16_gemm();
  if (const char* env = std::getenv("WEFT_CPU_BF16_GEMM"); env != nullptr && *env != 0) {
    const std::string_view name = env;
    check(name == "emulated" || name == "onednn",
          "WEFT_CPU_BF16_GEMM '{}' must be emulated or onednn", name);
    chosen = name == "onednn" ? Bf16Gemm::OneDnn : Bf16Gemm::Emulated;
    check(chosen == Bf16Gemm::Emulated || bf16_gemm_runs(), "WEFT_CPU_BF16_GEMM onednn: {}",
          onednn_built()
              ? "this CPU has neither AVX-512 BF16 nor AMX"
              : "weft was built without oneDNN (install libdnnl-dev, then set up again)");
  }
  g_bf16_gemm.store(static_cast<int>(chosen), std::memory_order_relaxed);
  return chosen;
}

void set_bf16_gemm(Bf16Gemm how) {
  check(how == Bf16Gemm::Emulated || bf16_gemm_runs(),
        "bf16 GEMMs on oneDNN need oneDNN and a CPU with AVX-512 BF16 or AMX");
  g_bf16_gemm.store(static_cast<int>(how), std::memory_order_relaxed);
}

std::string describe_bf16_gemm(Bf16Gemm how) {
#if WEFT_ONEDNN
  if (how == Bf16Gemm::OneDnn)
    return fmt::format("bf16 GEMMs on oneDNN ({})", isa_name(dnnl_get_effective_cpu_isa()));
#endif
  (void)how;
  return "emulated on the CPU: GEMM inputs rounded around fp32 GEMMs";
}

void gemm_bf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
               const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, float beta, float* c,
               int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    gemm(trans_a, trans_b, m, n, 0, alpha, nullptr, lda, nullptr, ldb, beta, c, ldc);
    return;
  }
#if WEFT_ONEDNN
  check(bf16_gemm_runs(), "gemm_bf16: this CPU has neither AVX-512 BF16 nor AMX");
  Bf16Matmuls& all = Bf16Matmuls::mine();
  const Bf16Matmuls::Entry& e = all.find({trans_a, trans_b, m, n, k, lda, ldb, ldc, alpha, beta});
  dnnl_memory_t ma = nullptr, mb = nullptr, mc = nullptr;
  check_dnnl(dnnl_memory_create(&ma, &e.a, Bf16Matmuls::engine(), const_cast<uint16_t*>(a)), "A");
  check_dnnl(dnnl_memory_create(&mb, &e.b, Bf16Matmuls::engine(), const_cast<uint16_t*>(b)), "B");
  check_dnnl(dnnl_memory_create(&mc, &e.c, Bf16Matmuls::engine(), c), "C");
  const dnnl_exec_arg_t args[] = {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}};
  const dnnl_status_t ran = dnnl_primitive_execute(e.primitive, all.stream(), 3, args);
  const dnnl_status_t waited = dnnl_stream_wait(all.stream());
  dnnl_memory_destroy(ma);
  dnnl_memory_destroy(mb);
  dnnl_memory_destroy(mc);
  check_dnnl(ran, "a bf16 matmul");
  check_dnnl(waited, "a bf16 matmul's stream");
#else
  (void)trans_a, (void)trans_b, (void)alpha, (void)a, (void)lda, (void)b, (void)ldb, (void)beta,
      (void)c, (void)ldc;
  throw Error("gemm_bf16: weft was built without oneDNN");
#endif
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

// The stored (rows, cols) matrix at x with row stride ld, rounded to bf16
// into a dense copy (exact for values that are bf16 already).
void narrow_copy(const float* x, int64_t rows, int64_t cols, int64_t ld,
                 std::vector<uint16_t>& out) {
  out.resize(static_cast<size_t>(rows * cols));
#pragma omp parallel for schedule(static) if (rows * cols >= (int64_t{1} << 16))
  for (int64_t i = 0; i < rows; ++i) {
    const float* src = x + i * ld;
    uint16_t* dst = out.data() + i * cols;
    for (int64_t j = 0; j < cols; ++j) dst[j] = to_bf16(src[j]);
  }
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
  const int64_t a_rows = trans_a ? k : m, a_cols = trans_a ? m : k;
  const int64_t b_rows = trans_b ? n : k, b_cols = trans_b ? k : n;
  // On oneDNN's bf16 matmul (bf16_gemm): both operands as bf16, an operand
  // not to be rounded holding bf16 values already. Inside a parallel loop
  // (attention's) too: each thread has its own primitives and stream, and
  // oneDNN then runs the matmul on the calling thread alone, with the same
  // sums as on several threads.
  const bool bf16 = round_a == Rounding::Bf16 || round_b == Rounding::Bf16;
  if (bf16 && round_a != Rounding::Fp16 && round_b != Rounding::Fp16 &&
      bf16_gemm() == Bf16Gemm::OneDnn) {
    thread_local std::vector<uint16_t> ha, hb;
    narrow_copy(a, a_rows, a_cols, lda, ha);
    narrow_copy(b, b_rows, b_cols, ldb, hb);
    gemm_bf16(trans_a, trans_b, m, n, k, alpha, ha.data(), a_cols, hb.data(), b_cols, beta, c, ldc);
    return;
  }
  // One pair of buffers per thread (attention calls this from an OpenMP
  // loop); they grow to the largest operands once and stay.
  thread_local std::vector<float> ra, rb;
  if (round_a != Rounding::None) {
    round_copy(round_a, a, a_rows, a_cols, lda, ra);
    a = ra.data(), lda = a_cols;
  }
  if (round_b != Rounding::None) {
    round_copy(round_b, b, b_rows, b_cols, ldb, rb);
    b = rb.data(), ldb = b_cols;
  }
  gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

}  // namespace weft::cpu
