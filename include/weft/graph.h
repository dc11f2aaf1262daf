// weft/graph.h — a model as a DAG of layer nodes.
//
// Values are tensors with static shapes (the graph is built for one
// micro-batch size); nodes are layers reading values and producing values.
// Nodes are kept in topological order (a node may only read values that
// exist when it is added), so a contiguous node range is a valid pipeline
// chunk, and a value may be read by any later node: skip connections and
// residuals are ordinary edges.
//
//   Graph g(params);
//   int tok = g.input("tokens", {B, T}, DType::I32);
//   int h   = g.add("h.0.ln_1", std::make_unique<LayerNorm>(...), {x});
#pragma once

#include <weft/layer.h>
#include <weft/param.h>

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace weft {

struct Value {
  std::string name;
  Shape shape;
  DType dtype = DType::F32;
  bool requires_grad = false;
  int producer = -1;           // node index, -1 for a graph input
  std::vector<int> consumers;  // node indices
};

struct Node {
  std::string name;
  std::unique_ptr<Layer> layer;
  std::vector<int> inputs;
  std::vector<int> outputs;
};

class Graph {
 public:
  explicit Graph(std::shared_ptr<ParamStore> params) : params_(std::move(params)) {}
  Graph(Graph&&) = default;
  Graph& operator=(Graph&&) = default;

  int input(const std::string& name, Shape shape, DType dtype, bool requires_grad = false);
  // Adds a node; returns its output value ids. Throws Error on shape mismatch.
  std::vector<int> add(const std::string& name, std::unique_ptr<Layer> layer,
                       std::vector<int> inputs);
  int add1(const std::string& name, std::unique_ptr<Layer> layer, std::vector<int> inputs) {
    return add(name, std::move(layer), std::move(inputs)).at(0);
  }
  void mark_output(int value) { outputs_.push_back(value); }
  // How the activations between nodes are stored: F32, or BF16 for bf16
  // activations (--bf16; weft/ops.h says how each operation reads and rounds
  // them). Every float value a node writes and another node reads takes this
  // dtype; graph inputs keep theirs, and so do values no node reads (the
  // model's outputs, a loss), which stay F32 for the host. A value's
  // gradient takes the value's dtype, as Megatron's --bf16 backward does (its
  // autograd runs on bf16 tensors): the activations' gradients are BF16 too,
  // rounded once per operation like the values; the parameters' gradients,
  // master weights and optimizer state stay F32. Call it once the graph is
  // whole.
  void set_activation_dtype(DType dtype);
  DType activation_dtype() const { return activation_dtype_; }

  const std::vector<Node>& nodes() const { return nodes_; }
  const std::vector<Value>& values() const { return values_; }
  const std::vector<int>& inputs() const { return inputs_; }
  const std::vector<int>& outputs() const { return outputs_; }
  int find_value(const std::string& name) const;  // -1 when absent

  ParamStore& param_store() const { return *params_; }
  const std::shared_ptr<ParamStore>& param_store_ptr() const { return params_; }
  // Parameters used by nodes [begin, end), each once, in first-use order.
  std::vector<Param*> params(int begin = 0, int end = -1) const;
  int64_t param_count() const;
  double node_flops(int node) const;
  double forward_flops() const;
  // One line per node: name, kind, output shapes, parameters, FLOPs.
  std::string summary() const;

 private:
  std::shared_ptr<ParamStore> params_;
  std::vector<Node> nodes_;
  std::vector<Value> values_;
  std::vector<int> inputs_;
  std::vector<int> outputs_;
  DType activation_dtype_ = DType::F32;
};

// The transformer block of a node named "h.<i>" or "h.<i>.<...>": i;
// otherwise -1. The uniform partition and block recompute count blocks so.
int block_of(std::string_view node_name);

}  // namespace weft
