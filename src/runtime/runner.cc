#include <weft/ops.h>
#include <weft/runner.h>

#include <algorithm>

namespace weft {

MicroBatch::MicroBatch(const Graph& graph, Device device)
    : graph_(&graph),
      device_(device),
      arena_(device),
      values_(graph.values().size()),
      grads_(graph.values().size()) {
  for (const Node& n : graph.nodes()) ctx_.push_back(n.layer->make_ctx());
  size_t most_in = 0, most_out = 0;
  for (const Node& n : graph.nodes()) {
    most_in = std::max(most_in, n.inputs.size());
    most_out = std::max(most_out, n.outputs.size());
  }
  in_buf_.reserve(std::max(most_in, most_out));
  out_buf_.reserve(std::max(most_in, most_out));
}

Tensor MicroBatch::input(int v) {
  const Value& val = graph_->values()[static_cast<size_t>(v)];
  check(val.producer < 0, "'{}' is not a graph input", val.name);
  Tensor& t = values_[static_cast<size_t>(v)];
  if (!t.defined()) t = arena_.alloc(val.shape, val.dtype);
  return t;
}

void MicroBatch::set_input(int v, const Tensor& src) {
  const Value& val = graph_->values()[static_cast<size_t>(v)];
  check(src.shape() == val.shape && src.dtype() == val.dtype,
        "input '{}' expects {} {}, got {} {}", val.name, dtype_name(val.dtype), val.shape.str(),
        dtype_name(src.dtype()), src.shape().str());
  input(v).copy_from(src);
}

void MicroBatch::seed_grad(int v, float g) {
  const Value& val = graph_->values()[static_cast<size_t>(v)];
  Tensor& t = grads_[static_cast<size_t>(v)];
  if (!t.defined()) t = arena_.alloc(val.shape, val.dtype);
  ops::fill(t, g);
  seeded_ = t.numel() == 1 ? v : -1;
  seed_ = g;
}

Tensor MicroBatch::zero_grad(const Value& val) {
  if (device_.is_cpu()) return arena_.zeros(val.shape, val.dtype);
  return Tensor::zeros(val.shape, val.dtype, device_);
}

Tensor MicroBatch::new_grad(const Value& val) {
  if (device_.is_cpu()) return arena_.alloc(val.shape, val.dtype);
  return Tensor::empty(val.shape, val.dtype, device_);
}

void MicroBatch::reset() {
  for (auto& t : values_) t = Tensor();
  for (auto& t : grads_) t = Tensor();
  seeded_ = -1;
  arena_.reset();
}

Bf16Copies::Bf16Copies(const Graph& g, const std::vector<Param*>& params, Bf16Tables& tables)
    : params_(params), made_(g.activation_dtype() == DType::BF16) {
  if (!made_) return;
  tables.values.clear();  // both keep their capacity
  tables.copies.clear();
  for (Param* p : params_) {  // matrices for the GEMMs, vectors for their biases
    if (!p->value16_store.defined() || p->value16_store.shape() != p->value.shape() ||
        !(p->value16_store.device() == p->value.device()))
      p->value16_store = Tensor::empty(p->value.shape(), DType::BF16, p->value.device());
    tables.values.push_back(p->value);
    tables.copies.push_back(p->value16_store);
  }
  ops::convert_multi(tables.values, tables.copies, tables.convert);
  // The lists hold no tensor between batches (a parameter's replaced value
  // is not kept alive here); the device table keeps only pointers, compared
  // on the next call.
  tables.values.clear();
  tables.copies.clear();
  for (Param* p : params_) p->value16 = p->value16_store;
}

Bf16Copies::~Bf16Copies() {
  if (made_)
    for (Param* p : params_) p->value16 = Tensor();
}

void forward(const Graph& g, MicroBatch& mb, int begin, int end) {
  for (int n = begin; n < end; ++n) {
    const Node& node = g.nodes()[static_cast<size_t>(n)];
    mb.in_buf_.clear();
    for (int v : node.inputs) {
      const Tensor& t = mb.values_[static_cast<size_t>(v)];
      check(t.defined(), "node '{}' reads '{}', which has not been computed or received",
            node.name, g.values()[static_cast<size_t>(v)].name);
      mb.in_buf_.push_back(t);
    }
    mb.out_buf_.clear();
    for (int v : node.outputs) {
      const Value& val = g.values()[static_cast<size_t>(v)];
      Tensor t = mb.arena_.alloc(val.shape, val.dtype);
      mb.values_[static_cast<size_t>(v)] = t;
      mb.out_buf_.push_back(t);
    }
    node.layer->forward(*mb.ctx_[static_cast<size_t>(n)], mb.arena_, mb.in_buf_, mb.out_buf_);
  }
}

void backward_input(const Graph& g, MicroBatch& mb, int n) {
  const Node& node = g.nodes()[static_cast<size_t>(n)];
  mb.out_buf_.clear();  // gradients of the outputs
  for (int v : node.outputs) {
    Tensor& gr = mb.grads_[static_cast<size_t>(v)];
    // An output nothing downstream used has a zero gradient.
    if (!gr.defined()) gr = mb.zero_grad(g.values()[static_cast<size_t>(v)]);
    mb.out_buf_.push_back(gr);
  }
  // Gradients of the inputs, accumulated into. The first node to reach a
  // value (its last reader) gets a fresh buffer: uninitialised where the
  // layer writes it whole (Layer::writes_input_grad), zeros otherwise. Or,
  // for one input that only this node reads, once, and whose gradient is
  // output 0's as the layer leaves it (Layer::may_share_input_grad: a
  // residual branch's), output 0's gradient buffer itself. Nothing else
  // writes that buffer again: the output's readers are done, and this value
  // has no other reader. Values that come to share one buffer so form a
  // chain of single readers, each done with it but the last one's producer,
  // which only reads it. The one layer that writes its output's gradient is
  // such a link (ResidualLayerNorm, which adds to it in place before the
  // value that shares it is read), and no link keeps the buffer to read
  // later: only the chain's last producer does.
  mb.in_buf_.clear();
  uint32_t fresh = 0, shared = 0;
  for (size_t i = 0; i < node.inputs.size(); ++i) {
    const int v = node.inputs[i];
    const Value& val = g.values()[static_cast<size_t>(v)];
    Tensor& gr = mb.grads_[static_cast<size_t>(v)];
    if (val.requires_grad && !gr.defined()) {
      if (shared == 0 && i < 32 && node.layer->may_share_input_grad(i) && val.consumers.size() == 1 &&
          std::count(node.inputs.begin(), node.inputs.end(), v) == 1 &&
          mb.out_buf_[0].shape() == val.shape && mb.out_buf_[0].dtype() == val.dtype) {
        gr = mb.out_buf_[0];
        shared |= 1u << i;
      } else if (i < 32 && node.layer->writes_input_grad(i)) {
        gr = mb.new_grad(val);
        fresh |= 1u << i;
      } else {
        gr = mb.zero_grad(val);
      }
    }
    mb.in_buf_.push_back(val.requires_grad ? gr : Tensor());
  }
  LayerCtx& ctx = *mb.ctx_[static_cast<size_t>(n)];
  ctx.fresh_grads_in = fresh;
  ctx.shared_grads_in = shared;
  if (node.outputs.size() == 1 && node.outputs[0] == mb.seeded_) ctx.seeded_grad_out = mb.seed_;
  node.layer->backward_input(ctx, mb.arena_, mb.out_buf_, mb.in_buf_);
  ctx.fresh_grads_in = ctx.shared_grads_in = 0;
  ctx.seeded_grad_out.reset();
}

void backward_weight(const Graph& g, MicroBatch& mb, int n) {
  const Node& node = g.nodes()[static_cast<size_t>(n)];
  node.layer->backward_weight(*mb.ctx_[static_cast<size_t>(n)], mb.arena_);
  // Nothing reads them again (see MicroBatch; the layer's W has dropped
  // what its ctx kept of them). On the CPU this frees nothing (the arena
  // keeps it all until reset), but it runs the same, so every CPU layout and
  // schedule test checks that nothing does.
  for (int v : node.outputs) mb.grads_[static_cast<size_t>(v)] = Tensor();
}

void backward(const Graph& g, MicroBatch& mb, int begin, int end) {
  for (int n = end - 1; n >= begin; --n) {
    backward_input(g, mb, n);
    backward_weight(g, mb, n);
  }
}

}  // namespace weft
