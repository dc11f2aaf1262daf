// CUDA device memory. Without a GPU every call fails with a clean error code,
// which cuda_count() turns into "no devices".
#include <cuda_runtime.h>

#include <cstddef>
#include <stdexcept>
#include <string>

namespace weft {

void* cuda_alloc(size_t bytes, int index) {
  if (cudaSetDevice(index) != cudaSuccess) {
    throw std::runtime_error("cudaSetDevice(" + std::to_string(index) + ") failed");
  }
  void* p = nullptr;
  cudaError_t err = cudaMalloc(&p, bytes);
  if (err != cudaSuccess) {
    throw std::runtime_error("cudaMalloc of " + std::to_string(bytes) +
                             " bytes failed: " + cudaGetErrorString(err));
  }
  return p;
}

void cuda_free(void* p, int index) {
  cudaSetDevice(index);
  cudaFree(p);
}

int cuda_count() {
  int n = 0;  // left untouched by cudaGetDeviceCount on error
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

}  // namespace weft
