// The caching allocator's bookkeeping. Plain C++: the device is behind
// MemoryBackend, so this logic is tested on machines without a GPU.
#include <weft/cuda/runtime.h>

#include <algorithm>
#include <bit>

namespace weft::cuda {

namespace {
constexpr size_t kGranule = 512;
}  // namespace

size_t CachingAllocator::size_class(size_t bytes) {
  if (bytes <= 4 * kGranule) return std::max<size_t>(1, (bytes + kGranule - 1) / kGranule) * kGranule;
  // Four classes per power of two: round up to a quarter of the power below.
  const size_t quarter = std::bit_floor(bytes - 1) / 4;
  return (bytes + quarter - 1) / quarter * quarter;
}

CachingAllocator::CachingAllocator(std::unique_ptr<MemoryBackend> backend)
    : backend_(std::move(backend)) {}

CachingAllocator::~CachingAllocator() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [p, bytes] : live_) backend_->free(p);
  live_.clear();
  empty_cache_locked();
}

void* CachingAllocator::allocate(size_t bytes) {
  const size_t cls = size_class(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  void* p = nullptr;
  auto it = free_.find(cls);
  if (it != free_.end() && !it->second.empty()) {
    p = it->second.back();
    it->second.pop_back();
    stats_.bytes_cached -= cls;
    ++stats_.cache_hits;
  } else {
    p = backend_->malloc(cls);
    if (p == nullptr && stats_.bytes_cached > 0) {
      // Out of memory with blocks of other classes cached: give them back and retry.
      empty_cache_locked();
      p = backend_->malloc(cls);
    }
    if (p == nullptr)
      throw Error("out of device memory allocating {} bytes (size class {}; {} bytes in use, "
                  "{} at peak)",
                  bytes, cls, stats_.bytes_in_use, stats_.peak_bytes_in_use);
    ++stats_.device_mallocs;
  }
  live_.emplace(p, cls);
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
  const size_t cls = it->second;
  live_.erase(it);
  free_[cls].push_back(p);
  stats_.bytes_in_use -= cls;
  stats_.bytes_cached += cls;
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
