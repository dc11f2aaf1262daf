// Min-max dynamic programming over cut positions, and the branch and bound that is
// exact when a rank's memory sums several stages.
#include "partitioner/search.h"

#include <algorithm>
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
  at(at(best, stages), n) = empty;
  for (int s = stages - 1; s >= 0; --s) {
    for (int a = s; a < last_end(n, stages, s); ++a) {
      double v = start;
      for (int b = a + 1; b <= last_end(n, stages, s); ++b) {
        const double rest = at(at(best, s + 1), b);
        if (rest == kInf) continue;
        v = std::min(v, combine(price(s, a, b), rest));
      }
      at(at(best, s), a) = v;
    }
  }
  return best;
}

}  // namespace

Grid min_max_suffix(int n, int stages, const RangePrice& price) {
  return suffix_table(
      n, stages, price, -kInf, [](double x, double y) { return std::max(x, y); }, kInf);
}

Grid min_sum_suffix(int n, int stages, const RangePrice& price) {
  return suffix_table(
      n, stages, price, 0.0, [](double x, double y) { return x + y; }, kInf);
}

std::vector<int> min_max_cut(int n, int stages, const RangePrice& price) {
  const Grid best = min_max_suffix(n, stages, price);
  if (best[0][0] == kInf) return {};
  std::vector<int> begin{0};
  for (int s = 0, a = 0; s < stages; ++s) {
    const double target = at(at(best, s), a);
    for (int b = a + 1; b <= last_end(n, stages, s); ++b) {
      if (std::max(price(s, a, b), at(at(best, s + 1), b)) == target) {
        begin.push_back(b);
        a = b;
        break;
      }
    }
  }
  return begin;
}

namespace {

// Lower bounds on the bytes each rank ends with, for pruning. The bytes a rank must add for
// nodes [a, e) are at least those of the parameters first used there (nobody holds them
// yet) and of the activations; every bound below is built from that, so none ever
// rejects a cut that fits.
class MemoryBounds {
 public:
  explicit MemoryBounds(const StageTables& t) : p_(t.p), l_(t.l), n_(t.p.nodes) {
    for (int r = 0; r < l_.pp; ++r) rank_left_.push_back(least_left(r));
    if (l_.pp > 1) tune_weights();
    left_after_.assign(static_cast<size_t>(l_.stages) + 1,
                       std::vector<int>(static_cast<size_t>(l_.pp), 0));
    for (int s = l_.stages - 1; s >= 0; --s) {
      at(left_after_, s) = at(left_after_, s + 1);
      ++at(at(left_after_, s), at(l_.rank, s));
    }
    for (int r = 0; r < l_.pp; ++r) by_in_flight_.push_back(r);
    std::stable_sort(by_in_flight_.begin(), by_in_flight_.end(),
                     [&](int x, int y) { return in_flight(x) < in_flight(y); });
    find_tied();
  }

  // The least peak any finish reaches once stage s ends at node b, the ranks holding
  // `bytes`: each rank alone must still add its own stages' least bytes (+inf: no finish).
  // So must the ranks together, and the peak is at least their weighted mean.
  double peak_at_least(int s, int b, const std::vector<double>& bytes) const {
    double peak = -kInf;
    for (int q = 0; q < l_.pp; ++q) peak = std::max(peak, at(bytes, q) + left(q, s + 1, b));
    if (!weights_.empty()) {
      double mean = at(at(weighted_left_, s + 1), b);
      for (int q = 0; q < l_.pp; ++q) mean += at(weights_, q) * at(bytes, q);
      peak = std::max(peak, mean * (1 - 1e-9));  // the weights sum to 1 only up to rounding
    }
    return peak;
  }

  // Whether every rank could still end within `cap`, by two tests that each drop a
  // different part of the truth. `memo` caches stage ends for ranks other than `r`,
  // whose rooms stay fixed while stage s's end b varies; it starts filled with -1.
  bool could_fit(int s, int b, int r, const std::vector<RankMemory>& ranks,
                 const std::vector<double>& bytes, double cap, std::vector<int>& memo) const {
    return room_in_any_order(s, b, bytes, cap) && room_in_order(s, b, r, ranks, bytes, cap, memo);
  }

 private:
  struct Tied {
    int id, first;              // parameter id and its first user
    std::vector<int> next_use;  // per node a: its first user at or after a (n if none)
  };

  int in_flight(int r) const { return at(l_.in_flight, r); }
  double left(int r, int s, int a) const { return at(at(at(rank_left_, r), s), a); }

  double least_added(int a, int e, int k) const {
    const double params = at(p_.param_prefix, e) - at(p_.param_prefix, a);
    const double acts = at(p_.act_prefix, e) - at(p_.act_prefix, a);
    return memory_bytes(p_.state_factor, params, k, acts) * (1 - 1e-9);  // prefix sums may round up
  }

  // left[s][a]: the least bytes rank r adds over nodes [a, n) in its stages from s on.
  Grid least_left(int r) const {
    return min_sum_suffix(n_, l_.stages, [&, r](int s, int a, int e) {
      return at(l_.rank, s) == r ? least_added(a, e, in_flight(r)) : 0.0;
    });
  }

  // For weights w over ranks summing to 1: [s][a] = the least w-weighted sum of the bytes
  // the stages from s on add over nodes [a, n). A sum over stages, so a DP finds it.
  Grid weighted_left(const std::vector<double>& w) const {
    return min_sum_suffix(n_, l_.stages, [&](int s, int a, int e) {
      const int r = at(l_.rank, s);
      return at(w, r) * least_added(a, e, in_flight(r));
    });
  }

  // What each rank adds along the cut that reaches weighted_left(w)[0][0].
  std::vector<double> weighted_argmin(const std::vector<double>& w, const Grid& left) const {
    std::vector<double> bytes(static_cast<size_t>(l_.pp), 0);
    for (int s = 0, a = 0; s < l_.stages; ++s) {
      const int r = at(l_.rank, s);
      for (int e = a + 1; e <= n_; ++e) {
        const double add = least_added(a, e, in_flight(r));
        const double rest = at(at(left, s + 1), e);
        if (at(w, r) * add + rest == at(at(left, s), a)) {
          at(bytes, r) += add;
          a = e;
          break;
        }
      }
    }
    return bytes;
  }

  // Any weights give a valid bound; multiplicative-weights ascent (more weight to the
  // ranks the least-sum cut loads most) makes it high. Keeps the best weights seen.
  void tune_weights() {
    std::vector<double> w(static_cast<size_t>(l_.pp), 1.0 / l_.pp);
    for (int it = 1; it <= 20; ++it) {
      Grid left = weighted_left(w);
      if (weights_.empty() || left[0][0] > weighted_left_[0][0]) {
        weights_ = w;
        weighted_left_ = left;
      }
      const std::vector<double> x = weighted_argmin(w, left);
      const double top = *std::max_element(x.begin(), x.end());
      if (!(top > 0)) break;
      double sum = 0;
      for (int q = 0; q < l_.pp; ++q) sum += at(w, q) *= std::exp(at(x, q) / top / std::sqrt(it));
      for (double& v : w) v /= sum;
    }
  }

  void find_tied() {
    for (int id = 0; id < static_cast<int>(p_.param_bytes.size()); ++id) {
      std::vector<int> next(static_cast<size_t>(n_) + 1, n_);
      int users = 0;
      for (int i = n_ - 1; i >= 0; --i) {
        const std::vector<int>& ids = at(p_.node_params, i);
        const bool uses = std::find(ids.begin(), ids.end(), id) != ids.end();
        users += uses;
        at(next, i) = uses ? i : at(next, i + 1);
      }
      if (users > 1) tied_.push_back({id, at(p_.first_user, id), std::move(next)});
    }
  }

  // Ignoring node order: activations go first to the ranks keeping the fewest
  // micro-batches, and the parameters first used after b must fit in the room left.
  // Only ranks with stages after s take more nodes.
  bool room_in_any_order(int s, int b, const std::vector<double>& bytes, double cap) const {
    double acts = (at(p_.act_prefix, n_) - at(p_.act_prefix, b)) * (1 - 1e-9);
    double room = 0;
    for (int q : by_in_flight_) {
      const double free = cap - at(bytes, q);
      if (at(at(left_after_, s + 1), q) == 0 || free <= 0) continue;
      const double take = std::min(acts, free / in_flight(q));
      acts -= take;
      room += free - in_flight(q) * take;
    }
    const double params = at(p_.param_prefix, n_) - at(p_.param_prefix, b);
    return acts <= 0 && p_.state_factor * params * (1 - 1e-9) <= room;
  }

  // Bytes rank q (holding what `rank` holds) must add for nodes [a, e): least_added, plus,
  // when `copies`, each tied parameter used there, older than a, that the rank lacks.
  // Grows with e.
  double need(const RankMemory& rank, int q, int a, int e, bool copies) const {
    double tied = 0;
    if (copies)
      for (const Tied& t : tied_)
        if (t.first < a && at(t.next_use, a) < e && !rank.holds(t.id))
          tied += at(p_.param_bytes, t.id);
    return least_added(a, e, in_flight(q)) + p_.state_factor * tied * (1 - 1e-9);
  }

  // The furthest end of stage st from node a within `room`: need grows with the end.
  int furthest(int st, int a, const RankMemory& rank, double room) const {
    const int q = at(l_.rank, st);
    // With one stage left, the rank must copy in the tied parameters it lacks; with more,
    // an earlier one might bring them.
    const bool copies = at(at(left_after_, st), q) == 1;
    int lo = a, hi = n_;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (need(rank, q, a, mid, copies) <= room)
        lo = mid;
      else
        hi = mid - 1;
    }
    return lo;
  }

  // In order, but as if each later stage had its rank's whole room to itself and could be
  // empty: then taking the most nodes each stage can is as good as any cut.
  bool room_in_order(int s, int b, int r, const std::vector<RankMemory>& ranks,
                     const std::vector<double>& bytes, double cap, std::vector<int>& memo) const {
    int a = b;
    for (int st = s + 1; st < l_.stages && a < n_; ++st) {
      const int q = at(l_.rank, st);
      const double room = cap - at(bytes, q);
      if (q == r) {
        a = furthest(st, a, at(ranks, q), room);
        continue;
      }
      int& end = at(memo, st * (n_ + 1) + a);
      if (end < 0) end = furthest(st, a, at(ranks, q), room);
      a = end;
    }
    return a == n_;
  }

  const Pricing& p_;
  const Layout& l_;
  int n_;
  std::vector<Grid> rank_left_;               // per rank: least_left
  std::vector<double> weights_;               // per rank, summing to 1
  Grid weighted_left_;                        // weighted_left(weights_)
  std::vector<std::vector<int>> left_after_;  // [s][r]: stages of rank r from s on
  std::vector<int> by_in_flight_;             // ranks, fewest micro-batches in flight first
  std::vector<Tied> tied_;                    // parameters used by more than one node
};

// Depth-first over stage ends, stage by stage, keeping each rank's exact memory (shared
// parameters once). A branch is cut when its lower bound cannot beat the best cut found:
// the least time to finish is a DP that ignores how the ranks' memory couples, and the
// memory bounds never overestimate, so no better cut is ever cut off.
class BranchAndBound {
 public:
  BranchAndBound(const StageTables& t, Goal goal, long max_steps)
      : t_(t),
        l_(t.l),
        n_(t.p.nodes),
        goal_(goal),
        steps_left_(max_steps),
        bounds_(t),
        ranks_(static_cast<size_t>(l_.pp), RankMemory(t.p)),
        load_(static_cast<size_t>(l_.pp), 0.0) {
    auto allowed = [&](int s, int a, int b) {
      return goal_ == Goal::Memory || fits(t_.memory(s, a, b), l_.budget);
    };
    time_left_ = min_max_suffix(n_, l_.stages, [&](int s, int a, int b) {
      return allowed(s, a, b) ? t_.time(a, b) : kInf;
    });
    const std::vector<double> none(static_cast<size_t>(l_.pp), 0);
    floor_ = goal_ == Goal::Memory ? bounds_.peak_at_least(-1, 0, none) : time_left_[0][0];
    if (goal_ != Goal::Time) return;
    // The least time each rank's own stages still add, the others taking any nodes.
    for (int q = 0; q < l_.pp; ++q) {
      more_.push_back(min_sum_suffix(n_, l_.stages, [&, q](int s, int a, int b) {
        if (at(l_.rank, s) != q) return 0.0;
        return allowed(s, a, b) ? t_.time(a, b) : kInf;
      }));
      floor_ = std::max(floor_, kBelow * more_.back()[0][0]);
    }
    floor_ = std::max(floor_, kBelow * t_.p.work(0, n_) / l_.pp);
  }

  SearchResult run(const std::vector<int>& start) {
    if (goal_ == Goal::Time && !start.empty()) beat(start);
    cut_ = {0};
    if (floor_ < kInf) search(0, 0);
    return {best_cut_, steps_left_ >= 0, floor_};
  }

 private:
  struct Candidate {
    double key;  // lower bound of any cut through this choice
    int end;
  };

  double rank_bytes(int r) const { return at(ranks_, r).bytes(at(l_.in_flight, r)); }

  // The most any rank may end with: the budget (Goal::Time), or just under the best peak.
  double cap() const {
    if (goal_ == Goal::Memory) return std::nextafter(best_, -kInf);
    return l_.budget > 0 ? l_.budget : kInf;
  }

  // The lower bound of finishing after stage s (on rank r) ends at b, given each rank's
  // bytes; +inf when no finish can keep every rank within cap().
  double bound(int s, int a, int b, const std::vector<double>& bytes,
               std::vector<int>& memo) const {
    const double peak = bounds_.peak_at_least(s, b, bytes);
    if (!(peak <= cap())) return kInf;
    const int r = at(l_.rank, s);
    const double key = goal_ == Goal::Memory ? peak : time_bound(s, r, a, b);
    if (key >= best_) return kInf;  // checked before the dearer memory tests
    return bounds_.could_fit(s, b, r, ranks_, bytes, cap(), memo) ? key : kInf;
  }

  // The least largest rank time of any finish once stage s (on rank r) ends at b: no
  // stage is shorter than the longest to come, each rank still adds its own stages' least,
  // and the busiest rank carries at least the mean of all the work. The last two sum in
  // another order than the ranks will, so they are taken a hair low.
  double time_bound(int s, int r, int a, int b) const {
    const double stage = t_.time(a, b);
    double key = std::max({cmax_, stage, at(at(time_left_, s + 1), b)}), total = 0;
    if (goal_ == Goal::StageTime) return key;
    for (int q = 0; q < l_.pp; ++q) {
      const double load = at(load_, q) + (q == r ? stage : 0.0);
      total += load;
      key = std::max(key, kBelow * (load + at(at(at(more_, q), s + 1), b)));
    }
    return std::max(key, kBelow * (total + t_.p.work(b, n_)) / l_.pp);
  }

  // The ends stage s may take, best bound first. Grows rank r's memory node by node and
  // puts it back, so each candidate's bytes are exact.
  std::vector<Candidate> candidates(int s, int a) {
    const int r = at(l_.rank, s);
    std::vector<double> bytes;
    for (int q = 0; q < l_.pp; ++q) bytes.push_back(rank_bytes(q));
    std::vector<int> memo(static_cast<size_t>(l_.stages) * static_cast<size_t>(n_ + 1), -1);
    RankMemory& m = at(ranks_, r);
    const RankMemory::Totals before = m.totals();
    std::vector<Candidate> out;
    int b = a + 1;
    for (; b <= last_end(n_, l_.stages, s); ++b) {
      m.add(b - 1);
      at(bytes, r) = rank_bytes(r);
      // Memory only grows with the range: past the cap, stop.
      if (!(at(bytes, r) <= cap())) {
        ++b;
        break;
      }
      const double key = bound(s, a, b, bytes, memo);
      if (key < best_) out.push_back({key, b});
    }
    m.remove(a, b - 1, before);
    std::stable_sort(out.begin(), out.end(),
                     [](const Candidate& x, const Candidate& y) { return x.key < y.key; });
    return out;
  }

  void search(int s, int a) {
    if (s == l_.stages) return record();
    if (--steps_left_ < 0) return;
    const int r = at(l_.rank, s);
    for (const Candidate& c : candidates(s, a)) {
      // Sorted: nothing later beats the best; and nothing beats the floor.
      if (c.key >= best_ || best_ <= floor_ || steps_left_ < 0) return;
      RankMemory& m = at(ranks_, r);
      const RankMemory::Totals before = m.totals();
      for (int i = a; i < c.end; ++i) m.add(i);
      const double cmax = cmax_, load = at(load_, r);
      cmax_ = std::max(cmax_, t_.time(a, c.end));
      at(load_, r) += t_.time(a, c.end);
      cut_.push_back(c.end);
      search(s + 1, c.end);
      cut_.pop_back();
      cmax_ = cmax;
      at(load_, r) = load;
      m.remove(a, c.end, before);
    }
  }

  void record() {
    double value = goal_ == Goal::StageTime ? cmax_ : -kInf;
    if (goal_ != Goal::StageTime)
      for (int r = 0; r < l_.pp; ++r)
        value = std::max(value, goal_ == Goal::Memory ? rank_bytes(r) : at(load_, r));
    if (value < best_) {
      best_ = value;
      best_cut_ = cut_;
    }
  }

  // Takes `cut` as the best so far when every rank fits: its ranks' times summed in stage
  // order, as record() and evaluate_plan sum them.
  void beat(const std::vector<int>& cut) {
    for (double b : rank_memory(t_.p, l_, cut))
      if (!fits(b, l_.budget)) return;
    std::vector<double> load(static_cast<size_t>(l_.pp), 0.0);
    for (int s = 0; s < l_.stages; ++s) at(load, at(l_.rank, s)) += t_.time(at(cut, s), at(cut, s + 1));
    best_ = *std::max_element(load.begin(), load.end());
    best_cut_ = cut;
  }

  static constexpr double kBelow = 1 - 1e-9;

  const StageTables& t_;
  const Layout& l_;
  int n_;
  Goal goal_;
  long steps_left_;
  MemoryBounds bounds_;
  std::vector<RankMemory> ranks_;
  std::vector<double> load_;  // per rank: the time of its stages so far
  std::vector<Grid> more_;    // per rank: the least time its stages add from (stage, node) on
  Grid time_left_;       // least largest stage time from (stage, node) on
  double floor_ = kInf;  // no cut does better: stop when the best reaches it
  double cmax_ = -kInf;  // largest stage time so far
  double best_ = kInf;
  std::vector<int> cut_, best_cut_;
};

}  // namespace

SearchResult branch_and_bound(const StageTables& t, Goal goal, long max_steps,
                              const std::vector<int>& start) {
  return BranchAndBound(t, goal, max_steps).run(start);
}

}  // namespace weft::partition_detail
