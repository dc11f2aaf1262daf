// weft/ops.h: dtype conversions and the matmul precision of each device.
#include "src/ops/dispatch.h"

namespace weft::ops {

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
        // Element by element, so threads change nothing but the time.
        if (down) {
          const float* x = src.data<float>();
          uint16_t* y = dst.data<uint16_t>();
#pragma omp parallel for schedule(static) if (n >= (int64_t{1} << 16))
          for (int64_t i = 0; i < n; ++i) y[i] = to_bf16(x[i]);
        } else {
          const uint16_t* x = src.data<uint16_t>();
          float* y = dst.data<float>();
#pragma omp parallel for schedule(static) if (n >= (int64_t{1} << 16))
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

}  // namespace weft::ops
