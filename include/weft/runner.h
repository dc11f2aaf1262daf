// weft/runner.h — running a graph's nodes for one micro-batch.
//
// MicroBatch holds everything one micro-batch keeps alive between its forward
// and its backward: the value tensors, their gradients, each node's LayerCtx
// and the arena they all live in. Pipeline stages run node ranges of the same
// graph; a single process runs the whole range.
//
//   MicroBatch mb(graph);
//   mb.set_input(tok, tokens_tensor);
//   forward(graph, mb, 0, n);
//   mb.seed_grad(loss, 1.0f / tokens);
//   backward(graph, mb, 0, n);       // I then W for each node, in reverse
//   mb.reset();                      // frees its activations for the next one
#pragma once

#include <weft/arena.h>
#include <weft/graph.h>

#include <memory>
#include <vector>

namespace weft {

class MicroBatch {
 public:
  // Activations and their gradients live on `device`. A node's output
  // gradients are dropped when its W is done (which drops what its ctx kept
  // of them, weft/layer.h): nothing reads them after. On the CPU every tensor comes from
  // the arena, so that frees nothing before reset(). On a GPU, where memory
  // is what limits a model, the gradients come from the caching allocator
  // instead, and each is freed there and then: only the gradients the
  // backward is still accumulating are alive at once, not all of them.
  explicit MicroBatch(const Graph& graph, Device device = Device::cpu());

  // Copies `src` into an arena tensor for graph input `value`.
  void set_input(int value, const Tensor& src);
  // Returns the tensor of an input value to fill in place.
  Tensor input(int value);
  // d loss / d value = g (a scalar value such as the loss).
  void seed_grad(int value, float g);

  const Tensor& value(int v) const { return values_[static_cast<size_t>(v)]; }
  Tensor& value(int v) { return values_[static_cast<size_t>(v)]; }
  const Tensor& grad(int v) const { return grads_[static_cast<size_t>(v)]; }
  Tensor& grad(int v) { return grads_[static_cast<size_t>(v)]; }
  LayerCtx& ctx(int node) { return *ctx_[static_cast<size_t>(node)]; }
  Arena& arena() { return arena_; }

  // Drops every tensor of this micro-batch; the arena keeps its memory.
  void reset();

 private:
  friend void forward(const Graph&, MicroBatch&, int, int);
  friend void backward_input(const Graph&, MicroBatch&, int);
  friend void backward_weight(const Graph&, MicroBatch&, int);
  // A value's gradient, of the value's shape and dtype (weft/graph.h).
  Tensor zero_grad(const Value& val);
  Tensor new_grad(const Value& val);  // uninitialised, for a layer that writes it whole
  const Graph* graph_;
  Device device_;
  Arena arena_;
  std::vector<std::unique_ptr<LayerCtx>> ctx_;
  std::vector<Tensor> values_;
  std::vector<Tensor> grads_;
  // Reused per call so that a step allocates nothing.
  std::vector<Tensor> in_buf_, out_buf_;
  // The value seed_grad last seeded, and with what (LayerCtx::seeded_grad_out).
  int seeded_ = -1;
  float seed_ = 0;
};

// bf16 activations (Graph::activation_dtype() BF16): the parameters' bf16
// copies (Param::value16) for one batch's forward and backward (the GEMMs'
// matrices and the biases their epilogues add), made
// here from `params` and dropped on every way out of the scope, before the
// optimizer changes the values. Nothing for an fp32 graph. `params` must
// outlive the scope.
//
// All copies are one ops::convert_multi (on a GPU one launch, not one per
// parameter), whose lists and device table live in `tables`: the caller
// keeps one Bf16Tables per parameter list from batch to batch (as it keeps
// GradTables), so a steady batch allocates nothing, on the host or the
// device. Passed in rather than cached here by parameter list: a scope
// object has nowhere of its own to keep it, and a process-wide cache would
// be shared by the ranks that run as threads of one process.
struct Bf16Tables {
  std::vector<Tensor> values, copies;  // this batch's lists (emptied after the call)
  std::shared_ptr<void> convert;       // ops::convert_multi's device table
};
class Bf16Copies {
 public:
  Bf16Copies(const Graph& g, const std::vector<Param*>& params, Bf16Tables& tables);
  ~Bf16Copies();
  Bf16Copies(const Bf16Copies&) = delete;
  Bf16Copies& operator=(const Bf16Copies&) = delete;

 private:
  const std::vector<Param*>& params_;
  bool made_;
};

// Forward for nodes [begin, end) in order.
void forward(const Graph& g, MicroBatch& mb, int begin, int end);
// The I action of one node: gradients of its inputs from those of its outputs.
void backward_input(const Graph& g, MicroBatch& mb, int node);
// The W action of one node: its parameter gradients.
void backward_weight(const Graph& g, MicroBatch& mb, int node);
// I then W for nodes [begin, end) in reverse order.
void backward(const Graph& g, MicroBatch& mb, int begin, int end);

}  // namespace weft
