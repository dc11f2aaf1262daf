#include <weft/device.h>
#include <weft/error.h>
#include <weft/units.h>

#include "weft_config.h"

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <optional>
#include <string>

namespace weft {

#if WEFT_CUDA
// src/cuda/device_cuda.cu
void* cuda_alloc(size_t bytes, int index);
void cuda_free(void* p, int index);
int cuda_count();
void cuda_profiler(bool start, int index);
#endif

std::string Device::str() const {
  return kind == DeviceKind::CPU ? std::string("cpu") : fmt::format("cuda:{}", index);
}

namespace {

// A number from a one-line file ("max" or absent: nothing).
std::optional<size_t> read_number(const char* path) {
  std::ifstream f(path);
  std::string s;
  if (!(f >> s) || s == "max") return std::nullopt;
  try {
    return static_cast<size_t>(std::stoull(s));
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

}  // namespace

size_t host_memory_available() {
  size_t avail = SIZE_MAX;
  std::ifstream meminfo("/proc/meminfo");
  for (std::string key; meminfo >> key;) {
    size_t kib = 0;
    meminfo >> kib;
    if (key == "MemAvailable:") {
      avail = kib * 1024;
      break;
    }
    meminfo.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
  }
  // A container's limit (cgroup v2: this process's group is named in /proc/self/cgroup).
  std::ifstream cg("/proc/self/cgroup");
  for (std::string line; std::getline(cg, line);) {
    if (line.rfind("0::", 0) != 0) continue;
    const std::string dir = "/sys/fs/cgroup" + line.substr(3);
    const auto limit = read_number((dir + "/memory.max").c_str());
    const auto current = read_number((dir + "/memory.current").c_str());
    if (limit && current) avail = std::min(avail, *limit > *current ? *limit - *current : 0);
  }
  return avail;
}


void* device_alloc(size_t bytes, Device device) {
  if (device.is_cpu()) {
    if (bytes >= (size_t{64} << 20)) {
      const size_t avail = host_memory_available();
      check(bytes <= avail, "out of host memory: an allocation needs {}, and {} are available",
            format_bytes(double(bytes)), format_bytes(double(avail)));
    }
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

void profiler_range(Device device, bool start) {
#if WEFT_CUDA
  if (!device.is_cpu()) cuda_profiler(start, device.index);
#else
  (void)device;
  (void)start;
#endif
}

}  // namespace weft
