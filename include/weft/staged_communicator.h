// weft/staged_communicator.h — device tensors over a host transport.
//
// NCCL refuses two ranks on one GPU, and test machines often have a single
// GPU. So when ranks share a device, device tensors travel through the host:
// each operation copies its device operands into host staging buffers, runs
// the wrapped host transport (MPI, or threads) on those, and copies what
// arrived back to the device. Host tensors pass straight through.
//
//   std::unique_ptr<Communicator> mpi = mpi_world();
//   HostStagedCommunicator world(*mpi);   // device tensors staged through the host
//   world.all_reduce(grads_on_gpu, ReduceOp::Sum);
//
// A receive or a non-blocking collective copies back when its request
// completes (test() or wait()); a send's device data is copied out before
// isend returns, so the tensor may change at once. Staging buffers are pooled
// per rank and reused: after the first step, a step allocates none.
// Communicators from split() stage alike and share the pool. Timeouts and
// failures are the wrapped transport's, with the step set here.
#pragma once

#include <weft/communicator.h>

#include <memory>

namespace weft {

class HostStagedCommunicator final : public Communicator {
 public:
  enum class Stage : uint8_t {
    Device,  // device tensors only (training)
    All,     // host tensors too, through the same buffers (tests the staging on a CPU)
  };
  // `inner` must outlive this communicator.
  explicit HostStagedCommunicator(Communicator& inner, Stage stage = Stage::Device);
  ~HostStagedCommunicator() override;

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  int world_rank(int r) const override { return inner_->world_rank(r); }
  std::string describe() const override { return inner_->describe(); }

  RequestPtr isend(const Tensor& t, int peer, MessageTag tag) override;
  RequestPtr irecv(const Tensor& t, int peer, MessageTag tag) override;
  void all_reduce(const Tensor& t, ReduceOp op) override;
  void all_gather(const Tensor& in, const Tensor& out) override;
  void reduce_scatter(const Tensor& in, const Tensor& out, ReduceOp op) override;
  void broadcast(const Tensor& t, int root) override;
  void barrier() override;
  RequestPtr iall_reduce(const Tensor& t, ReduceOp op) override;
  RequestPtr ireduce_scatter(const Tensor& in, const Tensor& out, ReduceOp op) override;
  RequestPtr iall_gather(const Tensor& in, const Tensor& out) override;
  std::unique_ptr<Communicator> split(const std::vector<std::vector<int>>& groups,
                                      const std::string& name) override;
  void group_start() override { inner_->group_start(); }
  void group_end() override { inner_->group_end(); }

  // Host bytes the staging pool holds (for tests: it stops growing).
  size_t staging_bytes() const;

  class Pool;

 private:
  HostStagedCommunicator(std::unique_ptr<Communicator> owned, Stage stage,
                         std::shared_ptr<Pool> pool);
  bool staged(const Tensor& t) const;
  // The inner transport takes this communicator's step and deadline.
  Communicator& inner();

  std::unique_ptr<Communicator> owned_;  // from split(); null for the world
  Communicator* inner_;
  Stage stage_;
  std::shared_ptr<Pool> pool_;
};

}  // namespace weft
