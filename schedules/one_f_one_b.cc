// 1F1B (PipeDream-Flush, Megatron's default): rank r runs pp - 1 - r warm-up
// forwards, then alternates one forward with one backward, then drains the
// remaining backwards. The bubble is GPipe's, (pp - 1) x (F + B), but a rank
// never holds more than pp - r micro-batches' activations instead of m.
#include <weft/error.h>
#include <weft/schedule.h>

#include <algorithm>

namespace weft::sched {

Schedule one_f_one_b(int pp, int micro_batches) {
  Schedule s = empty_schedule("1f1b", pp, micro_batches);
  for (int rank = 0; rank < pp; ++rank) {
    auto& list = s.actions[static_cast<size_t>(rank)];
    const int warmup = std::min(pp - 1 - rank, micro_batches);
    int next_f = 0, next_b = 0;
    while (next_f < warmup) list.push_back({ActionKind::F, rank, next_f++});
    while (next_f < micro_batches) {
      list.push_back({ActionKind::F, rank, next_f++});
      list.push_back({ActionKind::B, rank, next_b++});
    }
    while (next_b < micro_batches) list.push_back({ActionKind::B, rank, next_b++});
  }
  return s;
}

}  // namespace weft::sched
