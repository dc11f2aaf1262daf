#include <weft/cuda/runtime.h>
#include <weft/nccl_communicator.h>

#include <cuda_runtime.h>
#include <nccl.h>

#include <fmt/ranges.h>

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

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::F32: return ncclFloat32;
    case DType::I32: return ncclInt32;
    case DType::BF16: return ncclBfloat16;
  }
  return ncclFloat32;
}

ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::Sum ? ncclSum : ncclMax; }

void check_device(const Tensor& t, int device, const char* op) {
  check(t.device() == Device::cuda(device), "NCCL {} needs a tensor on cuda:{}, got one on {}",
        op, device, t.device().str());
}

// Polls `done` with growing sleeps until it holds or the deadline passes; then
// aborts the NCCL communicator (its kernels would otherwise spin forever).
template <typename Done>
void poll_until(const Communicator& comm, const std::string& what, ncclComm_t nccl, Done&& done) {
  const auto deadline = std::chrono::steady_clock::now() + comm.options().timeout;
  auto pause = std::chrono::microseconds(20);
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) {
      ncclCommAbort(nccl);
      throw CommTimeout("rank {} timed out after {} ms waiting for NCCL {} in {}{}", comm.rank(),
                        comm.options().timeout.count(), what, comm.describe(),
                        comm.step().empty() ? "" : ", at " + comm.step());
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
}

// Completion of work queued on a stream: an event, polled politely.
class EventRequest final : public Request {
 public:
  // `header` (a send's host-side shape message) and the tensor it reads must
  // outlive the request.
  EventRequest(cudaEvent_t event, RequestPtr header, Tensor header_bytes, const Communicator& comm,
               ncclComm_t nccl, std::string what)
      : event_(event), header_(std::move(header)), header_bytes_(std::move(header_bytes)),
        comm_(comm), nccl_(nccl), what_(std::move(what)) {}
  ~EventRequest() override { cudaEventDestroy(event_); }

  bool test() override {
    if (header_ && !header_->test()) return false;
    cudaError_t e = cudaEventQuery(event_);
    if (e == cudaErrorNotReady) return false;
    cuda_check(e, "cudaEventQuery");
    ncclResult_t async = ncclSuccess;
    nccl_check(ncclCommGetAsyncError(nccl_, &async), "ncclCommGetAsyncError");
    nccl_check(async, what_.c_str());
    return true;
  }

  void wait() override { poll_until(comm_, what_, nccl_, [this] { return test(); }); }

 private:
  cudaEvent_t event_;
  RequestPtr header_;
  Tensor header_bytes_;
  const Communicator& comm_;
  ncclComm_t nccl_;
  std::string what_;
};

// A receive whose NCCL part is queued only once its header has arrived and
// matched the posted tensor, so that posting it never blocks (a ring of
// irecv-then-send must not deadlock).
class HeaderFirstRecv final : public Request {
 public:
  using Start = std::function<RequestPtr(const Tensor& header)>;
  HeaderFirstRecv(Tensor header, RequestPtr header_req, Start start, const Communicator& comm,
                  ncclComm_t nccl, std::string what)
      : header_(std::move(header)), header_req_(std::move(header_req)), start_(std::move(start)),
        comm_(comm), nccl_(nccl), what_(std::move(what)) {}

  bool test() override {
    if (!payload_) {
      if (!header_req_->test()) return false;
      payload_ = start_(header_);
    }
    return payload_->test();
  }
  void wait() override { poll_until(comm_, what_, nccl_, [this] { return test(); }); }

 private:
  Tensor header_;
  RequestPtr header_req_;
  Start start_;
  RequestPtr payload_;
  const Communicator& comm_;
  ncclComm_t nccl_;
  std::string what_;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(Communicator& host, int device, ncclComm_t comm, std::string name,
                   std::vector<int> world_ranks, CommOptions options)
      : Communicator(options), host_(host), device_(device), comm_(comm), name_(std::move(name)),
        world_ranks_(std::move(world_ranks)) {
    cuda_check(cudaSetDevice(device_), "cudaSetDevice");
    cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    nccl_check(ncclCommUserRank(comm_, &rank_), "ncclCommUserRank");
    nccl_check(ncclCommCount(comm_, &size_), "ncclCommCount");
  }
  ~NcclCommunicator() override {
    device_free(scratch_, Device::cuda(device_));
    ncclCommDestroy(comm_);
    cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int world_rank(int r) const override { return world_ranks_[static_cast<size_t>(r)]; }
  std::string describe() const override {
    return name_ == "world" ? "nccl world"
                            : fmt::format("nccl {} [{}]", name_, fmt::join(world_ranks_, ", "));
  }

  RequestPtr isend(const Tensor& t, int peer, MessageTag tag) override {
    check_device(t, device_, "send");
    Tensor header_bytes = header_of(t);
    RequestPtr header = host_.isend(header_bytes, host_peer(peer), tag);
    return launch(fmt::format("send to rank {} tag {}", peer, tag.str()), std::move(header),
                  std::move(header_bytes), [&] {
                    nccl_check(ncclSend(t.raw(), static_cast<size_t>(t.numel()),
                                        nccl_type(t.dtype()), peer, comm_, stream_),
                               "ncclSend");
                  });
  }

  RequestPtr irecv(const Tensor& t, int peer, MessageTag tag) override {
    check_device(t, device_, "recv");
    Tensor header = Tensor::zeros({2 + Shape::kMaxRank}, DType::I32);
    RequestPtr header_req = host_.irecv(header, host_peer(peer), tag);
    std::string what = fmt::format("recv from rank {} tag {}", peer, tag.str());
    auto start = [this, t, peer, tag, what](const Tensor& h) {
      const int32_t* d = h.data<int32_t>();
      Shape arrived;
      arrived.rank = d[1];
      for (int i = 0; i < arrived.rank; ++i) arrived[i] = d[2 + i];
      check_message(t, arrived, static_cast<DType>(d[0]), peer, tag, *this);
      return launch(what, nullptr, Tensor(), [&] {
        nccl_check(ncclRecv(t.raw(), static_cast<size_t>(t.numel()), nccl_type(t.dtype()), peer,
                            comm_, stream_),
                   "ncclRecv");
      });
    };
    return std::make_unique<HeaderFirstRecv>(header, std::move(header_req), start, *this, comm_,
                                             what);
  }

  void all_reduce(const Tensor& t, ReduceOp op) override {
    check_device(t, device_, "all_reduce");
    launch(fmt::format("all_reduce {}", reduce_op_name(op)), nullptr, Tensor(), [&] {
      nccl_check(ncclAllReduce(t.raw(), t.raw(), static_cast<size_t>(t.numel()),
                               nccl_type(t.dtype()), nccl_op(op), comm_, stream_),
                 "ncclAllReduce");
    })->wait();
  }

  void all_gather(const Tensor& in, const Tensor& out) override {
    check_device(in, device_, "all_gather");
    check(out.numel() == in.numel() * size_, "all_gather: output holds {} elements, needs {} x {}",
          out.numel(), size_, in.numel());
    launch("all_gather", nullptr, Tensor(), [&] {
      nccl_check(ncclAllGather(in.raw(), out.raw(), static_cast<size_t>(in.numel()),
                               nccl_type(in.dtype()), comm_, stream_),
                 "ncclAllGather");
    })->wait();
  }

  void reduce_scatter(const Tensor& in, const Tensor& out, ReduceOp op) override {
    check_device(in, device_, "reduce_scatter");
    check(in.numel() == out.numel() * size_,
          "reduce_scatter: input holds {} elements, needs {} x {}", in.numel(), size_, out.numel());
    launch("reduce_scatter", nullptr, Tensor(), [&] {
      nccl_check(ncclReduceScatter(in.raw(), out.raw(), static_cast<size_t>(out.numel()),
                                   nccl_type(in.dtype()), nccl_op(op), comm_, stream_),
                 "ncclReduceScatter");
    })->wait();
  }

  void broadcast(const Tensor& t, int root) override {
    check_device(t, device_, "broadcast");
    launch(fmt::format("broadcast from rank {}", root), nullptr, Tensor(), [&] {
      nccl_check(ncclBroadcast(t.raw(), t.raw(), static_cast<size_t>(t.numel()),
                               nccl_type(t.dtype()), root, comm_, stream_),
                 "ncclBroadcast");
    })->wait();
  }

  void barrier() override {
    Tensor one = Tensor(scratch(), Shape{1}, DType::F32, Device::cuda(device_));
    all_reduce(one, ReduceOp::Sum);
  }

  std::unique_ptr<Communicator> split(const std::vector<std::vector<int>>& groups,
                                      const std::string& name) override {
    int color = -1, key = -1;
    for (size_t g = 0; g < groups.size(); ++g)
      for (size_t i = 0; i < groups[g].size(); ++i)
        if (groups[g][i] == rank_) color = static_cast<int>(g), key = static_cast<int>(i);
    check(color >= 0, "split '{}': rank {} is in none of the groups", name, rank_);
    ncclComm_t sub = nullptr;
    nccl_check(ncclCommSplit(comm_, color, key, &sub, nullptr), "ncclCommSplit");
    std::vector<int> members;
    for (int r : groups[static_cast<size_t>(color)]) members.push_back(world_rank(r));
    // The host side of the group carries the p2p headers.
    host_groups_.push_back(host_.split(groups, name));
    return std::make_unique<NcclCommunicator>(*host_groups_.back(), device_, sub, name, members,
                                              options_);
  }

 private:
  template <typename F>
  RequestPtr launch(std::string what, RequestPtr header, Tensor header_bytes, F&& enqueue) {
    cuda_check(cudaSetDevice(device_), "cudaSetDevice");
    // Order after the caller's work: weft's kernels on the device's compute
    // stream, and anything else on this thread's default stream.
    cudaEvent_t ready, done;
    cuda_check(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "cudaEventCreate");
    for (cudaStream_t before : {cuda::context(device_).compute_stream(), cudaStreamPerThread}) {
      cuda_check(cudaEventRecord(ready, before), "cudaEventRecord");
      cuda_check(cudaStreamWaitEvent(stream_, ready, 0), "cudaStreamWaitEvent");
    }
    cudaEventDestroy(ready);
    nccl_check(ncclGroupStart(), "ncclGroupStart");
    enqueue();
    nccl_check(ncclGroupEnd(), "ncclGroupEnd");
    cuda_check(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreate");
    cuda_check(cudaEventRecord(done, stream_), "cudaEventRecord");
    return std::make_unique<EventRequest>(done, std::move(header), std::move(header_bytes), *this,
                                          comm_, std::move(what));
  }

  // The host rank of group member `peer` is the same index: both groups list
  // the same members in the same order.
  int host_peer(int peer) const { return peer; }

  static Tensor header_of(const Tensor& t) {
    Tensor header = Tensor::zeros({2 + Shape::kMaxRank}, DType::I32);
    int32_t* h = header.data<int32_t>();
    h[0] = static_cast<int32_t>(t.dtype());
    h[1] = t.rank();
    for (int i = 0; i < t.rank(); ++i) h[2 + i] = static_cast<int32_t>(t.dim(i));
    return header;
  }

  void* scratch() {
    if (scratch_ == nullptr) scratch_ = device_alloc(sizeof(float), Device::cuda(device_));
    return scratch_;
  }

  Communicator& host_;
  int device_;
  ncclComm_t comm_;
  std::string name_;
  std::vector<int> world_ranks_;
  cudaStream_t stream_ = nullptr;
  int rank_ = 0, size_ = 1;
  std::vector<std::unique_ptr<Communicator>> host_groups_;
  void* scratch_ = nullptr;
};

}  // namespace

bool nccl_built() { return true; }

std::unique_ptr<Communicator> nccl_world(Communicator& host, int device, CommOptions options) {
  cuda_check(cudaSetDevice(device), "cudaSetDevice");
  ncclUniqueId id;
  Tensor id_bytes = Tensor::zeros({static_cast<int64_t>(sizeof(id) / 4)}, DType::I32);
  if (host.rank() == 0) {
    nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    std::memcpy(id_bytes.raw(), &id, sizeof(id));
  }
  host.broadcast(id_bytes, 0);
  std::memcpy(&id, id_bytes.raw(), sizeof(id));
  ncclComm_t comm = nullptr;
  nccl_check(ncclCommInitRank(&comm, host.size(), id, host.rank()), "ncclCommInitRank");
  std::vector<int> ranks;
  for (int r = 0; r < host.size(); ++r) ranks.push_back(host.world_rank(r));
  return std::make_unique<NcclCommunicator>(host, device, comm, "world", ranks, options);
}

}  // namespace weft
