// ZB-V, the V-shaped schedule of "Zero Bubble Pipeline Parallelism" (Qi et
// al., 2023). Each rank holds two chunks: rank r holds stage r, on the way
// down, and stage 2pp-1-r, on the way back up, so rank 0 holds both the
// first stage and the last. A micro-batch's forward runs down the ranks and
// back; its input gradients run the V the other way.
//
// The order is built by playing the pipeline forward in unit time (F = I = W
// = one slot, no communication cost) and letting each idle rank take the
// most urgent action that is ready:
//   1. an input gradient (I): every rank upstream is waiting for it;
//   2. a forward, while the rank holds fewer than 2pp chunk activations, the
//      memory of 1F1B's rank 0 (a chunk is half a 1F1B stage), keeping the
//      last slot for the up-going chunk so the V always drains;
//   3. a deferred weight gradient (W), which fills what would be a bubble.
// The result only fixes each rank's order; any real timing runs it unchanged.
#include <weft/error.h>
#include <weft/schedule.h>

#include <deque>
#include <limits>
#include <optional>

namespace weft::sched {
namespace {

constexpr int kNever = std::numeric_limits<int>::max();

// Slot at which each (stage, micro-batch) forward and input gradient ended.
struct Finished {
  int micro_batches;
  std::vector<int> f, i;
  Finished(int stages, int m)
      : micro_batches(m),
        f(static_cast<size_t>(stages * m), kNever),
        i(static_cast<size_t>(stages * m), kNever) {}
  int& at(std::vector<int>& v, int stage, int mb) {
    return v[static_cast<size_t>(stage * micro_batches + mb)];
  }
};

// One rank's progress through its two chunks.
struct RankState {
  int rank = 0;
  int stage[2] = {0, 0};  // down-going chunk, up-going chunk
  int next_f[2] = {0, 0};
  int next_i[2] = {0, 0};
  std::deque<Action> pending_w;
  int held = 0;  // forwards whose weight gradient has not run
  std::vector<Action> order;
};

class Builder {
 public:
  Builder(int pp, int m) : pp_(pp), m_(m), stages_(2 * pp), done_(2 * pp, m) {
    for (int r = 0; r < pp; ++r) {
      RankState st;
      st.rank = r;
      st.stage[0] = r;
      st.stage[1] = stages_ - 1 - r;
      ranks_.push_back(st);
    }
  }

  std::vector<std::vector<Action>> build() {
    const int total = 3 * stages_ * m_;
    int finished = 0;
    for (int slot = 0; finished < total; ++slot) {
      int taken = 0;
      for (RankState& st : ranks_) {
        std::optional<Action> a = pick(st, slot);
        if (!a) continue;
        run(st, *a, slot);
        ++taken;
      }
      check(taken > 0, "zb-v: construction stalled at slot {} (pp = {}, m = {})", slot, pp_, m_);
      finished += taken;
    }
    std::vector<std::vector<Action>> out;
    for (RankState& st : ranks_) out.push_back(std::move(st.order));
    return out;
  }

 private:
  bool ready(std::vector<int>& v, int stage, int mb, int slot) {
    return done_.at(v, stage, mb) <= slot;
  }

  std::optional<Action> input_grad(RankState& st, int slot) {
    std::optional<Action> best;
    for (int c = 1; c >= 0; --c) {
      const int s = st.stage[c], mb = st.next_i[c];
      if (mb >= m_ || mb >= st.next_f[c] || !ready(done_.f, s, mb, slot)) continue;
      if (s + 1 < stages_ && !ready(done_.i, s + 1, mb, slot)) continue;
      if (!best || mb < best->micro_batch) best = Action{ActionKind::I, s, mb};
    }
    return best;
  }

  std::optional<Action> forward(RankState& st, int slot) {
    const int cap = 2 * pp_;
    for (int c = 1; c >= 0; --c) {
      const int s = st.stage[c], mb = st.next_f[c];
      if (mb >= m_ || st.held >= cap - (c == 0 ? 1 : 0)) continue;
      if (s > 0 && !ready(done_.f, s - 1, mb, slot)) continue;
      return Action{ActionKind::F, s, mb};
    }
    return std::nullopt;
  }

  std::optional<Action> pick(RankState& st, int slot) {
    if (auto a = input_grad(st, slot)) return a;
    if (auto a = forward(st, slot)) return a;
    if (!st.pending_w.empty()) return st.pending_w.front();
    return std::nullopt;
  }

  void run(RankState& st, const Action& a, int slot) {
    const int c = a.stage == st.stage[0] ? 0 : 1;
    st.order.push_back(a);
    switch (a.kind) {
      case ActionKind::F:
        ++st.next_f[c];
        ++st.held;
        done_.at(done_.f, a.stage, a.micro_batch) = slot + 1;
        break;
      case ActionKind::I:
        ++st.next_i[c];
        st.pending_w.push_back({ActionKind::W, a.stage, a.micro_batch});
        done_.at(done_.i, a.stage, a.micro_batch) = slot + 1;
        break;
      default:
        st.pending_w.pop_front();
        --st.held;
        break;
    }
  }

  int pp_, m_, stages_;
  Finished done_;
  std::vector<RankState> ranks_;
};

}  // namespace

Schedule zb_v(int pp, int micro_batches) {
  check(pp >= 1, "zb-v: pipeline ranks (pp = {}) must be at least 1", pp);
  check(micro_batches >= pp, "zb-v: micro-batches ({}) must be at least pp ({})", micro_batches,
        pp);
  Schedule s = empty_schedule("zb-v", pp, micro_batches, 2);
  for (int stage = pp; stage < 2 * pp; ++stage)  // the V: back down the ranks
    s.stage_rank[static_cast<size_t>(stage)] = 2 * pp - 1 - stage;
  s.actions = Builder(pp, micro_batches).build();
  return s;
}

}  // namespace weft::sched
