// weft/local_communicator.h — N ranks as threads of one process.
//
// The fast, deterministic transport for testing everything distributed. It
// keeps the rules of the real transports (tag matching, per-peer FIFO order,
// shape checks, deadlines) and their failure behaviour: when one rank throws,
// every other rank's next wait throws PeerFailed naming it. Device tensors
// (threads sharing a GPU) move by device-to-device copies; reductions of
// device tensors compute on host copies.
//
//   run_local(4, [](Communicator& comm) {
//     Tensor t = Tensor::zeros({8});
//     comm.all_reduce(t, ReduceOp::Sum);
//   });
#pragma once

#include <weft/communicator.h>

#include <functional>
#include <memory>
#include <vector>

namespace weft {

// World communicators for `n` ranks sharing one process; give one to each thread.
std::vector<std::unique_ptr<Communicator>> make_local_world(int n, CommOptions options = {});

// Runs fn(comm) on n threads, one per rank, and joins them. When ranks throw,
// rethrows the first failure that is not a PeerFailed (the cause), prefixed
// with its rank ("rank 2: ...").
void run_local(int n, const std::function<void(Communicator&)>& fn, CommOptions options = {});

}  // namespace weft
