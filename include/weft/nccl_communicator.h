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
// passes. Point-to-point payloads go through NCCL at once (in a group, at
// group_end), never behind a host wait. The first message of each (peer,
// tag) also sends a small shape/dtype header over the host communicator,
// which the receive checks before it completes; later messages of that tag
// must keep its shape (checked on each side against the first), since a
// pipeline's shapes are fixed: after the first step no message touches the
// host transport. WEFT_NCCL_CHECK_MESSAGES=1 sends and checks a header with
// every message. Built with -Dcuda; elsewhere nccl_world throws.
#pragma once

#include <weft/communicator.h>

#include <memory>

namespace weft {

// True when weft was built with NCCL.
bool nccl_built();

// WEFT_NCCL_ONE_GPU=1: NCCL between ranks that share a GPU, for testing the
// NCCL path on a machine with fewer GPUs than ranks. NCCL refuses two ranks
// on one GPU of one host ("Duplicate GPU detected"), and takes the host's
// identity from NCCL_HOSTID: nccl_world gives each rank its own
// ("<host>-weft-rank-<world rank>"), so each is a "host" of its own and NCCL
// connects them through its socket transport (NCCL_SOCKET_IFNAME=lo and
// NCCL_IB_DISABLE=1 unless set). Slow, and only for tests.
bool nccl_ranks_as_hosts();
// A communicator over the same ranks as `host` (which must outlive it), on
// CUDA device `device`. Collective over `host`; call it before any other
// NCCL call of the process (NCCL reads NCCL_HOSTID once).
std::unique_ptr<Communicator> nccl_world(Communicator& host, int device, CommOptions options = {});

}  // namespace weft
