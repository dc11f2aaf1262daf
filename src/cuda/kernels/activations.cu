// GELU (scalar and 16-byte bf16), SwiGLU and rotary position embedding.
// Device code and its launchers (src/cuda/launch.h); the shared helpers are
// in common.cuh.
#include "src/cuda/kernels/common.cuh"

namespace weft::cuda::launch {

namespace {

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
// is rotated by pos * base^(-2i/D), the G value heads copied; pos is the
// row's place in its sequence, or positions[row] where given.
// backward: the inverse rotation, accumulated.
template <bool backward, class T>
__global__ void rope_kernel(const T* src, T* dst, int64_t rows, int64_t t, int64_t h, int64_t g,
                            int64_t d, float base, const int32_t* positions) {
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
    const float angle =
        static_cast<float>(static_cast<double>(positions ? positions[row] : row % t) *
                           pow(static_cast<double>(base), -2.0 * p / static_cast<double>(d)));
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

}  // namespace

template <class T>
void rope_of(cudaStream_t s, bool backward, const T* src, T* dst, int64_t b, int64_t t, int64_t h,
             int64_t g, int64_t d, float base, const int32_t* positions) {
  const int64_t work = b * t * (h + 2 * g) * d / 2;
  if (backward)
    rope_kernel<true>
        <<<blocks_for(work), kThreads, 0, s>>>(src, dst, b * t, t, h, g, d, base, positions);
  else
    rope_kernel<false>
        <<<blocks_for(work), kThreads, 0, s>>>(src, dst, b * t, t, h, g, d, base, positions);
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
          int64_t h, int64_t g, int64_t d, float base, const int32_t* positions) {
  rope_of(s, backward, src, dst, b, t, h, g, d, base, positions);
}

void rope(cudaStream_t s, bool backward, const uint16_t* src, uint16_t* dst, int64_t b, int64_t t,
          int64_t h, int64_t g, int64_t d, float base, const int32_t* positions) {
  rope_of(s, backward, bf(src), bf(dst), b, t, h, g, d, base, positions);
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


}  // namespace weft::cuda::launch
