// Sums and sums of squares in fixed-shape trees, the gradient norm and
// scaling over many tensors at once, and the clip coefficient.
// Device code and its launchers (src/cuda/launch.h); the shared helpers are
// in common.cuh.
#include "src/cuda/kernels/common.cuh"

namespace weft::cuda::launch {

namespace {

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


}  // namespace

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


}  // namespace weft::cuda::launch
