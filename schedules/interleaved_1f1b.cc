// Megatron's interleaved 1F1B. Each rank holds `chunks` (v) model chunks,
// placed round-robin: stage c * pp + r lives on rank r. Micro-batches go
// through in groups of pp: a rank runs chunk 0 forward for a group, then
// chunk 1 for the same group, and so on, which shrinks the bubble by v at the
// cost of v times the messages. Backwards visit the chunks in reverse.
//
// Like Megatron, it needs the micro-batches to be a multiple of pp so that
// every group is full; a ragged last group would break the lock-step order.
#include <weft/error.h>
#include <weft/schedule.h>

#include <algorithm>

namespace weft::sched {
namespace {

struct Slot {
  int chunk;
  int micro_batch;
};

// The k-th forward (or backward) a rank runs, out of m * v.
Slot virtual_slot(int k, int pp, int chunks, bool backward) {
  const int group = pp * chunks;
  const int chunk = (k % group) / pp;
  return {backward ? chunks - 1 - chunk : chunk, (k / group) * pp + k % pp};
}

// Forwards a rank runs before its first backward: enough that the first
// micro-batch reaches the last stage and comes back (2 per rank downstream),
// plus the v - 1 groups that fill the other chunks.
int warmup_forwards(int pp, int chunks, int rank, int total) {
  return std::min((pp - 1 - rank) * 2 + (chunks - 1) * pp, total);
}

}  // namespace

Schedule interleaved_1f1b(int pp, int micro_batches, int chunks) {
  check(pp >= 1, "interleaved-1f1b: pipeline ranks (pp = {}) must be at least 1", pp);
  check(chunks >= 2,
        "interleaved-1f1b: chunks per rank ({}) must be at least 2 (use 1f1b for one chunk)",
        chunks);
  check(micro_batches >= pp && micro_batches % pp == 0,
        "interleaved-1f1b: micro-batches ({}) must be a positive multiple of pp ({})",
        micro_batches, pp);
  Schedule s = empty_schedule("interleaved-1f1b", pp, micro_batches, chunks);

  const int total = micro_batches * chunks;
  for (int rank = 0; rank < pp; ++rank) {
    auto& list = s.actions[static_cast<size_t>(rank)];
    auto push = [&](ActionKind kind, int k) {
      const Slot slot = virtual_slot(k, pp, chunks, kind == ActionKind::B);
      list.push_back({kind, slot.chunk * pp + rank, slot.micro_batch});
    };
    const int warmup = warmup_forwards(pp, chunks, rank, total);
    int next_f = 0, next_b = 0;
    while (next_f < warmup) push(ActionKind::F, next_f++);
    while (next_f < total) {
      push(ActionKind::F, next_f++);
      push(ActionKind::B, next_b++);
    }
    while (next_b < total) push(ActionKind::B, next_b++);
  }
  return s;
}

}  // namespace weft::sched
