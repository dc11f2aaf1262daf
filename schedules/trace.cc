// Chrome trace JSON for a simulated schedule, the format Perfetto and
// chrome://tracing load: a complete ("X") event per action on the thread of
// its rank, and a flow ("s" then "f", one id) from each SEND to its RECV so
// the viewer draws the message as an arrow; each rank's parameter update,
// when there is one, is a last event named "update". One cost unit is shown
// as a millisecond, since trace timestamps are microseconds.
#include <weft/simulate.h>

#include <nlohmann/json.hpp>

namespace weft::sched {
namespace {

constexpr double kMicrosPerUnit = 1000;

const char* category(ActionKind k) {
  switch (k) {
    case ActionKind::F: return "forward";
    case ActionKind::B: return "backward";
    case ActionKind::I: return "input-grad";
    case ActionKind::W: return "weight-grad";
    case ActionKind::SEND_F:
    case ActionKind::SEND_B: return "send";
    case ActionKind::RECV_F:
    case ActionKind::RECV_B: return "recv";
    default: return "other";
  }
}

nlohmann::json thread_name(int rank) {
  return {{"ph", "M"}, {"name", "thread_name"}, {"pid", 0}, {"tid", rank},
          {"args", {{"name", "rank " + std::to_string(rank)}}}};
}

nlohmann::json complete(const Action& a, int rank, const ActionTime& t) {
  return {{"ph", "X"}, {"name", a.str()}, {"cat", category(a.kind)}, {"pid", 0}, {"tid", rank},
          {"ts", t.start * kMicrosPerUnit}, {"dur", (t.end - t.start) * kMicrosPerUnit},
          {"args", {{"stage", a.stage}, {"micro_batch", a.micro_batch}}}};
}

// The two halves of a message's arrow; "bp": "e" ties the finish to the
// RECV slice that encloses it rather than to the next slice to start.
void add_flow(nlohmann::json& events, const SimResult& r, const SimMessage& m, size_t id) {
  const ActionTime& recv =
      r.times[static_cast<size_t>(m.to_rank)][static_cast<size_t>(m.to_index)];
  events.push_back({{"ph", "s"}, {"name", "message"}, {"cat", "message"}, {"id", id},
                    {"pid", 0}, {"tid", m.from_rank}, {"ts", m.sent * kMicrosPerUnit}});
  events.push_back({{"ph", "f"}, {"bp", "e"}, {"name", "message"}, {"cat", "message"},
                    {"id", id}, {"pid", 0}, {"tid", m.to_rank}, {"ts", recv.end * kMicrosPerUnit}});
}

}  // namespace

std::string chrome_trace(const Schedule& s, const SimResult& r) {
  nlohmann::json events = nlohmann::json::array();
  events.push_back({{"ph", "M"}, {"name", "process_name"}, {"pid", 0},
                    {"args", {{"name", s.name}}}});
  for (size_t rank = 0; rank < s.actions.size(); ++rank) {
    events.push_back(thread_name(static_cast<int>(rank)));
    for (size_t i = 0; i < s.actions[rank].size(); ++i)
      events.push_back(complete(s.actions[rank][i], static_cast<int>(rank), r.times[rank][i]));
    if (rank < r.update.size() && r.update[rank] > 0)
      events.push_back({{"ph", "X"}, {"name", "update"}, {"cat", "update"}, {"pid", 0},
                        {"tid", static_cast<int>(rank)}, {"ts", r.last_end * kMicrosPerUnit},
                        {"dur", r.update[rank] * kMicrosPerUnit}});
  }
  for (size_t id = 0; id < r.messages.size(); ++id) add_flow(events, r, r.messages[id], id);
  nlohmann::json trace = {{"traceEvents", events}, {"displayTimeUnit", "ms"}};
  return trace.dump() + "\n";
}

}  // namespace weft::sched
