#include <weft/device.h>
#include <weft/error.h>

#include "weft_config.h"

#include <cstdlib>

namespace weft {

#if WEFT_CUDA
// src/cuda/device_cuda.cu
void* cuda_alloc(size_t bytes, int index);
void cuda_free(void* p, int index);
int cuda_count();
#endif

std::string Device::str() const {
  return kind == DeviceKind::CPU ? std::string("cpu") : fmt::format("cuda:{}", index);
}

void* device_alloc(size_t bytes, Device device) {
  if (device.is_cpu()) {
    size_t rounded = (bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded == 0 ? 64 : rounded);
    if (p == nullptr) throw Error("out of host memory allocating {} bytes", bytes);
    return p;
  }
#if WEFT_CUDA
  return cuda_alloc(bytes, device.index);
#else
  throw Error("device {} requested, but weft was built without CUDA (-Dcuda=enabled)",
              device.str());
#endif
}

void device_free(void* p, Device device) {
  if (p == nullptr) return;
  if (device.is_cpu()) {
    std::free(p);
    return;
  }
#if WEFT_CUDA
  cuda_free(p, device.index);
#endif
}

bool cuda_built() { return WEFT_CUDA != 0; }

int cuda_device_count() {
#if WEFT_CUDA
  return cuda_count();
#else
  return 0;
#endif
}

}  // namespace weft
