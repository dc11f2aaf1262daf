// GPU emulator (tests/cuda_emu): the CUDA runtime on the CPU, and the fibers
// that run a block's threads. See include/weft_emu_device.h.
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

#include "streams.h"

#include <boost/context/fiber.hpp>
#include <execinfo.h>
#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace weft_emu {

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "GPU emulator: %s\n", what);
  std::fflush(stderr);
  std::abort();
}

namespace {

constexpr int kWarp = 32;
constexpr size_t kStackBytes = size_t{128} << 10;

namespace bctx = boost::context;

// A fiber's stack: one of the block's, kept from launch to launch (Boost's
// own allocators would map and unmap one per GPU thread).
struct ReusedStack {
  char* base;
  bctx::stack_context allocate() {
    bctx::stack_context sc;
    sc.size = kStackBytes;
    sc.sp = base + kStackBytes;
    return sc;
  }
  void deallocate(bctx::stack_context&) noexcept {}
};

struct Fiber {
  bctx::fiber self;   // the GPU thread, suspended at a barrier (empty once it has returned)
  bctx::fiber sched;  // the scheduler, while the GPU thread runs
  ThreadState state;
  int warp = 0;
  unsigned shuffles = 0;  // how many this thread has made
  bool done = false;
  int waiting = 0;  // 0 running or runnable, 1 at the block barrier, 2 at its warp's
};

struct Barrier {
  int arrived = 0;
  int live = 0;
};

// One launch at a time per host thread (kernels run where they are launched).
struct Block {
  std::vector<Fiber> fibers;
  std::vector<char*> stacks;
  std::vector<Barrier> warps;
  struct Slot {
    uint64_t bits = 0;
    unsigned seq = 0;  // the writing lane's shuffle count
  };
  std::vector<Slot> slots;  // two banks of a shuffled value per thread
  Barrier block;
  const std::function<void()>* body = nullptr;
  Fiber* running = nullptr;
  ~Block() {
    for (char* s : stacks) std::free(s);
  }
};

thread_local Block t_block;

thread_local cudaError_t t_last_error = cudaSuccess;
thread_local int t_device = 0;
thread_local uint64_t t_launches = 0;
thread_local const ThreadState* t_state = nullptr;  // the running GPU thread's
thread_local bool t_direct = false;                 // threads run as plain calls
thread_local uint64_t t_waits = 0;                  // barriers and shuffles in this launch

bool always_fibers() {
  static const bool yes = [] {
    const char* v = std::getenv("WEFT_EMU_FIBERS");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return yes;
}

[[noreturn]] void fail_direct(const char* what) {
  std::fprintf(stderr,
               "GPU emulator: %s in a kernel whose earlier launch from the same place reached "
               "none; the emulator ran it without fibers and cannot stop a thread there "
               "(run with WEFT_EMU_FIBERS=1)\n",
               what);
  fail("barrier in a launch run without fibers");
}

void run_block_direct(dim3 grid, dim3 block, uint3 block_idx, bool reverse,
                      const std::function<void()>& body) {
  const unsigned n = block.x * block.y * block.z;
  ThreadState st{{0, 0, 0}, block_idx, block, grid};
  t_direct = true;
  for (unsigned k = 0; k < n; ++k) {
    const unsigned u = reverse ? n - 1 - k : k;
    st.thread_idx = {u % block.x, (u / block.x) % block.y, u / (block.x * block.y)};
    t_state = &st;
    body();
  }
  t_state = nullptr;
  t_direct = false;
}

// Lets the threads waiting at `bar` go on: the block's (kind 1) or warp
// `warp`'s (kind 2).
void release(Barrier& bar, int kind, int warp) {
  Block& b = t_block;
  bar.arrived = 0;
  const size_t n = b.fibers.size();
  const size_t first = kind == 1 ? 0 : static_cast<size_t>(warp) * kWarp;
  const size_t last = kind == 1 ? n : std::min(n, first + kWarp);
  for (size_t i = first; i < last; ++i) {
    Fiber& f = b.fibers[i];
    if (!f.done && f.waiting == kind) f.waiting = 0;
  }
}

void wait_at(Barrier& bar, int kind) {
  Block& b = t_block;
  Fiber& f = *b.running;
  f.waiting = kind;
  if (++bar.arrived == bar.live) release(bar, kind, f.warp);
  f.sched = std::move(f.sched).resume();
}

// The body of a GPU thread's fiber; returns to the scheduler for good.
bctx::fiber thread_main(bctx::fiber&& sched) {
  Block& b = t_block;
  b.running->sched = std::move(sched);
  (*b.body)();
  Fiber& f = *b.running;
  f.done = true;
  // A thread that returns no longer counts at its barriers; returning while
  // others wait at one is the barrier not every thread reaches.
  Barrier& warp = b.warps[static_cast<size_t>(f.warp)];
  if (b.block.arrived > 0) fail("a thread returned while others wait at __syncthreads");
  if (warp.arrived > 0) fail("a lane returned while others wait at a full-warp shuffle");
  --b.block.live;
  --warp.live;
  return std::move(f.sched);
}

// `reverse`: the threads run in descending order between barriers.
void run_block(dim3 grid, dim3 block, uint3 block_idx, bool reverse,
               const std::function<void()>& body) {
  Block& b = t_block;
  const int n = static_cast<int>(block.x * block.y * block.z);
  const int warps = (n + kWarp - 1) / kWarp;
  while (static_cast<int>(b.stacks.size()) < n) {
    char* s = static_cast<char*>(std::malloc(kStackBytes));
    if (s == nullptr) fail("out of host memory for fiber stacks");
    b.stacks.push_back(s);
  }
  b.fibers.clear();
  b.fibers.resize(static_cast<size_t>(n));
  b.warps.assign(static_cast<size_t>(warps), Barrier{});
  b.slots.assign(2 * static_cast<size_t>(n), Block::Slot{});
  b.block = Barrier{0, n};
  b.body = &body;
  for (int w = 0; w < warps; ++w) b.warps[static_cast<size_t>(w)].live = std::min(kWarp, n - w * kWarp);
  for (int i = 0; i < n; ++i) {
    Fiber& f = b.fibers[static_cast<size_t>(i)];
    const unsigned u = static_cast<unsigned>(i);
    f.state.thread_idx = {u % block.x, (u / block.x) % block.y, u / (block.x * block.y)};
    f.state.block_idx = block_idx;
    f.state.block_dim = block;
    f.state.grid_dim = grid;
    f.warp = i / kWarp;
    f.self = bctx::fiber(std::allocator_arg, ReusedStack{b.stacks[static_cast<size_t>(i)]},
                         thread_main);
  }
  int left = n;
  while (left > 0) {
    bool progressed = false;
    for (int k = 0; k < n; ++k) {
      Fiber& f = b.fibers[static_cast<size_t>(reverse ? n - 1 - k : k)];
      if (f.done || f.waiting != 0) continue;
      b.running = &f;
      t_state = &f.state;
      f.self = std::move(f.self).resume();
      b.running = nullptr;
      t_state = nullptr;
      progressed = true;
      if (f.done) --left;
    }
    if (!progressed && left > 0) {
      int at_block = 0, at_warp = 0;
      for (const Fiber& f : b.fibers) {
        if (f.done) continue;
        (f.waiting == 1 ? at_block : at_warp)++;
      }
      std::fprintf(stderr,
                   "GPU emulator: block (%u, %u, %u) of a %u-thread launch cannot go on: %d "
                   "threads wait at __syncthreads, %d at a warp shuffle, %d have returned "
                   "(a barrier not every thread reaches: a hang on a GPU)\n",
                   block_idx.x, block_idx.y, block_idx.z, static_cast<unsigned>(n), at_block,
                   at_warp, n - at_block - at_warp);
      fail("deadlock");
    }
  }
}

}  // namespace

const ThreadState& current() {
  if (t_state == nullptr) fail("a kernel built-in (threadIdx...) read outside a kernel");
  return *t_state;
}

int lane_id() {
  Block& b = t_block;
  return static_cast<int>(b.running - b.fibers.data()) % kWarp;
}

// CUDA allows __syncthreads only where every thread of the block reaches
// it, and a full-warp shuffle only where every lane of the warp does.
void sync_block() {
  if (t_direct) fail_direct("__syncthreads");
  ++t_waits;
  Block& b = t_block;
  if (b.block.live != static_cast<int>(b.fibers.size()))
    fail("__syncthreads after some threads of the block have returned");
  wait_at(b.block, 1);
}

// Two banks of slots, used by alternate shuffles: a lane writes its value,
// waits for its warp, and reads the source lane's. A lane can write the bank
// again only two shuffles on, past a barrier every lane reaches after its
// read, so one barrier a shuffle is enough. Each slot also holds which
// shuffle of its lane wrote it: a source lane that returned before this
// shuffle left an older one there.
uint64_t shuffle(uint64_t bits, int src_lane) {
  if (t_direct) fail_direct("a warp shuffle");
  ++t_waits;
  Block& b = t_block;
  Fiber& f = *b.running;
  const size_t n = b.fibers.size();
  const int tid = static_cast<int>(&f - b.fibers.data());
  Barrier& warp = b.warps[static_cast<size_t>(f.warp)];
  if (warp.live != std::min<int>(kWarp, static_cast<int>(n) - f.warp * kWarp))
    fail("a full-warp shuffle after some lanes of the warp have returned");
  const unsigned seq = ++f.shuffles;
  const size_t bank = (seq & 1u) * n;
  b.slots[bank + static_cast<size_t>(tid)] = {bits, seq};
  wait_at(warp, 2);  // every lane has written
  const int src = tid - tid % kWarp + src_lane;
  if (src_lane < 0 || src_lane >= kWarp || src >= static_cast<int>(n) ||
      b.slots[bank + static_cast<size_t>(src)].seq != seq)
    fail("a full-warp shuffle reads a lane that does not exist or has returned");
  return b.slots[bank + static_cast<size_t>(src)].bits;
}

float atomic_add(float* p, float v) {
  const float old = *p;
  *p = old + v;
  return old;
}

namespace {

void execute_grid(dim3 grid, dim3 block, SiteMode& site, const std::function<void()>& body);

}  // namespace

void run_grid(dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream, SiteMode& site,
              std::function<void()> body) {
  if (t_state != nullptr) fail("a kernel launched from inside a kernel");
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  const bool ok = grid.x >= 1 && grid.y >= 1 && grid.z >= 1 && grid.x <= 0x7fffffffu &&
                  grid.y <= 65535 && grid.z <= 65535 && block.x >= 1 && block.y >= 1 &&
                  block.z >= 1 && block.x <= 1024 && block.y <= 1024 && block.z <= 64 &&
                  threads <= 1024 && shared_bytes <= 48 * 1024;
  if (!ok) {
    t_last_error = cudaErrorInvalidConfiguration;
    return;
  }
  if (!count(Work::kernel)) return;
  enqueue(stream, [grid, block, &site, body = std::move(body)] {
    execute_grid(grid, block, site, body);
  });
}

namespace {

void execute_grid(dim3 grid, dim3 block, SiteMode& site, const std::function<void()>& body) {
  // Every other launch runs its blocks, and each block's threads between
  // barriers, in the reverse order: a kernel whose result depends on the
  // order (a missing barrier, a block reading another's output) then gives
  // a different answer on one of two calls.
  const bool reverse = (t_launches++ % 2) == 1;
  const bool direct = site.load() == 1 && !always_fibers();
  t_waits = 0;
  const uint64_t blocks = uint64_t{grid.x} * grid.y * grid.z;
  for (uint64_t k = 0; k < blocks; ++k) {
    const uint64_t i = reverse ? blocks - 1 - k : k;
    const uint3 at{static_cast<unsigned>(i % grid.x), static_cast<unsigned>(i / grid.x % grid.y),
                   static_cast<unsigned>(i / (uint64_t{grid.x} * grid.y))};
    if (direct)
      run_block_direct(grid, block, at, reverse, body);
    else
      run_block(grid, block, at, reverse, body);
  }
  if (!direct && t_waits == 0) site.store(1);
}

}  // namespace

// ------------------------------------------------------------ streams

namespace {

bool sync_streams() {
  static const bool yes = [] {
    const char* v = std::getenv("WEFT_EMU_SYNC_STREAMS");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return yes;
}

struct Item {
  std::function<bool()> work;  // true once done
  std::string what;            // what a hang report names ("" for plain work)
};

struct Stream {
  std::deque<Item> queue;
  uint64_t queued = 0;  // items ever queued
  uint64_t done = 0;    // items run, in order: the first `done` of them
  bool running = false;
};

// One lock for every stream: work runs in whichever host thread needs it,
// and may need another stream's (a wait for an event), hence recursive.
std::recursive_mutex& streams_mu() {
  static auto* mu = new std::recursive_mutex;
  return *mu;
}
std::map<cudaStream_t, std::unique_ptr<Stream>>& streams() {
  static auto* s = new std::map<cudaStream_t, std::unique_ptr<Stream>>;
  return *s;
}

bool legacy(cudaStream_t s) { return s == nullptr; }

// cudaStreamPerThread: each host thread's own stream (blocking, but not
// synchronous with the other streams, as CUDA's per-thread default stream).
thread_local char t_per_thread_stream;
cudaStream_t resolve(cudaStream_t s) {
  return s == cudaStreamPerThread ? reinterpret_cast<cudaStream_t>(&t_per_thread_stream) : s;
}

Stream& stream_of(cudaStream_t s) {
  std::unique_ptr<Stream>& p = streams()[s];
  if (!p) p = std::make_unique<Stream>();
  return *p;
}

thread_local int t_in_work = 0;  // > 0 while this thread runs queued work

// Runs `s`'s work up to its `upto`-th item, stopping at work that is not
// ready; returns whether `upto` was reached. Called with streams_mu() held.
bool drain(cudaStream_t s, uint64_t upto) {
  Stream& st = stream_of(s);
  if (st.done >= upto) return true;
  if (st.running)
    fail("streams wait for each other's later work in a cycle (a hang on a GPU)");
  while (st.done < upto && !st.queue.empty()) {
    st.running = true;
    ++t_in_work;
    const bool ran = st.queue.front().work();
    --t_in_work;
    st.running = false;
    if (!ran) return false;
    st.queue.pop_front();
    ++st.done;
  }
  return st.done >= upto;
}

// Every stream as far as it goes without waiting, pass after pass while a
// pass runs something (one stream's progress may let another's wait end).
bool progress_locked() {
  bool any = false;
  for (;;) {
    bool ran = false;
    for (auto& [s, st] : streams()) {
      const uint64_t before = st->done;
      if (!st->running) drain(s, st->queued);
      ran = ran || st->done != before;
    }
    if (!ran) return any;
    any = true;
  }
}

double hang_seconds() {
  static const double secs = [] {
    const char* v = std::getenv("WEFT_EMU_HANG_SECONDS");
    if (v == nullptr) return 300.0;
    char* end = nullptr;
    const double d = std::strtod(v, &end);
    if (end == v || *end != '\0' || !(d > 0)) {
      std::fprintf(stderr, "GPU emulator: WEFT_EMU_HANG_SECONDS='%s' must be a positive number\n", v);
      std::exit(2);
    }
    return d;
  }();
  return secs;
}

std::string stuck_streams() {
  std::string stuck;
  for (auto& [s, st] : streams()) {
    if (st->queue.empty()) continue;
    const std::string& what = st->queue.front().what;
    char line[160];
    std::snprintf(line, sizeof line, "\n  stream %p: %zu item(s) queued, the first ", static_cast<void*>(s),
                  st->queue.size());
    stuck += line;
    stuck += what.empty() ? std::string("waits for another stream") : "waits for " + what;
  }
  return stuck;
}

[[noreturn]] void report_hang(double secs) {
  const std::string stuck = stuck_streams();
  std::fprintf(stderr,
               "GPU emulator: a host wait for the device made no progress for %.0f s "
               "(WEFT_EMU_HANG_SECONDS): a hang on a GPU.%s\n",
               secs, stuck.c_str());
  fail("hang");
}

// Polls `reached` (called with streams_mu() held) until it holds, making
// every stream progress meanwhile, the lock released between polls so that
// other threads can queue work and messages can arrive.
void wait_until(const std::function<bool()>& reached) {
  if (t_in_work > 0) fail("a blocking wait inside queued work");
  std::unique_lock<std::recursive_mutex> lock(streams_mu());
  if (reached()) return;
  const auto start = std::chrono::steady_clock::now();
  auto pause = std::chrono::microseconds(20);
  for (;;) {
    progress_locked();
    if (reached()) return;
    lock.unlock();
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
    lock.lock();
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (waited > hang_seconds()) report_hang(waited);
  }
}

bool all_empty() {
  for (auto& [s, st] : streams())
    if (!st->queue.empty()) return false;
  return true;
}

}  // namespace

void drain_all() {
  wait_until([] {
    progress_locked();
    return all_empty();
  });
}

bool progress_all() {
  std::lock_guard<std::recursive_mutex> lock(streams_mu());
  return progress_locked();
}

std::string describe_queued() {
  std::lock_guard<std::recursive_mutex> lock(streams_mu());
  return stuck_streams();
}

namespace {

EventMark queue_item(cudaStream_t stream, Item item) {
  stream = resolve(stream);
  if (legacy(stream) || sync_streams()) {
    drain_all();
    if (!item.work()) wait_until([&] { return item.work(); });
    return {};
  }
  std::lock_guard<std::recursive_mutex> lock(streams_mu());
  Stream& st = stream_of(stream);
  st.queue.push_back(std::move(item));
  return {stream, ++st.queued};
}

}  // namespace

EventMark enqueue(cudaStream_t stream, std::function<void()> work) {
  return queue_item(stream, {[work = std::move(work)] {
                               work();
                               return true;
                             },
                             std::string()});
}

EventMark enqueue_try(cudaStream_t stream, std::function<bool()> work, std::string what) {
  return queue_item(stream, {std::move(work), std::move(what)});
}

bool host_only() {
  static const bool yes = [] {
    const char* v = std::getenv("WEFT_EMU_HOST_ONLY");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return yes;
}

namespace {
std::atomic<uint64_t> g_work[static_cast<int>(Work::kinds)];
// Host syncs and queries count per host thread: a range reports those of
// the thread that opened it (a step's), not a watchdog's polls.
thread_local uint64_t t_host_work[static_cast<int>(Work::kinds)];
bool per_thread(Work w) { return w == Work::host_sync || w == Work::event_query; }
}  // namespace

// WEFT_EMU_BACKTRACE_WAITS=1: a backtrace on stderr for each host sync
// (and, =2, each event query too) inside a profiled range, to find where a
// step waits for its device (addr2line -f -C -e BINARY turns the addresses
// into functions).
int backtrace_waits() {
  static const int level = [] {
    const char* v = std::getenv("WEFT_EMU_BACKTRACE_WAITS");
    return v == nullptr ? 0 : std::atoi(v);
  }();
  return level;
}
thread_local bool t_in_range = false;

bool count(Work w) {
  if (t_in_range && ((w == Work::host_sync && backtrace_waits() >= 1) ||
                     (w == Work::event_query && backtrace_waits() >= 2))) {
    void* frames[24];
    const int n = backtrace(frames, 24);
    std::fprintf(stderr, "GPU emulator: %s at\n", w == Work::host_sync ? "host sync" : "event query");
    backtrace_symbols_fd(frames, n, 2);
  }
  if (per_thread(w))
    ++t_host_work[static_cast<int>(w)];
  else
    g_work[static_cast<int>(w)].fetch_add(1, std::memory_order_relaxed);
  return w == Work::host_copy || w == Work::host_sync || w == Work::event_query || !host_only();
}

std::unique_lock<std::recursive_mutex> lock_streams() {
  return std::unique_lock<std::recursive_mutex>(streams_mu());
}

void drain_stream(cudaStream_t s) {
  s = resolve(s);
  wait_until([s] { return drain(s, stream_of(s).queued); });
}

void drain_to(const EventMark& m) {
  if (m.upto == 0) return;
  const cudaStream_t s = resolve(m.stream);
  wait_until([s, m] { return drain(s, m.upto); });
}

bool try_drain_to(const EventMark& m) {
  if (m.upto == 0) return true;
  std::lock_guard<std::recursive_mutex> lock(streams_mu());
  return drain(resolve(m.stream), m.upto);
}

}  // namespace weft_emu

float __fsqrt_rn(float a) { return std::sqrt(a); }
float rsqrtf(float a) { return 1.0f / std::sqrt(a); }

// --- the runtime API ---

namespace {

// How many devices there are: WEFT_EMU_DEVICES, default 1 (so that ranks
// started together share one GPU unless a test asks for more).
int device_count() {
  static const int n = [] {
    const char* v = std::getenv("WEFT_EMU_DEVICES");
    if (v == nullptr) return 1;
    char* end = nullptr;
    const long d = std::strtol(v, &end, 10);
    if (end == v || *end != '\0' || d < 1 || d > 64) {
      std::fprintf(stderr, "GPU emulator: WEFT_EMU_DEVICES='%s' must be a whole number from 1 to 64\n", v);
      std::exit(2);
    }
    return static_cast<int>(d);
  }();
  return n;
}

struct Allocation {
  size_t bytes;
  int device;
};
struct Allocations {
  std::mutex mu;
  std::unordered_map<void*, Allocation> live;
  size_t bytes[64] = {};  // per device
};
Allocations& allocations() {
  static Allocations* a = new Allocations;  // outlives static destructors that free
  return *a;
}

// Device memory each emulated GPU has: WEFT_EMU_DEVICE_MIB, default 8 GiB.
size_t device_bytes() {
  static const size_t bytes = [] {
    const char* v = std::getenv("WEFT_EMU_DEVICE_MIB");
    if (v == nullptr) return size_t{8192} << 20;
    char* end = nullptr;
    const unsigned long long mib = std::strtoull(v, &end, 10);
    if (end == v || *end != '\0' || mib == 0 || mib > (size_t{1} << 40)) {
      std::fprintf(stderr,
                   "GPU emulator: WEFT_EMU_DEVICE_MIB='%s' must be a whole number of MiB "
                   "from 1 to 2^40\n", v);
      std::exit(2);
    }
    return static_cast<size_t>(mib) << 20;
  }();
  return bytes;
}

// An event: its last record's place in its stream, and the time that
// record ran (shared with the queued record, which may outlive the handle:
// CUDA lets an event be destroyed while its record is pending).
struct EventState {
  weft_emu::EventMark mark;
  uint64_t records = 0;  // records made; a queued record older than the last does nothing
  bool reached = false;
  std::chrono::steady_clock::time_point at{};
};
struct Event {
  std::shared_ptr<EventState> state = std::make_shared<EventState>();
};

// Page-locked host allocations (cudaMallocHost): copies to and from them
// are queued; copies to and from other host memory are synchronous.
struct Pinned {
  std::mutex mu;
  std::map<const char*, size_t> live;
};
Pinned& pinned() {
  static auto* p = new Pinned;
  return *p;
}
bool is_pinned(const void* p) {
  Pinned& pn = pinned();
  std::lock_guard<std::mutex> lock(pn.mu);
  const char* c = static_cast<const char*>(p);
  auto it = pn.live.upper_bound(c);
  if (it == pn.live.begin()) return false;
  --it;
  return c < it->first + it->second;
}

cudaError_t set(cudaError_t e) {
  if (e != cudaSuccess) weft_emu::t_last_error = e;
  return e;
}

}  // namespace

cudaError_t cudaGetDeviceCount(int* count) {
  *count = device_count();
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= device_count()) return set(cudaErrorInvalidDevice);
  weft_emu::t_device = device;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  *device = weft_emu::t_device;
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize() {
  weft_emu::count(weft_emu::Work::host_sync);
  weft_emu::drain_all();
  return cudaSuccess;
}
cudaError_t cudaGetLastError() {
  const cudaError_t e = weft_emu::t_last_error;
  weft_emu::t_last_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError() { return weft_emu::t_last_error; }

const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInitializationError: return "cudaErrorInitializationError";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
  }
  return "cudaErrorUnknown";
}
const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInitializationError: return "initialization error";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
  }
  return "unknown error";
}

cudaError_t cudaMalloc(void** p, size_t bytes) {
  *p = nullptr;
  Allocations& a = allocations();
  std::lock_guard<std::mutex> lock(a.mu);
  const int device = weft_emu::t_device;
  size_t& used = a.bytes[device];
  if (bytes > device_bytes() - used) return set(cudaErrorMemoryAllocation);
  const size_t rounded = (std::max<size_t>(bytes, 1) + 255) / 256 * 256;
  void* q = nullptr;
  if (weft_emu::host_only()) {
    // Pages nothing may touch but uploads: reserve no host memory for them,
    // so that a device larger than the host's memory can be asked for.
    q = mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
             -1, 0);
    if (q == MAP_FAILED) q = nullptr;
  } else {
    q = std::aligned_alloc(256, rounded);
  }
  if (q == nullptr) return set(cudaErrorMemoryAllocation);
  a.live[q] = {bytes, device};
  used += bytes;
  *p = q;
  return cudaSuccess;
}
cudaError_t cudaFree(void* p) {
  if (p == nullptr) return cudaSuccess;
  weft_emu::count(weft_emu::Work::host_sync);
  weft_emu::drain_all();  // cudaFree waits for the device
  Allocations& a = allocations();
  std::lock_guard<std::mutex> lock(a.mu);
  const auto it = a.live.find(p);
  if (it == a.live.end()) return set(cudaErrorInvalidValue);
  a.bytes[it->second.device] -= it->second.bytes;
  if (weft_emu::host_only())
    munmap(p, (std::max<size_t>(it->second.bytes, 1) + 255) / 256 * 256);
  else
    std::free(p);
  a.live.erase(it);
  return cudaSuccess;
}
cudaError_t cudaMallocHost(void** p, size_t bytes) {
  *p = std::malloc(std::max<size_t>(bytes, 1));
  if (*p == nullptr) return set(cudaErrorMemoryAllocation);
  Pinned& pn = pinned();
  std::lock_guard<std::mutex> lock(pn.mu);
  pn.live[static_cast<const char*>(*p)] = std::max<size_t>(bytes, 1);
  return cudaSuccess;
}
cudaError_t cudaFreeHost(void* p) {
  if (p == nullptr) return cudaSuccess;
  weft_emu::count(weft_emu::Work::host_sync);
  weft_emu::drain_all();  // as cudaFree, it waits for the device
  {
    Pinned& pn = pinned();
    std::lock_guard<std::mutex> lock(pn.mu);
    if (pn.live.erase(static_cast<const char*>(p)) == 0) return set(cudaErrorInvalidValue);
  }
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  weft_emu::count(weft_emu::Work::host_sync);
  weft_emu::drain_all();  // the legacy default stream waits for blocking streams
  if (!weft_emu::count(kind == cudaMemcpyDeviceToDevice ? weft_emu::Work::device_copy
                                                         : weft_emu::Work::host_copy))
    return cudaSuccess;
  if (bytes > 0) std::memmove(dst, src, bytes);
  return cudaSuccess;
}
// A copy from pageable host memory takes its bytes at the call; one to
// pageable host memory is done when the call returns; one between device
// memory and page-locked host memory is queued.
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  if (bytes == 0) return cudaSuccess;
  const bool from_host = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyHostToHost;
  const bool to_host = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyHostToHost;
  if (!weft_emu::count(from_host || to_host ? weft_emu::Work::host_copy
                                            : weft_emu::Work::device_copy))
    return cudaSuccess;
  if (to_host && !is_pinned(dst)) {
    weft_emu::count(weft_emu::Work::host_sync);
    weft_emu::drain_all();
    std::memmove(dst, src, bytes);
    return cudaSuccess;
  }
  if (from_host && !is_pinned(src)) {
    auto copy = std::make_shared<std::vector<char>>(static_cast<const char*>(src),
                                                    static_cast<const char*>(src) + bytes);
    weft_emu::enqueue(stream, [dst, copy] { std::memcpy(dst, copy->data(), copy->size()); });
    return cudaSuccess;
  }
  weft_emu::enqueue(stream, [dst, src, bytes] { std::memmove(dst, src, bytes); });
  return cudaSuccess;
}
cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch,
                              size_t width, size_t height, cudaMemcpyKind kind,
                              cudaStream_t stream) {
  if (width > dpitch || width > spitch) return set(cudaErrorInvalidValue);
  if (kind != cudaMemcpyDeviceToDevice)
    weft_emu::fail("cudaMemcpy2DAsync other than device to device is not emulated");
  if (!weft_emu::count(weft_emu::Work::device_copy)) return cudaSuccess;
  weft_emu::enqueue(stream, [=] {
    for (size_t r = 0; r < height; ++r)
      std::memmove(static_cast<char*>(dst) + r * dpitch,
                   static_cast<const char*>(src) + r * spitch, width);
  });
  return cudaSuccess;
}
cudaError_t cudaMemset(void* p, int value, size_t bytes) {
  weft_emu::count(weft_emu::Work::host_sync);
  weft_emu::drain_all();
  if (!weft_emu::count(weft_emu::Work::memset)) return cudaSuccess;
  if (bytes > 0) std::memset(p, value, bytes);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t stream) {
  if (!weft_emu::count(weft_emu::Work::memset)) return cudaSuccess;
  if (bytes > 0) weft_emu::enqueue(stream, [=] { std::memset(p, value, bytes); });
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  return cudaStreamCreateWithFlags(stream, cudaStreamDefault);
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int) {
  // A distinct address per stream; nothing is kept there.
  *stream = reinterpret_cast<cudaStream_t>(new char);
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  // CUDA lets the queued work finish; here it runs now. The address is kept
  // (never reused for another stream) so that waits recorded against it stay valid.
  weft_emu::drain_stream(stream);
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  weft_emu::count(weft_emu::Work::host_sync);
  if (stream == nullptr)
    weft_emu::drain_all();
  else
    weft_emu::drain_stream(stream);
  return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int) {
  if (event == nullptr) return set(cudaErrorInvalidResourceHandle);
  // What the event's last record is, now: later records do not change the wait.
  auto lock = weft_emu::lock_streams();
  const weft_emu::EventMark m = reinterpret_cast<Event*>(event)->state->mark;
  weft_emu::enqueue_try(stream, [m] { return weft_emu::try_drain_to(m); }, std::string());
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) {
  return cudaEventCreateWithFlags(event, cudaEventDefault);
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int) {
  *event = reinterpret_cast<cudaEvent_t>(new Event);
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t event) {
  delete reinterpret_cast<Event*>(event);
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  if (event == nullptr) return set(cudaErrorInvalidResourceHandle);
  auto lock = weft_emu::lock_streams();  // the queued record reads the state where it runs
  std::shared_ptr<EventState> st = reinterpret_cast<Event*>(event)->state;
  const uint64_t record = ++st->records;
  st->reached = false;
  auto reach = [st, record] {
    if (st->records != record) return;  // recorded again since
    st->reached = true;
    st->at = std::chrono::steady_clock::now();
  };
  st->mark = weft_emu::enqueue(stream, reach);
  return cudaSuccess;
}
namespace {
// Where the event's last record is in its stream, read under the streams' lock.
weft_emu::EventMark last_record(cudaEvent_t event) {
  auto lock = weft_emu::lock_streams();
  return reinterpret_cast<Event*>(event)->state->mark;
}
}  // namespace

// The emulated GPU is instant when asked: a query runs the work before the
// record and answers that it is done, unless some of it is not ready (a
// receive whose message has not come). Work nobody asks about stays queued.
cudaError_t cudaEventQuery(cudaEvent_t event) {
  if (event == nullptr) return set(cudaErrorInvalidResourceHandle);
  weft_emu::count(weft_emu::Work::event_query);
  const weft_emu::EventMark m = last_record(event);
  if (weft_emu::try_drain_to(m)) return cudaSuccess;
  weft_emu::progress_all();  // as a GPU's other streams go on meanwhile
  return weft_emu::try_drain_to(m) ? cudaSuccess : cudaErrorNotReady;
}
cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  if (event == nullptr) return set(cudaErrorInvalidResourceHandle);
  weft_emu::count(weft_emu::Work::host_sync);
  weft_emu::drain_to(last_record(event));
  return cudaSuccess;
}
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  auto lock = weft_emu::lock_streams();
  const EventState& a = *reinterpret_cast<const Event*>(start)->state;
  const EventState& b = *reinterpret_cast<const Event*>(end)->state;
  if (a.records == 0 || b.records == 0) return set(cudaErrorInvalidResourceHandle);
  if (!a.reached || !b.reached) return set(cudaErrorNotReady);
  *ms = std::chrono::duration<float, std::milli>(b.at - a.at).count();
  return cudaSuccess;
}

// The profiler's range: what the host asked of the device between the two
// calls, and the host's time, printed at the stop (bench_cuda
// --kernel-profile opens it around one step).
namespace {
struct Range {
  uint64_t work[static_cast<int>(weft_emu::Work::kinds)] = {};
  std::chrono::steady_clock::time_point start{};
  bool open = false;
};
Range& range() {
  static Range r;
  return r;
}
void read_work(uint64_t* out) {
  for (int i = 0; i < static_cast<int>(weft_emu::Work::kinds); ++i)
    out[i] = weft_emu::per_thread(static_cast<weft_emu::Work>(i))
                 ? weft_emu::t_host_work[i]
                 : weft_emu::g_work[i].load(std::memory_order_relaxed);
}
}  // namespace

cudaError_t cudaProfilerStart() {
  Range& r = range();
  read_work(r.work);
  r.open = true;
  weft_emu::t_in_range = true;
  r.start = std::chrono::steady_clock::now();
  return cudaSuccess;
}
cudaError_t cudaProfilerStop() {
  Range& r = range();
  if (!r.open) return cudaSuccess;
  r.open = false;
  weft_emu::t_in_range = false;
  weft_emu::drain_all();
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - r.start).count();
  uint64_t now[static_cast<int>(weft_emu::Work::kinds)];
  read_work(now);
  auto d = [&](weft_emu::Work w) { return now[static_cast<int>(w)] - r.work[static_cast<int>(w)]; };
  std::fprintf(stderr,
               "GPU emulator: the profiled range%s: %llu kernel launches, %llu GEMMs, %llu memsets, "
               "%llu device-to-device copies, %llu copies to or from the host; this host thread "
               "waited for the device %llu times and asked it %llu times; %.1f ms of host "
               "time\n",
               weft_emu::host_only() ? " (WEFT_EMU_HOST_ONLY: nothing ran on the device)" : "",
               static_cast<unsigned long long>(d(weft_emu::Work::kernel)),
               static_cast<unsigned long long>(d(weft_emu::Work::gemm)),
               static_cast<unsigned long long>(d(weft_emu::Work::memset)),
               static_cast<unsigned long long>(d(weft_emu::Work::device_copy)),
               static_cast<unsigned long long>(d(weft_emu::Work::host_copy)),
               static_cast<unsigned long long>(d(weft_emu::Work::host_sync)),
               static_cast<unsigned long long>(d(weft_emu::Work::event_query)), ms);
  return cudaSuccess;
}
