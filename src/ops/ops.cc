// The device dispatch of weft/ops.h: each operation checks its tensors once,
// then runs the cpu:: kernel or the cuda:: kernel of their device.
//
// on_device(device, op, cpu, cuda) is the one place that chooses. The CUDA
// branch is a generic lambda taking the device's cuda::Context; in a build
// without CUDA it is never instantiated (the cuda:: declarations are plain
// C++, and nothing of them is linked), and asking for a CUDA tensor there
// throws instead.
#include <weft/ops.h>

#include <weft/bf16.h>
#include <weft/cpu_kernels.h>
#include <weft/cuda/kernels.h>
#include <weft/error.h>
#include <weft/optimizer.h>

#include "weft_config.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <initializer_list>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace weft::ops {

namespace {

// Every tensor of one call on one device; returns that device.
Device common_device(const char* op, std::initializer_list<const Tensor*> ts) {
  const Tensor* first = nullptr;
  for (const Tensor* t : ts) {
    if (t == nullptr || !t->defined() || t->raw() == nullptr) continue;
    if (first == nullptr) {
      first = t;
    } else if (!(t->device() == first->device())) {
      throw Error("{}: tensors on {} and {}; every operand must be on one device", op,
                  first->device().str(), t->device().str());
    }
  }
  return first != nullptr ? first->device() : Device::cpu();
}

void check_dtype(const char* op, const char* name, const Tensor& t, DType want) {
  check(t.dtype() == want, "{}: {} must be {}, got {}", op, name, dtype_name(want),
        dtype_name(t.dtype()));
}

void check_numel(const char* op, const char* name, const Tensor& t, int64_t want) {
  check(t.numel() == want, "{}: {} has {} elements {}, expected {}", op, name, t.numel(),
        t.shape().str(), want);
}

constexpr int kMaxDevices = 64;
std::array<std::atomic<MatmulPrecision>, kMaxDevices> g_precision{};
std::atomic<MatmulPrecision> g_cpu_precision{MatmulPrecision::Fp32};

cuda::MathMode math_mode(Device d) {
  switch (matmul_precision(d)) {
    case MatmulPrecision::Fp32: return cuda::MathMode::FP32;
    case MatmulPrecision::Tf32: return cuda::MathMode::TF32;
    case MatmulPrecision::Bf16: return cuda::MathMode::BF16;
    case MatmulPrecision::Fp16: return cuda::MathMode::FP16;
  }
  return cuda::MathMode::FP32;
}

// The CPU's emulation of the same rounding (Tf32 is never set there).
cpu::Rounding cpu_rounding() {
  switch (g_cpu_precision.load()) {
    case MatmulPrecision::Bf16: return cpu::Rounding::Bf16;
    case MatmulPrecision::Fp16: return cpu::Rounding::Fp16;
    default: return cpu::Rounding::None;
  }
}

#if WEFT_CUDA
template <typename Cpu, typename Cuda>
decltype(auto) on_device(Device d, const char* op, Cpu&& on_cpu, Cuda&& on_cuda) {
  if (d.is_cpu()) return on_cpu();
  static const int visible = cuda_device_count();
  if (d.index < 0 || d.index >= visible)
    throw Error("{} on {}: no such CUDA device ({} visible)", op, d.str(), visible);
  return on_cuda(cuda::context(d.index));
}
#else
template <typename Cpu, typename Cuda>
decltype(auto) on_device(Device d, const char* op, Cpu&& on_cpu, Cuda&&) {
  if (!d.is_cpu())
    throw Error("{} on {}: weft was built without CUDA (meson setup -Dcuda=enabled)", op,
                d.str());
  return on_cpu();
}
#endif

// An operation with no CUDA kernel yet: a clear error rather than a wrong result.
[[noreturn]] void no_cuda_kernel(const char* op, Device d) {
  throw Error("{} on {}: this operation has no CUDA kernel yet", op, d.str());
}

// The kernels' pointers. A float pointer to a tensor of another dtype is a
// bug in this file (an operation that forgot to widen), never a user's error.
float* fp32_data(const Tensor& t) {
  if (t.dtype() != DType::F32)
    throw Error("internal: a {} tensor {} reached an fp32 kernel", dtype_name(t.dtype()),
                t.shape().str());
  return t.data<float>();
}
const float* f(const Tensor& t) { return fp32_data(t); }
float* fw(const Tensor& t) { return fp32_data(t); }
const int32_t* i32(const Tensor& t) { return t.data<int32_t>(); }

bool any_bf16(std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts)
    if (t->defined() && t->dtype() == DType::BF16) return true;
  return false;
}

std::mutex& widened_mu() {
  static std::mutex mu;
  return mu;
}
std::map<std::string, int64_t>& widened_counts() {
  static std::map<std::string, int64_t> counts;
  return counts;
}

// fp32 stand-ins for the BF16 tensors of an operation that has no bf16
// kernel on their device: in() widens a copy (exactly: every bf16 value is
// an fp32 value); out() gives an fp32 tensor for an output, holding its
// values when the operation accumulates into it; commit() rounds each such
// output back into its BF16 tensor, once. The operation then gives what a
// bf16 kernel computing in fp32 and rounding its stores gives. Temporaries
// live on the tensors' device (its caching allocator on a GPU), queued on
// its compute stream like the kernels.
class Widen {
 public:
  explicit Widen(const char* op) : op_(op) {}
  Tensor in(const Tensor& t) {
    if (!t.defined() || t.dtype() != DType::BF16) return t;
    count();
    Tensor w = Tensor::empty(t.shape(), DType::F32, t.device());
    convert(t, w);
    return w;
  }
  Tensor out(const Tensor& t, bool accumulate) {
    if (!t.defined() || t.dtype() != DType::BF16) return t;
    count();
    Tensor w = accumulate ? in(t) : Tensor::empty(t.shape(), DType::F32, t.device());
    back_.emplace_back(t, w);
    return w;
  }
  void commit() {
    for (const auto& [dst, w] : back_) convert(w, dst);
    back_.clear();
  }

 private:
  void count() {  // once per operation, on the tensors' device
    if (counted_) return;
    counted_ = true;
    std::lock_guard lock(widened_mu());
    ++widened_counts()[op_];
  }
  const char* op_;
  bool counted_ = false;
  std::vector<std::pair<Tensor, Tensor>> back_;
};

bool is_bf16(const Tensor& t) { return t.dtype() == DType::BF16; }
bool is_f32(const Tensor& t) { return t.dtype() == DType::F32; }
bool is_i32(const Tensor& t) { return t.dtype() == DType::I32; }
const cuda::bf16* b16(const Tensor& t) { return t.data<cuda::bf16>(); }
cuda::bf16* b16w(const Tensor& t) { return t.data<cuda::bf16>(); }

// A bf16 kernel's call on a GPU; false on the CPU, which widens instead.
template <typename Cuda>
bool on_gpu(Device d, const char* op, Cuda&& on_cuda) {
  if (d.is_cpu()) return false;
  on_device(d, op, [] {}, std::forward<Cuda>(on_cuda));
  return true;
}

}  // namespace

// --- dtypes ---

void convert(const Tensor& src, const Tensor& dst) {
  const Device d = common_device("convert", {&src, &dst});
  check(src.numel() == dst.numel(), "convert: {} elements {} into {} elements {}", src.numel(),
        src.shape().str(), dst.numel(), dst.shape().str());
  if (src.dtype() == dst.dtype()) {
    dst.copy_from(src.view(dst.shape()));
    return;
  }
  const bool down = src.dtype() == DType::F32 && dst.dtype() == DType::BF16;
  check(down || (src.dtype() == DType::BF16 && dst.dtype() == DType::F32),
        "convert: {} to {} is not supported (F32 and BF16 either way)", dtype_name(src.dtype()),
        dtype_name(dst.dtype()));
  const int64_t n = src.numel();
  on_device(
      d, "convert",
      [&] {
        if (down) {
          to_bf16(src.data<float>(), dst.data<uint16_t>(), n);
        } else {
          const uint16_t* x = src.data<uint16_t>();
          float* y = dst.data<float>();
          for (int64_t i = 0; i < n; ++i) y[i] = bf16_to_float(x[i]);
        }
      },
      [&](auto& cx) {
        if (down) {
          cuda::to_bf16(cx, src.data<float>(), dst.data<cuda::bf16>(), n);
        } else {
          cuda::to_float(cx, src.data<cuda::bf16>(), dst.data<float>(), n);
        }
      });
}

void convert_multi(const std::vector<Tensor>& srcs, const std::vector<Tensor>& dsts,
                   std::shared_ptr<void>& cache) {
  check(srcs.size() == dsts.size(), "convert_multi: {} sources for {} destinations", srcs.size(),
        dsts.size());
  // Every pair checked before anything is written; the device is the first
  // one of a tensor that holds elements (none: the CPU, with nothing to do).
  const Tensor* first = nullptr;
  for (size_t i = 0; i < srcs.size(); ++i) {
    const Tensor &x = srcs[i], &y = dsts[i];
    check(x.defined() && y.defined(), "convert_multi: pair {} of {} has no storage ({} into {})",
          i, srcs.size(), x.defined() ? "a tensor" : "none", y.defined() ? "a tensor" : "none");
    check(x.dtype() == DType::F32 && y.dtype() == DType::BF16,
          "convert_multi: pair {} of {} is {} to {}; every pair must be F32 to BF16", i,
          srcs.size(), dtype_name(x.dtype()), dtype_name(y.dtype()));
    check(x.shape() == y.shape(), "convert_multi: pair {} of {} is {} into {}; shapes must match",
          i, srcs.size(), x.shape().str(), y.shape().str());
    for (const Tensor* t : {&x, &y}) {
      if (t->raw() == nullptr) continue;
      if (first == nullptr) first = t;
      check(t->device() == first->device(),
            "convert_multi: tensors on {} and {}; every operand must be on one device",
            first->device().str(), t->device().str());
    }
  }
  const Device d = first != nullptr ? first->device() : Device::cpu();
  on_device(
      d, "convert_multi",
      [&] {
        for (size_t i = 0; i < srcs.size(); ++i) convert(srcs[i], dsts[i]);
      },
      [&](auto& cx) {
        if (!cache) cache = std::make_shared<cuda::ConvertTable>();
        auto& table = *static_cast<cuda::ConvertTable*>(cache.get());
        table.scratch.clear();  // keeps its capacity
        for (size_t i = 0; i < srcs.size(); ++i)
          table.scratch.push_back({f(srcs[i]), b16w(dsts[i]), srcs[i].numel()});
        cuda::to_bf16_multi(cx, table.scratch, table);
      });
}

const char* matmul_precision_name(MatmulPrecision p) {
  switch (p) {
    case MatmulPrecision::Fp32: return "fp32";
    case MatmulPrecision::Tf32: return "tf32";
    case MatmulPrecision::Bf16: return "bf16";
    case MatmulPrecision::Fp16: return "fp16";
  }
  return "?";
}

std::map<std::string, int64_t> widened_ops() {
  std::lock_guard lock(widened_mu());
  return widened_counts();
}

void reset_widened_ops() {
  std::lock_guard lock(widened_mu());
  widened_counts().clear();
}

void set_matmul_precision(Device device, MatmulPrecision precision) {
  if (device.is_cpu()) {
    check(precision != MatmulPrecision::Tf32,
          "matmul precision tf32 needs a CUDA device: the CPU has no TF32 arithmetic");
    g_cpu_precision = precision;
    return;
  }
  check(device.index >= 0 && device.index < kMaxDevices, "device index {} is out of [0, {})",
        device.index, kMaxDevices);
  g_precision[static_cast<size_t>(device.index)] = precision;
}

MatmulPrecision matmul_precision(Device device) {
  if (device.is_cpu()) return g_cpu_precision;
  if (device.index < 0 || device.index >= kMaxDevices) return MatmulPrecision::Fp32;
  return g_precision[static_cast<size_t>(device.index)];
}

// --- matrices ---

void gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c,
          float alpha, float beta) {
  const Device d = common_device("gemm", {&a, &b, &c});
  const int64_t ar = a.shape().rows(), ac = a.shape().last();
  const int64_t br = b.shape().rows(), bc = b.shape().last();
  const int64_t m = trans_a ? ac : ar, k = trans_a ? ar : ac;
  const int64_t kb = trans_b ? bc : br, n = trans_b ? br : bc;
  check(k == kb && c.shape().rows() == m && c.shape().last() == n,
        "gemm: op(a) is ({}, {}), op(b) ({}, {}), c {}: the shapes do not chain", m, k, kb, n,
        c.shape().str());
  if (any_bf16({&a, &b, &c})) {
    // bf16 a and b are cuBLAS's own types (fp32 accumulation, c fp32 or
    // rounded once); any other mix is widened, which is exact.
    // One bf16 operand and one fp32 one on a GPU whose GEMMs round their
    // inputs to bf16 (--bf16): rounding the fp32 one first is what the GEMM
    // would do to it, and halves what the GEMM reads (a weight gradient's
    // dy, with x bf16). Only where it is the smaller one: the LM head's
    // dlogits (N, V) against its x (N, C) is cheaper to leave and widen x.
    if (!d.is_cpu() && matmul_precision(d) == MatmulPrecision::Bf16 &&
        is_bf16(a) != is_bf16(b) && (is_f32(a) || is_f32(b)) &&
        (is_bf16(a) ? b : a).numel() <= (is_bf16(a) ? a : b).numel()) {
      const Tensor& wide = is_bf16(a) ? b : a;
      {
        std::lock_guard lock(widened_mu());
        ++widened_counts()["gemm (an fp32 operand rounded to bf16)"];
      }
      const Tensor narrow = Tensor::empty(wide.shape(), DType::BF16, d);
      convert(wide, narrow);
      return is_bf16(a) ? gemm(a, trans_a, narrow, trans_b, c, alpha, beta)
                        : gemm(narrow, trans_a, b, trans_b, c, alpha, beta);
    }
    if (is_bf16(a) && is_bf16(b) &&
        on_gpu(d, "gemm", [&](auto& cx) {
          if (is_bf16(c))
            cuda::gemm_bf16_out(cx, trans_a, trans_b, m, n, k, alpha, b16(a), ac, b16(b), bc,
                                beta, b16w(c), n);
          else
            cuda::gemm_bf16(cx, trans_a, trans_b, m, n, k, alpha, b16(a), ac, b16(b), bc, beta,
                            fw(c), n);
        }))
      return;
    Widen wd(__func__);
    gemm(wd.in(a), trans_a, wd.in(b), trans_b, wd.out(c, beta != 0.0f), alpha, beta);
    return wd.commit();
  }
  on_device(
      d, "gemm",
      [&] {
        cpu::gemm_rounded(cpu_rounding(), trans_a, trans_b, m, n, k, alpha, f(a), ac, f(b), bc,
                          beta, fw(c), n);
      },
      [&](auto& cx) {
        cuda::gemm(cx, math_mode(d), trans_a, trans_b, m, n, k, alpha, f(a), ac, f(b), bc, beta,
                   fw(c), n);
      });
}

void gemm_bias(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& bias,
               const Tensor& c) {
  const Device d = common_device("gemm_bias", {&a, &b, &bias, &c});
  const int64_t ar = a.shape().rows(), ac = a.shape().last();
  const int64_t br = b.shape().rows(), bc = b.shape().last();
  const int64_t m = trans_a ? ac : ar, k = trans_a ? ar : ac;
  const int64_t kb = trans_b ? bc : br, n = trans_b ? br : bc;
  check(k == kb && c.shape().rows() == m && c.shape().last() == n,
        "gemm_bias: op(a) is ({}, {}), op(b) ({}, {}), c {}: the shapes do not chain", m, k, kb,
        n, c.shape().str());
  check_numel("gemm_bias", "bias", bias, n);
  const bool fp32 = is_f32(a) && is_f32(b) && is_f32(bias) && is_f32(c);
  const bool bf16 = is_bf16(a) && is_bf16(b) && is_bf16(c);  // the bias either dtype
  if ((fp32 || bf16) && on_gpu(d, "gemm_bias", [&](auto& cx) {
        if (fp32) {
          cuda::gemm_bias(cx, math_mode(d), trans_a, trans_b, m, n, k, f(a), ac, f(b), bc,
                          f(bias), fw(c), n);
          return;
        }
        // An fp32 bias is rounded as fill_rows rounds it into a bf16 c (a
        // training step's biases come rounded already: Param::value16).
        Tensor bias16 = bias;
        if (is_f32(bias)) {
          bias16 = Tensor::empty(bias.shape(), DType::BF16, d);
          convert(bias, bias16);
        }
        cuda::gemm_bias_bf16(cx, trans_a, trans_b, m, n, k, b16(a), ac, b16(b), bc, b16(bias16),
                             b16w(c), n);
      }))
    return;
  fill_rows(c, bias);
  gemm(a, trans_a, b, trans_b, c, 1.0f, 1.0f);
}

namespace {
// The (m, n) of C = op(a) op(b), checked against c's shape.
std::pair<int64_t, int64_t> product_shape(const char* name, const Tensor& a, bool trans_a,
                                          const Tensor& b, bool trans_b, const Tensor& c) {
  const int64_t ar = a.shape().rows(), ac = a.shape().last();
  const int64_t br = b.shape().rows(), bc = b.shape().last();
  const int64_t m = trans_a ? ac : ar, k = trans_a ? ar : ac;
  const int64_t kb = trans_b ? bc : br, n = trans_b ? br : bc;
  check(k == kb && c.shape().rows() == m && c.shape().last() == n,
        "{}: op(a) is ({}, {}), op(b) ({}, {}), the output {}: the shapes do not chain", name, m,
        k, kb, n, c.shape().str());
  return {m, n};
}
}  // namespace

void gemm_bias_gelu(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b,
                    const Tensor& bias, const Tensor& pre, const Tensor& y) {
  const Device d = common_device("gemm_bias_gelu", {&a, &b, &bias, &pre, &y});
  const auto [m, n] = product_shape("gemm_bias_gelu", a, trans_a, b, trans_b, pre);
  check(y.shape() == pre.shape() && y.dtype() == pre.dtype(),
        "gemm_bias_gelu: the GELU's output {} {} must match its input {} {}", dtype_name(y.dtype()),
        y.shape().str(), dtype_name(pre.dtype()), pre.shape().str());
  check_numel("gemm_bias_gelu", "bias", bias, n);
  if (is_bf16(a) && is_bf16(b) && is_bf16(pre) && is_bf16(y) &&
      on_gpu(d, "gemm_bias_gelu", [&](auto& cx) {
        Tensor bias16 = bias;  // rounded as gemm_bias rounds an fp32 bias
        if (is_f32(bias)) {
          bias16 = Tensor::empty(bias.shape(), DType::BF16, d);
          convert(bias, bias16);
        }
        const int64_t k = trans_a ? a.shape().rows() : a.shape().last();
        cuda::gemm_bias_gelu_bf16(cx, trans_a, trans_b, m, n, k, b16(a), a.shape().last(), b16(b),
                                  b.shape().last(), b16(bias16), b16w(pre), b16w(y));
      }))
    return;
  gemm_bias(a, trans_a, b, trans_b, bias, pre);
  gelu_forward(pre, y);
}

void gemm_dgelu(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& pre,
                const Tensor& dx) {
  const Device d = common_device("gemm_dgelu", {&a, &b, &pre, &dx});
  const auto [m, n] = product_shape("gemm_dgelu", a, trans_a, b, trans_b, dx);
  check(pre.shape() == dx.shape(),
        "gemm_dgelu: the GELU's input {} must have its gradient's shape {}",
        pre.shape().str(), dx.shape().str());
  if (is_bf16(a) && is_bf16(b) && is_bf16(pre) && is_bf16(dx) &&
      on_gpu(d, "gemm_dgelu", [&](auto& cx) {
        const int64_t k = trans_a ? a.shape().rows() : a.shape().last();
        cuda::gemm_dgelu_bf16(cx, trans_a, trans_b, m, n, k, b16(a), a.shape().last(), b16(b),
                              b.shape().last(), b16(pre), b16w(dx));
      }))
    return;
  gemm(a, trans_a, b, trans_b, dx, 1.0f, 0.0f);
  gelu_backward(dx, pre, dx, false);
}

void gemm_bias_grad(const Tensor& a, bool trans_a, const Tensor& b, const Tensor& c, float beta,
                    const Tensor& db) {
  const Device d = common_device("gemm_bias_grad", {&a, &b, &c, &db});
  const auto [m, n] = product_shape("gemm_bias_grad", a, trans_a, b, false, c);
  check_numel("gemm_bias_grad", "db", db, n);
  bool fused = false;
  if (is_bf16(a) && is_bf16(b) && is_f32(c) && is_f32(db))
    on_gpu(d, "gemm_bias_grad", [&](auto& cx) {
      const Tensor part = Tensor::empty(db.shape(), DType::F32, d);  // written by the epilogue
      const int64_t k = trans_a ? a.shape().rows() : a.shape().last();
      fused = cuda::gemm_bf16_bias_grad(cx, trans_a, m, n, k, b16(a), a.shape().last(), b16(b),
                                        n, beta, fw(c), n, fw(part));
      if (fused) cuda::add_inplace(cx, fw(db), f(part), n);
    });
  if (fused) return;
  gemm(a, trans_a, b, false, c, 1.0f, beta);
  sum_rows(b, db);
}

void fill_rows(const Tensor& y, const Tensor& row) {
  if (any_bf16({&y, &row})) {
    if (is_bf16(y) && is_f32(row) && y.shape().last() == row.numel() &&
        on_gpu(common_device("fill_rows", {&y, &row}), "fill_rows", [&](auto& cx) {
          cuda::fill_rows(cx, b16w(y), f(row), y.shape().rows(), y.shape().last());
        }))
      return;
    Widen wd(__func__);
    fill_rows(wd.out(y, false), wd.in(row));
    return wd.commit();
  }
  const Device d = common_device("fill_rows", {&y, &row});
  const int64_t n = y.shape().rows(), c = y.shape().last();
  check_numel("fill_rows", "row", row, c);
  on_device(
      d, "fill_rows", [&] { cpu::fill_rows(fw(y), f(row), n, c); },
      [&](auto& cx) {
        cuda::zero(cx, y.raw(), y.nbytes());
        cuda::add_bias(cx, fw(y), f(row), n, c);
      });
}

void add_rows(const Tensor& y, const Tensor& row) {
  if (any_bf16({&y, &row})) {
    Widen wd(__func__);
    add_rows(wd.out(y, true), wd.in(row));
    return wd.commit();
  }
  const Device d = common_device("add_rows", {&y, &row});
  const int64_t n = y.shape().rows(), c = y.shape().last();
  check_numel("add_rows", "row", row, c);
  on_device(
      d, "add_rows", [&] { cpu::add_bias(fw(y), f(row), n, c); },
      [&](auto& cx) { cuda::add_bias(cx, fw(y), f(row), n, c); });
}

void sum_rows(const Tensor& dy, const Tensor& db) {
  if (any_bf16({&dy, &db})) {
    if (is_bf16(dy) && is_f32(db) && db.numel() == dy.shape().last() &&
        on_gpu(common_device("sum_rows", {&dy, &db}), "sum_rows", [&](auto& cx) {
          cuda::sum_rows(cx, b16(dy), fw(db), dy.shape().rows(), dy.shape().last());
        }))
      return;
    Widen wd(__func__);
    sum_rows(wd.in(dy), wd.out(db, true));
    return wd.commit();
  }
  const Device d = common_device("sum_rows", {&dy, &db});
  const int64_t n = dy.shape().rows(), c = dy.shape().last();
  check_numel("sum_rows", "db", db, c);
  on_device(
      d, "sum_rows", [&] { cpu::sum_rows(f(dy), fw(db), n, c); },
      [&](auto& cx) { cuda::sum_rows(cx, f(dy), fw(db), n, c); });
}

// --- element-wise ---

void add(const Tensor& y, const Tensor& x) {
  if (any_bf16({&y, &x})) {
    if (is_bf16(y) && x.numel() == y.numel() &&
        on_gpu(common_device("add", {&y, &x}), "add", [&](auto& cx) {
          if (is_bf16(x))
            cuda::add_inplace(cx, b16w(y), b16(x), y.numel());
          else
            cuda::add_inplace(cx, b16w(y), f(x), y.numel());
        }))
      return;
    Widen wd(__func__);
    add(wd.out(y, true), wd.in(x));
    return wd.commit();
  }
  const Device d = common_device("add", {&y, &x});
  check_numel("add", "x", x, y.numel());
  on_device(
      d, "add", [&] { cpu::add_inplace(fw(y), f(x), y.numel()); },
      [&](auto& cx) { cuda::add_inplace(cx, fw(y), f(x), y.numel()); });
}

void add(const Tensor& a, const Tensor& b, const Tensor& y) {
  const Device d = common_device("add", {&a, &b, &y});
  check_numel("add", "a", a, y.numel());
  check_numel("add", "b", b, y.numel());
  const bool same = a.dtype() == y.dtype() && b.dtype() == y.dtype();
  if (same && (is_f32(y) || is_bf16(y)) && on_gpu(d, "add", [&](auto& cx) {
        if (is_f32(y))
          cuda::add(cx, f(a), f(b), fw(y), y.numel());
        else
          cuda::add(cx, b16(a), b16(b), b16w(y), y.numel());
      }))
    return;
  if (y.raw() == b.raw()) return add(y, a);  // fp32 addition commutes, bit for bit
  y.copy_from(a);
  add(y, b);
}

void scale(const Tensor& y, float s) {
  if (any_bf16({&y})) {
    Widen wd(__func__);
    scale(wd.out(y, true), s);
    return wd.commit();
  }
  const Device d = common_device("scale", {&y});
  on_device(
      d, "scale", [&] { cpu::scale_inplace(fw(y), s, y.numel()); },
      [&](auto& cx) { cuda::scale_inplace(cx, fw(y), s, y.numel()); });
}

void add_scaled(const Tensor& y, const Tensor& x, float s) {
  check_dtype("add_scaled", "x", x, DType::F32);
  check_numel("add_scaled", "x", x, y.numel());
  if (any_bf16({&y})) {
    if (on_gpu(common_device("add_scaled", {&y, &x}), "add_scaled",
               [&](auto& cx) { cuda::add_scaled(cx, b16w(y), f(x), s, y.numel()); }))
      return;
    Widen wd(__func__);
    add_scaled(wd.out(y, true), x, s);
    return wd.commit();
  }
  const Device d = common_device("add_scaled", {&y, &x});
  on_device(
      d, "add_scaled", [&] { cpu::add_scaled(fw(y), f(x), s, y.numel()); },
      [&](auto& cx) { cuda::add_scaled(cx, fw(y), f(x), s, y.numel()); });
}

double sum_squares(const Tensor& x) {
  if (any_bf16({&x})) {
    Widen wd(__func__);
    const double r = sum_squares(wd.in(x));
    wd.commit();
    return r;
  }
  const Device d = common_device("sum_squares", {&x});
  return on_device(
      d, "sum_squares", [&] { return cpu::sum_squares(f(x), x.numel()); },
      [&](auto& cx) { return cuda::sum_squares_to_host(cx, f(x), x.numel()); });
}

double sum(const Tensor& x) {
  if (any_bf16({&x})) {
    Widen wd(__func__);
    return sum(wd.in(x));
  }
  const Device d = common_device("sum", {&x});
  return on_device(
      d, "sum",
      [&] {
        double s = 0;
        const float* p = f(x);
        for (int64_t i = 0; i < x.numel(); ++i) s += p[i];
        return s;
      },
      [&](auto& cx) { return cuda::sum_to_host(cx, f(x), x.numel()); });
}

namespace {
// The device of a multi-tensor call, once every tensor is checked: fp32 (a
// bf16 one has no caller: gradients are fp32), defined, and on the device of
// the others that hold elements. No elements at all: the CPU.
Device multi_device(const char* op, const std::vector<Tensor>& xs) {
  const Tensor* first = nullptr;
  for (size_t i = 0; i < xs.size(); ++i) {
    const Tensor& x = xs[i];
    check(x.defined(), "{}: tensor {} of {} {} has no storage", op, i, xs.size(),
          x.shape().str());
    check(x.dtype() == DType::F32, "{}: tensor {} of {} {} is {}; every tensor must be F32", op,
          i, xs.size(), x.shape().str(), dtype_name(x.dtype()));
    if (x.raw() == nullptr) continue;
    if (first == nullptr) first = &x;
    check(x.device() == first->device(),
          "{}: tensors on {} and {}; every operand must be on one device", op,
          first->device().str(), x.device().str());
  }
  return first != nullptr ? first->device() : Device::cpu();
}

// The device table of sum_squares_multi and scale_multi, made on the first
// call, with this call's tensors in its scratch list. A template, as the CUDA
// branches are, so that a build without CUDA never instantiates it.
template <typename Table = cuda::MultiTensorTable>
Table& multi_table(std::shared_ptr<void>& cache, const std::vector<Tensor>& xs) {
  if (!cache) cache = std::make_shared<Table>();
  auto& table = *static_cast<Table*>(cache.get());
  table.scratch.clear();  // keeps its capacity
  for (const Tensor& x : xs) table.scratch.push_back({fw(x), x.numel()});
  return table;
}
}  // namespace

double sum_squares_multi(const std::vector<Tensor>& xs, std::shared_ptr<void>& cache) {
  const Device d = multi_device("sum_squares_multi", xs);
  return on_device(
      d, "sum_squares_multi",
      [&] {
        double s = 0;  // in order, as a loop over sum_squares adds them
        for (const Tensor& x : xs) s += cpu::sum_squares(f(x), x.numel());
        return s;
      },
      [&](auto& cx) {
        cuda::MultiTensorTable& table = multi_table(cache, xs);
        return cuda::sum_squares_multi(cx, table.scratch, table);
      });
}

void sum_squares_multi(const std::vector<Tensor>& xs, std::shared_ptr<void>& cache,
                       const Tensor& out) {
  check_numel("sum_squares_multi", "out", out, 1);
  check_dtype("sum_squares_multi", "out", out, DType::F32);
  const Device d = xs.empty() ? out.device() : multi_device("sum_squares_multi", xs);
  check(xs.empty() || out.device() == d,
        "sum_squares_multi: the tensors are on {}, out on {}; every operand must be on one device",
        d.str(), out.device().str());
  on_device(
      d, "sum_squares_multi",
      [&] { fw(out)[0] = static_cast<float>(sum_squares_multi(xs, cache)); },
      [&](auto& cx) {
        cuda::MultiTensorTable& table = multi_table(cache, xs);
        cuda::sum_squares_multi(cx, table.scratch, table, fw(out));
      });
}

void scale_multi(const std::vector<Tensor>& xs, const Tensor& s, std::shared_ptr<void>& cache) {
  check_numel("scale_multi", "the scale", s, 1);
  check_dtype("scale_multi", "the scale", s, DType::F32);
  const Device d = multi_device("scale_multi", xs);
  if (xs.empty() || d != s.device()) {
    check(xs.empty(), "scale_multi: the tensors are on {}, the scale on {}; every operand must be "
                      "on one device", d.str(), s.device().str());
    return;
  }
  on_device(
      d, "scale_multi", [&] { scale_multi(xs, f(s)[0], cache); },
      [&](auto& cx) {
        cuda::MultiTensorTable& table = multi_table(cache, xs);
        cuda::scale_multi(cx, table.scratch, 1.0f, table, f(s));
      });
}

void clip_coefficient(const Tensor& sum_squares, double max_norm, const Tensor& coef) {
  check_numel("clip_coefficient", "the sum of squares", sum_squares, 1);
  check_numel("clip_coefficient", "the coefficient", coef, 1);
  check_dtype("clip_coefficient", "the sum of squares", sum_squares, DType::F32);
  check_dtype("clip_coefficient", "the coefficient", coef, DType::F32);
  const Device d = common_device("clip_coefficient", {&sum_squares, &coef});
  on_device(
      d, "clip_coefficient",
      [&] {
        fw(coef)[0] = weft::clip_coefficient(
            max_norm, std::sqrt(static_cast<double>(f(sum_squares)[0])));
      },
      [&](auto& cx) { cuda::clip_coefficient(cx, f(sum_squares), max_norm, fw(coef)); });
}

void scale_multi(const std::vector<Tensor>& xs, float s, std::shared_ptr<void>& cache) {
  const Device d = multi_device("scale_multi", xs);
  on_device(
      d, "scale_multi",
      [&] {
        for (const Tensor& x : xs) cpu::scale_inplace(fw(x), s, x.numel());
      },
      [&](auto& cx) {
        cuda::MultiTensorTable& table = multi_table(cache, xs);
        cuda::scale_multi(cx, table.scratch, s, table);
      });
}

void sum(const Tensor& x, const Tensor& out) {
  check_numel("sum", "out", out, 1);
  check_dtype("sum", "out", out, DType::F32);
  if (any_bf16({&x})) {
    Widen wd(__func__);
    return sum(wd.in(x), out);
  }
  const Device d = common_device("sum", {&x, &out});
  on_device(
      d, "sum", [&] { fw(out)[0] = static_cast<float>(sum(x)); },
      [&](auto& cx) { cuda::sum(cx, f(x), x.numel(), fw(out)); });
}

float item(const Tensor& t) {
  check_numel("item", "the tensor", t, 1);
  check_dtype("item", "the tensor", t, DType::F32);
  return on_device(
      t.device(), "item", [&] { return f(t)[0]; },
      [&](auto& cx) {
        float v = 0;
        cuda::download(cx, &v, t.raw(), sizeof v);
        return v;
      });
}

void set_item(const Tensor& t, float value) {
  check_numel("set_item", "the tensor", t, 1);
  check_dtype("set_item", "the tensor", t, DType::F32);
  on_device(
      t.device(), "set_item", [&] { fw(t)[0] = value; },
      [&](auto& cx) { cuda::upload(cx, t.raw(), &value, sizeof value); });
}

void fill(const Tensor& t, float value) {
  check(t.dtype() == DType::F32 || t.dtype() == DType::BF16,
        "fill: the tensor must be F32 or BF16, got {}", dtype_name(t.dtype()));
  if (t.dtype() == DType::BF16) {  // the value rounded once
    const uint16_t bits = to_bf16(value);
    on_device(
        t.device(), "fill", [&] { std::fill_n(t.data<uint16_t>(), t.numel(), bits); },
        [&](auto& cx) { cuda::fill16(cx, t.data<uint16_t>(), bits, t.numel()); });
    return;
  }
  on_device(
      t.device(), "fill", [&] { std::fill_n(fw(t), t.numel(), value); },
      [&](auto& cx) {
        if (value == 0.0f) {
          cuda::zero(cx, t.raw(), t.nbytes());
        } else {
          uint32_t bits;
          std::memcpy(&bits, &value, sizeof bits);
          cuda::fill32(cx, static_cast<uint32_t*>(t.raw()), bits, t.numel());
        }
      });
}

// --- LayerNorm ---

void layernorm_forward(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& y,
                       const Tensor& mean, const Tensor& rstd, float eps) {
  if (any_bf16({&x, &w, &b, &y, &mean, &rstd})) {
    if (is_bf16(x) && is_bf16(y) && is_f32(w) && is_f32(b) && is_f32(mean) && is_f32(rstd) &&
        y.numel() == x.numel() &&
        on_gpu(common_device("layernorm_forward", {&x, &w, &b, &y, &mean, &rstd}),
               "layernorm_forward", [&](auto& cx) {
                 cuda::layernorm_forward(cx, b16(x), f(w), f(b), b16w(y), fw(mean), fw(rstd),
                                         x.shape().rows(), x.shape().last(), eps);
               }))
      return;
    Widen wd(__func__);
    layernorm_forward(wd.in(x), wd.in(w), wd.in(b), wd.out(y, false), wd.out(mean, false),
                      wd.out(rstd, false), eps);
    return wd.commit();
  }
  const Device d = common_device("layernorm_forward", {&x, &w, &b, &y, &mean, &rstd});
  const int64_t n = x.shape().rows(), c = x.shape().last();
  check_numel("layernorm_forward", "y", y, n * c);
  on_device(
      d, "layernorm_forward",
      [&] { cpu::layernorm_forward(f(x), f(w), f(b), fw(y), fw(mean), fw(rstd), n, c, eps); },
      [&](auto& cx) {
        cuda::layernorm_forward(cx, f(x), f(w), f(b), fw(y), fw(mean), fw(rstd), n, c, eps);
      });
}

void layernorm_backward_input(const Tensor& dy, const Tensor& x, const Tensor& w,
                              const Tensor& mean, const Tensor& rstd, const Tensor& dx) {
  if (any_bf16({&dy, &x, &w, &mean, &rstd, &dx})) {
    if (is_bf16(x) && is_bf16(dy) && is_f32(w) && is_bf16(dx) && is_f32(mean) && is_f32(rstd) &&
        dy.numel() == x.numel() && dx.numel() == x.numel() &&
        on_gpu(common_device("layernorm_backward_input", {&dy, &x, &w, &mean, &rstd, &dx}),
               "layernorm_backward_input", [&](auto& cx) {
                 cuda::layernorm_backward_input(cx, b16(dy), b16(x), f(w), f(mean), f(rstd),
                                                b16w(dx), x.shape().rows(), x.shape().last());
               }))
      return;
    Widen wd(__func__);
    layernorm_backward_input(wd.in(dy), wd.in(x), wd.in(w), wd.in(mean), wd.in(rstd),
                             wd.out(dx, true));
    return wd.commit();
  }
  const Device d = common_device("layernorm_backward_input", {&dy, &x, &w, &mean, &rstd, &dx});
  const int64_t n = x.shape().rows(), c = x.shape().last();
  on_device(
      d, "layernorm_backward_input",
      [&] {
        cpu::layernorm_backward_input(f(dy), f(x), f(w), f(mean), f(rstd), fw(dx), n, c);
      },
      [&](auto& cx) {
        cuda::layernorm_backward_input(cx, f(dy), f(x), f(w), f(mean), f(rstd), fw(dx), n, c);
      });
}

void layernorm_backward_weight(const Tensor& dy, const Tensor& x, const Tensor& mean,
                               const Tensor& rstd, const Tensor& dw, const Tensor& db) {
  if (any_bf16({&dy, &x, &mean, &rstd, &dw, &db})) {
    if (is_bf16(x) && is_bf16(dy) && is_f32(dw) && is_f32(db) && is_f32(mean) &&
        is_f32(rstd) && dy.numel() == x.numel() &&
        on_gpu(common_device("layernorm_backward_weight", {&dy, &x, &mean, &rstd, &dw, &db}),
               "layernorm_backward_weight", [&](auto& cx) {
                 cuda::layernorm_backward_weight(cx, b16(dy), b16(x), f(mean), f(rstd), fw(dw),
                                                 fw(db), x.shape().rows(), x.shape().last());
               }))
      return;
    Widen wd(__func__);
    layernorm_backward_weight(wd.in(dy), wd.in(x), wd.in(mean), wd.in(rstd), wd.out(dw, true),
                              wd.out(db, true));
    return wd.commit();
  }
  const Device d = common_device("layernorm_backward_weight", {&dy, &x, &mean, &rstd, &dw, &db});
  const int64_t n = x.shape().rows(), c = x.shape().last();
  on_device(
      d, "layernorm_backward_weight",
      [&] {
        cpu::layernorm_backward_weight(f(dy), f(x), f(mean), f(rstd), fw(dw), fw(db), n, c);
      },
      [&](auto& cx) {
        cuda::layernorm_backward_weight(cx, f(dy), f(x), f(mean), f(rstd), fw(dw), fw(db), n, c);
      });
}

void add_layernorm_forward(const Tensor& x, const Tensor& a, const Tensor& w, const Tensor& b,
                           const Tensor& sum, const Tensor& y, const Tensor& mean,
                           const Tensor& rstd, float eps) {
  const Device d =
      common_device("add_layernorm_forward", {&x, &a, &w, &b, &sum, &y, &mean, &rstd});
  const int64_t n = x.shape().rows(), c = x.shape().last();
  const DType dt = x.dtype();
  const bool one_kernel = !d.is_cpu() && (dt == DType::F32 || dt == DType::BF16) &&
                          a.dtype() == dt && sum.dtype() == dt && y.dtype() == dt && is_f32(w) &&
                          is_f32(b) && is_f32(mean) && is_f32(rstd) && a.numel() == n * c &&
                          sum.numel() == n * c && y.numel() == n * c && w.numel() == c &&
                          b.numel() == c && mean.numel() == n && rstd.numel() == n;
  if (one_kernel && on_device(
                        d, "add_layernorm_forward", [] { return false; },
                        [&](auto& cx) {
                          if (dt == DType::F32)
                            return cuda::add_layernorm_forward(cx, f(x), f(a), fw(sum), f(w),
                                                               f(b), fw(y), fw(mean), fw(rstd), n,
                                                               c, eps);
                          return cuda::add_layernorm_forward(cx, b16(x), b16(a), b16w(sum), f(w),
                                                             f(b), b16w(y), fw(mean), fw(rstd), n,
                                                             c, eps);
                        }))
    return;
  add(x, a, sum);
  layernorm_forward(sum, w, b, y, mean, rstd, eps);
}

void layernorm_backward_input_copy(const Tensor& dy, const Tensor& x, const Tensor& w,
                                   const Tensor& mean, const Tensor& rstd, const Tensor& dx,
                                   const Tensor& copy) {
  const Device d =
      common_device("layernorm_backward_input_copy", {&dy, &x, &w, &mean, &rstd, &dx, &copy});
  const int64_t n = x.shape().rows(), c = x.shape().last();
  const DType dt = x.dtype();
  const bool one_kernel = !d.is_cpu() && (dt == DType::F32 || dt == DType::BF16) &&
                          dy.dtype() == dt && dx.dtype() == dt && copy.dtype() == dt &&
                          is_f32(w) && is_f32(mean) && is_f32(rstd) && dy.numel() == n * c &&
                          dx.numel() == n * c && copy.numel() == n * c && w.numel() == c &&
                          mean.numel() == n && rstd.numel() == n;
  if (one_kernel && on_device(
                        d, "layernorm_backward_input_copy", [] { return false; },
                        [&](auto& cx) {
                          if (dt == DType::F32)
                            return cuda::layernorm_backward_input_copy(
                                cx, f(dy), f(x), f(w), f(mean), f(rstd), fw(dx), fw(copy), n, c);
                          return cuda::layernorm_backward_input_copy(cx, b16(dy), b16(x), f(w),
                                                                     f(mean), f(rstd), b16w(dx),
                                                                     b16w(copy), n, c);
                        }))
    return;
  layernorm_backward_input(dy, x, w, mean, rstd, dx);
  copy.copy_from(dx);
}

// --- RMSNorm, SwiGLU, rotary embedding ---

void rmsnorm_forward(const Tensor& x, const Tensor& w, const Tensor& y, const Tensor& rstd,
                     float eps) {
  if (any_bf16({&x, &w, &y, &rstd})) {
    if (is_bf16(x) && is_bf16(y) && is_f32(w) && is_f32(rstd) && y.numel() == x.numel() &&
        w.numel() == x.shape().last() && rstd.numel() == x.shape().rows() &&
        on_gpu(common_device("rmsnorm_forward", {&x, &w, &y, &rstd}), "rmsnorm_forward",
               [&](auto& cx) {
                 cuda::rmsnorm_forward(cx, b16(x), f(w), b16w(y), fw(rstd), x.shape().rows(),
                                       x.shape().last(), eps);
               }))
      return;
    Widen wd(__func__);
    rmsnorm_forward(wd.in(x), wd.in(w), wd.out(y, false), wd.out(rstd, false), eps);
    return wd.commit();
  }
  const Device d = common_device("rmsnorm_forward", {&x, &w, &y, &rstd});
  const int64_t n = x.shape().rows(), c = x.shape().last();
  check_numel("rmsnorm_forward", "y", y, n * c);
  check_numel("rmsnorm_forward", "the weight", w, c);
  on_device(
      d, "rmsnorm_forward", [&] { cpu::rmsnorm_forward(f(x), f(w), fw(y), fw(rstd), n, c, eps); },
      [&](auto& cx) { cuda::rmsnorm_forward(cx, f(x), f(w), fw(y), fw(rstd), n, c, eps); });
}

void rmsnorm_backward_input(const Tensor& dy, const Tensor& x, const Tensor& w,
                            const Tensor& rstd, const Tensor& dx) {
  if (any_bf16({&dy, &x, &w, &rstd, &dx})) {
    if (is_bf16(dy) && is_bf16(x) && is_bf16(dx) && is_f32(w) && is_f32(rstd) &&
        dy.numel() == x.numel() && dx.numel() == x.numel() && w.numel() == x.shape().last() &&
        rstd.numel() == x.shape().rows() &&
        on_gpu(common_device("rmsnorm_backward_input", {&dy, &x, &w, &rstd, &dx}),
               "rmsnorm_backward_input", [&](auto& cx) {
                 cuda::rmsnorm_backward_input(cx, b16(dy), b16(x), f(w), f(rstd), b16w(dx),
                                              x.shape().rows(), x.shape().last());
               }))
      return;
    Widen wd(__func__);
    rmsnorm_backward_input(wd.in(dy), wd.in(x), wd.in(w), wd.in(rstd), wd.out(dx, true));
    return wd.commit();
  }
  const Device d = common_device("rmsnorm_backward_input", {&dy, &x, &w, &rstd, &dx});
  const int64_t n = x.shape().rows(), c = x.shape().last();
  on_device(
      d, "rmsnorm_backward_input",
      [&] { cpu::rmsnorm_backward_input(f(dy), f(x), f(w), f(rstd), fw(dx), n, c); },
      [&](auto& cx) {
        cuda::rmsnorm_backward_input(cx, f(dy), f(x), f(w), f(rstd), fw(dx), n, c);
      });
}

void rmsnorm_backward_weight(const Tensor& dy, const Tensor& x, const Tensor& rstd,
                             const Tensor& dw) {
  if (any_bf16({&dy, &x, &rstd, &dw})) {
    if (is_bf16(dy) && is_bf16(x) && is_f32(rstd) && is_f32(dw) && dy.numel() == x.numel() &&
        dw.numel() == x.shape().last() && rstd.numel() == x.shape().rows() &&
        on_gpu(common_device("rmsnorm_backward_weight", {&dy, &x, &rstd, &dw}),
               "rmsnorm_backward_weight", [&](auto& cx) {
                 cuda::rmsnorm_backward_weight(cx, b16(dy), b16(x), f(rstd), fw(dw),
                                               x.shape().rows(), x.shape().last());
               }))
      return;
    Widen wd(__func__);
    rmsnorm_backward_weight(wd.in(dy), wd.in(x), wd.in(rstd), wd.out(dw, true));
    return wd.commit();
  }
  const Device d = common_device("rmsnorm_backward_weight", {&dy, &x, &rstd, &dw});
  const int64_t n = x.shape().rows(), c = x.shape().last();
  on_device(
      d, "rmsnorm_backward_weight",
      [&] { cpu::rmsnorm_backward_weight(f(dy), f(x), f(rstd), fw(dw), n, c); },
      [&](auto& cx) { cuda::rmsnorm_backward_weight(cx, f(dy), f(x), f(rstd), fw(dw), n, c); });
}

void swiglu_forward(const Tensor& x, const Tensor& y) {
  if (any_bf16({&x, &y})) {
    if (is_bf16(x) && is_bf16(y) && x.shape().last() % 2 == 0 && 2 * y.numel() == x.numel() &&
        on_gpu(common_device("swiglu_forward", {&x, &y}), "swiglu_forward", [&](auto& cx) {
          cuda::swiglu_forward(cx, b16(x), b16w(y), x.shape().rows(), x.shape().last() / 2);
        }))
      return;
    Widen wd(__func__);
    swiglu_forward(wd.in(x), wd.out(y, false));
    return wd.commit();
  }
  const Device d = common_device("swiglu_forward", {&x, &y});
  const int64_t n = x.shape().rows(), h = x.shape().last() / 2;
  check(x.shape().last() % 2 == 0, "swiglu_forward: the input width {} must be even (gate | up)",
        x.shape().last());
  check_numel("swiglu_forward", "y", y, n * h);
  on_device(
      d, "swiglu_forward", [&] { cpu::swiglu_forward(f(x), fw(y), n, h); },
      [&](auto& cx) { cuda::swiglu_forward(cx, f(x), fw(y), n, h); });
}

void swiglu_backward(const Tensor& dy, const Tensor& x, const Tensor& dx) {
  if (any_bf16({&dy, &x, &dx})) {
    if (is_bf16(dy) && is_bf16(x) && is_bf16(dx) && x.shape().last() % 2 == 0 &&
        2 * dy.numel() == x.numel() && dx.numel() == x.numel() &&
        on_gpu(common_device("swiglu_backward", {&dy, &x, &dx}), "swiglu_backward",
               [&](auto& cx) {
                 cuda::swiglu_backward(cx, b16(dy), b16(x), b16w(dx), x.shape().rows(),
                                       x.shape().last() / 2);
               }))
      return;
    Widen wd(__func__);
    swiglu_backward(wd.in(dy), wd.in(x), wd.out(dx, true));
    return wd.commit();
  }
  const Device d = common_device("swiglu_backward", {&dy, &x, &dx});
  const int64_t n = x.shape().rows(), h = x.shape().last() / 2;
  check_numel("swiglu_backward", "dx", dx, x.numel());
  on_device(
      d, "swiglu_backward", [&] { cpu::swiglu_backward(f(dy), f(x), fw(dx), n, h); },
      [&](auto& cx) { cuda::swiglu_backward(cx, f(dy), f(x), fw(dx), n, h); });
}

namespace {
// The head size of a packed qkv (B, T, (H + 2G) D), checked.
int64_t qkv_head_size(const char* op, const Tensor& qkv, int64_t heads, int64_t groups) {
  check(qkv.rank() == 3, "{}: qkv must be (B, T, (H + 2G) D), got {}", op, qkv.shape().str());
  check(heads > 0 && groups > 0 && heads % groups == 0,
        "{}: {} query heads must be a multiple of {} key/value groups", op, heads, groups);
  const int64_t w = qkv.dim(2), n = heads + 2 * groups;
  check(w % n == 0, "{}: width {} must be {} heads ({} query + 2 x {} key/value) of equal size",
        op, w, n, heads, groups);
  return w / n;
}
}  // namespace

void rope_forward(const Tensor& qkv, const Tensor& y, int64_t heads, int64_t groups, float base) {
  const Device d = common_device("rope_forward", {&qkv, &y});
  const int64_t hd = qkv_head_size("rope_forward", qkv, heads, groups);
  const int64_t b = qkv.dim(0), t = qkv.dim(1);
  check(hd % 2 == 0, "rope: the head size {} must be even", hd);
  check_numel("rope_forward", "y", y, qkv.numel());
  if (any_bf16({&qkv, &y})) {
    if (is_bf16(qkv) && is_bf16(y) && on_gpu(d, "rope_forward", [&](auto& cx) {
          cuda::rope_forward(cx, b16(qkv), b16w(y), b, t, heads, groups, hd, base);
        }))
      return;
    Widen wd(__func__);
    rope_forward(wd.in(qkv), wd.out(y, false), heads, groups, base);
    return wd.commit();
  }
  on_device(
      d, "rope_forward",
      [&] { cpu::rope_forward(f(qkv), fw(y), b, t, heads, groups, hd, base); },
      [&](auto& cx) { cuda::rope_forward(cx, f(qkv), fw(y), b, t, heads, groups, hd, base); });
}

void rope_backward(const Tensor& dy, const Tensor& dqkv, int64_t heads, int64_t groups,
                   float base) {
  const Device d = common_device("rope_backward", {&dy, &dqkv});
  const int64_t hd = qkv_head_size("rope_backward", dqkv, heads, groups);
  const int64_t b = dqkv.dim(0), t = dqkv.dim(1);
  check(hd % 2 == 0, "rope: the head size {} must be even", hd);
  check_numel("rope_backward", "dy", dy, dqkv.numel());
  if (any_bf16({&dy, &dqkv})) {
    if (is_bf16(dy) && is_bf16(dqkv) && on_gpu(d, "rope_backward", [&](auto& cx) {
          cuda::rope_backward(cx, b16(dy), b16w(dqkv), b, t, heads, groups, hd, base);
        }))
      return;
    Widen wd(__func__);
    rope_backward(wd.in(dy), wd.out(dqkv, true), heads, groups, base);
    return wd.commit();
  }
  on_device(
      d, "rope_backward",
      [&] { cpu::rope_backward(f(dy), fw(dqkv), b, t, heads, groups, hd, base); },
      [&](auto& cx) { cuda::rope_backward(cx, f(dy), fw(dqkv), b, t, heads, groups, hd, base); });
}

// --- GELU ---

void gelu_forward(const Tensor& x, const Tensor& y) {
  if (any_bf16({&x, &y})) {
    if (is_bf16(x) && is_bf16(y) && y.numel() == x.numel() &&
        on_gpu(common_device("gelu_forward", {&x, &y}), "gelu_forward",
               [&](auto& cx) { cuda::gelu_forward(cx, b16(x), b16w(y), x.numel()); }))
      return;
    Widen wd(__func__);
    gelu_forward(wd.in(x), wd.out(y, false));
    return wd.commit();
  }
  const Device d = common_device("gelu_forward", {&x, &y});
  check_numel("gelu_forward", "y", y, x.numel());
  on_device(
      d, "gelu_forward", [&] { cpu::gelu_forward(f(x), fw(y), x.numel()); },
      [&](auto& cx) { cuda::gelu_forward(cx, f(x), fw(y), x.numel()); });
}

void gelu_backward(const Tensor& dy, const Tensor& x, const Tensor& dx, bool accumulate) {
  if (any_bf16({&dy, &x, &dx})) {
    if (is_bf16(x) && is_bf16(dy) && is_bf16(dx) && dx.numel() == x.numel() &&
        dy.numel() == x.numel() &&
        on_gpu(common_device("gelu_backward", {&dy, &x, &dx}), "gelu_backward",
               [&](auto& cx) {
                 cuda::gelu_backward(cx, b16(dy), b16(x), b16w(dx), x.numel(), accumulate);
               }))
      return;
    Widen wd(__func__);
    gelu_backward(wd.in(dy), wd.in(x), wd.out(dx, accumulate), accumulate);
    return wd.commit();
  }
  const Device d = common_device("gelu_backward", {&dy, &x, &dx});
  check_numel("gelu_backward", "dx", dx, x.numel());
  on_device(
      d, "gelu_backward", [&] { cpu::gelu_backward(f(dy), f(x), fw(dx), x.numel(), accumulate); },
      [&](auto& cx) { cuda::gelu_backward(cx, f(dy), f(x), fw(dx), x.numel(), accumulate); });
}

// --- attention ---

void attention_forward(const Tensor& qkv, const Tensor& out, const Tensor& probs, int64_t heads,
                       int64_t groups) {
  if (any_bf16({&qkv, &out, &probs})) {
    Widen wd(__func__);
    attention_forward(wd.in(qkv), wd.out(out, false), wd.out(probs, false), heads, groups);
    return wd.commit();
  }
  const Device d = common_device("attention_forward", {&qkv, &out, &probs});
  const int64_t hd = qkv_head_size("attention_forward", qkv, heads, groups);
  const int64_t b = qkv.dim(0), t = qkv.dim(1);
  check_numel("attention_forward", "out", out, b * t * heads * hd);
  check_numel("attention_forward", "probs", probs, b * heads * t * t);
  on_device(
      d, "attention_forward",
      [&] {
        cpu::attention_forward(f(qkv), fw(out), fw(probs), b, t, heads, groups, hd,
                               cpu_rounding());
      },
      [&](auto& cx) {
        cuda::attention_forward(cx, math_mode(d), f(qkv), fw(out), fw(probs), b, t, heads, groups,
                                hd);
      });
}

void attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& probs,
                        const Tensor& dqkv, const Tensor& scratch, int64_t heads, int64_t groups) {
  if (any_bf16({&dout, &qkv, &probs, &dqkv, &scratch})) {
    Widen wd(__func__);
    attention_backward(wd.in(dout), wd.in(qkv), wd.in(probs), wd.out(dqkv, true),
                       wd.out(scratch, false), heads, groups);
    return wd.commit();
  }
  const Device d = common_device("attention_backward", {&dout, &qkv, &probs, &dqkv, &scratch});
  const int64_t hd = qkv_head_size("attention_backward", qkv, heads, groups);
  const int64_t b = qkv.dim(0), t = qkv.dim(1);
  check_numel("attention_backward", "dout", dout, b * t * heads * hd);
  check_numel("attention_backward", "dqkv", dqkv, qkv.numel());
  check(scratch.numel() >= b * heads * t * t,
        "attention_backward: scratch holds {} floats, needs {}", scratch.numel(),
        b * heads * t * t);
  on_device(
      d, "attention_backward",
      [&] {
        cpu::attention_backward(f(dout), f(qkv), f(probs), fw(dqkv), fw(scratch), b, t, heads,
                                groups, hd, cpu_rounding());
      },
      [&](auto& cx) {
        cuda::attention_backward(cx, math_mode(d), f(dout), f(qkv), f(probs), fw(dqkv),
                                 fw(scratch), b, t, heads, groups, hd);
      });
}

namespace {

std::array<std::atomic<AttentionBackend>, kMaxDevices> g_attention{};

// The head sizes cuDNN's fused attention takes (src/cuda/fused_attention.cc checks them too).
bool fused_head_size_ok(int64_t d) { return d % 8 == 0 && d <= 128; }

}  // namespace

const char* attention_backend_name(AttentionBackend b) {
  switch (b) {
    case AttentionBackend::Auto: return "auto";
    case AttentionBackend::Unfused: return "unfused";
    case AttentionBackend::Fused: return "fused";
  }
  return "?";
}

AttentionBackend parse_attention_backend(const std::string& name) {
  for (AttentionBackend b :
       {AttentionBackend::Auto, AttentionBackend::Unfused, AttentionBackend::Fused})
    if (name == attention_backend_name(b)) return b;
  throw Error("attention backend '{}' is not one of auto, unfused, fused", name);
}

bool fused_attention_built() { return WEFT_CUDA && WEFT_CUDNN; }

void set_attention_backend(Device device, AttentionBackend backend) {
  check(device.index >= 0 && device.index < kMaxDevices, "device index {} is out of [0, {})",
        device.index, kMaxDevices);
  if (backend == AttentionBackend::Fused) {
    check(!device.is_cpu(),
          "fused attention is cuDNN's, for CUDA devices: the CPU computes attention unfused");
    check(fused_attention_built(),
          "fused attention: weft was built without cuDNN's fused attention (it needs CUDA, "
          "cuDNN and the cudnn-frontend headers of scripts/cudnn-frontend.sh at set-up)");
  }
  if (!device.is_cpu()) g_attention[static_cast<size_t>(device.index)] = backend;
}

AttentionBackend attention_backend(Device device) {
  if (device.is_cpu() || device.index < 0 || device.index >= kMaxDevices)
    return AttentionBackend::Unfused;
  return g_attention[static_cast<size_t>(device.index)];
}

bool attention_uses_fused(Device device, int64_t head_size) {
  switch (attention_backend(device)) {
    case AttentionBackend::Unfused: return false;
    case AttentionBackend::Fused: return true;
    case AttentionBackend::Auto:
      return fused_attention_built() && !device.is_cpu() &&
             matmul_precision(device) == MatmulPrecision::Bf16 && fused_head_size_ok(head_size);
  }
  return false;
}

void attention_forward_fused(const Tensor& qkv, const Tensor& out, const Tensor& lse,
                             int64_t heads, int64_t groups) {
#if WEFT_CUDNN
  if (is_bf16(qkv) && is_bf16(out) && is_f32(lse)) {
    const Device d = common_device("attention_forward_fused", {&qkv, &out, &lse});
    const int64_t hd = qkv_head_size("attention_forward_fused", qkv, heads, groups);
    const int64_t b = qkv.dim(0), t = qkv.dim(1);
    check_numel("attention_forward_fused", "out", out, b * t * heads * hd);
    check_numel("attention_forward_fused", "lse", lse, b * heads * t);
    if (on_gpu(d, "attention_forward_fused", [&](auto& cx) {
          cuda::fused_attention_forward(cx, b16(qkv), b16w(out), fw(lse), b, t, heads, groups,
                                        hd);
        }))
      return;
  }
  // (Without cuDNN the call below refuses whatever the dtypes.)
  if (any_bf16({&qkv, &out, &lse})) {
    Widen wd(__func__);
    attention_forward_fused(wd.in(qkv), wd.out(out, false), wd.out(lse, false), heads, groups);
    return wd.commit();
  }
#endif
  const Device d = common_device("attention_forward_fused", {&qkv, &out, &lse});
  const int64_t hd = qkv_head_size("attention_forward_fused", qkv, heads, groups);
  const int64_t b = qkv.dim(0), t = qkv.dim(1);
  check_numel("attention_forward_fused", "out", out, b * t * heads * hd);
  check_numel("attention_forward_fused", "lse", lse, b * heads * t);
  on_device(
      d, "attention_forward_fused",
      [&] { throw Error("attention_forward_fused on cpu: fused attention is CUDA's (cuDNN)"); },
      [&](auto& cx) {
#if WEFT_CUDNN
        cuda::fused_attention_forward(cx, f(qkv), fw(out), fw(lse), b, t, heads, groups, hd);
#else
        (void)cx;
        throw Error("attention_forward_fused: weft was built without cuDNN's fused attention");
#endif
      });
}

void attention_backward_fused(const Tensor& dout, const Tensor& qkv, const Tensor& out,
                              const Tensor& lse, const Tensor& dqkv, int64_t heads,
                              int64_t groups, bool accumulate) {
#if WEFT_CUDNN
  if (is_bf16(dout) && is_bf16(qkv) && is_bf16(out) && is_f32(lse) && is_bf16(dqkv)) {
    const Device d = common_device("attention_backward_fused", {&dout, &qkv, &out, &lse, &dqkv});
    const int64_t hd = qkv_head_size("attention_backward_fused", qkv, heads, groups);
    const int64_t b = qkv.dim(0), t = qkv.dim(1);
    check_numel("attention_backward_fused", "dout", dout, b * t * heads * hd);
    check_numel("attention_backward_fused", "out", out, b * t * heads * hd);
    check_numel("attention_backward_fused", "lse", lse, b * heads * t);
    check_numel("attention_backward_fused", "dqkv", dqkv, qkv.numel());
    if (on_gpu(d, "attention_backward_fused", [&](auto& cx) {
          cuda::fused_attention_backward(cx, b16(dout), b16(qkv), b16(out), f(lse), b16w(dqkv), b,
                                         t, heads, groups, hd, accumulate);
        }))
      return;
  }
  if (any_bf16({&dout, &qkv, &out, &lse, &dqkv})) {
    Widen wd(__func__);
    attention_backward_fused(wd.in(dout), wd.in(qkv), wd.in(out), wd.in(lse),
                             wd.out(dqkv, accumulate), heads, groups, accumulate);
    return wd.commit();
  }
#endif
  const Device d = common_device("attention_backward_fused", {&dout, &qkv, &out, &lse, &dqkv});
  const int64_t hd = qkv_head_size("attention_backward_fused", qkv, heads, groups);
  const int64_t b = qkv.dim(0), t = qkv.dim(1);
  check_numel("attention_backward_fused", "dout", dout, b * t * heads * hd);
  check_numel("attention_backward_fused", "out", out, b * t * heads * hd);
  check_numel("attention_backward_fused", "lse", lse, b * heads * t);
  check_numel("attention_backward_fused", "dqkv", dqkv, qkv.numel());
  on_device(
      d, "attention_backward_fused",
      [&] { throw Error("attention_backward_fused on cpu: fused attention is CUDA's (cuDNN)"); },
      [&](auto& cx) {
#if WEFT_CUDNN
        cuda::fused_attention_backward(cx, f(dout), f(qkv), f(out), f(lse), fw(dqkv), b, t,
                                       heads, groups, hd, accumulate);
#else
        (void)accumulate;
        (void)cx;
        throw Error("attention_backward_fused: weft was built without cuDNN's fused attention");
#endif
      });
}

// --- embedding ---

void check_token_range(const Tensor& tokens, int64_t vocab, const char* what) {
  check_dtype("check_token_range", "tokens", tokens, DType::I32);
  if (!tokens.device().is_cpu()) return;
  const int32_t* tp = i32(tokens);
  for (int64_t i = 0; i < tokens.numel(); ++i)
    check(tp[i] >= 0 && tp[i] < vocab, "{} {} at position {} is outside the vocabulary [0, {})",
          what, tp[i], i, vocab);
}

void embedding_forward(const Tensor& tokens, const Tensor& wte, int64_t first, const Tensor& wpe,
                       const Tensor& y) {
  if (any_bf16({&wte, &wpe, &y})) {
    if (is_bf16(y) && is_f32(wte) && is_f32(wpe) && tokens.dtype() == DType::I32 &&
        y.numel() == tokens.numel() * wte.dim(1) &&
        on_gpu(common_device("embedding_forward", {&tokens, &wte, &wpe, &y}), "embedding_forward",
               [&](auto& cx) {
                 cuda::embedding_forward(cx, i32(tokens), f(wte),
                                         wpe.defined() && wpe.numel() > 0 ? f(wpe) : nullptr,
                                         b16w(y), tokens.dim(0), tokens.dim(1), wte.dim(1),
                                         wte.dim(0), first);
               }))
      return;
    Widen wd(__func__);
    embedding_forward(tokens, wd.in(wte), first, wd.in(wpe), wd.out(y, false));
    return wd.commit();
  }
  const Device d = common_device("embedding_forward", {&tokens, &wte, &wpe, &y});
  check_dtype("embedding_forward", "tokens", tokens, DType::I32);
  const int64_t b = tokens.dim(0), t = tokens.dim(1), c = wte.dim(1), rows = wte.dim(0);
  const float* pos = wpe.defined() && wpe.numel() > 0 ? f(wpe) : nullptr;
  check_numel("embedding_forward", "y", y, b * t * c);
  on_device(
      d, "embedding_forward",
      [&] { cpu::embedding_forward(i32(tokens), f(wte), rows, first, pos, fw(y), b, t, c); },
      [&](auto& cx) {
        cuda::embedding_forward(cx, i32(tokens), f(wte), pos, fw(y), b, t, c, rows, first);
      });
}

void embedding_backward(const Tensor& tokens, const Tensor& dy, const Tensor& dwte, int64_t first,
                        const Tensor& dwpe) {
  if (any_bf16({&dy, &dwte, &dwpe})) {
    if (is_bf16(dy) && is_f32(dwte) && (!dwpe.defined() || is_f32(dwpe)) &&
        is_i32(tokens) && dy.numel() == tokens.numel() * dwte.dim(1) &&
        on_gpu(common_device("embedding_backward", {&tokens, &dy, &dwte, &dwpe}),
               "embedding_backward", [&](auto& cx) {
                 float* pos = dwpe.defined() && dwpe.numel() > 0 ? fw(dwpe) : nullptr;
                 cuda::embedding_backward(cx, i32(tokens), b16(dy), fw(dwte), pos, tokens.dim(0),
                                          tokens.dim(1), dwte.dim(1), dwte.dim(0), first);
               }))
      return;
    Widen wd(__func__);
    embedding_backward(tokens, wd.in(dy), wd.out(dwte, true), first, wd.out(dwpe, true));
    return wd.commit();
  }
  const Device d = common_device("embedding_backward", {&tokens, &dy, &dwte, &dwpe});
  check_dtype("embedding_backward", "tokens", tokens, DType::I32);
  const int64_t b = tokens.dim(0), t = tokens.dim(1), c = dwte.dim(1), rows = dwte.dim(0);
  float* pos = dwpe.defined() && dwpe.numel() > 0 ? fw(dwpe) : nullptr;  // none: no positions
  on_device(
      d, "embedding_backward",
      [&] { cpu::embedding_backward(i32(tokens), f(dy), fw(dwte), rows, first, pos, b, t, c); },
      [&](auto& cx) {
        cuda::embedding_backward(cx, i32(tokens), f(dy), fw(dwte), pos, b, t, c, rows, first);
      });
}

// --- cross-entropy ---

void mask_columns(const Tensor& logits, int64_t from) {
  const Device d = common_device("mask_columns", {&logits});
  const int64_t n = logits.shape().rows(), v = logits.shape().last();
  check(from >= 0 && from <= v, "mask_columns: column {} is outside the {} columns of {}", from, v,
        logits.shape().str());
  if (from == v) return;
  if (is_bf16(logits)) {  // -inf is exact in bf16: the widened path gives the same bits
    if (on_gpu(d, "mask_columns",
               [&](auto& cx) { cuda::mask_columns(cx, b16w(logits), n, v, from); }))
      return;
    Widen wd(__func__);
    mask_columns(wd.out(logits, true), from);
    return wd.commit();
  }
  check_dtype("mask_columns", "logits", logits, DType::F32);
  on_device(
      d, "mask_columns", [&] { cpu::mask_columns(fw(logits), n, v, from); },
      [&](auto& cx) { cuda::mask_columns(cx, fw(logits), n, v, from); });
}

double softmax_cross_entropy(const Tensor& logits, const Tensor& targets, const Tensor& losses) {
  if (any_bf16({&logits, &losses})) {
    Widen wd(__func__);
    const double r = softmax_cross_entropy(wd.out(logits, true), targets, wd.out(losses, false));
    wd.commit();
    return r;
  }
  const Device d = common_device("softmax_cross_entropy", {&logits, &targets, &losses});
  check_dtype("softmax_cross_entropy", "targets", targets, DType::I32);
  const int64_t n = logits.shape().rows(), v = logits.shape().last();
  check_numel("softmax_cross_entropy", "targets", targets, n);
  check_numel("softmax_cross_entropy", "losses", losses, n);
  return on_device(
      d, "softmax_cross_entropy",
      [&] { return cpu::softmax_cross_entropy(fw(logits), i32(targets), fw(losses), n, v); },
      [&](auto& cx) {
        cuda::softmax_cross_entropy(cx, fw(logits), i32(targets), fw(losses), n, v);
        return cuda::sum_to_host(cx, f(losses), n);
      });
}

namespace {
// The fused classifier's checks: logits (N, V), fp32 (or bf16 with bf16
// dlogits), N int32 targets, N losses, all on one device (and dlogits, when
// given, of the logits' shape). Returns that device.
Device check_classifier(const char* op, const Tensor& logits, const Tensor& targets,
                        const Tensor& losses, const Tensor& dlogits = Tensor()) {
  const Device d = dlogits.defined() ? common_device(op, {&logits, &targets, &losses, &dlogits})
                                     : common_device(op, {&logits, &targets, &losses});
  if (is_bf16(logits) && dlogits.defined())
    check_dtype(op, "dlogits (for bf16 logits)", dlogits, DType::BF16);
  else
    check_dtype(op, "logits", logits, DType::F32);
  check_dtype(op, "targets", targets, DType::I32);
  check_numel(op, "targets", targets, logits.shape().rows());
  check_numel(op, "losses", losses, logits.shape().rows());
  check(!dlogits.defined() || dlogits.shape() == logits.shape(),
        "{}: dlogits {} for logits {}: the shapes must match", op, dlogits.shape().str(),
        logits.shape().str());
  return d;
}
}  // namespace

double fused_cross_entropy(const Tensor& logits, const Tensor& targets, const Tensor& losses,
                           float scale) {
  fused_cross_entropy_rows(logits, targets, losses, scale);
  return sum(losses);
}

void fused_cross_entropy_rows(const Tensor& logits, const Tensor& targets, const Tensor& losses,
                              float scale) {
  const Device d = check_classifier("fused_cross_entropy_rows", logits, targets, losses);
  const int64_t n = logits.shape().rows(), v = logits.shape().last();
  on_device(
      d, "fused_cross_entropy_rows",
      [&] {
        cpu::softmax_cross_entropy(fw(logits), i32(targets), fw(losses), n, v);
        cpu::cross_entropy_backward(f(logits), i32(targets), fw(logits), scale, n, v, 0);
      },
      [&](auto& cx) {
        cuda::fused_cross_entropy(cx, fw(logits), i32(targets), fw(losses), scale, n, v);
      });
}

void fused_cross_entropy_rows(const Tensor& logits, const Tensor& targets, const Tensor& losses,
                              float scale, const Tensor& dlogits) {
  const Device d = check_classifier("fused_cross_entropy_rows", logits, targets, losses, dlogits);
  if (is_bf16(logits)) {  // bf16 dlogits too; they may be the logits themselves
    if (on_gpu(d, "fused_cross_entropy_rows", [&](auto& cx) {
          cuda::fused_cross_entropy(cx, b16(logits), b16w(dlogits), i32(targets), fw(losses),
                                    scale, logits.shape().rows(), logits.shape().last());
        }))
      return;
    Widen wd(__func__);  // the CPU: the fp32 classifier on the exact widened logits, rounded once
    const Tensor wide = wd.in(logits);
    fused_cross_entropy_rows(wide, targets, losses, scale);
    convert(wide, dlogits);
    return;
  }
  if (dlogits.raw() == logits.raw()) return fused_cross_entropy_rows(logits, targets, losses, scale);
  if (is_bf16(dlogits)) {
    if (on_gpu(d, "fused_cross_entropy_rows", [&](auto& cx) {
          cuda::fused_cross_entropy(cx, f(logits), b16w(dlogits), i32(targets), fw(losses), scale,
                                    logits.shape().rows(), logits.shape().last());
        }))
      return;
    fused_cross_entropy_rows(logits, targets, losses, scale);  // the CPU: in place, then rounded
    convert(logits, dlogits);
    return;
  }
  check_dtype("fused_cross_entropy_rows", "dlogits", dlogits, DType::F32);
  dlogits.copy_from(logits);
  fused_cross_entropy_rows(dlogits, targets, losses, scale);
}

void cross_entropy_backward(const Tensor& probs, const Tensor& targets, int64_t first,
                            const Tensor& dlogits, float scale) {
  if (any_bf16({&probs, &dlogits})) {
    Widen wd(__func__);
    cross_entropy_backward(wd.in(probs), targets, first, wd.out(dlogits, false), scale);
    return wd.commit();
  }
  const Device d = common_device("cross_entropy_backward", {&probs, &targets, &dlogits});
  const int64_t n = probs.shape().rows(), v = probs.shape().last();
  check_numel("cross_entropy_backward", "dlogits", dlogits, n * v);
  on_device(
      d, "cross_entropy_backward",
      [&] { cpu::cross_entropy_backward(f(probs), i32(targets), fw(dlogits), scale, n, v, first); },
      [&](auto& cx) {
        cuda::cross_entropy_backward(cx, f(probs), i32(targets), fw(dlogits), scale, n, v, first);
      });
}

void row_max(const Tensor& logits, const Tensor& max) {
  if (any_bf16({&logits, &max})) {
    Widen wd(__func__);
    row_max(wd.in(logits), wd.out(max, false));
    return wd.commit();
  }
  const Device d = common_device("row_max", {&logits, &max});
  const int64_t n = logits.shape().rows(), v = logits.shape().last();
  check_numel("row_max", "max", max, n);
  on_device(
      d, "row_max", [&] { cpu::row_max(f(logits), fw(max), n, v); },
      [&](auto& cx) { cuda::row_max(cx, f(logits), fw(max), n, v); });
}

void exp_and_stats(const Tensor& logits, const Tensor& targets, int64_t first, const Tensor& max,
                   const Tensor& stats) {
  if (any_bf16({&logits, &max, &stats})) {
    Widen wd(__func__);
    exp_and_stats(wd.out(logits, true), targets, first, wd.in(max), wd.out(stats, false));
    return wd.commit();
  }
  const Device d = common_device("exp_and_stats", {&logits, &targets, &max, &stats});
  const int64_t n = logits.shape().rows(), v = logits.shape().last();
  check_numel("exp_and_stats", "stats", stats, 2 * n);
  on_device(
      d, "exp_and_stats",
      [&] {
        cpu::exp_and_stats(fw(logits), i32(targets), first, f(max), fw(stats), fw(stats) + n, n,
                           v);
      },
      [&](auto& cx) {
        cuda::exp_and_stats(cx, fw(logits), i32(targets), first, f(max), fw(stats), fw(stats) + n,
                            n, v);
      });
}

void normalise_and_loss(const Tensor& exps, const Tensor& stats, const Tensor& loss) {
  check_numel("normalise_and_loss", "loss", loss, 1);
  check_dtype("normalise_and_loss", "loss", loss, DType::F32);
  if (any_bf16({&exps, &stats})) {
    Widen wd(__func__);
    normalise_and_loss(wd.out(exps, true), wd.in(stats), loss);
    return wd.commit();
  }
  const Device d = common_device("normalise_and_loss", {&exps, &stats, &loss});
  const int64_t n = exps.shape().rows(), v = exps.shape().last();
  check_numel("normalise_and_loss", "stats", stats, 2 * n);
  on_device(
      d, "normalise_and_loss",
      [&] {
        fw(loss)[0] =
            static_cast<float>(cpu::normalise_and_loss(fw(exps), f(stats), f(stats) + n, n, v));
      },
      [&](auto& cx) {
        cuda::normalise_and_loss(cx, fw(exps), f(stats), f(stats) + n, n, v, fw(loss));
      });
}

// --- mean-squared error ---

double mse_loss(const Tensor& pred, const Tensor& target) {
  if (any_bf16({&pred, &target})) {
    Widen wd(__func__);
    const double r = mse_loss(wd.in(pred), wd.in(target));
    wd.commit();
    return r;
  }
  const Device d = common_device("mse_loss", {&pred, &target});
  check_numel("mse_loss", "target", target, pred.numel());
  return on_device(
      d, "mse_loss", [&] { return cpu::mse_loss(f(pred), f(target), pred.numel()); },
      [&](auto&) -> double { no_cuda_kernel("mse_loss", d); });
}

void mse_backward(const Tensor& pred, const Tensor& target, float g, const Tensor& dx) {
  if (any_bf16({&pred, &target, &dx})) {
    Widen wd(__func__);
    mse_backward(wd.in(pred), wd.in(target), g, wd.out(dx, true));
    return wd.commit();
  }
  const Device d = common_device("mse_backward", {&pred, &target, &dx});
  check_numel("mse_backward", "the gradient", dx, pred.numel());
  on_device(
      d, "mse_backward", [&] { cpu::mse_backward(f(pred), f(target), g, fw(dx), pred.numel()); },
      [&](auto&) { no_cuda_kernel("mse_backward", d); });
}

// --- AdamW ---

void sgd(const Tensor& p, const Tensor& g, const Tensor& buf, float lr, float momentum,
         float weight_decay) {
  const Device d = common_device("sgd", {&p, &g, &buf});
  const int64_t n = p.numel();
  check_numel("sgd", "the gradient", g, n);
  check_numel("sgd", "the momentum buffer", buf, n);
  on_device(
      d, "sgd", [&] { cpu::sgd(fw(p), f(g), fw(buf), n, lr, momentum, weight_decay); },
      [&](auto& cx) { cuda::sgd(cx, fw(p), f(g), fw(buf), n, lr, momentum, weight_decay); });
}

namespace {
void check_grad_scale_at(const char* op, const Tensor& at, Device d) {
  if (!at.defined()) return;
  check_numel(op, "grad_scale_at", at, 1);
  check_dtype(op, "grad_scale_at", at, DType::F32);
  check(at.device() == d,
        "{}: grad_scale_at is on {}, the update on {}; every operand must be on one device", op,
        at.device().str(), d.str());
}
const float* scale_at(const Tensor& at) { return at.defined() ? f(at) : nullptr; }
}  // namespace

void lion(const Tensor& p, const Tensor& g, const Tensor& m, float lr, float beta1, float beta2,
          float weight_decay, float grad_scale, const Tensor& grad_scale_at) {
  const Device d = common_device("lion", {&p, &g, &m});
  const int64_t n = p.numel();
  check_numel("lion", "the gradient", g, n);
  check_numel("lion", "the momentum", m, n);
  check_grad_scale_at("lion", grad_scale_at, d);
  on_device(
      d, "lion",
      [&] {
        cpu::lion(fw(p), f(g), fw(m), n, lr, beta1, beta2, weight_decay,
                  grad_scale_at.defined() ? f(grad_scale_at)[0] : grad_scale);
      },
      [&](auto& cx) {
        cuda::lion(cx, fw(p), f(g), fw(m), n, lr, beta1, beta2, weight_decay, grad_scale,
                   scale_at(grad_scale_at));
      });
}

void adamw(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v,
           const AdamWStep& s, const Tensor& grad_scale_at) {
  const Device d = common_device("adamw", {&p, &g, &m, &v});
  const int64_t n = p.numel();
  check_numel("adamw", "the gradient", g, n);
  check_numel("adamw", "exp_avg", m, n);
  check_numel("adamw", "exp_avg_sq", v, n);
  check_grad_scale_at("adamw", grad_scale_at, d);
  on_device(
      d, "adamw",
      [&] {
        cpu::adamw(fw(p), f(g), fw(m), fw(v), n, s.lr, s.beta1, s.beta2, s.eps, s.weight_decay,
                   s.step, grad_scale_at.defined() ? f(grad_scale_at)[0] : s.grad_scale);
      },
      [&](auto& cx) {
        cuda::adamw(cx, fw(p), f(g), fw(m), fw(v), n, s.lr, s.beta1, s.beta2, s.eps,
                    s.weight_decay, s.step, s.grad_scale, scale_at(grad_scale_at));
      });
}

void adamw_multi(const std::vector<AdamWTensors>& ts, const AdamWStep& s,
                 std::shared_ptr<void>& cache, const Tensor& grad_scale_at) {
  if (ts.empty()) return;
  const Device d = common_device("adamw_multi", {&ts[0].p});
  for (const AdamWTensors& t : ts) {
    const int64_t n = t.p.numel();
    check(t.p.device() == d && t.g.device() == d && t.m.device() == d && t.v.device() == d,
          "adamw_multi: tensors on {} and {}; every operand must be on one device", d.str(),
          t.p.device().str());
    check_numel("adamw_multi", "the gradient", t.g, n);
    check_numel("adamw_multi", "exp_avg", t.m, n);
    check_numel("adamw_multi", "exp_avg_sq", t.v, n);
  }
  check_grad_scale_at("adamw_multi", grad_scale_at, d);
  on_device(
      d, "adamw_multi",
      [&] {
        for (const AdamWTensors& t : ts) {
          AdamWStep one = s;
          one.weight_decay = t.decay ? s.weight_decay : 0.0f;
          adamw(t.p, t.g, t.m, t.v, one, grad_scale_at);
        }
      },
      [&](auto& cx) {
        if (!cache) cache = std::make_shared<cuda::AdamWTable>();
        auto& table = *static_cast<cuda::AdamWTable*>(cache.get());
        table.scratch.clear();  // keeps its capacity
        for (const AdamWTensors& t : ts)
          table.scratch.push_back({fw(t.p), f(t.g), fw(t.m), fw(t.v), t.p.numel(), t.decay});
        cuda::adamw_multi(cx, table.scratch, table, s.lr, s.beta1, s.beta2, s.eps,
                          s.weight_decay, s.step, s.grad_scale, scale_at(grad_scale_at));
      });
}

}  // namespace weft::ops
