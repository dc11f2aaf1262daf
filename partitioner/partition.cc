// The partition methods: uniform (blocks), parameters and time.
#include "partitioner/search.h"

#include <weft/error.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <unordered_set>

namespace weft {

PartitionMethod parse_partition_method(const std::string& name) {
  if (name == "uniform") return PartitionMethod::Uniform;
  if (name == "parameters") return PartitionMethod::Parameters;
  if (name == "time") return PartitionMethod::Time;
  throw Error("partition method '{}' is unknown; choose one of: uniform, parameters, time", name);
}

namespace {

using namespace partition_detail;

const char* method_name(PartitionMethod m) {
  switch (m) {
    case PartitionMethod::Uniform: return "uniform";
    case PartitionMethod::Parameters: return "parameters";
    case PartitionMethod::Time: return "time";
  }
  return "?";
}

std::string bytes_text(double bytes) {
  std::string s = bytes == std::floor(bytes) && bytes < 1e18 ? fmt::format("{:.0f} bytes", bytes)
                                                             : fmt::format("{} bytes", bytes);
  if (bytes >= 1024 * 1024) s += fmt::format(" ({:.1f} MiB)", bytes / (1024 * 1024));
  return s;
}

// The transformer block of a node named "h.<i>" or "h.<i>.*": i; otherwise -1.
int block_of(const std::string& name) {
  if (name.rfind("h.", 0) != 0) return -1;
  size_t end = 2;
  while (end < name.size() && std::isdigit(static_cast<unsigned char>(name[end]))) ++end;
  if (end == 2 || end - 2 > 9 || (end < name.size() && name[end] != '.')) return -1;
  return std::stoi(name.substr(2, end - 2));
}

// Where each of `parts` shares of `count` items starts, ending with `count`. The first
// count % parts shares take one item more, as DeepSpeed's partition_uniform does.
std::vector<int> even_starts(int count, int parts) {
  std::vector<int> starts;
  for (int s = 0; s <= parts; ++s) starts.push_back(s * (count / parts) + std::min(s, count % parts));
  return starts;
}

// Cuts just before the first node of a block, so stage 0 also takes the nodes before
// the first block and the last stage the nodes after the last one.
std::vector<int> uniform_cut(const Graph& g, const Layout& l) {
  const int n = static_cast<int>(g.nodes().size());
  std::vector<int> block_start;
  std::unordered_set<int> seen;
  for (int i = 0; i < n; ++i) {
    const int b = block_of(g.nodes()[static_cast<size_t>(i)].name);
    if (b >= 0 && seen.insert(b).second) block_start.push_back(i);
  }
  if (block_start.empty()) return even_starts(n, l.stages);
  const int blocks = static_cast<int>(block_start.size());
  check(blocks >= l.stages,
        "uniform partitioning gives every stage whole transformer blocks, but the graph has "
        "{} blocks (\"h.<i>.*\"), fewer than pp x chunks = {} stages; use the parameters or "
        "time method",
        blocks, l.stages);
  const std::vector<int> first = even_starts(blocks, l.stages);
  std::vector<int> begin{0};
  for (int s = 1; s < l.stages; ++s) begin.push_back(block_start[static_cast<size_t>(first[static_cast<size_t>(s)])]);
  begin.push_back(n);
  return begin;
}

// Least largest stage parameter bytes; of those cuts, the one with the least largest time.
std::vector<int> parameters_cut(const StageTables& t) {
  const int n = t.p.nodes, stages = t.l.stages;
  const double least =
      min_max_suffix(n, stages, [&](int, int a, int b) { return t.params(a, b); })[0][0];
  return min_max_cut(n, stages, [&](int, int a, int b) {
    return t.params(a, b) <= least ? t.time(a, b) : kInf;
  });
}

bool all_fit(const std::vector<double>& bytes, double budget) {
  return std::all_of(bytes.begin(), bytes.end(), [&](double b) { return fits(b, budget); });
}

// Least largest stage time within the budget; empty when no cut fits. With one stage
// per rank a stage's memory is its rank's, so the DP over cuts is exact. With several,
// the DP's per-stage check is only necessary: its cut is optimal if its ranks fit, and
// otherwise the exact search takes over.
std::vector<int> time_cut(const StageTables& t) {
  const Layout& l = t.l;
  std::vector<int> cut = min_max_cut(t.p.nodes, l.stages, [&](int s, int a, int b) {
    return fits(t.memory(s, a, b), l.budget) ? t.time(a, b) : kInf;
  });
  if (cut.empty() || l.chunks == 1 || l.budget <= 0) return cut;
  if (all_fit(rank_memory(t.p, l, cut), l.budget)) return cut;
  return branch_and_bound(t, Goal::Time);
}

// The cut whose largest rank memory is least.
std::vector<int> least_memory_cut(const StageTables& t) {
  if (t.l.chunks > 1) return branch_and_bound(t, Goal::Memory);
  return min_max_cut(t.p.nodes, t.l.stages,
                     [&](int s, int a, int b) { return t.memory(s, a, b); });
}

double peak(const StagePlan& plan, int* rank = nullptr) {
  const auto it = std::max_element(plan.rank_memory.begin(), plan.rank_memory.end());
  if (rank != nullptr) *rank = static_cast<int>(it - plan.rank_memory.begin());
  return *it;
}

[[noreturn]] void no_cut_fits(const Graph& g, const CostModel& cost, const PartitionOptions& opt,
                              const StageTables& t) {
  const StagePlan least = evaluate_plan(g, cost, opt, least_memory_cut(t), "least memory");
  throw Error(
      "no plan fits the memory budget of {} per rank: the smallest peak rank memory any cut "
      "into {} stages reaches is {}",
      bytes_text(opt.memory_budget), t.l.stages, bytes_text(peak(least)));
}

void check_budget(const StagePlan& plan, double budget) {
  int rank = 0;
  const double most = peak(plan, &rank);
  check(fits(most, budget),
        "the {} plan needs {} on rank {}, over the memory budget of {} per rank; the time "
        "method finds a plan within the budget when one exists",
        plan.method, bytes_text(most), rank, bytes_text(budget));
}

}  // namespace

StagePlan partition(const Graph& g, const CostModel& cost, const PartitionOptions& opt) {
  const Layout l = make_layout(g, opt);
  const Pricing p(g, cost);
  std::vector<int> cut;
  if (opt.method == PartitionMethod::Uniform) {
    cut = uniform_cut(g, l);
  } else {
    const StageTables t(p, l);
    cut = opt.method == PartitionMethod::Time ? time_cut(t) : parameters_cut(t);
    if (cut.empty()) no_cut_fits(g, cost, opt, t);
  }
  StagePlan plan = evaluate_plan(g, cost, opt, std::move(cut), method_name(opt.method));
  check_budget(plan, l.budget);
  return plan;
}

}  // namespace weft
