// NCCL for device tensors; host tensors through the host communicator.
#include <weft/cuda/runtime.h>
#include <weft/nccl_communicator.h>

#include <cuda_runtime.h>
#include <nccl.h>

#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <thread>

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

// The shape/dtype header a point-to-point message sends ahead over the host
// transport, so that the receiver checks what arrives.
constexpr int64_t kHeaderInts = 2 + Shape::kMaxRank;

Tensor header_of(const Tensor& t) {
  Tensor header = Tensor::zeros({kHeaderInts}, DType::I32);
  int32_t* h = header.data<int32_t>();
  h[0] = static_cast<int32_t>(t.dtype());
  h[1] = t.rank();
  for (int i = 0; i < t.rank(); ++i) h[2 + i] = static_cast<int32_t>(t.dim(i));
  return header;
}

class NcclCommunicator;

// A send, a receive or a non-blocking collective on NCCL: complete when its
// launch's event has fired (and a send's header has left).
class NcclRequest final : public Request {
 public:
  NcclRequest(NcclCommunicator& comm, std::shared_ptr<Launch> launch, RequestPtr header,
              Tensor header_bytes, std::string what)
      : comm_(comm), launch_(std::move(launch)), header_(std::move(header)),
        header_bytes_(std::move(header_bytes)), what_(std::move(what)) {}
  bool test() override;
  void wait() override;

 private:
  NcclCommunicator& comm_;
  std::shared_ptr<Launch> launch_;
  RequestPtr header_;   // a send's header on the host transport
  Tensor header_bytes_;  // what it reads, alive until it completes
  std::string what_;
  bool done_ = false;
};

// A receive outside a group: its NCCL part is queued only once its header has
// arrived and matched the posted tensor, so that posting it never blocks.
class HeaderFirstRecv final : public Request {
 public:
  using Start = std::function<RequestPtr(const Tensor& header)>;
  HeaderFirstRecv(NcclCommunicator& comm, Tensor header, RequestPtr header_req, Start start,
                  std::string what)
      : comm_(comm), header_(std::move(header)), header_req_(std::move(header_req)),
        start_(std::move(start)), what_(std::move(what)) {}
  bool test() override {
    if (!payload_) {
      if (!header_req_->test()) return false;
      payload_ = start_(header_);
    }
    return payload_->test();
  }
  void wait() override;

 private:
  NcclCommunicator& comm_;
  Tensor header_;
  RequestPtr header_req_;
  Start start_;
  RequestPtr payload_;
  std::string what_;
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

  RequestPtr isend(const Tensor& t, int peer, MessageTag tag) override {
    if (!on_device(t, "isend")) return host().isend(t, peer, tag);
    check_peer(peer, "isend");
    keep_for_stream(t);
    std::string what = fmt::format("send to rank {} tag {}", peer, tag.str());
    Tensor header_bytes = header_of(t);
    RequestPtr header = host().isend(header_bytes, peer, tag);
    if (in_group_) {
      pending_.push_back({true, t, peer, tag, Tensor(), nullptr});
      return std::make_unique<NcclRequest>(*this, group_launch_, std::move(header),
                                            std::move(header_bytes), std::move(what));
    }
    std::shared_ptr<Launch> l = launch(what, [&] { enqueue_send(t, peer); });
    return std::make_unique<NcclRequest>(*this, std::move(l), std::move(header),
                                          std::move(header_bytes), std::move(what));
  }

  RequestPtr irecv(const Tensor& t, int peer, MessageTag tag) override {
    if (!on_device(t, "irecv")) return host().irecv(t, peer, tag);
    check_peer(peer, "irecv");
    keep_for_stream(t);
    std::string what = fmt::format("recv from rank {} tag {}", peer, tag.str());
    Tensor header = Tensor::zeros({kHeaderInts}, DType::I32);
    RequestPtr header_req = host().irecv(header, peer, tag);
    if (in_group_) {
      pending_.push_back({false, t, peer, tag, header, std::move(header_req)});
      return std::make_unique<NcclRequest>(*this, group_launch_, nullptr, Tensor(),
                                            std::move(what));
    }
    auto start = [this, t, peer, tag, what](const Tensor& h) -> RequestPtr {
      check_header(t, h, peer, tag);
      std::shared_ptr<Launch> l = launch(what, [&] { enqueue_recv(t, peer); });
      return std::make_unique<NcclRequest>(*this, std::move(l), nullptr, Tensor(), what);
    };
    return std::make_unique<HeaderFirstRecv>(*this, header, std::move(header_req), start, what);
  }

  // The sends and receives of one group go to NCCL together at group_end,
  // inside one ncclGroupStart/ncclGroupEnd, after every receive's header has
  // arrived and matched (NCCL needs equal counts on both sides). Waiting for
  // those headers is where a blocking receive would have waited.
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
    host();  // the host transport's waits name this step
    for (Pending& op : ops)
      if (!op.send) {
        op.header_req->wait();
        check_header(op.t, op.header, op.peer, op.tag);
      }
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
    iall_reduce(t, op)->wait();
  }
  void all_gather(const Tensor& in, const Tensor& out) override {
    if (!on_device(in, out, "all_gather")) return host().all_gather(in, out);
    iall_gather(in, out)->wait();
  }
  void reduce_scatter(const Tensor& in, const Tensor& out, ReduceOp op) override {
    if (!on_device(in, out, "reduce_scatter")) return host().reduce_scatter(in, out, op);
    ireduce_scatter(in, out, op)->wait();
  }

  void broadcast(const Tensor& t, int root) override {
    if (!on_device(t, "broadcast")) return host().broadcast(t, root);
    check(root >= 0 && root < size_, "broadcast root {} is outside {} of size {}", root,
          describe(), size_);
    collective(fmt::format("broadcast from rank {}", root), {&t}, [&] {
      nccl_started(ncclBroadcast(t.raw(), t.raw(), count(t), nccl_type(t.dtype()), root, comm_,
                                 stream_),
                   "ncclBroadcast");
    })->wait();
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
        if (!aborted_) {
          ncclCommAbort(comm_);
          aborted_ = true;
        }
        throw CommTimeout(waiting_for("NCCL " + what) + " (the NCCL communicator was aborted)");
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
    }
  }

  // Throws Error when NCCL has reported an asynchronous failure (a network
  // error, a peer's abort).
  void check_async(const std::string& what) const {
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
    MessageTag tag;
    Tensor header;          // a receive's header, arriving over the host
    RequestPtr header_req;  // its host receive
  };

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
  void check_header(const Tensor& posted, const Tensor& header, int peer,
                    const MessageTag& tag) const {
    const int32_t* d = header.data<int32_t>();
    Shape arrived;
    arrived.rank = d[1];
    for (int i = 0; i < arrived.rank; ++i) arrived[i] = d[2 + i];
    check_message(posted, arrived, static_cast<DType>(d[0]), peer, tag, *this);
  }
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
    return std::make_unique<NcclRequest>(*this, std::move(l), nullptr, Tensor(), std::move(what));
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
    check(!aborted_, "NCCL {} in {}: the communicator was aborted after a timeout", what,
          describe());
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

  std::unique_ptr<Communicator> owned_host_;  // declared first: host_ may refer to it
  Communicator& host_;
  int device_;
  ncclComm_t comm_;
  bool aborted_ = false;
  std::string name_;
  std::vector<int> world_ranks_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ready_ = nullptr;
  int rank_ = 0, size_ = 1;
  bool in_group_ = false;
  std::vector<Pending> pending_;
  std::shared_ptr<Launch> group_launch_;
};

bool NcclRequest::test() {
  if (done_) return true;
  if (launch_->done == nullptr) return false;  // its group is still open
  if (header_ && !header_->test()) return false;
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

void HeaderFirstRecv::wait() { comm_.poll(what_, [this] { return test(); }); }

}  // namespace

bool nccl_built() { return true; }

std::unique_ptr<Communicator> nccl_world(Communicator& host, int device, CommOptions options) {
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
