// Activation memory, counted in (stage, micro-batch) stashes from the forward
// that saves one to the input gradient (I or B) that releases the bulk of it.
// What a deferred W still reads is bounded by each schedule instead: ZB-H1
// lets rank r defer at most r of them, ZB-V caps forwards not yet followed by
// their W.
#include <weft/schedule.h>

#include <algorithm>

namespace weft::sched {

std::vector<int> peak_in_flight(const Schedule& s) {
  std::vector<int> peaks;
  for (const auto& list : s.actions) {
    int held = 0, peak = 0;
    for (const Action& a : list) {
      if (a.kind == ActionKind::F) peak = std::max(peak, ++held);
      if (a.kind == ActionKind::B || a.kind == ActionKind::I) --held;
    }
    peaks.push_back(peak);
  }
  return peaks;
}

}  // namespace weft::sched
