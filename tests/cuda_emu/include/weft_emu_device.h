// GPU emulator (tests/cuda_emu): what device code sees. A launch runs the
// grid's blocks one after another; a block's threads are fibers on the
// launching thread, switched only where CUDA would wait for other threads
// (__syncthreads, a warp shuffle), so a missing barrier shows up as a read of
// a value not written yet. A barrier some threads never reach, or a shuffle
// from a lane that has returned, stops the program with a message: on a GPU
// that is a hang or undefined values.
//
// weft's .cu files are compiled as C++ after the build's rewrite of
// `kernel<<<grid, block, shared, stream>>>(args)` into
// `::weft_emu::launch([&](auto&&... a) { kernel(a...); }, grid, block, shared,
// stream)(args)` (tests/cuda_emu/rewrite_launches.py).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __restrict__ __restrict
// Blocks run one at a time, so a static is the block's shared memory.
#define __shared__ static

namespace weft_emu {

struct ThreadState {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
};

// The running GPU thread's indices.
const ThreadState& current();
void sync_block();
// Every lane of the warp offers `bits` and gets lane `src_lane`'s.
uint64_t shuffle(uint64_t bits, int src_lane);
int lane_id();
// What the emulator has learnt of one launch site's kernel: 0 while it runs
// with fibers; 1 once a whole launch of it ran without a barrier or shuffle,
// after which its threads run as plain calls, one after another (fibers
// cost a microsecond a thread). A kernel that then reaches a barrier after
// all stops the program saying so; WEFT_EMU_FIBERS=1 keeps every launch on
// fibers.
using SiteMode = std::atomic<int>;

// Checks the configuration as CUDA does (a bad one sets the error
// cudaGetLastError returns), then queues `body` on `stream` to run once per
// thread of the grid (tests/cuda_emu/streams.h says when queued work runs).
void run_grid(dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream, SiteMode& site,
              std::function<void()> body);

// The arguments are copied at the launch, as CUDA copies a kernel's
// parameters: the kernel may run after the caller's variables are gone.
template <typename Kernel>
auto launch(Kernel kernel, dim3 grid, dim3 block, size_t shared_bytes = 0,
            cudaStream_t stream = nullptr) {
  static SiteMode site{0};  // one per launch site: each has its own lambda type
  return [=](auto&&... args) {
    run_grid(grid, block, shared_bytes, stream, site,
             [kernel, ... a = std::decay_t<decltype(args)>(args)]() mutable { kernel(a...); });
  };
}

template <typename T>
T shuffle_value(T v, int src_lane) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "a shuffle moves 4 or 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  bits = shuffle(bits, src_lane);
  std::memcpy(&v, &bits, sizeof(T));
  return v;
}

float atomic_add(float* p, float v);

}  // namespace weft_emu

#define threadIdx (::weft_emu::current().thread_idx)
#define blockIdx (::weft_emu::current().block_idx)
#define blockDim (::weft_emu::current().block_dim)
#define gridDim (::weft_emu::current().grid_dim)
#define warpSize 32

inline void __syncthreads() { ::weft_emu::sync_block(); }
template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  (void)mask, (void)width;
  return ::weft_emu::shuffle_value(v, ::weft_emu::lane_id() ^ lane_mask);
}
template <typename T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  (void)mask, (void)width;
  const int src = ::weft_emu::lane_id() + static_cast<int>(delta);
  return ::weft_emu::shuffle_value(v, src < 32 ? src : ::weft_emu::lane_id());
}
inline float atomicAdd(float* p, float v) { return ::weft_emu::atomic_add(p, v); }

// Correctly rounded single-precision arithmetic (what the _rn intrinsics
// promise; the host's IEEE operations give the same).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
float __fsqrt_rn(float a);
inline float __uint_as_float(unsigned int u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline unsigned int __float_as_uint(float f) {
  unsigned int u;
  std::memcpy(&u, &f, 4);
  return u;
}
float rsqrtf(float a);
