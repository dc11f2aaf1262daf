// NCCL for device tensors; host tensors through the host communicator.
#include <weft/cuda/runtime.h>
#include <weft/nccl_communicator.h>

#include <cuda_runtime.h>
#include <nccl.h>

#include <fmt/ranges.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string_view>
#include <thread>
#include <tuple>

namespace weft {

namespace {

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error("{} failed: {}", what, cudaGetErrorString(e));
}
void nccl_check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) throw Error("{} failed: {}", what, ncclGetErrorString(r));
}
// A call on a non-blocking communicator: ncclInProgress means it goes on in
// the background (ncclCommGetAsyncError says when it is done). Returns
// whether it does.
bool nccl_started(ncclResult_t r, const char* what) {
  if (r == ncclInProgress) return true;
  nccl_check(r, what);
  return false;
}

// Every communicator is non-blocking (NCCL's `blocking = 0`): its creation
// returns at once and is then polled against --comm-timeout, so that a rank
// whose peers never arrive stops with a message instead of hanging in
// ncclCommInitRank. Calls on it may likewise return ncclInProgress before
// their work is queued on the stream; launch() waits for that.
ncclConfig_t non_blocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

// True once `comm`'s background work (its creation, a launch) is done;
// throws Error when it failed.
bool settled(ncclComm_t comm, const char* what) {
  ncclResult_t state = ncclSuccess;
  nccl_check(ncclCommGetAsyncError(comm, &state), "ncclCommGetAsyncError");
  if (state == ncclInProgress) return false;
  nccl_check(state, what);
  return true;
}

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::F32: return ncclFloat32;
    case DType::I32: return ncclInt32;
    case DType::BF16: return ncclBfloat16;
  }
  return ncclFloat32;
}

ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::Sum ? ncclSum : ncclMax; }

// The completion of NCCL work on the communication stream: an event recorded
// after it. The requests of one p2p group share one; until the group is
// closed and launched, `done` is null.
struct Launch {
  cudaEvent_t done = nullptr;
  Launch() = default;
  Launch(const Launch&) = delete;
  Launch& operator=(const Launch&) = delete;
  ~Launch() {
    if (done != nullptr) cudaEventDestroy(done);
  }
};

// The shape/dtype header that the first message of each tag between two
// ranks (every message, with WEFT_NCCL_CHECK_MESSAGES=1) sends over the host
// transport beside its NCCL payload, so that the receiver checks what came.
constexpr int64_t kHeaderInts = 2 + Shape::kMaxRank;

Tensor header_of(const Tensor& t) {
  Tensor header = Tensor::zeros({kHeaderInts}, DType::I32);
  int32_t* h = header.data<int32_t>();
  h[0] = static_cast<int32_t>(t.dtype());
  h[1] = t.rank();
  for (int i = 0; i < t.rank(); ++i) h[2 + i] = static_cast<int32_t>(t.dim(i));
  return header;
}

// Whether every point-to-point message carries its header
// (WEFT_NCCL_CHECK_MESSAGES=1), not only each tag's first.
bool check_every_message() {
  static const bool yes = [] {
    const char* v = std::getenv("WEFT_NCCL_CHECK_MESSAGES");
    return v != nullptr && std::string_view(v) == "1";
  }();
  return yes;
}

class NcclCommunicator;

// A send, a receive or a non-blocking collective on NCCL: complete when its
// launch's event has fired and, for a message that carries a header, once
// the header has gone (a send) or has come and matched the posted tensor (a
// receive, which otherwise aborts the communicator and throws naming both).
class NcclRequest final : public Request {
 public:
  using Check = std::function<void(const Tensor& header)>;
  NcclRequest(NcclCommunicator& comm, std::shared_ptr<Launch> launch, std::string what)
      : comm_(comm), launch_(std::move(launch)), what_(std::move(what)) {}
  void carry_header(RequestPtr req, Tensor header, Check check) {
    header_req_ = std::move(req);
    header_ = std::move(header);
    check_ = std::move(check);
  }
  bool test() override;
  void wait() override;
  bool device_ordered() const override { return true; }
  void wait_on_device() override;

 private:
  bool header_checked();

  NcclCommunicator& comm_;
  std::shared_ptr<Launch> launch_;
  RequestPtr header_req_;  // the header's host send or receive
  Tensor header_;          // what it reads or writes, alive until it completes
  Check check_;            // a receive's check of what came
  std::string what_;
  bool done_ = false;
  bool ordered_ = false;  // the compute stream waits for it (wait_on_device)
};

class NcclCommunicator final : public Communicator {
 public:
  // `host` carries host tensors, the p2p headers and barriers; `owned_host`
  // is it when this communicator owns it (a split), else null.
  NcclCommunicator(Communicator& host, std::unique_ptr<Communicator> owned_host, int device,
                   ncclComm_t comm, std::string name, std::vector<int> world_ranks,
                   CommOptions options)
      : Communicator(options), owned_host_(std::move(owned_host)), host_(host), device_(device),
        comm_(comm), name_(std::move(name)), world_ranks_(std::move(world_ranks)) {
    cuda_check(cudaSetDevice(device_), "cudaSetDevice");
    cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    cuda_check(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming), "cudaEventCreate");
    nccl_check(ncclCommUserRank(comm_, &rank_), "ncclCommUserRank");
    nccl_check(ncclCommCount(comm_, &size_), "ncclCommCount");
  }
  ~NcclCommunicator() override {
    if (watchdog_.joinable()) {
      {
        std::lock_guard<std::mutex> lock(watch_mu_);
        stop_ = true;
      }
      watch_cv_.notify_all();
      watchdog_.join();
    }
    cudaSetDevice(device_);
    if (!aborted_) ncclCommDestroy(comm_);  // an aborted one is already freed
    cudaEventDestroy(ready_);
    cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int world_rank(int r) const override {
    check(r >= 0 && r < size_, "rank {} is outside {} of size {}", r, describe(), size_);
    return world_ranks_[static_cast<size_t>(r)];
  }
  std::string describe() const override {
    return name_ == "world" ? "nccl world"
                            : fmt::format("nccl {} [{}]", name_, fmt::join(world_ranks_, ", "));
  }

  // A message goes to NCCL at once (in a group: at group_end), never behind
  // a wait of the host's. Its shape and dtype are the posted tensor's: the
  // first message of each (peer, tag) also sends a header over the host
  // transport, which the receiver checks when it waits; later ones are held
  // to the shape that header carried (a pipeline's shapes are fixed by its
  // schedule and graph), each side checking its own tensor.
  RequestPtr isend(const Tensor& t, int peer, MessageTag tag) override {
    if (!on_device(t, "isend")) return host().isend(t, peer, tag);
    return post(true, t, peer, tag);
  }

  RequestPtr irecv(const Tensor& t, int peer, MessageTag tag) override {
    if (!on_device(t, "irecv")) return host().irecv(t, peer, tag);
    return post(false, t, peer, tag);
  }

  // The sends and receives of one group go to NCCL together at group_end,
  // inside one ncclGroupStart/ncclGroupEnd, so that none waits behind
  // another (NCCL matches them with the peers' groups as they come).
  void group_start() override {
    check(!in_group_, "group_start in {}: a group is already open (groups do not nest)",
          describe());
    in_group_ = true;
    pending_.clear();
    group_launch_ = std::make_shared<Launch>();
  }

  void group_end() override {
    check(in_group_, "group_end in {} without group_start", describe());
    in_group_ = false;
    std::vector<Pending> ops = std::move(pending_);
    pending_.clear();
    std::shared_ptr<Launch> group = std::move(group_launch_);
    if (ops.empty()) return;
    std::shared_ptr<Launch> l = launch(fmt::format("group of {} sends and receives", ops.size()),
                                       [&] {
                                         for (const Pending& op : ops)
                                           op.send ? enqueue_send(op.t, op.peer)
                                                   : enqueue_recv(op.t, op.peer);
                                       });
    group->done = std::exchange(l->done, nullptr);
  }

  void all_reduce(const Tensor& t, ReduceOp op) override {
    if (!on_device(t, "all_reduce")) return host().all_reduce(t, op);
    iall_reduce(t, op)->wait_on_device();
  }
  void all_gather(const Tensor& in, const Tensor& out) override {
    if (!on_device(in, out, "all_gather")) return host().all_gather(in, out);
    iall_gather(in, out)->wait_on_device();
  }
  void reduce_scatter(const Tensor& in, const Tensor& out, ReduceOp op) override {
    if (!on_device(in, out, "reduce_scatter")) return host().reduce_scatter(in, out, op);
    ireduce_scatter(in, out, op)->wait_on_device();
  }

  void broadcast(const Tensor& t, int root) override {
    if (!on_device(t, "broadcast")) return host().broadcast(t, root);
    check(root >= 0 && root < size_, "broadcast root {} is outside {} of size {}", root,
          describe(), size_);
    collective(fmt::format("broadcast from rank {}", root), {&t}, [&] {
      nccl_started(ncclBroadcast(t.raw(), t.raw(), count(t), nccl_type(t.dtype()), root, comm_,
                                 stream_),
                   "ncclBroadcast");
    })->wait_on_device();
  }

  // Every caller of a barrier orders host work (checkpoints, start-up).
  void barrier() override {
    check(!in_group_, "barrier in {} inside a p2p group", describe());
    host().barrier();
  }

  RequestPtr iall_reduce(const Tensor& t, ReduceOp op) override {
    if (!on_device(t, "iall_reduce")) return host().iall_reduce(t, op);
    check_reducible(t, op, "all_reduce");
    return collective(fmt::format("all_reduce {}", reduce_op_name(op)), {&t}, [&] {
      nccl_started(ncclAllReduce(t.raw(), t.raw(), count(t), nccl_type(t.dtype()), nccl_op(op),
                                 comm_, stream_),
                   "ncclAllReduce");
    });
  }

  RequestPtr ireduce_scatter(const Tensor& in, const Tensor& out, ReduceOp op) override {
    if (!on_device(in, out, "ireduce_scatter")) return host().ireduce_scatter(in, out, op);
    check_reducible(in, op, "reduce_scatter");
    check(in.numel() == out.numel() * size_ && in.dtype() == out.dtype(),
          "reduce_scatter in {}: input {} {} must hold {} x {} {} elements", describe(),
          dtype_name(in.dtype()), in.shape().str(), size_, out.numel(), dtype_name(out.dtype()));
    return collective(fmt::format("reduce_scatter {}", reduce_op_name(op)), {&in, &out}, [&] {
      nccl_started(ncclReduceScatter(in.raw(), out.raw(), count(out), nccl_type(in.dtype()),
                                     nccl_op(op), comm_, stream_),
                   "ncclReduceScatter");
    });
  }

  RequestPtr iall_gather(const Tensor& in, const Tensor& out) override {
    if (!on_device(in, out, "iall_gather")) return host().iall_gather(in, out);
    check(out.numel() == in.numel() * size_ && in.dtype() == out.dtype(),
          "all_gather in {}: output {} {} must hold {} x {} {} elements", describe(),
          dtype_name(out.dtype()), out.shape().str(), size_, in.numel(), dtype_name(in.dtype()));
    return collective("all_gather", {&in, &out}, [&] {
      nccl_started(ncclAllGather(in.raw(), out.raw(), count(in), nccl_type(in.dtype()), comm_,
                                 stream_),
                   "ncclAllGather");
    });
  }

  // ncclCommSplit over this communicator (collective: every member calls it
  // with its group's index as the colour), and the same split of the host
  // transport for the new group's host tensors and headers.
  std::unique_ptr<Communicator> split(const std::vector<std::vector<int>>& groups,
                                      const std::string& name) override {
    check(!in_group_, "split '{}' of {} inside a p2p group", name, describe());
    std::unique_ptr<Communicator> host_group = host().split(groups, name);  // checks the partition
    int color = -1, key = -1;
    for (size_t g = 0; g < groups.size(); ++g)
      for (size_t i = 0; i < groups[g].size(); ++i)
        if (groups[g][i] == rank_) color = static_cast<int>(g), key = static_cast<int>(i);
    check(color >= 0, "split '{}' of {}: rank {} is in none of the groups", name, describe(),
          rank_);
    rethrow_watchdog();
    std::lock_guard<std::recursive_mutex> lock(nccl_mu_);
    check(!aborted_, "split '{}' of {}: the communicator was aborted after a timeout", name,
          describe());
    cuda_check(cudaSetDevice(device_), "cudaSetDevice");
    ncclComm_t sub = nullptr;
    ncclConfig_t config = non_blocking_config();
    nccl_started(ncclCommSplit(comm_, color, key, &sub, &config), "ncclCommSplit");
    // A non-blocking split may hand the new communicator back only when its
    // background work has run (NCCL 2.28 on an H200: still null when
    // ncclCommSplit returned), which the parent's state says: read it (as
    // that work may write it) once the parent has settled.
    const std::atomic_ref<ncclComm_t> handed(sub);
    const int members_n = static_cast<int>(groups[static_cast<size_t>(color)].size());
    await_setup(
        fmt::format("NCCL communicator set-up (ncclCommSplit '{}' of {})", name, describe()), key,
        members_n, options_.timeout,
        [&] {
          if (!settled(comm_, "ncclCommSplit")) return false;
          check(handed.load() != nullptr, "ncclCommSplit '{}' of {} gave rank {} no communicator",
                name, describe(), rank_);
          return settled(handed.load(), "ncclCommSplit");
        },
        [&] {
          if (ncclComm_t c = handed.load()) ncclCommAbort(c);
        });
    std::vector<int> members;
    for (int r : groups[static_cast<size_t>(color)]) members.push_back(world_rank(r));
    Communicator& h = *host_group;
    return std::make_unique<NcclCommunicator>(h, std::move(host_group), device_, sub, name,
                                              members, options_);
  }

  // Polls `done` with growing sleeps (20 us to 1 ms) until it holds; past the
  // deadline, aborts the NCCL communicator (its kernels would otherwise spin
  // for ever) and throws CommTimeout naming `what`.
  void poll(const std::string& what, const std::function<bool()>& done) {
    const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
    auto pause = std::chrono::microseconds(20);
    while (!done()) {
      if (std::chrono::steady_clock::now() > deadline) {
        abort();
        throw CommTimeout(waiting_for("NCCL " + what) + " (the NCCL communicator was aborted)");
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
    }
  }

  // Throws Error when NCCL has reported an asynchronous failure (a network
  // error, a peer's abort).
  void check_async(const std::string& what) {
    rethrow_watchdog();
    std::lock_guard<std::recursive_mutex> lock(nccl_mu_);
    if (aborted_) throw Error("NCCL {} in {}: the communicator was aborted", what, describe());
    ncclResult_t async = ncclSuccess;
    nccl_check(ncclCommGetAsyncError(comm_, &async), "ncclCommGetAsyncError");
    if (async != ncclSuccess && async != ncclInProgress)
      throw Error("NCCL {} failed in {}: {}", what, describe(), ncclGetErrorString(async));
  }

 private:
  struct Pending {
    bool send;
    Tensor t;
    int peer;
  };

  // A send or receive of a device tensor: to NCCL now, or at group_end; the
  // first of its (peer, tag) with its header over the host transport.
  RequestPtr post(bool send, const Tensor& t, int peer, const MessageTag& tag) {
    check_peer(peer, send ? "isend" : "irecv");
    keep_for_stream(t);
    std::string what =
        fmt::format("{} rank {} tag {}", send ? "send to" : "recv from", peer, tag.str());
    const bool header = first_of(send, t, peer, tag);
    std::shared_ptr<Launch> l;
    if (in_group_) {
      pending_.push_back({send, t, peer});
      l = group_launch_;
    } else {
      l = launch(what, [&] { send ? enqueue_send(t, peer) : enqueue_recv(t, peer); });
    }
    auto req = std::make_unique<NcclRequest>(*this, std::move(l), std::move(what));
    if (header && send) {
      Tensor bytes = header_of(t);
      req->carry_header(host().isend(bytes, peer, tag), bytes, nullptr);
    } else if (header) {
      Tensor bytes = Tensor::zeros({kHeaderInts}, DType::I32);
      req->carry_header(host().irecv(bytes, peer, tag), bytes,
                        [this, t, peer, tag](const Tensor& h) { check_header(t, h, peer, tag); });
    }
    return req;
  }

  // Whether this message is the first of its (direction, peer, tag), which
  // carries a header (or every one does: WEFT_NCCL_CHECK_MESSAGES=1); a later
  // one must have the first one's shape and dtype.
  bool first_of(bool send, const Tensor& t, int peer, const MessageTag& tag) {
    const auto key = std::make_tuple(send, peer, tag.encode());
    const auto it = shapes_.find(key);
    if (it == shapes_.end()) {
      shapes_.emplace(key, std::make_pair(t.shape(), t.dtype()));
      return true;
    }
    check(it->second.first == t.shape() && it->second.second == t.dtype(),
          "rank {} (world rank {}) {} {} {} {} rank {} (world rank {}) with tag {} in {}, whose "
          "first message was {} {}: over NCCL a tag's messages keep its first message's shape "
          "(WEFT_NCCL_CHECK_MESSAGES=1 checks every message)",
          rank_, world_rank(rank_), send ? "sends" : "posts a receive for", dtype_name(t.dtype()),
          t.shape().str(), send ? "to" : "from", peer, world_rank(peer), tag.str(), describe(),
          dtype_name(it->second.second), it->second.first.str());
    return check_every_message();
  }

  // The host transport, with this communicator's step and deadline.
  Communicator& host() {
    host_.set_step(step());
    host_.set_timeout(options_.timeout);
    return host_;
  }

  // False for a host tensor (the host transport carries it); true for one on
  // this communicator's GPU; throws for any other device.
  bool on_device(const Tensor& t, const char* op) const {
    if (t.device().is_cpu()) return false;
    check(t.device() == Device::cuda(device_), "{} in {}: NCCL here drives cuda:{}, not {}", op,
          describe(), device_, t.device().str());
    return true;
  }
  bool on_device(const Tensor& in, const Tensor& out, const char* op) const {
    const bool a = on_device(in, op), b = on_device(out, op);
    check(a == b, "{} in {}: input on {} but output on {}", op, describe(), in.device().str(),
          out.device().str());
    return a;
  }
  void check_peer(int peer, const char* op) const {
    check(peer >= 0 && peer < size_, "{} peer {} is outside {} of size {}", op, peer, describe(),
          size_);
  }
  void check_reducible(const Tensor& t, ReduceOp op, const char* what) const {
    check(t.dtype() != DType::BF16 || op == ReduceOp::Sum,
          "{} ({}) in {} of bf16 tensors is not supported (bf16 sums only)", what,
          reduce_op_name(op), describe());
  }
  // A receive's header against its tensor. NCCL has already been given the
  // receive, whose count differs from the send's: the communicator is
  // aborted (its work would never end well) before the error is thrown.
  void check_header(const Tensor& posted, const Tensor& header, int peer,
                    const MessageTag& tag) {
    const int32_t* d = header.data<int32_t>();
    Shape arrived;
    arrived.rank = d[1];
    for (int i = 0; i < arrived.rank; ++i) arrived[i] = d[2 + i];
    try {
      check_message(posted, arrived, static_cast<DType>(d[0]), peer, tag, *this);
    } catch (const Error&) {
      abort();
      throw;
    }
  }

 public:
  // Aborts the NCCL communicator (its kernels end; its queued work completes
  // without effect). From the watchdog's thread too.
  void abort() {
    std::lock_guard<std::recursive_mutex> lock(nccl_mu_);
    if (!aborted_) {
      ncclCommAbort(comm_);
      aborted_ = true;
    }
  }

  // The compute stream waits for `l` (the host does not), and the watchdog
  // watches it against the deadline.
  void order_after(const std::shared_ptr<Launch>& l, const std::string& what) {
    rethrow_watchdog();
    cuda_check(cudaSetDevice(device_), "cudaSetDevice");
    cuda_check(cudaStreamWaitEvent(cuda::context(device_).compute_stream(), l->done, 0),
               "cudaStreamWaitEvent");
    std::lock_guard<std::mutex> lock(watch_mu_);
    watched_.push_back({l, std::chrono::steady_clock::now() + options_.timeout,
                        waiting_for("NCCL " + what) +
                            " (the NCCL watchdog aborted the communicator)",
                        what, step()});
    if (!watchdog_.joinable()) watchdog_ = std::thread([this] { watch(); });
    watch_cv_.notify_one();
  }

  // What the watchdog found, thrown by every call after it.
  void rethrow_watchdog() {
    std::lock_guard<std::mutex> lock(watch_mu_);
    if (failure_.empty()) return;
    if (failure_timed_out_) throw CommTimeout(failure_);
    throw Error("{}", failure_);
  }

 private:
  static size_t count(const Tensor& t) { return static_cast<size_t>(t.numel()); }

  void enqueue_send(const Tensor& t, int peer) {
    nccl_started(ncclSend(t.raw(), count(t), nccl_type(t.dtype()), peer, comm_, stream_),
                 "ncclSend");
  }
  void enqueue_recv(const Tensor& t, int peer) {
    nccl_started(ncclRecv(t.raw(), count(t), nccl_type(t.dtype()), peer, comm_, stream_),
                 "ncclRecv");
  }

  template <typename F>
  RequestPtr collective(std::string what, std::initializer_list<const Tensor*> tensors,
                        F&& enqueue) {
    check(!in_group_, "{} in {} inside a p2p group (groups hold sends and receives only)", what,
          describe());
    for (const Tensor* t : tensors) keep_for_stream(*t);
    std::shared_ptr<Launch> l = launch(what, enqueue);
    return std::make_unique<NcclRequest>(*this, std::move(l), std::move(what));
  }

  // A block freed while this stream may still use it waits for it
  // (CachingAllocator::record_stream).
  void keep_for_stream(const Tensor& t) {
    if (t.nbytes() > 0) cuda::context(device_).allocator().record_stream(t.raw(), stream_);
  }

  // Queues `enqueue`'s NCCL calls on the communication stream after the
  // caller's work (weft's kernels on the compute stream, and anything on this
  // thread's default stream), inside one NCCL group, and records the event
  // that says they are done.
  template <typename F>
  std::shared_ptr<Launch> launch(const std::string& what, F&& enqueue) {
    rethrow_watchdog();
    std::lock_guard<std::recursive_mutex> lock(nccl_mu_);
    check(!aborted_, "NCCL {} in {}: the communicator was aborted after a timeout", what,
          describe());
    check_async(what);  // a peer's abort or a network error, named before NCCL refuses the call
    cuda_check(cudaSetDevice(device_), "cudaSetDevice");
    for (cudaStream_t before : {cuda::context(device_).compute_stream(), cudaStreamPerThread}) {
      cuda_check(cudaEventRecord(ready_, before), "cudaEventRecord");
      cuda_check(cudaStreamWaitEvent(stream_, ready_, 0), "cudaStreamWaitEvent");
    }
    nccl_check(ncclGroupStart(), "ncclGroupStart");
    try {
      enqueue();
    } catch (...) {
      ncclGroupEnd();
      throw;
    }
    // Non-blocking: the group may still be on its way to the stream; the
    // event below must come after it, so wait (with the deadline) for NCCL
    // to finish queuing it.
    if (nccl_started(ncclGroupEnd(), "ncclGroupEnd"))
      poll(what, [this, &what] { return settled(comm_, what.c_str()); });
    auto l = std::make_shared<Launch>();
    cuda_check(cudaEventCreateWithFlags(&l->done, cudaEventDisableTiming), "cudaEventCreate");
    cuda_check(cudaEventRecord(l->done, stream_), "cudaEventRecord");
    return l;
  }

  // The watchdog: what the host stopped waiting for (wait_on_device), in
  // stream order, each done once its event has fired. Past an entry's
  // deadline, or on NCCL's asynchronous error, it aborts the communicator
  // (so that the device's work ends), prints what never completed, and
  // leaves the message for the next call to throw.
  void watch() {
    cudaSetDevice(device_);
    std::unique_lock<std::mutex> lock(watch_mu_);
    auto pause = std::chrono::microseconds(50);
    while (!stop_) {
      if (watched_.empty() || !failure_.empty()) {
        watch_cv_.wait(lock);
        pause = std::chrono::microseconds(50);
        continue;
      }
      const Watched w = watched_.front();
      lock.unlock();
      const bool done = cudaEventQuery(w.launch->done) == cudaSuccess;
      ncclResult_t async = ncclSuccess;
      {
        std::lock_guard<std::recursive_mutex> nccl(nccl_mu_);
        if (!aborted_) ncclCommGetAsyncError(comm_, &async);
      }
      const bool late = !done && std::chrono::steady_clock::now() > w.deadline;
      const bool failed = async != ncclSuccess && async != ncclInProgress;
      if (late || failed) {
        const std::string message =
            late ? w.timeout_message
                 : fmt::format("rank {} (world rank {}): NCCL failed in {}: {}, while the device "
                               "waited for {} at {} (the NCCL watchdog aborted the communicator)",
                               rank_, world_rank(rank_), describe(), ncclGetErrorString(async),
                               w.what, w.step);
        abort();
        fmt::print(stderr, "NCCL watchdog: {}\n", message);
        std::fflush(stderr);
        lock.lock();
        failure_ = message;
        failure_timed_out_ = late;
        watched_.clear();
        continue;
      }
      lock.lock();
      if (done) {
        if (!watched_.empty() && watched_.front().launch == w.launch) watched_.pop_front();
        pause = std::chrono::microseconds(50);
        continue;
      }
      watch_cv_.wait_for(lock, pause);
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
    }
  }

  struct Watched {
    std::shared_ptr<Launch> launch;
    std::chrono::steady_clock::time_point deadline;
    std::string timeout_message;  // CommTimeout's, made when the host moved on
    std::string what, step;       // the operation, and the step it was waited for at
  };

  std::unique_ptr<Communicator> owned_host_;  // declared first: host_ may refer to it
  Communicator& host_;
  int device_;
  ncclComm_t comm_;
  std::recursive_mutex nccl_mu_;  // comm_'s calls and its abort, from two threads
  std::atomic<bool> aborted_{false};
  std::mutex watch_mu_;
  std::condition_variable watch_cv_;
  std::deque<Watched> watched_;
  std::string failure_;  // what the watchdog found
  bool failure_timed_out_ = false;
  bool stop_ = false;
  std::thread watchdog_;
  std::string name_;
  std::vector<int> world_ranks_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ready_ = nullptr;
  int rank_ = 0, size_ = 1;
  bool in_group_ = false;
  std::vector<Pending> pending_;
  std::map<std::tuple<bool, int, int32_t>, std::pair<Shape, DType>> shapes_;
  std::shared_ptr<Launch> group_launch_;
};

bool NcclRequest::header_checked() {
  if (!header_req_) return true;
  if (!header_req_->test()) return false;
  if (check_) check_(header_);
  header_req_.reset();
  return true;
}

bool NcclRequest::test() {
  if (done_) return true;
  if (launch_->done == nullptr) return false;  // its group is still open
  if (!header_checked()) return false;
  const cudaError_t e = cudaEventQuery(launch_->done);
  comm_.check_async(what_);
  if (e == cudaErrorNotReady) return false;
  cuda_check(e, "cudaEventQuery");
  done_ = true;
  return true;
}

void NcclRequest::wait() {
  check(done_ || launch_->done != nullptr,
        "NCCL {} in {} waited for inside its open group: close the group first (group_end)",
        what_, comm_.describe());
  comm_.poll(what_, [this] { return test(); });
}

// The host waits only for a first message's header (the host transport's,
// at the first step); the device waits for the rest.
void NcclRequest::wait_on_device() {
  check(done_ || launch_->done != nullptr,
        "NCCL {} in {} waited for inside its open group: close the group first (group_end)",
        what_, comm_.describe());
  if (done_ || ordered_) return;
  comm_.poll(what_, [this] { return header_checked(); });
  comm_.order_after(launch_, what_);
  ordered_ = true;
}

}  // namespace

bool nccl_built() { return true; }

bool nccl_ranks_as_hosts() {
  const char* v = std::getenv("WEFT_NCCL_ONE_GPU");
  return v != nullptr && std::string_view(v) == "1";
}

std::unique_ptr<Communicator> nccl_world(Communicator& host, int device, CommOptions options) {
  if (nccl_ranks_as_hosts()) {
    char name[256] = {};
    gethostname(name, sizeof name - 1);
    const std::string id = fmt::format("{}-weft-rank-{}", name, host.world_rank(host.rank()));
    setenv("NCCL_HOSTID", id.c_str(), 1);
    setenv("NCCL_SOCKET_IFNAME", "lo", 0);
    setenv("NCCL_IB_DISABLE", "1", 0);
  }
  cuda_check(cudaSetDevice(device), "cudaSetDevice");
  ncclUniqueId id;
  static_assert(sizeof(id) % 4 == 0);
  Tensor id_bytes = Tensor::zeros({static_cast<int64_t>(sizeof(id) / 4)}, DType::I32);
  if (host.rank() == 0) {
    nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    std::memcpy(id_bytes.raw(), &id, sizeof(id));
  }
  host.broadcast(id_bytes, 0);
  std::memcpy(&id, id_bytes.raw(), sizeof(id));
  ncclComm_t comm = nullptr;
  ncclConfig_t config = non_blocking_config();
  nccl_started(ncclCommInitRankConfig(&comm, host.size(), id, host.rank(), &config),
               "ncclCommInitRankConfig");
  check(comm != nullptr, "ncclCommInitRankConfig gave rank {} of {} no communicator", host.rank(),
        host.size());
  await_setup("NCCL communicator set-up (ncclCommInitRank)", host.rank(), host.size(),
              options.timeout, [&] { return settled(comm, "ncclCommInitRankConfig"); },
              [&] { ncclCommAbort(comm); });
  std::vector<int> ranks;
  for (int r = 0; r < host.size(); ++r) ranks.push_back(host.world_rank(r));
  return std::make_unique<NcclCommunicator>(host, nullptr, device, comm, "world", ranks, options);
}

}  // namespace weft
