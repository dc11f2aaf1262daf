// The analytic cost model, and the per-node prices every partition search shares.
#include "partitioner/pricing.h"

#include <weft/error.h>

#include <algorithm>
#include <cmath>
#include <unordered_map>
#include <unordered_set>

namespace weft {

using partition_detail::at;

namespace {

double value_bytes(const Value& v) {
  return static_cast<double>(v.shape.numel()) * static_cast<double>(dtype_size(v.dtype));
}

double output_bytes(const Graph& g, int node) {
  double bytes = 0;
  for (int v : at(g.nodes(), node).outputs) bytes += value_bytes(at(g.values(), v));
  return bytes;
}

}  // namespace

CostModel CostModel::analytic(const Graph& g) {
  CostModel m;
  std::unordered_set<const Param*> seen;
  for (int n = 0; n < static_cast<int>(g.nodes().size()); ++n) {
    NodeCost c;
    c.f = g.node_flops(n);
    const std::vector<Param*> params = at(g.nodes(), n).layer->params();
    // Backward through a layer costs about its forward for the input gradient; a layer
    // with weights does a second product of the same size for the weight gradient.
    c.i = c.f;
    c.w = params.empty() ? 0 : c.f;
    for (const Param* p : params)
      if (seen.insert(p).second) c.param_bytes += 4.0 * static_cast<double>(p->value.numel());
    c.output_bytes = output_bytes(g, n);
    // The stash holds what a node produced until its backward runs, and what
    // the layer keeps inside.
    std::vector<Shape> in;
    for (int v : at(g.nodes(), n).inputs) in.push_back(at(g.values(), v).shape);
    c.activation_bytes = c.output_bytes + at(g.nodes(), n).layer->stashed_elements(in) *
                                              static_cast<double>(dtype_size(g.activation_dtype()));
    m.nodes.push_back(c);
  }
  return m;
}

namespace partition_detail {

namespace {

void check_cost(const Graph& g, const CostModel& cost) {
  check(cost.nodes.size() == g.nodes().size(),
        "the cost model has {} node costs for a graph of {} nodes", cost.nodes.size(),
        g.nodes().size());
  auto field = [](double v, const char* what, size_t n, const std::string& name) {
    check(std::isfinite(v) && v >= 0, "cost of node {} '{}': {} = {} must be finite and >= 0", n,
          name, what, v);
  };
  for (size_t n = 0; n < cost.nodes.size(); ++n) {
    const NodeCost& c = cost.nodes[n];
    const std::string& name = g.nodes()[n].name;
    field(c.f, "f", n, name);
    field(c.i, "i", n, name);
    field(c.w, "w", n, name);
    field(c.param_bytes, "param_bytes", n, name);
    field(c.activation_bytes, "activation_bytes", n, name);
    field(c.output_bytes, "output_bytes", n, name);
  }
  check(std::isfinite(cost.link_bytes_per_unit) && cost.link_bytes_per_unit >= 0,
        "link_bytes_per_unit ({}) must be finite and >= 0 (0 = free links)",
        cost.link_bytes_per_unit);
  check(std::isfinite(cost.state_per_param_byte) && cost.state_per_param_byte >= 0,
        "state_per_param_byte ({}) must be finite and >= 0", cost.state_per_param_byte);
}

// Parameter ids in first-use order, the ids each node uses (each once), and each
// parameter's element count.
std::vector<double> index_params(const Graph& g, Pricing& p) {
  std::unordered_map<const Param*, int> id;
  std::vector<double> elements;
  for (const Param* q : g.params()) {
    id.emplace(q, static_cast<int>(id.size()));
    elements.push_back(static_cast<double>(q->value.numel()));
  }
  p.param_bytes.assign(id.size(), 0);
  p.first_user.assign(id.size(), -1);
  p.node_params.resize(static_cast<size_t>(p.nodes));
  for (int n = 0; n < p.nodes; ++n) {
    std::vector<int>& ids = at(p.node_params, n);
    for (const Param* q : at(g.nodes(), n).layer->params()) {
      const int i = id.at(q);
      if (std::find(ids.begin(), ids.end(), i) == ids.end()) ids.push_back(i);
      if (at(p.first_user, i) < 0) at(p.first_user, i) = n;
    }
  }
  return elements;
}

// Splits each node's param_bytes over the parameters it uses first, by element count,
// so a tied parameter can be charged again on another rank that uses it. A node with
// param_bytes but no parameter of its own to carry them keeps them as own_bytes.
void share_param_bytes(const CostModel& cost, const std::vector<double>& elements, Pricing& p) {
  std::vector<bool> seen(elements.size(), false);
  p.own_bytes.assign(static_cast<size_t>(p.nodes), 0);
  for (int n = 0; n < p.nodes; ++n) {
    std::vector<int> first;
    double total = 0;
    for (int id : at(p.node_params, n)) {
      if (at(seen, id)) continue;
      at(seen, id) = true;
      first.push_back(id);
      total += at(elements, id);
    }
    const double bytes = at(cost.nodes, n).param_bytes;
    if (total <= 0) {
      at(p.own_bytes, n) = bytes;
      continue;
    }
    // Multiply before dividing: fp32 bytes (4 x elements) then come out exact.
    for (int id : first) at(p.param_bytes, id) = bytes * at(elements, id) / total;
  }
}

void find_crossings(const Graph& g, const CostModel& cost, Pricing& p) {
  for (int n = 0; n < p.nodes; ++n) {
    const std::vector<int>& outs = at(g.nodes(), n).outputs;
    double total = 0;
    for (int v : outs) total += value_bytes(at(g.values(), v));
    for (int v : outs) {
      const Value& val = at(g.values(), v);
      if (val.consumers.empty()) continue;
      const int last = *std::max_element(val.consumers.begin(), val.consumers.end());
      const double share =
          total > 0 ? value_bytes(val) / total : 1.0 / static_cast<double>(outs.size());
      p.crossings.push_back({n, last, at(cost.nodes, n).output_bytes * share});
    }
  }
}

}  // namespace

Pricing::Pricing(const Graph& g, const CostModel& cost) {
  check_cost(g, cost);
  nodes = static_cast<int>(g.nodes().size());
  link = cost.link_bytes_per_unit;
  state_factor = 1 + cost.state_per_param_byte;
  work_prefix.assign(static_cast<size_t>(nodes) + 1, 0);
  param_prefix.assign(static_cast<size_t>(nodes) + 1, 0);
  act_prefix.assign(static_cast<size_t>(nodes) + 1, 0);
  for (size_t n = 0; n < cost.nodes.size(); ++n) {
    const NodeCost& c = cost.nodes[n];
    work_prefix[n + 1] = work_prefix[n] + (c.f + c.i + c.w);
    param_prefix[n + 1] = param_prefix[n] + c.param_bytes;
    act_prefix[n + 1] = act_prefix[n] + c.activation_bytes;
    activation.push_back(c.activation_bytes);
  }
  share_param_bytes(cost, index_params(g, *this), *this);
  find_crossings(g, cost, *this);
}

double Pricing::sent_bytes(int a, int b) const {
  double bytes = 0;
  for (const Crossing& c : crossings)
    if (c.producer >= a && c.producer < b && c.last_reader >= b) bytes += c.bytes;
  return bytes;
}

double Pricing::time(int a, int b) const {
  const double t = work(a, b);
  return link > 0 ? t + sent_bytes(a, b) / link : t;
}

void RankMemory::add(int node) {
  for (int id : at(p_->node_params, node))
    if (at(held_, id)++ == 0) totals_.params += at(p_->param_bytes, id);
  totals_.params += at(p_->own_bytes, node);
  totals_.activations += at(p_->activation, node);
}

void RankMemory::remove(int a, int b, Totals before) {
  for (int n = a; n < b; ++n)
    for (int id : at(p_->node_params, n)) --at(held_, id);
  totals_ = before;
}

std::vector<double> rank_memory(const Pricing& p, const Layout& l, const std::vector<int>& begin) {
  std::vector<RankMemory> ranks(static_cast<size_t>(l.pp), RankMemory(p));
  for (int s = 0; s < l.stages; ++s)
    for (int n = at(begin, s); n < at(begin, s + 1); ++n) at(ranks, at(l.rank, s)).add(n);
  std::vector<double> bytes;
  for (int r = 0; r < l.pp; ++r) bytes.push_back(at(ranks, r).bytes(at(l.in_flight, r)));
  return bytes;
}

}  // namespace partition_detail
}  // namespace weft
