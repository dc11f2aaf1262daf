// NcclCommunicator on the GPUs of this machine: world size 1 per process
// (NCCL needs one GPU per rank). Exits 77 (meson: SKIP) without a GPU or
// without the CUDA build.
#include <weft/mpi_communicator.h>
#include <weft/nccl_communicator.h>

#include <fmt/core.h>

#include <cmath>
#include <vector>

#include "weft_config.h"

#if WEFT_CUDA
#include <cuda_runtime.h>
#endif

namespace {

[[maybe_unused]] int failures = 0;

[[maybe_unused]] void expect(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    fmt::print(stderr, "FAILED: {}\n", what);
  }
}

#if WEFT_CUDA
std::vector<float> to_host(const weft::Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  cudaMemcpy(v.data(), t.raw(), t.nbytes(), cudaMemcpyDeviceToHost);
  return v;
}

weft::Tensor to_device(const std::vector<float>& v) {
  weft::Tensor t = weft::Tensor::empty({static_cast<int64_t>(v.size())}, weft::DType::F32,
                                       weft::Device::cuda(0));
  cudaMemcpy(t.raw(), v.data(), t.nbytes(), cudaMemcpyHostToDevice);
  return t;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  if (!weft::nccl_built() || weft::cuda_device_count() == 0) {
    fmt::print("SKIP: {}\n", weft::nccl_built() ? "no CUDA device" : "built without CUDA");
    return 77;
  }
#if WEFT_CUDA
  return weft::mpi_main(argc, argv, [](weft::Communicator& host) {
    auto nccl = weft::nccl_world(host, host.rank() % weft::cuda_device_count());
    const int n = nccl->size();
    weft::Tensor t = to_device({1.0f, 2.0f, -3.0f});
    nccl->all_reduce(t, weft::ReduceOp::Sum);
    auto v = to_host(t);
    expect(v[0] == static_cast<float>(n) && v[2] == -3.0f * static_cast<float>(n), "all_reduce sum");
    weft::Tensor g = weft::Tensor::empty({3L * n}, weft::DType::F32, weft::Device::cuda(0));
    nccl->all_gather(to_device({1.0f, 2.0f, 3.0f}), g);
    expect(to_host(g)[3 * n - 1] == 3.0f, "all_gather");
    weft::Tensor b = to_device({static_cast<float>(nccl->rank()) + 7.0f});
    nccl->broadcast(b, 0);
    expect(to_host(b)[0] == 7.0f, "broadcast");
    nccl->barrier();
    if (n >= 2) {  // a ring of point-to-point messages with shape checks
      const int next = (nccl->rank() + 1) % n, prev = (nccl->rank() + n - 1) % n;
      weft::Tensor out = to_device({static_cast<float>(nccl->rank())});
      weft::Tensor in = to_device({-1.0f});
      auto r = nccl->irecv(in, prev, {weft::MessageTag::Kind::Activation, 0});
      nccl->send(out, next, {weft::MessageTag::Kind::Activation, 0});
      r->wait();
      expect(to_host(in)[0] == static_cast<float>(prev), "p2p ring");
    }
    fmt::print("rank {}: NCCL world of {}: {}\n", host.rank(), n, failures ? "FAILED" : "ok");
    return failures ? 1 : 0;
  });
#else
  (void)argc;
  (void)argv;
  return 77;
#endif
}
