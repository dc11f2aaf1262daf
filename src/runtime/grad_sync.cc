#include <weft/bf16.h>
#include <weft/grad_sync.h>
#include <weft/ops.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <map>

namespace weft {

using Clock = std::chrono::steady_clock;

struct GradSync::Bucket {
  std::vector<int> params;      // indices into params_, in flat order
  std::vector<int64_t> offset;  // each one's first element in the flat buffers
  int64_t numel = 0;            // elements in use
  int64_t padded = 0;           // a multiple of the data-parallel size
  bool late = false;
  int pending = 0;              // parameters whose gradients are not final yet
  bool launched = false;
  Tensor grad;                  // (padded): Param::grad are views into it
  // Distributed optimizer only.
  Tensor value;                 // (padded): Param::value are views into it
  Tensor shard_value;           // sharded parameters: (padded / dp), in place of value
  Tensor shard_grad;            // (padded / dp): this replica's reduced slice
  // (padded / dp): the optimizer's state of the slice, as many as its rule keeps.
  std::array<Tensor, kMaxOptimizerState> state;
  std::vector<UpdatePiece> pieces;  // this step's slices, reused
  std::shared_ptr<void> update_cache;  // the rule's device table for them
  // A bf16 reduction: the message (padded) and, distributed, this replica's slice.
  Tensor grad16, shard16;
  std::unique_ptr<PowerSgd> powersgd;  // when it compresses one of the bucket's matrices
  RequestPtr request;
};

namespace {

// Elements [at, at + n) of a flat fp32 buffer, as a view on its device.
Tensor elements(const Tensor& flat, int64_t at, int64_t n) {
  return Tensor(flat.data<float>() + at, Shape{n}, DType::F32, flat.device());
}

// The elements [lo, hi) of segment [begin, end) of a flat buffer, if any.
struct Overlap {
  int64_t lo = 0, hi = 0;
  bool empty() const { return hi <= lo; }
};
Overlap overlap(int64_t begin, int64_t end, int64_t lo, int64_t hi) {
  return {std::max(begin, lo), std::min(end, hi)};
}

}  // namespace

DType parse_grad_reduce_dtype(const std::string& name) {
  if (name == "fp32") return DType::F32;
  if (name == "bf16") return DType::BF16;
  throw Error("--grad-reduce-dtype '{}' must be fp32 or bf16", name);
}

void check_grad_sync_options(const GradSyncOptions& o) {
  check(o.bucket_elements > 0, "--ddp-bucket-size ({}) must be positive", o.bucket_elements);
  check(!o.shard_grads || o.distributed_optimizer,
        "sharded gradients (optim_grads) shard the optimizer state too: they need the "
        "distributed optimizer");
  check(!o.shard_params || o.shard_grads,
        "sharded parameters (optim_grads_params) shard the gradients and the optimizer state "
        "too: they need sharded gradients");
  check(o.max_in_flight >= 1, "sharded gradients need at least one reduction in flight, not {}",
        o.max_in_flight);
  check(o.reduce_dtype == DType::F32 || o.reduce_dtype == DType::BF16,
        "--grad-reduce-dtype {} is not available (fp32 or bf16)", dtype_name(o.reduce_dtype));
  check(o.powersgd_rank >= 1, "--powersgd-rank ({}) must be at least 1", o.powersgd_rank);
  check(o.powersgd_start_iter >= 0, "--powersgd-start-iter ({}) must not be negative",
        o.powersgd_start_iter);
  check(std::isfinite(o.sgd.momentum) && o.sgd.momentum >= 0 && o.sgd.momentum < 1,
        "--sgd-momentum ({}) must be in [0, 1)", o.sgd.momentum);
  if (o.compression != GradCompression::PowerSgd) return;
  check(!o.distributed_optimizer,
        "--grad-compression powersgd compresses the all-reduce of plain data parallelism; it "
        "cannot be combined with --use-distributed-optimizer (which reduce-scatters)");
  check(o.reduce_dtype == DType::F32,
        "--grad-compression powersgd sends fp32 factors; it cannot be combined with "
        "--grad-reduce-dtype bf16");
}

GradSync::GradSync(const Graph& graph, std::vector<int> nodes, std::vector<Param*> params,
                   std::vector<Param*> late, std::vector<Param*> norm_owned, ParallelGroups groups,
                   AdamWConfig adam, GradSyncOptions options)
    : groups_(groups), options_(options), adam_(adam), params_(std::move(params)), graph_(&graph) {
  check_grad_sync_options(options_);
  OptimizerConfig oc;
  oc.kind = options_.optimizer, oc.adam = adam_, oc.sgd = options_.sgd, oc.lion = options_.lion;
  rule_ = make_update_rule(oc);
  state_count_ = rule_->state_suffixes().size();
  std::map<const Param*, int> index;
  for (size_t i = 0; i < params_.size(); ++i) index[params_[i]] = static_cast<int>(i);
  const size_t np = params_.size();

  // Which of this rank's nodes use each parameter, and the earliest one: the
  // backward runs nodes in reverse, so that node's W makes the gradient final.
  node_params_.assign(graph.nodes().size(), {});
  nodes_per_param_.assign(np, 0);
  std::vector<int> first_node(np, static_cast<int>(graph.nodes().size()));
  for (int n : nodes)
    for (Param* p : graph.nodes()[static_cast<size_t>(n)].layer->params()) {
      auto it = index.find(p);
      if (it == index.end()) continue;
      node_params_[static_cast<size_t>(n)].push_back(it->second);
      ++nodes_per_param_[static_cast<size_t>(it->second)];
      first_node[static_cast<size_t>(it->second)] =
          std::min(first_node[static_cast<size_t>(it->second)], n);
    }
  std::vector<char> is_late(np, 0);
  for (Param* p : late) {
    auto it = index.find(p);
    if (it != index.end()) is_late[static_cast<size_t>(it->second)] = 1;
  }
  norm_counts_.assign(np, 0);
  for (Param* p : norm_owned) {
    auto it = index.find(p);
    if (it == index.end()) continue;
    // A piece of a split tensor counts on every tensor-parallel rank; a whole
    // tensor replicated across the group counts on rank 0 only.
    norm_counts_[static_cast<size_t>(it->second)] = p->shard.split() || groups_.tp_rank() == 0;
  }

  // Buckets, in the order their gradients become final: later first nodes first.
  std::vector<int> order(np);
  for (size_t i = 0; i < np; ++i) order[i] = static_cast<int>(i);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    if (is_late[static_cast<size_t>(a)] != is_late[static_cast<size_t>(b)])
      return is_late[static_cast<size_t>(a)] < is_late[static_cast<size_t>(b)];
    return first_node[static_cast<size_t>(a)] > first_node[static_cast<size_t>(b)];
  });
  bucket_of_.assign(np, -1);
  for (int i : order) {
    const bool lt = is_late[static_cast<size_t>(i)] != 0;
    const int64_t n = params_[static_cast<size_t>(i)]->value.numel();
    if (buckets_.empty() || buckets_.back()->late != lt ||
        (buckets_.back()->numel > 0 && buckets_.back()->numel + n > options_.bucket_elements)) {
      buckets_.push_back(std::make_unique<Bucket>());
      buckets_.back()->late = lt;
    }
    Bucket& b = *buckets_.back();
    b.params.push_back(i);
    b.offset.push_back(b.numel);
    b.numel += n;
    bucket_of_[static_cast<size_t>(i)] = static_cast<int>(buckets_.size()) - 1;
  }

  // Flat buffers on the parameters' device; gradients (and, distributed,
  // values) become views into them.
  const int64_t dp = groups_.dp_size();
  const Device device = params_.empty() ? Device::cpu() : params_[0]->value.device();
  for (const Param* p : params_)
    check(p->value.device() == device, "{} is on {} but {} is on {}: one device per rank",
          p->name, p->value.device().str(), params_[0]->name, device.str());
  // Bucketed reductions, plain or sharded (the distributed optimizer), run on
  // any device; the compressed ones round and factor on host memory.
  check(device.is_cpu() || dp == 1 ||
            (options_.reduce_dtype == DType::F32 &&
             options_.compression == GradCompression::None),
        "on {}, data parallelism reduces fp32 gradients: --grad-reduce-dtype bf16 and "
        "--grad-compression powersgd are not available on a GPU yet",
        device.str());
  offset_of_.assign(np, 0);
  per_micro_batch_.assign(buckets_.size(), 0);
  for (size_t bi = 0; bi < buckets_.size(); ++bi) {
    Bucket& b = *buckets_[bi];
    b.padded = (b.numel + dp - 1) / dp * dp;
    for (size_t k = 0; k < b.params.size(); ++k) {
      offset_of_[static_cast<size_t>(b.params[k])] = b.offset[k];
      per_micro_batch_[bi] += nodes_per_param_[static_cast<size_t>(b.params[k])];
    }
    if (sharded(b)) pool_elements_ = std::max(pool_elements_, b.padded);
  }
  if (sharded_params()) {
    // Each node's buckets whose values are sharded, and a first buffer that
    // every sharded value points into once its slice is copied (its own
    // memory let go there, bucket by bucket, so that the whole values and
    // the slices are never all held at once).
    node_buckets_.assign(graph.nodes().size(), {});
    size_t most = 0;
    for (int n : nodes) {
      std::vector<int>& v = node_buckets_[static_cast<size_t>(n)];
      for (int i : node_params_[static_cast<size_t>(n)]) {
        const int bi = bucket_of_[static_cast<size_t>(i)];
        if (params_sharded(*buckets_[static_cast<size_t>(bi)]) &&
            std::find(v.begin(), v.end(), bi) == v.end())
          v.push_back(bi);
      }
      most = std::max(most, v.size());
    }
    gathered_cap_ = std::max<size_t>(2, 2 * most);
    resident_.assign(buckets_.size(), -1);
    if (pool_elements_ > 0) free_gathered(-1, -1);
  }
  for (auto& bp : buckets_) {
    Bucket& b = *bp;
    // Sharded gradients: no whole buffer; each micro-batch borrows one.
    if (!sharded(b)) b.grad = Tensor::zeros({b.padded}, DType::F32, device);
    if (distributed()) {
      // Every shard lives beside the parameters: the reduce-scatter and the
      // all-gather move device tensors, and AdamW runs where they are.
      const int64_t s = b.padded / dp;
      if (params_sharded(b))
        b.shard_value = Tensor::zeros({s}, DType::F32, device);
      else
        b.value = Tensor::zeros({b.padded}, DType::F32, device);
      b.shard_grad = Tensor::zeros({s}, DType::F32, device);
      for (size_t k = 0; k < state_count_; ++k)
        b.state[k] = Tensor::zeros({s}, DType::F32, device);
      // A sharded bucket's bf16 messages live in the pool's buffers.
      if (options_.reduce_dtype == DType::BF16 && !sharded(b))
        b.shard16 = Tensor::zeros({s}, DType::BF16);
    }
    if (dp > 1 && options_.reduce_dtype == DType::BF16 && !sharded(b))
      b.grad16 = Tensor::zeros({b.padded}, DType::BF16);
    if (dp > 1 && options_.compression == GradCompression::PowerSgd) {
      std::vector<PowerSgd::Piece> pieces;
      bool any = false;
      for (size_t k = 0; k < b.params.size(); ++k) {
        const Param* p = params_[static_cast<size_t>(b.params[k])];
        pieces.push_back({p->name, b.offset[k], p->value.shape()});
        any = any || PowerSgd::compressible(p->value.shape(), options_.powersgd_rank);
      }
      if (any) b.powersgd = std::make_unique<PowerSgd>(pieces, options_.powersgd_rank);
    }
    if (sharded(b) && pool_.empty()) borrow();  // the gradients point somewhere from the start
    for (size_t k = 0; k < b.params.size(); ++k) {
      Param* p = params_[static_cast<size_t>(b.params[k])];
      p->grad = sharded(b) ? grad_view(0, b.params[k])
                           : Tensor(b.grad.data<float>() + b.offset[k], p->value.shape(),
                                    DType::F32, device);
      if (params_sharded(b)) {  // this replica's slice of it, if any
        const int64_t s = b.padded / dp, lo = groups_.dp_rank() * s;
        const Overlap o = overlap(b.offset[k], b.offset[k] + p->value.numel(), lo, lo + s);
        if (!o.empty())
          elements(b.shard_value, o.lo - lo, o.hi - o.lo)
              .copy_from(elements(p->value, o.lo - b.offset[k], o.hi - o.lo));
        p->value = gathered_view(0, b.params[k], false);
      } else if (distributed()) {
        Tensor view(b.value.data<float>() + b.offset[k], p->value.shape(), DType::F32, device);
        view.copy_from(p->value);
        p->value = view;
      }
    }
  }
  if (!pool_.empty()) pool_[0].busy = false;
  for (size_t i = 0; i < np; ++i)
    if (!params_sharded(*buckets_[static_cast<size_t>(bucket_of_[i])]))
      whole_params_.push_back(params_[i]);
  if (!distributed()) plain_ = std::make_unique<Optimizer>(params_, make_update_rule(oc));
  remaining_.assign(np, 0);
}

bool GradSync::sharded(const Bucket& b) const { return sharded_grads() && !b.late; }
bool GradSync::params_sharded(const Bucket& b) const { return sharded_params() && !b.late; }

const Tensor& GradSync::grad_view(int buffer, int param) {
  PoolBuffer& pb = pool_[static_cast<size_t>(buffer)];
  Tensor& v = pb.views[static_cast<size_t>(param)];
  if (!v.defined()) {
    const Param* p = params_[static_cast<size_t>(param)];
    v = Tensor(pb.grad.data<float>() + offset_of_[static_cast<size_t>(param)], p->value.shape(),
               DType::F32, pb.grad.device());
  }
  return v;
}

// A free buffer of the pool. On a GPU the oldest reduction in flight is
// retired first (the compute stream waits for it; the host does not), so the
// pool holds the buffers open at once and one more. On the host's transports
// the pool grows while fewer than max_in_flight reductions are in flight, and
// then the oldest is waited for.
int GradSync::borrow() {
  auto free_one = [&]() -> int {
    for (size_t k = 0; k < pool_.size(); ++k)
      if (!pool_[k].busy) return static_cast<int>(k);
    return -1;
  };
  int k = free_one();
  if (k < 0) {
    poll();
    k = free_one();
  }
  int64_t in_flight = 0;
  bool device_ordered = false;
  for (const Open& o : open_)
    if (o.posted >= 0) {
      ++in_flight;
      device_ordered = device_ordered || (o.request && o.request->device_ordered());
    }
  if (k < 0 && in_flight > 0 && (device_ordered || in_flight >= options_.max_in_flight)) {
    retire_oldest(/*wait=*/true);
    k = free_one();
  }
  if (k < 0) {
    const Device device = params_[0]->value.device();
    PoolBuffer pb;
    pb.grad = Tensor::zeros({pool_elements_}, DType::F32, device);
    pb.shard = Tensor::zeros({pool_elements_ / groups_.dp_size()}, DType::F32, device);
    if (options_.reduce_dtype == DType::BF16) {
      pb.grad16 = Tensor::zeros({pool_elements_}, DType::BF16);
      pb.shard16 = Tensor::zeros({pool_elements_ / groups_.dp_size()}, DType::BF16);
    }
    pb.views.resize(params_.size());
    pool_.push_back(std::move(pb));
    k = static_cast<int>(pool_.size()) - 1;
  }
  pool_[static_cast<size_t>(k)].busy = true;
  return k;
}

GradSync::Open& GradSync::open_for(int bucket, int micro_batch) {
  for (Open& o : open_)
    if (o.bucket == bucket && o.micro_batch == micro_batch && o.posted < 0) return o;
  const int buffer = borrow();
  elements(pool_[static_cast<size_t>(buffer)].grad, 0,
           buckets_[static_cast<size_t>(bucket)]->padded)
      .zero_();
  Open o;
  o.bucket = bucket, o.micro_batch = micro_batch, o.buffer = buffer;
  o.pending = per_micro_batch_[static_cast<size_t>(bucket)];
  open_.push_back(std::move(o));  // reserved: no allocation past the first step
  return open_.back();
}

void GradSync::weight_begin(int node, int micro_batch) {
  if (!sharded_grads()) return;
  for (int i : node_params_[static_cast<size_t>(node)]) {
    const int bi = bucket_of_[static_cast<size_t>(i)];
    if (!sharded(*buckets_[static_cast<size_t>(bi)])) continue;
    const int buffer = open_for(bi, micro_batch).buffer;
    params_[static_cast<size_t>(i)]->grad = grad_view(buffer, i);
  }
}

void GradSync::post_open(Open& o) {
  Bucket& b = *buckets_[static_cast<size_t>(o.bucket)];
  PoolBuffer& pb = pool_[static_cast<size_t>(o.buffer)];
  if (!reduce_) {  // evaluation: the gradients are thrown away
    pb.busy = false;
    o.bucket = -1;
    return;
  }
  if (!launched_any_) {
    launched_any_ = true;
    first_launch_ = Clock::now();
  }
  ++stats_.buckets;
  if (!in_finish_) ++stats_.started_in_backward;
  const int64_t s = b.padded / groups_.dp_size();
  if (pb.grad16.defined()) {  // rounded to bf16 and reduced in bf16, as a ZeRO-1 bucket is
    to_bf16(pb.grad.data<float>(), pb.grad16.data<uint16_t>(), b.padded);
    const Tensor shard16(pb.shard16.data<uint16_t>(), Shape{s}, DType::BF16, pb.shard16.device());
    o.request = reduce(Tensor(pb.grad16.data<uint16_t>(), Shape{b.padded}, DType::BF16,
                              pb.grad16.device()),
                       &shard16);
  } else {
    const Tensor shard = elements(pb.shard, 0, s);
    o.request = reduce(elements(pb.grad, 0, b.padded), &shard);
  }
  o.posted = posts_++;
}

bool GradSync::retire_oldest(bool wait) {
  Open* oldest = nullptr;
  for (Open& o : open_)
    if (o.posted >= 0 && (oldest == nullptr || o.posted < oldest->posted)) oldest = &o;
  if (oldest == nullptr) return false;
  if (oldest->request) {
    if (wait) {
      oldest->request->wait_on_device();  // on a GPU with NCCL, the stream waits, not the host
    } else if (oldest->request->device_ordered() || !oldest->request->test()) {
      return false;
    }
  }
  Bucket& b = *buckets_[static_cast<size_t>(oldest->bucket)];
  PoolBuffer& pb = pool_[static_cast<size_t>(oldest->buffer)];
  if (pb.shard16.defined())  // widened: each micro-batch's bf16 sum, added in fp32
    bf16_to_float(pb.shard16.data<uint16_t>(), pb.shard.data<float>(), b.shard_grad.numel());
  ops::add(b.shard_grad, elements(pb.shard, 0, b.shard_grad.numel()));
  pb.busy = false;
  oldest->bucket = -1;  // erased below
  std::erase_if(open_, [](const Open& o) { return o.bucket < 0; });
  return true;
}

const Tensor& GradSync::gathered_view(int buffer, int param, bool half) {
  Gathered& g = gathered_[static_cast<size_t>(buffer)];
  Tensor& v = (half ? g.views16 : g.views)[static_cast<size_t>(param)];
  if (!v.defined()) {
    const Param* p = params_[static_cast<size_t>(param)];
    const int64_t at = offset_of_[static_cast<size_t>(param)];
    v = half ? Tensor(g.value16.data<uint16_t>() + at, p->value.shape(), DType::BF16,
                      g.value16.device())
             : Tensor(g.value.data<float>() + at, p->value.shape(), DType::F32, g.value.device());
  }
  return v;
}

bool GradSync::pinned(int bucket, int node, int next) const {
  for (int n : {node, next}) {
    if (n < 0) continue;
    const std::vector<int>& v = node_buckets_[static_cast<size_t>(n)];
    if (std::find(v.begin(), v.end(), bucket) != v.end()) return true;
  }
  return false;
}

// A buffer for a bucket to be gathered into: a free one, a new one while the
// pool is below its cap, else the one least recently needed by a node that
// neither `node` nor `next` needs (its gather waited for first).
int GradSync::free_gathered(int node, int next) {
  for (size_t k = 0; k < gathered_.size(); ++k)
    if (gathered_[k].bucket < 0) return static_cast<int>(k);
  if (gathered_.size() < gathered_cap_) {
    const Device device = params_[0]->value.device();
    Gathered g;
    g.value = Tensor::zeros({pool_elements_}, DType::F32, device);
    if (graph_->activation_dtype() == DType::BF16)
      g.value16 = Tensor::zeros({pool_elements_}, DType::BF16, device);
    g.views.resize(params_.size());
    g.views16.resize(params_.size());
    gathered_.push_back(std::move(g));
    return static_cast<int>(gathered_.size()) - 1;
  }
  int best = -1;
  for (size_t k = 0; k < gathered_.size(); ++k) {
    const Gathered& g = gathered_[k];
    if (pinned(g.bucket, node, next)) continue;
    if (best < 0 || g.used < gathered_[static_cast<size_t>(best)].used) best = static_cast<int>(k);
  }
  check(best >= 0,
        "no gathered-parameter buffer is free for node {}: the pool's {} hold what it "
        "and node {} need",
        node, gathered_.size(), next);
  Gathered& g = gathered_[static_cast<size_t>(best)];
  if (g.request) {
    g.request->wait_on_device();
    g.request.reset();
  }
  resident_[static_cast<size_t>(g.bucket)] = -1;
  g.bucket = -1;
  return best;
}

void GradSync::resident(int bucket, int node, int next, bool wait) {
  int k = resident_[static_cast<size_t>(bucket)];
  Bucket& b = *buckets_[static_cast<size_t>(bucket)];
  if (k < 0) {
    k = free_gathered(node, next);
    Gathered& g = gathered_[static_cast<size_t>(k)];
    g.bucket = bucket;
    g.rounded = false;
    resident_[static_cast<size_t>(bucket)] = k;
    g.request = groups_.dp->iall_gather(b.shard_value, elements(g.value, 0, b.padded));
    ++stats_.gathers;
    if (!wait) ++stats_.prefetched;
  }
  Gathered& g = gathered_[static_cast<size_t>(k)];
  g.used = clock_;
  if (!wait) return;
  if (g.request) {
    g.request->wait_on_device();  // on a GPU with NCCL, the compute stream waits
    g.request.reset();
  }
  const bool half = graph_->activation_dtype() == DType::BF16;
  if (half && !g.value16.defined())  // activations made bf16 after the pool began
    g.value16 = Tensor::zeros({pool_elements_}, DType::BF16, g.value.device());
  if (half && !g.rounded) {  // the bucket's bf16 copies, rounded once while it stays
    ops::convert(elements(g.value, 0, b.padded), Tensor(g.value16.data<uint16_t>(), Shape{b.padded},
                                                        DType::BF16, g.value16.device()));
    g.rounded = true;
  }
  // Set on every use: another bucket may have held this buffer since the last.
  for (int i : b.params) {
    Param* p = params_[static_cast<size_t>(i)];
    p->value = gathered_view(k, i, false);
    p->value16 = half ? gathered_view(k, i, true) : Tensor();
  }
}

void GradSync::gather(int node, int next) {
  if (!sharded_params()) return;
  ++clock_;
  for (int bi : node_buckets_[static_cast<size_t>(node)]) resident(bi, node, next, true);
  if (next < 0) return;
  for (int bi : node_buckets_[static_cast<size_t>(next)])
    if (resident_[static_cast<size_t>(bi)] < 0) resident(bi, node, next, false);
}

void GradSync::drop_gathered() {
  for (Gathered& g : gathered_) {
    if (g.request) {
      g.request->wait_on_device();
      g.request.reset();
    }
    if (g.bucket >= 0) resident_[static_cast<size_t>(g.bucket)] = -1;
    g.bucket = -1;
  }
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_sharded(*buckets_[static_cast<size_t>(bucket_of_[i])]))
      params_[i]->value16 = Tensor();
}

GradSync::~GradSync() = default;

void GradSync::set_steps(int64_t s) {
  steps_ = s;
  if (plain_) plain_->set_steps(s);
}

void GradSync::begin(int64_t micro_batches) {
  check(open_.empty(), "a step began with {} micro-batch gradient buffers still open",
        open_.size());
  open_.reserve(buckets_.size() * 4);
  for (auto& b : buckets_) {
    if (sharded(*b))
      b->shard_grad.zero_();
    else
      b->grad.zero_();
    b->launched = false;
    b->request.reset();
    b->pending = 0;
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    remaining_[i] = nodes_per_param_[i] * micro_batches;
    Bucket& b = *buckets_[static_cast<size_t>(bucket_of_[i])];
    if (!sharded(b)) ++b.pending;  // a sharded bucket counts per micro-batch (Open)
  }
  next_launch_ = 0;
  launched_any_ = false;
  stats_ = {};
  // Steps before --powersgd-start-iter reduce uncompressed (PyTorch's
  // start_powerSGD_iter): Adam's moments settle on exact gradients first.
  compressing_ = reduce_ && options_.compression == GradCompression::PowerSgd &&
                 steps_ >= options_.powersgd_start_iter;
}

void GradSync::launch(Bucket& b) {
  b.launched = true;
  // A sharded bucket reduces each micro-batch's buffer as it completes.
  if (groups_.dp_size() <= 1 || !reduce_ || sharded(b)) return;
  if (!launched_any_) {
    launched_any_ = true;
    first_launch_ = Clock::now();
  }
  ++stats_.buckets;
  if (!in_finish_) ++stats_.started_in_backward;
  post(b);
}

void GradSync::post(Bucket& b) {
  if (b.powersgd && compressing_) {
    b.request = reduce(b.powersgd->compress(b.grad.data<float>()), nullptr);
  } else if (b.grad16.raw() != nullptr) {
    to_bf16(b.grad.data<float>(), b.grad16.data<uint16_t>(), b.padded);
    b.request = reduce(b.grad16, distributed() ? &b.shard16 : nullptr);
  } else {
    b.request = reduce(b.grad, distributed() ? &b.shard_grad : nullptr);
  }
}

RequestPtr GradSync::reduce(const Tensor& t, const Tensor* out) {
  const double dp = groups_.dp_size(), bytes = static_cast<double>(t.nbytes());
  ++stats_.collectives;
  if (out) {
    stats_.bytes_sent += bytes * (dp - 1) / dp;  // a ring reduce-scatter's share
    return groups_.dp->ireduce_scatter(t, *out, ReduceOp::Sum);
  }
  stats_.bytes_sent += 2 * bytes * (dp - 1) / dp;  // a ring all-reduce's share
  return groups_.dp->iall_reduce(t, ReduceOp::Sum);
}

void GradSync::launch_second_round() {
  for (auto& bp : buckets_) {
    Bucket& b = *bp;
    if (!b.powersgd || !compressing_ || !b.launched) continue;
    if (b.request) {
      b.request->wait();
      b.request.reset();
    }
    b.request = reduce(b.powersgd->project(b.grad.data<float>()), nullptr);
  }
}

void GradSync::unpack(Bucket& b) {
  if (b.powersgd && compressing_) {
    b.powersgd->decompress(b.grad.data<float>(), groups_.dp_size());
  } else if (distributed() && b.shard16.raw() != nullptr) {
    bf16_to_float(b.shard16.data<uint16_t>(), b.shard_grad.data<float>(), b.shard16.numel());
  } else if (!distributed() && b.grad16.raw() != nullptr) {
    bf16_to_float(b.grad16.data<uint16_t>(), b.grad.data<float>(), b.padded);
  }
}

double GradSync::reduce_written(bool compress) {
  if (groups_.dp_size() <= 1) return 0;
  check(!distributed(), "reduce_written sums whole buffers; the distributed optimizer shards them");
  stats_ = {};
  compressing_ = compress && options_.compression == GradCompression::PowerSgd &&
                 steps_ >= options_.powersgd_start_iter;
  for (auto& b : buckets_) {
    ++stats_.buckets;
    post(*b);
    b->launched = true;
  }
  complete();
  compressing_ = false;
  return stats_.bytes_sent;
}

void GradSync::complete() {
  if (compressing_) launch_second_round();
  for (auto& b : buckets_) {
    if (b->request) {
      b->request->wait_on_device();  // on a GPU with NCCL, the update waits, not the host
      b->request.reset();
    }
    unpack(*b);
  }
}

// Buckets start in bucket order on every replica, so collectives match.
void GradSync::launch_ready() {
  while (next_launch_ < buckets_.size()) {
    Bucket& b = *buckets_[next_launch_];
    if (b.late || b.pending > 0) return;
    launch(b);
    ++next_launch_;
  }
}

void GradSync::poll() {
  for (size_t k = 0; k < next_launch_; ++k)
    if (buckets_[k]->request && !buckets_[k]->request->device_ordered() &&
        buckets_[k]->request->test())
      buckets_[k]->request.reset();
  while (retire_oldest(/*wait=*/false)) {
  }
}

void GradSync::weight_done(int node, int micro_batch) {
  bool any = false;
  for (int i : node_params_[static_cast<size_t>(node)]) {
    const int bi = bucket_of_[static_cast<size_t>(i)];
    if (sharded(*buckets_[static_cast<size_t>(bi)])) {
      Open& o = open_for(bi, micro_batch);
      if (--o.pending > 0) continue;
      post_open(o);
      if (o.bucket < 0)
        std::erase_if(open_, [](const Open& x) { return x.bucket < 0; });
      else if (!options_.overlap)
        retire_oldest(/*wait=*/true);  // no overlap: each reduction done before going on
      continue;
    }
    if (--remaining_[static_cast<size_t>(i)] == 0) {
      --buckets_[static_cast<size_t>(bi)]->pending;
      any = true;
    }
  }
  if (!options_.overlap) return;
  if (any) launch_ready();
  poll();
}

void GradSync::finish() {
  in_finish_ = true;
  const auto t0 = Clock::now();
  while (next_launch_ < buckets_.size()) launch(*buckets_[next_launch_++]);
  for (const Open& o : open_)
    check(o.posted >= 0,
          "bucket {} of micro-batch {} still waits for {} W actions at the step's end", o.bucket,
          o.micro_batch, o.pending);
  while (retire_oldest(/*wait=*/true)) {
  }
  if (groups_.dp_size() > 1 && reduce_) complete();
  const auto t1 = Clock::now();
  in_finish_ = false;
  stats_.wait_ms = std::chrono::duration<double, std::milli>(t1 - t0).count();
  if (launched_any_)
    stats_.reduce_ms = std::chrono::duration<double, std::milli>(t1 - first_launch_).count();
}

// The sum of squares of every counted gradient (distributed: of the counted
// parameters' pieces of this replica's shards) in one ops::sum_squares_multi
// call, left where the gradients are, then summed over the groups. The list
// is rebuilt in place each step, in the order a loop over them would add them.
void GradSync::grad_norm_squared(const Tensor& out) {
  std::vector<Tensor>& xs = tables_.grads;
  xs.clear();  // keeps its capacity
  if (!distributed()) {
    for (size_t i = 0; i < params_.size(); ++i)
      if (norm_counts_[i]) xs.push_back(params_[i]->grad);
  } else {
    const int64_t r = groups_.dp_rank();
    for (auto& bp : buckets_) {
      const Bucket& b = *bp;
      const int64_t s = b.shard_grad.numel(), lo = r * s;
      for (size_t k = 0; k < b.params.size(); ++k) {
        if (!norm_counts_[static_cast<size_t>(b.params[k])]) continue;
        const int64_t n = params_[static_cast<size_t>(b.params[k])]->value.numel();
        const Overlap o = overlap(b.offset[k], b.offset[k] + n, lo, lo + s);
        if (!o.empty()) xs.push_back(elements(b.shard_grad, o.lo - lo, o.hi - o.lo));
      }
    }
  }
  ops::sum_squares_multi(xs, tables_.norm, out);
  if (distributed()) groups_.dp->all_reduce(out, ReduceOp::Sum);
  if (groups_.tp) groups_.tp->all_reduce(out, ReduceOp::Sum);
  if (groups_.pp) groups_.pp->all_reduce(out, ReduceOp::Sum);
}

void GradSync::scale_grads(float s) {
  std::vector<Tensor>& xs = tables_.grads;
  xs.clear();  // keeps its capacity
  if (!distributed()) {
    for (Param* p : params_) xs.push_back(p->grad);
  } else {
    for (auto& b : buckets_) xs.push_back(b->shard_grad);
  }
  ops::scale_multi(xs, s, scale_cache_);
}

GradSync::Memory GradSync::memory() const {
  Memory m;
  auto bytes = [](const Tensor& t) { return t.defined() ? static_cast<double>(t.nbytes()) : 0.0; };
  for (const Param* p : params_) {
    if (!distributed()) m.values += bytes(p->value), m.grads += bytes(p->grad);
  }
  if (!distributed()) {
    m.state = 4.0 * static_cast<double>(state_count_) * (m.values / 4.0);
    return m;
  }
  for (const auto& b : buckets_) {
    m.values += bytes(b->value) + bytes(b->shard_value);
    m.grads += bytes(b->grad) + bytes(b->shard_grad);
    for (size_t j = 0; j < state_count_; ++j) m.state += bytes(b->state[j]);
  }
  for (const PoolBuffer& pb : pool_) m.grad_buffers += bytes(pb.grad) + bytes(pb.shard);
  for (const Gathered& g : gathered_) m.value_buffers += bytes(g.value) + bytes(g.value16);
  return m;
}

double GradSync::grad_norm() {
  if (!norm_sq_.defined())
    norm_sq_ = Tensor::zeros({1}, DType::F32,
                             params_.empty() ? Device::cpu() : params_[0]->value.device());
  grad_norm_squared(norm_sq_);
  return std::sqrt(static_cast<double>(ops::item(norm_sq_)));
}

void GradSync::step(float lr, float grad_scale) { update(lr, grad_scale, Tensor()); }

void GradSync::step(float lr, const Tensor& grad_scale) { update(lr, 1.0f, grad_scale); }

void GradSync::update(float lr, float grad_scale, const Tensor& grad_scale_at) {
  ++steps_;
  if (!distributed()) {
    if (grad_scale_at.defined())
      plain_->step(lr, grad_scale_at);
    else
      plain_->step(lr, grad_scale);
    return;
  }
  const int64_t r = groups_.dp_rank();
  drop_gathered();  // their gathers read the slices about to change
  std::vector<RequestPtr> gathers;
  gathers.reserve(buckets_.size());
  UpdateStep step;
  step.lr = lr, step.step = steps_, step.grad_scale = grad_scale, step.grad_scale_at = grad_scale_at;
  for (auto& bp : buckets_) {
    Bucket& b = *bp;
    const int64_t s = b.shard_grad.numel(), lo = r * s;
    // This replica's slice of each parameter, updated by the optimizer's
    // rule as the whole tensor would be (element-wise, the same bits).
    b.pieces.clear();  // keeps its capacity
    for (size_t k = 0; k < b.params.size(); ++k) {
      const Param* p = params_[static_cast<size_t>(b.params[k])];
      const Overlap o = overlap(b.offset[k], b.offset[k] + p->value.numel(), lo, lo + s);
      if (o.empty()) continue;
      const int64_t at = o.lo - lo, n = o.hi - o.lo;
      const Tensor value =
          params_sharded(b) ? elements(b.shard_value, at, n) : elements(b.value, o.lo, n);
      UpdatePiece piece{value, elements(b.shard_grad, at, n), {}, p->weight_decay()};
      for (size_t j = 0; j < state_count_; ++j) piece.state[j] = elements(b.state[j], at, n);
      b.pieces.push_back(piece);
    }
    rule_->update(b.pieces, step, b.update_cache);
    // Sharded values stay sliced: each node's action gathers them again.
    if (params_sharded(b)) continue;
    // In place: the updated slice is this replica's part of the output.
    gathers.push_back(groups_.dp->iall_gather(elements(b.value, lo, s), b.value));
  }
  wait_all_on_device(gathers);
}

std::vector<std::pair<std::string, Tensor>> GradSync::optimizer_state() {
  if (!distributed()) return plain_->state();
  const std::vector<std::string> suffixes = rule_->state_suffixes();
  std::vector<std::pair<std::string, Tensor>> out;
  for (auto& bp : buckets_) {
    Bucket& b = *bp;
    // Gathered where the shards live, then copied to host memory: the
    // checkpoint gets the same host tensors from a GPU run as from a CPU one.
    std::array<Tensor, kMaxOptimizerState> whole;
    for (size_t j = 0; j < state_count_; ++j) {
      const Device device = b.state[j].device();
      whole[j] = Tensor::zeros({b.padded}, DType::F32, device);
      groups_.dp->all_gather(b.state[j], whole[j]);
      if (!device.is_cpu()) {
        Tensor host = Tensor::zeros({b.padded});
        host.copy_from(whole[j]);
        whole[j] = host;
      }
    }
    for (size_t k = 0; k < b.params.size(); ++k) {
      const Param* p = params_[static_cast<size_t>(b.params[k])];
      const Shape& shape = p->value.shape();
      for (size_t j = 0; j < state_count_; ++j)
        out.emplace_back(p->name + suffixes[j],
                         Tensor(whole[j].data<float>() + b.offset[k], shape, DType::F32).clone());
    }
  }
  return out;
}

void GradSync::load_optimizer_state(const std::vector<std::pair<std::string, Tensor>>& state) {
  std::map<std::string, const Tensor*> by_name;
  for (const auto& [name, t] : state) by_name[name] = &t;
  const std::vector<std::string> suffixes = rule_->state_suffixes();
  load_optimizer_state([&](size_t param, size_t which, int64_t lo, int64_t hi, const Tensor& dest) {
    const Param* p = params_[param];
    const std::string name = p->name + suffixes[which];
    auto it = by_name.find(name);
    check(it != by_name.end(), "the optimizer state lacks '{}'", name);
    check_shape(*it->second, p->value.shape(), "optimizer state '" + name + "'");
    dest.copy_from(elements(*it->second, lo, hi - lo));
  });
}

void GradSync::load_optimizer_state(const StateReader& read) {
  if (!distributed()) {
    const std::vector<std::pair<std::string, Tensor>> state = plain_->state();
    for (size_t i = 0; i < params_.size(); ++i)
      for (size_t j = 0; j < state_count_; ++j) {
        const Tensor& t = state[i * state_count_ + j].second;
        Tensor host = Tensor::zeros({t.numel()});
        read(i, j, 0, t.numel(), host);
        t.copy_from(host.view(t.shape()));
      }
    return;
  }
  const int64_t r = groups_.dp_rank();
  for (auto& bp : buckets_) {
    Bucket& b = *bp;
    const int64_t s = b.shard_grad.numel(), lo = r * s;
    for (size_t k = 0; k < b.params.size(); ++k) {
      const size_t i = static_cast<size_t>(b.params[k]);
      const Overlap o = overlap(b.offset[k], b.offset[k] + params_[i]->value.numel(), lo, lo + s);
      if (o.empty()) continue;
      // Only this replica's slice, wherever it lives.
      const int64_t from = o.lo - b.offset[k], n = o.hi - o.lo;
      for (size_t j = 0; j < state_count_; ++j) {
        Tensor host = Tensor::zeros({n});
        read(i, j, from, from + n, host);
        elements(b.state[j], o.lo - lo, n).copy_from(host);
      }
    }
  }
}

std::vector<GradSync::OwnedSlice> GradSync::owned_slices() const {
  std::vector<OwnedSlice> out;
  const int64_t r = groups_.dp_rank(), dp = groups_.dp_size();
  for (const auto& bp : buckets_) {
    const Bucket& b = *bp;
    const int64_t s = b.padded / dp, lo = r * s;
    for (size_t k = 0; k < b.params.size(); ++k) {
      const size_t i = static_cast<size_t>(b.params[k]);
      const Overlap o = overlap(b.offset[k], b.offset[k] + params_[i]->value.numel(), lo, lo + s);
      if (!o.empty()) out.push_back({i, o.lo - b.offset[k], o.hi - b.offset[k]});
    }
  }
  std::sort(out.begin(), out.end(),
            [](const OwnedSlice& a, const OwnedSlice& b) { return a.param < b.param; });
  return out;
}

Tensor GradSync::state_slice(const OwnedSlice& s, size_t which) const {
  check(which < state_count_, "the optimizer keeps {} state tensors, not {}", state_count_,
        which + 1);
  Tensor host = Tensor::zeros({s.hi - s.lo});
  if (!distributed()) {
    const std::vector<std::pair<std::string, Tensor>> state = plain_->state();
    host.copy_from(elements(state[s.param * state_count_ + which].second, s.lo, s.hi - s.lo));
    return host;
  }
  const Bucket& b = *buckets_[static_cast<size_t>(bucket_of_[s.param])];
  const auto at = std::find(b.params.begin(), b.params.end(), static_cast<int>(s.param));
  const int64_t first = b.offset[static_cast<size_t>(at - b.params.begin())] + s.lo;
  const int64_t shard_lo = groups_.dp_rank() * b.shard_grad.numel();
  check(first >= shard_lo && first + (s.hi - s.lo) <= shard_lo + b.shard_grad.numel(),
        "the state of '{}' [{}, {}) is not this replica's to read", params_[s.param]->name, s.lo,
        s.hi);
  host.copy_from(elements(b.state[which], first - shard_lo, s.hi - s.lo));
  return host;
}

Tensor GradSync::value_slice(const OwnedSlice& s) const {
  const Param* p = params_[s.param];
  check(s.lo >= 0 && s.lo <= s.hi && s.hi <= p->value.numel(),
        "the value of '{}' has no elements [{}, {})", p->name, s.lo, s.hi);
  Tensor host = Tensor::zeros({s.hi - s.lo});
  const Bucket& b = *buckets_[static_cast<size_t>(bucket_of_[s.param])];
  if (!params_sharded(b)) {
    host.copy_from(elements(p->value, s.lo, s.hi - s.lo));
    return host;
  }
  const auto at = std::find(b.params.begin(), b.params.end(), static_cast<int>(s.param));
  const int64_t first = b.offset[static_cast<size_t>(at - b.params.begin())] + s.lo;
  const int64_t shard_lo = groups_.dp_rank() * b.shard_value.numel();
  check(first >= shard_lo && first + (s.hi - s.lo) <= shard_lo + b.shard_value.numel(),
        "the value of '{}' [{}, {}) is not this replica's to read: its parameters are sharded",
        p->name, s.lo, s.hi);
  host.copy_from(elements(b.shard_value, first - shard_lo, s.hi - s.lo));
  return host;
}

std::vector<Tensor> GradSync::whole_values() {
  std::vector<Tensor> out(params_.size());
  for (auto& bp : buckets_) {
    Bucket& b = *bp;
    Tensor whole;
    if (params_sharded(b)) {
      whole = Tensor::zeros({b.padded}, DType::F32, b.shard_value.device());
      groups_.dp->all_gather(b.shard_value, whole);
    }
    for (size_t k = 0; k < b.params.size(); ++k) {
      const Param* p = params_[static_cast<size_t>(b.params[k])];
      out[static_cast<size_t>(b.params[k])] =
          whole.defined() ? Tensor(whole.data<float>() + b.offset[k], p->value.shape(), DType::F32,
                                   whole.device())
                                .clone()
                          : p->value.clone();
    }
  }
  return out;
}

void GradSync::load_values(const ValueReader& read) {
  drop_gathered();
  const int64_t r = groups_.dp_rank();
  for (auto& bp : buckets_) {
    Bucket& b = *bp;
    const int64_t s = params_sharded(b) ? b.shard_value.numel() : 0, lo = r * s;
    for (size_t k = 0; k < b.params.size(); ++k) {
      const size_t i = static_cast<size_t>(b.params[k]);
      Param* p = params_[i];
      if (!params_sharded(b)) {
        Tensor host = Tensor::zeros({p->value.numel()});
        read(i, 0, p->value.numel(), host);
        p->value.copy_from(host.view(p->value.shape()));
        continue;
      }
      const Overlap o = overlap(b.offset[k], b.offset[k] + p->value.numel(), lo, lo + s);
      if (o.empty()) continue;
      const int64_t from = o.lo - b.offset[k], n = o.hi - o.lo;
      Tensor host = Tensor::zeros({n});
      read(i, from, from + n, host);
      elements(b.shard_value, o.lo - lo, n).copy_from(host);
    }
  }
}

}  // namespace weft
