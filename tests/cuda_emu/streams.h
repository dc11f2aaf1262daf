// GPU emulator (tests/cuda_emu): the order in which streams run their work.
//
// Work queued on a stream (a kernel, an asynchronous copy or memset, a
// cuBLAS or cuBLASLt GEMM, an event's record, a wait for an event) runs
// only when something needs it: a synchronize of its stream, of an event
// recorded after it, or of the device; a stream that waits for such an
// event reaching its own wait; a synchronous call (cudaMemcpy, cudaMemset,
// cudaFree, cudaFreeHost, an asynchronous copy to or from pageable host
// memory), which waits for every stream, as the legacy default stream does
// for blocking streams. Work then runs in the thread that needs it, in its
// stream's order. So a host that reads a copy's destination before
// synchronizing reads what was there before; a staging buffer rewritten
// while a copy from it is queued gives the copy the new bytes; and a stream
// that reads another's output without waiting for it reads what was there
// before. On a GPU each is a race that the GPU's speed usually hides.
//
// Communication (nccl.cc) queues work that may not be ready when its turn
// comes: a receive whose message has not arrived. Such work says so, and
// its stream stops there; a wait that needs it (a synchronize, a copy to
// pageable memory) polls until it is ready, running every stream as far as
// it can meanwhile (as a GPU runs them all at once), and an event query
// answers cudaErrorNotReady. A wait that no work can ever satisfy stops the
// program after WEFT_EMU_HANG_SECONDS (default 300), naming what each
// stuck stream waits for: a hang on a GPU.
//
// WEFT_EMU_SYNC_STREAMS=1 runs all work at once instead, in the calling
// thread, as the emulator did before (for telling an emulator problem from
// weft's).
#pragma once

#include <cuda_runtime.h>

#include <functional>
#include <mutex>
#include <string>

namespace weft_emu {

// A place in a stream's work: reached once its first `upto` items have run
// (upto 0: reached).
struct EventMark {
  cudaStream_t stream = nullptr;
  uint64_t upto = 0;
};

// Queues `work` on `stream` and says where it is (on the legacy default
// stream, or on any with WEFT_EMU_SYNC_STREAMS=1, runs it now, after all
// queued work, and returns a reached mark).
EventMark enqueue(cudaStream_t stream, std::function<void()> work);

// Work that may not be ready: returns false (having changed nothing it
// must not change twice) until it is, and is called again later. `what`
// names it where a hang is reported ("ncclRecv from rank 1 ...").
EventMark enqueue_try(cudaStream_t stream, std::function<bool()> work, std::string what);

// Runs `m`'s stream's work up to it, waiting (polling) for work that is not
// ready.
void drain_to(const EventMark& m);
// The same without waiting: whether `m` was reached.
bool try_drain_to(const EventMark& m);

// Runs everything queued on `stream` so far, waiting as drain_to does.
void drain_stream(cudaStream_t stream);

// Runs every stream's queued work, waiting as drain_to does.
void drain_all();
// Runs every stream as far as it can without waiting (a progress thread's
// pass, nccl.cc); returns whether anything ran.
bool progress_all();
// Each stream with queued work, and what its first item waits for.
std::string describe_queued();

// The lock every stream's queue, and each event's record, is kept under
// (recursive: the calls above take it too).
std::unique_lock<std::recursive_mutex> lock_streams();

[[noreturn]] void fail(const char* what);

// WEFT_EMU_HOST_ONLY=1: a device that does nothing, so that what a program
// spends is the host's own time. Kernels, GEMMs, memsets and device-to-device
// copies are checked as usual, counted and dropped; copies to and from host
// memory, event records and waits still run. Device memory is then whatever
// the host uploaded, or zero. Without it, the same work is counted and run.
bool host_only();
enum class Work { kernel, gemm, memset, device_copy, host_copy, host_sync, event_query, kinds };
// Counts one piece of work of kind `w`, and says whether to run it (false
// with WEFT_EMU_HOST_ONLY=1, except for host copies, syncs and queries).
// host_sync: a host call that waits for the device (a stream, event or
// device synchronize, a blocking copy or memset, cudaFree); event_query: a
// host call that asks whether the device is done (a loop of them is a
// wait too). A step whose host runs ahead of its GPU makes neither.
bool count(Work w);

}  // namespace weft_emu
