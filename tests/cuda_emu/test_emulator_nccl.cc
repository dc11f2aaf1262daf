// The GPU emulator's NCCL across processes (tests/cuda_emu/nccl.cc), called
// directly, as weft's NcclCommunicator does, under mpiexec: each case runs
// this binary as the ranks (--ranks CASE) and checks what they printed.
// What works: every collective and a bf16 sum over 3 ranks against the
// values worked out here, and a group's sends and receives between ranks.
// Where NCCL fails, it fails here: a receive whose count differs from its
// send's (the communicator's asynchronous error, and NCCL's warning), ranks
// that call collectives in different orders (the program stops, naming
// both), a send that nothing receives (a hang: the emulator stops the wait
// after WEFT_EMU_HANG_SECONDS, naming the send), two ranks on one device of
// one host ("Duplicate GPU detected"), and a peer's abort or exit (its peers'
// communicators report ncclRemoteError).
#include <weft/mpi_communicator.h>
#include <weft/tensor.h>

#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <nccl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

// ---- the ranks

int failures = 0;
void expect(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::fprintf(stderr, "FAILED: %s\n", what.c_str());
  }
}

// Each rank on device rank % devices, as weft places them.
ncclComm_t init(weft::Communicator& host) {
  int devices = 0;
  cudaGetDeviceCount(&devices);
  cudaSetDevice(host.rank() % devices);
  ncclUniqueId id{};
  if (host.rank() == 0) ncclGetUniqueId(&id);
  weft::Tensor bytes = weft::Tensor::zeros({sizeof(id) / 4}, weft::DType::I32);
  std::memcpy(bytes.raw(), &id, sizeof id);
  host.broadcast(bytes, 0);
  std::memcpy(&id, bytes.raw(), sizeof id);
  ncclComm_t comm = nullptr;
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclResult_t r = ncclCommInitRankConfig(&comm, host.size(), id, host.rank(), &config);
  ncclResult_t state = r;
  while (state == ncclInProgress) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    ncclCommGetAsyncError(comm, &state);
  }
  if (state != ncclSuccess)
    std::printf("rank %d: init: %s\n", host.rank(), ncclGetErrorString(state));
  std::fflush(stdout);
  return state == ncclSuccess ? comm : nullptr;
}

float* device_floats(const std::vector<float>& v) {
  void* p = nullptr;
  cudaMalloc(&p, v.size() * sizeof(float));
  cudaMemcpy(p, v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice);
  return static_cast<float*>(p);
}

std::vector<float> host_floats(const float* p, size_t n) {
  std::vector<float> v(n);
  cudaMemcpy(v.data(), p, n * sizeof(float), cudaMemcpyDeviceToHost);  // waits for the streams
  return v;
}

// Waits (with a deadline) for `comm`'s asynchronous state to leave success.
ncclResult_t await_error(ncclComm_t comm, double seconds) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  ncclResult_t state = ncclSuccess;
  while (std::chrono::steady_clock::now() < end) {
    ncclCommGetAsyncError(comm, &state);
    if (state != ncclSuccess && state != ncclInProgress) return state;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return state;
}

int collectives(weft::Communicator& host, ncclComm_t comm) {
  const int n = host.size(), me = host.rank();
  cudaStream_t s;
  cudaStreamCreate(&s);
  float* a = device_floats({1.0f + me, -2.0f * me});
  ncclAllReduce(a, a, 2, ncclFloat32, ncclSum, comm, s);
  float sum0 = 0, sum1 = 0;
  for (int r = 0; r < n; ++r) sum0 += 1.0f + r, sum1 += -2.0f * r;
  expect(host_floats(a, 2) == std::vector<float>{sum0, sum1}, "all_reduce sum");
  float* m = device_floats({static_cast<float>(me)});
  ncclAllReduce(m, m, 1, ncclFloat32, ncclMax, comm, s);
  expect(host_floats(m, 1)[0] == static_cast<float>(n - 1), "all_reduce max");
  std::vector<float> parts;
  for (int r = 0; r < n; ++r) parts.insert(parts.end(), {static_cast<float>(r + me), 1.0f});
  float* in = device_floats(parts);
  float* out = device_floats({0, 0});
  ncclReduceScatter(in, out, 2, ncclFloat32, ncclSum, comm, s);
  float want = 0;
  for (int r = 0; r < n; ++r) want += static_cast<float>(me + r);
  expect(host_floats(out, 2) == std::vector<float>{want, static_cast<float>(n)}, "reduce_scatter");
  float* g = device_floats(std::vector<float>(static_cast<size_t>(n), 0));
  float* mine = device_floats({10.0f * me});
  ncclAllGather(mine, g, 1, ncclFloat32, comm, s);
  std::vector<float> want_g;
  for (int r = 0; r < n; ++r) want_g.push_back(10.0f * r);
  expect(host_floats(g, static_cast<size_t>(n)) == want_g, "all_gather");
  float* b = device_floats({100.0f + me});
  ncclBroadcast(b, b, 1, ncclFloat32, n - 1, comm, s);
  expect(host_floats(b, 1)[0] == 100.0f + (n - 1), "broadcast from the last rank");
  // bf16: 1 + 2^-8 + 2^-8: rounded after each addition in rank order, the
  // first sum 1 + 2^-8 is a tie that rounds to even (1), and so does the second.
  const uint16_t one = 0x3f80, eps = 0x3b80;  // 1.0 and 2^-8
  void* h = nullptr;
  cudaMalloc(&h, 2);
  const uint16_t v = me == 0 ? one : eps;
  cudaMemcpy(h, &v, 2, cudaMemcpyHostToDevice);
  ncclAllReduce(h, h, 1, ncclBfloat16, ncclSum, comm, s);
  uint16_t got = 0;
  cudaMemcpy(&got, h, 2, cudaMemcpyDeviceToHost);
  expect(got == one, "a bf16 sum rounds after each addition in rank order");
  // A group: each rank sends to the next and receives from the previous.
  float* to = device_floats({static_cast<float>(me)});
  float* from = device_floats({-1});
  ncclGroupStart();
  ncclSend(to, 1, ncclFloat32, (me + 1) % n, comm, s);
  ncclRecv(from, 1, ncclFloat32, (me + n - 1) % n, comm, s);
  ncclGroupEnd();
  expect(host_floats(from, 1)[0] == static_cast<float>((me + n - 1) % n), "a ring of sends");
  std::printf("rank %d: %s\n", me, failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}

int run_case(const std::string& name, weft::Communicator& host) {
  ncclComm_t comm = init(host);
  if (comm == nullptr) return 3;
  const int me = host.rank();
  cudaStream_t s;
  cudaStreamCreate(&s);
  if (name == "collectives") return collectives(host, comm);
  if (name == "counts") {  // rank 0 sends 2 floats, rank 1 receives 3
    float* buf = device_floats({1, 2, 3});
    if (me == 0) ncclSend(buf, 2, ncclFloat32, 1, comm, s);
    if (me == 1) ncclRecv(buf, 3, ncclFloat32, 0, comm, s);
    if (me == 1) {
      const ncclResult_t e = await_error(comm, 20);
      std::printf("rank 1: async error %s\n", ncclGetErrorString(e));
    }
    return 0;
  }
  if (name == "order") {  // the ranks call two collectives in opposite orders
    float* a = device_floats({1, 2});
    float* g = device_floats({0, 0, 0, 0});
    if (me == 0) {
      ncclAllReduce(a, a, 2, ncclFloat32, ncclSum, comm, s);
      ncclAllGather(a, g, 2, ncclFloat32, comm, s);
    } else {
      ncclAllGather(a, g, 2, ncclFloat32, comm, s);
      ncclAllReduce(a, a, 2, ncclFloat32, ncclSum, comm, s);
    }
    cudaStreamSynchronize(s);
    std::printf("rank %d: no error\n", me);
    return 0;
  }
  if (name == "unmatched") {  // rank 0 sends; rank 1 posts nothing
    float* buf = device_floats({1});
    if (me == 0) {
      ncclSend(buf, 1, ncclFloat32, 1, comm, s);
      cudaStreamSynchronize(s);
      std::printf("rank 0: the send completed\n");
    } else {
      std::this_thread::sleep_for(std::chrono::seconds(8));
    }
    return 0;
  }
  if (name == "abort") {  // rank 0 aborts; rank 1 waits for its message
    float* buf = device_floats({1});
    host.barrier();  // both set up
    if (me == 0) {
      ncclCommAbort(comm);
      std::printf("rank 0: aborted\n");
    } else {
      ncclRecv(buf, 1, ncclFloat32, 0, comm, s);
      const ncclResult_t e = await_error(comm, 20);
      std::printf("rank 1: async error %s\n", ncclGetErrorString(e));
      cudaStreamSynchronize(s);  // the failed communicator's work ends
      std::printf("rank 1: the stream drained\n");
    }
    std::fflush(stdout);
    return 0;
  }
  if (name == "exit") {  // rank 0's process ends; rank 1 waits in an all_reduce
    float* buf = device_floats({1});
    host.barrier();  // both set up
    if (me == 0) {
      std::fflush(stdout);
      _exit(0);
    }
    ncclAllReduce(buf, buf, 1, ncclFloat32, ncclSum, comm, s);
    const ncclResult_t e = await_error(comm, 20);
    std::printf("rank 1: async error %s\n", ncclGetErrorString(e));
    std::fflush(stdout);
    _exit(0);  // MPI's own finalize would wait for rank 0
  }
  std::printf("unknown case %s\n", name.c_str());
  return 2;
}

// ---- the driver

struct RanksRun {
  int status = 0;
  std::string output;
};

RanksRun ranks(int n, const std::string& name, const std::string& env = "",
              const std::string& launcher_flags = "") {
  const char* mpiexec = std::getenv("WEFT_MPIEXEC");
  char self[4096] = {};
  const ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
  const std::string out = "/tmp/weft-emu-nccl-" + std::to_string(getpid()) + ".txt";
  const std::string cmd = env + " MPIEXEC_TIMEOUT=60 " + (mpiexec ? mpiexec : "mpiexec") +
                          " " + launcher_flags + " -n " + std::to_string(n) + " " + std::string(self, len > 0 ? len : 0) +
                          " --ranks " + name + " >" + out + " 2>&1";
  RanksRun r;
  r.status = std::system(cmd.c_str());
  std::ifstream f(out);
  std::stringstream ss;
  ss << f.rdbuf();
  r.output = ss.str();
  std::remove(out.c_str());
  return r;
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

const std::string kDevices = "WEFT_EMU_DEVICES=4";

TEST(EmulatedNccl, CollectivesAndGroupsAcrossProcesses) {
  const RanksRun r = ranks(3, "collectives", kDevices);
  EXPECT_EQ(r.status, 0) << r.output;
  for (int k = 0; k < 3; ++k)
    EXPECT_TRUE(has(r.output, "rank " + std::to_string(k) + ": ok")) << r.output;
}

TEST(EmulatedNccl, CountsThatDifferFailTheCommunicator) {
  const RanksRun r = ranks(2, "counts", kDevices);
  EXPECT_TRUE(has(r.output, "NCCL WARN rank 1's ncclRecv of 12 bytes from rank 0 matched an "
                            "ncclSend of 8 bytes (counts must agree"))
      << r.output;
  EXPECT_TRUE(has(r.output, "rank 1: async error invalid usage")) << r.output;
}

TEST(EmulatedNccl, CollectivesInDifferentOrdersStopTheProgram) {
  const RanksRun r = ranks(2, "order", kDevices);
  EXPECT_NE(r.status, 0) << r.output;
  // Whichever rank arrives second names the first one's call: both orders.
  EXPECT_TRUE(((has(r.output, "rank 0 called ncclAllReduce of 2 float32 (sum)") &&
                has(r.output, "rank 1 ncclAllGather of 2 float32")) ||
               (has(r.output, "rank 1 called ncclAllGather of 2 float32") &&
                has(r.output, "rank 0 ncclAllReduce of 2 float32 (sum)"))) &&
              has(r.output, "ranks must call the same collectives in the same order"))
      << r.output;
  EXPECT_FALSE(has(r.output, "no error")) << r.output;
}

TEST(EmulatedNccl, AnUnmatchedSendHangs) {
  const RanksRun r = ranks(2, "unmatched", kDevices + " WEFT_EMU_HANG_SECONDS=2");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_TRUE(has(r.output, "made no progress for 2 s") &&
              has(r.output, "waits for ncclSend to rank 1 (4 bytes) on rank 0"))
      << r.output;
  EXPECT_FALSE(has(r.output, "the send completed")) << r.output;
}

TEST(EmulatedNccl, TwoRanksOnOneDeviceOfOneHostAreRefused) {
  const RanksRun r = ranks(2, "collectives", "WEFT_EMU_DEVICES=1");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_TRUE(has(r.output, "NCCL WARN Duplicate GPU detected : rank 0 and rank 1 both on CUDA "
                            "device 0"))
      << r.output;
  EXPECT_TRUE(has(r.output, "init: invalid usage")) << r.output;
  // Each its own host (NCCL_HOSTID), as weft's WEFT_NCCL_ONE_GPU=1 sets it.
  const RanksRun hosts = ranks(2, "collectives", "WEFT_EMU_DEVICES=1 NCCL_HOSTID_FROM_RANK=1");
  EXPECT_EQ(hosts.status, 0) << hosts.output;
}

TEST(EmulatedNccl, APeersAbortOrExitIsARemoteError) {
  const RanksRun a = ranks(2, "abort", kDevices);
  EXPECT_TRUE(has(a.output, "rank 0: aborted")) << a.output;
  EXPECT_TRUE(has(a.output, "rank 1: async error remote process exited or there was a network "
                            "error"))
      << a.output;
  EXPECT_TRUE(has(a.output, "rank 1: the stream drained")) << a.output;
  // A rank's process that ends: MPICH's launcher ends the others at once
  // unless told not to (-disable-auto-cleanup, which Open MPI's lacks).
  const char* mpiexec = std::getenv("WEFT_MPIEXEC");
  std::string version;
  if (FILE* p = popen((std::string(mpiexec ? mpiexec : "mpiexec") + " --version 2>&1").c_str(), "r")) {
    char buf[256];
    while (std::fgets(buf, sizeof buf, p) != nullptr) version += buf;
    pclose(p);
  }
  if (!has(version, "HYDRA")) GTEST_SKIP() << "the launcher is not MPICH's: " << version;
  const RanksRun e = ranks(2, "exit", kDevices, "-disable-auto-cleanup");
  EXPECT_TRUE(has(e.output, "rank 1: async error remote process exited or there was a network "
                            "error"))
      << e.output;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "--ranks") {
    const std::string name = argv[2];
    return weft::mpi_main(argc, argv, [&](weft::Communicator& host) {
      if (std::getenv("NCCL_HOSTID_FROM_RANK") != nullptr)
        setenv("NCCL_HOSTID", ("rank-" + std::to_string(host.rank())).c_str(), 1);
      return run_case(name, host);
    });
  }
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
