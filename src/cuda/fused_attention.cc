// Causal attention that never writes the (B, H, T, T) scores: the fp32 and
// bf16 interfaces of include/weft/cuda/kernels.h around one core on bf16
// arrays (src/cuda/sdpa.h: cuDNN's SDPA graphs, or the GPU emulator's
// stand-in). Built where WEFT_CUDNN is; the unfused path is
// src/cuda/attention.cc.
//
// With fp32 activations, each call rounds its fp32 inputs into bf16 scratch
// (one element-wise kernel each) and widens the bf16 results back:
//
//   forward:  qkv16 = bf16(qkv); O16, lse = core(qkv16); out = float(O16).
//   backward: qkv16 = bf16(qkv), O16 = bf16(out) (exact: out is O16 widened),
//             dO16 = bf16(dout); dq, dk, dv written by the core into one
//             packed bf16 buffer shaped like qkv; dqkv += float(that buffer).
//
// With bf16 activations (--bf16) qkv and out, and their gradients dout and
// dqkv, are the core's bf16 tensors themselves: it reads and writes them in
// place of the scratch copies (a dqkv that is accumulated into gets the
// core's result through bf16 scratch and one rounded add).
//
// The backward's O is the forward's output read back, not a copy kept in bf16:
// the runner keeps a micro-batch's values until its backward is done, so the
// layer keeps only the lse.
//
// At T = 1 cuDNN has no backward (cudnn-frontend refuses s_q = s_kv = 1);
// one position needs none: dq = dk = 0 and dv is dO summed over each group's
// query heads, written into the same bf16 buffer by one element-wise kernel.
//
// Every scratch buffer comes from the context's caching allocator.
#include <weft/cuda/kernels.h>

#include "src/cuda/check.h"
#include "src/cuda/launch.h"
#include "src/cuda/sdpa.h"

#include <cstdint>
#include <string>

namespace weft::cuda {

namespace sdpa {

std::string describe(const Shape& k) {
  return fmt::format("B {} T {} H {} G {} D {}", k.b, k.t, k.h, k.g, k.d);
}

}  // namespace sdpa

namespace {

using sdpa::Shape;

Shape shape_of(int64_t b, int64_t t, int64_t h, int64_t g, int64_t d) {
  check(b > 0 && t > 0 && h > 0 && g > 0 && d > 0 && h % g == 0,
        "fused attention: {} query heads must be a multiple of {} key/value heads; B {} T {} D {}",
        h, g, b, t, d);
  check(d % 8 == 0 && d <= 128,
        "fused attention: head size {} must be a multiple of 8 and at most 128 (cuDNN's fused "
        "attention; the unfused backend takes any head size)",
        d);
  return Shape{b, t, h, g, d};
}

int64_t qkv_size(const Shape& k) { return k.b * k.t * (k.h + 2 * k.g) * k.d; }
int64_t out_size(const Shape& k) { return k.b * k.t * k.h * k.d; }

// A caller's bf16 array handed to the core as it is: cuDNN's graphs declare
// 16-byte aligned tensors (cudnn-frontend's default), and the q, k, v heads
// start at multiples of D elements (16 bytes, D % 8 == 0) from qkv.
void check_aligned(const void* p, const char* what, const Shape& k) {
  check(reinterpret_cast<uintptr_t>(p) % 16 == 0,
        "fused attention ({}): bf16 {} at {} is not 16-byte aligned (cuDNN's graphs declare "
        "16-byte aligned tensors)",
        sdpa::describe(k), what, p);
}

// The backward on bf16 qkv16, o16 and do16: dq, dk and dv written into
// dqkv16 (packed like qkv), every element of it.
void backward_core(Context& ctx, const Shape& k, const bf16* do16, const bf16* qkv16,
                   const bf16* o16, const float* lse, bf16* dqkv16) {
  if (k.t == 1) {
    // cudnn-frontend's sdpa_backward refuses s_q = s_kv = 1 at validate()
    // (GRAPH_NOT_SUPPORTED, "s_q = s_kv = 1 is not supported."). With one
    // position the gradient needs no attention at all: dq = dk = 0 and dv
    // sums dO over its group's query heads, written as cuDNN would write it.
    launch::attention_one_position_backward(ctx.compute_stream(),
                                            reinterpret_cast<const uint16_t*>(do16),
                                            reinterpret_cast<uint16_t*>(dqkv16), k.b, k.h, k.g,
                                            k.d);
    WEFT_LAUNCH_CHECK("attention_one_position_backward");
    return;
  }
  sdpa::backward(ctx, k, do16, qkv16, o16, lse, dqkv16);
}

}  // namespace

void fused_attention_forward(Context& ctx, const float* qkv, float* out, float* lse, int64_t b,
                             int64_t t, int64_t h, int64_t g, int64_t d) {
  const Shape k = shape_of(b, t, h, g, d);
  ctx.make_current();
  const int64_t n_qkv = qkv_size(k), n_out = out_size(k);
  DeviceBuffer<bf16> qkv16(ctx, n_qkv), o16(ctx, n_out);
  to_bf16(ctx, qkv, qkv16.data(), n_qkv);
  sdpa::forward(ctx, k, qkv16.data(), o16.data(), lse);
  to_float(ctx, o16.data(), out, n_out);
}

void fused_attention_forward(Context& ctx, const bf16* qkv, bf16* out, float* lse, int64_t b,
                             int64_t t, int64_t h, int64_t g, int64_t d) {
  const Shape k = shape_of(b, t, h, g, d);
  check_aligned(qkv, "qkv", k);
  check_aligned(out, "out", k);
  ctx.make_current();
  sdpa::forward(ctx, k, qkv, out, lse);
}

void fused_attention_backward(Context& ctx, const float* dout, const float* qkv, const float* out,
                              const float* lse, float* dqkv, int64_t b, int64_t t, int64_t h,
                              int64_t g, int64_t d, bool accumulate) {
  const Shape k = shape_of(b, t, h, g, d);
  ctx.make_current();
  const int64_t n_qkv = qkv_size(k), n_out = out_size(k);
  DeviceBuffer<bf16> qkv16(ctx, n_qkv), o16(ctx, n_out), do16(ctx, n_out), dqkv16(ctx, n_qkv);
  to_bf16(ctx, qkv, qkv16.data(), n_qkv);
  to_bf16(ctx, out, o16.data(), n_out);
  to_bf16(ctx, dout, do16.data(), n_out);
  backward_core(ctx, k, do16.data(), qkv16.data(), o16.data(), lse, dqkv16.data());
  if (accumulate)
    add_bf16(ctx, dqkv16.data(), dqkv, n_qkv);
  else
    to_float(ctx, dqkv16.data(), dqkv, n_qkv);  // a fresh dqkv: written, not read
}

void fused_attention_backward(Context& ctx, const bf16* dout, const bf16* qkv, const bf16* out,
                              const float* lse, bf16* dqkv, int64_t b, int64_t t, int64_t h,
                              int64_t g, int64_t d, bool accumulate) {
  const Shape k = shape_of(b, t, h, g, d);
  check_aligned(qkv, "qkv", k);
  check_aligned(out, "out", k);
  check_aligned(dout, "dout", k);
  check_aligned(dqkv, "dqkv", k);
  ctx.make_current();
  if (!accumulate) {  // a fresh dqkv: the core writes it
    backward_core(ctx, k, dout, qkv, out, lse, dqkv);
    return;
  }
  DeviceBuffer<bf16> dqkv16(ctx, qkv_size(k));
  backward_core(ctx, k, dout, qkv, out, lse, dqkv16.data());
  add_inplace(ctx, dqkv, dqkv16.data(), qkv_size(k));
}

size_t fused_attention_graphs(Context& ctx) { return sdpa::graphs(ctx); }

}  // namespace weft::cuda
