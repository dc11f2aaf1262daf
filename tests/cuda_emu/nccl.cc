// GPU emulator (tests/cuda_emu): NCCL across processes, as users run it (one
// rank per process under mpiexec), and across the ranks of one process.
// Written for weft from NCCL's documented behaviour; no NVIDIA code.
//
// Transport. Each process that takes part in a communicator of more than
// one rank listens on a Unix socket in Linux's abstract namespace
// ("weft-emu-nccl-<pid>", nothing on disk); a thread reads every message
// that arrives into a mailbox, so that a sender never waits for its peer's
// host. A unique id names its creator's process, which is the bootstrap
// root: every rank sends it a hello (rank, PID, host identity, device), and
// once all have come it sends every rank the table of all. Until then the
// communicator's state is ncclInProgress. Two ranks on one device of one
// host fail it, as NCCL fails "Duplicate GPU detected"; the host identity is
// NCCL_HOSTID where that is set (so that distinct values per rank make
// ranks on one GPU distinct "hosts", as with NCCL) and the host name
// otherwise.
//
// Operations are queued on their stream (streams.h) and run in stream order,
// like a kernel. A collective sends this rank's part to every rank and is
// done when every rank's part has come; the ranks' parts are reduced in rank
// order (bf16 rounded after each addition), so every rank gets the same
// bits. Each part carries what the collective was (kind, type, count,
// operator, root): ranks that call collectives in different orders or with
// different counts stop the program with both descriptions (a hang or
// garbage on a GPU). Sends and receives of one group are one piece of work:
// it posts its sends' payloads and a clear-to-send for each receive, and is
// done once each receive's payload and each send's clear-to-send have come.
// So a group completes only when each peer has reached the group that
// matches it (NCCL's rendezvous: a send completes once its receive is
// posted), and a send that no receive ever matches hangs, as on a GPU.
// Between two ranks, messages match in the order they were posted; a
// receive whose count differs from its send's prints a warning and fails
// the communicator (ncclInvalidUsage from ncclCommGetAsyncError).
//
// Errors. ncclCommAbort tells the peers, whose communicators then report
// ncclRemoteError from ncclCommGetAsyncError, as does a peer's process that
// went away while something waits for it; the aborted or failed
// communicator's queued work completes without effect, as a GPU's kernels
// end when NCCL aborts them. A communicator of one rank needs no socket.
//
// With peers in other processes, a thread runs every stream's work as far
// as it can every millisecond, as a GPU would (a peer may be waiting for
// this process's sends while its host waits elsewhere); without such a peer
// the streams stay lazy (streams.h).
#include <cuda_bf16.h>
#include <nccl.h>

#include "streams.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace {

// ------------------------------------------------------------ messages

enum class Type : uint32_t { hello = 1, table, p2p, cts, coll, split, abort };

// What a collective is; equal on every rank that calls the same one.
struct CollDesc {
  int32_t kind = 0;  // 1 all_reduce, 2 reduce_scatter, 3 all_gather, 4 broadcast
  int32_t dtype = 0;
  int32_t op = 0;
  int32_t root = 0;
  uint64_t count = 0;
  bool operator==(const CollDesc&) const = default;
};

struct Header {
  Type type = Type::hello;
  int32_t src = -1;  // the sender's rank in the communicator (-1 for bootstrap)
  uint64_t comm = 0;
  uint64_t seq = 0;
  uint64_t bytes = 0;  // the payload's
  CollDesc desc;       // coll: what it is; hello: rank (root), nranks (count), device (op)
  int32_t pid = 0;     // hello: the sender's process
  uint64_t host = 0;   // hello: the sender's host identity
};

struct Message {
  Header h;
  std::vector<char> payload;
};

// Where a message waits: (communicator, type, source rank, sequence).
using Key = std::tuple<uint64_t, Type, int32_t, uint64_t>;

// WEFT_EMU_NCCL_TRACE=1: a line on stderr as each queued NCCL operation
// starts and ends (for finding which peer a hang waits for).
bool tracing() {
  static const bool yes = [] {
    const char* v = std::getenv("WEFT_EMU_NCCL_TRACE");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return yes;
}
void trace(const char* event, const std::string& what) {
  if (tracing()) std::fprintf(stderr, "[nccl emu pid %d] %s: %s\n", static_cast<int>(getpid()), event, what.c_str());
}

uint64_t mix(uint64_t a, uint64_t b) {
  uint64_t x = a ^ (b + 0x9e3779b97f4a7c15ull + (a << 6) + (a >> 2));
  x ^= x >> 31;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 29;
  return x;
}

uint64_t hash_string(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

// This process's host identity, as NCCL takes it: NCCL_HOSTID, else the
// host name.
uint64_t host_identity() {
  if (const char* id = std::getenv("NCCL_HOSTID"); id != nullptr && *id != 0)
    return hash_string(std::string("id:") + id);
  char name[256] = {};
  gethostname(name, sizeof name - 1);
  return hash_string(std::string("host:") + name);
}

std::string socket_name(int pid) { return "weft-emu-nccl-" + std::to_string(pid); }

sockaddr_un address(int pid, socklen_t* len) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  const std::string name = socket_name(pid);
  std::memcpy(a.sun_path + 1, name.data(), name.size());  // abstract: leading NUL
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return a;
}

// Reads (or writes) all `n` bytes; false when the peer has gone.
bool transfer(int fd, void* p, size_t n, bool write) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    const ssize_t r = write ? ::send(fd, c, n, MSG_NOSIGNAL) : ::read(fd, c, n);
    if (r == 0 && !write) return false;
    if (r < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    c += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}
bool read_all(int fd, void* p, size_t n) { return transfer(fd, p, n, false); }
bool write_all(int fd, const void* p, size_t n) {
  return transfer(fd, const_cast<void*>(p), n, true);
}

// The process's post office: its listening socket, the thread that reads
// what arrives into the mailbox, the connections to other processes, and
// the bootstrap root's tables.
class Post {
 public:
  static Post& get() {
    static Post* p = new Post;  // never destroyed: its thread runs to the end
    return *p;
  }

  const int pid = static_cast<int>(getpid());

  // Sends a message to process `to` (this one: straight into the mailbox).
  void send(int to, const Header& h, const void* payload) {
    if (to == pid) {
      Message m{h, {}};
      if (h.bytes > 0) m.payload.assign(static_cast<const char*>(payload),
                                        static_cast<const char*>(payload) + h.bytes);
      deliver(std::move(m));
      return;
    }
    Link& l = link(to);
    std::lock_guard<std::mutex> lock(l.mu);
    if (l.fd < 0) return;  // gone: what waits for it will see that
    if (!write_all(l.fd, &h, sizeof h) || (h.bytes > 0 && !write_all(l.fd, payload, h.bytes))) {
      ::close(l.fd);
      l.fd = -1;
    }
  }

  // Takes the first message waiting under `key`.
  bool take(const Key& key, Message* out) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = box_.find(key);
    if (it == box_.end() || it->second.empty()) return false;
    *out = std::move(it->second.front());
    it->second.pop_front();
    if (it->second.empty()) box_.erase(it);
    return true;
  }
  bool has(const Key& key) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = box_.find(key);
    return it != box_.end() && !it->second.empty();
  }
  // Whether process `p` has closed its connection to this one, or refused one.
  bool gone(int p) {
    std::lock_guard<std::mutex> lock(mu_);
    return gone_.count(p) > 0;
  }
  // Whether a peer aborted communicator `comm`.
  bool aborted(uint64_t comm) {
    std::lock_guard<std::mutex> lock(mu_);
    return aborted_.count(comm) > 0;
  }

 private:
  struct Link {
    std::mutex mu;
    int fd = -1;
    bool tried = false;
  };

  Post() {
    listen_fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    socklen_t len = 0;
    const sockaddr_un a = address(pid, &len);
    if (listen_fd_ < 0 || ::bind(listen_fd_, reinterpret_cast<const sockaddr*>(&a), len) != 0 ||
        ::listen(listen_fd_, 64) != 0)
      weft_emu::fail("NCCL: cannot listen on this process's socket");
    std::thread([this] { serve(); }).detach();
  }

  Link& link(int to) {
    Link* l = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      std::unique_ptr<Link>& p = links_[to];
      if (!p) p = std::make_unique<Link>();
      l = p.get();
    }
    std::lock_guard<std::mutex> lock(l->mu);
    if (!l->tried) {
      l->tried = true;
      // The peer may not listen yet (it is still starting): try for a while.
      for (int attempt = 0; attempt < 3000 && l->fd < 0; ++attempt) {
        const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        socklen_t len = 0;
        const sockaddr_un a = address(to, &len);
        if (::connect(fd, reinterpret_cast<const sockaddr*>(&a), len) == 0) {
          l->fd = fd;
          break;
        }
        ::close(fd);
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      if (l->fd < 0) {
        std::lock_guard<std::mutex> lock2(mu_);
        gone_.insert(to);
      }
    }
    return *l;
  }

  void serve() {
    std::vector<pollfd> fds{{listen_fd_, POLLIN, 0}};
    std::map<int, int> peer_of;  // fd -> pid (learnt from its first message)
    for (;;) {
      for (pollfd& p : fds) p.revents = 0;
      if (::poll(fds.data(), fds.size(), -1) < 0) continue;
      std::vector<pollfd> next{fds[0]};
      if (fds[0].revents & POLLIN) {
        const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
        if (fd >= 0) next.push_back({fd, POLLIN, 0});
      }
      for (size_t i = 1; i < fds.size(); ++i) {
        pollfd p = fds[i];
        if (p.revents == 0) {
          next.push_back(p);
          continue;
        }
        Message m;
        if (!read_all(p.fd, &m.h, sizeof m.h) ||
            (m.payload.resize(m.h.bytes), m.h.bytes > 0 && !read_all(p.fd, m.payload.data(), m.h.bytes))) {
          ::close(p.fd);
          std::lock_guard<std::mutex> lock(mu_);
          if (peer_of.count(p.fd)) gone_.insert(peer_of[p.fd]);
          peer_of.erase(p.fd);
          continue;
        }
        if (m.h.pid != 0) peer_of[p.fd] = m.h.pid;
        deliver(std::move(m));
        next.push_back(p);
      }
      fds = std::move(next);
    }
  }

  void deliver(Message m) {
    if (m.h.type == Type::hello) return bootstrap(std::move(m));
    std::lock_guard<std::mutex> lock(mu_);
    if (m.h.type == Type::abort) {
      aborted_.insert(m.h.comm);
      return;
    }
    box_[Key{m.h.comm, m.h.type, m.h.src, m.h.seq}].push_back(std::move(m));
  }

  // The root's part of a communicator's creation: collect every rank's
  // hello, then send each the table of all (or the reason there is none).
  struct Entry {
    int32_t pid = 0, device = -1;
    uint64_t host = 0;
    bool in = false;
  };
  void bootstrap(Message m) {
    std::vector<Entry> table;
    {
      std::lock_guard<std::mutex> lock(mu_);
      std::vector<Entry>& t = roots_[m.h.comm];
      const int nranks = static_cast<int>(m.h.desc.count), rank = m.h.desc.root;
      if (t.empty()) t.resize(static_cast<size_t>(nranks));
      if (rank < 0 || rank >= static_cast<int>(t.size()) || t[static_cast<size_t>(rank)].in)
        weft_emu::fail("NCCL: two ranks of one communicator gave the same rank, or one past its "
                       "size (invalid usage)");
      t[static_cast<size_t>(rank)] = {m.h.pid, m.h.desc.op, m.h.host, true};
      for (const Entry& e : t)
        if (!e.in) return;
      table = std::move(t);
      roots_.erase(m.h.comm);
    }
    std::string error;
    for (size_t i = 0; i < table.size() && error.empty(); ++i)
      for (size_t j = 0; j < i; ++j)
        if (table[i].host == table[j].host && table[i].device == table[j].device) {
          char text[200];
          std::snprintf(text, sizeof text,
                        "Duplicate GPU detected : rank %zu and rank %zu both on CUDA device %d",
                        j, i, table[i].device);
          error = text;
          break;
        }
    // The table: per rank its PID; then the error text, if any.
    std::vector<char> payload(table.size() * sizeof(int32_t));
    for (size_t i = 0; i < table.size(); ++i)
      std::memcpy(payload.data() + i * sizeof(int32_t), &table[i].pid, sizeof(int32_t));
    payload.insert(payload.end(), error.begin(), error.end());
    Header h;
  h.type = Type::table;
    h.comm = m.h.comm;
    h.bytes = payload.size();
    h.pid = pid;
    for (size_t i = 0; i < table.size(); ++i) {
      Header to = h;
      to.src = static_cast<int32_t>(i);  // the rank it is for
      send(table[i].pid, to, payload.data());
    }
  }

  int listen_fd_ = -1;
  std::mutex mu_;
  std::map<Key, std::deque<Message>> box_;
  std::map<int, std::unique_ptr<Link>> links_;
  std::set<int> gone_;
  std::set<uint64_t> aborted_;
  std::map<uint64_t, std::vector<Entry>> roots_;
};

// A thread that runs every stream as far as it can, once a communicator with
// peers in other processes exists (as a GPU runs its streams without being
// asked; a peer waits for this process's sends).
void start_progress_thread() {
  static std::once_flag once;
  std::call_once(once, [] {
    std::thread([] {
      auto last = std::chrono::steady_clock::now();
      for (;;) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        const auto now = std::chrono::steady_clock::now();
        if (weft_emu::progress_all()) {
          last = now;
        } else if (tracing() && now - last > std::chrono::seconds(2)) {
          trace("no progress for 2 s; queued", weft_emu::describe_queued());
          last = now;
        }
      }
    }).detach();
  });
}

}  // namespace

// ------------------------------------------------------------ communicators

// What queued work shares with the communicator (which ncclCommAbort frees
// at once while work may still be queued).
struct CommState {
  uint64_t key = 0;
  int nranks = 1, rank = 0, device = 0;
  std::vector<int> pids;  // per rank, once the table has come
  std::atomic<int> state{ncclSuccess};
  std::atomic<bool> aborted{false};
  std::string error;  // why the set-up failed

  // Whether this communicator can no longer complete work (aborted here or
  // by a peer, or a peer went away): its work then ends without effect.
  bool failed() {
    if (aborted.load()) return true;
    if (state.load() != ncclSuccess && state.load() != ncclInProgress) return true;
    if (nranks > 1 && Post::get().aborted(key)) {
      trace("a peer aborted", "communicator " + std::to_string(key));
      state = ncclRemoteError;
      return true;
    }
    return false;
  }
  // Whether process of rank r has gone; marks the communicator failed.
  bool peer_gone(int r) {
    if (nranks == 1 || !Post::get().gone(pids[static_cast<size_t>(r)])) return false;
    trace("a peer's process went away", "rank " + std::to_string(r) + " of communicator " + std::to_string(key));
    state = ncclRemoteError;
    return true;
  }
};

struct PendingSplit {
  uint64_t seq = 0;
  int color = 0, key = 0;
  ncclComm_t* out = nullptr;
};

struct ncclComm {
  std::shared_ptr<CommState> s = std::make_shared<CommState>();
  uint64_t coll_seq = 0;   // collectives queued so far
  uint64_t split_seq = 0;  // splits called so far
  bool pending_init = false;
  std::unique_ptr<PendingSplit> split;
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

const char* type_name(int t) {
  switch (t) {
    case ncclInt8: return "int8";
    case ncclUint8: return "uint8";
    case ncclFloat16: return "float16";
    case ncclBfloat16: return "bfloat16";
    case ncclInt32: return "int32";
    case ncclUint32: return "uint32";
    case ncclFloat32: return "float32";
    case ncclInt64: return "int64";
    case ncclUint64: return "uint64";
    case ncclFloat64: return "float64";
  }
  return "?";
}

bool valid_type(ncclDataType_t t) { return type_size(t) != 0; }

bool ready(ncclComm_t comm) {
  return comm != nullptr && comm->s->state.load() == ncclSuccess && !comm->s->aborted.load();
}

std::string describe(const CollDesc& d) {
  static const char* kinds[] = {"?", "ncclAllReduce", "ncclReduceScatter", "ncclAllGather",
                                "ncclBroadcast"};
  static const char* ops[] = {"sum", "prod", "max", "min", "avg"};
  char text[200];
  std::snprintf(text, sizeof text, "%s of %llu %s%s%s", kinds[d.kind >= 1 && d.kind <= 4 ? d.kind : 0],
                static_cast<unsigned long long>(d.count), type_name(d.dtype),
                d.kind <= 2 ? (std::string(" (") + ops[d.op >= 0 && d.op <= 4 ? d.op : 0] + ")").c_str()
                            : "",
                d.kind == 4 ? (" from rank " + std::to_string(d.root)).c_str() : "");
  return text;
}

// ---- reductions, in rank order, in each type's arithmetic

float bf16_to_float(uint16_t b) { return __bfloat162float(__ushort_as_bfloat16(b)); }
uint16_t float_to_bf16(float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); }

template <typename T>
T combine(T a, T b, int op) {
  switch (op) {
    case ncclProd: return a * b;
    case ncclMax: return a > b ? a : b;
    case ncclMin: return a < b ? a : b;
    default: return a + b;  // sum; avg divides after
  }
}

template <typename T>
void reduce_into(void* acc, const void* x, size_t n, int op) {
  T* a = static_cast<T*>(acc);
  const T* b = static_cast<const T*>(x);
  for (size_t i = 0; i < n; ++i) a[i] = combine(a[i], b[i], op);
}

void reduce_into(void* acc, const void* x, size_t n, int dtype, int op) {
  switch (dtype) {
    case ncclInt8: return reduce_into<int8_t>(acc, x, n, op);
    case ncclUint8: return reduce_into<uint8_t>(acc, x, n, op);
    case ncclInt32: return reduce_into<int32_t>(acc, x, n, op);
    case ncclUint32: return reduce_into<uint32_t>(acc, x, n, op);
    case ncclInt64: return reduce_into<int64_t>(acc, x, n, op);
    case ncclUint64: return reduce_into<uint64_t>(acc, x, n, op);
    case ncclFloat32: return reduce_into<float>(acc, x, n, op);
    case ncclFloat64: return reduce_into<double>(acc, x, n, op);
    case ncclBfloat16: {
      uint16_t* a = static_cast<uint16_t*>(acc);
      const uint16_t* b = static_cast<const uint16_t*>(x);
      for (size_t i = 0; i < n; ++i)
        a[i] = float_to_bf16(combine(bf16_to_float(a[i]), bf16_to_float(b[i]), op));
      return;
    }
    default: weft_emu::fail("NCCL: a reduction of float16 is not emulated");
  }
}

void divide(void* acc, size_t n, int dtype, int by) {
  if (dtype == ncclFloat32)
    for (size_t i = 0; i < n; ++i) static_cast<float*>(acc)[i] /= static_cast<float>(by);
  else if (dtype == ncclFloat64)
    for (size_t i = 0; i < n; ++i) static_cast<double*>(acc)[i] /= by;
  else if (dtype == ncclBfloat16)
    for (size_t i = 0; i < n; ++i) {
      uint16_t& v = static_cast<uint16_t*>(acc)[i];
      v = float_to_bf16(bf16_to_float(v) / static_cast<float>(by));
    }
  else
    weft_emu::fail("NCCL: ncclAvg of an integer type is not emulated");
}

Header header(Type type, const CommState& s, uint64_t seq, uint64_t bytes) {
  Header h;
  h.type = type;
  h.src = s.rank;
  h.comm = s.key;
  h.seq = seq;
  h.bytes = weft_emu::host_only() ? 0 : bytes;  // a device that does nothing moves no bytes
  h.pid = Post::get().pid;
  return h;
}

void send_to(const CommState& s, int rank, const Header& h, const void* payload) {
  Post::get().send(s.pids[static_cast<size_t>(rank)], h, payload);
}

// A collective as stream work: sends this rank's part to every rank, then
// waits for every rank's part and combines them.
ncclResult_t collective(ncclComm_t comm, CollDesc d, const void* send, void* recv,
                        cudaStream_t stream) {
  if (!ready(comm)) return ncclInvalidUsage;
  if (!valid_type(static_cast<ncclDataType_t>(d.dtype))) return ncclInvalidArgument;
  if (d.kind == 4 && (d.root < 0 || d.root >= comm->s->nranks)) return ncclInvalidArgument;
  std::shared_ptr<CommState> s = comm->s;
  const uint64_t seq = comm->coll_seq++;
  const size_t elem = type_size(static_cast<ncclDataType_t>(d.dtype));
  const int n = s->nranks;
  // Elements of this rank's part.
  const size_t part = d.kind == 2 ? d.count * n : d.count;  // reduce_scatter sends all slices
  auto started = std::make_shared<bool>(false);
  auto work = [=]() -> bool {
    if (s->failed()) return true;
    if (!*started) {
      *started = true;
      trace("start", describe(d) + " #" + std::to_string(seq));
      const bool carries = d.kind != 4 || s->rank == d.root;
      Header h = header(Type::coll, *s, seq, carries ? part * elem : 0);
      h.desc = d;
      for (int r = 0; r < n; ++r) send_to(*s, r, h, send);
    }
    Post& post = Post::get();
    for (int r = 0; r < n; ++r)
      if (!post.has(Key{s->key, Type::coll, r, seq})) {
        if (s->peer_gone(r)) return true;
        return false;
      }
    std::vector<Message> parts(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) post.take(Key{s->key, Type::coll, r, seq}, &parts[static_cast<size_t>(r)]);
    for (int r = 0; r < n; ++r)
      if (!(parts[static_cast<size_t>(r)].h.desc == d)) {
        const std::string text = "NCCL: collective #" + std::to_string(seq) + " of a communicator: rank " +
                                 std::to_string(s->rank) + " called " + describe(d) + ", rank " +
                                 std::to_string(r) + " " + describe(parts[static_cast<size_t>(r)].h.desc) +
                                 " (ranks must call the same collectives in the same order: a "
                                 "hang or garbage on a GPU)";
        weft_emu::fail(text.c_str());
      }
    if (weft_emu::host_only()) return true;
    const size_t bytes = d.count * elem;
    switch (d.kind) {
      case 1: {  // all_reduce
        std::vector<char> acc(parts[0].payload);
        for (int r = 1; r < n; ++r)
          reduce_into(acc.data(), parts[static_cast<size_t>(r)].payload.data(), d.count, d.dtype, d.op);
        if (d.op == ncclAvg) divide(acc.data(), d.count, d.dtype, n);
        if (bytes > 0) std::memcpy(recv, acc.data(), bytes);
        break;
      }
      case 2: {  // reduce_scatter: slice `rank` of every part
        const size_t off = static_cast<size_t>(s->rank) * bytes;
        std::vector<char> acc(parts[0].payload.begin() + static_cast<std::ptrdiff_t>(off),
                              parts[0].payload.begin() + static_cast<std::ptrdiff_t>(off + bytes));
        for (int r = 1; r < n; ++r)
          reduce_into(acc.data(), parts[static_cast<size_t>(r)].payload.data() + off, d.count, d.dtype, d.op);
        if (d.op == ncclAvg) divide(acc.data(), d.count, d.dtype, n);
        if (bytes > 0) std::memcpy(recv, acc.data(), bytes);
        break;
      }
      case 3:  // all_gather
        for (int r = 0; r < n; ++r)
          if (bytes > 0)
            std::memcpy(static_cast<char*>(recv) + static_cast<size_t>(r) * bytes,
                        parts[static_cast<size_t>(r)].payload.data(), bytes);
        break;
      case 4:  // broadcast
        if (bytes > 0) std::memmove(recv, parts[static_cast<size_t>(d.root)].payload.data(), bytes);
        break;
    }
    return true;
  };
  weft_emu::enqueue_try(stream, work, describe(d) + " (collective #" + std::to_string(seq) + ")");
  return ncclSuccess;
}

struct P2p {
  bool send;
  void* buf;
  size_t bytes;
  int peer;
  ncclComm_t comm;
  cudaStream_t stream;
};

// The open group of this host thread (NCCL's groups are per thread).
thread_local int t_group_depth = 0;
thread_local std::vector<P2p> t_pending;

ncclResult_t p2p(bool send, void* buf, size_t count, ncclDataType_t type, int peer,
                 ncclComm_t comm, cudaStream_t stream) {
  if (!ready(comm)) return ncclInvalidUsage;
  if (!valid_type(type) || peer < 0 || peer >= comm->s->nranks) return ncclInvalidArgument;
  t_pending.push_back({send, buf, count * type_size(type), peer, comm, stream});
  if (t_group_depth == 0) return ncclGroupEnd();  // alone: its own group
  return ncclSuccess;
}

// One stream's sends and receives of a group, on one communicator, as one
// piece of stream work.
void queue_group(std::vector<P2p> ops) {
  std::shared_ptr<CommState> s = ops.front().comm->s;
  const cudaStream_t stream = ops.front().stream;
  auto started = std::make_shared<bool>(false);
  auto done = std::make_shared<std::vector<bool>>(ops.size(), false);
  std::string what;
  for (const P2p& op : ops) {
    if (!what.empty()) what += ", ";
    what += (op.send ? "ncclSend to rank " : "ncclRecv from rank ") + std::to_string(op.peer) +
            " (" + std::to_string(op.bytes) + " bytes)";
  }
  what += " on rank " + std::to_string(s->rank) + " of a communicator of " + std::to_string(s->nranks);
  auto work = [s, ops, started, done, what]() -> bool {
    if (s->failed()) return true;
    Post& post = Post::get();
    if (!*started) {
      *started = true;
      trace("start", what);
      for (const P2p& op : ops)
        send_to(*s, op.peer, header(op.send ? Type::p2p : Type::cts, *s, 0, op.send ? op.bytes : 0),
                op.buf);
    }
    bool all = true;
    // Between two ranks messages match in order: a receive (or a send's
    // clear-to-send) waits while an earlier one from the same peer does.
    std::set<std::pair<bool, int>> waiting;
    for (size_t i = 0; i < ops.size(); ++i) {
      if ((*done)[i]) continue;
      const P2p& op = ops[i];
      Message m;
      if (waiting.count({op.send, op.peer}) > 0 ||
          !post.take(Key{s->key, op.send ? Type::cts : Type::p2p, op.peer, 0}, &m)) {
        if (s->peer_gone(op.peer)) return true;
        waiting.insert({op.send, op.peer});
        all = false;
        continue;
      }
      if (!op.send && !weft_emu::host_only()) {
        if (m.payload.size() != op.bytes) {
          const std::string text = "rank " + std::to_string(s->rank) + "'s ncclRecv of " +
                                   std::to_string(op.bytes) + " bytes from rank " +
                                   std::to_string(op.peer) + " matched an ncclSend of " +
                                   std::to_string(m.payload.size()) +
                                   " bytes (counts must agree: undefined on a GPU)";
          std::fprintf(stderr, "NCCL WARN %s (GPU emulator)\n", text.c_str());
          s->state = ncclInvalidUsage;  // what ncclCommGetAsyncError says from now on
          return true;
        }
        if (op.bytes > 0) std::memcpy(op.buf, m.payload.data(), op.bytes);
      }
      (*done)[i] = true;
    }
    if (all) trace("done", what);
    return all;
  };
  weft_emu::enqueue_try(stream, work, what);
}

ncclComm_t new_comm(uint64_t key, int nranks, int rank, int device) {
  ncclComm_t c = new ncclComm;
  c->s->key = key;
  c->s->nranks = nranks;
  c->s->rank = rank;
  c->s->device = device;
  return c;
}

// The background work of a communicator's creation: done once the root's
// table has come.
void poll_init(ncclComm_t comm) {
  if (!comm->pending_init) return;
  CommState& s = *comm->s;
  Message m;
  if (!Post::get().take(Key{s.key, Type::table, s.rank, 0}, &m)) return;
  comm->pending_init = false;
  const size_t n = static_cast<size_t>(s.nranks);
  s.pids.resize(n);
  for (size_t i = 0; i < n; ++i) std::memcpy(&s.pids[i], m.payload.data() + i * sizeof(int32_t), sizeof(int32_t));
  if (m.payload.size() > n * sizeof(int32_t)) {
    s.error.assign(m.payload.begin() + static_cast<std::ptrdiff_t>(n * sizeof(int32_t)), m.payload.end());
    std::fprintf(stderr, "NCCL WARN %s (GPU emulator)\n", s.error.c_str());
    s.state = ncclInvalidUsage;
    return;
  }
  s.state = ncclSuccess;
}

// The background work of a split: done once every rank's colour and key
// have come.
void poll_split(ncclComm_t comm) {
  if (!comm->split) return;
  CommState& s = *comm->s;
  PendingSplit& p = *comm->split;
  Post& post = Post::get();
  for (int r = 0; r < s.nranks; ++r)
    if (!post.has(Key{s.key, Type::split, r, p.seq})) {
      if (s.peer_gone(r)) comm->split.reset();
      return;
    }
  std::vector<std::tuple<int, int, int>> members;  // (key, parent rank, colour) of this colour
  for (int r = 0; r < s.nranks; ++r) {
    Message m;
    post.take(Key{s.key, Type::split, r, p.seq}, &m);
    if (m.h.desc.op == p.color) members.emplace_back(m.h.desc.root, r, m.h.desc.op);
  }
  std::sort(members.begin(), members.end());
  if (p.color != NCCL_SPLIT_NOCOLOR) {
    int rank = 0;
    for (size_t i = 0; i < members.size(); ++i)
      if (std::get<1>(members[i]) == s.rank) rank = static_cast<int>(i);
    ncclComm_t c = new_comm(mix(mix(s.key, p.seq + 1), static_cast<uint64_t>(p.color) + 7),
                            static_cast<int>(members.size()), rank, s.device);
    for (const auto& mbr : members) c->s->pids.push_back(s.pids[static_cast<size_t>(std::get<1>(mbr))]);
    trace("split", "communicator " + std::to_string(c->s->key) + " (rank " + std::to_string(rank) +
                       " of " + std::to_string(c->s->nranks) + ") from " + std::to_string(s.key) +
                       " split #" + std::to_string(p.seq));
    *p.out = c;
  }
  comm->split.reset();
  s.state = ncclSuccess;
}

void poll(ncclComm_t comm) {
  poll_init(comm);
  poll_split(comm);
}

// Blocks (for a blocking call) until the background work is done.
ncclResult_t finish_blocking(ncclComm_t comm) {
  while (comm->s->state.load() == ncclInProgress) {
    poll(comm);
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return comm->s->state.load() == ncclSuccess ? ncclSuccess : ncclInvalidUsage;
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

// The id: a random number, and the creating process, which is the root that
// every rank's hello goes to.
ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  if (id == nullptr) return ncclInvalidArgument;
  static std::atomic<uint64_t> next{1};
  std::memset(id->internal, 0, sizeof id->internal);
  const uint64_t key = mix(mix(static_cast<uint64_t>(getpid()), next++),
                           static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
  const int32_t pid = Post::get().pid;  // listening from now on, as NCCL's root does
  std::memcpy(id->internal, &key, sizeof key);
  std::memcpy(id->internal + sizeof key, &pid, sizeof pid);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t* config) {
  if (comm == nullptr || nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
  const bool blocking = config == nullptr || config->blocking != 0;
  uint64_t key = 0;
  int32_t root = 0;
  std::memcpy(&key, id.internal, sizeof key);
  std::memcpy(&root, id.internal + sizeof key, sizeof root);
  int device = 0;
  cudaGetDevice(&device);
  ncclComm_t c = new_comm(key, nranks, rank, device);
  *comm = c;
  if (nranks == 1) {
    c->s->pids = {static_cast<int>(getpid())};
    return ncclSuccess;
  }
  Post& post = Post::get();
  start_progress_thread();
  Header h;
  h.type = Type::hello;
  h.comm = key;
  h.pid = post.pid;
  h.host = host_identity();
  h.desc.root = rank;
  h.desc.count = static_cast<uint64_t>(nranks);
  h.desc.op = device;
  c->s->state = ncclInProgress;
  c->pending_init = true;
  post.send(root, h, nullptr);
  if (blocking) return finish_blocking(c);
  return ncclInProgress;
}

// Non-blocking (`blocking = 0`), as NCCL 2.28 was seen to do on an H200:
// the call answers ncclInProgress with *newcomm still null, and the new
// communicator is handed back when the parent's state is polled after every
// rank's colour has come.
ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm,
                           ncclConfig_t* config) {
  if (!ready(comm) || newcomm == nullptr || comm->split) return ncclInvalidUsage;
  *newcomm = nullptr;
  CommState& s = *comm->s;
  comm->split = std::make_unique<PendingSplit>(PendingSplit{comm->split_seq++, color, key, newcomm});
  Header h = header(Type::split, s, comm->split->seq, 0);
  h.desc.op = color;
  h.desc.root = key;
  for (int r = 0; r < s.nranks; ++r) send_to(s, r, h, nullptr);
  s.state = ncclInProgress;
  if (config == nullptr || config->blocking != 0) return finish_blocking(comm);
  return ncclInProgress;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (comm == nullptr) return ncclInvalidArgument;
  weft_emu::drain_all();  // its queued work finishes first
  delete comm;
  return ncclSuccess;
}

// Frees the communicator at once; its queued work ends without effect, and
// its peers' communicators report ncclRemoteError.
ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (comm == nullptr) return ncclSuccess;
  CommState& s = *comm->s;
  s.aborted = true;
  if (s.nranks > 1 && s.pids.size() == static_cast<size_t>(s.nranks)) {
    Header h = header(Type::abort, s, 0, 0);
    for (int r = 0; r < s.nranks; ++r)
      if (r != s.rank) send_to(s, r, h, nullptr);
  }
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* state) {
  if (comm == nullptr || state == nullptr) return ncclInvalidArgument;
  poll(comm);
  comm->s->failed();  // a peer's abort becomes this communicator's error
  *state = static_cast<ncclResult_t>(comm->s->state.load());
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  if (comm == nullptr || count == nullptr) return ncclInvalidArgument;
  *count = comm->s->nranks;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  if (comm == nullptr || rank == nullptr) return ncclInvalidArgument;
  *rank = comm->s->rank;
  return ncclSuccess;
}

ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, ncclDataType_t type,
                           int root, ncclComm_t comm, cudaStream_t stream) {
  return collective(comm, {4, type, 0, root, count}, send, recv, stream);
}

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t type,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return collective(comm, {1, type, op, 0, count}, send, recv, stream);
}

ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t recvcount,
                               ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                               cudaStream_t stream) {
  return collective(comm, {2, type, op, 0, recvcount}, send, recv, stream);
}

ncclResult_t ncclAllGather(const void* send, void* recv, size_t sendcount, ncclDataType_t type,
                           ncclComm_t comm, cudaStream_t stream) {
  return collective(comm, {3, type, 0, 0, sendcount}, send, recv, stream);
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

// Queues the group's sends and receives: per (communicator, stream), one
// piece of stream work in the order they were posted.
ncclResult_t ncclGroupEnd() {
  if (t_group_depth > 0) --t_group_depth;
  if (t_group_depth > 0) return ncclSuccess;
  std::vector<P2p> ops = std::move(t_pending);
  t_pending.clear();
  std::vector<bool> queued(ops.size(), false);
  for (size_t i = 0; i < ops.size(); ++i) {
    if (queued[i]) continue;
    std::vector<P2p> same;
    for (size_t j = i; j < ops.size(); ++j)
      if (!queued[j] && ops[j].comm == ops[i].comm && ops[j].stream == ops[i].stream) {
        same.push_back(ops[j]);
        queued[j] = true;
      }
    queue_group(std::move(same));
  }
  return ncclSuccess;
}
