// Activation memory, as the executor holds it: one slot per (stage,
// micro-batch), alive from its first action (RECV_F or F) until its I and W
// are done and the gradient it sends back has been posted. A rank's memory
// changes only through its own actions, so walking them in order gives the
// bytes at every point of the step without a clock.
#include <weft/error.h>
#include <weft/schedule.h>

#include <algorithm>
#include <cmath>

namespace weft::sched {

namespace {

bool lowered(const Schedule& s) {
  for (const auto& list : s.actions)
    for (const Action& a : list)
      if (a.kind == ActionKind::SEND_F || a.kind == ActionKind::RECV_F ||
          a.kind == ActionKind::SEND_B || a.kind == ActionKind::RECV_B)
        return true;
  return false;
}

struct Slot {
  bool alive = false, inputs = false, grads = false;  // inputs / output gradient present
  bool input_grad = false, weight = false, grad_sent = false;
  double bytes = 0;
};

void check_bytes(const Schedule& s, const std::vector<StageBytes>& bytes) {
  check(bytes.size() == static_cast<size_t>(s.stages()),
        "memory_use: {} stage byte counts for schedule '{}' of {} stages", bytes.size(), s.name,
        s.stages());
  for (size_t st = 0; st < bytes.size(); ++st) {
    const StageBytes& b = bytes[st];
    for (double v : {b.recv_f, b.f, b.recv_b, b.i, b.w, b.f_work, b.i_work, b.i_keep})
      check(std::isfinite(v) && v >= 0,
            "memory_use: stage {} has a byte count of {}; counts must be finite and >= 0", st,
            v);
  }
  for (size_t r = 0; r < s.actions.size(); ++r)
    for (const Action& a : s.actions[r])
      check(a.kind == ActionKind::REDUCE_GRAD || a.kind == ActionKind::REDUCE_TIED ||
                a.kind == ActionKind::STEP ||
                (a.stage >= 0 && a.stage < s.stages() && a.micro_batch >= 0 &&
                 a.micro_batch < s.micro_batches),
            "memory_use: {} on rank {} is outside stages 0..{} or micro-batches 0..{}", a.str(),
            r, s.stages() - 1, s.micro_batches - 1);
}

}  // namespace

MemoryUse memory_use(const Schedule& s, const std::vector<StageBytes>& bytes, bool recompute,
                     bool receives_ahead) {
  check_bytes(s, bytes);
  recompute = folds_weights(s, recompute);  // from here: W runs with I
  const bool with_messages = lowered(s);
  const int m = s.micro_batches;
  auto rank_of = [&](int stage) { return s.stage_rank[static_cast<size_t>(stage)]; };
  MemoryUse use;
  for (size_t r = 0; r < s.actions.size(); ++r) {
    std::vector<Slot> slots(static_cast<size_t>(s.stages() * m));
    double held = 0, peak = 0;
    int alive = 0, peak_alive = 0;
    auto slot = [&](int stage, int mb) -> Slot& {
      Slot& sl = slots[static_cast<size_t>(stage * m + mb)];
      if (!sl.alive) {
        sl = Slot{};
        sl.alive = true;
        peak_alive = std::max(peak_alive, ++alive);
      }
      return sl;
    };
    auto add = [&](Slot& sl, double b) {
      sl.bytes += b;
      held += b;
    };
    auto release_if_done = [&](int stage, Slot& sl) {
      const bool needs_send =
          with_messages && stage > 0 && rank_of(stage - 1) != static_cast<int>(r);
      if (!sl.alive || !sl.input_grad || !sl.weight || (needs_send && !sl.grad_sent)) return;
      held -= sl.bytes;
      sl = Slot{};
      --alive;
    };
    auto input_grad = [&](int stage, int mb) {
      const StageBytes& b = bytes[static_cast<size_t>(stage)];
      Slot& sl = slot(stage, mb);
      if (!sl.grads && stage + 1 < s.stages()) {  // not received: came with the action
        add(sl, b.recv_b);
        sl.grads = true;
      }
      add(sl, b.i);
      peak = std::max(peak, held + b.i_work_above);
      if (stage > 0 && rank_of(stage - 1) == static_cast<int>(r)) {
        Slot& prev = slot(stage - 1, mb);
        add(prev, bytes[static_cast<size_t>(stage) - 1].recv_b);
        prev.grads = true;
      } else if (stage > 0) {
        add(sl, b.i_keep);
      }
      sl.input_grad = true;
      if (recompute) sl.weight = true;
      peak = std::max(peak, held + b.i_work);
    };
    auto weight = [&](int stage, int mb) {
      Slot& sl = slot(stage, mb);
      if (!sl.weight) add(sl, bytes[static_cast<size_t>(stage)].w);
      sl.weight = true;
      peak = std::max(peak, held);
    };
    auto receive = [&](const Action& a) {
      Slot& sl = slot(a.stage, a.micro_batch);
      const StageBytes& b = bytes[static_cast<size_t>(a.stage)];
      if (a.kind == ActionKind::RECV_F) {
        add(sl, b.recv_f);
        sl.inputs = true;
      } else {
        add(sl, b.recv_b);
        sl.grads = true;
      }
      peak = std::max(peak, held);
    };
    const std::vector<Action>& list = s.actions[r];
    std::vector<bool> posted(list.size(), false);
    std::vector<double> after;
    for (size_t i = 0; i < list.size(); ++i) {
      const Action& a = list[i];
      const int st = a.stage, mb = a.micro_batch;
      // The receives up to the next compute action are posted before this one.
      if (receives_ahead && is_compute(a.kind))
        for (size_t j = i + 1; j < list.size() && !is_compute(list[j].kind); ++j)
          if ((list[j].kind == ActionKind::RECV_F || list[j].kind == ActionKind::RECV_B) &&
              !posted[j]) {
            receive(list[j]);
            posted[j] = true;
          }
      switch (a.kind) {
        case ActionKind::RECV_F:
        case ActionKind::RECV_B:
          if (!posted[i]) receive(a);
          posted[i] = true;
          break;
        case ActionKind::F: {
          const StageBytes& b = bytes[static_cast<size_t>(st)];
          Slot& sl = slot(st, mb);
          if (!sl.inputs && st > 0) add(sl, b.recv_f);
          sl.inputs = true;
          add(sl, b.f);
          peak = std::max(peak, held + b.f_work);
          break;
        }
        case ActionKind::I:
          input_grad(st, mb);
          release_if_done(st, slot(st, mb));
          break;
        case ActionKind::B:
          input_grad(st, mb);
          weight(st, mb);
          release_if_done(st, slot(st, mb));
          break;
        case ActionKind::W:
          if (recompute) break;  // it ran with I, which freed the slot
          weight(st, mb);
          release_if_done(st, slot(st, mb));
          break;
        case ActionKind::SEND_B: {
          Slot& sl = slot(st, mb);
          sl.grad_sent = true;
          release_if_done(st, sl);
          break;
        }
        case ActionKind::SEND_F:
        case ActionKind::REDUCE_GRAD:
        case ActionKind::REDUCE_TIED:
        case ActionKind::STEP:
          break;
      }
      after.push_back(held);
    }
    use.peak.push_back(peak);
    use.peak_slots.push_back(peak_alive);
    use.held.push_back(std::move(after));
  }
  return use;
}

bool folds_weights(const Schedule& s, bool recompute) {
  if (!recompute) return false;
  for (const auto& list : s.actions)
    for (const Action& a : list)
      if (a.kind == ActionKind::I || a.kind == ActionKind::W) return false;
  return true;
}

std::vector<int> peak_in_flight(const Schedule& s, bool recompute) {
  recompute = folds_weights(s, recompute);
  std::vector<int> peaks;
  for (const auto& list : s.actions) {
    // Per (stage, micro-batch): 0 before F, then 1 after F, 2 after one of
    // I/W, gone after both (B is both).
    std::vector<int> state(static_cast<size_t>(s.stages() * s.micro_batches), 0);
    int held = 0, peak = 0;
    for (const Action& a : list) {
      if (a.kind != ActionKind::F && a.kind != ActionKind::B && a.kind != ActionKind::I &&
          a.kind != ActionKind::W)
        continue;
      check(a.stage >= 0 && a.stage < s.stages() && a.micro_batch >= 0 &&
                a.micro_batch < s.micro_batches,
            "peak_in_flight: {} is outside stages 0..{} or micro-batches 0..{}", a.str(),
            s.stages() - 1, s.micro_batches - 1);
      int& st = state[static_cast<size_t>(a.stage * s.micro_batches + a.micro_batch)];
      if (a.kind == ActionKind::F) {
        st = 1;
        peak = std::max(peak, ++held);
      } else if (st > 0) {
        // With recompute, I runs W too.
        st = a.kind == ActionKind::B || st == 2 || (recompute && a.kind == ActionKind::I) ? 0 : 2;
        if (st == 0) --held;
      }
    }
    peaks.push_back(peak);
  }
  return peaks;
}

}  // namespace weft::sched
