// weft/device.h — where a tensor's bytes live.
//
// CPU is always present. A CUDA device exists when weft is built with
// -Dcuda=enabled (or auto, where nvcc is found); kernels dispatch on
// Device::kind. Nothing above src/ needs to know which devices were built.
#pragma once

#include <cstdint>
#include <string>

namespace weft {

enum class DeviceKind : uint8_t { CPU, CUDA };

struct Device {
  DeviceKind kind = DeviceKind::CPU;
  int index = 0;

  static constexpr Device cpu() { return Device{DeviceKind::CPU, 0}; }
  static constexpr Device cuda(int i) { return Device{DeviceKind::CUDA, i}; }
  bool is_cpu() const { return kind == DeviceKind::CPU; }
  bool operator==(const Device& o) const { return kind == o.kind && index == o.index; }
  std::string str() const;  // "cpu", "cuda:0"
};

// Raw allocation on a device. CPU memory is 64-byte aligned.
// Host allocations of 64 MiB or more are refused when the machine has less
// memory available ("needs N GiB, M GiB available") instead of being killed
// later by the kernel's out-of-memory killer.
void* device_alloc(size_t bytes, Device device);
void device_free(void* p, Device device);
// Bytes of host memory this process can still take: MemAvailable, bounded by
// a cgroup (v2) memory limit when one is set; SIZE_MAX when unknown.
size_t host_memory_available();


// True when weft was built with the CUDA backend.
bool cuda_built();
// Number of usable CUDA devices at run time (0 when none, or not built).
int cuda_device_count();
// Opens (start) or closes the CUDA profiler's collection range on a GPU
// (cudaProfilerStart/Stop: `nsys --capture-range=cudaProfilerApi` or
// `ncu --profile-from-start off` record only inside it; the GPU emulator
// prints what the host asked of the device in it); nothing on the CPU.
void profiler_range(Device device, bool start);

}  // namespace weft
