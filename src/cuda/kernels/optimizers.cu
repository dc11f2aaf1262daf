// The optimizers' element-wise updates: AdamW (one tensor, or many in one
// launch), SGD with momentum, Lion.
// Device code and its launchers (src/cuda/launch.h); the shared helpers are
// in common.cuh.
#include "src/cuda/kernels/common.cuh"

namespace weft::cuda::launch {

namespace {

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


}  // namespace

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


}  // namespace weft::cuda::launch
