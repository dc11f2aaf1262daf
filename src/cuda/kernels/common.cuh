// What every family of src/cuda/kernels/*.cu shares: the grid helpers, the
// warp and block reductions, loads and stores of fp32 or bf16 activations,
// 16-byte vector accesses, and the launchers' view of bf16 arrays. Each .cu
// includes it; they are inline (defined alike in every file), the kernels
// and their own helpers internal to each file.
//
// Each kernel does the CPU loop's arithmetic in the same order within an
// element or a row (two-pass mean and variance, max-subtracted softmax, the
// same AdamW expression), so the results differ from the CPU's only by the
// order of the reductions across a row. Reductions across rows (weight and
// bias gradients) use fixed-shape trees, so they are deterministic; the one
// exception is the token-embedding gradient, a scatter-add with atomics.
#pragma once

#include "src/cuda/launch.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

namespace weft::cuda::launch {

inline constexpr int kWarp = 32;
inline constexpr int kThreads = 256;

// Blocks for a grid-stride loop over n elements: enough to fill the GPU,
// never more than the loop needs.
inline unsigned blocks_for(int64_t n, int threads = kThreads) {
  const int64_t want = (n + threads - 1) / threads;
  return static_cast<unsigned>(std::clamp<int64_t>(want, 1, int64_t{1} << 16));
}

inline __device__ float warp_sum(float v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum (or max) over the whole block; every thread gets the result. `shared`
// holds one value per warp. blockDim.x must be a multiple of 32.
template <typename T, typename Op>
__device__ T block_reduce(T v, T* shared, Op op) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int warps = blockDim.x / kWarp;
  for (int o = kWarp / 2; o > 0; o /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();  // `shared` may still be read by a previous call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  T r = shared[0];
  for (int i = 1; i < warps; ++i) r = op(r, shared[i]);
  return r;
}

struct Add {
  template <typename T>
  __device__ T operator()(T a, T b) const { return a + b; }
};
struct Max {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// Activation storage: fp32, or bf16 (--bf16). A kernel templated on its
// activations' element type loads them widened to fp32, computes in fp32
// exactly as the fp32 instance does, and rounds only on the final store (to
// nearest even), so its bf16 output is the fp32 instance's output rounded.
__device__ __forceinline__ float load(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load(const __nv_bfloat16* p, int64_t i) {
  return __bfloat162float(p[i]);
}
__device__ __forceinline__ void store(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void store(__nv_bfloat16* p, int64_t i, float v) {
  p[i] = __float2bfloat16_rn(v);
}


// ---------------------------------------------------------------- bf16 vectors

// The bf16 element-wise kernels of a --bf16 step, 8 elements (16 bytes) per
// access. With one 2-byte element per thread in flight, an SM's resident
// threads keep a few KB of loads outstanding, far fewer than it takes to
// cover the memory's latency at full bandwidth; 16-byte accesses keep 8x as
// many. Each element's arithmetic is the scalar kernel's (the same inline
// functions, in fp32, rounded once on the store), so the bits are the same.
// Elements past the last whole vector go one per thread. The launchers take
// this path only when every array is 16-byte aligned.
inline constexpr int kVec = 8;

// A 32-bit word of a vector access holds two bf16, the lower address in the
// low half; a bf16 is the top half of an fp32. The words are taken apart
// and put together with shifts, not by reading them through another type
// (undefined behaviour, which an optimiser may turn into wrong values).
__device__ __forceinline__ float bf16_low(unsigned word) { return __uint_as_float(word << 16); }
__device__ __forceinline__ float bf16_high(unsigned word) {
  return __uint_as_float(word & 0xffff0000u);
}
__device__ __forceinline__ unsigned bf16_pair(float lo, float hi) {
  return static_cast<unsigned>(__bfloat16_as_ushort(__float2bfloat16_rn(lo))) |
         (static_cast<unsigned>(__bfloat16_as_ushort(__float2bfloat16_rn(hi))) << 16);
}

__device__ __forceinline__ void load8(const __nv_bfloat16* p, int64_t v, float (&out)[kVec]) {
  const uint4 raw = reinterpret_cast<const uint4*>(p)[v];
  const unsigned words[kVec / 2] = {raw.x, raw.y, raw.z, raw.w};
  for (int k = 0; k < kVec / 2; ++k) {
    out[2 * k] = bf16_low(words[k]);
    out[2 * k + 1] = bf16_high(words[k]);
  }
}

__device__ __forceinline__ void store8(__nv_bfloat16* p, int64_t v, const float (&in)[kVec]) {
  reinterpret_cast<uint4*>(p)[v] = make_uint4(bf16_pair(in[0], in[1]), bf16_pair(in[2], in[3]),
                                              bf16_pair(in[4], in[5]), bf16_pair(in[6], in[7]));
}

__device__ __forceinline__ void load8(const float* p, int64_t v, float (&out)[kVec]) {
  const float4 lo = reinterpret_cast<const float4*>(p)[2 * v];
  const float4 hi = reinterpret_cast<const float4*>(p)[2 * v + 1];
  out[0] = lo.x, out[1] = lo.y, out[2] = lo.z, out[3] = lo.w;
  out[4] = hi.x, out[5] = hi.y, out[6] = hi.z, out[7] = hi.w;
}

__device__ __forceinline__ void store8(float* p, int64_t v, const float (&in)[kVec]) {
  reinterpret_cast<float4*>(p)[2 * v] = make_float4(in[0], in[1], in[2], in[3]);
  reinterpret_cast<float4*>(p)[2 * v + 1] = make_float4(in[4], in[5], in[6], in[7]);
}

// Rows per block for the one-warp-per-row kernels.
inline constexpr int kRowsPerBlock = kThreads / kWarp;
inline unsigned row_blocks(int64_t n) {
  return static_cast<unsigned>((n + kRowsPerBlock - 1) / kRowsPerBlock);
}

// The launchers' bf16 arrays (uint16_t, launch.h) as CUDA's type.
static_assert(sizeof(uint16_t) == sizeof(__nv_bfloat16), "bf16 is 2 bytes");
inline const __nv_bfloat16* bf(const uint16_t* p) { return reinterpret_cast<const __nv_bfloat16*>(p); }
inline __nv_bfloat16* bf(uint16_t* p) { return reinterpret_cast<__nv_bfloat16*>(p); }

// The bf16 vector kernels' conditions and grid: every array 16-byte aligned;
// one thread per whole vector (the tail's few elements ride along).
inline bool aligned16(std::initializer_list<const void*> ps) {
  for (const void* p : ps)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}
inline unsigned vec_blocks(int64_t n) { return blocks_for((n + kVec - 1) / kVec); }

}  // namespace weft::cuda::launch
