// Min-max dynamic programming over cut positions, and the branch and bound that is
// exact when a rank's memory sums several stages.
#include "partitioner/search.h"

#include <algorithm>
#include <cstdio>
#include <cmath>

namespace weft::partition_detail {

StageTables::StageTables(const Pricing& pricing, const Layout& layout)
    : p(pricing), l(layout), time(p.nodes), params(p.nodes), activations(p.nodes) {
  for (int a = 0; a < p.nodes; ++a) {
    // Grow the range one node at a time, exactly as rank_memory adds a stage.
    RankMemory m(p);
    for (int b = a + 1; b <= p.nodes; ++b) {
      m.add(b - 1);
      time.at(a, b) = p.time(a, b);
      params.at(a, b) = m.totals().params;
      activations.at(a, b) = m.totals().activations;
    }
  }
}

namespace {

// The last node stage s may end at: each later stage needs one node.
int last_end(int n, int stages, int s) { return n - (stages - s - 1); }

template <typename Combine>
Grid suffix_table(int n, int stages, const RangePrice& price, double empty, Combine combine,
                  double start) {
  Grid best(static_cast<size_t>(stages) + 1, std::vector<double>(static_cast<size_t>(n) + 1, kInf));
  best[static_cast<size_t>(stages)][static_cast<size_t>(n)] = empty;
  for (int s = stages - 1; s >= 0; --s) {
    for (int a = s; a < last_end(n, stages, s); ++a) {
      double v = start;
      for (int b = a + 1; b <= last_end(n, stages, s); ++b) {
        const double rest = best[static_cast<size_t>(s) + 1][static_cast<size_t>(b)];
        if (rest == kInf) continue;
        v = std::min(v, combine(price(s, a, b), rest));
      }
      best[static_cast<size_t>(s)][static_cast<size_t>(a)] = v;
    }
  }
  return best;
}

}  // namespace

Grid min_max_suffix(int n, int stages, const RangePrice& price) {
  return suffix_table(n, stages, price, -kInf, [](double x, double y) { return std::max(x, y); },
                      kInf);
}

Grid min_sum_suffix(int n, int stages, const RangePrice& price) {
  return suffix_table(n, stages, price, 0.0, [](double x, double y) { return x + y; }, kInf);
}

std::vector<int> min_max_cut(int n, int stages, const RangePrice& price) {
  const Grid best = min_max_suffix(n, stages, price);
  if (best[0][0] == kInf) return {};
  std::vector<int> begin{0};
  for (int s = 0, a = 0; s < stages; ++s) {
    const double target = best[static_cast<size_t>(s)][static_cast<size_t>(a)];
    for (int b = a + 1; b <= last_end(n, stages, s); ++b) {
      if (std::max(price(s, a, b), best[static_cast<size_t>(s) + 1][static_cast<size_t>(b)]) ==
          target) {
        begin.push_back(b);
        a = b;
        break;
      }
    }
  }
  return begin;
}

namespace {

// Lower bounds on the bytes ranks end with, fixed up front. The bytes a rank must add for
// nodes [a, b) are at least those of the parameters first used there (nobody holds them
// yet) and the activations. For weights w over ranks summing to 1, the w-weighted mean of
// the ranks' final bytes is at least w . (bytes so far) + left[s][a], the least weighted
// bytes that stages s.. must add over nodes [a, n): a sum over stages, so a DP finds it.
// The peak is at least every weighted mean: one w per rank alone, and a few chosen at the
// start to make the bound high.
class MemoryBounds {
 public:
  explicit MemoryBounds(const StageTables& t) : t_(t), l_(t.l), n_(t.p.nodes) {
    for (int r = 0; r < l_.pp; ++r) {
      std::vector<double> w(static_cast<size_t>(l_.pp), 0);
      w[static_cast<size_t>(r)] = 1;
      add_weights(w);
    }
    if (l_.pp > 1) tune_weights();
    last_stage_.assign(static_cast<size_t>(l_.pp), -1);
    for (int s = 0; s < l_.stages; ++s) last_stage_[static_cast<size_t>(l_.rank[static_cast<size_t>(s)])] = s;
    for (int r = 0; r < l_.pp; ++r) by_in_flight_.push_back(r);
    std::stable_sort(by_in_flight_.begin(), by_in_flight_.end(), [&](int x, int y) {
      return l_.in_flight[static_cast<size_t>(x)] < l_.in_flight[static_cast<size_t>(y)];
    });
  }

  // Cuts seen while choosing weights: real cuts, so good first guesses for the least peak.
  const std::vector<std::vector<int>>& sample_cuts() const { return samples_; }

  // The least peak any finish can reach once stage s ends at node b (+inf: none exists).
  double peak_at_least(int s, int b, const std::vector<double>& bytes) const {
    double peak = -kInf;
    for (const Weighted& w : weighted_) {
      double v = w.left[static_cast<size_t>(s) + 1][static_cast<size_t>(b)];
      for (int q = 0; q < l_.pp; ++q) v += w.w[static_cast<size_t>(q)] * bytes[static_cast<size_t>(q)];
      peak = std::max(peak, v);
    }
    return peak;
  }

  double floor() const { return peak_at_least(-1, 0, std::vector<double>(static_cast<size_t>(l_.pp), 0)); }

  // Two more necessary conditions for every rank to end within `cap`, each dropping a
  // different part of the truth, so neither ever rejects a cut that fits.
  bool could_fit(int s, int b, const std::vector<double>& bytes, double cap) const {
    return room_in_any_order(s, b, bytes, cap) && room_in_order(s, b, bytes, cap);
  }

 private:
  struct Weighted {
    std::vector<double> w;
    Grid left;
  };

  double least_added(int a, int b, int in_flight) const {
    const Pricing& p = t_.p;
    const double bytes = memory_bytes(
        p.state_factor, p.param_prefix[static_cast<size_t>(b)] - p.param_prefix[static_cast<size_t>(a)],
        in_flight, p.act_prefix[static_cast<size_t>(b)] - p.act_prefix[static_cast<size_t>(a)]);
    return bytes * (1 - 1e-9);  // prefix differences may round up; stay below
  }

  RangePrice weighted_price(const std::vector<double>& w) const {
    return [this, &w](int s, int a, int b) {
      const int r = l_.rank[static_cast<size_t>(s)];
      const double wr = w[static_cast<size_t>(r)];
      return wr == 0 ? 0.0 : wr * least_added(a, b, l_.in_flight[static_cast<size_t>(r)]);
    };
  }

  void add_weights(const std::vector<double>& w) {
    weighted_.push_back({w, {}});
    weighted_.back().left = min_sum_suffix(n_, l_.stages, weighted_price(weighted_.back().w));
  }

  // The cut reaching left[0][0], and what each rank must add along it.
  std::vector<double> argmin_bytes(const Weighted& w) {
    const RangePrice price = weighted_price(w.w);
    std::vector<double> bytes(static_cast<size_t>(l_.pp), 0);
    std::vector<int> cut{0};
    for (int s = 0, a = 0; s < l_.stages; ++s) {
      for (int b = a + 1; b <= n_; ++b) {
        const double rest = w.left[static_cast<size_t>(s) + 1][static_cast<size_t>(b)];
        if (rest < kInf && price(s, a, b) + rest == w.left[static_cast<size_t>(s)][static_cast<size_t>(a)]) {
          const int r = l_.rank[static_cast<size_t>(s)];
          bytes[static_cast<size_t>(r)] += least_added(a, b, l_.in_flight[static_cast<size_t>(r)]);
          cut.push_back(b);
          a = b;
          break;
        }
      }
    }
    if (static_cast<int>(cut.size()) == l_.stages + 1) samples_.push_back(cut);
    return bytes;
  }

  // Multiplicative-weights ascent on the bound: ranks the current best cut loads most
  // get more weight. Every weight vector gives a valid bound; this only makes it tighter.
  void tune_weights() {
    std::vector<double> w(static_cast<size_t>(l_.pp), 1.0 / l_.pp);
    Weighted best{w, min_sum_suffix(n_, l_.stages, weighted_price(w))};
    Weighted cur = best;
    for (int it = 1; it <= 24; ++it) {
      const std::vector<double> x = argmin_bytes(cur);
      const double top = *std::max_element(x.begin(), x.end());
      if (top <= 0) break;
      double sum = 0;
      for (int q = 0; q < l_.pp; ++q)
        sum += w[static_cast<size_t>(q)] *= std::exp(2.0 / std::sqrt(it) * x[static_cast<size_t>(q)] / top);
      for (double& v : w) v /= sum;
      cur = {w, min_sum_suffix(n_, l_.stages, weighted_price(w))};
      if (cur.left[0][0] > best.left[0][0]) best = cur;
    }
    weighted_.push_back(std::move(best));
  }

  // Ignoring node order: activations go first to the ranks keeping the fewest
  // micro-batches, and the parameters first used after b must fit in the room left.
  // Only ranks with stages after s take more nodes.
  bool room_in_any_order(int s, int b, const std::vector<double>& bytes, double cap) const {
    const Pricing& p = t_.p;
    double acts = (p.act_prefix[static_cast<size_t>(n_)] - p.act_prefix[static_cast<size_t>(b)]) * (1 - 1e-9);
    double room = 0;
    for (int q : by_in_flight_) {
      if (last_stage_[static_cast<size_t>(q)] <= s) continue;
      const double free = cap - bytes[static_cast<size_t>(q)];
      if (free <= 0) continue;
      const double k = l_.in_flight[static_cast<size_t>(q)];
      const double take = std::min(acts, free / k);
      acts -= take;
      room += free - k * take;
    }
    const double params = (p.param_prefix[static_cast<size_t>(n_)] - p.param_prefix[static_cast<size_t>(b)]) * (1 - 1e-9);
    return acts <= 0 && p.state_factor * params <= room;
  }

  // In order, but as if each later stage had its rank's whole room to itself and could be
  // empty: then taking the most nodes each stage can is as good as any cut.
  bool room_in_order(int s, int b, const std::vector<double>& bytes, double cap) const {
    int a = b;
    for (int st = s + 1; st < l_.stages && a < n_; ++st) {
      const int q = l_.rank[static_cast<size_t>(st)];
      const double room = cap - bytes[static_cast<size_t>(q)];
      int e = a;
      while (e < n_ && least_added(a, e + 1, l_.in_flight[static_cast<size_t>(q)]) <= room) ++e;
      a = e;
    }
    return a == n_;
  }

  const StageTables& t_;
  const Layout& l_;
  int n_;
  std::vector<Weighted> weighted_;
  std::vector<std::vector<int>> samples_;
  std::vector<int> last_stage_;    // per rank
  std::vector<int> by_in_flight_;  // ranks, fewest micro-batches in flight first
};

// Depth-first over stage ends, stage by stage, keeping each rank's exact memory (shared
// parameters once). A branch is cut when its lower bound cannot beat the best cut found:
// the least time to finish is a DP that ignores the ranks' memory coupling, and the
// memory bounds above never overestimate, so no better cut is ever cut off.
class BranchAndBound {
 public:
  BranchAndBound(const StageTables& t, Goal goal)
      : t_(t), l_(t.l), n_(t.p.nodes), goal_(goal), bounds_(t),
        ranks_(static_cast<size_t>(l_.pp), RankMemory(t.p)) {
    time_left_ = min_max_suffix(n_, l_.stages, [&](int s, int a, int b) {
      return goal_ == Goal::Time && !fits(t_.memory(s, a, b), l_.budget) ? kInf : t_.time(a, b);
    });
    floor_ = goal_ == Goal::Time ? time_left_[0][0] : bounds_.floor();
    if (goal_ == Goal::Memory)
      for (const std::vector<int>& cut : bounds_.sample_cuts()) consider(cut);
  }

  std::vector<int> run() {
    cut_ = {0};
    if (floor_ < kInf) search(0, 0);
    fprintf(stderr, "goal %d nodes %ld best %g floor %g\n", (int)goal_, visits_, best_, floor_);
    for (int i = 0; i <= l_.stages; ++i) fprintf(stderr, " depth %d: %ld\n", i, depth_[i]);
    return best_cut_;
  }

 private:
  struct Candidate {
    double key;  // lower bound of any cut through this choice
    int end;
  };

  // A known cut as the best so far (Goal::Memory), to prune with from the start.
  void consider(const std::vector<int>& cut) {
    const std::vector<double> bytes = rank_memory(t_.p, l_, cut);
    const double peak = *std::max_element(bytes.begin(), bytes.end());
    if (peak < best_) {
      best_ = peak;
      best_cut_ = cut;
    }
  }

  double rank_bytes(int r) const {
    return ranks_[static_cast<size_t>(r)].bytes(l_.in_flight[static_cast<size_t>(r)]);
  }

  // The lower bound of finishing after stage s ends at b, given each rank's bytes; +inf
  // when no finish can stay within the budget (Time) or get below the best peak (Memory).
  double bound(int s, int a, int b, const std::vector<double>& bytes) const {
    // Goal::Memory looks for a peak below the best: the largest double under it.
    const double cap = goal_ == Goal::Memory ? std::nextafter(best_, -kInf)
                                             : l_.budget > 0 ? l_.budget : kInf;
    const double peak = bounds_.peak_at_least(s, b, bytes);
    if (peak == kInf || (goal_ == Goal::Time && !fits(peak, cap))) return kInf;
    if (cap < kInf && !bounds_.could_fit(s, b, bytes, cap)) return kInf;
    if (goal_ == Goal::Memory) return peak;
    return std::max({cmax_, t_.time(a, b), time_left_[static_cast<size_t>(s) + 1][static_cast<size_t>(b)]});
  }

  // The ends stage s may take, best bound first. Grows rank r's memory node by node and
  // puts it back, so each candidate's bytes are exact.
  std::vector<Candidate> candidates(int s, int a) {
    const int r = l_.rank[static_cast<size_t>(s)];
    std::vector<double> bytes;
    for (int q = 0; q < l_.pp; ++q) bytes.push_back(rank_bytes(q));
    RankMemory& m = ranks_[static_cast<size_t>(r)];
    const RankMemory::Totals before = m.totals();
    std::vector<Candidate> out;
    int b = a + 1;
    for (; b <= last_end(n_, l_.stages, s); ++b) {
      m.add(b - 1);
      bytes[static_cast<size_t>(r)] = rank_bytes(r);
      // Memory only grows with the range: past the budget or the best peak, stop.
      if (goal_ == Goal::Time ? !fits(bytes[static_cast<size_t>(r)], l_.budget)
                              : bytes[static_cast<size_t>(r)] >= best_) {
        ++b;
        break;
      }
      const double key = bound(s, a, b, bytes);
      if (key < best_) out.push_back({key, b});
    }
    m.remove(a, b - 1, before);
    std::stable_sort(out.begin(), out.end(),
                     [](const Candidate& x, const Candidate& y) { return x.key < y.key; });
    return out;
  }

  long visits_ = 0; long depth_[80] = {};
  void search(int s, int a) {
    ++visits_; ++depth_[s];
    if (s == l_.stages) return record();
    const int r = l_.rank[static_cast<size_t>(s)];
    for (const Candidate& c : candidates(s, a)) {
      if (c.key >= best_ || best_ <= floor_) return;  // sorted: nothing later beats the best
      RankMemory& m = ranks_[static_cast<size_t>(r)];
      const RankMemory::Totals before = m.totals();
      for (int i = a; i < c.end; ++i) m.add(i);
      const double cmax = cmax_;
      cmax_ = std::max(cmax_, t_.time(a, c.end));
      cut_.push_back(c.end);
      search(s + 1, c.end);
      cut_.pop_back();
      cmax_ = cmax;
      m.remove(a, c.end, before);
    }
  }

  void record() {
    double value = cmax_;
    if (goal_ == Goal::Memory) {
      value = -kInf;
      for (int r = 0; r < l_.pp; ++r) value = std::max(value, rank_bytes(r));
    }
    if (value < best_) {
      best_ = value;
      best_cut_ = cut_;
    }
  }

  const StageTables& t_;
  const Layout& l_;
  int n_;
  Goal goal_;
  MemoryBounds bounds_;
  std::vector<RankMemory> ranks_;
  Grid time_left_;       // least largest stage time from (stage, node) on
  double floor_ = kInf;  // no cut does better: stop when the best reaches it
  double cmax_ = -kInf;  // largest stage time so far
  double best_ = kInf;
  std::vector<int> cut_, best_cut_;
};

}  // namespace

std::vector<int> branch_and_bound(const StageTables& t, Goal goal) {
  return BranchAndBound(t, goal).run();
}

}  // namespace weft::partition_detail
