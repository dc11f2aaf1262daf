// Element-wise adds, scales and fills, bias adds, and the conversions between
// fp32, bf16 and fp16 values.
// Device code and its launchers (src/cuda/launch.h); the shared helpers are
// in common.cuh.
#include "src/cuda/kernels/common.cuh"

namespace weft::cuda::launch {

namespace {

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

}  // namespace

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

}  // namespace weft::cuda::launch
