// partitioner/pricing.h — how a cut is priced, shared by evaluate_plan and the searches.
//
// Every search and evaluate_plan price a stage with the same functions, summing
// in the same order, so the cost a search optimises is bit for bit the cost the
// returned plan reports.
#pragma once

#include <weft/partition.h>

#include <vector>

namespace weft::partition_detail {

// Element i of a vector: nodes, stages and ranks are numbered with ints throughout.
template <typename V>
decltype(auto) at(V& v, int i) {
  return v[static_cast<size_t>(i)];
}

// Validated options: the rank of every stage and the micro-batches each rank holds.
struct Layout {
  int pp = 1, chunks = 1, stages = 1;
  std::vector<int> rank;       // per stage
  std::vector<int> in_flight;  // per rank
  double budget = 0;           // bytes per rank; 0 = unlimited
};
// Throws Error naming the option and the rule it breaks.
Layout make_layout(const Graph& g, const PartitionOptions& opt);

inline bool fits(double bytes, double budget) { return budget <= 0 || bytes <= budget; }

// The one formula for a rank's bytes: parameters with their gradients and optimizer
// state, plus the activations of every micro-batch the rank holds at once.
inline double memory_bytes(double state_factor, double params, int in_flight, double activations) {
  return state_factor * params + in_flight * activations;
}

// The cost model, rearranged per node, parameter and crossing value.
struct Pricing {
  Pricing(const Graph& g, const CostModel& cost);  // throws Error on a bad cost model

  int nodes = 0;
  double link = 0;                   // boundary bytes per cost unit; 0 = free
  double state_factor = 4;           // 1 + state_per_param_byte
  std::vector<double> work_prefix;   // F + I + W of nodes [0, i)
  std::vector<double> param_prefix;  // cost-model param_bytes of nodes [0, i)
  std::vector<double> act_prefix;    // activation bytes of nodes [0, i)

  // A parameter's bytes are its share (by element count) of the param_bytes of the
  // node that first uses it; a later user on another rank holds a copy of it.
  std::vector<double> param_bytes;            // per parameter id
  std::vector<std::vector<int>> node_params;  // per node: the parameter ids it uses
  std::vector<int> first_user;                // per parameter id: the first node using it
  std::vector<double> own_bytes;              // per node: param_bytes no parameter of it carries
  std::vector<double> activation;             // per node

  // A value read after the node producing it: it crosses every cut in between.
  struct Crossing {
    int producer, last_reader;
    double bytes;  // the producer's output_bytes, split over its outputs by size
  };
  std::vector<Crossing> crossings;

  double work(int a, int b) const { return at(work_prefix, b) - at(work_prefix, a); }
  // Bytes stage [a, b) sends forward: values produced in it and read after it.
  double sent_bytes(int a, int b) const;
  // F + I + W of nodes [a, b) plus the time to send its boundary.
  double time(int a, int b) const;
};

// What one rank holds: each parameter once, however many of its nodes use it.
class RankMemory {
 public:
  explicit RankMemory(const Pricing& p) : p_(&p), held_(p.param_bytes.size(), 0) {}

  struct Totals {
    double params = 0, activations = 0;
  };
  void add(int node);
  // Forgets nodes [a, b), the last ones added, and puts back the totals from before them
  // (restoring rather than subtracting keeps the sums exact).
  void remove(int a, int b, Totals before);
  Totals totals() const { return totals_; }
  bool holds(int param) const { return at(held_, param) > 0; }
  double bytes(int in_flight) const {
    return memory_bytes(p_->state_factor, totals_.params, in_flight, totals_.activations);
  }

 private:
  const Pricing* p_;
  std::vector<int> held_;  // per parameter id: how many added nodes use it
  Totals totals_;
};

// Bytes held by each rank when stage s (nodes [begin[s], begin[s+1])) runs on rank[s].
std::vector<double> rank_memory(const Pricing& p, const Layout& l, const std::vector<int>& begin);

}  // namespace weft::partition_detail
