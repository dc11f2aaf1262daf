// The device dispatch of weft/ops.h, written once for every family of
// operations (src/ops/*.cc): each operation checks its tensors once, then
// runs the cpu:: kernel or the cuda:: kernel of their device.
//
// on_device(device, op, cpu, cuda) is the one place that chooses. The CUDA
// branch is a generic lambda taking the device's cuda::Context; in a build
// without CUDA it is never instantiated (the cuda:: declarations are plain
// C++, and nothing of them is linked), and asking for a CUDA tensor there
// throws instead. Internal to src/ops/.
#pragma once

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


// Every tensor of one call on one device; returns that device.
inline Device common_device(const char* op, std::initializer_list<const Tensor*> ts) {
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

inline void check_dtype(const char* op, const char* name, const Tensor& t, DType want) {
  check(t.dtype() == want, "{}: {} must be {}, got {}", op, name, dtype_name(want),
        dtype_name(t.dtype()));
}

inline void check_numel(const char* op, const char* name, const Tensor& t, int64_t want) {
  check(t.numel() == want, "{}: {} has {} elements {}, expected {}", op, name, t.numel(),
        t.shape().str(), want);
}

inline constexpr int kMaxDevices = 64;
inline std::array<std::atomic<MatmulPrecision>, kMaxDevices> g_precision{};
inline std::atomic<MatmulPrecision> g_cpu_precision{MatmulPrecision::Fp32};

inline cuda::MathMode math_mode(Device d) {
  switch (matmul_precision(d)) {
    case MatmulPrecision::Fp32: return cuda::MathMode::FP32;
    case MatmulPrecision::Tf32: return cuda::MathMode::TF32;
    case MatmulPrecision::Bf16: return cuda::MathMode::BF16;
    case MatmulPrecision::Fp16: return cuda::MathMode::FP16;
  }
  return cuda::MathMode::FP32;
}

// The CPU's emulation of the same rounding (Tf32 is never set there).
inline cpu::Rounding cpu_rounding() {
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
[[noreturn]] inline void no_cuda_kernel(const char* op, Device d) {
  throw Error("{} on {}: this operation has no CUDA kernel yet", op, d.str());
}

// The kernels' pointers. A float pointer to a tensor of another dtype is a
// bug in this file (an operation that forgot to widen), never a user's error.
inline float* fp32_data(const Tensor& t) {
  if (t.dtype() != DType::F32)
    throw Error("internal: a {} tensor {} reached an fp32 kernel", dtype_name(t.dtype()),
                t.shape().str());
  return t.data<float>();
}
inline const float* f(const Tensor& t) { return fp32_data(t); }
inline float* fw(const Tensor& t) { return fp32_data(t); }
inline const int32_t* i32(const Tensor& t) { return t.data<int32_t>(); }
// An optional int32 input: null where undefined.
inline const int32_t* opt_i32(const Tensor& t) { return t.defined() ? t.data<int32_t>() : nullptr; }

inline bool any_bf16(std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts)
    if (t->defined() && t->dtype() == DType::BF16) return true;
  return false;
}

inline std::mutex& widened_mu() {
  static std::mutex mu;
  return mu;
}
inline std::map<std::string, int64_t>& widened_counts() {
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

inline bool is_bf16(const Tensor& t) { return t.dtype() == DType::BF16; }
inline bool is_f32(const Tensor& t) { return t.dtype() == DType::F32; }
inline bool is_i32(const Tensor& t) { return t.dtype() == DType::I32; }
inline const cuda::bf16* b16(const Tensor& t) { return t.data<cuda::bf16>(); }
inline cuda::bf16* b16w(const Tensor& t) { return t.data<cuda::bf16>(); }

// A bf16 kernel's call on a GPU; false on the CPU, which widens instead.
template <typename Cuda>
bool on_gpu(Device d, const char* op, Cuda&& on_cuda) {
  if (d.is_cpu()) return false;
  on_device(d, op, [] {}, std::forward<Cuda>(on_cuda));
  return true;
}


}  // namespace weft::ops
