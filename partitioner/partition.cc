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

// With several stages per rank the exact search may grow exponentially (a rank's memory
// sums non-adjacent ranges, so no cut-position DP is exact); it stops after this many
// partial cuts, a few seconds, and says so rather than claim what it did not prove. The
// search that only words an error gets a quarter of that.
constexpr long kMaxSearchSteps = 200000;
constexpr long kMaxMessageSteps = kMaxSearchSteps / 4;

struct TimeCut {
  std::vector<int> cut;  // empty when no cut fits the budget
  bool proven = true;    // false: the step limit ended the search before it proved optimality
  double floor = 0;      // no cut's largest rank time is lower
};

// A cut's rank times, its largest first then the sum of their squares: moving a cut
// point that leaves the busiest rank as busy can still even out the others.
struct Balance {
  double most = 0, squares = 0;
  bool operator<(const Balance& o) const {
    return most < o.most || (most == o.most && squares < o.squares);
  }
};
Balance balance_of(const StageTables& t, const std::vector<int>& cut) {
  std::vector<double> load(static_cast<size_t>(t.l.pp), 0.0);
  for (int s = 0; s < t.l.stages; ++s)
    at(load, at(t.l.rank, s)) += t.time(at(cut, s), at(cut, s + 1));
  Balance b;
  for (double x : load) b.most = std::max(b.most, x), b.squares += x * x;
  return b;
}

// The branch and bound's first cut to beat, when rank times sum several chunks: from
// `cut` (which fits), cut points move one way or the other by halving steps while that
// evens the ranks' times and every rank still fits.
std::vector<int> balanced(const StageTables& t, std::vector<int> cut) {
  const int n = t.p.nodes;
  auto fits_all = [&](const std::vector<int>& c) {
    for (double b : rank_memory(t.p, t.l, c))
      if (!fits(b, t.l.budget)) return false;
    return true;
  };
  if (!fits_all(cut)) return {};
  Balance best = balance_of(t, cut);
  for (int step = std::max(1, n / (2 * t.l.stages)); step >= 1; step /= 2) {
    for (bool moved = true; moved;) {
      moved = false;
      for (int s = 1; s < t.l.stages; ++s)
        for (int dir : {-1, 1}) {
          std::vector<int> c = cut;
          at(c, s) += dir * step;
          if (at(c, s) <= at(c, s - 1) || at(c, s) >= at(c, s + 1)) continue;
          const Balance b = balance_of(t, c);
          if (!(b < best) || !fits_all(c)) continue;
          best = b;
          cut = std::move(c);
          moved = true;
        }
    }
  }
  return cut;
}

// Least largest rank time within the budget. With one stage per rank a rank's time and
// memory are its stage's, so the DP over cuts is exact. With several (interleaved, ZB-V)
// a rank's time sums its chunks, which no cut-position DP sees: the exact search runs,
// starting from the DP's least largest stage time when its ranks fit.
TimeCut time_cut(const StageTables& t) {
  const Layout& l = t.l;
  std::vector<int> cut = min_max_cut(t.p.nodes, l.stages, [&](int s, int a, int b) {
    return fits(t.memory(s, a, b), l.budget) ? t.time(a, b) : kInf;
  });
  if (cut.empty() || l.chunks == 1) return {cut, true};
  // A cut that fits to start from: the DP's, or the least largest stage time over cuts
  // whose ranks fit.
  std::vector<int> start = balanced(t, cut);
  if (start.empty()) {
    SearchResult first = branch_and_bound(t, Goal::StageTime, kMaxSearchSteps);
    if (first.cut.empty()) return {{}, first.proven};
    start = balanced(t, first.cut);
  }
  SearchResult found = branch_and_bound(t, Goal::Time, kMaxSearchSteps, start);
  return {std::move(found.cut), found.proven, found.floor};
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
    // A plan that fits but is not proven optimal says so, and how far from optimal it
    // may be, wherever it is described.
    if (!found.proven) {
      const double most = evaluate_plan(g, cost, opt, found.cut, method).max_rank_cost();
      method = fmt::format(
          "time (best found, at most {:.1f}% slower than optimal: the search stopped before "
          "proving it)",
          found.floor > 0 ? 100 * (most / found.floor - 1) : 100.0);
    }
    cut = std::move(found.cut);
  }
  StagePlan plan = evaluate_plan(g, cost, opt, std::move(cut), method);
  check_budget(plan, l.budget);
  return plan;
}

}  // namespace weft
