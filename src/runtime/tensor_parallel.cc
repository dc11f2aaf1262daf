#include <weft/tensor_parallel.h>

#include <fmt/ranges.h>

#include <algorithm>

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

Graph tensor_parallel_graph(const Graph& logical, Communicator& tp,
                            std::shared_ptr<ParamStore> store) {
  check(store != nullptr, "tensor_parallel_graph needs a parameter store");
  check(store.get() != &logical.param_store(),
        "tensor_parallel_graph needs a store of its own, not the logical graph's");
  TpBuild build{&tp, store.get()};
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
      try {
        layer = node.layer->tensor_parallel(build);
      } catch (const Error& e) {
        throw Error("{} ({}) at tensor-parallel size {}: {}", node.name, node.layer->kind(),
                    tp.size(), e.what());
      }
      const std::vector<int> outs = g.add(node.name, std::move(layer), node.inputs);
      check(outs == node.outputs,
            "{}: its tensor-parallel form's {} outputs are not the logical node's {}", node.name,
            outs.size(), node.outputs.size());
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

void check_tensor_parallel(const Graph& logical, int tp) {
  check(tp >= 1, "tensor-parallel size ({}) must be at least 1", tp);
  if (tp == 1) return;
  ShapeOnlyGroup group(tp);
  tensor_parallel_graph(logical, group, std::make_shared<ParamStore>());
}

}  // namespace weft
