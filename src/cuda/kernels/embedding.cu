// Token and position embedding, forward and weight gradients.
// Device code and its launchers (src/cuda/launch.h); the shared helpers are
// in common.cuh.
#include "src/cuda/kernels/common.cuh"

namespace weft::cuda::launch {

namespace {

// ---------------------------------------------------------------- embedding

// wte holds the rows of tokens [first, first + rows); other tokens read 0.
// wpe may be null: no positions added. The sum in fp32, stored as Y (float or bf16).
template <class Y>
__global__ void embedding_forward_kernel(const int32_t* tokens, const float* wte, int64_t rows,
                                         int64_t first, const float* wpe, Y* y, int64_t n,
                                         int64_t t, int64_t c, const int32_t* positions) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n * c;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = i / c, j = i % c;
    const int64_t e = int64_t{tokens[row]} - first;
    const float x = e >= 0 && e < rows ? wte[e * c + j] : 0.0f;
    const int64_t at = positions ? positions[row] : row % t;
    store(y, i, wpe != nullptr ? x + wpe[at * c + j] : x);
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

// Positions given (--reset-position-ids): dwpe[positions[row]] += dy[row],
// an atomic scatter-add as dwte's.
template <class G>
__global__ void embedding_backward_positions_kernel(const int32_t* positions, const G* dy,
                                                    float* dwpe, int64_t n, int64_t c) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n * c;
       i += int64_t{gridDim.x} * blockDim.x)
    atomicAdd(dwpe + int64_t{positions[i / c]} * c + i % c, load(dy, i));
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


}  // namespace

void embedding_forward(cudaStream_t s, const int32_t* tokens, const float* wte, int64_t rows,
                       int64_t first, const float* wpe, float* y, int64_t b, int64_t t, int64_t c,
                       const int32_t* positions) {
  embedding_forward_kernel<<<blocks_for(b * t * c), kThreads, 0, s>>>(tokens, wte, rows, first, wpe,
                                                                      y, b * t, t, c, positions);
}

void embedding_forward(cudaStream_t s, const int32_t* tokens, const float* wte, int64_t rows,
                       int64_t first, const float* wpe, uint16_t* y, int64_t b, int64_t t,
                       int64_t c, const int32_t* positions) {
  embedding_forward_kernel<<<blocks_for(b * t * c), kThreads, 0, s>>>(
      tokens, wte, rows, first, wpe, bf(y), b * t, t, c, positions);
}

void embedding_backward(cudaStream_t s, const int32_t* tokens, const float* dy, float* dwte,
                        int64_t rows, int64_t first, float* dwpe, int64_t b, int64_t t, int64_t c,
                        const int32_t* positions) {
  embedding_backward_wte_kernel<<<blocks_for(b * t * c), kThreads, 0, s>>>(tokens, dy, dwte, rows,
                                                                           first, b * t, c);
  if (dwpe != nullptr && positions != nullptr)
    embedding_backward_positions_kernel<<<blocks_for(b * t * c), kThreads, 0, s>>>(positions, dy,
                                                                                   dwpe, b * t, c);
  else if (dwpe != nullptr)
    embedding_backward_wpe_kernel<<<blocks_for(t * c), kThreads, 0, s>>>(dy, dwpe, b, t, c);
}

void embedding_backward(cudaStream_t s, const int32_t* tokens, const uint16_t* dy, float* dwte,
                        int64_t rows, int64_t first, float* dwpe, int64_t b, int64_t t, int64_t c,
                        const int32_t* positions) {
  embedding_backward_wte_kernel<<<blocks_for(b * t * c), kThreads, 0, s>>>(tokens, bf(dy), dwte,
                                                                           rows, first, b * t, c);
  if (dwpe != nullptr && positions != nullptr)
    embedding_backward_positions_kernel<<<blocks_for(b * t * c), kThreads, 0, s>>>(
        positions, bf(dy), dwpe, b * t, c);
  else if (dwpe != nullptr)
    embedding_backward_wpe_kernel<<<blocks_for(t * c), kThreads, 0, s>>>(bf(dy), dwpe, b, t, c);
}

}  // namespace weft::cuda::launch
