// GPipe: every rank runs all forwards, then all backwards. The simplest
// schedule and the most memory-hungry: each rank holds all m micro-batches'
// activations at the turn. Stage s lives on rank s.
#include <weft/error.h>
#include <weft/schedule.h>

namespace weft::sched {

Schedule gpipe(int pp, int micro_batches) {
  Schedule s = empty_schedule("gpipe", pp, micro_batches);
  for (int rank = 0; rank < pp; ++rank) {
    auto& list = s.actions[static_cast<size_t>(rank)];
    for (int mb = 0; mb < micro_batches; ++mb) list.push_back({ActionKind::F, rank, mb});
    // Backwards in forward order, so the first micro-batch's gradient leaves
    // the last stage as soon as the forwards drain.
    for (int mb = 0; mb < micro_batches; ++mb) list.push_back({ActionKind::B, rank, mb});
  }
  return s;
}

}  // namespace weft::sched
