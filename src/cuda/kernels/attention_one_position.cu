// Attention's backward at T = 1 (a decode step of one position).
// Device code and its launchers (src/cuda/launch.h); the shared helpers are
// in common.cuh.
#include "src/cuda/kernels/common.cuh"

namespace weft::cuda::launch {

namespace {

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

}  // namespace

void attention_one_position_backward(cudaStream_t s, const uint16_t* dout, uint16_t* dqkv,
                                     int64_t b, int64_t h, int64_t g, int64_t d) {
  attention_one_position_backward_kernel<<<blocks_for(b * (h + 2 * g) * d), kThreads, 0, s>>>(
      bf(dout), bf(dqkv), b, h, g, d);
}

}  // namespace weft::cuda::launch
