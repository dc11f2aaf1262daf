// Schedules by name: the one list that weft-sched and train_gpt --schedule
// accept, with the conditions each schedule puts on its sizes.
#include <weft/error.h>
#include <weft/schedule.h>

#include <fmt/format.h>

namespace weft::sched {

Schedule empty_schedule(std::string name, int pp, int micro_batches, int chunks) {
  check(pp >= 1, "{}: pipeline ranks (pp = {}) must be at least 1", name, pp);
  check(micro_batches >= 1, "{}: micro-batches ({}) must be at least 1", name, micro_batches);
  Schedule s;
  s.name = std::move(name);
  s.pp = pp;
  s.chunks = chunks;
  s.micro_batches = micro_batches;
  for (int stage = 0; stage < pp * chunks; ++stage) s.stage_rank.push_back(stage % pp);
  s.actions.resize(static_cast<size_t>(pp));
  return s;
}

std::vector<std::string> schedule_names() {
  return {"gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v"};
}

Schedule make_schedule(const std::string& name, int pp, int micro_batches, int chunks) {
  check(pp >= 1, "schedule '{}': pipeline ranks (pp = {}) must be at least 1", name, pp);
  check(micro_batches >= 1, "schedule '{}': micro-batches ({}) must be at least 1", name,
        micro_batches);
  if (name == "gpipe") return gpipe(pp, micro_batches);
  if (name == "1f1b") return one_f_one_b(pp, micro_batches);
  if (name == "interleaved-1f1b") return interleaved_1f1b(pp, micro_batches, chunks);
  if (name == "zb-h1") return zb_h1(pp, micro_batches);
  if (name == "zb-v") return zb_v(pp, micro_batches);
  const std::vector<std::string> names = schedule_names();
  throw Error("unknown schedule '{}'; the schedules are {}", name, fmt::join(names, ", "));
}

}  // namespace weft::sched
