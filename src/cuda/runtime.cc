// Contexts, streams, pinned buffers and copies on the CUDA runtime.
#include <weft/cuda/runtime.h>

#include "src/cuda/check.h"

#include <cublasLt.h>
#include <cuda_profiler_api.h>

#include <algorithm>
#include <cstring>
#include <memory>

namespace weft::cuda {

std::string cuda_error_message(int status, const char* call) {
  const auto e = static_cast<cudaError_t>(status);
  return fmt::format("{} failed: {} ({})", call, cudaGetErrorString(e), cudaGetErrorName(e));
}

std::string cublas_error_message(int status, const char* call) {
  const auto s = static_cast<cublasStatus_t>(status);
  return fmt::format("{} failed: {} ({})", call, cublasGetStatusString(s), cublasGetStatusName(s));
}

namespace {

// cudaMalloc/cudaFree on one device. Out of memory is reported as nullptr so
// the allocator can empty its cache and retry; the sticky error is cleared.
class CudaBackend final : public MemoryBackend {
 public:
  explicit CudaBackend(int device) : device_(device) {}
  void* malloc(size_t bytes) override {
    WEFT_CUDA_CHECK(cudaSetDevice(device_));
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, bytes);
    if (e == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      return nullptr;
    }
    detail::check_cuda(e, "cudaMalloc", __FILE__, __LINE__);
    return p;
  }
  void free(void* p) override {
    cudaSetDevice(device_);
    cudaFree(p);  // errors here are the runtime shutting down; nothing to do
  }
  void* record_event(CUstream_st* stream) override {
    WEFT_CUDA_CHECK(cudaSetDevice(device_));
    cudaEvent_t e = nullptr;
    WEFT_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    WEFT_CUDA_CHECK(cudaEventRecord(e, stream));
    return e;
  }
  bool event_done(void* event) override {
    const cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(event));
    if (e == cudaErrorNotReady) return false;
    detail::check_cuda(e, "cudaEventQuery", __FILE__, __LINE__);
    return true;
  }
  void event_synchronize(void* event) override {
    WEFT_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event)));
  }
  void destroy_event(void* event) override { cudaEventDestroy(static_cast<cudaEvent_t>(event)); }

 private:
  int device_;
};

constexpr size_t kCublasWorkspace = size_t{32} << 20;  // what cuBLAS recommends on Hopper

}  // namespace

PinnedBuffer::PinnedBuffer(size_t bytes) : bytes_(bytes) {
  WEFT_CUDA_CHECK(cudaMallocHost(&data_, bytes));
}

PinnedBuffer::~PinnedBuffer() {
  if (data_ != nullptr) cudaFreeHost(data_);
}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  if (this != &o) {
    if (data_ != nullptr) cudaFreeHost(data_);
    data_ = std::exchange(o.data_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

Context::Context(int device) : device_(device) {
  WEFT_CUDA_CHECK(cudaSetDevice(device));
  cudaStream_t s = nullptr;
  // Blocking streams: a plain cudaMemcpy (the legacy default stream) still
  // waits for, and is waited for by, weft's work, so code outside weft that
  // touches the same memory stays correct.
  WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamDefault));
  compute_ = s;
  WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamDefault));
  comm_ = s;
  cudaEvent_t e = nullptr;
  for (CUevent_st** ev : {&compute_done_, &comm_done_, &staging_done_}) {
    WEFT_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    *ev = e;
  }
  allocator_ = std::make_unique<CachingAllocator>(std::make_unique<CudaBackend>(device), compute_);
}

Context::~Context() {
  cudaSetDevice(device_);
  // Handles first, then the workspaces they may still name.
  if (cublas_ != nullptr) cublasDestroy(cublas_);
  if (cublas_lt_ != nullptr) cublasLtDestroy(cublas_lt_);
  allocator_->release(cublas_workspace_);
  allocator_->release(cublas_lt_workspace_);
  allocator_.reset();
  for (CUevent_st* ev : {compute_done_, comm_done_, staging_done_}) cudaEventDestroy(ev);
  for (const auto& slot : small_) cudaEventDestroy(slot->done);
  cudaStreamDestroy(compute_);
  cudaStreamDestroy(comm_);
}

void Context::make_current() const { WEFT_CUDA_CHECK(cudaSetDevice(device_)); }

cublasContext* Context::cublas() {
  std::call_once(cublas_once_, [this] {
    make_current();
    cublasHandle_t h = nullptr;
    WEFT_CUBLAS_CHECK(cublasCreate(&h));
    WEFT_CUBLAS_CHECK(cublasSetStream(h, compute_));
    cublas_workspace_ = allocator_->allocate(kCublasWorkspace);
    WEFT_CUBLAS_CHECK(cublasSetWorkspace(h, cublas_workspace_, kCublasWorkspace));
    cublas_ = h;
  });
  return cublas_;
}

size_t Context::cublas_lt_workspace_bytes() { return kCublasWorkspace; }

cublasLtContext* Context::cublas_lt() {
  std::call_once(cublas_lt_once_, [this] {
    make_current();
    void* workspace = allocator_->allocate(kCublasWorkspace);
    cublasLtHandle_t h = nullptr;
    const cublasStatus_t s = cublasLtCreate(&h);
    if (s != CUBLAS_STATUS_SUCCESS) {
      allocator_->release(workspace);  // call_once runs this again on the next call
      detail::check_cublas(s, "cublasLtCreate(&h)", __FILE__, __LINE__);
    }
    cublas_lt_workspace_ = workspace;
    cublas_lt_ = h;
  });
  return cublas_lt_;
}

void Context::comm_waits_for_compute() {
  make_current();
  WEFT_CUDA_CHECK(cudaEventRecord(compute_done_, compute_));
  WEFT_CUDA_CHECK(cudaStreamWaitEvent(comm_, compute_done_, 0));
}

void Context::compute_waits_for_comm() {
  make_current();
  WEFT_CUDA_CHECK(cudaEventRecord(comm_done_, comm_));
  WEFT_CUDA_CHECK(cudaStreamWaitEvent(compute_, comm_done_, 0));
}

void Context::synchronize() const {
  make_current();
  // Either order waits for both. The communication stream first: where
  // streams run work only when it is needed (the GPU emulator), its work
  // then runs before the compute work it should have waited for, and a
  // missing wait shows.
  WEFT_CUDA_CHECK(cudaStreamSynchronize(comm_));
  WEFT_CUDA_CHECK(cudaStreamSynchronize(compute_));
}

PinnedBuffer& Context::staging(size_t bytes) {
  if (bytes <= kSmallStaging) {
    // The oldest slot, unless its copy is still queued: then a new slot
    // before it, which the ring reaches last.
    bool busy = !small_.empty() && small_[next_small_]->pending;
    if (busy) {
      const cudaError_t e = cudaEventQuery(small_[next_small_]->done);
      if (e != cudaErrorNotReady) WEFT_CUDA_CHECK(e);
      busy = e == cudaErrorNotReady;
    }
    if (small_.empty() || (busy && small_.size() < kMaxSmallSlots)) {
      auto slot = std::make_unique<SmallSlot>();
      WEFT_CUDA_CHECK(cudaEventCreateWithFlags(&slot->done, cudaEventDisableTiming));
      small_.insert(small_.begin() + static_cast<std::ptrdiff_t>(next_small_), std::move(slot));
    } else if (busy) {  // the ring is full: wait for its oldest copy
      WEFT_CUDA_CHECK(cudaEventSynchronize(small_[next_small_]->done));
    }
    const size_t k = next_small_;
    next_small_ = (next_small_ + 1) % small_.size();
    SmallSlot& slot = *small_[k];
    slot.pending = false;
    // 64 KiB at least, doubled up to kSmallStaging as larger copies come.
    if (slot.buf.bytes() < bytes)
      slot.buf = PinnedBuffer(std::min(kSmallStaging,
                                       std::max({bytes, slot.buf.bytes() * 2, size_t{1} << 16})));
    staged_slot_ = static_cast<int>(k);
    return slot.buf;
  }
  staged_slot_ = -1;
  if (staging_pending_) {
    WEFT_CUDA_CHECK(cudaEventSynchronize(staging_done_));
    staging_pending_ = false;
  }
  if (staging_.bytes() < bytes) staging_ = PinnedBuffer(std::max(bytes, staging_.bytes() * 2));
  return staging_;
}

void Context::staging_in_flight() {
  if (staged_slot_ >= 0) {
    SmallSlot& slot = *small_[static_cast<size_t>(staged_slot_)];
    WEFT_CUDA_CHECK(cudaEventRecord(slot.done, compute_));
    slot.pending = true;
    return;
  }
  WEFT_CUDA_CHECK(cudaEventRecord(staging_done_, compute_));
  staging_pending_ = true;
}

TimingEvents::~TimingEvents() {
  for (CUevent_st* e : events_) cudaEventDestroy(e);  // errors: the runtime shutting down
}

void TimingEvents::record(size_t i) {
  ctx_->make_current();
  while (events_.size() <= i) {
    cudaEvent_t e = nullptr;
    WEFT_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDefault));  // with timing
    events_.push_back(e);
  }
  WEFT_CUDA_CHECK(cudaEventRecord(events_[i], ctx_->compute_stream()));
  last_ = i;
  recorded_ = true;
}

void TimingEvents::synchronize() const {
  if (recorded_) WEFT_CUDA_CHECK(cudaEventSynchronize(events_[last_]));
}

float TimingEvents::elapsed_ms(size_t a, size_t b) const {
  check(a < events_.size() && b < events_.size(),
        "timing events {} and {}: only {} were ever recorded", a, b, events_.size());
  float ms = 0;
  WEFT_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[a], events_[b]));
  return ms;
}

Context& context(int device) {
  static std::mutex mu;
  static std::vector<Context*> contexts;  // leaked on purpose: see the header
  std::lock_guard<std::mutex> lock(mu);
  int count = 0;  // left untouched by cudaGetDeviceCount on error
  if (contexts.empty()) {
    const cudaError_t e = cudaGetDeviceCount(&count);
    check(e == cudaSuccess && count > 0, "no CUDA device is usable: {}",
          e == cudaSuccess ? std::string("none found")
                           : cuda_error_message(static_cast<int>(e), "cudaGetDeviceCount"));
    contexts.assign(static_cast<size_t>(count), nullptr);
  }
  check(device >= 0 && static_cast<size_t>(device) < contexts.size(),
        "cuda:{} requested, but {} CUDA device(s) are visible", device, contexts.size());
  Context*& c = contexts[static_cast<size_t>(device)];
  if (c == nullptr) c = new Context(device);
  return *c;
}

void upload(Context& ctx, void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  std::lock_guard<std::mutex> lock(ctx.staging_mu_);
  ctx.make_current();
  PinnedBuffer& pin = ctx.staging(bytes);
  std::memcpy(pin.data(), src, bytes);
  WEFT_CUDA_CHECK(cudaMemcpyAsync(dst, pin.data(), bytes, cudaMemcpyHostToDevice,
                                  ctx.compute_stream()));
  ctx.staging_in_flight();
}

void download(Context& ctx, void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  std::lock_guard<std::mutex> lock(ctx.staging_mu_);
  ctx.make_current();
  PinnedBuffer& pin = ctx.staging(bytes);
  WEFT_CUDA_CHECK(cudaMemcpyAsync(pin.data(), src, bytes, cudaMemcpyDeviceToHost,
                                  ctx.compute_stream()));
  WEFT_CUDA_CHECK(cudaStreamSynchronize(ctx.compute_stream()));
  std::memcpy(dst, pin.data(), bytes);
}

namespace {
cudaStream_t stream_of(const Context& ctx, StreamKind on) {
  return on == StreamKind::Compute ? ctx.compute_stream() : ctx.comm_stream();
}
}  // namespace

void copy_device(Context& ctx, void* dst, const void* src, size_t bytes, StreamKind on) {
  if (bytes == 0) return;
  ctx.make_current();
  WEFT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_of(ctx, on)));
}

void zero(Context& ctx, void* dst, size_t bytes, StreamKind on) {
  if (bytes == 0) return;
  ctx.make_current();
  WEFT_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, stream_of(ctx, on)));
}

void profiler_start(Context& ctx) {
  ctx.make_current();
  WEFT_CUDA_CHECK(cudaProfilerStart());
}

void profiler_stop(Context& ctx) {
  ctx.make_current();
  WEFT_CUDA_CHECK(cudaProfilerStop());
}

}  // namespace weft::cuda
