// Element-wise, normalisation, loss, embedding, optimiser and reduction
// kernels: the device twins of src/cpu/kernels.cc and layers/embedding.cc.
// Host-side checks and scratch memory are in kernels.cc; this file is device
// code and the launchers of src/cuda/launch.h.
//
// Each kernel does the CPU loop's arithmetic in the same order within an
// element or a row (two-pass mean and variance, max-subtracted softmax, the
// same AdamW expression), so the results differ from the CPU's only by the
// order of the reductions across a row. Reductions across rows (weight and
// bias gradients) use fixed-shape trees, so they are deterministic; the one
// exception is the token-embedding gradient, a scatter-add with atomics.
#include "src/cuda/launch.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

namespace weft::cuda::launch {

namespace {

constexpr int kWarp = 32;
constexpr int kThreads = 256;

// Blocks for a grid-stride loop over n elements: enough to fill the GPU,
// never more than the loop needs.
unsigned blocks_for(int64_t n, int threads = kThreads) {
  const int64_t want = (n + threads - 1) / threads;
  return static_cast<unsigned>(std::clamp<int64_t>(want, 1, int64_t{1} << 16));
}

__device__ float warp_sum(float v) {
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

// ---------------------------------------------------------------- LayerNorm

// One warp per row. x, y (N, C) of activations X, Y (float or bf16); mean, rstd (N)
template <class X, class Y>
__global__ void layernorm_forward_kernel(const X* x, const float* w, const float* b, Y* y,
                                         float* mean, float* rstd, int64_t n, int64_t c,
                                         float eps) {
  const int64_t row = int64_t{blockIdx.x} * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= n) return;
  const X* xr = x + row * c;
  float s = 0;
  for (int64_t j = lane; j < c; j += kWarp) s += load(xr, j);
  const float m = warp_sum(s) / static_cast<float>(c);
  float var = 0;
  for (int64_t j = lane; j < c; j += kWarp) {
    const float d = load(xr, j) - m;
    var += d * d;
  }
  var = warp_sum(var) / static_cast<float>(c);
  const float r = 1.0f / sqrtf(var + eps);
  Y* yr = y + row * c;
  for (int64_t j = lane; j < c; j += kWarp) store(yr, j, (load(xr, j) - m) * r * w[j] + b[j]);
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = r;
  }
}

// One warp per row: dx += (dy w - mean(dy w) - xhat mean(dy w xhat)) rstd;
// x of activations X, dy and dx of their gradients' type G (float, or bf16
// with bf16 activations: dx read widened, the sum rounded once).
template <class X, class G>
__global__ void layernorm_backward_input_kernel(const G* dy, const X* x, const float* w,
                                                const float* mean, const float* rstd, G* dx,
                                                int64_t n, int64_t c) {
  const int64_t row = int64_t{blockIdx.x} * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= n) return;
  const G* dyr = dy + row * c;
  const X* xr = x + row * c;
  const float m = mean[row], r = rstd[row];
  float dnorm_mean = 0, dnorm_xhat_mean = 0;
  for (int64_t j = lane; j < c; j += kWarp) {
    const float dnorm = load(dyr, j) * w[j];
    dnorm_mean += dnorm;
    dnorm_xhat_mean += dnorm * (load(xr, j) - m) * r;
  }
  dnorm_mean = warp_sum(dnorm_mean) / static_cast<float>(c);
  dnorm_xhat_mean = warp_sum(dnorm_xhat_mean) / static_cast<float>(c);
  G* dxr = dx + row * c;
  for (int64_t j = lane; j < c; j += kWarp) {
    const float xhat = (load(xr, j) - m) * r;
    store(dxr, j, load(dxr, j) + (load(dyr, j) * w[j] - dnorm_mean - xhat * dnorm_xhat_mean) * r);
  }
}

// ---------------------------------------------------------------- RMSNorm, SwiGLU, RoPE

// The Llama layers' kernels are templated on the activations' element type
// T (float, or bf16 under --bf16: x, y, dy and dx; the weight and rstd stay
// fp32), as LayerNorm's are: the bf16 instance loads widened, computes as
// the fp32 instance does, and rounds each store once.

// One warp per row. x, y (N, C); rstd (N)
template <class T>
__global__ void rmsnorm_forward_kernel(const T* x, const float* w, T* y, float* rstd, int64_t n,
                                       int64_t c, float eps) {
  const int64_t row = int64_t{blockIdx.x} * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= n) return;
  const T* xr = x + row * c;
  float ss = 0;
  for (int64_t j = lane; j < c; j += kWarp) {
    const float xj = load(xr, j);
    ss += xj * xj;
  }
  const float r = 1.0f / sqrtf(warp_sum(ss) / static_cast<float>(c) + eps);
  T* yr = y + row * c;
  for (int64_t j = lane; j < c; j += kWarp) store(yr, j, load(xr, j) * r * w[j]);
  if (lane == 0) rstd[row] = r;
}

// One warp per row: dx += r w dy - x r^3 / C * sum_j w_j dy_j x_j
template <class T>
__global__ void rmsnorm_backward_input_kernel(const T* dy, const T* x, const float* w,
                                              const float* rstd, T* dx, int64_t n, int64_t c) {
  const int64_t row = int64_t{blockIdx.x} * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= n) return;
  const T* dyr = dy + row * c;
  const T* xr = x + row * c;
  const float r = rstd[row];
  float dot = 0;
  for (int64_t j = lane; j < c; j += kWarp) dot += w[j] * load(dyr, j) * load(xr, j);
  const float k = r * r * r * warp_sum(dot) / static_cast<float>(c);
  T* dxr = dx + row * c;
  for (int64_t j = lane; j < c; j += kWarp)
    store(dxr, j, load(dxr, j) + (r * w[j] * load(dyr, j) - load(xr, j) * k));
}

// x (N, 2H) = [gate | up] -> y (N, H) = silu(gate) * up
template <class T>
__global__ void swiglu_forward_kernel(const T* x, T* y, int64_t n, int64_t h) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n * h;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = i / h, j = i % h;
    const float g = load(x, row * 2 * h + j), u = load(x, row * 2 * h + h + j);
    store(y, i, g / (1.0f + expf(-g)) * u);
  }
}

template <class T>
__global__ void swiglu_backward_kernel(const T* dy, const T* x, T* dx, int64_t n, int64_t h) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n * h;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = i / h, j = i % h;
    const int64_t at = row * 2 * h + j;
    const float g = load(x, at), u = load(x, at + h);
    const float s = 1.0f / (1.0f + expf(-g)), d = load(dy, i);
    store(dx, at, load(dx, at) + d * u * s * (1.0f + g * (1.0f - s)));
    store(dx, at + h, load(dx, at + h) + d * g * s);
  }
}

// One thread per (row, head of q|k|v, column of the first half of a head) of
// qkv (rows, (H + 2G) D); the pair (i, i + D/2) of the H query and G key heads
// is rotated by pos * base^(-2i/D), the G value heads copied.
// backward: the inverse rotation, accumulated.
template <bool backward, class T>
__global__ void rope_kernel(const T* src, T* dst, int64_t rows, int64_t t, int64_t h, int64_t g,
                            int64_t d, float base) {
  const int64_t half = d / 2, n = h + 2 * g;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < rows * n * half;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t p = i % half, hi = i / half % n, row = i / (half * n);
    const int64_t at = row * n * d + hi * d + p;
    const float a0 = load(src, at), a1 = load(src, at + half);
    if (hi >= h + g) {  // v: no rotation
      if constexpr (backward) {
        store(dst, at, load(dst, at) + a0);
        store(dst, at + half, load(dst, at + half) + a1);
      } else {
        store(dst, at, a0);
        store(dst, at + half, a1);
      }
      continue;
    }
    const float angle = static_cast<float>(
        static_cast<double>(row % t) * pow(static_cast<double>(base), -2.0 * p / static_cast<double>(d)));
    const float cs = cosf(angle), sn = sinf(angle);
    if constexpr (backward) {
      store(dst, at, load(dst, at) + (a0 * cs + a1 * sn));
      store(dst, at + half, load(dst, at + half) + (a1 * cs - a0 * sn));
    } else {
      store(dst, at, a0 * cs - a1 * sn);
      store(dst, at + half, a1 * cs + a0 * sn);
    }
  }
}

// Column sums over rows in two deterministic passes. Pass 1: block (32, 8)
// owns 32 columns and row slice blockIdx.y of `slices`; it writes one partial
// per column. Pass 2 adds the slices' partials in order into the output.
// With `norm`, it also sums dy * xhat (the LayerNorm weight gradient), x of
// activations X (float or bf16).
constexpr int kColTile = 32, kRowLanes = 8;

template <bool norm, class X, class G>
__global__ void column_partials_kernel(const G* dy, const X* x, const float* mean,
                                       const float* rstd, float* part_dw, float* part_db,
                                       int64_t n, int64_t c) {
  __shared__ float sw[kRowLanes][kColTile], sb[kRowLanes][kColTile];
  const int64_t col = int64_t{blockIdx.x} * kColTile + threadIdx.x;
  const int64_t slices = gridDim.y;
  float acc_w = 0, acc_b = 0;
  if (col < c) {
    for (int64_t i = int64_t{blockIdx.y} * kRowLanes + threadIdx.y; i < n;
         i += slices * kRowLanes) {
      const float g = load(dy, i * c + col);
      acc_b += g;
      if constexpr (norm) acc_w += g * (load(x, i * c + col) - mean[i]) * rstd[i];
    }
  }
  sw[threadIdx.y][threadIdx.x] = acc_w;
  sb[threadIdx.y][threadIdx.x] = acc_b;
  __syncthreads();
  if (threadIdx.y == 0 && col < c) {
    float tw = 0, tb = 0;
    for (int k = 0; k < kRowLanes; ++k) {
      tw += sw[k][threadIdx.x];
      tb += sb[k][threadIdx.x];
    }
    if constexpr (norm) part_dw[int64_t{blockIdx.y} * c + col] = tw;
    part_db[int64_t{blockIdx.y} * c + col] = tb;
  }
}

// One thread per column adds its up to 128 partials in order. They were just
// written, so they come from L2, but a few hundred threads (C 768: 3 blocks)
// waiting on one load after another would take a round trip per few slices:
// the loop is unrolled 16 deep so that 16 loads are in flight at once (the
// adds stay in order).
__global__ void column_finish_kernel(const float* part, float* out, int64_t slices, int64_t c) {
  for (int64_t j = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; j < c;
       j += int64_t{gridDim.x} * blockDim.x) {
    float s = 0;
#pragma unroll 16
    for (int64_t k = 0; k < slices; ++k) s += part[k * c + j];
    out[j] += s;
  }
}

// ---------------------------------------------------------------- GELU

constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;

// One element's arithmetic, shared by the scalar kernels and the bf16
// vector ones below, so that both give the same bits.
__device__ __forceinline__ float gelu_of(float xi) {
  const float u = kGeluScale * (xi + kGeluCubic * xi * xi * xi);
  return 0.5f * xi * (1.0f + tanhf(u));
}

__device__ __forceinline__ float gelu_grad_of(float xi) {
  const float x2 = xi * xi;
  const float t = tanhf(kGeluScale * xi * (1.0f + kGeluCubic * x2));
  const float dudx = kGeluScale * (1.0f + 3.0f * kGeluCubic * x2);
  return 0.5f * (1.0f + t) + 0.5f * xi * (1.0f - t * t) * dudx;
}

// dx's new value from dy, x and (accumulating) dx's old one.
__device__ __forceinline__ float gelu_backward_of(float dy, float xi, float old, bool accumulate) {
  const float d = dy * gelu_grad_of(xi);
  return accumulate ? old + d : d;
}

// x, y activations X, Y (float or bf16); dy, dx fp32.
template <class X, class Y>
__global__ void gelu_forward_kernel(const X* x, Y* y, int64_t n) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    store(y, i, gelu_of(load(x, i)));
}

// dx += dy gelu'(x), or dx = dy gelu'(x) (dx unread) without accumulate;
// dy and dx of the gradients' type G.
template <class X, class G>
__global__ void gelu_backward_kernel(const G* dy, const X* x, G* dx, int64_t n, bool accumulate) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    store(dx, i, gelu_backward_of(load(dy, i), load(x, i), accumulate ? load(dx, i) : 0.0f,
                                  accumulate));
}

// ---------------------------------------------------------------- element-wise

__global__ void add_bias_kernel(float* y, const float* bias, int64_t n, int64_t c) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n * c;
       i += int64_t{gridDim.x} * blockDim.x)
    y[i] += bias[i % c];
}

// y = y + s x in fp32 (y float or bf16), stored as Y: the product rounded
// before the sum, as scale_inplace_kernel then add_inplace_kernel round them.
template <class Y>
__global__ void add_scaled_kernel(Y* y, const float* x, float s, int64_t n) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    store(y, i, __fadd_rn(load(y, i), __fmul_rn(x[i], s)));
}

// y, x of element types Y, X (float or bf16): y = y + x in fp32, stored as Y.
template <class Y, class X>
__global__ void add_inplace_kernel(Y* y, const X* x, int64_t n) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    store(y, i, load(y, i) + load(x, i));
}

// y = a + b in fp32, stored as T (the residual add).
template <class T>
__global__ void add_kernel(const T* a, const T* b, T* y, int64_t n) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    store(y, i, load(a, i) + load(b, i));
}

// Every row of y (N, C) = row (C), stored as Y: a bias that a GEMM with beta 1
// then accumulates onto.
template <class Y>
__global__ void fill_rows_kernel(Y* y, const float* row, int64_t n, int64_t c) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n * c;
       i += int64_t{gridDim.x} * blockDim.x)
    store(y, i, row[i % c]);
}

// y (n, c; rows ldy apart) = bf16(x + bias), x (n, c) contiguous fp32, each
// rounded once: a bias GEMM's separate steps.
__global__ void add_bias_bf16_kernel(const float* x, const __nv_bfloat16* bias,
                                     __nv_bfloat16* y, int64_t n, int64_t c, int64_t ldy) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n * c;
       i += int64_t{gridDim.x} * blockDim.x)
    y[(i / c) * ldy + i % c] = __float2bfloat16_rn(x[i] + __bfloat162float(bias[i % c]));
}

__global__ void scale_inplace_kernel(float* y, float s, int64_t n) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    y[i] *= s;
}

template <typename T>
__global__ void fill_kernel(T* y, T bits, int64_t n) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    y[i] = bits;
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
constexpr int kVec = 8;

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

__global__ void gelu_forward_vec_kernel(const __nv_bfloat16* x, __nv_bfloat16* y, int64_t n) {
  const int64_t first = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x, vectors = n / kVec;
  for (int64_t v = first; v < vectors; v += stride) {
    float a[kVec];
    load8(x, v, a);
    for (int k = 0; k < kVec; ++k) a[k] = gelu_of(a[k]);
    store8(y, v, a);
  }
  for (int64_t i = vectors * kVec + first; i < n; i += stride) store(y, i, gelu_of(load(x, i)));
}

__global__ void gelu_backward_vec_kernel(const __nv_bfloat16* dy, const __nv_bfloat16* x,
                                         __nv_bfloat16* dx, int64_t n, bool accumulate) {
  const int64_t first = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x, vectors = n / kVec;
  for (int64_t v = first; v < vectors; v += stride) {
    float xs[kVec], d[kVec], old[kVec] = {};
    load8(x, v, xs);
    load8(dy, v, d);
    if (accumulate) load8(dx, v, old);
    for (int k = 0; k < kVec; ++k) d[k] = gelu_backward_of(d[k], xs[k], old[k], accumulate);
    store8(dx, v, d);
  }
  for (int64_t i = vectors * kVec + first; i < n; i += stride)
    store(dx, i, gelu_backward_of(load(dy, i), load(x, i), accumulate ? load(dx, i) : 0.0f,
                                  accumulate));
}

// y = a + b, or y += x with a = y (the residual add and its accumulation).
__global__ void add_vec_kernel(const __nv_bfloat16* a, const __nv_bfloat16* b, __nv_bfloat16* y,
                               int64_t n) {
  const int64_t first = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x, vectors = n / kVec;
  for (int64_t v = first; v < vectors; v += stride) {
    float p[kVec], q[kVec];
    load8(a, v, p);
    load8(b, v, q);
    for (int k = 0; k < kVec; ++k) p[k] = p[k] + q[k];
    store8(y, v, p);
  }
  for (int64_t i = vectors * kVec + first; i < n; i += stride) store(y, i, load(a, i) + load(b, i));
}

// ---------------------------------------------------------------- LayerNorm, 16-byte accesses

// The LayerNorm kernels of rows whose width is a multiple of 8, every array
// 16-byte aligned: one warp per row as above, but each lane owns whole groups
// of 8 elements (groups lane, lane + 32, ...) and moves each in 16-byte
// accesses (one uint4 of bf16, or two float4 of fp32). The lane keeps its
// groups in registers, so the forward reads x once (not three times) and the
// backward reads dy and x once each. kGroups is the most groups a lane owns;
// the launchers pick it from C alone. A lane sums its own elements in a fixed
// order (group by group, 8 in a row) before the warp's tree, and the fp32 and
// bf16 instances do the same arithmetic on the widened values, so a bf16
// output is still the fp32 instance's output rounded once. The order differs
// from the scalar kernels' (a lane's elements are no longer 32 apart), within
// fp32 rounding.
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

// The most groups of 8 a lane keeps in registers: rows of up to 32 * 8 * 8 =
// 2048 elements take the vector kernels, wider ones the scalar kernels.
constexpr int kMaxLaneGroups = 8;

// v as an array of T holds it: as it is, or rounded to bf16 (to nearest even).
__device__ __forceinline__ float as_stored(float v, const float*) { return v; }
__device__ __forceinline__ float as_stored(float v, const __nv_bfloat16*) {
  return __bfloat162float(__float2bfloat16_rn(v));
}

// kSum: the row normalised is the sum x + a of two rows, written to `sum`
// too (a residual add fused with the LayerNorm that reads it). Each element
// of the sum is rounded to X as the add's kernels round it and normalised
// as stored, so sum and y are the bits of the add followed by this kernel
// on its output, and x is read once more than it would be alone, not the
// sum written, then read back.
template <int kGroups, bool kSum, class X, class Y>
__global__ void layernorm_forward_vec_kernel(const X* x, const X* a, X* sum, const float* w,
                                             const float* b, Y* y, float* mean, float* rstd,
                                             int64_t n, int64_t c, float eps) {
  const int64_t row = int64_t{blockIdx.x} * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= n) return;  // the whole warp: every lane below reaches the shuffles
  const int64_t groups = c / kVec, first = row * groups;  // the row's first group
  float v[kGroups][kVec];
  float s = 0;
#pragma unroll
  for (int k = 0; k < kGroups; ++k) {
    const int64_t g = lane + int64_t{k} * kWarp;
    if (g < groups) {
      load8(x, first + g, v[k]);
      if constexpr (kSum) {
        float u[kVec];
        load8(a, first + g, u);
        for (int e = 0; e < kVec; ++e) v[k][e] = v[k][e] + u[e];
        store8(sum, first + g, v[k]);
        for (int e = 0; e < kVec; ++e) v[k][e] = as_stored(v[k][e], sum);
      }
      for (int e = 0; e < kVec; ++e) s += v[k][e];
    }
  }
  const float m = warp_sum(s) / static_cast<float>(c);
  float var = 0;
#pragma unroll
  for (int k = 0; k < kGroups; ++k) {
    if (lane + int64_t{k} * kWarp < groups) {
      for (int e = 0; e < kVec; ++e) {
        const float d = v[k][e] - m;
        var += d * d;
      }
    }
  }
  var = warp_sum(var) / static_cast<float>(c);
  const float r = 1.0f / sqrtf(var + eps);
#pragma unroll
  for (int k = 0; k < kGroups; ++k) {
    const int64_t g = lane + int64_t{k} * kWarp;
    if (g < groups) {
      float wg[kVec], bg[kVec];
      load8(w, g, wg);
      load8(b, g, bg);
      for (int e = 0; e < kVec; ++e) v[k][e] = (v[k][e] - m) * r * wg[e] + bg[e];
      store8(y, first + g, v[k]);
    }
  }
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = r;
  }
}

// dx += (dy w - mean(dy w) - xhat mean(dy w xhat)) rstd, as the scalar kernel;
// a lane keeps dy w and xhat of its groups, then reads and writes dx once.
// kCopy: the new dx is written to `copy` as well (the gradient of both
// inputs of a residual add fused with this LayerNorm).
template <int kGroups, bool kCopy, class X, class G>
__global__ void layernorm_backward_input_vec_kernel(const G* dy, const X* x, const float* w,
                                                    const float* mean, const float* rstd, G* dx,
                                                    G* copy, int64_t n, int64_t c) {
  const int64_t row = int64_t{blockIdx.x} * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= n) return;  // the whole warp
  const int64_t groups = c / kVec, first = row * groups;
  const float m = mean[row], r = rstd[row];
  float dnorm[kGroups][kVec], xhat[kGroups][kVec];
  float dnorm_mean = 0, dnorm_xhat_mean = 0;
#pragma unroll
  for (int k = 0; k < kGroups; ++k) {
    const int64_t g = lane + int64_t{k} * kWarp;
    if (g < groups) {
      float wg[kVec];
      load8(dy, first + g, dnorm[k]);
      load8(x, first + g, xhat[k]);
      load8(w, g, wg);
      for (int e = 0; e < kVec; ++e) {
        dnorm[k][e] = dnorm[k][e] * wg[e];
        xhat[k][e] = (xhat[k][e] - m) * r;
        dnorm_mean += dnorm[k][e];
        dnorm_xhat_mean += dnorm[k][e] * xhat[k][e];
      }
    }
  }
  dnorm_mean = warp_sum(dnorm_mean) / static_cast<float>(c);
  dnorm_xhat_mean = warp_sum(dnorm_xhat_mean) / static_cast<float>(c);
#pragma unroll
  for (int k = 0; k < kGroups; ++k) {
    const int64_t g = lane + int64_t{k} * kWarp;
    if (g < groups) {
      float d[kVec];
      load8(dx, first + g, d);
      for (int e = 0; e < kVec; ++e)
        d[e] = d[e] + (dnorm[k][e] - dnorm_mean - xhat[k][e] * dnorm_xhat_mean) * r;
      store8(dx, first + g, d);
      if constexpr (kCopy) store8(copy, first + g, d);
    }
  }
}

// ---------------------------------------------------------------- column sums, 16-byte accesses

// column_partials_kernel for rows whose width is a multiple of 8, dy (and x)
// 16-byte aligned: block (32, 8) owns 256 columns, each thread 8 adjacent
// ones read in one 16-byte access (a warp reads 512 bytes of a bf16 row, not
// 64). Every column is summed exactly as column_partials_kernel sums it: the
// same rows for each threadIdx.y in the same order, then the 8 row lanes in
// order, so the partials do not depend on which kernel ran.
constexpr int kColVecTile = kWarp * kVec;

template <bool norm, class X, class G>
__global__ void column_partials_vec_kernel(const G* dy, const X* x, const float* mean,
                                           const float* rstd, float* part_dw, float* part_db,
                                           int64_t n, int64_t c) {
  __shared__ float sw[kRowLanes][kColVecTile], sb[kRowLanes][kColVecTile];
  const int64_t base = int64_t{blockIdx.x} * kColVecTile;  // the block's first column
  const int64_t col = base + threadIdx.x * kVec;            // the thread's first column
  const int64_t slices = gridDim.y, groups = c / kVec;
  float acc_w[kVec] = {}, acc_b[kVec] = {};
  if (col < c) {  // then so are col + 1 ... col + 7: c is a multiple of 8
#pragma unroll 4
    for (int64_t i = int64_t{blockIdx.y} * kRowLanes + threadIdx.y; i < n;
         i += slices * kRowLanes) {
      float g[kVec];
      load8(dy, i * groups + col / kVec, g);
      if constexpr (norm) {
        float xs[kVec];
        load8(x, i * groups + col / kVec, xs);
        const float m = mean[i], r = rstd[i];
        for (int e = 0; e < kVec; ++e) acc_w[e] += g[e] * (xs[e] - m) * r;
      }
      for (int e = 0; e < kVec; ++e) acc_b[e] += g[e];
    }
  }
  for (int e = 0; e < kVec; ++e) {
    sw[threadIdx.y][threadIdx.x * kVec + e] = acc_w[e];
    sb[threadIdx.y][threadIdx.x * kVec + e] = acc_b[e];
  }
  __syncthreads();
  // Each of the block's 256 threads finishes one column.
  const int t = threadIdx.y * kWarp + threadIdx.x;
  if (base + t < c) {
    float tw = 0, tb = 0;
    for (int k = 0; k < kRowLanes; ++k) {
      tw += sw[k][t];
      tb += sb[k][t];
    }
    if constexpr (norm) part_dw[int64_t{blockIdx.y} * c + base + t] = tw;
    part_db[int64_t{blockIdx.y} * c + base + t] = tb;
  }
}

// ---------------------------------------------------------------- cross-entropy

constexpr int kRowThreads = 512;

// The running (max, sum of exp(x - max)) of a thread's share of a row, the
// online softmax's: a chunk's values are taken together, so the sum is
// rescaled (one expf) only when the chunk raises the max. A -inf value (a
// masked column) adds nothing, and a thread that has seen only -inf keeps
// (-inf, 0): no expf(-inf - -inf) = NaN is ever formed. A NaN logit makes
// the sum NaN, as the two-pass softmax's would (fmaxf skips it in the max),
// so that a non-finite loss is seen.
template <int kWidth>
__device__ void online_add(const float (&x)[kWidth], float& m, float& s) {
  float cm = x[0];
  for (int k = 1; k < kWidth; ++k) cm = fmaxf(cm, x[k]);
  if (cm > m) {
    s *= expf(m - cm);  // m = -inf: s is 0 (or NaN) and stays so
    m = cm;
  }
  if (m == -INFINITY) {  // every value so far -inf or NaN
    for (int k = 0; k < kWidth; ++k)
      if (x[k] != -INFINITY) s = NAN;
    return;
  }
  for (int k = 0; k < kWidth; ++k) s += expf(x[k] - m);
}

// One block per row, the fused classifier: the row is read once for its max
// and sum of exp(x - max) (online: each thread's running pair, then the
// block's), once more for the output: the probabilities, or with `fused`
// dlogits = (p - onehot(target)) * scale in place. A 50304-wide row is 201
// KB, more than a block can hold in registers at a useful occupancy and all
// of an SM's shared memory, so it is not kept on chip between the two reads.
// (The two-pass softmax kernel and the backward's elementwise kernel read it
// four times and wrote it twice.)
// `vec`: v % 4 == 0 and the logits 16-byte aligned, so rows load as float4
// (and, bf16, dst 8-byte aligned: each four store as one 8-byte access).
// The output goes to `dst` (N, V) of type D: the logits themselves (float,
// in place), or a bf16 array (bf16 activations' dlogits, each rounded once).
// The logits are float or bf16 (bf16 activations' LM head, whose logits
// GEMM rounds its output once); `dst` may be `logits` itself, of either
// type: each element is read (by the thread that writes it) before it is
// written, and the target's logit is read before any is written.
// `vec` with bf16 logits: v % 4 == 0 and logits and dst 8-byte aligned, four
// logits loaded as one 8-byte access.
template <class S>
__device__ __forceinline__ float4 load4(const S* row, int64_t j) {
  if constexpr (sizeof(S) == sizeof(float)) {
    return reinterpret_cast<const float4*>(row)[j];
  } else {
    const uint2 raw = reinterpret_cast<const uint2*>(row)[j];
    return make_float4(bf16_low(raw.x), bf16_high(raw.x), bf16_low(raw.y), bf16_high(raw.y));
  }
}

template <bool fused, bool vec, class S, class D>
__global__ void cross_entropy_kernel(const S* logits, D* dst, const int32_t* targets,
                                     float* losses, float scale, int64_t v) {
  __shared__ float shared[kRowThreads / kWarp];
  const S* row = logits + int64_t{blockIdx.x} * v;
  D* drow = dst + int64_t{blockIdx.x} * v;
  const int32_t target = targets[blockIdx.x];
  float m = -INFINITY, s = 0.0f;
  if constexpr (vec) {
    for (int64_t j = threadIdx.x; j < v / 4; j += blockDim.x) {
      const float4 q = load4(row, j);
      const float x[4] = {q.x, q.y, q.z, q.w};
      online_add<4>(x, m, s);
    }
  } else {
    for (int64_t j = threadIdx.x; j < v; j += blockDim.x) {
      const float x[1] = {load(row, j)};
      online_add<1>(x, m, s);
    }
  }
  // The block's max, then each thread's sum moved onto it (a thread with
  // m = -inf holds 0, or NaN, as it is).
  const float mx = block_reduce(m, shared, Max{});
  s = block_reduce(m == -INFINITY ? s : s * expf(m - mx), shared, Add{});
  const bool valid = target >= 0 && target < v;
  // Read the target's logit before the output pass overwrites the row.
  const float target_logit = valid ? load(row, target) - mx : 0.0f;
  __syncthreads();
  const float inv = 1.0f / s;
  auto out = [&](int64_t j, float x) {
    const float p = expf(x - mx) * inv;
    if constexpr (fused)
      return j == target ? p * scale - scale : p * scale;
    else
      return p;
  };
  if constexpr (vec) {
    for (int64_t j = threadIdx.x; j < v / 4; j += blockDim.x) {
      float4 q = load4(row, j);
      q.x = out(4 * j, q.x);
      q.y = out(4 * j + 1, q.y);
      q.z = out(4 * j + 2, q.z);
      q.w = out(4 * j + 3, q.w);
      if constexpr (sizeof(D) == sizeof(float)) {
        reinterpret_cast<float4*>(drow)[j] = q;
      } else {  // four bf16 in one 8-byte store, each rounded as store() rounds it
        reinterpret_cast<uint2*>(drow)[j] = make_uint2(bf16_pair(q.x, q.y), bf16_pair(q.z, q.w));
      }
    }
  } else {
    for (int64_t j = threadIdx.x; j < v; j += blockDim.x) store(drow, j, out(j, load(row, j)));
  }
  if (threadIdx.x == 0) losses[blockIdx.x] = valid ? logf(s) - target_logit : NAN;
}

// Columns [from, v) of each row = -inf: a padded vocabulary's logits (float
// or bf16, whose -inf is exact).
template <class T>
__global__ void mask_columns_kernel(T* logits, int64_t n, int64_t v, int64_t from) {
  const int64_t w = v - from;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n * w;
       i += int64_t{gridDim.x} * blockDim.x)
    store(logits, (i / w) * v + from + i % w, -INFINITY);
}

// The vocabulary-parallel cross-entropy's local steps, one block per row of
// logits (N, V) holding vocabulary [first, first + V).
__global__ void row_max_kernel(const float* logits, float* m, int64_t v) {
  __shared__ float shared[kRowThreads / kWarp];
  const float* row = logits + int64_t{blockIdx.x} * v;
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < v; j += blockDim.x) mx = fmaxf(mx, row[j]);
  mx = block_reduce(mx, shared, Max{});
  if (threadIdx.x == 0) m[blockIdx.x] = mx;
}

// row = exp(row - m); sum[i] = its sum; z[i] = logit[target] - m here, else 0.
__global__ void exp_and_stats_kernel(float* logits, const int32_t* targets, int64_t first,
                                     const float* m, float* sum, float* z, int64_t v) {
  __shared__ float shared[kRowThreads / kWarp];
  const int64_t i = blockIdx.x;
  float* row = logits + i * v;
  const int64_t col = int64_t{targets[i]} - first;
  // Read the target's logit before this pass overwrites the row.
  const float zi = col >= 0 && col < v ? row[col] - m[i] : 0.0f;
  __syncthreads();
  float s = 0;
  for (int64_t j = threadIdx.x; j < v; j += blockDim.x) {
    const float e = expf(row[j] - m[i]);
    row[j] = e;
    s += e;
  }
  s = block_reduce(s, shared, Add{});
  if (threadIdx.x == 0) {
    sum[i] = s;
    z[i] = zi;
  }
}

// row /= sum[i]; losses[i] = log(sum[i]) - z[i].
__global__ void normalise_kernel(float* p, const float* sum, const float* z, float* losses,
                                 int64_t v) {
  const int64_t i = blockIdx.x;
  const float inv = 1.0f / sum[i];
  float* row = p + i * v;
  for (int64_t j = threadIdx.x; j < v; j += blockDim.x) row[j] *= inv;
  if (threadIdx.x == 0) losses[i] = logf(sum[i]) - z[i];
}

// The vocabulary columns [first, first + v) of dlogits; a target outside them
// (another tensor-parallel rank's) subtracts nothing here.
__global__ void cross_entropy_backward_kernel(const float* probs, const int32_t* targets,
                                              float* dlogits, float scale, int64_t n, int64_t v,
                                              int64_t first) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n * v;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float d = probs[i] * scale;
    dlogits[i] = (i % v) + first == targets[i / v] ? d - scale : d;
  }
}

// ---------------------------------------------------------------- embedding

// wte holds the rows of tokens [first, first + rows); other tokens read 0.
// wpe may be null: no positions added. The sum in fp32, stored as Y (float or bf16).
template <class Y>
__global__ void embedding_forward_kernel(const int32_t* tokens, const float* wte, int64_t rows,
                                         int64_t first, const float* wpe, Y* y, int64_t n,
                                         int64_t t, int64_t c) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n * c;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = i / c, j = i % c;
    const int64_t e = int64_t{tokens[row]} - first;
    const float x = e >= 0 && e < rows ? wte[e * c + j] : 0.0f;
    store(y, i, wpe != nullptr ? x + wpe[(row % t) * c + j] : x);
  }
}

template <class G>
__global__ void embedding_backward_wte_kernel(const int32_t* tokens, const G* dy, float* dwte,
                                              int64_t rows, int64_t first, int64_t n, int64_t c) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n * c;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = i / c, j = i % c;
    const int64_t e = int64_t{tokens[row]} - first;
    if (e >= 0 && e < rows) atomicAdd(dwte + e * c + j, load(dy, i));
  }
}

// dwpe[t, j] += sum over b of dy[b, t, j], summed in batch order.
template <class G>
__global__ void embedding_backward_wpe_kernel(const G* dy, float* dwpe, int64_t b, int64_t t,
                                              int64_t c) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < t * c;
       i += int64_t{gridDim.x} * blockDim.x) {
    float s = 0;
    for (int64_t bi = 0; bi < b; ++bi) s += load(dy, bi * t * c + i);
    dwpe[i] += s;
  }
}

// ---------------------------------------------------------------- AdamW

// One element of the update (cpu::adamw's expression); both kernels below
// inline this, so a tensor gets the same bits from either. Every operation is
// an explicit round-to-nearest intrinsic: the compiler may not contract a
// multiply and an add into an FMA, which it could otherwise do differently in
// the two kernels' contexts.
__device__ __forceinline__ void adamw_element(float* p, const float* g, float* m, float* v,
                                              int64_t i, float beta1, float beta2, float eps,
                                              float step_size, float bc2_sqrt, float decay,
                                              float grad_scale) {
  const float gi = __fmul_rn(g[i], grad_scale);
  const float pi = __fmul_rn(p[i], decay);
  const float mi = __fadd_rn(__fmul_rn(m[i], beta1), __fmul_rn(__fsub_rn(1.0f, beta1), gi));
  const float vi = __fadd_rn(__fmul_rn(v[i], beta2),
                             __fmul_rn(__fmul_rn(__fsub_rn(1.0f, beta2), gi), gi));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), bc2_sqrt), eps);
  p[i] = __fsub_rn(pi, __fmul_rn(step_size, __fdiv_rn(mi, denom)));
  m[i] = mi;
  v[i] = vi;
}

__global__ void adamw_kernel(float* p, const float* g, float* m, float* v, int64_t n, float beta1,
                             float beta2, float eps, float step_size, float bc2_sqrt, float decay,
                             float grad_scale, const float* grad_scale_at) {
  if (grad_scale_at != nullptr) grad_scale = *grad_scale_at;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    adamw_element(p, g, m, v, i, beta1, beta2, eps, step_size, bc2_sqrt, decay, grad_scale);
}

// Every tensor of the table at once: blocks grid-stride over the chunks,
// threads over a chunk's elements. decay_on for the decay group, decay_off
// (1 - lr * 0, as the per-tensor call computes it) for the others.
__global__ void adamw_multi_kernel(const AdamWChunk* chunks, int64_t count, float beta1,
                                   float beta2, float eps, float step_size, float bc2_sqrt,
                                   float decay_on, float decay_off, float grad_scale,
                                   const float* grad_scale_at) {
  if (grad_scale_at != nullptr) grad_scale = *grad_scale_at;
  for (int64_t c = blockIdx.x; c < count; c += gridDim.x) {
    const AdamWChunk k = chunks[c];
    const float decay = k.decay != 0 ? decay_on : decay_off;
    const auto bits = reinterpret_cast<uintptr_t>(k.p) | reinterpret_cast<uintptr_t>(k.g) |
                      reinterpret_cast<uintptr_t>(k.m) | reinterpret_cast<uintptr_t>(k.v);
    if (bits % 16 == 0 && k.n % 4 == 0) {
      // Four elements per access of each array (16-byte loads and stores),
      // each updated by the same adamw_element as one at a time.
      for (int64_t q = threadIdx.x; q < k.n / 4; q += blockDim.x) {
        const float4 p4 = reinterpret_cast<const float4*>(k.p)[q];
        const float4 g4 = reinterpret_cast<const float4*>(k.g)[q];
        const float4 m4 = reinterpret_cast<const float4*>(k.m)[q];
        const float4 v4 = reinterpret_cast<const float4*>(k.v)[q];
        float pa[4] = {p4.x, p4.y, p4.z, p4.w}, ga[4] = {g4.x, g4.y, g4.z, g4.w};
        float ma[4] = {m4.x, m4.y, m4.z, m4.w}, va[4] = {v4.x, v4.y, v4.z, v4.w};
#pragma unroll
        for (int e = 0; e < 4; ++e)
          adamw_element(pa, ga, ma, va, e, beta1, beta2, eps, step_size, bc2_sqrt, decay,
                        grad_scale);
        reinterpret_cast<float4*>(k.p)[q] = make_float4(pa[0], pa[1], pa[2], pa[3]);
        reinterpret_cast<float4*>(k.m)[q] = make_float4(ma[0], ma[1], ma[2], ma[3]);
        reinterpret_cast<float4*>(k.v)[q] = make_float4(va[0], va[1], va[2], va[3]);
      }
      continue;
    }
    for (int64_t i = threadIdx.x; i < k.n; i += blockDim.x)
      adamw_element(k.p, k.g, k.m, k.v, i, beta1, beta2, eps, step_size, bc2_sqrt, decay,
                    grad_scale);
  }
}

// ---------------------------------------------------------------- SGD

__global__ void sgd_kernel(float* p, const float* g, float* buf, int64_t n, float lr,
                           float momentum, float weight_decay) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float d = g[i] + weight_decay * p[i];
    const float b = momentum * buf[i] + d;
    buf[i] = b;
    p[i] -= lr * (momentum > 0.0f ? b : d);
  }
}

// ---------------------------------------------------------------- Lion

// As cpu::lion, element for element.
__global__ void lion_kernel(float* p, const float* g, float* m, int64_t n, float lr, float beta1,
                            float beta2, float decay, float grad_scale,
                            const float* grad_scale_at) {
  if (grad_scale_at != nullptr) grad_scale = *grad_scale_at;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float gi = g[i] * grad_scale;
    const float c = beta1 * m[i] + (1.0f - beta1) * gi;
    const float sign = c > 0.0f ? 1.0f : c < 0.0f ? -1.0f : 0.0f;
    p[i] = p[i] * decay - lr * sign;
    m[i] = beta2 * m[i] + (1.0f - beta2) * gi;
  }
}

// ---------------------------------------------------------------- reductions

constexpr int kReduceBlocks = 1024;

// Pass 1: each block's sum (of x or x^2) in double, over a grid-stride slice.
template <bool square>
__global__ void reduce_partials_kernel(const float* x, int64_t n, double* part) {
  __shared__ double shared[kThreads / kWarp];
  double s = 0;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const double xi = x[i];
    s += square ? xi * xi : xi;
  }
  s = block_reduce(s, shared, Add{});
  if (threadIdx.x == 0) part[blockIdx.x] = s;
}

// Pass 2: one block adds the partials.
// The double total into *out as Out: double, or float rounded to nearest
// (the host's static_cast<float>).
template <class Out>
__global__ void reduce_finish_kernel(const double* part, int64_t count, Out* out) {
  __shared__ double shared[kThreads / kWarp];
  double s = 0;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) s += part[i];
  s = block_reduce(s, shared, Add{});
  if (threadIdx.x == 0) *out = static_cast<Out>(s);
}

// ---------------------------------------------------------------- many tensors at once

// Pass 1 of sum_squares_multi: blocks grid-stride over the table's chunks,
// threads over a chunk's elements; each chunk's sum goes to sums[c]. All
// threads of a block run the same chunks, so every one of them reaches
// block_reduce's barriers. A float's square is exact in double.
__global__ void sum_squares_multi_kernel(const MultiChunk* chunks, int64_t count, double* sums) {
  __shared__ double shared[kThreads / kWarp];
  for (int64_t c = blockIdx.x; c < count; c += gridDim.x) {
    const MultiChunk k = chunks[c];
    double s = 0;
    for (int64_t i = threadIdx.x; i < k.n; i += blockDim.x) {
      const double xi = k.x[i];
      s += xi * xi;
    }
    s = block_reduce(s, shared, Add{});
    if (threadIdx.x == 0) sums[c] = s;
  }
}

// scale_inplace_kernel's multiply on every chunk of the table.
__global__ void scale_multi_kernel(const MultiChunk* chunks, int64_t count, float scale,
                                   const float* scale_at) {
  if (scale_at != nullptr) scale = *scale_at;
  for (int64_t c = blockIdx.x; c < count; c += gridDim.x) {
    const MultiChunk k = chunks[c];
    for (int64_t i = threadIdx.x; i < k.n; i += blockDim.x) k.x[i] *= scale;
  }
}

// clip_coefficient (src/runtime/optimizer.cc) on the device: the same double
// operations, each correctly rounded, so the same bits.
__global__ void clip_coefficient_kernel(const float* sum_squares, double max_norm, float* coef) {
  if (max_norm <= 0) {
    *coef = 1.0f;
    return;
  }
  const double c = max_norm / (sqrt(static_cast<double>(*sum_squares)) + 1e-6);
  *coef = c >= 1.0 ? 1.0f : static_cast<float>(c);
}

// ---------------------------------------------------------------- bf16

__global__ void to_bf16_kernel(const float* x, __nv_bfloat16* y, int64_t n) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    y[i] = __float2bfloat16_rn(x[i]);
}

// to_bf16_kernel's rounding (the same intrinsic, so the same bits) on every
// chunk of the table: blocks grid-stride over the chunks, threads over a
// chunk's elements.
__global__ void to_bf16_multi_kernel(const ConvertChunk* chunks, int64_t count) {
  for (int64_t c = blockIdx.x; c < count; c += gridDim.x) {
    const ConvertChunk k = chunks[c];
    __nv_bfloat16* y = reinterpret_cast<__nv_bfloat16*>(k.y);
    for (int64_t i = threadIdx.x; i < k.n; i += blockDim.x) y[i] = __float2bfloat16_rn(k.x[i]);
  }
}

// x rounded to the nearest fp16 value, ties to even, kept as a float:
// +-inf from 65520 on (where rounding reaches 2^16), NaN kept, fp16's
// subnormal unit 2^-24 below 2^-14. Exact float arithmetic: frexp gives
// x's binary exponent, the fp16 unit there is 2^(e - 11) (11 significant
// bits), and rint rounds x in units of it, to nearest even.
__device__ float fp16_value(float x) {
  const float ax = fabsf(x);
  if (!(ax < 65520.0f)) return ax != ax ? x : copysignf(INFINITY, x);
  int e = 0;
  frexpf(ax, &e);  // ax = m 2^e, m in [0.5, 1)
  const int q = e - 11 > -24 ? e - 11 : -24;
  return ldexpf(rintf(ldexpf(x, -q)), q);
}

// y = x rounded to bf16 (bf16 true) or fp16 values, as floats.
__global__ void round_values_kernel(const float* x, float* y, int64_t n, bool bf16) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    y[i] = bf16 ? __bfloat162float(__float2bfloat16_rn(x[i])) : fp16_value(x[i]);
}

__global__ void to_float_kernel(const __nv_bfloat16* x, float* y, int64_t n) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    y[i] = __bfloat162float(x[i]);
}

__global__ void add_bf16_kernel(const __nv_bfloat16* x, float* y, int64_t n) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    y[i] += __bfloat162float(x[i]);
}

// Causal attention at T = 1: each query sees only its own key, with softmax
// probability exactly 1, so out = v and dS = P (dP - rowsum(dO o O)) =
// dO.v - dO.v = 0: dq = dk = 0, and dv is dO summed over the group's query
// heads (fp32, in head order, rounded once as cuDNN rounds its dV). One
// thread per element of dqkv (B, (H + 2G) D); dout (B, H D).
__global__ void attention_one_position_backward_kernel(const __nv_bfloat16* dout,
                                                       __nv_bfloat16* dqkv, int64_t b, int64_t h,
                                                       int64_t g, int64_t d) {
  const int64_t w = (h + 2 * g) * d, per_group = h / g;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < b * w;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t bi = i / w, col = i % w, head = col / d, di = col % d;
    float sum = 0.0f;
    if (head >= h + g) {
      const int64_t gi = head - h - g;
      for (int64_t hi = gi * per_group; hi < (gi + 1) * per_group; ++hi)
        sum += load(dout, (bi * h + hi) * d + di);
    }
    store(dqkv, i, sum);
  }
}

// Rows per block for the one-warp-per-row kernels.
constexpr int kRowsPerBlock = kThreads / kWarp;
unsigned row_blocks(int64_t n) {
  return static_cast<unsigned>((n + kRowsPerBlock - 1) / kRowsPerBlock);
}

// The launchers' bf16 arrays (uint16_t, launch.h) as CUDA's type.
static_assert(sizeof(uint16_t) == sizeof(__nv_bfloat16), "bf16 is 2 bytes");
const __nv_bfloat16* bf(const uint16_t* p) { return reinterpret_cast<const __nv_bfloat16*>(p); }
__nv_bfloat16* bf(uint16_t* p) { return reinterpret_cast<__nv_bfloat16*>(p); }

// The bf16 vector kernels' conditions and grid: every array 16-byte aligned;
// one thread per whole vector (the tail's few elements ride along).
bool aligned16(std::initializer_list<const void*> ps) {
  for (const void* p : ps)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}
unsigned vec_blocks(int64_t n) { return blocks_for((n + kVec - 1) / kVec); }

// Groups of 8 a lane owns in the LayerNorm vector kernels, for rows of c: 0
// (the scalar kernels) unless c is a multiple of 8 and at most 32 * 8 *
// kMaxLaneGroups, and every array is 16-byte aligned (then so is every row:
// c / 8 whole 16-byte or 32-byte groups after the first). Rounded up to a
// count that is instantiated. It depends on c and the arrays' addresses only,
// not on their element types, so an fp32 and a bf16 call on arrays of one
// shape take the same kernel shape.
int layernorm_lane_groups(int64_t c, std::initializer_list<const void*> ps) {
  if (c <= 0 || c % kVec != 0 || !aligned16(ps)) return 0;
  const int64_t per_lane = (c / kVec + kWarp - 1) / kWarp;
  if (per_lane > kMaxLaneGroups) return 0;
  return per_lane <= 4 ? static_cast<int>(per_lane) : per_lane <= 6 ? 6 : 8;
}

// f(std::integral_constant<int, k>{}) for a count k of layernorm_lane_groups.
template <class F>
void with_lane_groups(int k, F f) {
  switch (k) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    default: f(std::integral_constant<int, kMaxLaneGroups>{}); break;
  }
}

// The LayerNorm launchers for either type of activations X, Y and gradients G.
template <class X, class Y>
void layernorm_forward_of(cudaStream_t s, const X* x, const float* w, const float* b, Y* y,
                          float* mean, float* rstd, int64_t n, int64_t c, float eps) {
  const int k = layernorm_lane_groups(c, {x, w, b, y});
  if (k == 0) {
    layernorm_forward_kernel<<<row_blocks(n), kThreads, 0, s>>>(x, w, b, y, mean, rstd, n, c, eps);
    return;
  }
  with_lane_groups(k, [&](auto groups) {
    layernorm_forward_vec_kernel<decltype(groups)::value, false>
        <<<row_blocks(n), kThreads, 0, s>>>(x, static_cast<const X*>(nullptr),
                                            static_cast<X*>(nullptr), w, b, y, mean, rstd, n, c,
                                            eps);
  });
}

// sum = x + a and y = LayerNorm(sum) in one kernel where the vector kernel
// takes rows of c; false, launching nothing, where it does not.
template <class X>
bool add_layernorm_forward_of(cudaStream_t s, const X* x, const X* a, X* sum, const float* w,
                              const float* b, X* y, float* mean, float* rstd, int64_t n,
                              int64_t c, float eps) {
  const int k = layernorm_lane_groups(c, {x, a, sum, w, b, y});
  if (k == 0) return false;
  with_lane_groups(k, [&](auto groups) {
    layernorm_forward_vec_kernel<decltype(groups)::value, true>
        <<<row_blocks(n), kThreads, 0, s>>>(x, a, sum, w, b, y, mean, rstd, n, c, eps);
  });
  return true;
}

template <class X, class G>
void layernorm_backward_input_of(cudaStream_t s, const G* dy, const X* x, const float* w,
                                 const float* mean, const float* rstd, G* dx, int64_t n,
                                 int64_t c) {
  const int k = layernorm_lane_groups(c, {dy, x, w, dx});
  if (k == 0) {
    layernorm_backward_input_kernel<<<row_blocks(n), kThreads, 0, s>>>(dy, x, w, mean, rstd, dx,
                                                                       n, c);
    return;
  }
  with_lane_groups(k, [&](auto groups) {
    layernorm_backward_input_vec_kernel<decltype(groups)::value, false>
        <<<row_blocks(n), kThreads, 0, s>>>(dy, x, w, mean, rstd, dx, static_cast<G*>(nullptr),
                                            n, c);
  });
}

// dx += d/dx and copy = dx in one kernel where the vector kernel takes rows
// of c; false, launching nothing, where it does not.
template <class X, class G>
bool layernorm_backward_input_copy_of(cudaStream_t s, const G* dy, const X* x, const float* w,
                                      const float* mean, const float* rstd, G* dx, G* copy,
                                      int64_t n, int64_t c) {
  const int k = layernorm_lane_groups(c, {dy, x, w, dx, copy});
  if (k == 0) return false;
  with_lane_groups(k, [&](auto groups) {
    layernorm_backward_input_vec_kernel<decltype(groups)::value, true>
        <<<row_blocks(n), kThreads, 0, s>>>(dy, x, w, mean, rstd, dx, copy, n, c);
  });
  return true;
}

// column_sums for either type of x and dy. The 16-byte kernel when c is a
// multiple of 8 and dy (and x, when read) are 16-byte aligned; it gives the
// same partials as the scalar one.
template <class X, class G>
void column_sums_of(cudaStream_t s, const G* dy, const X* x, const float* mean,
                    const float* rstd, float* dw, float* db, float* partials, int64_t n,
                    int64_t c) {
  const int64_t slices = column_slices(n);
  const bool norm = dw != nullptr;
  const bool vec = c % kVec == 0 && (norm ? aligned16({dy, x}) : aligned16({dy}));
  const int64_t tile = vec ? kColVecTile : kColTile;
  const dim3 grid(static_cast<unsigned>((c + tile - 1) / tile), static_cast<unsigned>(slices));
  const dim3 block(kWarp, kRowLanes);
  static_assert(kColTile == kWarp, "a block's threadIdx.x spans its tile's columns");
  float* part_db = partials;
  float* part_dw = norm ? partials + slices * c : nullptr;
  if (norm && vec)
    column_partials_vec_kernel<true, X, G><<<grid, block, 0, s>>>(dy, x, mean, rstd, part_dw,
                                                                  part_db, n, c);
  else if (norm)
    column_partials_kernel<true, X, G><<<grid, block, 0, s>>>(dy, x, mean, rstd, part_dw, part_db,
                                                              n, c);
  else if (vec)
    column_partials_vec_kernel<false, X, G><<<grid, block, 0, s>>>(dy, x, mean, rstd, nullptr,
                                                                   part_db, n, c);
  else
    column_partials_kernel<false, X, G><<<grid, block, 0, s>>>(dy, x, mean, rstd, nullptr, part_db,
                                                               n, c);
  if (norm) column_finish_kernel<<<blocks_for(c), kThreads, 0, s>>>(part_dw, dw, slices, c);
  column_finish_kernel<<<blocks_for(c), kThreads, 0, s>>>(part_db, db, slices, c);
}

}  // namespace

// ---------------------------------------------------------------- launchers

void layernorm_forward(cudaStream_t s, const float* x, const float* w, const float* b, float* y,
                       float* mean, float* rstd, int64_t n, int64_t c, float eps) {
  layernorm_forward_of(s, x, w, b, y, mean, rstd, n, c, eps);
}

void layernorm_forward(cudaStream_t s, const uint16_t* x, const float* w, const float* b,
                       uint16_t* y, float* mean, float* rstd, int64_t n, int64_t c, float eps) {
  layernorm_forward_of(s, bf(x), w, b, bf(y), mean, rstd, n, c, eps);
}

void layernorm_backward_input(cudaStream_t s, const float* dy, const float* x, const float* w,
                              const float* mean, const float* rstd, float* dx, int64_t n,
                              int64_t c) {
  layernorm_backward_input_of(s, dy, x, w, mean, rstd, dx, n, c);
}

void layernorm_backward_input(cudaStream_t s, const uint16_t* dy, const uint16_t* x,
                              const float* w, const float* mean, const float* rstd, uint16_t* dx,
                              int64_t n, int64_t c) {
  layernorm_backward_input_of(s, bf(dy), bf(x), w, mean, rstd, bf(dx), n, c);
}

bool add_layernorm_forward(cudaStream_t s, const float* x, const float* a, float* sum,
                           const float* w, const float* b, float* y, float* mean, float* rstd,
                           int64_t n, int64_t c, float eps) {
  return add_layernorm_forward_of(s, x, a, sum, w, b, y, mean, rstd, n, c, eps);
}

bool add_layernorm_forward(cudaStream_t s, const uint16_t* x, const uint16_t* a, uint16_t* sum,
                           const float* w, const float* b, uint16_t* y, float* mean, float* rstd,
                           int64_t n, int64_t c, float eps) {
  return add_layernorm_forward_of(s, bf(x), bf(a), bf(sum), w, b, bf(y), mean, rstd, n, c, eps);
}

bool layernorm_backward_input_copy(cudaStream_t s, const float* dy, const float* x,
                                   const float* w, const float* mean, const float* rstd,
                                   float* dx, float* copy, int64_t n, int64_t c) {
  return layernorm_backward_input_copy_of(s, dy, x, w, mean, rstd, dx, copy, n, c);
}

bool layernorm_backward_input_copy(cudaStream_t s, const uint16_t* dy, const uint16_t* x,
                                   const float* w, const float* mean, const float* rstd,
                                   uint16_t* dx, uint16_t* copy, int64_t n, int64_t c) {
  return layernorm_backward_input_copy_of(s, bf(dy), bf(x), w, mean, rstd, bf(dx), bf(copy), n,
                                          c);
}

// About 16 rows per thread of the first pass, at most 128 slices.
int64_t column_slices(int64_t n) {
  return std::clamp<int64_t>((n + kRowLanes * 16 - 1) / (kRowLanes * 16), 1, 128);
}

void column_sums(cudaStream_t s, const float* dy, const float* x, const float* mean,
                 const float* rstd, float* dw, float* db, float* partials, int64_t n, int64_t c) {
  column_sums_of(s, dy, x, mean, rstd, dw, db, partials, n, c);
}

void column_sums(cudaStream_t s, const uint16_t* dy, const uint16_t* x, const float* mean,
                 const float* rstd, float* dw, float* db, float* partials, int64_t n, int64_t c) {
  column_sums_of(s, bf(dy), bf(x), mean, rstd, dw, db, partials, n, c);
}

template <class T>
void rmsnorm_forward_of(cudaStream_t s, const T* x, const float* w, T* y, float* rstd, int64_t n,
                        int64_t c, float eps) {
  rmsnorm_forward_kernel<<<row_blocks(n), kThreads, 0, s>>>(x, w, y, rstd, n, c, eps);
}

template <class T>
void rmsnorm_backward_input_of(cudaStream_t s, const T* dy, const T* x, const float* w,
                               const float* rstd, T* dx, int64_t n, int64_t c) {
  rmsnorm_backward_input_kernel<<<row_blocks(n), kThreads, 0, s>>>(dy, x, w, rstd, dx, n, c);
}

template <class T>
void rope_of(cudaStream_t s, bool backward, const T* src, T* dst, int64_t b, int64_t t, int64_t h,
             int64_t g, int64_t d, float base) {
  const int64_t work = b * t * (h + 2 * g) * d / 2;
  if (backward)
    rope_kernel<true><<<blocks_for(work), kThreads, 0, s>>>(src, dst, b * t, t, h, g, d, base);
  else
    rope_kernel<false><<<blocks_for(work), kThreads, 0, s>>>(src, dst, b * t, t, h, g, d, base);
}

void rmsnorm_forward(cudaStream_t s, const float* x, const float* w, float* y, float* rstd,
                     int64_t n, int64_t c, float eps) {
  rmsnorm_forward_of(s, x, w, y, rstd, n, c, eps);
}

void rmsnorm_forward(cudaStream_t s, const uint16_t* x, const float* w, uint16_t* y, float* rstd,
                     int64_t n, int64_t c, float eps) {
  rmsnorm_forward_of(s, bf(x), w, bf(y), rstd, n, c, eps);
}

void rmsnorm_backward_input(cudaStream_t s, const float* dy, const float* x, const float* w,
                            const float* rstd, float* dx, int64_t n, int64_t c) {
  rmsnorm_backward_input_of(s, dy, x, w, rstd, dx, n, c);
}

void rmsnorm_backward_input(cudaStream_t s, const uint16_t* dy, const uint16_t* x, const float* w,
                            const float* rstd, uint16_t* dx, int64_t n, int64_t c) {
  rmsnorm_backward_input_of(s, bf(dy), bf(x), w, rstd, bf(dx), n, c);
}

void swiglu_forward(cudaStream_t s, const float* x, float* y, int64_t n, int64_t h) {
  swiglu_forward_kernel<<<blocks_for(n * h), kThreads, 0, s>>>(x, y, n, h);
}

void swiglu_forward(cudaStream_t s, const uint16_t* x, uint16_t* y, int64_t n, int64_t h) {
  swiglu_forward_kernel<<<blocks_for(n * h), kThreads, 0, s>>>(bf(x), bf(y), n, h);
}

void swiglu_backward(cudaStream_t s, const float* dy, const float* x, float* dx, int64_t n,
                     int64_t h) {
  swiglu_backward_kernel<<<blocks_for(n * h), kThreads, 0, s>>>(dy, x, dx, n, h);
}

void swiglu_backward(cudaStream_t s, const uint16_t* dy, const uint16_t* x, uint16_t* dx,
                     int64_t n, int64_t h) {
  swiglu_backward_kernel<<<blocks_for(n * h), kThreads, 0, s>>>(bf(dy), bf(x), bf(dx), n, h);
}

void rope(cudaStream_t s, bool backward, const float* src, float* dst, int64_t b, int64_t t,
          int64_t h, int64_t g, int64_t d, float base) {
  rope_of(s, backward, src, dst, b, t, h, g, d, base);
}

void rope(cudaStream_t s, bool backward, const uint16_t* src, uint16_t* dst, int64_t b, int64_t t,
          int64_t h, int64_t g, int64_t d, float base) {
  rope_of(s, backward, bf(src), bf(dst), b, t, h, g, d, base);
}

void gelu_forward(cudaStream_t s, const float* x, float* y, int64_t n) {
  gelu_forward_kernel<<<blocks_for(n), kThreads, 0, s>>>(x, y, n);
}

void gelu_forward(cudaStream_t s, const uint16_t* x, uint16_t* y, int64_t n) {
  if (aligned16({x, y}))
    gelu_forward_vec_kernel<<<vec_blocks(n), kThreads, 0, s>>>(bf(x), bf(y), n);
  else
    gelu_forward_kernel<<<blocks_for(n), kThreads, 0, s>>>(bf(x), bf(y), n);
}

void gelu_backward(cudaStream_t s, const float* dy, const float* x, float* dx, int64_t n,
                   bool accumulate) {
  gelu_backward_kernel<<<blocks_for(n), kThreads, 0, s>>>(dy, x, dx, n, accumulate);
}

void gelu_backward(cudaStream_t s, const uint16_t* dy, const uint16_t* x, uint16_t* dx, int64_t n,
                   bool accumulate) {
  if (aligned16({dy, x, dx}))
    gelu_backward_vec_kernel<<<vec_blocks(n), kThreads, 0, s>>>(bf(dy), bf(x), bf(dx), n,
                                                                accumulate);
  else
    gelu_backward_kernel<<<blocks_for(n), kThreads, 0, s>>>(bf(dy), bf(x), bf(dx), n, accumulate);
}

void add_bias(cudaStream_t s, float* y, const float* bias, int64_t n, int64_t c) {
  add_bias_kernel<<<blocks_for(n * c), kThreads, 0, s>>>(y, bias, n, c);
}

void add_inplace(cudaStream_t s, float* y, const float* x, int64_t n) {
  add_inplace_kernel<<<blocks_for(n), kThreads, 0, s>>>(y, x, n);
}

void add_inplace(cudaStream_t s, uint16_t* y, const uint16_t* x, int64_t n) {
  if (aligned16({y, x}))
    add_vec_kernel<<<vec_blocks(n), kThreads, 0, s>>>(bf(y), bf(x), bf(y), n);
  else
    add_inplace_kernel<<<blocks_for(n), kThreads, 0, s>>>(bf(y), bf(x), n);
}

void add_scaled(cudaStream_t s, float* y, const float* x, float scale, int64_t n) {
  add_scaled_kernel<<<blocks_for(n), kThreads, 0, s>>>(y, x, scale, n);
}

void add_scaled(cudaStream_t s, uint16_t* y, const float* x, float scale, int64_t n) {
  add_scaled_kernel<<<blocks_for(n), kThreads, 0, s>>>(bf(y), x, scale, n);
}

void add(cudaStream_t s, const float* a, const float* b, float* y, int64_t n) {
  add_kernel<<<blocks_for(n), kThreads, 0, s>>>(a, b, y, n);
}

void add(cudaStream_t s, const uint16_t* a, const uint16_t* b, uint16_t* y, int64_t n) {
  if (aligned16({a, b, y}))
    add_vec_kernel<<<vec_blocks(n), kThreads, 0, s>>>(bf(a), bf(b), bf(y), n);
  else
    add_kernel<<<blocks_for(n), kThreads, 0, s>>>(bf(a), bf(b), bf(y), n);
}

void add_inplace(cudaStream_t s, uint16_t* y, const float* x, int64_t n) {
  add_inplace_kernel<<<blocks_for(n), kThreads, 0, s>>>(bf(y), x, n);
}

void fill_rows(cudaStream_t s, uint16_t* y, const float* row, int64_t n, int64_t c) {
  fill_rows_kernel<<<blocks_for(n * c), kThreads, 0, s>>>(bf(y), row, n, c);
}

void add_bias_bf16(cudaStream_t s, const float* x, const uint16_t* bias, uint16_t* y, int64_t n,
                   int64_t c, int64_t ldy) {
  add_bias_bf16_kernel<<<blocks_for(n * c), kThreads, 0, s>>>(x, bf(bias), bf(y), n, c, ldy);
}

void scale_inplace(cudaStream_t s, float* y, float scale, int64_t n) {
  scale_inplace_kernel<<<blocks_for(n), kThreads, 0, s>>>(y, scale, n);
}

void fill32(cudaStream_t s, uint32_t* y, uint32_t bits, int64_t n) {
  fill_kernel<<<blocks_for(n), kThreads, 0, s>>>(y, bits, n);
}

void fill16(cudaStream_t s, uint16_t* y, uint16_t bits, int64_t n) {
  fill_kernel<<<blocks_for(n), kThreads, 0, s>>>(y, bits, n);
}

void mask_columns(cudaStream_t s, float* logits, int64_t n, int64_t v, int64_t from) {
  mask_columns_kernel<<<blocks_for(n * (v - from)), kThreads, 0, s>>>(logits, n, v, from);
}

void mask_columns_bf16(cudaStream_t s, uint16_t* logits, int64_t n, int64_t v, int64_t from) {
  mask_columns_kernel<<<blocks_for(n * (v - from)), kThreads, 0, s>>>(bf(logits), n, v, from);
}

void cross_entropy(cudaStream_t s, float* logits, const int32_t* targets, float* losses,
                   float scale, bool fused, int64_t n, int64_t v) {
  const unsigned rows = static_cast<unsigned>(n);
  const bool vec = v % 4 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0;
  if (fused && vec)
    cross_entropy_kernel<true, true><<<rows, kRowThreads, 0, s>>>(logits, logits, targets, losses,
                                                                  scale, v);
  else if (fused)
    cross_entropy_kernel<true, false><<<rows, kRowThreads, 0, s>>>(logits, logits, targets, losses,
                                                                   scale, v);
  else if (vec)
    cross_entropy_kernel<false, true><<<rows, kRowThreads, 0, s>>>(logits, logits, targets, losses,
                                                                   scale, v);
  else
    cross_entropy_kernel<false, false><<<rows, kRowThreads, 0, s>>>(logits, logits, targets,
                                                                    losses, scale, v);
}

void cross_entropy_bf16(cudaStream_t s, const float* logits, uint16_t* dlogits,
                        const int32_t* targets, float* losses, float scale, int64_t n, int64_t v) {
  const unsigned rows = static_cast<unsigned>(n);
  if (v % 4 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(dlogits) % 8 == 0)
    cross_entropy_kernel<true, true><<<rows, kRowThreads, 0, s>>>(logits, bf(dlogits), targets,
                                                                  losses, scale, v);
  else
    cross_entropy_kernel<true, false><<<rows, kRowThreads, 0, s>>>(logits, bf(dlogits), targets,
                                                                   losses, scale, v);
}

void cross_entropy_bf16_logits(cudaStream_t s, const uint16_t* logits, uint16_t* dlogits,
                               const int32_t* targets, float* losses, float scale, int64_t n,
                               int64_t v) {
  const unsigned rows = static_cast<unsigned>(n);
  if (v % 4 == 0 && reinterpret_cast<uintptr_t>(logits) % 8 == 0 &&
      reinterpret_cast<uintptr_t>(dlogits) % 8 == 0)
    cross_entropy_kernel<true, true><<<rows, kRowThreads, 0, s>>>(bf(logits), bf(dlogits),
                                                                  targets, losses, scale, v);
  else
    cross_entropy_kernel<true, false><<<rows, kRowThreads, 0, s>>>(bf(logits), bf(dlogits),
                                                                   targets, losses, scale, v);
}

void cross_entropy_backward(cudaStream_t s, const float* probs, const int32_t* targets,
                            float* dlogits, float scale, int64_t n, int64_t v, int64_t first) {
  cross_entropy_backward_kernel<<<blocks_for(n * v), kThreads, 0, s>>>(probs, targets, dlogits,
                                                                       scale, n, v, first);
}

void row_max(cudaStream_t s, const float* logits, float* m, int64_t n, int64_t v) {
  row_max_kernel<<<static_cast<unsigned>(n), kRowThreads, 0, s>>>(logits, m, v);
}

void exp_and_stats(cudaStream_t s, float* logits, const int32_t* targets, int64_t first,
                   const float* m, float* sum, float* z, int64_t n, int64_t v) {
  exp_and_stats_kernel<<<static_cast<unsigned>(n), kRowThreads, 0, s>>>(logits, targets, first, m,
                                                                        sum, z, v);
}

void normalise(cudaStream_t s, float* p, const float* sum, const float* z, float* losses,
               int64_t n, int64_t v) {
  normalise_kernel<<<static_cast<unsigned>(n), kRowThreads, 0, s>>>(p, sum, z, losses, v);
}

void embedding_forward(cudaStream_t s, const int32_t* tokens, const float* wte, int64_t rows,
                       int64_t first, const float* wpe, float* y, int64_t b, int64_t t,
                       int64_t c) {
  embedding_forward_kernel<<<blocks_for(b * t * c), kThreads, 0, s>>>(tokens, wte, rows, first,
                                                                      wpe, y, b * t, t, c);
}

void embedding_forward(cudaStream_t s, const int32_t* tokens, const float* wte, int64_t rows,
                       int64_t first, const float* wpe, uint16_t* y, int64_t b, int64_t t,
                       int64_t c) {
  embedding_forward_kernel<<<blocks_for(b * t * c), kThreads, 0, s>>>(tokens, wte, rows, first,
                                                                      wpe, bf(y), b * t, t, c);
}

void embedding_backward(cudaStream_t s, const int32_t* tokens, const float* dy, float* dwte,
                        int64_t rows, int64_t first, float* dwpe, int64_t b, int64_t t,
                        int64_t c) {
  embedding_backward_wte_kernel<<<blocks_for(b * t * c), kThreads, 0, s>>>(tokens, dy, dwte, rows,
                                                                           first, b * t, c);
  if (dwpe != nullptr)
    embedding_backward_wpe_kernel<<<blocks_for(t * c), kThreads, 0, s>>>(dy, dwpe, b, t, c);
}

void embedding_backward(cudaStream_t s, const int32_t* tokens, const uint16_t* dy, float* dwte,
                        int64_t rows, int64_t first, float* dwpe, int64_t b, int64_t t,
                        int64_t c) {
  embedding_backward_wte_kernel<<<blocks_for(b * t * c), kThreads, 0, s>>>(tokens, bf(dy), dwte,
                                                                           rows, first, b * t, c);
  if (dwpe != nullptr)
    embedding_backward_wpe_kernel<<<blocks_for(t * c), kThreads, 0, s>>>(bf(dy), dwpe, b, t, c);
}

void adamw(cudaStream_t s, float* p, const float* g, float* m, float* v, int64_t n, float beta1,
           float beta2, float eps, float step_size, float bc2_sqrt, float decay,
           float grad_scale, const float* grad_scale_at) {
  adamw_kernel<<<blocks_for(n), kThreads, 0, s>>>(p, g, m, v, n, beta1, beta2, eps, step_size,
                                                  bc2_sqrt, decay, grad_scale, grad_scale_at);
}

void adamw_multi(cudaStream_t s, const AdamWChunk* chunks, int64_t count, float beta1,
                 float beta2, float eps, float step_size, float bc2_sqrt, float decay_on,
                 float decay_off, float grad_scale, const float* grad_scale_at) {
  const unsigned blocks = static_cast<unsigned>(std::clamp<int64_t>(count, 1, int64_t{1} << 16));
  adamw_multi_kernel<<<blocks, kThreads, 0, s>>>(chunks, count, beta1, beta2, eps, step_size,
                                                 bc2_sqrt, decay_on, decay_off, grad_scale,
                                                 grad_scale_at);
}

void sgd(cudaStream_t s, float* p, const float* g, float* buf, int64_t n, float lr,
         float momentum, float weight_decay) {
  sgd_kernel<<<blocks_for(n), kThreads, 0, s>>>(p, g, buf, n, lr, momentum, weight_decay);
}

void lion(cudaStream_t s, float* p, const float* g, float* m, int64_t n, float lr, float beta1,
          float beta2, float decay, float grad_scale, const float* grad_scale_at) {
  lion_kernel<<<blocks_for(n), kThreads, 0, s>>>(p, g, m, n, lr, beta1, beta2, decay, grad_scale,
                                                 grad_scale_at);
}

int64_t reduce_blocks(int64_t n) { return std::min<int64_t>(blocks_for(n), kReduceBlocks); }

namespace {
template <class Out>
void reduce_into(cudaStream_t s, const float* x, int64_t n, bool square, double* partials,
                 Out* out) {
  const int64_t blocks = reduce_blocks(n);
  if (square)
    reduce_partials_kernel<true><<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(x, n, partials);
  else
    reduce_partials_kernel<false><<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(x, n, partials);
  reduce_finish_kernel<<<1, kThreads, 0, s>>>(partials, blocks, out);
}
}  // namespace

void reduce(cudaStream_t s, const float* x, int64_t n, bool square, double* partials,
            double* out) {
  reduce_into(s, x, n, square, partials, out);
}

void reduce(cudaStream_t s, const float* x, int64_t n, bool square, double* partials,
            float* out) {
  reduce_into(s, x, n, square, partials, out);
}

void sum_squares_multi(cudaStream_t s, const MultiChunk* chunks, int64_t count, double* sums,
                       float* total) {
  const unsigned blocks = static_cast<unsigned>(std::clamp<int64_t>(count, 1, int64_t{1} << 16));
  sum_squares_multi_kernel<<<blocks, kThreads, 0, s>>>(chunks, count, sums);
  // The partials in a fixed order (reduce's second pass), into sums[count]
  // or, rounded, into *total.
  if (total != nullptr)
    reduce_finish_kernel<<<1, kThreads, 0, s>>>(sums, count, total);
  else
    reduce_finish_kernel<<<1, kThreads, 0, s>>>(sums, count, sums + count);
}

void scale_multi(cudaStream_t s, const MultiChunk* chunks, int64_t count, float scale,
                 const float* scale_at) {
  const unsigned blocks = static_cast<unsigned>(std::clamp<int64_t>(count, 1, int64_t{1} << 16));
  scale_multi_kernel<<<blocks, kThreads, 0, s>>>(chunks, count, scale, scale_at);
}

void clip_coefficient(cudaStream_t s, const float* sum_squares, double max_norm, float* coef) {
  clip_coefficient_kernel<<<1, 1, 0, s>>>(sum_squares, max_norm, coef);
}

void to_bf16(cudaStream_t s, const float* x, uint16_t* y, int64_t n) {
  to_bf16_kernel<<<blocks_for(n), kThreads, 0, s>>>(x, bf(y), n);
}

void to_bf16_multi(cudaStream_t s, const ConvertChunk* chunks, int64_t count) {
  const unsigned blocks = static_cast<unsigned>(std::clamp<int64_t>(count, 1, int64_t{1} << 16));
  to_bf16_multi_kernel<<<blocks, kThreads, 0, s>>>(chunks, count);
}

void round_values(cudaStream_t s, const float* x, float* y, int64_t n, bool bf16) {
  round_values_kernel<<<blocks_for(n), kThreads, 0, s>>>(x, y, n, bf16);
}

void to_float(cudaStream_t s, const uint16_t* x, float* y, int64_t n) {
  to_float_kernel<<<blocks_for(n), kThreads, 0, s>>>(bf(x), y, n);
}

void add_bf16(cudaStream_t s, const uint16_t* x, float* y, int64_t n) {
  add_bf16_kernel<<<blocks_for(n), kThreads, 0, s>>>(bf(x), y, n);
}

void attention_one_position_backward(cudaStream_t s, const uint16_t* dout, uint16_t* dqkv,
                                     int64_t b, int64_t h, int64_t g, int64_t d) {
  attention_one_position_backward_kernel<<<blocks_for(b * (h + 2 * g) * d), kThreads, 0, s>>>(
      bf(dout), bf(dqkv), b, h, g, d);
}

}  // namespace weft::cuda::launch
