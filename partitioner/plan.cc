// StagePlan: the checks every plan passes, its costs and memory, and its table.
#include "partitioner/pricing.h"

#include <weft/error.h>
#include <weft/units.h>

#include <algorithm>
#include <cmath>

namespace weft {

using partition_detail::at;

namespace partition_detail {

namespace {

std::vector<int> stage_ranks(const PartitionOptions& opt, int stages) {
  if (opt.stage_rank.empty()) {
    std::vector<int> rank;
    for (int s = 0; s < stages; ++s) rank.push_back(s % opt.pp);
    return rank;
  }
  check(static_cast<int>(opt.stage_rank.size()) == stages,
        "stage_rank has {} entries; it needs one per stage (pp x chunks = {})",
        opt.stage_rank.size(), stages);
  std::vector<int> count(static_cast<size_t>(opt.pp), 0);
  for (int s = 0; s < stages; ++s) {
    const int r = at(opt.stage_rank, s);
    check(r >= 0 && r < opt.pp, "stage_rank[{}] = {} is not a rank in 0..{}", s, r, opt.pp - 1);
    ++at(count, r);
  }
  // Every schedule weft runs gives each rank the same number of virtual stages.
  for (int r = 0; r < opt.pp; ++r)
    check(at(count, r) == opt.chunks,
          "stage_rank gives rank {} {} stages; every rank must run chunks = {}", r, at(count, r),
          opt.chunks);
  return opt.stage_rank;
}

std::vector<int> in_flight(const PartitionOptions& opt) {
  if (opt.in_flight.empty()) return std::vector<int>(static_cast<size_t>(opt.pp), 1);
  check(static_cast<int>(opt.in_flight.size()) == opt.pp,
        "in_flight has {} entries; it needs one per rank (pp = {})", opt.in_flight.size(), opt.pp);
  for (int r = 0; r < opt.pp; ++r)
    check(at(opt.in_flight, r) >= 1,
          "in_flight[{}] = {} must be at least 1: a rank holds the micro-batch it runs", r,
          at(opt.in_flight, r));
  return opt.in_flight;
}

// A plan covers every node exactly once, in order, with no stage empty.
void check_cut(const std::vector<int>& begin, int stages, int n) {
  check(static_cast<int>(begin.size()) == stages + 1,
        "a plan of {} stages needs {} stage starts (the last = {} nodes), got {}", stages,
        stages + 1, n, begin.size());
  const int first = begin.front(), last = begin.back();
  check(first <= 0, "nodes 0..{} are in no stage: stage 0 starts at node {}, not 0", first - 1,
        first);
  check(first == 0, "stage 0 starts at node {}, before the first node 0", first);
  for (int s = 1; s < stages; ++s)
    check(at(begin, s) <= n, "stage {} starts at node {}, past the graph's {} nodes", s,
          at(begin, s), n);
  for (int s = 0; s < stages; ++s) {
    const int a = at(begin, s), b = at(begin, s + 1);
    check(a != b, "stage {} is empty: it starts and ends at node {}", s, a);
    check(a < b,
          "stage {} ends at node {} before it starts at node {}: nodes {}..{} would run in "
          "two stages (stage starts must increase)",
          s, b, a, b, a - 1);
  }
  check(last >= n, "nodes {}..{} are in no stage: the last stage ({}) ends at node {}, not {}",
        last, n - 1, stages - 1, last, n);
  check(last == n, "the last stage ({}) ends at node {}, past the graph's {} nodes", stages - 1,
        last, n);
}

}  // namespace

Layout make_layout(const Graph& g, const PartitionOptions& opt) {
  check(opt.pp >= 1, "pp ({}) must be at least 1", opt.pp);
  check(opt.chunks >= 1, "chunks ({}) must be at least 1", opt.chunks);
  Layout l;
  l.pp = opt.pp;
  l.chunks = opt.chunks;
  l.stages = opt.pp * opt.chunks;
  const int n = static_cast<int>(g.nodes().size());
  check(n >= l.stages, "the graph has {} nodes, fewer than pp x chunks = {} stages", n, l.stages);
  l.rank = stage_ranks(opt, l.stages);
  l.in_flight = in_flight(opt);
  check(std::isfinite(opt.memory_budget) && opt.memory_budget >= 0,
        "memory_budget ({}) must be finite and >= 0 bytes (0 = unlimited)", opt.memory_budget);
  l.budget = opt.memory_budget;
  return l;
}

}  // namespace partition_detail

StagePlan evaluate_plan(const Graph& g, const CostModel& cost, const PartitionOptions& opt,
                        std::vector<int> begin, std::string method) {
  using namespace partition_detail;
  const Layout l = make_layout(g, opt);
  check_cut(begin, l.stages, static_cast<int>(g.nodes().size()));
  const Pricing p(g, cost);
  StagePlan plan;
  plan.pp = l.pp;
  plan.chunks = l.chunks;
  plan.method = std::move(method);
  for (int s = 0; s < l.stages; ++s)
    plan.stage_cost.push_back(p.time(at(begin, s), at(begin, s + 1)));
  plan.rank_cost.assign(static_cast<size_t>(l.pp), 0.0);
  for (int s = 0; s < l.stages; ++s) at(plan.rank_cost, at(l.rank, s)) += at(plan.stage_cost, s);
  plan.rank_memory = rank_memory(p, l, begin);
  plan.stage_rank = l.rank;
  plan.begin = std::move(begin);
  return plan;
}

int StagePlan::stage_of(int node) const {
  check(!begin.empty() && node >= 0 && node < begin.back(),
        "node {} is not in the plan (nodes 0..{})", node, begin.empty() ? -1 : begin.back() - 1);
  return static_cast<int>(std::upper_bound(begin.begin(), begin.end(), node) - begin.begin()) - 1;
}

double StagePlan::max_stage_cost() const {
  return stage_cost.empty() ? 0 : *std::max_element(stage_cost.begin(), stage_cost.end());
}

double StagePlan::max_rank_cost() const {
  return rank_cost.empty() ? 0 : *std::max_element(rank_cost.begin(), rank_cost.end());
}


std::string StagePlan::describe(const Graph& g) const {
  double peak = 0;
  for (double m : rank_memory) peak = std::max(peak, m);
  std::string s = fmt::format(
      "{} plan: {} stages (pp {} x {} chunks), max stage cost {:.4g}{}, peak rank memory {}\n",
      method, stages(), pp, chunks, max_stage_cost(),
      chunks > 1 ? fmt::format(", max rank cost {:.4g}", max_rank_cost()) : "",
      weft::format_bytes(peak));
  s += fmt::format("{:>5} {:>4}  {:<11} {:<40} {:>11} {:>12}\n", "stage", "rank", "nodes",
                   "first .. last", "cost", "rank memory");
  for (int st = 0; st + 1 < static_cast<int>(begin.size()); ++st) {
    const int a = at(begin, st), b = at(begin, st + 1);
    const int r = static_cast<size_t>(st) < stage_rank.size() ? at(stage_rank, st) : st % pp;
    const std::string names =
        fmt::format("{} .. {}", at(g.nodes(), a).name, at(g.nodes(), b - 1).name);
    const double cost = static_cast<size_t>(st) < stage_cost.size() ? at(stage_cost, st) : 0;
    const double mem = static_cast<size_t>(r) < rank_memory.size() ? at(rank_memory, r) : 0;
    s += fmt::format("{:>5} {:>4}  {:<11} {:<40} {:>11.4g} {:>12}\n", st, r,
                     fmt::format("{}-{}", a, b - 1), names, cost, weft::format_bytes(mem));
  }
  return s;
}

}  // namespace weft
