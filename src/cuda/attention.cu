// Causal attention kernels: splitting the packed qkv into heads and back,
// the causal softmax and its backward. The GEMMs between them, and the
// sequence, are in src/cuda/attention.cc.
#include "src/cuda/launch.h"

#include <algorithm>
#include <cmath>

namespace weft::cuda::launch {

namespace {

constexpr int kWarp = 32;
constexpr int kThreads = 256;

unsigned blocks_for(int64_t n) {
  return static_cast<unsigned>(std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1,
                                                   int64_t{1} << 16));
}

// qkv (B, T, (H + 2G) D) -> q, k, v, each (B, H, T, D): one thread per
// element of the outputs, so a key/value head shared by H / G query heads is
// copied to each of them.
__global__ void split_qkv_kernel(const float* qkv, float* q, float* k, float* v, int64_t b,
                                 int64_t t, int64_t h, int64_t g, int64_t d) {
  const int64_t per_head = t * d, total = b * h * per_head, w = (h + 2 * g) * d;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t di = i % d, ti = i / d % t, hi = i / per_head % h, bi = i / (per_head * h);
    const int64_t row = (bi * t + ti) * w, kv = h * d + hi / (h / g) * d + di;
    q[i] = qkv[row + hi * d + di];
    k[i] = qkv[row + kv];
    v[i] = qkv[row + kv + g * d];
  }
}

// (B, H, T, D) <-> (B, T, C): `to_rows` gathers heads into rows, otherwise scatters.
__global__ void permute_heads_kernel(const float* src, float* dst, int64_t b, int64_t t,
                                     int64_t h, int64_t d, bool to_rows) {
  const int64_t c = h * d, total = b * t * c;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = i / c, col = i % c;  // i indexes (B, T, C)
    const int64_t bi = row / t, ti = row % t, hi = col / d, di = col % d;
    const int64_t j = ((bi * h + hi) * t + ti) * d + di;
    if (to_rows)
      dst[i] = src[j];
    else
      dst[j] = src[i];
  }
}

// dqkv (B, T, (H + 2G) D) += dq, dk, dv (B, H, T, D), the inverse of
// split_qkv: one thread per element of dqkv, a key or value element summing
// the gradients of its group's query heads in order.
__global__ void accumulate_qkv_kernel(const float* dq, const float* dk, const float* dv,
                                      float* dqkv, int64_t b, int64_t t, int64_t h, int64_t g,
                                      int64_t d) {
  const int64_t w = (h + 2 * g) * d, total = b * t * w, per_group = h / g;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t col = i % w, row = i / w;  // row = bi * t + ti
    const int64_t bi = row / t, ti = row % t, head = col / d, di = col % d;
    auto at = [&](int64_t hi) { return ((bi * h + hi) * t + ti) * d + di; };
    if (head < h) {
      dqkv[i] += dq[at(head)];
      continue;
    }
    const bool key = head < h + g;
    const int64_t gi = key ? head - h : head - h - g;
    const float* src = key ? dk : dv;
    float sum = 0.0f;
    for (int64_t hi = gi * per_group; hi < (gi + 1) * per_group; ++hi) sum += src[at(hi)];
    dqkv[i] += sum;
  }
}

__device__ float warp_sum(float v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ float warp_max(float v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// One warp per score row (rows of B*H stacked T x T matrices). Row i keeps
// columns 0..i: softmax there, zero after (the CPU's causal_softmax_rows).
// With `positions` (B*T; h query heads a batch row), row i of batch b keeps
// columns i - positions[b T + i] .. i only: its document.
__global__ void causal_softmax_kernel(float* p, int64_t rows, int64_t t, int64_t h,
                                      const int32_t* positions) {
  const int64_t r = int64_t{blockIdx.x} * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (r >= rows) return;
  const int64_t i = r % t;
  const int64_t start = positions ? i - positions[r / (t * h) * t + i] : 0;
  float* row = p + r * t;
  float mx = -INFINITY;
  for (int64_t j = start + lane; j <= i; j += kWarp) mx = fmaxf(mx, row[j]);
  mx = warp_max(mx);
  float s = 0;
  for (int64_t j = start + lane; j <= i; j += kWarp) s += expf(row[j] - mx);
  const float inv = 1.0f / warp_sum(s);
  for (int64_t j = lane; j < t; j += kWarp)
    row[j] = j >= start && j <= i ? expf(row[j] - mx) * inv : 0.0f;
}

// In place over dP: dS = P * (dP - sum_j P dP) on the causal part, zero after.
__global__ void softmax_backward_kernel(const float* p, float* ds, int64_t rows, int64_t t) {
  const int64_t r = int64_t{blockIdx.x} * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (r >= rows) return;
  const int64_t i = r % t;
  const float* pr = p + r * t;
  float* sr = ds + r * t;
  float dot = 0;
  for (int64_t j = lane; j <= i; j += kWarp) dot += pr[j] * sr[j];
  dot = warp_sum(dot);
  for (int64_t j = lane; j < t; j += kWarp) sr[j] = j <= i ? pr[j] * (sr[j] - dot) : 0.0f;
}

unsigned warp_row_blocks(int64_t rows) {
  const int64_t per_block = kThreads / kWarp;
  return static_cast<unsigned>((rows + per_block - 1) / per_block);
}

}  // namespace

void split_qkv(cudaStream_t s, const float* qkv, float* q, float* k, float* v, int64_t b,
               int64_t t, int64_t h, int64_t g, int64_t d) {
  split_qkv_kernel<<<blocks_for(b * t * h * d), kThreads, 0, s>>>(qkv, q, k, v, b, t, h, g, d);
}

void permute_heads(cudaStream_t s, const float* src, float* dst, int64_t b, int64_t t, int64_t h,
                   int64_t d, bool to_rows) {
  permute_heads_kernel<<<blocks_for(b * t * h * d), kThreads, 0, s>>>(src, dst, b, t, h, d,
                                                                      to_rows);
}

void accumulate_qkv(cudaStream_t s, const float* dq, const float* dk, const float* dv,
                    float* dqkv, int64_t b, int64_t t, int64_t h, int64_t g, int64_t d) {
  accumulate_qkv_kernel<<<blocks_for(b * t * (h + 2 * g) * d), kThreads, 0, s>>>(dq, dk, dv, dqkv,
                                                                                 b, t, h, g, d);
}

void causal_softmax(cudaStream_t s, float* p, int64_t rows, int64_t t, int64_t h,
                    const int32_t* positions) {
  causal_softmax_kernel<<<warp_row_blocks(rows), kThreads, 0, s>>>(p, rows, t, h, positions);
}

void softmax_backward(cudaStream_t s, const float* p, float* ds, int64_t rows, int64_t t) {
  softmax_backward_kernel<<<warp_row_blocks(rows), kThreads, 0, s>>>(p, ds, rows, t);
}

}  // namespace weft::cuda::launch
