// Error checks for CUDA and cuBLAS calls inside src/cuda: a failing call
// throws weft::Error naming the call as written, the CUDA error and where.
//
//   WEFT_CUDA_CHECK(cudaMalloc(&p, bytes));
//   // cudaMalloc(&p, bytes) failed: out of memory (cudaErrorMemoryAllocation) at src/cuda/runtime.cc:40
//   layernorm_forward_kernel<<<grid, block, 0, stream>>>(...);
//   WEFT_LAUNCH_CHECK("layernorm_forward");
#pragma once

#include <weft/cuda/runtime.h>
#include <weft/error.h>

#include <cublas_v2.h>
#include <cuda_runtime.h>

namespace weft::cuda::detail {

inline void check_cuda(cudaError_t status, const char* call, const char* file, int line) {
  if (status != cudaSuccess)
    throw Error("{} at {}:{}", cuda_error_message(static_cast<int>(status), call), file, line);
}

inline void check_cublas(cublasStatus_t status, const char* call, const char* file, int line) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw Error("{} at {}:{}", cublas_error_message(static_cast<int>(status), call), file, line);
}

inline cudaStream_t stream(const Context& ctx) { return ctx.compute_stream(); }

}  // namespace weft::cuda::detail

#define WEFT_CUDA_CHECK(call) ::weft::cuda::detail::check_cuda((call), #call, __FILE__, __LINE__)
#define WEFT_CUBLAS_CHECK(call) \
  ::weft::cuda::detail::check_cublas((call), #call, __FILE__, __LINE__)
// After a kernel launch: a bad configuration (too many threads, too much
// shared memory) is reported here, naming the kernel.
#define WEFT_LAUNCH_CHECK(kernel) \
  ::weft::cuda::detail::check_cuda(cudaGetLastError(), "launch of " kernel, __FILE__, __LINE__)
