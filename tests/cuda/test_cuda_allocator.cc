// Host-side logic of the CUDA backend, checked without a GPU: the caching
// allocator's size classes, reuse, statistics, out-of-memory path and
// stream-ordered reuse (events) over a fake backend; CUDA and cuBLAS error messages; bf16 rounding; math modes.
#include "weft_config.h"

#if WEFT_CUDA
#include <weft/cuda/kernels.h>
#include <weft/cuda/runtime.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <map>
#include <set>
#include <vector>

#include "test_util.h"

namespace weft::cuda {
namespace {

using weft::testing::contains;
using weft::testing::error_message;

// Host memory standing in for a device, with a capacity so that running out
// can be tested. Counts what the allocator asks of it.
class FakeBackend final : public MemoryBackend {
 public:
  struct Counts {
    size_t mallocs = 0, frees = 0, failed = 0, held = 0;
    size_t events = 0, events_destroyed = 0, synchronized = 0, queries = 0;
  };
  FakeBackend(Counts* counts, size_t capacity) : counts_(counts), capacity_(capacity) {}
  void* malloc(size_t bytes) override {
    if (counts_->held + bytes > capacity_) {
      ++counts_->failed;
      return nullptr;
    }
    ++counts_->mallocs;
    counts_->held += bytes;
    void* p = std::malloc(bytes);
    sizes_[p] = bytes;
    return p;
  }
  void free(void* p) override {
    ++counts_->frees;
    counts_->held -= sizes_.at(p);
    sizes_.erase(p);
    std::free(p);
  }
  // Events: fired only when the test says the stream's work is done.
  void* record_event(CUstream_st* stream) override {
    ++counts_->events;
    events_[++next_event_] = {stream, false};
    return reinterpret_cast<void*>(next_event_);
  }
  bool event_done(void* event) override {
    ++counts_->queries;
    return events_.at(id(event)).done;
  }
  void event_synchronize(void* event) override {
    ++counts_->synchronized;
    events_.at(id(event)).done = true;
  }
  void destroy_event(void* event) override {
    ++counts_->events_destroyed;
    events_.erase(id(event));
  }
  // Everything queued on `stream` so far has run.
  void finish(CUstream_st* stream) {
    for (auto& [e, ev] : events_)
      if (ev.stream == stream) ev.done = true;
  }

 private:
  struct Event {
    CUstream_st* stream;
    bool done;
  };
  static uintptr_t id(void* event) { return reinterpret_cast<uintptr_t>(event); }
  Counts* counts_;
  size_t capacity_;
  std::map<void*, size_t> sizes_;
  std::map<uintptr_t, Event> events_;
  uintptr_t next_event_ = 0;
};

// Streams are opaque to the allocator: any distinct pointers do.
CUstream_st* fake_stream(uintptr_t n) { return reinterpret_cast<CUstream_st*>(n * 4096); }

// --- stream-ordered reuse ---

TEST(StreamAware, ABlockAnotherStreamUsesIsReusedOnlyAfterItsEvent) {
  FakeBackend::Counts counts;
  auto owned = std::make_unique<FakeBackend>(&counts, size_t{1} << 30);
  FakeBackend& backend = *owned;
  CUstream_st* compute = fake_stream(1);
  CUstream_st* comm = fake_stream(2);
  CachingAllocator a(std::move(owned), compute);
  void* p = a.allocate(4096);
  // A view into the block (a tensor in an arena) names it.
  a.record_stream(static_cast<char*>(p) + 1000, comm);
  a.record_stream(p, comm);  // twice: one event still
  a.release(p);
  EXPECT_EQ(counts.events, 1u);
  EXPECT_EQ(a.stats().bytes_awaiting_streams, 4096u);
  EXPECT_EQ(a.stats().bytes_cached, 0u);
  EXPECT_EQ(a.stats().bytes_in_use, 0u);
  // The communication stream has not reached the event: a new block.
  void* q = a.allocate(4096);
  EXPECT_NE(q, p);
  EXPECT_EQ(counts.mallocs, 2u);
  backend.finish(comm);
  void* r = a.allocate(4096);
  EXPECT_EQ(r, p) << "reused once the event fired";
  EXPECT_EQ(counts.mallocs, 2u);
  EXPECT_EQ(counts.events_destroyed, 1u);
  EXPECT_EQ(a.stats().bytes_awaiting_streams, 0u);
  a.release(q);
  a.release(r);
}

// Many blocks released while another stream still uses them (a pipeline
// stage's sent gradients): an allocation asks about the oldest on that
// stream only, since events on one stream fire in order; once the stream
// is done, every block is collected.
TEST(StreamAware, AnAllocationAsksOnlyTheOldestEventOfABusyStream) {
  FakeBackend::Counts counts;
  auto owned = std::make_unique<FakeBackend>(&counts, size_t{1} << 30);
  FakeBackend& backend = *owned;
  CUstream_st* comm = fake_stream(2);
  CachingAllocator a(std::move(owned), fake_stream(1));
  std::vector<void*> sent;
  for (int k = 0; k < 50; ++k) {
    sent.push_back(a.allocate(4096));
    a.record_stream(sent.back(), comm);
  }
  for (void* p : sent) a.release(p);
  EXPECT_EQ(a.stats().bytes_awaiting_streams, 50u * 4096);
  const size_t before = counts.queries;
  void* q = a.allocate(4096);
  EXPECT_EQ(counts.queries - before, 1u) << "one question about the busy stream, not 50";
  backend.finish(comm);
  void* r = a.allocate(4096);
  EXPECT_EQ(a.stats().bytes_awaiting_streams, 0u);
  EXPECT_NE(std::find(sent.begin(), sent.end(), r), sent.end()) << "a collected block reused";
  a.release(q);
  a.release(r);
}

TEST(StreamAware, TheHomeStreamAndBlocksNoOtherStreamUsedNeedNoEvent) {
  FakeBackend::Counts counts;
  CUstream_st* compute = fake_stream(1);
  CachingAllocator a(std::make_unique<FakeBackend>(&counts, size_t{1} << 30), compute);
  void* p = a.allocate(100);
  a.record_stream(p, compute);
  a.record_stream(p, nullptr);
  a.release(p);
  EXPECT_EQ(counts.events, 0u);
  EXPECT_EQ(a.allocate(100), p);
  a.release(p);
}

TEST(StreamAware, EachStreamThatUsedABlockMustFinish) {
  FakeBackend::Counts counts;
  auto owned = std::make_unique<FakeBackend>(&counts, size_t{1} << 30);
  FakeBackend& backend = *owned;
  CachingAllocator a(std::move(owned), fake_stream(1));
  void* p = a.allocate(512);
  a.record_stream(p, fake_stream(2));
  a.record_stream(p, fake_stream(3));
  a.release(p);
  EXPECT_EQ(counts.events, 2u);
  backend.finish(fake_stream(2));
  void* q = a.allocate(512);
  EXPECT_NE(q, p) << "stream 3 may still use it";
  backend.finish(fake_stream(3));
  EXPECT_EQ(a.allocate(512), p);
  EXPECT_EQ(counts.events_destroyed, 2u);
  a.release(p);
  a.release(q);
}

TEST(StreamAware, RecordStreamNamesAnAddressNoBlockHolds) {
  FakeBackend::Counts counts;
  CachingAllocator a(std::make_unique<FakeBackend>(&counts, size_t{1} << 30), fake_stream(1));
  void* p = a.allocate(512);
  int outside = 0;
  const std::string e = error_message([&] { a.record_stream(&outside, fake_stream(2)); });
  EXPECT_TRUE(contains(e, "record_stream of")) << e;
  EXPECT_TRUE(contains(e, "no block")) << e;
  // One past the block's end is outside it too.
  const std::string end = error_message(
      [&] { a.record_stream(static_cast<char*>(p) + CachingAllocator::size_class(512), fake_stream(2)); });
  EXPECT_TRUE(contains(end, "no block")) << end;
  a.release(p);
}

TEST(StreamAware, OutOfMemoryWaitsForTheStreamsThenReuses) {
  FakeBackend::Counts counts;
  // Room for one block of 1 MiB only.
  CachingAllocator a(std::make_unique<FakeBackend>(&counts, size_t{1} << 20), fake_stream(1));
  void* p = a.allocate(size_t{1} << 20);
  a.record_stream(p, fake_stream(2));
  a.release(p);
  void* q = a.allocate(size_t{3} << 18);  // another class: the device is full
  EXPECT_EQ(counts.synchronized, 1u) << "waited for the stream, not failed";
  EXPECT_EQ(counts.frees, 1u) << "the waited-for block went back to make room";
  EXPECT_EQ(a.stats().bytes_awaiting_streams, 0u);
  a.release(q);
}

TEST(StreamAware, DestroyingTheAllocatorReturnsBlocksStillAwaitingStreams) {
  FakeBackend::Counts counts;
  {
    CachingAllocator a(std::make_unique<FakeBackend>(&counts, size_t{1} << 30), fake_stream(1));
    void* p = a.allocate(512);
    a.record_stream(p, fake_stream(2));
    a.release(p);
  }
  EXPECT_EQ(counts.frees, counts.mallocs);
  EXPECT_EQ(counts.events_destroyed, counts.events);
  EXPECT_EQ(counts.held, 0u);
}

TEST(SizeClass, CoversTheRequestWithLittleWaste) {
  size_t previous = 0;
  for (size_t bytes = 0; bytes < (size_t{1} << 22); bytes += 1 + bytes / 7) {
    const size_t cls = CachingAllocator::size_class(bytes);
    EXPECT_GE(cls, std::max<size_t>(bytes, 1)) << bytes;
    EXPECT_EQ(cls % 512, 0u) << bytes;
    // Up to 2 KiB the next multiple of 512; above, at most a quarter more.
    const size_t bound = bytes <= 2048 ? (std::max<size_t>(bytes, 1) + 511) / 512 * 512
                                       : bytes + bytes / 4;
    EXPECT_LE(cls, bound) << bytes;
    EXPECT_GE(cls, previous) << "classes must grow with the request, at " << bytes;
    previous = cls;
  }
  EXPECT_EQ(CachingAllocator::size_class(1), 512u);
  EXPECT_EQ(CachingAllocator::size_class(2048), 2048u);
  EXPECT_EQ(CachingAllocator::size_class(2049), 2560u);
  EXPECT_EQ(CachingAllocator::size_class(size_t{1} << 20), size_t{1} << 20);
  EXPECT_EQ(CachingAllocator::size_class((size_t{1} << 20) + 1), (size_t{5} << 18));
}

// Above 64 MiB, whole 2 MiB pages: an arena's one planned block of 6.1 GiB
// wastes under 2 MiB, not the 0.9 GiB of the next quarter class.
TEST(SizeClass, LargeBlocksRoundToTwoMebibytes) {
  const size_t mib = size_t{1} << 20;
  EXPECT_EQ(CachingAllocator::size_class(64 * mib), 64 * mib);  // still a quarter class
  EXPECT_EQ(CachingAllocator::size_class(64 * mib + 1), 66 * mib);
  EXPECT_EQ(CachingAllocator::size_class(6225 * mib + 5), 6226 * mib);
  EXPECT_EQ(CachingAllocator::size_class(6226 * mib), 6226 * mib);
  for (size_t bytes = 64 * mib + 1; bytes < 4096 * mib; bytes = bytes * 5 / 4 + 12345) {
    const size_t cls = CachingAllocator::size_class(bytes);
    EXPECT_GE(cls, bytes);
    EXPECT_LT(cls - bytes, 2 * mib);
    EXPECT_EQ(cls % (2 * mib), 0u);
  }
}

TEST(SizeClass, FewClassesPerPowerOfTwo) {
  std::set<size_t> classes;
  for (size_t bytes = (size_t{1} << 20) + 1; bytes <= (size_t{1} << 21); bytes += 997)
    classes.insert(CachingAllocator::size_class(bytes));
  EXPECT_EQ(classes.size(), 4u);
}

TEST(CachingAllocator, ReusesFreedBlocksOfTheSameClass) {
  FakeBackend::Counts counts;
  CachingAllocator alloc(std::make_unique<FakeBackend>(&counts, size_t{1} << 30));
  void* a = alloc.allocate(1000);
  void* b = alloc.allocate(100000);
  EXPECT_EQ(counts.mallocs, 2u);
  alloc.release(a);
  alloc.release(b);
  // A step that repeats the previous step's requests is served from the cache.
  void* a2 = alloc.allocate(1000);
  void* b2 = alloc.allocate(99000);  // same class as 100000
  EXPECT_EQ(a2, a);
  EXPECT_EQ(b2, b);
  EXPECT_EQ(counts.mallocs, 2u);
  const AllocatorStats s = alloc.stats();
  EXPECT_EQ(s.device_mallocs, 2u);
  EXPECT_EQ(s.cache_hits, 2u);
  EXPECT_EQ(s.bytes_in_use,
            CachingAllocator::size_class(1000) + CachingAllocator::size_class(100000));
  EXPECT_EQ(s.bytes_cached, 0u);
  // A different class is a new block.
  void* c = alloc.allocate(1 << 20);
  EXPECT_NE(c, a);
  EXPECT_EQ(counts.mallocs, 3u);
  alloc.release(a2);
  alloc.release(b2);
  alloc.release(c);
}

TEST(CachingAllocator, TracksBytesInUseCachedAndPeak) {
  FakeBackend::Counts counts;
  CachingAllocator alloc(std::make_unique<FakeBackend>(&counts, size_t{1} << 30));
  void* a = alloc.allocate(4096);
  void* b = alloc.allocate(4096);
  EXPECT_EQ(alloc.stats().bytes_in_use, 8192u);
  alloc.release(a);
  EXPECT_EQ(alloc.stats().bytes_in_use, 4096u);
  EXPECT_EQ(alloc.stats().bytes_cached, 4096u);
  EXPECT_EQ(alloc.stats().peak_bytes_in_use, 8192u);
  alloc.reset_peak();
  EXPECT_EQ(alloc.stats().peak_bytes_in_use, 4096u);
  alloc.release(b);
  alloc.empty_cache();
  EXPECT_EQ(alloc.stats().bytes_cached, 0u);
  EXPECT_EQ(alloc.stats().device_frees, 2u);
  EXPECT_EQ(counts.frees, 2u);
  EXPECT_EQ(counts.held, 0u);
}

TEST(CachingAllocator, OutOfMemoryEmptiesTheCacheAndRetries) {
  FakeBackend::Counts counts;
  CachingAllocator alloc(std::make_unique<FakeBackend>(&counts, 3 << 20));
  void* a = alloc.allocate(2 << 20);
  alloc.release(a);  // 2 MiB cached, 1 MiB left on the "device"
  void* b = alloc.allocate(3 << 19);  // 1.5 MiB: fails once, succeeds after emptying
  EXPECT_NE(b, nullptr);
  EXPECT_EQ(counts.failed, 1u);
  EXPECT_EQ(alloc.stats().bytes_cached, 0u);
  // Nothing left to free: the error names the request and the state.
  const std::string msg = error_message([&] { alloc.allocate(2 << 20); });
  EXPECT_TRUE(contains(msg, "out of device memory allocating 2097152 bytes")) << msg;
  EXPECT_TRUE(contains(msg, "1572864 bytes in use")) << msg;
  alloc.release(b);
}

TEST(CachingAllocator, RejectsForeignAndDoubleReleases) {
  FakeBackend::Counts counts;
  CachingAllocator alloc(std::make_unique<FakeBackend>(&counts, size_t{1} << 30));
  int local = 0;
  EXPECT_TRUE(contains(error_message([&] { alloc.release(&local); }), "did not hand out"));
  void* a = alloc.allocate(64);
  alloc.release(a);
  EXPECT_TRUE(contains(error_message([&] { alloc.release(a); }), "released twice"));
  alloc.release(nullptr);  // ignored
}

TEST(CachingAllocator, DestructorReturnsEverything) {
  FakeBackend::Counts counts;
  {
    CachingAllocator alloc(std::make_unique<FakeBackend>(&counts, size_t{1} << 30));
    alloc.release(alloc.allocate(1000));
    (void)alloc.allocate(5000);  // still handed out at destruction
  }
  EXPECT_EQ(counts.mallocs, 2u);
  EXPECT_EQ(counts.frees, 2u);
  EXPECT_EQ(counts.held, 0u);
}

TEST(CudaErrors, NameTheCallAndTheError) {
  // 2 = cudaErrorMemoryAllocation; 7 = CUBLAS_STATUS_INVALID_VALUE.
  const std::string m = cuda_error_message(2, "cudaMalloc(&p, 64)");
  EXPECT_TRUE(contains(m, "cudaMalloc(&p, 64) failed")) << m;
  EXPECT_TRUE(contains(m, "out of memory")) << m;
  EXPECT_TRUE(contains(m, "cudaErrorMemoryAllocation")) << m;
  const std::string b = cublas_error_message(7, "cublasGemmEx(h, ...)");
  EXPECT_TRUE(contains(b, "cublasGemmEx(h, ...) failed")) << b;
  EXPECT_TRUE(contains(b, "CUBLAS_STATUS_INVALID_VALUE")) << b;
}

TEST(Bf16, RoundsToNearestEven) {
  auto bits = [](float f) { return to_bf16(f).bits; };
  EXPECT_EQ(bits(1.0f), 0x3f80);
  EXPECT_EQ(bits(-2.0f), 0xc000);
  EXPECT_EQ(bits(1.0f + 0x01p-8f), 0x3f80);               // tie, rounds to even
  EXPECT_EQ(bits(1.0f + 3 * 0x01p-8f), 0x3f82);           // tie, rounds up to even
  EXPECT_EQ(bits(1.0f + 0x01p-8f + 0x01p-20f), 0x3f81);   // above the tie
  EXPECT_EQ(bits(std::numeric_limits<float>::max()), 0x7f80);       // overflows to inf
  EXPECT_EQ(bits(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(bits(std::nanf("")), 0x7fff);
  EXPECT_EQ(to_float(bf16{0x3f80}), 1.0f);
  EXPECT_EQ(to_float(to_bf16(3.140625f)), 3.140625f);  // representable: exact
}

TEST(MathMode, NamesRoundTrip) {
  for (MathMode m : {MathMode::FP32, MathMode::TF32, MathMode::BF16, MathMode::FP16})
    EXPECT_EQ(parse_math_mode(math_mode_name(m)), m);
  EXPECT_TRUE(contains(error_message([] { parse_math_mode("fp8"); }), "'fp8'"));
}

}  // namespace
}  // namespace weft::cuda
#endif  // WEFT_CUDA
