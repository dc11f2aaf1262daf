// Softmax cross-entropy: fused with its gradient, over the vocabulary
// slices of tensor parallelism (row maxima, sums, normalisation), and masking.
// Device code and its launchers (src/cuda/launch.h); the shared helpers are
// in common.cuh.
#include "src/cuda/kernels/common.cuh"

namespace weft::cuda::launch {

namespace {

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
  const bool ignored = target == weft::kIgnoredTarget;  // no loss term, dlogits 0
  // Read the target's logit before the output pass overwrites the row.
  const float target_logit = valid ? load(row, target) - mx : 0.0f;
  __syncthreads();
  const float inv = 1.0f / s;
  auto out = [&](int64_t j, float x) {
    const float p = expf(x - mx) * inv;
    if constexpr (fused)
      return ignored ? 0.0f : j == target ? p * scale - scale : p * scale;
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
  if (threadIdx.x == 0) losses[blockIdx.x] = ignored ? 0.0f : valid ? logf(s) - target_logit : NAN;
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

// row /= sum[i]; losses[i] = log(sum[i]) - z[i], or 0 for an ignored target.
__global__ void normalise_kernel(float* p, const float* sum, const float* z, const int32_t* targets,
                                 float* losses, int64_t v) {
  const int64_t i = blockIdx.x;
  const float inv = 1.0f / sum[i];
  float* row = p + i * v;
  for (int64_t j = threadIdx.x; j < v; j += blockDim.x) row[j] *= inv;
  if (threadIdx.x == 0) losses[i] = targets[i] == weft::kIgnoredTarget ? 0.0f : logf(sum[i]) - z[i];
}

// The vocabulary columns [first, first + v) of dlogits; a target outside them
// (another tensor-parallel rank's) subtracts nothing here; an ignored one's
// row is 0.
__global__ void cross_entropy_backward_kernel(const float* probs, const int32_t* targets,
                                              float* dlogits, float scale, int64_t n, int64_t v,
                                              int64_t first) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n * v;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int32_t target = targets[i / v];
    const float d = target == weft::kIgnoredTarget ? 0.0f : probs[i] * scale;
    dlogits[i] = (i % v) + first == target ? d - scale : d;
  }
}


}  // namespace

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

void normalise(cudaStream_t s, float* p, const float* sum, const float* z, const int32_t* targets,
               float* losses, int64_t n, int64_t v) {
  normalise_kernel<<<static_cast<unsigned>(n), kRowThreads, 0, s>>>(p, sum, z, targets, losses, v);
}

}  // namespace weft::cuda::launch
