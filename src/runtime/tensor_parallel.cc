#include <weft/ops.h>
#include <weft/tensor_parallel.h>

#include <fmt/ranges.h>

#include <algorithm>

#include "layers/tp_regions.h"

namespace weft {

std::unique_ptr<Layer> Layer::tensor_parallel(TpBuild&) const {
  throw Error("layers of kind '{}' have no tensor-parallel form", kind());
}

Param* TpBuild::param(const Param& logical, int dim, int equal_blocks) {
  if (dim < 0 || equal_blocks == 1) return param(logical, dim, std::vector<int64_t>{});
  const int64_t extent = dim < logical.value.rank() ? logical.value.dim(dim) : 0;
  check(equal_blocks > 1 && extent % equal_blocks == 0,
        "{}: dimension {} ({}) is not {} equal blocks", logical.name, dim, extent, equal_blocks);
  return param(logical, dim, weft::equal_blocks(extent, equal_blocks));
}

Param* TpBuild::param(const Param& logical, int dim, std::vector<int64_t> blocks) {
  check(group != nullptr && store != nullptr, "{}: TpBuild needs a group and a parameter store",
        logical.name);
  const Shape full = logical.value.shape();
  check(!logical.shard.split(), "{}: the logical parameter is already a piece {} of {}",
        logical.name, full.str(), logical.shard.full.str());
  check(dim >= -1 && dim < full.rank, "{}: dimension {} is out of range for shape {}", logical.name,
        dim, full.str());
  const int tp = group->size();
  if (dim < 0) blocks.clear();
  if (!blocks.empty()) {
    int64_t sum = 0;
    for (int64_t w : blocks) {
      check(w > 0, "{}: block widths {} must be positive", logical.name, fmt::join(blocks, ", "));
      sum += w;
    }
    check(sum == full[dim], "{}: dimension {} ({}) is not its blocks' total width ({})",
          logical.name, dim, full[dim], fmt::join(blocks, " + "));
    if (blocks.size() == 1) blocks.clear();
  }
  if (dim >= 0) {
    if (blocks.empty())
      check(full[dim] % tp == 0,
            "{}: dimension {} ({}) must be divisible by tensor-parallel size ({})", logical.name,
            dim, full[dim], tp);
    for (int64_t w : blocks)
      check(w % tp == 0,
            "{}: dimension {} ({}) must be divisible by tensor-parallel size ({}) in each of its "
            "{} blocks (of widths {})",
            logical.name, dim, full[dim], tp, blocks.size(), fmt::join(blocks, ", "));
  }
  const Shard shard{dim, tp, group->rank(), blocks, full};
  if (Param* p = store->find(logical.name)) {
    // Tied weights: a second user must want the same piece.
    check(p->shard.dim == shard.dim && p->shard.blocks == shard.blocks &&
              p->shard.parts == shard.parts && p->shard.index == shard.index &&
              p->shard.full == full,
          "{}: tensor-parallel piece along dimension {} ({} blocks) requested, but it is "
          "already held along dimension {} ({} blocks)",
          logical.name, dim, std::max<size_t>(shard.blocks.size(), 1), p->shard.dim,
          std::max<size_t>(p->shard.blocks.size(), 1));
    return p;
  }
  Param* p = store->create_shard(logical.name, shard, logical.init);
  p->true_rows = logical.true_rows;
  return p;
}

namespace {

// A layer between tensor-parallel regions under sequence parallelism, whose
// parameters are whole on every rank: each rank computes their gradients
// from its own tokens, so W gathers its part into a buffer of its own and
// the group sums them before they are added (Megatron sums its sequence-
// parallel norms' gradients once a step; here each micro-batch's, as ZeRO-2
// and the overlapped buckets read a parameter's gradient once its last W
// has run). Everything else is the layer's own.
class SequenceParallelReplica final : public Layer {
 public:
  SequenceParallelReplica(std::unique_ptr<Layer> layer, Communicator& group)
      : layer_(std::move(layer)), group_(&group), params_(layer_->params()) {
    for (Param* p : params_) total_ += p->value.numel();
    saved_.reserve(params_.size());
  }
  const char* kind() const override { return layer_->kind(); }
  std::vector<Shape> output_shapes(std::span<const Shape> in) const override {
    return layer_->output_shapes(in);
  }
  std::vector<DType> output_dtypes(std::span<const Shape> in) const override {
    return layer_->output_dtypes(in);
  }
  std::vector<Param*> params() const override { return layer_->params(); }
  double flops(std::span<const Shape> in) const override { return layer_->flops(in); }
  double stashed_elements(std::span<const Shape> in) const override {
    return layer_->stashed_elements(in);
  }
  std::unique_ptr<LayerCtx> make_ctx() const override { return layer_->make_ctx(); }
  void forward(LayerCtx& ctx, Arena& arena, std::span<const Tensor> in,
               std::span<const Tensor> out) override {
    layer_->forward(ctx, arena, in, out);
  }
  void backward_input(LayerCtx& ctx, Arena& arena, std::span<const Tensor> grad_out,
                      std::span<const Tensor> grad_in) override {
    layer_->backward_input(ctx, arena, grad_out, grad_in);
  }
  bool writes_input_grad(size_t i) const override { return layer_->writes_input_grad(i); }
  bool may_share_input_grad(size_t i) const override { return layer_->may_share_input_grad(i); }

  // The layer's W into zeroed views of one buffer, summed over the group in
  // one all-reduce, then added to the parameters' gradients.
  void backward_weight(LayerCtx& ctx, Arena& arena) override {
    const std::vector<Param*>& params = params_;
    if (!sums_.defined() || !(sums_.device() == params.front()->value.device()))
      sums_ = Tensor::empty({total_}, DType::F32, params.front()->value.device());
    sums_.zero_();
    saved_.clear();
    int64_t at = 0;
    for (Param* p : params) {
      const int64_t n = p->value.numel();
      saved_.push_back(p->grad);
      p->grad = sums_.slice0(at, at + n).view(p->value.shape());
      at += n;
    }
    try {
      layer_->backward_weight(ctx, arena);
    } catch (...) {
      restore(params);
      throw;
    }
    restore(params);
    group_->all_reduce(sums_, ReduceOp::Sum);
    at = 0;
    for (Param* p : params) {
      const int64_t n = p->value.numel();
      if (p->grad.defined()) ops::add(p->grad, sums_.slice0(at, at + n).view(p->value.shape()));
      at += n;
    }
  }

 private:
  void restore(const std::vector<Param*>& params) {
    for (size_t k = 0; k < params.size(); ++k) params[k]->grad = saved_[k];
  }
  std::unique_ptr<Layer> layer_;
  Communicator* group_;
  std::vector<Param*> params_;  // the layer's, fixed once built: a W allocates nothing
  int64_t total_ = 0;
  Tensor sums_;                // the group's sums, one view per parameter
  std::vector<Tensor> saved_;  // the parameters' own gradients during the call
};

// Whether a value of the rank's graph holds 1/tp of its tokens: its second
// dimension (the sequence) is shorter than the logical value's.
bool token_split(const Shape& rank, const Shape& logical) {
  return rank.rank >= 2 && logical.rank == rank.rank && rank[1] != logical[1];
}

}  // namespace

Graph tensor_parallel_graph(const Graph& logical, Communicator& tp,
                            std::shared_ptr<ParamStore> store, bool sequence_parallel) {
  check(store != nullptr, "tensor_parallel_graph needs a parameter store");
  check(store.get() != &logical.param_store(),
        "tensor_parallel_graph needs a store of its own, not the logical graph's");
  TpBuild build{&tp, store.get()};
  if (sequence_parallel) build.sequence = std::make_shared<SequenceScratch>();
  Graph g(store);
  const std::vector<Value>& values = logical.values();
  const std::vector<Node>& nodes = logical.nodes();

  // Values are numbered in the order inputs and nodes were added: replay that
  // order, so every value and node keeps its id.
  size_t next = 0;  // the next logical node to add
  auto add_through = [&](size_t last) {
    for (; next <= last; ++next) {
      const Node& node = nodes[next];
      std::unique_ptr<Layer> layer;
      build.took_sequence = false;
      try {
        layer = node.layer->tensor_parallel(build);
      } catch (const Error& e) {
        throw Error("{} ({}) at tensor-parallel size {}: {}", node.name, node.layer->kind(),
                    tp.size(), e.what());
      }
      bool split_input = false;  // one of its inputs holds 1/tp of the tokens
      for (int v : node.inputs) {
        const size_t at = static_cast<size_t>(v);
        split_input = split_input || token_split(g.values()[at].shape, values[at].shape);
      }
      const std::vector<Param*> params = layer->params();
      const bool splits = std::any_of(params.begin(), params.end(),
                                      [](const Param* p) { return p->shard.split(); });
      if (sequence_parallel && split_input && !splits) {
        // Between regions: token by token, its whole parameters' gradients summed.
        if (!params.empty())
          layer = std::make_unique<SequenceParallelReplica>(std::move(layer), tp);
      } else if (sequence_parallel && splits && !build.took_sequence) {
        throw Error(
            "{} ({}): --sequence-parallel needs every layer that splits parameters across the "
            "tensor-parallel group to have a sequence-parallel form, and this one has none",
            node.name, node.layer->kind());
      }
      const std::vector<int> outs = g.add(node.name, std::move(layer), node.inputs);
      check(outs == node.outputs,
            "{}: its tensor-parallel form's {} outputs are not the logical node's {}", node.name,
            outs.size(), node.outputs.size());
      if (sequence_parallel && split_input && !splits)
        for (int v : outs) {
          const size_t at = static_cast<size_t>(v);
          check(token_split(g.values()[at].shape, values[at].shape),
                "{} ({}): under --sequence-parallel its input holds 1/{} of the tokens, and its "
                "output {} (whole: {}) does not: only a layer that works token by token may sit "
                "between tensor-parallel regions",
                node.name, node.layer->kind(), tp.size(), g.values()[at].shape.str(),
                values[at].shape.str());
        }
    }
  };
  for (size_t v = 0; v < values.size(); ++v) {
    const Value& val = values[v];
    if (val.producer < 0) {
      const int id = g.input(val.name, val.shape, val.dtype, val.requires_grad);
      check(id == static_cast<int>(v), "graph input '{}' became value {} instead of {}", val.name,
            id, v);
    } else if (static_cast<size_t>(val.producer) >= next) {
      add_through(static_cast<size_t>(val.producer));
    }
  }
  if (next < nodes.size()) add_through(nodes.size() - 1);  // nodes without outputs
  for (int v : logical.outputs()) g.mark_output(v);
  g.set_activation_dtype(logical.activation_dtype());
  return g;
}

namespace {

// A tensor-parallel group in name only: rank 0 of `size`, for building a
// rank's graph to check it. Building communicates nothing; anything that
// tries is a bug, and says so.
class ShapeOnlyGroup final : public Communicator {
 public:
  explicit ShapeOnlyGroup(int size) : Communicator(CommOptions{}), size_(size) {}
  int rank() const override { return 0; }
  int size() const override { return size_; }
  int world_rank(int r) const override { return r; }
  std::string describe() const override { return "tp (checking shapes)"; }
  RequestPtr isend(const Tensor&, int, MessageTag) override { fail("isend"); }
  RequestPtr irecv(const Tensor&, int, MessageTag) override { fail("irecv"); }
  void all_reduce(const Tensor&, ReduceOp) override { fail("all_reduce"); }
  void all_gather(const Tensor&, const Tensor&) override { fail("all_gather"); }
  void reduce_scatter(const Tensor&, const Tensor&, ReduceOp) override { fail("reduce_scatter"); }
  void broadcast(const Tensor&, int) override { fail("broadcast"); }
  void barrier() override { fail("barrier"); }
  std::unique_ptr<Communicator> split(const std::vector<std::vector<int>>&,
                                      const std::string&) override {
    fail("split");
  }

 private:
  [[noreturn]] static void fail(const char* op) {
    throw Error("{} while checking tensor-parallel shapes: building a graph must not communicate",
                op);
  }
  int size_;
};

}  // namespace

void check_tensor_parallel(const Graph& logical, int tp, bool sequence_parallel) {
  check(tp >= 1, "tensor-parallel size ({}) must be at least 1", tp);
  check(!sequence_parallel || tp > 1,
        "--sequence-parallel needs --tensor-model-parallel-size above 1 (got {}): it splits "
        "the tokens across the tensor-parallel group",
        tp);
  if (tp == 1) return;
  ShapeOnlyGroup group(tp);
  tensor_parallel_graph(logical, group, std::make_shared<ParamStore>(), sequence_parallel);
}

}  // namespace weft
