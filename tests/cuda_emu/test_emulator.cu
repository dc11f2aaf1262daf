// The GPU emulator's own rules (tests/cuda_emu/README.md): launches checked
// as CUDA checks them, barriers and shuffles that give the right values, and
// each misuse CUDA leaves undefined stopped with its message. Written in
// CUDA's syntax, so the build's launch rewrite is tested too.
#include <cuda_runtime.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

__global__ void block_sum(const float* x, float* out) {
  __shared__ float part[256];
  part[threadIdx.x] = x[blockIdx.x * blockDim.x + threadIdx.x];
  __syncthreads();
  for (unsigned half = blockDim.x / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) part[threadIdx.x] += part[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = part[0];
}

template <typename T>
__global__ void warp_sum(const T* x, T* out) {
  T v = x[threadIdx.x];
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  out[threadIdx.x] = v;
}

// Reads the previous thread's shared value with no barrier between: right
// whenever the threads happen to run in ascending order.
__global__ void missing_barrier(int tag, int* out) {
  __shared__ int s[64];
  s[threadIdx.x] = tag + static_cast<int>(threadIdx.x);
  out[threadIdx.x] = threadIdx.x == 0 ? tag : s[threadIdx.x - 1];
}

__global__ void divergent_barrier(int* x) {
  if (threadIdx.x < 16) __syncthreads();
  x[threadIdx.x] = 1;
}

__global__ void shuffle_after_return(float* x) {
  if (threadIdx.x == 3) return;
  x[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
}

__global__ void two_barriers(float* x) {
  if (threadIdx.x == 0)
    __syncthreads();
  else
    x[threadIdx.x] = __shfl_xor_sync(0xffffffffu, x[threadIdx.x], 1);
}

__global__ void barrier_if(bool sync, int* x) {
  if (sync) __syncthreads();
  x[threadIdx.x] = 1;
}

TEST(GpuEmulator, BarriersAndShufflesGiveTheSums) {
  std::vector<float> x(4 * 256), out(4, 0.0f);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 7);
  block_sum<<<4, 256>>>(x.data(), out.data());
  for (int b = 0; b < 4; ++b) {
    float want = 0;
    for (int i = 0; i < 256; ++i) want += x[static_cast<size_t>(b * 256 + i)];
    EXPECT_EQ(out[static_cast<size_t>(b)], want) << b;
  }
  std::vector<int> xi(64), oi(64);
  for (int i = 0; i < 64; ++i) xi[static_cast<size_t>(i)] = i;
  warp_sum<<<1, 64>>>(xi.data(), oi.data());  // a template deduced at the launch
  for (int i = 0; i < 64; ++i) EXPECT_EQ(oi[static_cast<size_t>(i)], i < 32 ? 496 : 1520) << i;
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST(GpuEmulator, ABadConfigurationIsTheLaunchsError) {
  std::vector<float> x(2048), out(1);
  block_sum<<<1, 2048>>>(x.data(), out.data());
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // read once, then cleared
  block_sum<<<dim3(1, 70000), 32>>>(x.data(), out.data());
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
}

// Alternate launches run the threads in opposite orders: a barrier missing
// where ascending order hides it gives a wrong answer on one of two (each
// launch writes its own tag, so the previous launch's shared values do not
// pass for this one's).
TEST(GpuEmulator, AMissingBarrierShowsOnOneOfTwoLaunches) {
  int wrong_launches = 0;
  for (int k = 0; k < 2; ++k) {
    std::vector<int> out(64, -1);
    const int tag = 1000 * (k + 1);
    missing_barrier<<<1, 64>>>(tag, out.data());
    bool wrong = false;
    for (int i = 0; i < 64; ++i)
      wrong = wrong || out[static_cast<size_t>(i)] != tag + std::max(i - 1, 0);
    wrong_launches += wrong;
  }
  EXPECT_EQ(wrong_launches, 1);
}

TEST(GpuEmulatorDeathTest, MisusedBarriersStopTheRun) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  std::vector<int> xi(64);
  std::vector<float> xf(64);
  EXPECT_DEATH(divergent_barrier<<<1, 64>>>(xi.data()), "returned while others wait at __syncthreads");
  EXPECT_DEATH(shuffle_after_return<<<1, 32>>>(xf.data()),
               "returned while others wait at a full-warp shuffle");
  EXPECT_DEATH(two_barriers<<<1, 32>>>(xf.data()), "cannot go on");
  // A site whose first launch reached no barrier runs its threads as plain
  // calls; reaching one later is reported, not hidden.
  auto without_then_with = [&] {
    for (bool sync : {false, true}) barrier_if<<<1, 32>>>(sync, xi.data());
  };
  EXPECT_DEATH(without_then_with(), "earlier launch from the same place reached none");
}

}  // namespace
