// Device tensors staged through host buffers over a host transport.
#include <weft/staged_communicator.h>

namespace weft {

// Host buffers, each lent to one operation at a time. A rank's operations
// come from one thread, so the pool needs no lock.
class HostStagedCommunicator::Pool {
 public:
  // A buffer of at least `bytes`: the smallest free one that fits, else a new one.
  size_t take(size_t bytes) {
    size_t best = buffers_.size();
    for (size_t i = 0; i < buffers_.size(); ++i)
      if (!buffers_[i].busy && buffers_[i].t.nbytes() >= bytes &&
          (best == buffers_.size() || buffers_[i].t.nbytes() < buffers_[best].t.nbytes()))
        best = i;
    if (best == buffers_.size())
      buffers_.push_back({Tensor::empty({static_cast<int64_t>((bytes + 3) / 4)}), false});
    buffers_[best].busy = true;
    return best;
  }
  void give_back(size_t i) { buffers_[i].busy = false; }
  void* data(size_t i) const { return buffers_[i].t.raw(); }
  size_t bytes() const {
    size_t n = 0;
    for (const Buffer& b : buffers_) n += b.t.nbytes();
    return n;
  }

 private:
  struct Buffer {
    Tensor t;
    bool busy;
  };
  std::vector<Buffer> buffers_;
};

namespace {

using Pool = HostStagedCommunicator::Pool;

// One operand as the host transport sees it: the tensor itself, or a host
// view of a pooled buffer that stands for it until the operation is done.
class Operand {
 public:
  Operand() = default;
  Operand(const Tensor& t, bool stage, std::shared_ptr<Pool> pool, bool copy_in) : original_(t) {
    if (!stage || t.nbytes() == 0) {
      host_ = t;
      return;
    }
    pool_ = std::move(pool);
    lease_ = pool_->take(t.nbytes());
    host_ = Tensor(pool_->data(lease_), t.shape(), t.dtype(), Device::cpu());
    if (copy_in) host_.copy_from(t);
  }
  Operand(Operand&& o) noexcept { *this = std::move(o); }
  Operand& operator=(Operand&& o) noexcept {
    release();
    original_ = o.original_;
    host_ = o.host_;
    pool_ = std::move(o.pool_);
    lease_ = o.lease_;
    o.pool_.reset();
    return *this;
  }
  ~Operand() { release(); }

  const Tensor& host() const { return host_; }
  // What arrived, back into the tensor it stands for.
  void copy_out() const {
    if (pool_) original_.copy_from(host_);
  }
  void release() {
    if (pool_) pool_->give_back(lease_);
    pool_.reset();
  }

 private:
  Tensor original_, host_;
  std::shared_ptr<Pool> pool_;  // null when not staged, or released
  size_t lease_ = 0;
};

// Completes the host transport's request, then copies `out` back (a
// receive, a reduction's result) and returns every buffer to the pool.
class StagedRequest final : public Request {
 public:
  StagedRequest(RequestPtr inner, Operand in, Operand out)
      : inner_(std::move(inner)), in_(std::move(in)), out_(std::move(out)) {}
  bool test() override {
    if (done_) return true;
    if (!inner_->test()) return false;
    finish();
    return true;
  }
  void wait() override {
    if (done_) return;
    inner_->wait();
    finish();
  }

 private:
  void finish() {
    out_.copy_out();
    in_.release();
    out_.release();
    done_ = true;
  }

  RequestPtr inner_;
  Operand in_, out_;
  bool done_ = false;
};

}  // namespace

HostStagedCommunicator::HostStagedCommunicator(Communicator& inner, Stage stage)
    : Communicator(inner.options()),
      inner_(&inner),
      stage_(stage),
      pool_(std::make_shared<Pool>()) {}

HostStagedCommunicator::HostStagedCommunicator(std::unique_ptr<Communicator> owned, Stage stage,
                                               std::shared_ptr<Pool> pool)
    : Communicator(owned->options()),
      owned_(std::move(owned)),
      inner_(owned_.get()),
      stage_(stage),
      pool_(std::move(pool)) {}

HostStagedCommunicator::~HostStagedCommunicator() = default;

bool HostStagedCommunicator::staged(const Tensor& t) const {
  return stage_ == Stage::All || !t.device().is_cpu();
}

Communicator& HostStagedCommunicator::inner() {
  inner_->set_step(step());
  inner_->set_timeout(options_.timeout);
  return *inner_;
}

size_t HostStagedCommunicator::staging_bytes() const { return pool_->bytes(); }

RequestPtr HostStagedCommunicator::isend(const Tensor& t, int peer, MessageTag tag) {
  Operand in(t, staged(t), pool_, /*copy_in=*/true);
  RequestPtr r = inner().isend(in.host(), peer, tag);
  return std::make_unique<StagedRequest>(std::move(r), std::move(in), Operand{});
}

RequestPtr HostStagedCommunicator::irecv(const Tensor& t, int peer, MessageTag tag) {
  Operand out(t, staged(t), pool_, /*copy_in=*/false);
  RequestPtr r = inner().irecv(out.host(), peer, tag);
  return std::make_unique<StagedRequest>(std::move(r), Operand{}, std::move(out));
}

void HostStagedCommunicator::all_reduce(const Tensor& t, ReduceOp op) {
  Operand x(t, staged(t), pool_, true);
  inner().all_reduce(x.host(), op);
  x.copy_out();
}

void HostStagedCommunicator::all_gather(const Tensor& in, const Tensor& out) {
  Operand a(in, staged(in), pool_, true), b(out, staged(out), pool_, false);
  inner().all_gather(a.host(), b.host());
  b.copy_out();
}

void HostStagedCommunicator::reduce_scatter(const Tensor& in, const Tensor& out, ReduceOp op) {
  Operand a(in, staged(in), pool_, true), b(out, staged(out), pool_, false);
  inner().reduce_scatter(a.host(), b.host(), op);
  b.copy_out();
}

void HostStagedCommunicator::broadcast(const Tensor& t, int root) {
  Operand x(t, staged(t), pool_, /*copy_in=*/rank() == root);
  inner().broadcast(x.host(), root);
  if (rank() != root) x.copy_out();
}

void HostStagedCommunicator::barrier() { inner().barrier(); }

RequestPtr HostStagedCommunicator::iall_reduce(const Tensor& t, ReduceOp op) {
  Operand x(t, staged(t), pool_, true);
  RequestPtr r = inner().iall_reduce(x.host(), op);
  return std::make_unique<StagedRequest>(std::move(r), Operand{}, std::move(x));
}

RequestPtr HostStagedCommunicator::ireduce_scatter(const Tensor& in, const Tensor& out,
                                                   ReduceOp op) {
  Operand a(in, staged(in), pool_, true), b(out, staged(out), pool_, false);
  RequestPtr r = inner().ireduce_scatter(a.host(), b.host(), op);
  return std::make_unique<StagedRequest>(std::move(r), std::move(a), std::move(b));
}

RequestPtr HostStagedCommunicator::iall_gather(const Tensor& in, const Tensor& out) {
  Operand a(in, staged(in), pool_, true), b(out, staged(out), pool_, false);
  RequestPtr r = inner().iall_gather(a.host(), b.host());
  return std::make_unique<StagedRequest>(std::move(r), std::move(a), std::move(b));
}

std::unique_ptr<Communicator> HostStagedCommunicator::split(
    const std::vector<std::vector<int>>& groups, const std::string& name) {
  return std::unique_ptr<Communicator>(
      new HostStagedCommunicator(inner().split(groups, name), stage_, pool_));
}

}  // namespace weft
