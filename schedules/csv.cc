// CSV form of a schedule: line r lists rank r's actions, comma-separated, in
// order. Placement and sizes are not written: every action names its stage,
// so reading infers them (the rank of a stage is the line its actions sit on).
#include <weft/error.h>
#include <weft/schedule.h>

#include <algorithm>

namespace weft::sched {
namespace {

std::vector<std::string_view> split(std::string_view text, char sep) {
  std::vector<std::string_view> parts;
  for (size_t start = 0;;) {
    const size_t end = text.find(sep, start);
    parts.push_back(text.substr(start, end == std::string_view::npos ? end : end - start));
    if (end == std::string_view::npos) return parts;
    start = end + 1;
  }
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\r'))
    s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r'))
    s.remove_suffix(1);
  return s;
}

// Records that `stage` sits on `rank`, refusing a stage seen on two ranks.
void place(std::vector<int>& stage_rank, int stage, int rank, size_t line, size_t cell,
           std::string_view text) {
  if (stage < 0) return;
  if (static_cast<size_t>(stage) >= stage_rank.size())
    stage_rank.resize(static_cast<size_t>(stage) + 1, -1);
  int& r = stage_rank[static_cast<size_t>(stage)];
  check(r == -1 || r == rank,
        "csv line {}, cell {}: '{}' puts stage {} on rank {}, but line {} already holds it",
        line + 1, cell + 1, text, stage, rank, r + 1);
  r = rank;
}

// Sizes follow from what the actions name: stages = highest stage + 1 (all
// of them present), chunks = stages / pp, micro-batches = highest + 1.
void infer_sizes(Schedule& s) {
  const int stages = static_cast<int>(s.stage_rank.size());
  for (int stage = 0; stage < stages; ++stage)
    check(s.stage_rank[static_cast<size_t>(stage)] >= 0,
          "csv: stage {} appears on no line, but stage {} does", stage, stages - 1);
  check(stages > 0, "csv: no line names a stage");
  check(stages % s.pp == 0, "csv: {} stages do not split evenly over {} lines (ranks)", stages,
        s.pp);
  s.chunks = stages / s.pp;
  int last_mb = -1;
  for (const auto& list : s.actions)
    for (const Action& a : list) last_mb = std::max(last_mb, a.micro_batch);
  check(last_mb >= 0, "csv: no line names a micro-batch");
  s.micro_batches = last_mb + 1;
}

}  // namespace

std::string to_csv(const Schedule& s) {
  std::string out;
  for (const auto& list : s.actions) {
    for (size_t i = 0; i < list.size(); ++i) {
      if (i > 0) out += ',';
      out += list[i].str();
    }
    out += '\n';
  }
  return out;
}

Schedule from_csv(std::string_view csv, const std::string& name) {
  std::vector<std::string_view> lines = split(csv, '\n');
  // A final newline ends the last line rather than starting an empty one.
  if (!lines.empty() && trim(lines.back()).empty()) lines.pop_back();
  check(!lines.empty(), "csv: no lines; expected one line of actions per rank");

  Schedule s;
  s.name = name;
  s.pp = static_cast<int>(lines.size());
  s.actions.resize(lines.size());
  for (size_t line = 0; line < lines.size(); ++line) {
    if (trim(lines[line]).empty()) continue;  // a rank with nothing to do
    const auto cells = split(lines[line], ',');
    for (size_t cell = 0; cell < cells.size(); ++cell) {
      const std::string_view text = trim(cells[cell]);
      Action a;
      try {
        a = Action::parse(text);
      } catch (const Error& e) {
        throw Error("csv line {}, cell {}: {}", line + 1, cell + 1, e.what());
      }
      place(s.stage_rank, a.stage, static_cast<int>(line), line, cell, text);
      s.actions[line].push_back(a);
    }
  }
  infer_sizes(s);
  return s;
}

}  // namespace weft::sched
