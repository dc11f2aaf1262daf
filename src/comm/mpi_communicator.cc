// MpiCommunicator: the Communicator rules over an MPI_Comm, for host tensors.
//
// Every operation is posted non-blocking and completed by one polling loop
// (MpiCommunicator::poll). MPICH's own blocking calls spin at full speed, and
// with more ranks than cores a spinning rank steals the core the rank it waits
// for needs: a blocking 8-rank all-reduce of up to 256 KiB on 2 cores takes
// 30-100 ms, through this loop 1-4 ms (bench/comm.sh). The loop spins only
// where spinning is free (no more ranks than cores on the node) and otherwise
// sleeps between MPI_Test calls; the deadline lives there.
//
// Point-to-point messages travel as two MPI messages posted together: a small
// Header (dtype, shape, sender, tag) under tag `code | kHeaderBit`, and the
// payload, straight from and into the tensors' bytes, under tag `code`. The
// receiver posts both receives at once, so the n-th irecv of a (peer, tag)
// takes the n-th header and the n-th payload whatever order requests are
// waited in (MPI matches each tag in posting order). It checks the header
// against the posted tensor before it reports the receive complete.
//
// Failures: MPI cannot tell a dead peer from a slow one (no ULFM in MPICH's
// default build), so this transport never throws PeerFailed. It does not need
// to: a rank that throws out of mpi_main calls MPI_Abort, and hydra (mpiexec)
// kills every rank of a job as soon as one of them exits abnormally, killed
// by a signal included. The deadline covers the rest (a peer that is alive but
// never sends).
#include <weft/bf16.h>
#include <weft/mesh.h>
#include <weft/mpi_communicator.h>

#include <fmt/ranges.h>
#include <mpi.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <condition_variable>
#include <mutex>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <optional>
#include <thread>

namespace weft {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::microseconds;

// Header tags sit above every MessageTag code (codes are below 2^25).
constexpr int kHeaderBit = 1 << 25;
constexpr int64_t kHeaderMagic = 0x7466'6577'6864'7231;  // "1rdhweft"

// What a payload is, sent ahead of it.
struct Header {
  int64_t magic = kHeaderMagic;
  int32_t tag = 0;
  int32_t rank = 0;  // sender's rank in the communicator
  int32_t dtype = 0;
  int32_t ndim = 0;
  int64_t dims[Shape::kMaxRank] = {};
};

void mpi_check(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw Error("{} failed: {} (error {})", call, std::string(text, static_cast<size_t>(len)), rc);
}

// Checks on the per-message path are written `if (!ok) throw`, not check():
// check() formats its arguments (shapes, group names) before it tests, which
// cost more than the message itself.

// MPI counts are int; weft's tensors are not.
int mpi_count(int64_t n, const Tensor& t, const char* op) {
  if (n > INT_MAX)
    throw Error("{} of {} {} ({} bytes) needs {} MPI items, more than one call carries ({})", op,
                dtype_name(t.dtype()), t.shape().str(), t.nbytes(), n, INT_MAX);
  return static_cast<int>(n);
}

void check_host(const Tensor& t, const char* op) {
  if (!t.device().is_cpu())
    throw Error("{}: MpiCommunicator moves host memory, but the tensor {} is on {} (use NCCL)", op,
                t.shape().str(), t.device().str());
  if (!t.defined()) throw Error("{}: the tensor {} has no storage", op, t.shape().str());
}

// bf16 sum as an MPI user op over 2-byte elements: each addition in fp32,
// rounded once to bf16 (weft/bf16.h). fp32 addition commutes exactly, so the
// op is declared commutative; it is not associative, so the result depends on
// MPI's reduction tree, but MPICH's trees give every rank the same bits.
void bf16_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const uint16_t*>(in);
  auto* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = bf16_add(a[i], b[i]);
}

// Created at the first bf16 reduction (MPI is initialised by then); never
// freed, it lives until MPI_Finalize like the built-in ops.
MPI_Op bf16_sum_op() {
  static const MPI_Op op = [] {
    MPI_Op o;
    mpi_check(MPI_Op_create(&bf16_sum, /*commute=*/1, &o), "MPI_Op_create");
    return o;
  }();
  return op;
}

// The element type and operation of a reduction: sum and max of F32 and
// I32, and sum of BF16.
struct Reduction {
  MPI_Datatype type;
  MPI_Op op;
};
Reduction reduction(const Tensor& t, ReduceOp op, const char* what) {
  const MPI_Op builtin = op == ReduceOp::Sum ? MPI_SUM : MPI_MAX;
  switch (t.dtype()) {
    case DType::F32: return {MPI_FLOAT, builtin};
    case DType::I32: return {MPI_INT32_T, builtin};
    case DType::BF16:
      if (op == ReduceOp::Sum) return {MPI_UINT16_T, bf16_sum_op()};
      break;
  }
  throw Error("{} ({}) of {} {}: MPI reductions take F32 or I32, and BF16 for sums", what,
              reduce_op_name(op), dtype_name(t.dtype()), t.shape().str());
}

// Copies move bytes of any dtype, counted in 2-byte units (every dtype's size
// is a multiple of 2): one count then holds 4 GiB, and sender and receiver
// always agree on the type even when their dtypes differ.
const MPI_Datatype kCopyType = MPI_UINT16_T;
int64_t copy_count(const Tensor& t) { return static_cast<int64_t>(t.nbytes() / 2); }

// When a waiting rank may spin: only while each rank on this node has a core
// to itself; otherwise spinning takes the core from the rank being waited for.
microseconds spin_window(MPI_Comm world) {
  if (const char* env = std::getenv("WEFT_COMM_SPIN_US")) return microseconds(std::atol(env));
  MPI_Comm node;
  mpi_check(MPI_Comm_split_type(world, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node),
            "MPI_Comm_split_type");
  int ranks_here = 1;
  MPI_Comm_size(node, &ranks_here);
  MPI_Comm_free(&node);
  cpu_set_t cpus;
  int cores = sched_getaffinity(0, sizeof(cpus), &cpus) == 0
                  ? CPU_COUNT(&cpus)
                  : static_cast<int>(std::thread::hardware_concurrency());
  return ranks_here <= cores ? microseconds(2000) : microseconds(0);
}

class MpiCommunicator;

// What one round of MPI_Test calls found.
enum class Progress {
  Done,
  // Data is flowing: the peer has posted its side. MPI moves a large message
  // a fragment per progress call on both sides, so sleeping now would stall
  // it (a 64 MiB message took 3x as long): poll on, yielding at most.
  Moving,
  // Nothing from the peer yet, which may take long: back off.
  Waiting,
};

// Between two MPI_Test calls while Waiting; false once done spinning. With a
// core of its own a rank keeps polling for `spin` (2 ms covers a ping-pong of
// a few MiB). Then, or at once when ranks outnumber cores, it yields a few
// times (the rank it waits for may be about to run) and then sleeps for 1/32
// of the time waited so far, at least 50 us (shorter sleeps are rounded up to
// Linux's timer slack anyway) and at most 1 ms: a long wait ends at most ~3%
// late, a short one is not stretched by a long sleep, and a sleeping rank
// leaves its core to the others.
bool back_off(Clock::duration waited, microseconds spin, int polls) {
  if (waited < spin) return true;
  if (polls < 16) {
    std::this_thread::yield();
    return false;
  }
  std::this_thread::sleep_for(
      std::clamp<Clock::duration>(waited / 32, microseconds(50), microseconds(1000)));
  return false;
}

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, bool owned, std::vector<int> world_ranks, std::string name,
                  microseconds spin, CommOptions options)
      : Communicator(options),
        comm_(comm),
        owned_(owned),
        world_ranks_(std::move(world_ranks)),
        name_(std::move(name)),
        spin_(spin) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    // The roll call's own channel (roll_call): nothing else matches it.
    mpi_check(MPI_Comm_dup(comm_, &roll_), "MPI_Comm_dup");
  }

  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&roll_);
    if (owned_ && !finalized) MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int world_rank(int r) const override {
    if (r < 0 || r >= size_) throw Error("rank {} is outside {} (size {})", r, describe(), size_);
    return world_ranks_[static_cast<size_t>(r)];
  }
  std::string describe() const override {
    if (name_.empty()) return "world";
    return fmt::format("{} [{}]", name_, fmt::join(world_ranks_, ", "));
  }

  RequestPtr isend(const Tensor& t, int peer, MessageTag tag) override;
  RequestPtr irecv(const Tensor& t, int peer, MessageTag tag) override;
  void all_reduce(const Tensor& t, ReduceOp op) override;
  void all_gather(const Tensor& in, const Tensor& out) override;
  void reduce_scatter(const Tensor& in, const Tensor& out, ReduceOp op) override;
  RequestPtr iall_reduce(const Tensor& t, ReduceOp op) override;
  RequestPtr ireduce_scatter(const Tensor& in, const Tensor& out, ReduceOp op) override;
  void broadcast(const Tensor& t, int root) override;
  void barrier() override;
  std::unique_ptr<Communicator> split(const std::vector<std::vector<int>>& groups,
                                      const std::string& name) override;

  MPI_Comm comm() const { return comm_; }

  // The one waiting loop: calls step() (which calls MPI_Test) until it is
  // Done; past the deadline throws CommTimeout naming what(). step() may
  // throw (a mismatched message). `bytes` is what this rank's share of the
  // operation moves when step() cannot tell Moving from Waiting.
  template <typename Step, typename What>
  void poll(Step&& step, What&& what, size_t bytes = 0) const {
    // A rank with a core of its own also spins through the transfer itself,
    // counted at 1 GB/s (shared memory on one node does several).
    const microseconds spin = spin_.count() ? spin_ + microseconds(bytes / 1000) : spin_;
    Progress p = step();
    if (p == Progress::Done) return;  // most sends, without reading the clock
    const auto start = Clock::now();
    const auto deadline = start + options_.timeout;
    bool spinning = false;
    for (int polls = 0;; ++polls) {
      // Reading the clock costs about what an idle MPI_Test does: while
      // spinning, read it every 32nd poll only.
      if (!spinning || polls % 32 == 0) {
        const auto now = Clock::now();
        if (now >= deadline) throw CommTimeout(waiting_for(what()));
        if (p == Progress::Waiting) {
          spinning = back_off(now - start, spin, polls);
        } else {
          spinning = spin_.count() > 0;
          if (!spinning) std::this_thread::yield();
        }
      }
      p = step();
      if (p == Progress::Done) return;
    }
  }

  // "from rank 0 (world rank 4)"
  std::string peer_str(const char* dir, int peer) const {
    return fmt::format("{} rank {} (world rank {})", dir, peer, world_rank(peer));
  }

 private:
  MPI_Request post_all_reduce(const Tensor& t, ReduceOp op);
  // `src` receives the copy MPI reads from when `out` lies inside `in`.
  MPI_Request post_reduce_scatter(const Tensor& in, const Tensor& out, ReduceOp op, Tensor& src);
  static std::string reduce_scatter_what(const Tensor& in, ReduceOp op);
  void check_peer(int peer, const char* op) const {
    if (peer < 0 || peer >= size_)
      throw Error("{}: peer rank {} is outside {} of size {} (rank {})", op, peer, describe(),
                  size_, rank_);
  }
  // Waits for a posted collective that moves `bytes` in and out of this rank.
  template <typename What>
  void wait_collective(MPI_Request& req, size_t bytes, What&& what) {
    const int64_t n = next_collective();
    try {
      poll(
          [&] {
            int flag = 0;
            mpi_check(MPI_Test(&req, &flag, MPI_STATUS_IGNORE), "MPI_Test");
            return flag ? Progress::Done : Progress::Waiting;
          },
          what, bytes);
    } catch (const CommTimeout& e) {
      throw CommTimeout("{}; {}", e.what(), roll_call(n));
    }
  }

 public:
  // The number of the group's next collective, blocking or not: MPI has
  // every member post the group's collectives in one order, so the same
  // collective has the same number on every member.
  int64_t next_collective() { return ++collectives_; }

  // After collective number `mine` timed out here: who never arrived. Each
  // member that times out sends every other the number of the collective
  // it waits for on roll_ and listens for theirs, as long as the deadline
  // (60 s at most): a member never heard from was elsewhere (stuck in other
  // work, or gone); one with another number waits in another collective of
  // the group.
  std::string roll_call(int64_t mine) const {
    roll_note_ = mine;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      MPI_Request q;
      if (MPI_Isend(&roll_note_, 1, MPI_INT64_T, r, 0, roll_, &q) == MPI_SUCCESS)
        MPI_Request_free(&q);  // sent in the background, or never: this rank is failing
    }
    std::vector<int64_t> count(static_cast<size_t>(size_), -1);
    count[static_cast<size_t>(rank_)] = mine;
    int left = size_ - 1;
    const auto listen = std::min<std::chrono::milliseconds>(options_.timeout, std::chrono::seconds(60));
    const auto until = Clock::now() + listen;
    while (left > 0 && Clock::now() < until) {
      int flag = 0;
      MPI_Status st;
      if (MPI_Iprobe(MPI_ANY_SOURCE, 0, roll_, &flag, &st) != MPI_SUCCESS) break;
      if (!flag) {
        std::this_thread::sleep_for(microseconds(500));
        continue;
      }
      int64_t theirs = 0;
      if (MPI_Recv(&theirs, 1, MPI_INT64_T, st.MPI_SOURCE, 0, roll_, MPI_STATUS_IGNORE) !=
          MPI_SUCCESS)
        break;
      int64_t& c = count[static_cast<size_t>(st.MPI_SOURCE)];
      if (c < 0) --left;
      c = theirs;
    }
    std::vector<std::string> missing, elsewhere;
    for (int r = 0; r < size_; ++r) {
      const int64_t c = count[static_cast<size_t>(r)];
      if (c < 0)
        missing.push_back(fmt::format("rank {} (world rank {})", r, world_rank(r)));
      else if (c != mine)
        elsewhere.push_back(fmt::format("rank {} (world rank {}) at collective #{}", r,
                                        world_rank(r), c));
    }
    std::string out;
    if (!missing.empty())
      out = fmt::format("never arrived: {} (no answer within {:g} s of this rank's timeout)",
                        fmt::join(missing, ", "), static_cast<double>(listen.count()) / 1e3);
    if (!elsewhere.empty())
      out += fmt::format("{}in another collective of the group: {} (this rank at #{})",
                         out.empty() ? "" : "; ", fmt::join(elsewhere, ", "), mine);
    if (out.empty())
      out = fmt::format("every member of the group is in it (collective #{}) and timed out too",
                        mine);
    return out;
  }

 private:

  MPI_Comm comm_;
  bool owned_;
  std::vector<int> world_ranks_;
  std::string name_;  // empty for the world
  microseconds spin_;
  int rank_ = 0, size_ = 1;
  MPI_Comm roll_ = MPI_COMM_NULL;
  int64_t collectives_ = 0;        // collectives this rank posted in the group
  mutable int64_t roll_note_ = 0;  // roll_call's message (MPI reads it after the call)
};

// Leaves requests that will never be waited for to MPI: receives are
// cancelled (a receive already matched still lands), sends are left to finish.
// A Header may still be read or written by MPI afterwards, so it is leaked
// rather than freed; this happens only on error paths.
void abandon(MPI_Request* reqs, int n, bool cancel, std::unique_ptr<Header>& header) {
  bool pending = false;
  for (int i = 0; i < n; ++i) {
    if (reqs[i] == MPI_REQUEST_NULL) continue;
    pending = true;
    if (cancel) MPI_Cancel(&reqs[i]);
    MPI_Request_free(&reqs[i]);
  }
  if (pending) (void)header.release();
}

class SendRequest final : public Request {
 public:
  // Payloads this large go by rendezvous (MPICH over UCX switches above
  // 8 KiB on one node), which needs the sender polling while the data flows.
  // Their header goes synchronously (MPI_Issend): once it completes, the
  // receiver has matched it, so it has posted the payload's receive too, and
  // the sender stops sleeping. (Where MPI's eager limit is higher, such a
  // send now waits for its receive to be posted, as MPI's send may.)
  static constexpr size_t kSyncHeaderBytes = 16 * 1024;

  SendRequest(const MpiCommunicator& comm, const Tensor& t, int peer, MessageTag tag)
      : comm_(comm),
        peer_(peer),
        tag_(tag),
        header_(std::make_unique<Header>()),
        sync_(t.nbytes() >= kSyncHeaderBytes) {
    const int code = tag.encode();
    header_->tag = code;
    header_->rank = comm.rank();
    header_->dtype = static_cast<int32_t>(t.dtype());
    header_->ndim = t.rank();
    for (int i = 0; i < t.rank(); ++i) header_->dims[i] = t.dim(i);
    const int count = mpi_count(copy_count(t), t, "send");
    mpi_check((sync_ ? MPI_Issend : MPI_Isend)(header_.get(), sizeof(Header), MPI_BYTE, peer,
                                               code | kHeaderBit, comm.comm(), &reqs_[0]),
              sync_ ? "MPI_Issend" : "MPI_Isend");
    mpi_check(MPI_Isend(t.raw(), count, kCopyType, peer, code, comm.comm(), &reqs_[1]),
              "MPI_Isend");
  }
  ~SendRequest() override { abandon(reqs_, 2, /*cancel=*/false, header_); }

  bool test() override { return progress() == Progress::Done; }
  void wait() override {
    comm_.poll(
        [&] { return progress(); },
        [&] { return fmt::format("send {}, tag {}", comm_.peer_str("to", peer_), tag_.str()); });
  }

 private:
  Progress progress() {
    int flag = 0;
    for (MPI_Request& r : reqs_)
      if (r != MPI_REQUEST_NULL) mpi_check(MPI_Test(&r, &flag, MPI_STATUS_IGNORE), "MPI_Test");
    if (reqs_[1] == MPI_REQUEST_NULL && reqs_[0] == MPI_REQUEST_NULL) return Progress::Done;
    return sync_ && reqs_[0] == MPI_REQUEST_NULL ? Progress::Moving : Progress::Waiting;
  }

  const MpiCommunicator& comm_;
  int peer_;
  MessageTag tag_;
  std::unique_ptr<Header> header_;
  bool sync_;
  MPI_Request reqs_[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
};

class RecvRequest final : public Request {
 public:
  RecvRequest(const MpiCommunicator& comm, const Tensor& t, int peer, MessageTag tag)
      : comm_(comm), posted_(t), peer_(peer), tag_(tag), header_(std::make_unique<Header>()) {
    const int code = tag.encode();
    const int count = mpi_count(copy_count(t), t, "recv");
    mpi_check(MPI_Irecv(header_.get(), sizeof(Header), MPI_BYTE, peer, code | kHeaderBit,
                        comm.comm(), &reqs_[0]),
              "MPI_Irecv");
    mpi_check(MPI_Irecv(t.raw(), count, kCopyType, peer, code, comm.comm(), &reqs_[1]),
              "MPI_Irecv");
  }
  ~RecvRequest() override { abandon(reqs_, 2, /*cancel=*/true, header_); }

  bool test() override { return progress() == Progress::Done; }
  void wait() override {
    comm_.poll([&] { return progress(); },
               [&] {
                 return fmt::format("recv of {} {} {}, tag {}", dtype_name(posted_.dtype()),
                                    posted_.shape().str(), comm_.peer_str("from", peer_),
                                    tag_.str());
               });
  }

 private:
  // The header first; once it is in, the payload is on its way.
  Progress progress() {
    int flag = 0;
    if (reqs_[0] != MPI_REQUEST_NULL) {
      mpi_check(MPI_Test(&reqs_[0], &flag, MPI_STATUS_IGNORE), "MPI_Test");
      if (!flag) return Progress::Waiting;
      check_header();
    }
    if (reqs_[1] != MPI_REQUEST_NULL) {
      // A payload larger than the posted tensor fails to arrive (truncation);
      // the header's mismatch is the better report.
      const int rc = MPI_Test(&reqs_[1], &flag, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS && mismatch_) throw Error(*mismatch_);
      mpi_check(rc, "MPI_Test");
      if (!flag) return Progress::Moving;
    }
    if (mismatch_) throw Error(*mismatch_);
    return Progress::Done;
  }

  // A mismatch is reported once the payload is out of MPI's hands too, so no
  // stray payload is left to match a later receive with the same tag.
  void check_header() {
    const Header& h = *header_;
    if (h.magic != kHeaderMagic || h.ndim < 0 || h.ndim > Shape::kMaxRank || h.dtype < 0 ||
        h.dtype > static_cast<int32_t>(DType::BF16) || h.tag != tag_.encode() || h.rank != peer_)
      throw Error(
          "rank {} received a malformed message header from rank {} for tag {} (magic {:#x}, "
          "tag {}, sender {}, dtype {}, ndim {})",
          comm_.rank(), peer_, tag_.str(), h.magic, h.tag, h.rank, h.dtype, h.ndim);
    Shape shape;
    shape.rank = h.ndim;
    for (int i = 0; i < h.ndim; ++i) shape.dims[static_cast<size_t>(i)] = h.dims[i];
    const auto dtype = static_cast<DType>(h.dtype);
    if (shape == posted_.shape() && dtype == posted_.dtype()) return;
    try {
      check_message(posted_, shape, dtype, peer_, tag_, comm_);
    } catch (const Error& e) {
      mismatch_ = e.what();
    }
  }

  const MpiCommunicator& comm_;
  Tensor posted_;
  int peer_;
  MessageTag tag_;
  std::unique_ptr<Header> header_;
  std::optional<std::string> mismatch_;
  MPI_Request reqs_[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
};

RequestPtr MpiCommunicator::isend(const Tensor& t, int peer, MessageTag tag) {
  check_host(t, "send");
  check_peer(peer, "send");
  return std::make_unique<SendRequest>(*this, t, peer, tag);
}

RequestPtr MpiCommunicator::irecv(const Tensor& t, int peer, MessageTag tag) {
  check_host(t, "recv");
  check_peer(peer, "recv");
  return std::make_unique<RecvRequest>(*this, t, peer, tag);
}

// A posted non-blocking collective, completed by the communicator's polling
// loop. MPI forbids freeing or cancelling one, so a request dropped before it
// completes is left to MPI (the job is ending with an error anyway).
class CollectiveRequest final : public Request {
 public:
  CollectiveRequest(MpiCommunicator& comm, MPI_Request req, size_t bytes, std::string what,
                    Tensor keep_alive)
      : comm_(comm),
        req_(req),
        bytes_(bytes),
        what_(std::move(what)),
        keep_(std::move(keep_alive)),
        number_(comm.next_collective()) {}

  bool test() override {
    if (req_ == MPI_REQUEST_NULL) return true;
    int flag = 0;
    mpi_check(MPI_Test(&req_, &flag, MPI_STATUS_IGNORE), "MPI_Test");
    return flag != 0;
  }
  // Past the deadline, the members that waited here name who never
  // arrived, as a blocking collective's do.
  void wait() override {
    try {
      comm_.poll([&] { return test() ? Progress::Done : Progress::Waiting; },
                 [&] { return what_; }, bytes_);
    } catch (const CommTimeout& e) {
      throw CommTimeout("{}; {}", e.what(), comm_.roll_call(number_));
    }
  }

 private:
  const MpiCommunicator& comm_;
  MPI_Request req_;
  size_t bytes_;
  std::string what_;
  Tensor keep_;     // a copy MPI reads from until done
  int64_t number_;  // the group's collective number (roll_call)
};

namespace {
std::string all_reduce_what(const Tensor& t, ReduceOp op) {
  return fmt::format("all_reduce ({}) of {} {}", reduce_op_name(op), dtype_name(t.dtype()),
                     t.shape().str());
}
}  // namespace

MPI_Request MpiCommunicator::post_all_reduce(const Tensor& t, ReduceOp op) {
  check_host(t, "all_reduce");
  const Reduction red = reduction(t, op, "all_reduce");
  MPI_Request req;
  mpi_check(MPI_Iallreduce(MPI_IN_PLACE, t.raw(), mpi_count(t.numel(), t, "all_reduce"), red.type,
                           red.op, comm_, &req),
            "MPI_Iallreduce");
  return req;
}

void MpiCommunicator::all_reduce(const Tensor& t, ReduceOp op) {
  MPI_Request req = post_all_reduce(t, op);
  wait_collective(req, 2 * t.nbytes(), [&] { return all_reduce_what(t, op); });
}

RequestPtr MpiCommunicator::iall_reduce(const Tensor& t, ReduceOp op) {
  MPI_Request req = post_all_reduce(t, op);
  return std::make_unique<CollectiveRequest>(*this, req, 2 * t.nbytes(), all_reduce_what(t, op),
                                             Tensor());
}

void MpiCommunicator::all_gather(const Tensor& in, const Tensor& out) {
  check_host(in, "all_gather");
  check_host(out, "all_gather");
  if (in.dtype() != out.dtype())
    throw Error("all_gather: input is {} but output is {}", dtype_name(in.dtype()),
                dtype_name(out.dtype()));
  if (out.numel() != size_ * in.numel())
    throw Error("all_gather in {}: output {} holds {} elements, not size ({}) x input {} ({})",
                describe(), out.shape().str(), out.numel(), size_, in.shape().str(), in.numel());
  const int count = mpi_count(copy_count(in), in, "all_gather");
  const MPI_Datatype type = kCopyType;
  // MPI forbids a send buffer inside the receive buffer except as MPI_IN_PLACE.
  const char* own_slot = out.data<char>() + static_cast<size_t>(rank_) * in.nbytes();
  const bool in_place = in.raw() == own_slot && in.nbytes() > 0;
  MPI_Request req;
  mpi_check(MPI_Iallgather(in_place ? MPI_IN_PLACE : in.raw(), count, type, out.raw(), count, type,
                           comm_, &req),
            "MPI_Iallgather");
  wait_collective(req, out.nbytes(), [&] {
    return fmt::format("all_gather of {} {}", dtype_name(in.dtype()), in.shape().str());
  });
}

void MpiCommunicator::reduce_scatter(const Tensor& in, const Tensor& out, ReduceOp op) {
  Tensor src;
  MPI_Request req = post_reduce_scatter(in, out, op, src);
  wait_collective(req, in.nbytes(), [&] { return reduce_scatter_what(in, op); });
}

RequestPtr MpiCommunicator::ireduce_scatter(const Tensor& in, const Tensor& out, ReduceOp op) {
  Tensor src;
  MPI_Request req = post_reduce_scatter(in, out, op, src);
  return std::make_unique<CollectiveRequest>(*this, req, in.nbytes(), reduce_scatter_what(in, op),
                                             src);
}

std::string MpiCommunicator::reduce_scatter_what(const Tensor& in, ReduceOp op) {
  return fmt::format("reduce_scatter ({}) of {} {}", reduce_op_name(op), dtype_name(in.dtype()),
                     in.shape().str());
}

MPI_Request MpiCommunicator::post_reduce_scatter(const Tensor& in, const Tensor& out, ReduceOp op,
                                                 Tensor& src) {
  check_host(in, "reduce_scatter");
  check_host(out, "reduce_scatter");
  if (in.dtype() != out.dtype())
    throw Error("reduce_scatter: input is {} but output is {}", dtype_name(in.dtype()),
                dtype_name(out.dtype()));
  if (in.numel() != size_ * out.numel())
    throw Error("reduce_scatter in {}: input {} holds {} elements, not size ({}) x output {} ({})",
                describe(), in.shape().str(), in.numel(), size_, out.shape().str(), out.numel());
  const Reduction red = reduction(in, op, "reduce_scatter");
  // MPI's in-place form keeps the result at the front, not at slice `rank`:
  // an output inside the input is reduced from a copy of the input instead.
  src = Tensor();
  const char* a = in.data<char>();
  const char* b = out.data<char>();
  if (out.nbytes() > 0 && b < a + in.nbytes() && a < b + out.nbytes()) src = in.clone();
  MPI_Request req;
  mpi_check(MPI_Ireduce_scatter_block(src.raw() ? src.raw() : in.raw(), out.raw(),
                                      mpi_count(out.numel(), out, "reduce_scatter"), red.type,
                                      red.op, comm_, &req),
            "MPI_Ireduce_scatter_block");
  return req;
}

void MpiCommunicator::broadcast(const Tensor& t, int root) {
  check_host(t, "broadcast");
  if (root < 0 || root >= size_)
    throw Error("broadcast: root {} is outside {} of size {}", root, describe(), size_);
  MPI_Request req;
  mpi_check(
      MPI_Ibcast(t.raw(), mpi_count(copy_count(t), t, "broadcast"), kCopyType, root, comm_, &req),
      "MPI_Ibcast");
  wait_collective(req, t.nbytes(), [&] {
    return fmt::format("broadcast of {} {} from rank {} (world rank {})", dtype_name(t.dtype()),
                       t.shape().str(), root, world_rank(root));
  });
}

void MpiCommunicator::barrier() {
  MPI_Request req;
  mpi_check(MPI_Ibarrier(comm_, &req), "MPI_Ibarrier");
  wait_collective(req, 0, [] { return std::string("barrier"); });
}

std::unique_ptr<Communicator> MpiCommunicator::split(const std::vector<std::vector<int>>& groups,
                                                     const std::string& name) {
  std::vector<int> group_of(static_cast<size_t>(size_), -1), position(static_cast<size_t>(size_));
  for (size_t g = 0; g < groups.size(); ++g) {
    if (groups[g].empty()) throw Error("split '{}' of {}: group {} is empty", name, describe(), g);
    for (size_t i = 0; i < groups[g].size(); ++i) {
      const int r = groups[g][i];
      if (r < 0 || r >= size_)
        throw Error("split '{}' of {}: rank {} in group {} is outside [0, {})", name, describe(), r,
                    g, size_);
      int& slot = group_of[static_cast<size_t>(r)];
      if (slot >= 0)
        throw Error("split '{}' of {}: rank {} is listed twice (groups {} and {})", name,
                    describe(), r, slot, g);
      slot = static_cast<int>(g);
      position[static_cast<size_t>(r)] = static_cast<int>(i);
    }
  }
  for (int r = 0; r < size_; ++r)
    if (group_of[static_cast<size_t>(r)] < 0)
      throw Error("split '{}' of {}: rank {} is in no group", name, describe(), r);

  // Every member must pass the same partition: compare a hash of it (max of
  // h and of -h equal h and -h only if all agree). This also brings the
  // members together politely, so the blocking MPI_Comm_split below does not
  // spin while waiting for a late one.
  uint32_t h = 2166136261u;
  auto mix = [&h](int v) { h = (h ^ static_cast<uint32_t>(v)) * 16777619u; };
  for (const auto& g : groups) {
    mix(-1);
    for (int r : g) mix(r);
  }
  Tensor agree = Tensor::empty({2}, DType::I32);
  const int32_t mine = static_cast<int32_t>(h & 0x3fffffff);
  agree.data<int32_t>()[0] = mine;
  agree.data<int32_t>()[1] = -mine;
  all_reduce(agree, ReduceOp::Max);
  check(agree.data<int32_t>()[0] == mine && agree.data<int32_t>()[1] == -mine,
        "split '{}' of {}: rank {} passed a partition that other members did not (every member "
        "must pass the same groups)",
        name, describe(), rank_);

  const int g = group_of[static_cast<size_t>(rank_)];
  MPI_Comm sub;
  mpi_check(MPI_Comm_split(comm_, g, position[static_cast<size_t>(rank_)], &sub), "MPI_Comm_split");
  std::vector<int> members;
  for (int r : groups[static_cast<size_t>(g)]) members.push_back(world_rank(r));
  return std::make_unique<MpiCommunicator>(sub, /*owned=*/true, std::move(members), name, spin_,
                                           options_);
}

}  // namespace

std::unique_ptr<Communicator> mpi_world(CommOptions options) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  check(initialized, "mpi_world: MPI is not initialised (run inside mpi_main)");
  // Errors come back as return codes and become weft::Error with the call's name.
  mpi_check(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  int* tag_ub = nullptr;
  int found = 0;
  mpi_check(MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &tag_ub, &found), "MPI_Comm_get_attr");
  check(found && *tag_ub >= 2 * kHeaderBit - 1,
        "this MPI's largest tag (MPI_TAG_UB = {}) is below {}, which message tags and their "
        "headers need",
        found ? *tag_ub : -1, 2 * kHeaderBit - 1);
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::vector<int> ranks(static_cast<size_t>(size));
  std::iota(ranks.begin(), ranks.end(), 0);
  return std::make_unique<MpiCommunicator>(MPI_COMM_WORLD, /*owned=*/false, std::move(ranks), "",
                                           spin_window(MPI_COMM_WORLD), options);
}

namespace {
// MPI's start-up has no deadline of its own: a rank that never joins (stopped,
// or failed to start) leaves the others inside MPI_Init with an empty log.
// This guard gives it --comm-timeout: past it the rank says why, naming
// itself from the launcher's environment, and exits 1 (the launcher then
// ends the job).
class StartupDeadline {
 public:
  explicit StartupDeadline(std::chrono::milliseconds timeout)
      : thread_([this, timeout] {
          std::unique_lock<std::mutex> lock(mu_);
          if (cv_.wait_for(lock, timeout, [this] { return done_; })) return;
          const LaunchInfo me = detect_launch();
          char host[256] = {};
          ::gethostname(host, sizeof host - 1);
          const std::string line = fmt::format(
              "rank {} (host {}, pid {}): error: MPI start-up did not finish within "
              "--comm-timeout {:g} s: a rank of the {} never joined (stopped, or failed to "
              "start; the launcher's output says which)\n",
              me.rank, host, ::getpid(), static_cast<double>(timeout.count()) / 1e3, me.size);
          std::fwrite(line.data(), 1, line.size(), stderr);
          std::fflush(stderr);
          std::_Exit(1);
        }) {}
  ~StartupDeadline() { finish(); }
  void finish() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};
}  // namespace

int mpi_main(int argc, char** argv, const std::function<int(Communicator&)>& fn,
             CommOptions options) {
  int provided = 0;
  StartupDeadline startup(options.timeout);
  // Only the main thread calls MPI (OpenMP threads compute, never communicate).
  if (MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS) {
    std::fputs("error: MPI_Init_thread failed\n", stderr);
    return 1;
  }
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  int status = 0;
  try {
    check(provided >= MPI_THREAD_FUNNELED, "MPI provides thread level {}, weft needs {} (FUNNELED)",
          provided, static_cast<int>(MPI_THREAD_FUNNELED));
    auto world = mpi_world(options);
    startup.finish();
    status = fn(*world);
    // Ranks finish at different times; wait for the others here, politely and
    // with a deadline, rather than spinning inside MPI_Finalize.
    world->barrier();
  } catch (const std::exception& e) {
    std::string what = e.what();
    std::replace(what.begin(), what.end(), '\n', ' ');
    // One write, so lines of ranks failing together do not interleave.
    const std::string line = fmt::format("rank {}: error: {}\n", rank, what);
    std::fwrite(line.data(), 1, line.size(), stderr);
    std::fflush(stderr);
    // Hydra forwards a rank's stderr through its proxy, which may act on the
    // abort before it has read the line (the line was lost in ~1 of 15 jobs
    // on 2 cores); a moment's pause lets the line out first.
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  MPI_Finalize();
  return status;
}

}  // namespace weft
