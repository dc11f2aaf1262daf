// The caching allocator's bookkeeping. Plain C++: the device (memory and
// events) is behind MemoryBackend, so this logic is tested on machines
// without a GPU.
#include <weft/cuda/runtime.h>

#include <algorithm>
#include <bit>
#include <iterator>

namespace weft::cuda {

namespace {
constexpr size_t kGranule = 512;
constexpr size_t kLarge = size_t{64} << 20, kLargePage = size_t{2} << 20;
}  // namespace

size_t CachingAllocator::size_class(size_t bytes) {
  if (bytes <= 4 * kGranule) return std::max<size_t>(1, (bytes + kGranule - 1) / kGranule) * kGranule;
  // From 64 MiB on, whole 2 MiB pages: a quarter of the power below would
  // waste up to a gigabyte on an arena's one planned block (6.1 GiB -> 7).
  if (bytes > kLarge) return (bytes + kLargePage - 1) / kLargePage * kLargePage;
  // Four classes per power of two: round up to a quarter of the power below.
  const size_t quarter = std::bit_floor(bytes - 1) / 4;
  return (bytes + quarter - 1) / quarter * quarter;
}

CachingAllocator::CachingAllocator(std::unique_ptr<MemoryBackend> backend, CUstream_st* home)
    : backend_(std::move(backend)), home_(home) {}

CachingAllocator::~CachingAllocator() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [p, block] : live_) backend_->free(p);
  live_.clear();
  for (Pending& b : pending_) {
    for (void* e : b.events) backend_->destroy_event(e);
    backend_->free(b.p);
  }
  pending_.clear();
  empty_cache_locked();
}

void CachingAllocator::collect_pending_locked(bool wait) {
  std::vector<CUstream_st*> busy;  // streams with an event found not done in this pass
  auto done = [&](Pending& b) {
    for (CUstream_st* s : b.streams)
      if (!wait && std::find(busy.begin(), busy.end(), s) != busy.end()) return false;
    for (size_t k = 0; k < b.events.size(); ++k) {
      if (wait) {
        backend_->event_synchronize(b.events[k]);
      } else if (!backend_->event_done(b.events[k])) {
        busy.push_back(b.streams[k]);
        return false;
      }
    }
    return true;
  };
  size_t kept = 0;
  for (size_t i = 0; i < pending_.size(); ++i) {
    Pending& b = pending_[i];
    if (!done(b)) {
      if (kept != i) pending_[kept] = std::move(b);  // never a self-move: it would empty events
      ++kept;
      continue;
    }
    for (void* e : b.events) backend_->destroy_event(e);
    free_[b.cls].push_back(b.p);
    stats_.bytes_awaiting_streams -= b.cls;
    stats_.bytes_cached += b.cls;
  }
  pending_.resize(kept);
}

void* CachingAllocator::allocate(size_t bytes) {
  const size_t cls = size_class(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  if (!pending_.empty()) collect_pending_locked(false);
  void* p = nullptr;
  auto it = free_.find(cls);
  if (it != free_.end() && !it->second.empty()) {
    p = it->second.back();
    it->second.pop_back();
    stats_.bytes_cached -= cls;
    ++stats_.cache_hits;
  } else {
    p = backend_->malloc(cls);
    if (p == nullptr && stats_.bytes_cached + stats_.bytes_awaiting_streams > 0) {
      // Out of memory with blocks cached, or awaiting other streams: wait for
      // those streams, give every free block back, and retry.
      collect_pending_locked(true);
      empty_cache_locked();
      p = backend_->malloc(cls);
    }
    if (p == nullptr)
      throw Error("out of device memory allocating {} bytes (size class {}; {} bytes in use, "
                  "{} at peak)",
                  bytes, cls, stats_.bytes_in_use, stats_.peak_bytes_in_use);
    ++stats_.device_mallocs;
  }
  live_.emplace(p, Block{cls, {}});
  stats_.bytes_in_use += cls;
  stats_.peak_bytes_in_use = std::max(stats_.peak_bytes_in_use, stats_.bytes_in_use);
  return p;
}

void CachingAllocator::release(void* p) {
  if (p == nullptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(p);
  check(it != live_.end(), "release of {} which this allocator did not hand out (or released twice)",
        p);
  const size_t cls = it->second.cls;
  std::vector<CUstream_st*> streams = std::move(it->second.streams);
  live_.erase(it);
  stats_.bytes_in_use -= cls;
  if (streams.empty()) {
    free_[cls].push_back(p);
    stats_.bytes_cached += cls;
    return;
  }
  Pending b{p, cls, {}, streams};
  for (CUstream_st* s : streams) b.events.push_back(backend_->record_event(s));
  pending_.push_back(std::move(b));
  stats_.bytes_awaiting_streams += cls;
}

void CachingAllocator::record_stream(const void* p, CUstream_st* stream) {
  if (stream == nullptr || stream == home_) return;
  std::lock_guard<std::mutex> lock(mu_);
  // The block holding p: the last one starting at or before it.
  auto it = live_.upper_bound(const_cast<void*>(p));
  const bool found = it != live_.begin() &&
                     static_cast<const char*>(p) <
                         static_cast<const char*>(std::prev(it)->first) + std::prev(it)->second.cls;
  check(found, "record_stream of {}, which no block handed out by this allocator holds", p);
  std::vector<CUstream_st*>& streams = std::prev(it)->second.streams;
  if (std::find(streams.begin(), streams.end(), stream) == streams.end()) streams.push_back(stream);
}

void CachingAllocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mu_);
  empty_cache_locked();
}

void CachingAllocator::empty_cache_locked() {
  for (auto& [cls, blocks] : free_) {
    for (void* p : blocks) {
      backend_->free(p);
      ++stats_.device_frees;
      stats_.bytes_cached -= cls;
    }
    blocks.clear();
  }
}

void CachingAllocator::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.peak_bytes_in_use = stats_.bytes_in_use;
}

AllocatorStats CachingAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace weft::cuda
