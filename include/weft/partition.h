// weft/partition.h — cutting a model graph into pipeline stages.
//
// A StagePlan splits the graph's nodes (kept in topological order) into
// pp * chunks contiguous ranges; stage s runs nodes [begin[s], begin[s+1]).
// A cut may fall anywhere: every value produced before it and read after it
// crosses the boundary (a stage boundary carries a list of tensors).
//
// Methods:
//   uniform     equal numbers of transformer blocks ("h.<i>.*" nodes) per
//               stage; nodes before the first block go to the first stage,
//               nodes after the last block to the last stage. Graphs without
//               blocks split their nodes evenly.
//   parameters  balances parameter bytes (DeepSpeed's "parameters").
//   time        optimal: minimises the largest rank cost, where a stage
//               costs the F, I and W time of its nodes plus the time to send
//               its boundary and a rank the sum of its stages (its chunks),
//               subject to each rank's memory (parameters, gradients and
//               optimizer state, plus the activations its schedule keeps in
//               flight) fitting the budget. With one stage per rank, dynamic
//               programming over cut positions is exact. With several, an
//               exact branch and bound runs from an evened-out cut; past its
//               step limit it returns the best plan found and says so in
//               StagePlan::method, with how far from optimal it can be.
#pragma once

#include <weft/graph.h>

#include <string>
#include <vector>

namespace weft {

enum class PartitionMethod { Uniform, Parameters, Time };
PartitionMethod parse_partition_method(const std::string& name);  // throws naming the value

struct NodeCost {
  double f = 0, i = 0, w = 0;   // seconds (or FLOPs: any one unit)
  double param_bytes = 0;       // parameters first used by this node (tied ones once)
  double activation_bytes = 0;  // kept per micro-batch between F and I/B
  double output_bytes = 0;      // its outputs, per micro-batch
};

struct CostModel {
  std::vector<NodeCost> nodes;    // one per graph node
  double link_bytes_per_unit = 0; // boundary bytes sent per cost unit; 0 = free
  // Bytes of gradients and optimizer state per parameter byte (fp32 AdamW: grad + m + v = 3).
  double state_per_param_byte = 3;

  // From the graph alone: F = forward FLOPs; I = F for every node and W = F
  // for nodes with parameters (a matmul's backward is two matmuls), W = 0
  // without; fp32 bytes for memory.
  static CostModel analytic(const Graph& g);
};

struct PartitionOptions {
  PartitionMethod method = PartitionMethod::Uniform;
  int pp = 1;
  int chunks = 1;  // virtual stages per rank
  // Stage s runs on rank stage_rank[s]; empty means s % pp.
  std::vector<int> stage_rank;
  // Micro-batches whose activations each rank holds at once under the chosen
  // schedule (sched::peak_in_flight); empty means 1 each.
  std::vector<int> in_flight;
  double memory_budget = 0;  // bytes per rank; 0 = unlimited
};

struct StagePlan {
  int pp = 1, chunks = 1;
  std::vector<int> begin;            // size stages + 1; begin.front() = 0, back() = nodes
  std::vector<int> stage_rank;       // stage -> rank
  std::vector<double> stage_cost;    // per stage, by the cost model
  std::vector<double> rank_cost;     // per rank: its stages' costs summed, in stage order
  std::vector<double> rank_memory;   // per rank, bytes
  std::string method;

  int stages() const { return pp * chunks; }
  int stage_of(int node) const;
  double max_stage_cost() const;
  // What `time` minimises: the busiest rank's work per micro-batch. With one
  // chunk per rank it is max_stage_cost().
  double max_rank_cost() const;
  std::string describe(const Graph& g) const;  // a table: stage, rank, nodes, cost, memory
};

// Throws weft::Error naming the rule: fewer nodes than stages, or a budget no
// plan can meet (naming the smallest peak memory any plan reaches).
StagePlan partition(const Graph& g, const CostModel& cost, const PartitionOptions& opt);
// Costs and memory of a given cut, and the checks every plan must pass: the
// ranges cover every node exactly once, in order, none empty.
StagePlan evaluate_plan(const Graph& g, const CostModel& cost, const PartitionOptions& opt,
                        std::vector<int> begin, std::string method);

}  // namespace weft
