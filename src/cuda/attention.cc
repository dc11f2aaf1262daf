// Causal attention: the device twin of src/cpu/attention.cc.
//
// The packed qkv (B, T, (H + 2G) D) is first split into per-head q, k, v
// (B, H, T, D), a shared key/value head copied to each query head of its
// group, so that every (batch, head) pair is one matrix of a strided batched cuBLAS
// GEMM; the scores are materialised (B, H, T, T) exactly as the CPU layer keeps
// them, which makes the two paths comparable element by element and the
// backward pass a plain sequence of GEMMs. The fused alternative, cuDNN's
// flash attention without the T x T memory, is src/cuda/fused_attention.cc
// (ops::AttentionBackend).
//
//   forward:  S = q k^T / sqrt(D); P = causal_softmax(S); o = P v
//   backward: dP = dO v^T; dv += P^T dO; dS = P * (dP - rowsum(P * dP));
//             dq += dS k / sqrt(D); dk += dS^T q / sqrt(D)
#include <weft/cuda/kernels.h>

#include "src/cuda/check.h"
#include "src/cuda/launch.h"

#include <algorithm>
#include <cmath>

namespace weft::cuda {

namespace {

void check_shape(int64_t b, int64_t t, int64_t h, int64_t g, int64_t d) {
  check(b > 0 && t > 0 && h > 0 && g > 0 && d > 0 && h % g == 0,
        "attention: {} query heads must be a multiple of {} key/value heads; B {} T {} D {}", h,
        g, b, t, d);
  check(b * h * t / 8 < int64_t{0x7fffffff}, "attention: B*H*T ({}) rows exceed the grid",
        b * h * t);
}

}  // namespace

void attention_forward(Context& ctx, MathMode mode, const float* qkv, float* out, float* probs,
                       int64_t b, int64_t t, int64_t h, int64_t g, int64_t d,
                       const int32_t* positions) {
  check_shape(b, t, h, g, d);
  ctx.make_current();
  const int64_t bh = b * h, n = b * t * h * d;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  cudaStream_t s = ctx.compute_stream();
  DeviceBuffer<float> q(ctx, n), k(ctx, n), v(ctx, n), o(ctx, n);
  launch::split_qkv(s, qkv, q.data(), k.data(), v.data(), b, t, h, g, d);
  WEFT_LAUNCH_CHECK("split_qkv");
  // S (T, T) = scale q k^T, per (batch, head)
  gemm_strided_batched(ctx, mode, false, true, t, t, d, scale, q.data(), d, t * d, k.data(), d,
                       t * d, 0.0f, probs, t, t * t, bh);
  launch::causal_softmax(s, probs, bh * t, t, h, positions);
  WEFT_LAUNCH_CHECK("causal_softmax");
  // o (T, D) = P v
  gemm_strided_batched(ctx, mode, false, false, t, d, t, 1.0f, probs, t, t * t, v.data(), d, t * d,
                       0.0f, o.data(), d, t * d, bh);
  launch::permute_heads(s, o.data(), out, b, t, h, d, true);
  WEFT_LAUNCH_CHECK("permute_heads");
}

void attention_backward(Context& ctx, MathMode mode, const float* dout, const float* qkv,
                        const float* probs, float* dqkv, float* scratch, int64_t b, int64_t t,
                        int64_t h, int64_t g, int64_t d) {
  check_shape(b, t, h, g, d);
  ctx.make_current();
  const int64_t bh = b * h, n = b * t * h * d;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  cudaStream_t s = ctx.compute_stream();
  DeviceBuffer<float> q(ctx, n), k(ctx, n), v(ctx, n), dout_h(ctx, n);
  DeviceBuffer<float> dq(ctx, n), dk(ctx, n), dv(ctx, n);
  launch::split_qkv(s, qkv, q.data(), k.data(), v.data(), b, t, h, g, d);
  WEFT_LAUNCH_CHECK("split_qkv");
  launch::permute_heads(s, dout, dout_h.data(), b, t, h, d, false);
  WEFT_LAUNCH_CHECK("permute_heads");
  float* ds = scratch;
  // dP (T, T) = dO v^T
  gemm_strided_batched(ctx, mode, false, true, t, t, d, 1.0f, dout_h.data(), d, t * d, v.data(), d,
                       t * d, 0.0f, ds, t, t * t, bh);
  // dv (T, D) = P^T dO
  gemm_strided_batched(ctx, mode, true, false, t, d, t, 1.0f, probs, t, t * t, dout_h.data(), d,
                       t * d, 0.0f, dv.data(), d, t * d, bh);
  launch::softmax_backward(s, probs, ds, bh * t, t);
  WEFT_LAUNCH_CHECK("softmax_backward");
  // dq (T, D) = scale dS k;  dk (T, D) = scale dS^T q
  gemm_strided_batched(ctx, mode, false, false, t, d, t, scale, ds, t, t * t, k.data(), d, t * d,
                       0.0f, dq.data(), d, t * d, bh);
  gemm_strided_batched(ctx, mode, true, false, t, d, t, scale, ds, t, t * t, q.data(), d, t * d,
                       0.0f, dk.data(), d, t * d, bh);
  launch::accumulate_qkv(s, dq.data(), dk.data(), dv.data(), dqkv, b, t, h, g, d);
  WEFT_LAUNCH_CHECK("accumulate_qkv");
}

}  // namespace weft::cuda
