// weft/ops.h: rotary embedding and causal self-attention (unfused, and
// cuDNN's fused flash attention where it runs).
#include "src/ops/dispatch.h"

namespace weft::ops {

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

// Positions, where given, are (B, T) int32 on the activations' device.
void check_positions_for(const char* op, const Tensor& positions, int64_t b, int64_t t) {
  if (!positions.defined()) return;
  check(positions.dtype() == DType::I32 && positions.rank() == 2 && positions.dim(0) == b &&
            positions.dim(1) == t,
        "{}: positions must be ({}, {}) int32, got {} {}", op, b, t, dtype_name(positions.dtype()),
        positions.shape().str());
  check_positions(positions);
}
}  // namespace

void check_positions(const Tensor& positions, int64_t limit) {
  check_dtype("check_positions", "positions", positions, DType::I32);
  if (!positions.device().is_cpu()) return;
  const int64_t t = positions.dim(positions.rank() - 1);
  const int32_t* p = i32(positions);
  for (int64_t i = 0; i < positions.numel(); ++i) {
    const int64_t prev = i % t == 0 ? -1 : p[i - 1];
    check(p[i] == 0 || p[i] == prev + 1,
          "position {} at token {} of sequence {} must be 0 (a document's first token) or one "
          "more than the token before it's ({})",
          p[i], i % t, i / t, prev);
    check(limit <= 0 || p[i] < limit,
          "position {} at token {} of sequence {} is past the {} "
          "positions of the table",
          p[i], i % t, i / t, limit);
  }
}

void rope_forward(const Tensor& qkv, const Tensor& y, int64_t heads, int64_t groups, float base,
                  const Tensor& positions) {
  const Device d = common_device("rope_forward", {&qkv, &y});
  const int64_t hd = qkv_head_size("rope_forward", qkv, heads, groups);
  const int64_t b = qkv.dim(0), t = qkv.dim(1);
  check(hd % 2 == 0, "rope: the head size {} must be even", hd);
  check_numel("rope_forward", "y", y, qkv.numel());
  check_positions_for("rope_forward", positions, b, t);
  const int32_t* pos = opt_i32(positions);
  if (any_bf16({&qkv, &y})) {
    if (is_bf16(qkv) && is_bf16(y) && on_gpu(d, "rope_forward", [&](auto& cx) {
          cuda::rope_forward(cx, b16(qkv), b16w(y), b, t, heads, groups, hd, base, pos);
        }))
      return;
    Widen wd(__func__);
    rope_forward(wd.in(qkv), wd.out(y, false), heads, groups, base, positions);
    return wd.commit();
  }
  on_device(
      d, "rope_forward",
      [&] { cpu::rope_forward(f(qkv), fw(y), b, t, heads, groups, hd, base, pos); },
      [&](auto& cx) { cuda::rope_forward(cx, f(qkv), fw(y), b, t, heads, groups, hd, base, pos); });
}

void rope_backward(const Tensor& dy, const Tensor& dqkv, int64_t heads, int64_t groups, float base,
                   const Tensor& positions) {
  const Device d = common_device("rope_backward", {&dy, &dqkv});
  const int64_t hd = qkv_head_size("rope_backward", dqkv, heads, groups);
  const int64_t b = dqkv.dim(0), t = dqkv.dim(1);
  check(hd % 2 == 0, "rope: the head size {} must be even", hd);
  check_numel("rope_backward", "dy", dy, dqkv.numel());
  check_positions_for("rope_backward", positions, b, t);
  const int32_t* pos = opt_i32(positions);
  if (any_bf16({&dy, &dqkv})) {
    if (is_bf16(dy) && is_bf16(dqkv) && on_gpu(d, "rope_backward", [&](auto& cx) {
          cuda::rope_backward(cx, b16(dy), b16w(dqkv), b, t, heads, groups, hd, base, pos);
        }))
      return;
    Widen wd(__func__);
    rope_backward(wd.in(dy), wd.out(dqkv, true), heads, groups, base, positions);
    return wd.commit();
  }
  on_device(
      d, "rope_backward",
      [&] { cpu::rope_backward(f(dy), fw(dqkv), b, t, heads, groups, hd, base, pos); },
      [&](auto& cx) {
        cuda::rope_backward(cx, f(dy), fw(dqkv), b, t, heads, groups, hd, base, pos);
      });
}

// --- attention ---

void attention_forward(const Tensor& qkv, const Tensor& out, const Tensor& probs, int64_t heads,
                       int64_t groups, const Tensor& positions) {
  if (any_bf16({&qkv, &out, &probs})) {
    Widen wd(__func__);
    attention_forward(wd.in(qkv), wd.out(out, false), wd.out(probs, false), heads, groups,
                      positions);
    return wd.commit();
  }
  const Device d = common_device("attention_forward", {&qkv, &out, &probs});
  const int64_t hd = qkv_head_size("attention_forward", qkv, heads, groups);
  const int64_t b = qkv.dim(0), t = qkv.dim(1);
  check_numel("attention_forward", "out", out, b * t * heads * hd);
  check_numel("attention_forward", "probs", probs, b * heads * t * t);
  check_positions_for("attention_forward", positions, b, t);
  const int32_t* pos = opt_i32(positions);
  on_device(
      d, "attention_forward",
      [&] {
        cpu::attention_forward(f(qkv), fw(out), fw(probs), b, t, heads, groups, hd, cpu_rounding(),
                               pos);
      },
      [&](auto& cx) {
        cuda::attention_forward(cx, math_mode(d), f(qkv), fw(out), fw(probs), b, t, heads, groups,
                                hd, pos);
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

}  // namespace weft::ops
