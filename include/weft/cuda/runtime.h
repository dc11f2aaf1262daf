// weft/cuda/runtime.h — the CUDA device: memory, streams, copies, errors.
//
// One Context per GPU, created on first use and kept for the life of the
// process. It owns
//   - a compute stream, where every weft kernel and cuBLAS call runs, and a
//     communication stream, ordered against it by events
//     (comm_waits_for_compute / compute_waits_for_comm);
//   - a CachingAllocator: freed blocks go to per-size-class free lists and the
//     next request of that class reuses them, so a training step that repeats
//     the previous step's allocations makes no cudaMalloc at all;
//   - pinned (page-locked) staging buffers for host <-> device copies.
//
//   cuda::Context& ctx = cuda::context(0);
//   cuda::DeviceBuffer<float> x(ctx, n);          // from the caching allocator
//   cuda::upload(ctx, x.data(), host.data(), n * sizeof(float));
//   cuda::gelu_forward(ctx, x.data(), y.data(), n);   // weft/cuda/kernels.h
//   cuda::download(ctx, host.data(), y.data(), n * sizeof(float));  // waits
//
// Memory semantics are stream-ordered, as in PyTorch: a released block may be
// handed out again at once, which is safe for work queued later on the compute
// stream. A block that another stream uses (NCCL's, the communication
// stream) is marked with CachingAllocator::record_stream; when it is
// released, an event is recorded on each such stream, and the block is
// handed out again only once those events have fired.
//
// This header names no CUDA type (streams and handles are opaque pointers), so
// plain C++ code, tests and benches include it without the CUDA headers.
// Every failing CUDA, cuBLAS or allocation call throws weft::Error naming the
// call and the CUDA error. Built with -Dcuda; elsewhere nothing here links.
#pragma once

#include <weft/error.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

// Opaque CUDA handles (cudaStream_t, cudaEvent_t, cublasHandle_t, cublasLtHandle_t are
// pointers to these).
struct CUstream_st;
struct CUevent_st;
struct cublasContext;
struct cublasLtContext;

namespace weft::cuda {

// "cudaMalloc(&p, 64) failed: out of memory (cudaErrorMemoryAllocation)" for
// CUDA runtime status `status` returned by `call`.
std::string cuda_error_message(int status, const char* call);
// The same for a cuBLAS status.
std::string cublas_error_message(int status, const char* call);

// --- caching allocator ---

// Raw device memory, as the allocator sees it: cudaMalloc/cudaFree on a GPU,
// a counting fake in the host-side tests.
class MemoryBackend {
 public:
  virtual ~MemoryBackend() = default;
  // nullptr when the device is out of memory; throws Error on other failures.
  virtual void* malloc(size_t bytes) = 0;
  virtual void free(void* p) = 0;
  // Stream-ordered reuse (CachingAllocator::record_stream): an event marking
  // the work queued on `stream` so far; whether it has fired; blocking until
  // it has; and giving it back. On a GPU these are cudaEventRecord,
  // cudaEventQuery, cudaEventSynchronize and cudaEventDestroy.
  virtual void* record_event(CUstream_st* stream) = 0;
  virtual bool event_done(void* event) = 0;
  virtual void event_synchronize(void* event) = 0;
  virtual void destroy_event(void* event) = 0;
};

struct AllocatorStats {
  size_t bytes_in_use = 0;       // size-class bytes handed out and not yet released
  size_t peak_bytes_in_use = 0;  // the most ever in use at once
  size_t bytes_cached = 0;       // size-class bytes waiting in the free lists
  size_t device_mallocs = 0;     // backend malloc calls, ever (cudaMalloc on a GPU)
  size_t device_frees = 0;       // backend free calls, ever
  size_t cache_hits = 0;         // requests served from a free list
  size_t bytes_awaiting_streams = 0;  // released, but another stream may still use them
};

class CachingAllocator {
 public:
  // `home` is the stream the blocks are used on (the compute stream): reuse
  // is ordered on it without events.
  explicit CachingAllocator(std::unique_ptr<MemoryBackend> backend, CUstream_st* home = nullptr);
  // Returns every block, cached or still handed out, to the backend.
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // A block of at least `bytes` (size_class(bytes) bytes, 256-byte aligned by
  // cudaMalloc). A free block of that class is reused; otherwise the backend
  // is asked, and when it is out of memory the cache is emptied and it is
  // asked once more before this throws Error with the allocator's state.
  void* allocate(size_t bytes);
  // Puts a block from allocate() back on its free list; throws Error for a
  // pointer this allocator did not hand out. nullptr is ignored. A block
  // marked by record_stream waits, instead, until an event recorded now on
  // each stream that used it has fired; allocate() looks first.
  void release(void* p);
  // Work queued on `stream` uses the block holding address `p` (a pointer
  // into a block from allocate(): a tensor view, a bucket slice). Throws
  // Error naming the address when no block handed out holds it. The home
  // stream and nullptr are ignored.
  void record_stream(const void* p, CUstream_st* stream);
  // Returns the cached (free) blocks to the backend; blocks awaiting streams stay.
  void empty_cache();
  AllocatorStats stats() const;
  // Restarts peak_bytes_in_use from the bytes in use now.
  void reset_peak();

  // Size classes: multiples of 512 bytes up to 2 KiB, then four classes per
  // power of two (2^k, 1.25 2^k, 1.5 2^k, 1.75 2^k), so a block wastes at
  // most 25% and a step's varied activation sizes land on few lists; above
  // 64 MiB, multiples of 2 MiB (an arena's planned block, a vocabulary-sized
  // table: few and each the same size every step).
  static size_t size_class(size_t bytes);

 private:
  void empty_cache_locked();
  // Moves the blocks whose streams are done (all of them, waiting, when
  // `wait`) from pending_ to the free lists. Events on one stream fire in
  // the order they were recorded, which is pending_'s: once one is found not
  // done, the later ones on its stream are not asked about.
  void collect_pending_locked(bool wait);

  struct Block {
    size_t cls = 0;                     // size-class bytes
    std::vector<CUstream_st*> streams;  // other streams that used it (record_stream)
  };
  struct Pending {
    void* p = nullptr;
    size_t cls = 0;
    std::vector<void*> events;          // one per stream in Block::streams
    std::vector<CUstream_st*> streams;  // the stream each event was recorded on
  };

  std::unique_ptr<MemoryBackend> backend_;
  CUstream_st* home_;
  mutable std::mutex mu_;
  std::map<void*, Block> live_;                // handed out, by address (ordered: record_stream
                                               // finds the block holding an interior pointer)
  std::vector<Pending> pending_;               // released, awaiting other streams
  std::map<size_t, std::vector<void*>> free_;  // class bytes -> free blocks
  AllocatorStats stats_;
};

// Page-locked host memory (cudaMallocHost): copies from it run asynchronously
// and at full PCIe/NVLink speed.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  explicit PinnedBuffer(size_t bytes);
  ~PinnedBuffer();
  PinnedBuffer(PinnedBuffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept;
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// --- the per-device context ---

class Context;
void upload(Context& ctx, void* dst, const void* src, size_t bytes);
void download(Context& ctx, void* dst, const void* src, size_t bytes);

class Context {
 public:
  explicit Context(int device);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  int device() const { return device_; }
  // Makes this context's device the calling thread's current CUDA device.
  void make_current() const;
  CUstream_st* compute_stream() const { return compute_; }
  CUstream_st* comm_stream() const { return comm_; }
  // The cuBLAS handle, bound to the compute stream, with a workspace from the
  // caching allocator (created on first use).
  cublasContext* cublas();
  // The cuBLASLt handle (created on first use) and its own workspace of
  // cublas_lt_workspace_bytes() from the caching allocator, held until the
  // context is destroyed. A cuBLASLt matmul takes its stream per call: the
  // compute stream.
  cublasLtContext* cublas_lt();
  void* cublas_lt_workspace() const { return cublas_lt_workspace_; }
  static size_t cublas_lt_workspace_bytes();
  // GEMMs whose bias epilogue cuBLASLt could not run (gemm_bias in
  // weft/cuda/kernels.h), which added the bias separately: counted, and
  // reported on stderr for the first only, not once per step.
  // count_bias_epilogue_fallback() returns the count before this one.
  int64_t count_bias_epilogue_fallback() { return bias_fallbacks_.fetch_add(1); }
  int64_t bias_epilogue_fallbacks() const { return bias_fallbacks_.load(); }
  // The same for the GELU epilogues (gemm_bias_gelu_bf16, gemm_dgelu_bf16),
  // which then run the GELU kernel separately.
  int64_t count_gelu_epilogue_fallback() { return gelu_fallbacks_.fetch_add(1); }
  int64_t gelu_epilogue_fallbacks() const { return gelu_fallbacks_.load(); }
  // And for the bias-gradient epilogue (gemm_bf16_bias_grad).
  int64_t count_bias_grad_epilogue_fallback() { return bias_grad_fallbacks_.fetch_add(1); }
  int64_t bias_grad_epilogue_fallbacks() const { return bias_grad_fallbacks_.load(); }
  CachingAllocator& allocator() { return *allocator_; }

  // Work queued on the communication stream after this call starts only when
  // everything queued on the compute stream before it has finished; and the
  // converse. Both record an event and make the other stream wait on it; the
  // host does not wait.
  void comm_waits_for_compute();
  void compute_waits_for_comm();
  // Blocks the host until both streams are idle.
  void synchronize() const;

  // Bytes of the pinned staging buffer for large copies (grown on demand by
  // upload/download).
  size_t staging_bytes() const { return staging_.bytes(); }
  // Copies of at most this many bytes (a micro-batch's tokens) go through a
  // ring of small pinned buffers instead. An upload takes the oldest slot
  // once the device has made the copy that last used it; while that copy is
  // still queued, the ring grows by a slot (up to kMaxSmallSlots) rather than
  // wait, so that a step's uploads never stop the host: the ring settles at
  // the uploads the host runs ahead of the device.
  static constexpr size_t kSmallStaging = size_t{1} << 20;
  static constexpr size_t kMaxSmallSlots = 256;
  // Slots in the ring now.
  size_t small_slots() const { return small_.size(); }

 private:
  friend void upload(Context& ctx, void* dst, const void* src, size_t bytes);
  friend void download(Context& ctx, void* dst, const void* src, size_t bytes);
  // A pinned staging buffer of at least `bytes`, once any copy still reading
  // it has finished: the next small slot, or the large buffer, grown. Called
  // with staging_mu_ held.
  PinnedBuffer& staging(size_t bytes);
  // Records that an asynchronous copy from the buffer staging() last gave
  // was queued.
  void staging_in_flight();

  int device_;
  CUstream_st* compute_ = nullptr;
  CUstream_st* comm_ = nullptr;
  CUevent_st* compute_done_ = nullptr;
  CUevent_st* comm_done_ = nullptr;
  CUevent_st* staging_done_ = nullptr;
  bool staging_pending_ = false;
  std::unique_ptr<CachingAllocator> allocator_;
  std::once_flag cublas_once_;
  cublasContext* cublas_ = nullptr;
  void* cublas_workspace_ = nullptr;
  std::once_flag cublas_lt_once_;
  cublasLtContext* cublas_lt_ = nullptr;
  void* cublas_lt_workspace_ = nullptr;
  std::atomic<int64_t> bias_fallbacks_{0};
  std::atomic<int64_t> gelu_fallbacks_{0};
  std::atomic<int64_t> bias_grad_fallbacks_{0};
  PinnedBuffer staging_;
  struct SmallSlot {
    PinnedBuffer buf;
    CUevent_st* done = nullptr;  // recorded after the copy that last read it
    bool pending = false;
  };
  std::vector<std::unique_ptr<SmallSlot>> small_;
  size_t next_small_ = 0;
  int staged_slot_ = -1;  // the small slot staging() last gave, -1 for the large buffer
  std::mutex staging_mu_;
};

// Timing events on a context's compute stream, for profilers: record(i)
// marks the point the stream reaches once the work queued before it is done,
// and elapsed_ms(a, b) is the GPU's time between two marks
// (cudaEventRecord, cudaEventElapsedTime). Events are created on first use
// and reused; a mark may be recorded again once the host has read it.
class TimingEvents {
 public:
  explicit TimingEvents(Context& ctx) : ctx_(&ctx) {}
  ~TimingEvents();  // destroys the events
  TimingEvents(const TimingEvents&) = delete;
  TimingEvents& operator=(const TimingEvents&) = delete;

  void record(size_t i);
  // Blocks the host until the last mark recorded has been reached.
  void synchronize() const;
  // Milliseconds from mark a to mark b; both must have been reached
  // (synchronize() first), else this throws Error naming the call.
  float elapsed_ms(size_t a, size_t b) const;

 private:
  Context* ctx_;
  std::vector<CUevent_st*> events_;
  size_t last_ = 0;  // the mark recorded last
  bool recorded_ = false;
};

// The context of CUDA device `device`, created on first use. Throws Error when
// the device does not exist. Contexts are never destroyed: the CUDA runtime
// may be torn down before static destructors run.
Context& context(int device);

// Host -> device through the pinned staging buffer, queued on the compute
// stream; returns once `src` has been read (the device copy may still run).
void upload(Context& ctx, void* dst, const void* src, size_t bytes);
// Device -> host after everything queued on the compute stream; waits for it.
void download(Context& ctx, void* dst, const void* src, size_t bytes);
enum class StreamKind : uint8_t { Compute, Comm };
// Device -> device, queued on the compute (or the communication) stream.
void copy_device(Context& ctx, void* dst, const void* src, size_t bytes,
                 StreamKind on = StreamKind::Compute);
// Sets `bytes` bytes to zero, queued on the compute (or the communication) stream.
void zero(Context& ctx, void* dst, size_t bytes, StreamKind on = StreamKind::Compute);

// The CUDA profiler's collection range (cudaProfilerStart / Stop): a kernel
// profiler started with collection off (`ncu --profile-from-start off`)
// records only the kernels launched between the two. Outside a profiler both
// do nothing.
void profiler_start(Context& ctx);
void profiler_stop(Context& ctx);

// A typed block from a context's caching allocator, returned when destroyed.
template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Context& ctx, int64_t count)
      : ctx_(&ctx), data_(static_cast<T*>(ctx.allocator().allocate(bytes_of(count)))),
        count_(count) {}
  ~DeviceBuffer() { reset(); }
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : ctx_(o.ctx_), data_(std::exchange(o.data_, nullptr)), count_(std::exchange(o.count_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      ctx_ = o.ctx_;
      data_ = std::exchange(o.data_, nullptr);
      count_ = std::exchange(o.count_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  static size_t bytes_of(int64_t count) {
    check(count >= 0, "a device buffer of {} elements", count);
    return static_cast<size_t>(count) * sizeof(T);
  }
  T* data() const { return data_; }
  int64_t size() const { return count_; }
  size_t bytes() const { return static_cast<size_t>(count_) * sizeof(T); }
  void reset() {
    if (data_ != nullptr) ctx_->allocator().release(data_);
    data_ = nullptr;
    count_ = 0;
  }

 private:
  Context* ctx_ = nullptr;
  T* data_ = nullptr;
  int64_t count_ = 0;
};

}  // namespace weft::cuda
