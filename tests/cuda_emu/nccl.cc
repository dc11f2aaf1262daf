// GPU emulator (tests/cuda_emu): NCCL for one process, whose communicators
// have one rank (the GPU machine's check runs NCCL at world size 1 too).
// Written for weft from NCCL's documented behaviour; no NVIDIA code.
//
// A collective of one rank is a copy from the send buffer to the receive
// buffer (none when they are the same), queued on its stream like any GPU
// work (streams.h). Sends and receives are held from ncclGroupStart to
// ncclGroupEnd, which pairs each send to self with the receive of the same
// size in the order both were posted, and queues the copies; one left
// without a partner is a hang on a GPU and stops the run here. A
// communicator of more than one rank never finishes its set-up (its peers
// are in no other process): with `blocking = 0` its creation answers
// ncclInProgress and stays so until it is aborted, as NCCL's does while it
// waits for peers that never come.
#include <nccl.h>

#include "streams.h"

#include <atomic>
#include <cstdint>
#include <cstring>
#include <deque>
#include <mutex>
#include <vector>

struct ncclComm {
  int nranks = 1;
  ncclResult_t state = ncclSuccess;  // what ncclCommGetAsyncError says
  ncclComm** split_out = nullptr;    // a non-blocking split's, until it is polled
};

namespace {

size_t type_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
    case ncclUint8: return 1;
    case ncclFloat16:
    case ncclBfloat16: return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32: return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64: return 8;
  }
  return 0;
}

bool valid_type(ncclDataType_t t) { return type_size(t) != 0; }

bool ready(ncclComm_t comm) { return comm != nullptr && comm->state == ncclSuccess; }

// A copy of `bytes` on `stream` (none in place).
void queue_copy(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  if (bytes == 0 || dst == src) return;
  weft_emu::enqueue(stream, [dst, src, bytes] { std::memmove(dst, src, bytes); });
}

struct P2p {
  bool send;
  void* buf;
  size_t bytes;
  ncclComm_t comm;
  cudaStream_t stream;
};

// The open group of this host thread (NCCL's groups are per thread).
thread_local int t_group_depth = 0;
thread_local std::vector<P2p> t_pending;

ncclResult_t p2p(bool send, void* buf, size_t count, ncclDataType_t type, int peer,
                 ncclComm_t comm, cudaStream_t stream) {
  if (!ready(comm)) return ncclInvalidUsage;
  if (!valid_type(type) || peer != 0) return ncclInvalidArgument;
  t_pending.push_back({send, buf, count * type_size(type), comm, stream});
  if (t_group_depth == 0) return ncclGroupEnd();  // alone: its own group (it will not pair)
  return ncclSuccess;
}

}  // namespace

const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    case ncclNumResults: break;
  }
  return "unknown result code";
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  if (id == nullptr) return ncclInvalidArgument;
  static std::atomic<uint64_t> next{1};
  std::memset(id->internal, 0, sizeof id->internal);
  const uint64_t n = next++;
  std::memcpy(id->internal, &n, sizeof n);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId, int rank,
                                    ncclConfig_t* config) {
  if (comm == nullptr || nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
  const bool blocking = config == nullptr || config->blocking != 0;
  *comm = new ncclComm{nranks, nranks == 1 ? ncclSuccess : ncclInProgress};
  if (nranks == 1) return ncclSuccess;
  if (blocking)
    weft_emu::fail("ncclCommInitRank for a group of more than one rank: its peers never come "
                   "(a hang on a GPU)");
  return ncclInProgress;
}

// Non-blocking (`blocking = 0`), as NCCL 2.28 was seen to do on an H200:
// the call answers ncclInProgress with *newcomm still null, and the new
// communicator is handed back when the parent's state is next polled.
ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int, ncclComm_t* newcomm,
                           ncclConfig_t* config) {
  if (!ready(comm) || newcomm == nullptr) return ncclInvalidUsage;
  *newcomm = nullptr;
  if (color == NCCL_SPLIT_NOCOLOR) return ncclSuccess;
  if (config != nullptr && config->blocking == 0) {
    comm->state = ncclInProgress;
    comm->split_out = newcomm;
    return ncclInProgress;
  }
  *newcomm = new ncclComm{1, ncclSuccess};
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (comm == nullptr) return ncclInvalidArgument;
  weft_emu::drain_all();  // its queued work finishes first
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* state) {
  if (comm == nullptr || state == nullptr) return ncclInvalidArgument;
  if (comm->split_out != nullptr) {  // the split's background work is done
    *comm->split_out = new ncclComm{1, ncclSuccess};
    comm->split_out = nullptr;
    comm->state = ncclSuccess;
  }
  *state = comm->state;
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  if (comm == nullptr || count == nullptr) return ncclInvalidArgument;
  *count = comm->nranks;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  if (comm == nullptr || rank == nullptr) return ncclInvalidArgument;
  *rank = 0;
  return ncclSuccess;
}

ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, ncclDataType_t type,
                           int root, ncclComm_t comm, cudaStream_t stream) {
  if (!ready(comm)) return ncclInvalidUsage;
  if (!valid_type(type) || root != 0) return ncclInvalidArgument;
  queue_copy(recv, send, count * type_size(type), stream);
  return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t type,
                           ncclRedOp_t, ncclComm_t comm, cudaStream_t stream) {
  if (!ready(comm)) return ncclInvalidUsage;
  if (!valid_type(type)) return ncclInvalidArgument;
  queue_copy(recv, send, count * type_size(type), stream);  // a sum, max... of one
  return ncclSuccess;
}

ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t recvcount,
                               ncclDataType_t type, ncclRedOp_t, ncclComm_t comm,
                               cudaStream_t stream) {
  if (!ready(comm)) return ncclInvalidUsage;
  if (!valid_type(type)) return ncclInvalidArgument;
  queue_copy(recv, send, recvcount * type_size(type), stream);
  return ncclSuccess;
}

ncclResult_t ncclAllGather(const void* send, void* recv, size_t sendcount, ncclDataType_t type,
                           ncclComm_t comm, cudaStream_t stream) {
  if (!ready(comm)) return ncclInvalidUsage;
  if (!valid_type(type)) return ncclInvalidArgument;
  queue_copy(recv, send, sendcount * type_size(type), stream);
  return ncclSuccess;
}

ncclResult_t ncclSend(const void* send, size_t count, ncclDataType_t type, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
  return p2p(true, const_cast<void*>(send), count, type, peer, comm, stream);
}

ncclResult_t ncclRecv(void* recv, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return p2p(false, recv, count, type, peer, comm, stream);
}

ncclResult_t ncclGroupStart() {
  ++t_group_depth;
  return ncclSuccess;
}

// Pairs the group's sends with its receives, per communicator, in the order
// each was posted; the receive's stream waits for the send's (one stream
// in weft's use) and copies.
ncclResult_t ncclGroupEnd() {
  if (t_group_depth > 0) --t_group_depth;
  if (t_group_depth > 0) return ncclSuccess;
  std::vector<P2p> ops = std::move(t_pending);
  t_pending.clear();
  std::vector<bool> used(ops.size(), false);
  for (size_t i = 0; i < ops.size(); ++i) {
    if (!ops[i].send) continue;
    size_t j = 0;
    while (j < ops.size() && (used[j] || ops[j].send || ops[j].comm != ops[i].comm)) ++j;
    if (j == ops.size()) break;
    if (ops[j].bytes != ops[i].bytes)
      weft_emu::fail("ncclSend and ncclRecv of one group pair with different sizes (undefined "
                     "on a GPU)");
    used[i] = used[j] = true;
    if (ops[i].stream != ops[j].stream)
      weft_emu::fail("ncclSend and ncclRecv to self on two streams: not emulated");
    queue_copy(ops[j].buf, ops[i].buf, ops[i].bytes, ops[j].stream);
  }
  for (size_t i = 0; i < ops.size(); ++i)
    if (!used[i])
      weft_emu::fail("an NCCL send or receive with no partner in its group (a hang on a GPU)");
  return ncclSuccess;
}
