// The GPU emulator's own rules (tests/cuda_emu/README.md): launches checked
// as CUDA checks them, barriers and shuffles that give the right values, and
// each misuse CUDA leaves undefined stopped with its message. Written in
// CUDA's syntax, so the build's launch rewrite is tested too.
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
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

__global__ void fill_value(int v, int* x) { x[threadIdx.x] = v; }

struct Pair {
  int a, b;
};
__global__ void write_pair(Pair p, int* out) {
  out[0] = p.a;
  out[1] = p.b;
}

bool sync_streams() {  // WEFT_EMU_SYNC_STREAMS=1: every stream runs its work at once
  const char* v = std::getenv("WEFT_EMU_SYNC_STREAMS");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

int read_back(const int* d) {  // a synchronous copy: every stream's work first
  int v = -1;
  EXPECT_EQ(cudaMemcpy(&v, d, sizeof v, cudaMemcpyDeviceToHost), cudaSuccess);
  return v;
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

// Work queued on a stream runs when something needs it (streams.h): a host
// that reads a copy's destination before synchronizing sees the old bytes,
// as a GPU still busy would leave them.
TEST(GpuEmulatorStreams, QueuedWorkRunsWhenSomethingNeedsIt) {
  if (sync_streams()) GTEST_SKIP() << "WEFT_EMU_SYNC_STREAMS=1 runs the work at once";
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreate(&s), cudaSuccess);
  int* d = nullptr;
  int* pin = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&d), 32 * sizeof(int)), cudaSuccess);
  ASSERT_EQ(cudaMallocHost(reinterpret_cast<void**>(&pin), 32 * sizeof(int)), cudaSuccess);
  std::fill(pin, pin + 32, -1);
  fill_value<<<1, 32, 0, s>>>(7, d);
  cudaMemcpyAsync(pin, d, 32 * sizeof(int), cudaMemcpyDeviceToHost, s);
  EXPECT_EQ(pin[0], -1) << "read before synchronizing";
  cudaStreamSynchronize(s);
  EXPECT_EQ(pin[31], 7);
  // To pageable memory a copy is done when the call returns.
  std::vector<int> host(32, -1);
  fill_value<<<1, 32, 0, s>>>(8, d);
  cudaMemcpyAsync(host.data(), d, 32 * sizeof(int), cudaMemcpyDeviceToHost, s);
  EXPECT_EQ(host[31], 8);
  // From page-locked memory the copy reads the bytes when it runs; from
  // pageable memory, at the call.
  pin[0] = 1;
  cudaMemcpyAsync(d, pin, sizeof(int), cudaMemcpyHostToDevice, s);
  pin[0] = 2;
  cudaStreamSynchronize(s);
  EXPECT_EQ(read_back(d), 2);
  int v = 1;
  cudaMemcpyAsync(d, &v, sizeof v, cudaMemcpyHostToDevice, s);
  v = 2;
  EXPECT_EQ(read_back(d), 1);
  // A kernel's parameters are copied at the launch.
  Pair p{3, 4};
  write_pair<<<1, 1, 0, s>>>(p, d);
  p = {5, 6};
  EXPECT_EQ(read_back(d), 3);
  EXPECT_EQ(read_back(d + 1), 4);
  cudaFreeHost(pin);
  cudaFree(d);
  cudaStreamDestroy(s);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

// A stream reads another's output only after waiting for an event recorded
// behind it; an event's synchronize runs its stream's work up to the record
// and no further.
TEST(GpuEmulatorStreams, AStreamSeesAnothersWorkOnlyAfterWaitingForIt) {
  if (sync_streams()) GTEST_SKIP() << "WEFT_EMU_SYNC_STREAMS=1 runs the work at once";
  cudaStream_t a = nullptr, b = nullptr;
  cudaEvent_t e = nullptr, late = nullptr;
  ASSERT_EQ(cudaStreamCreate(&a), cudaSuccess);
  ASSERT_EQ(cudaStreamCreate(&b), cudaSuccess);
  ASSERT_EQ(cudaEventCreate(&e), cudaSuccess);
  ASSERT_EQ(cudaEventCreate(&late), cudaSuccess);
  int *x = nullptr, *y = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&x), 32 * sizeof(int)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&y), 32 * sizeof(int)), cudaSuccess);
  cudaMemset(x, 0, 32 * sizeof(int));
  cudaMemset(y, 0, 32 * sizeof(int));

  fill_value<<<1, 32, 0, a>>>(5, x);
  cudaMemcpyAsync(y, x, 32 * sizeof(int), cudaMemcpyDeviceToDevice, b);
  cudaStreamSynchronize(b);
  EXPECT_EQ(read_back(y), 0) << "b did not wait for a";
  EXPECT_EQ(read_back(x), 5);

  fill_value<<<1, 32, 0, a>>>(6, x);
  cudaEventRecord(e, a);
  fill_value<<<1, 32, 0, a>>>(9, x);  // after the record: the wait does not cover it
  cudaStreamWaitEvent(b, e, 0);
  cudaMemcpyAsync(y, x, 32 * sizeof(int), cudaMemcpyDeviceToDevice, b);
  cudaEventRecord(late, a);
  float ms = 0;
  EXPECT_EQ(cudaEventElapsedTime(&ms, e, late), cudaErrorNotReady);
  cudaGetLastError();
  cudaStreamSynchronize(b);
  EXPECT_EQ(read_back(y), 6);
  EXPECT_EQ(cudaEventElapsedTime(&ms, e, late), cudaSuccess);
  cudaEventDestroy(e);
  cudaEventDestroy(late);
  cudaFree(x);
  cudaFree(y);
  cudaStreamDestroy(a);
  cudaStreamDestroy(b);
}

// WEFT_EMU_HOST_ONLY=1, in a child process (the mode is read once): a
// kernel, a memset and a device-to-device copy are counted and dropped,
// copies to and from the host run, and the profiler's range reports each.
void host_only_run() {
  setenv("WEFT_EMU_HOST_ONLY", "1", 1);
  int* d = nullptr;
  if (cudaMalloc(&d, 2 * sizeof(int)) != cudaSuccess) std::exit(3);
  const int seven[2] = {7, 7};
  cudaProfilerStart();
  cudaMemcpy(d, seven, sizeof seven, cudaMemcpyHostToDevice);
  fill_value<<<1, 2>>>(1, d);
  cudaMemsetAsync(d, 0, sizeof(int), cudaStreamPerThread);
  cudaMemcpyAsync(d + 1, d, sizeof(int), cudaMemcpyDeviceToDevice, cudaStreamPerThread);
  int back[2] = {0, 0};
  cudaMemcpy(back, d, sizeof back, cudaMemcpyDeviceToHost);
  cudaProfilerStop();
  cudaFree(d);
  std::exit(back[0] == 7 && back[1] == 7 ? 0 : 1);
}

TEST(GpuEmulatorDeathTest, HostOnlyRunsNothingOnTheDeviceAndCountsIt) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(host_only_run(), ::testing::ExitedWithCode(0),
              "the profiled range \\(WEFT_EMU_HOST_ONLY: nothing ran on the device\\): 1 kernel "
              "launches, 0 GEMMs, 1 memsets, 1 device-to-device copies, 2 copies to or from the "
              "host");
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
