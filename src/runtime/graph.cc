#include <weft/graph.h>

#include <algorithm>
#include <cctype>
#include <unordered_set>

namespace weft {

int Graph::input(const std::string& name, Shape shape, DType dtype, bool requires_grad) {
  check(find_value(name) < 0, "graph value '{}' is defined twice", name);
  values_.push_back(Value{name, shape, dtype, requires_grad, -1, {}});
  int id = static_cast<int>(values_.size()) - 1;
  inputs_.push_back(id);
  return id;
}

std::vector<int> Graph::add(const std::string& name, std::unique_ptr<Layer> layer,
                            std::vector<int> inputs) {
  std::vector<Shape> in_shapes;
  bool needs_grad = !layer->params().empty();
  for (int v : inputs) {
    check(v >= 0 && v < static_cast<int>(values_.size()),
          "node '{}' reads value {}, which does not exist yet (graph has {} values)", name, v,
          values_.size());
    in_shapes.push_back(values_[static_cast<size_t>(v)].shape);
    needs_grad = needs_grad || values_[static_cast<size_t>(v)].requires_grad;
  }
  std::vector<Shape> out_shapes;
  std::vector<DType> out_dtypes;
  try {
    out_shapes = layer->output_shapes(in_shapes);
    out_dtypes = layer->output_dtypes(in_shapes);
  } catch (const Error& e) {
    throw Error("{} ({}): {}", name, layer->kind(), e.what());
  }
  const int node = static_cast<int>(nodes_.size());
  std::vector<int> outs;
  for (size_t i = 0; i < out_shapes.size(); ++i) {
    std::string vname = out_shapes.size() == 1 ? name : fmt::format("{}:{}", name, i);
    check(find_value(vname) < 0, "graph value '{}' is defined twice", vname);
    values_.push_back(Value{vname, out_shapes[i], out_dtypes[i], needs_grad, node, {}});
    outs.push_back(static_cast<int>(values_.size()) - 1);
  }
  for (int v : inputs) values_[static_cast<size_t>(v)].consumers.push_back(node);
  nodes_.push_back(Node{name, std::move(layer), std::move(inputs), outs});
  return outs;
}

int Graph::find_value(const std::string& name) const {
  for (size_t i = 0; i < values_.size(); ++i)
    if (values_[i].name == name) return static_cast<int>(i);
  return -1;
}

std::vector<Param*> Graph::params(int begin, int end) const {
  if (end < 0) end = static_cast<int>(nodes_.size());
  std::vector<Param*> out;
  std::unordered_set<Param*> seen;
  for (int n = begin; n < end; ++n)
    for (Param* p : nodes_[static_cast<size_t>(n)].layer->params())
      if (seen.insert(p).second) out.push_back(p);
  return out;
}

int64_t Graph::param_count() const {
  int64_t n = 0;
  for (Param* p : params()) n += p->value.numel();
  return n;
}

double Graph::node_flops(int node) const {
  const Node& nd = nodes_[static_cast<size_t>(node)];
  std::vector<Shape> in;
  for (int v : nd.inputs) in.push_back(values_[static_cast<size_t>(v)].shape);
  return nd.layer->flops(in);
}

double Graph::forward_flops() const {
  double f = 0;
  for (int n = 0; n < static_cast<int>(nodes_.size()); ++n) f += node_flops(n);
  return f;
}

std::string Graph::summary() const {
  std::string s;
  for (int n = 0; n < static_cast<int>(nodes_.size()); ++n) {
    const Node& nd = nodes_[static_cast<size_t>(n)];
    int64_t np = 0;
    for (Param* p : nd.layer->params()) np += p->value.numel();
    std::string outs;
    for (int v : nd.outputs) outs += values_[static_cast<size_t>(v)].shape.str();
    s += fmt::format("{:<24} {:<14} {:<18} params {:>10}  fwd {:.3g} FLOP\n", nd.name,
                     nd.layer->kind(), outs, np, node_flops(n));
  }
  return s;
}

void Graph::set_activation_dtype(DType dtype) {
  check(dtype == DType::F32 || dtype == DType::BF16,
        "activation dtype {} is not F32 or BF16", dtype_name(dtype));
  activation_dtype_ = dtype;
  for (Value& v : values_)
    if (v.producer >= 0 && !v.consumers.empty() &&
        (v.dtype == DType::F32 || v.dtype == DType::BF16))
      v.dtype = dtype;
}

int block_of(std::string_view name) {
  if (!name.starts_with("h.")) return -1;
  size_t end = 2;
  while (end < name.size() && std::isdigit(static_cast<unsigned char>(name[end]))) ++end;
  if (end == 2 || end - 2 > 9 || (end < name.size() && name[end] != '.')) return -1;
  int block = 0;
  for (size_t k = 2; k < end; ++k) block = 10 * block + (name[k] - '0');
  return block;
}

}  // namespace weft
