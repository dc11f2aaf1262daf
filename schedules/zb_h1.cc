// ZB-H1, the first handcrafted schedule of "Zero Bubble Pipeline Parallelism"
// (Qi et al., 2023). It is 1F1B with each backward split in two: I (the input
// gradient, on the critical path between ranks) keeps B's place, and W (the
// weight gradient, needed by nobody until the optimizer step) is deferred.
//
// Rank r lets up to r weight gradients wait. Its 1F1B stash peaks at pp - r
// micro-batches, so holding r more keeps every rank within rank 0's pp: the
// peak memory of 1F1B. The waiting W's then run in the cool-down, where 1F1B
// sits idle waiting for backwards, which cuts the bubble to about a third.
#include <weft/error.h>
#include <weft/schedule.h>

#include <algorithm>
#include <deque>

namespace weft::sched {
namespace {

std::vector<Action> rank_actions(int pp, int micro_batches, int rank) {
  std::vector<Action> list;
  const int warmup = std::min(pp - 1 - rank, micro_batches);
  const size_t deferred = static_cast<size_t>(rank);
  std::deque<int> pending_w;
  int next_f = 0, next_i = 0;
  auto input_grad = [&] {
    list.push_back({ActionKind::I, rank, next_i});
    pending_w.push_back(next_i++);
    if (pending_w.size() > deferred) {
      list.push_back({ActionKind::W, rank, pending_w.front()});
      pending_w.pop_front();
    }
  };
  while (next_f < warmup) list.push_back({ActionKind::F, rank, next_f++});
  while (next_f < micro_batches) {
    list.push_back({ActionKind::F, rank, next_f++});
    input_grad();
  }
  while (next_i < micro_batches) input_grad();
  for (int mb : pending_w) list.push_back({ActionKind::W, rank, mb});
  return list;
}

}  // namespace

Schedule zb_h1(int pp, int micro_batches) {
  Schedule s = empty_schedule("zb-h1", pp, micro_batches);
  for (int rank = 0; rank < pp; ++rank)
    s.actions[static_cast<size_t>(rank)] = rank_actions(pp, micro_batches, rank);
  return s;
}

}  // namespace weft::sched
