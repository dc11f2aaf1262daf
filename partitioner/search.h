// partitioner/search.h — min-max searches over the cut positions of a node order.
#pragma once

#include "partitioner/pricing.h"

#include <functional>
#include <limits>
#include <vector>

namespace weft::partition_detail {

constexpr double kInf = std::numeric_limits<double>::infinity();

// A price for every range [a, b) of n nodes, 0 <= a < b <= n.
class RangeTable {
 public:
  explicit RangeTable(int n = 0) : n_(n), v_(static_cast<size_t>((n + 1) * (n + 1)), 0) {}
  double& at(int a, int b) { return v_[index(a, b)]; }
  double operator()(int a, int b) const { return v_[index(a, b)]; }

 private:
  size_t index(int a, int b) const { return static_cast<size_t>(a * (n_ + 1) + b); }

  int n_;
  std::vector<double> v_;
};

// What every range costs as a stage of its own: time, and the parameter and activation
// bytes of a rank holding only that range (a tied parameter used twice in it counts once).
struct StageTables {
  StageTables(const Pricing& p, const Layout& l);
  const Pricing& p;
  const Layout& l;
  RangeTable time, params, activations;
  // Bytes of stage s's rank if it held nodes [a, b) alone.
  double memory(int s, int a, int b) const {
    return memory_bytes(p.state_factor, params(a, b), at(l.in_flight, at(l.rank, s)),
                        activations(a, b));
  }
};

// price(s, a, b): what stage s costs running nodes [a, b); +inf where it may not.
using RangePrice = std::function<double(int s, int a, int b)>;
using Grid = std::vector<std::vector<double>>;

// best[s][a]: the least largest price over cuts of nodes [a, n) into stages s..stages-1
// (+inf when none; best[stages][n] is -inf, the empty maximum).
Grid min_max_suffix(int n, int stages, const RangePrice& price);
// As above with sums for maxima (best[stages][n] = 0).
Grid min_sum_suffix(int n, int stages, const RangePrice& price);
// The cut (begin, size stages + 1) minimising the largest price; empty when every cut
// has a range priced +inf. Of equal cuts, the one with the earliest cuts wins.
std::vector<int> min_max_cut(int n, int stages, const RangePrice& price);

// Exact searches for when a rank runs several stages (chunks > 1), so its memory is
// the sum over non-adjacent ranges and no cut-position DP is exact.
enum class Goal {
  Time,       // least largest rank time (its stages' times summed) with every rank's
              // memory within the budget
  StageTime,  // least largest stage time, every rank within the budget: faster to prove,
              // it gives Time a cut to start from
  Memory,     // least largest rank memory
};
struct SearchResult {
  std::vector<int> cut;  // the best cut found; empty when none meets the budget (Goal::Time)
  bool proven = true;    // false when the step limit ended the search first
  double floor = 0;      // no cut does better (a lower bound on the goal)
};
// Explores at most `max_steps` partial cuts. `start`, when given and within the
// budget, is the cut to beat (Goal::Time): of equal cuts it wins.
SearchResult branch_and_bound(const StageTables& t, Goal goal, long max_steps,
                              const std::vector<int>& start = {});

}  // namespace weft::partition_detail
