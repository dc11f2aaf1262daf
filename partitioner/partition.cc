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
    case PartitionMethod::Uniform:
      return "uniform";
    case PartitionMethod::Parameters:
      return "parameters";
    case PartitionMethod::Time:
      return "time";
  }
  return "?";
}

std::string bytes_text(double bytes) {
  std::string s = bytes == std::floor(bytes) ? fmt::format("{:.0f} bytes", bytes)
                                             : fmt::format("{:.1f} bytes", bytes);
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
  for (int s = 0; s <= parts; ++s)
    starts.push_back(s * (count / parts) + std::min(s, count % parts));
  return starts;
}

// Cuts just before the first node of a block, so stage 0 also takes the nodes before
// the first block and the last stage the nodes after the last one.
std::vector<int> uniform_cut(const Graph& g, const Layout& l) {
  const int n = static_cast<int>(g.nodes().size());
  std::vector<int> block_start;
  std::unordered_set<int> seen;
  for (int i = 0; i < n; ++i) {
    const int b = block_of(at(g.nodes(), i).name);
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
  for (int s = 1; s < l.stages; ++s) begin.push_back(at(block_start, at(first, s)));
  begin.push_back(n);
  return begin;
}

// Least largest stage parameter bytes; of those cuts, the one with the least largest time.
std::vector<int> parameters_cut(const StageTables& t) {
  const int n = t.p.nodes, stages = t.l.stages;
  const double least =
      min_max_suffix(n, stages, [&](int, int a, int b) { return t.params(a, b); })[0][0];
  return min_max_cut(
      n, stages, [&](int, int a, int b) { return t.params(a, b) <= least ? t.time(a, b) : kInf; });
}

bool all_fit(const std::vector<double>& bytes, double budget) {
  return std::all_of(bytes.begin(), bytes.end(), [&](double b) { return fits(b, budget); });
}

// With several stages per rank the exact search may grow exponentially (a rank's memory
// sums non-adjacent ranges, so no cut-position DP is exact); it stops after this many
// partial cuts, a few seconds, and says so rather than claim what it did not prove. The
// search that only words an error gets a quarter of that.
constexpr long kMaxSearchSteps = 200000;
constexpr long kMaxMessageSteps = kMaxSearchSteps / 4;

struct TimeCut {
  std::vector<int> cut;  // empty when no cut fits the budget
  bool proven = true;    // false: the step limit ended the search before it proved optimality
};

// Least largest stage time within the budget. With one stage per rank a stage's memory
// is its rank's, so the DP over cuts is exact. With several, the DP's per-stage check is
// only necessary: its cut is optimal if its ranks fit, and otherwise the exact search
// takes over.
TimeCut time_cut(const StageTables& t) {
  const Layout& l = t.l;
  std::vector<int> cut = min_max_cut(t.p.nodes, l.stages, [&](int s, int a, int b) {
    return fits(t.memory(s, a, b), l.budget) ? t.time(a, b) : kInf;
  });
  if (cut.empty() || l.chunks == 1 || l.budget <= 0) return {cut, true};
  if (all_fit(rank_memory(t.p, l, cut), l.budget)) return {cut, true};
  SearchResult found = branch_and_bound(t, Goal::Time, kMaxSearchSteps);
  return {std::move(found.cut), found.proven};
}

double peak(const StagePlan& plan, int* rank = nullptr) {
  const auto it = std::max_element(plan.rank_memory.begin(), plan.rank_memory.end());
  if (rank != nullptr) *rank = static_cast<int>(it - plan.rank_memory.begin());
  return *it;
}

std::string least_peak_text(const Graph& g, const CostModel& cost, const PartitionOptions& opt,
                            const StageTables& t) {
  SearchResult least{{}, true, 0};
  if (t.l.chunks == 1) {
    least.cut =
        min_max_cut(t.p.nodes, t.l.stages, [&](int s, int a, int b) { return t.memory(s, a, b); });
  } else {
    least = branch_and_bound(t, Goal::Memory, kMaxMessageSteps);
  }
  const double reached = peak(evaluate_plan(g, cost, opt, least.cut, "least memory"));
  if (least.proven) return fmt::format("is {}", bytes_text(reached));
  return fmt::format("is between {} and {} (the search for it stopped after {} steps)",
                     bytes_text(std::floor(std::min(reached, least.floor))), bytes_text(reached),
                     kMaxMessageSteps);
}

// Why no plan came back, naming the least peak memory any cut reaches.
[[noreturn]] void no_cut_fits(const Graph& g, const CostModel& cost, const PartitionOptions& opt,
                              const StageTables& t, bool proven) {
  const std::string least = least_peak_text(g, cost, opt, t);
  const std::string budget = bytes_text(opt.memory_budget);
  if (proven)
    throw Error(
        "no plan fits the memory budget of {} per rank: the least peak rank memory of any cut "
        "into {} stages {}",
        budget, t.l.stages, least);
  throw Error(
      "no plan within the memory budget of {} per rank was found in {} search steps (with {} "
      "chunks per rank the exact search can grow exponentially); the least peak rank memory of "
      "any cut into {} stages {}",
      budget, kMaxSearchSteps, t.l.chunks, t.l.stages, least);
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
  std::string method = method_name(opt.method);
  if (opt.method == PartitionMethod::Uniform) {
    cut = uniform_cut(g, l);
  } else if (opt.method == PartitionMethod::Parameters) {
    cut = parameters_cut(StageTables(p, l));
  } else {
    const StageTables t(p, l);
    TimeCut found = time_cut(t);
    if (found.cut.empty()) no_cut_fits(g, cost, opt, t, found.proven);
    // A plan that fits but is not proven optimal says so wherever it is described.
    if (!found.proven) method = "time (best found: the search stopped before proving it optimal)";
    cut = std::move(found.cut);
  }
  StagePlan plan = evaluate_plan(g, cost, opt, std::move(cut), method);
  check_budget(plan, l.budget);
  return plan;
}

}  // namespace weft
