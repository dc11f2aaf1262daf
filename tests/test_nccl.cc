// NcclCommunicator on this machine's GPU, at world size 1 (NCCL refuses two
// ranks on one GPU; under mpiexec with a GPU per rank it runs at any size):
// every collective, blocking and not, point-to-point to itself inside a
// group, the shape checks, host tensors through the host transport, split(),
// the deadline, the set-up's deadline (a peer that never arrives), and the
// allocator's stream-ordered reuse. Values are small
// integers in fp32, so every sum is exact and compared with ==. Exits 77
// (meson: SKIP) without a GPU or without the CUDA build.
#include <weft/cuda/kernels.h>
#include <weft/cuda/runtime.h>
#include <weft/mpi_communicator.h>
#include <weft/nccl_communicator.h>

#include <fmt/core.h>
#include <fmt/ranges.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
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
using weft::Device;
using weft::DType;
using weft::Tensor;

int gpu = 0;

std::vector<float> to_host(const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  cudaDeviceSynchronize();
  cudaMemcpy(v.data(), t.raw(), t.nbytes(), cudaMemcpyDeviceToHost);
  return v;
}

Tensor to_device(const std::vector<float>& v) {
  Tensor t = Tensor::empty({static_cast<int64_t>(v.size())}, DType::F32, Device::cuda(gpu));
  cudaMemcpy(t.raw(), v.data(), t.nbytes(), cudaMemcpyHostToDevice);
  return t;
}

// The text of the weft::Error `fn` throws ("" when it throws none).
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

void check_collectives(weft::Communicator& c) {
  const int n = c.size();
  const auto fn = static_cast<float>(n);
  const auto me = static_cast<float>(c.rank());
  Tensor t = to_device({1, 2, -3});
  c.all_reduce(t, weft::ReduceOp::Sum);
  expect(to_host(t) == std::vector<float>{fn, 2 * fn, -3 * fn}, "all_reduce sum");
  Tensor m = to_device({me, -me});
  c.all_reduce(m, weft::ReduceOp::Max);
  expect(to_host(m) == std::vector<float>{fn - 1, 0}, "all_reduce max");
  Tensor g = Tensor::empty({2L * n}, DType::F32, Device::cuda(gpu));
  c.all_gather(to_device({me, 10 + me}), g);
  std::vector<float> want_g;
  for (int r = 0; r < n; ++r) want_g.insert(want_g.end(), {float(r), 10.0f + float(r)});
  expect(to_host(g) == want_g, "all_gather");
  std::vector<float> in_rs;
  for (int r = 0; r < n; ++r) in_rs.insert(in_rs.end(), {float(r), 1});
  Tensor rs = Tensor::empty({2}, DType::F32, Device::cuda(gpu));
  c.reduce_scatter(to_device(in_rs), rs, weft::ReduceOp::Sum);
  expect(to_host(rs) == std::vector<float>{me * fn, fn}, "reduce_scatter");
  Tensor b = to_device({me + 7});
  c.broadcast(b, 0);
  expect(to_host(b) == std::vector<float>{7}, "broadcast");
  c.barrier();

  // Non-blocking forms, all in flight at once, waited for in order.
  Tensor a1 = to_device({2, 4});
  Tensor g1 = Tensor::empty({2L * n}, DType::F32, Device::cuda(gpu));
  Tensor s1 = Tensor::empty({2}, DType::F32, Device::cuda(gpu));
  Tensor g_in = to_device({me, me});
  Tensor s_in = to_device(in_rs);
  std::vector<weft::RequestPtr> reqs;
  reqs.push_back(c.iall_reduce(a1, weft::ReduceOp::Sum));
  reqs.push_back(c.iall_gather(g_in, g1));
  reqs.push_back(c.ireduce_scatter(s_in, s1, weft::ReduceOp::Sum));
  weft::wait_all(reqs);
  expect(to_host(a1) == std::vector<float>{2 * fn, 4 * fn}, "iall_reduce");
  std::vector<float> want_g1;
  for (int r = 0; r < n; ++r) want_g1.insert(want_g1.end(), {float(r), float(r)});
  expect(to_host(g1) == want_g1, "iall_gather");
  expect(to_host(s1) == std::vector<float>{me * fn, fn}, "ireduce_scatter");

  // An input the compute stream is still making: the collective's stream
  // waits for it (where streams run lazily, as on the GPU emulator, a
  // collective that did not wait would read the input unscaled).
  Tensor made = to_device({me + 1, me + 2});
  weft::cuda::scale_inplace(weft::cuda::context(gpu), made.data<float>(), 3.0f, 2);
  Tensor g2 = Tensor::empty({2L * n}, DType::F32, Device::cuda(gpu));
  c.all_gather(made, g2);
  std::vector<float> want_g2;
  for (int r = 0; r < n; ++r) want_g2.insert(want_g2.end(), {3.0f * (r + 1), 3.0f * (r + 2)});
  expect(to_host(g2) == want_g2, "all_gather of what the compute stream was making");

  // Host tensors go through the host transport.
  Tensor h = Tensor::zeros({1});
  h.data<float>()[0] = 1;
  c.all_reduce(h, weft::ReduceOp::Sum);
  expect(h.data<float>()[0] == fn, "all_reduce of a host tensor");
}

// A group that sends to the next rank and receives from the previous one
// (itself at world size 1): two messages of different shapes, per-peer order.
void check_group_p2p(weft::Communicator& c) {
  const int n = c.size();
  const int next = (c.rank() + 1) % n, prev = (c.rank() + n - 1) % n;
  const auto me = static_cast<float>(c.rank());
  Tensor out0 = to_device({me, me + 0.5f}), out1 = to_device({100 + me});
  Tensor in0 = to_device({-1, -1}), in1 = to_device({-1});
  std::vector<weft::RequestPtr> reqs;
  c.group_start();
  reqs.push_back(c.irecv(in0, prev, {weft::MessageTag::Kind::Activation, 0}));
  reqs.push_back(c.irecv(in1, prev, {weft::MessageTag::Kind::Activation, 1}));
  reqs.push_back(c.isend(out0, next, {weft::MessageTag::Kind::Activation, 0}));
  reqs.push_back(c.isend(out1, next, {weft::MessageTag::Kind::Activation, 1}));
  expect(!reqs[0]->test(), "a request of an open group is not done");
  const std::string inside = error_of([&] { reqs[0]->wait(); });
  expect(has(inside, "inside its open group"), "waiting inside a group is refused: " + inside);
  c.group_end();
  weft::wait_all(reqs);
  const auto p = static_cast<float>(prev);
  expect(to_host(in0) == std::vector<float>{p, p + 0.5f}, "group p2p, first message");
  expect(to_host(in1) == std::vector<float>{100 + p}, "group p2p, second message");

}

// A receive posted for the wrong shape: the first message of a tag carries
// its header over the host, so the receive's wait names both shapes, and
// aborts the communicator (its NCCL receive has the wrong count). A later
// message of a tag keeps the first one's shape, checked on each side. On
// splits of their own, since they end them.
void check_mismatches(weft::Communicator& world) {
  std::vector<int> all;
  for (int r = 0; r < world.size(); ++r) all.push_back(r);
  const int n = world.size();
  const int next = (world.rank() + 1) % n, prev = (world.rank() + n - 1) % n;
  {
    auto c = world.split({all}, "mismatch");
    world.barrier();  // every rank has it before any aborts it
    Tensor wrong = to_device({0, 0, 0}), right = to_device({1, 2});
    c->group_start();
    auto r = c->irecv(wrong, prev, {weft::MessageTag::Kind::Gradient, 2});
    auto s = c->isend(right, next, {weft::MessageTag::Kind::Gradient, 2});
    c->group_end();
    world.barrier();  // every rank has launched before any aborts
    const std::string e = error_of([&] { r->wait(); });
    expect(has(e, "received F32 [2]") && has(e, "posted a receive for F32 [3]"),
           "a mismatched receive names both shapes: " + e);
    const std::string after = error_of([&] { c->all_reduce(right, weft::ReduceOp::Sum); });
    expect(has(after, "aborted"), "the communicator is aborted after a mismatch: " + after);
  }
  {
    auto c = world.split({all}, "changed shape");
    world.barrier();
    Tensor a = to_device({1, 2}), b = to_device({0, 0});
    c->group_start();
    auto r = c->irecv(b, prev, {weft::MessageTag::Kind::Activation, 5});
    auto s = c->isend(a, next, {weft::MessageTag::Kind::Activation, 5});
    c->group_end();
    r->wait();
    s->wait();
    const std::string e = error_of([&] {
      c->isend(to_device({1, 2, 3}), next, {weft::MessageTag::Kind::Activation, 5});
    });
    expect(has(e, "sends F32 [3]") && has(e, "whose first message was F32 [2]"),
           "a tag's later message of another shape is refused: " + e);
    const std::string e2 = error_of([&] {
      c->irecv(to_device({1}), prev, {weft::MessageTag::Kind::Activation, 5});
    });
    expect(has(e2, "posts a receive for F32 [1]") && has(e2, "whose first message was F32 [2]"),
           "a tag's later receive of another shape is refused: " + e2);
  }
}

// The deadline: a receive nothing sends. Runs on a split of its own, since
// it aborts that NCCL communicator.
void check_deadline(weft::Communicator& world) {
  std::vector<int> all;
  for (int r = 0; r < world.size(); ++r) all.push_back(r);
  auto c = world.split({all}, "deadline");
  world.barrier();  // every rank has it before any aborts it
  c->set_timeout(std::chrono::milliseconds(300));
  c->set_step("the deadline check");
  Tensor t = to_device({0});
  const auto start = std::chrono::steady_clock::now();
  const std::string e = error_of([&] { c->recv(t, 0, {weft::MessageTag::Kind::User, 9}); });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  expect(has(e, "timed out after 300 ms") && has(e, "the deadline check"),
         "a receive past its deadline throws CommTimeout naming it: " + e);
  expect(s < 30, fmt::format("the deadline came in {} s", s));

  // A receive left to the device (wait_on_device, as a GPU step waits): the
  // host goes on at once; past the deadline the watchdog aborts the
  // communicator, so that the device's work ends, and the next call throws
  // naming the receive. Its tag's first message (which carries a header)
  // goes first, so that the host has nothing of its own to wait for.
  auto w = world.split({all}, "watchdog");
  world.barrier();
  w->set_timeout(std::chrono::milliseconds(300));
  w->set_step("the watchdog check");
  const int n = world.size();
  const weft::MessageTag tag{weft::MessageTag::Kind::User, 7};
  Tensor a = to_device({1}), b = to_device({0});
  w->group_start();
  auto r0 = w->irecv(b, (w->rank() + n - 1) % n, tag);
  auto s0 = w->isend(a, (w->rank() + 1) % n, tag);
  w->group_end();
  r0->wait_on_device();
  s0->wait_on_device();
  expect(to_host(b) == std::vector<float>{1}, "a message the device waited for");
  auto r1 = w->irecv(b, (w->rank() + n - 1) % n, tag);  // nothing sends it
  const auto t1 = std::chrono::steady_clock::now();
  r1->wait_on_device();
  const double posted = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  expect(posted < 0.25, fmt::format("wait_on_device returned after {} s, not at once", posted));
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  const std::string later = error_of([&] { w->isend(a, (w->rank() + 1) % n, tag); });
  // Its own deadline, or a peer's abort when that peer's deadline came first.
  expect((has(later, "timed out after 300 ms") || has(later, "remote process exited")) &&
             has(later, "the watchdog check") &&
             has(later, "the NCCL watchdog aborted the communicator"),
         "the watchdog's timeout is thrown by the next call: " + later);
  cudaDeviceSynchronize();  // the aborted receive's work has ended
}

// A tensor the communication stream used is not reused until its event fires.
// A host group of two whose second member never comes: rank 0's broadcast
// of the unique id returns at once (it is the root), and nothing else is
// called. NCCL's set-up then waits for a peer that never connects.
class AbsentPeer final : public weft::Communicator {
 public:
  AbsentPeer() : Communicator(weft::CommOptions{}) {}
  int rank() const override { return 0; }
  int size() const override { return 2; }
  int world_rank(int r) const override { return r; }
  std::string describe() const override { return "a group with an absent peer"; }
  weft::RequestPtr isend(const Tensor&, int, weft::MessageTag) override { return unused(); }
  weft::RequestPtr irecv(const Tensor&, int, weft::MessageTag) override { return unused(); }
  void all_reduce(const Tensor&, weft::ReduceOp) override { unused(); }
  void all_gather(const Tensor&, const Tensor&) override { unused(); }
  void reduce_scatter(const Tensor&, const Tensor&, weft::ReduceOp) override { unused(); }
  void broadcast(const Tensor&, int) override {}
  void barrier() override { unused(); }
  std::unique_ptr<weft::Communicator> split(const std::vector<std::vector<int>>&,
                                            const std::string&) override {
    unused();
    return nullptr;
  }

 private:
  static weft::RequestPtr unused() { throw weft::Error("AbsentPeer: only broadcast is used"); }
};

// The set-up's deadline: ncclCommInitRank for a group of two that only this
// rank joins stops at --comm-timeout with one line, instead of hanging.
void check_setup_deadline() {
  AbsentPeer host;
  const auto t0 = std::chrono::steady_clock::now();
  const std::string e = error_of([&] {
    weft::nccl_world(host, gpu, weft::CommOptions{std::chrono::milliseconds(2000)});
  });
  const double s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  expect(has(e, "rank 0 of a group of 2: NCCL communicator set-up") &&
             has(e, "did not finish within 2000 ms (--comm-timeout); aborted"),
         "an NCCL set-up whose peer never comes times out naming rank, size and timeout: " + e);
  expect(s >= 1.9 && s < 30, fmt::format("the set-up's deadline came in {} s", s));
}

void check_stream_ordered_reuse(weft::Communicator& c) {
  weft::cuda::CachingAllocator& alloc = weft::cuda::context(gpu).allocator();
  cudaDeviceSynchronize();
  (void)Tensor::empty({1}, DType::F32, Device::cuda(gpu));  // an allocation collects what fired
  const size_t before = alloc.stats().bytes_awaiting_streams;
  {
    Tensor t = to_device({1, 2, 3});
    c.all_reduce(t, weft::ReduceOp::Sum);
  }
  expect(alloc.stats().bytes_awaiting_streams > before,
         "a block NCCL used waits for its stream when released");
  cudaDeviceSynchronize();
  Tensor u = Tensor::empty({3}, DType::F32, Device::cuda(gpu));  // collects it
  expect(alloc.stats().bytes_awaiting_streams == before,
         "once the stream has passed the event, the block is free again");
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
    gpu = host.rank() % weft::cuda_device_count();
    auto nccl = weft::nccl_world(host, gpu);
    check_collectives(*nccl);
    check_group_p2p(*nccl);
    check_stream_ordered_reuse(*nccl);
    // A sub-communicator (ncclCommSplit) of even and odd ranks.
    std::vector<std::vector<int>> parity(nccl->size() > 1 ? 2 : 1);
    for (int r = 0; r < nccl->size(); ++r) parity[static_cast<size_t>(r % 2)].push_back(r);
    auto half = nccl->split(parity, "parity");
    check_collectives(*half);
    check_group_p2p(*half);
    check_mismatches(*nccl);
    check_deadline(*nccl);
    // Last: NCCL is left with an aborted set-up. At world size 1 only, where
    // this rank is alone in the real world too.
    if (host.size() == 1) check_setup_deadline();
    fmt::print("rank {}: NCCL world of {}: {}\n", host.rank(), nccl->size(),
               failures ? "FAILED" : "ok");
    return failures ? 1 : 0;
  });
#else
  (void)argc;
  (void)argv;
  return 77;
#endif
}
