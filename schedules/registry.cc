// Schedules by name: the one list that weft-sched and train_gpt --schedule
// accept, with the conditions each schedule puts on its sizes.
#include <weft/error.h>
#include <weft/schedule.h>

#include <fmt/format.h>

#include <algorithm>

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

namespace {

void check_known(const std::string& name) {
  const std::vector<std::string> names = schedule_names();
  check(std::find(names.begin(), names.end(), name) != names.end(),
        "unknown schedule '{}'; the schedules are {}", name, fmt::join(names, ", "));
}

}  // namespace

int default_chunks(const std::string& name) {
  check_known(name);
  return name == "interleaved-1f1b" || name == "zb-v" ? 2 : 1;
}

std::string chunks_rule(const std::string& name, int chunks) {
  check_known(name);
  if (chunks < 1) return "chunks per rank must be at least 1";
  if (name == "zb-v")
    return chunks == 2 ? "" : "zb-v runs exactly 2 chunks per rank (its V shape)";
  if (name == "interleaved-1f1b")
    return chunks >= 2 ? ""
                       : "interleaved-1f1b runs at least 2 chunks per rank (1f1b is its "
                         "one-chunk form)";
  return chunks == 1 ? ""
                     : fmt::format("{} runs one chunk per rank; only interleaved-1f1b and zb-v "
                                   "run several",
                                   name);
}

Schedule make_schedule(const std::string& name, int pp, int micro_batches, int chunks) {
  check_known(name);
  check(pp >= 1, "schedule '{}': pipeline ranks (pp = {}) must be at least 1", name, pp);
  check(micro_batches >= 1, "schedule '{}': micro-batches ({}) must be at least 1", name,
        micro_batches);
  if (name == "gpipe") return gpipe(pp, micro_batches);
  if (name == "1f1b") return one_f_one_b(pp, micro_batches);
  if (name == "interleaved-1f1b") return interleaved_1f1b(pp, micro_batches, chunks);
  if (name == "zb-h1") return zb_h1(pp, micro_batches);
  return zb_v(pp, micro_batches);
}

}  // namespace weft::sched
