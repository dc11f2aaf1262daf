// weft/nccl_communicator.h — NCCL for device-memory tensors.
//
// The NCCL unique id travels over a host communicator (MPI); each rank drives
// one GPU. Communicators are created non-blocking (ncclCommInitRankConfig and
// ncclCommSplit with `blocking = 0`) and polled with ncclCommGetAsyncError
// against CommOptions::timeout: a rank whose peers never arrive aborts the
// set-up and throws CommTimeout naming its rank, the group's size and the
// timeout (await_setup, weft/communicator.h), instead of hanging. Operations run on the communicator's own CUDA stream, ordered
// after the caller's work by an event, and complete when an event recorded
// after them has fired: Request::wait polls that event with the same
// deadline as the host transports, and aborts the NCCL communicator when it
// passes. Point-to-point payloads go through NCCL; their small shape/dtype
// header goes through the host communicator, so a receive still checks what
// arrived. Built with -Dcuda; elsewhere nccl_world throws.
#pragma once

#include <weft/communicator.h>

#include <memory>

namespace weft {

// True when weft was built with NCCL.
bool nccl_built();
// A communicator over the same ranks as `host` (which must outlive it), on
// CUDA device `device`. Collective over `host`.
std::unique_ptr<Communicator> nccl_world(Communicator& host, int device, CommOptions options = {});

}  // namespace weft
