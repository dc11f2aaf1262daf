// CUDA device memory for weft::device_alloc (tensors, arenas): served by the
// device's caching allocator, so a tensor freed and made again of the same
// size costs no cudaMalloc. Without a GPU every call fails with a clean error
// code, which cuda_count() turns into "no devices".
#include <weft/cuda/runtime.h>

#include <cuda_runtime.h>

#include <cstddef>

namespace weft {

void* cuda_alloc(size_t bytes, int index) {
  return cuda::context(index).allocator().allocate(bytes);
}

void cuda_free(void* p, int index) { cuda::context(index).allocator().release(p); }

void cuda_profiler(bool start, int index) {
  start ? cuda::profiler_start(cuda::context(index)) : cuda::profiler_stop(cuda::context(index));
}

int cuda_count() {
  int n = 0;  // left untouched by cudaGetDeviceCount on error
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

}  // namespace weft
