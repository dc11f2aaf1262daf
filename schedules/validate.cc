// Validation and the text grid. The checks run from the cheapest to the most
// expensive, and each later one relies on the earlier ones having passed:
//   1. layout: the action lists and stage placement have the schedule's sizes;
//   2. placement: every action names a real stage and micro-batch, on the rank
//      that holds the stage; messages only cross ranks;
//   3. counts: one F per (stage, micro-batch), one B or one I and one W, and
//      in a lowered schedule one of each message per cross-rank boundary;
//   4. order on a rank: what an action needs from its own rank comes first;
//   5. pairing: a pair of ranks sends and receives in the same order;
//   6. progress: executing with non-blocking sends and blocking receives (or,
//      before lowering, waiting for other ranks' compute) finishes.
// A schedule is lowered when it holds any message; then every cross-rank
// input must arrive by message.
#include <weft/error.h>
#include <weft/schedule.h>

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <optional>

namespace weft::sched {
namespace {

constexpr size_t kKinds = 11;

struct Loc {
  int rank = -1;
  int index = -1;
};

struct Problem {
  std::string rule;
  std::vector<Loc> marks;
};
using Found = std::optional<Problem>;

bool is_message(ActionKind k) {
  return k == ActionKind::SEND_F || k == ActionKind::RECV_F || k == ActionKind::SEND_B ||
         k == ActionKind::RECV_B;
}
bool is_backward_input(ActionKind k) { return k == ActionKind::B || k == ActionKind::I; }

int rank_of(const Schedule& s, int stage) { return s.stage_rank[static_cast<size_t>(stage)]; }
bool crosses(const Schedule& s, int from, int to) {
  return to >= 0 && to < s.stages() && rank_of(s, from) != rank_of(s, to);
}

// The tensor a message carries, the same for the send and its receive: a
// forward crossing stage boundary b -> b + 1, or a gradient crossing it back.
struct Tensor {
  bool forward = true;
  int boundary = 0;
  int micro_batch = 0;
  bool operator==(const Tensor&) const = default;
};
Tensor carried(const Action& a) {
  switch (a.kind) {
    case ActionKind::SEND_F: return {true, a.stage, a.micro_batch};
    case ActionKind::RECV_F: return {true, a.stage - 1, a.micro_batch};
    case ActionKind::SEND_B: return {false, a.stage - 1, a.micro_batch};
    default: return {false, a.stage, a.micro_batch};
  }
}
// The rank at the other end of a message.
int peer(const Schedule& s, const Action& a) {
  const bool toward_next = a.kind == ActionKind::SEND_F || a.kind == ActionKind::RECV_B;
  return rank_of(s, a.stage + (toward_next ? 1 : -1));
}
// The action at the other end of a message.
Action counterpart(const Action& a) {
  switch (a.kind) {
    case ActionKind::SEND_F: return {ActionKind::RECV_F, a.stage + 1, a.micro_batch};
    case ActionKind::RECV_F: return {ActionKind::SEND_F, a.stage - 1, a.micro_batch};
    case ActionKind::SEND_B: return {ActionKind::RECV_B, a.stage - 1, a.micro_batch};
    default: return {ActionKind::SEND_B, a.stage + 1, a.micro_batch};
  }
}

// Where each action sits, by (kind, stage, micro-batch); valid once every
// action passed the placement check.
class Where {
 public:
  explicit Where(const Schedule& s)
      : stages_(s.stages()),
        mbs_(s.micro_batches),
        slots_(kKinds * static_cast<size_t>((stages_ + 1) * (mbs_ + 1))) {
    for (size_t r = 0; r < s.actions.size(); ++r)
      for (size_t i = 0; i < s.actions[r].size(); ++i)
        slots_[key(s.actions[r][i])].push_back({static_cast<int>(r), static_cast<int>(i)});
  }
  const std::vector<Loc>& at(const Action& a) const { return slots_[key(a)]; }
  const std::vector<Loc>& at(ActionKind k, int stage, int mb) const { return at({k, stage, mb}); }
  // The one B or I of (stage, micro-batch); valid once counts passed.
  Loc backward_input(int stage, int mb) const {
    const auto& b = at(ActionKind::B, stage, mb);
    return b.empty() ? at(ActionKind::I, stage, mb).front() : b.front();
  }

 private:
  size_t key(const Action& a) const {
    const size_t kind = static_cast<size_t>(a.kind);
    return (kind * static_cast<size_t>(stages_ + 1) + static_cast<size_t>(a.stage + 1)) *
               static_cast<size_t>(mbs_ + 1) +
           static_cast<size_t>(a.micro_batch + 1);
  }
  int stages_, mbs_;
  std::vector<std::vector<Loc>> slots_;
};

const Action& action_at(const Schedule& s, Loc l) {
  return s.actions[static_cast<size_t>(l.rank)][static_cast<size_t>(l.index)];
}

// --- 1. layout ---

Found check_layout(const Schedule& s) {
  if (s.pp < 1 || s.chunks < 1 || s.micro_batches < 1)
    return Problem{fmt::format("pp ({}), chunks ({}) and micro-batches ({}) must be at least 1",
                               s.pp, s.chunks, s.micro_batches),
                   {}};
  if (static_cast<int>(s.actions.size()) != s.pp)
    return Problem{fmt::format("the schedule has action lists for {} ranks, not pp ({})",
                               s.actions.size(), s.pp),
                   {}};
  if (static_cast<int>(s.stage_rank.size()) != s.stages())
    return Problem{fmt::format("stage_rank places {} stages, not pp x chunks ({} x {} = {})",
                               s.stage_rank.size(), s.pp, s.chunks, s.stages()),
                   {}};
  for (int stage = 0; stage < s.stages(); ++stage)
    if (rank_of(s, stage) < 0 || rank_of(s, stage) >= s.pp)
      return Problem{fmt::format("stage {} is placed on rank {}, outside 0..{}", stage,
                                 rank_of(s, stage), s.pp - 1),
                     {}};
  return std::nullopt;
}

// --- 2. placement ---

// Why action `a` cannot sit on rank `rank`, or "" when it can.
std::string misplaced(const Schedule& s, const Action& a, int rank) {
  if (a.kind == ActionKind::STEP)
    return a.stage == -1 && a.micro_batch == -1 ? "" : "STEP takes no stage or micro-batch";
  if (a.stage < 0 || a.stage >= s.stages())
    return fmt::format("stage {} is outside 0..{}", a.stage, s.stages() - 1);
  const bool reduce = a.kind == ActionKind::REDUCE_GRAD || a.kind == ActionKind::REDUCE_TIED;
  if (reduce && a.micro_batch != -1) return "a gradient reduction takes no micro-batch";
  if (!reduce && (a.micro_batch < 0 || a.micro_batch >= s.micro_batches))
    return fmt::format("micro-batch {} is outside 0..{}", a.micro_batch, s.micro_batches - 1);
  if (rank_of(s, a.stage) != rank)
    return fmt::format("stage {} is held by rank {}, not rank {}", a.stage, rank_of(s, a.stage),
                       rank);
  if (!is_message(a.kind)) return "";
  const bool toward_next = a.kind == ActionKind::SEND_F || a.kind == ActionKind::RECV_B;
  const int other = a.stage + (toward_next ? 1 : -1);
  if (other < 0 || other >= s.stages())
    return fmt::format("stage {} has no stage {} to exchange with", a.stage, other);
  if (rank_of(s, other) == rank)
    return fmt::format("stages {} and {} are both on rank {}: no message is needed", a.stage, other,
                       rank);
  return "";
}

Found check_placement(const Schedule& s) {
  for (size_t r = 0; r < s.actions.size(); ++r)
    for (size_t i = 0; i < s.actions[r].size(); ++i) {
      const Action& a = s.actions[r][i];
      const std::string why = misplaced(s, a, static_cast<int>(r));
      if (!why.empty())
        return Problem{fmt::format("{} on rank {} cannot be there: {}", a.str(), r, why),
                       {{static_cast<int>(r), static_cast<int>(i)}}};
    }
  return std::nullopt;
}

// --- 3. counts ---

// Where a missing action would have had to come: before the rank's first
// action on the same stage and a later micro-batch, else at its end.
Loc expected_near(const Schedule& s, int stage, int mb) {
  const int r = rank_of(s, stage);
  const auto& list = s.actions[static_cast<size_t>(r)];
  for (size_t i = 0; i < list.size(); ++i)
    if (list[i].stage == stage && list[i].micro_batch >= mb) return {r, static_cast<int>(i)};
  // An empty rank has no action to point at: its row is flagged all the same.
  return {r, std::max(0, static_cast<int>(list.size()) - 1)};
}

Found duplicate(const Schedule& s, const std::vector<Loc>& found) {
  if (found.size() < 2) return std::nullopt;
  const Action& a = action_at(s, found[1]);
  return Problem{fmt::format("{} appears {} times; each must appear once", a.str(), found.size()),
                 {found[1]}};
}

Found check_compute_counts(const Schedule& s, const Where& where, int stage, int mb) {
  const auto& f = where.at(ActionKind::F, stage, mb);
  const auto& b = where.at(ActionKind::B, stage, mb);
  const auto& in = where.at(ActionKind::I, stage, mb);
  const auto& w = where.at(ActionKind::W, stage, mb);
  const Action fwd{ActionKind::F, stage, mb};
  if (f.empty())
    return Problem{fmt::format("{} is missing: stage {} never runs micro-batch {} forward",
                               fwd.str(), stage, mb),
                   {expected_near(s, stage, mb)}};
  for (const auto* found : {&f, &b, &in, &w})
    if (auto p = duplicate(s, *found)) return p;
  if (b.empty() && in.empty()) {
    const Loc near = w.empty() ? expected_near(s, stage, mb) : w.front();
    return Problem{
        fmt::format("{} has no backward: neither {} nor {}", fwd.str(),
                    Action{ActionKind::B, stage, mb}.str(), Action{ActionKind::I, stage, mb}.str()),
        {near}};
  }
  if (!b.empty() && (!in.empty() || !w.empty())) {
    const Loc split = in.empty() ? w.front() : in.front();
    return Problem{fmt::format("{} is split into I and W and also run whole as {}",
                               action_at(s, split).str(), action_at(s, b.front()).str()),
                   {split}};
  }
  if (!in.empty() && w.empty())
    return Problem{fmt::format("{} has no weight gradient {}", action_at(s, in.front()).str(),
                               Action{ActionKind::W, stage, mb}.str()),
                   {in.front()}};
  return std::nullopt;
}

// One message of the kind and stage given must exist; `consumer` is the
// compute that produces or consumes it, marked when it is missing.
Found check_message_count(const Schedule& s, const Where& where, const Action& message,
                          Loc consumer) {
  const auto& found = where.at(message);
  if (found.empty()) {
    const bool send = message.kind == ActionKind::SEND_F || message.kind == ActionKind::SEND_B;
    return Problem{
        fmt::format("{} on rank {} has no {} {} rank {}", action_at(s, consumer).str(),
                    consumer.rank, message.str(), send ? "to" : "from", peer(s, message)),
        {consumer}};
  }
  return duplicate(s, found);
}

Found check_message_counts(const Schedule& s, const Where& where, int boundary, int mb) {
  const Loc fwd_out = where.at(ActionKind::F, boundary, mb).front();
  const Loc fwd_in = where.at(ActionKind::F, boundary + 1, mb).front();
  const Loc grad_out = where.backward_input(boundary + 1, mb);
  const Loc grad_in = where.backward_input(boundary, mb);
  const std::pair<Action, Loc> needed[] = {
      {{ActionKind::SEND_F, boundary, mb}, fwd_out},
      {{ActionKind::RECV_F, boundary + 1, mb}, fwd_in},
      {{ActionKind::SEND_B, boundary + 1, mb}, grad_out},
      {{ActionKind::RECV_B, boundary, mb}, grad_in},
  };
  for (const auto& [message, at] : needed)
    if (auto p = check_message_count(s, where, message, at)) return p;
  return std::nullopt;
}

Found check_counts(const Schedule& s, const Where& where, bool lowered) {
  for (int stage = 0; stage < s.stages(); ++stage)
    for (int mb = 0; mb < s.micro_batches; ++mb)
      if (auto p = check_compute_counts(s, where, stage, mb)) return p;
  if (!lowered) return std::nullopt;
  for (int stage = 0; stage + 1 < s.stages(); ++stage)
    if (crosses(s, stage, stage + 1))
      for (int mb = 0; mb < s.micro_batches; ++mb)
        if (auto p = check_message_counts(s, where, stage, mb)) return p;
  return std::nullopt;
}

// --- 4. order on a rank ---

// What `a` needs from its own rank, each found exactly once by now.
std::vector<Loc> local_needs(const Schedule& s, const Where& where, const Action& a, bool lowered) {
  const int st = a.stage, mb = a.micro_batch;
  std::vector<Loc> needs;
  auto input_from = [&](int other, ActionKind recv, auto&& same_rank) {
    if (other < 0 || other >= s.stages()) return;
    if (!crosses(s, st, other))
      needs.push_back(same_rank());
    else if (lowered)
      needs.push_back(where.at(recv, st, mb).front());
  };
  switch (a.kind) {
    case ActionKind::F:
      input_from(st - 1, ActionKind::RECV_F,
                 [&] { return where.at(ActionKind::F, st - 1, mb).front(); });
      break;
    case ActionKind::B:
    case ActionKind::I:
      needs.push_back(where.at(ActionKind::F, st, mb).front());
      input_from(st + 1, ActionKind::RECV_B, [&] { return where.backward_input(st + 1, mb); });
      break;
    case ActionKind::W: needs.push_back(where.at(ActionKind::I, st, mb).front()); break;
    case ActionKind::SEND_F: needs.push_back(where.at(ActionKind::F, st, mb).front()); break;
    case ActionKind::SEND_B: needs.push_back(where.backward_input(st, mb)); break;
    case ActionKind::REDUCE_GRAD:
    case ActionKind::REDUCE_TIED:
      for (int m = 0; m < s.micro_batches; ++m) {
        const auto& b = where.at(ActionKind::B, st, m);
        needs.push_back(b.empty() ? where.at(ActionKind::W, st, m).front() : b.front());
      }
      break;
    default: break;
  }
  return needs;
}

Found check_local_order(const Schedule& s, const Where& where, bool lowered) {
  for (size_t r = 0; r < s.actions.size(); ++r)
    for (size_t i = 0; i < s.actions[r].size(); ++i) {
      const Action& a = s.actions[r][i];
      for (const Loc& need : local_needs(s, where, a, lowered)) {
        if (need.index < static_cast<int>(i)) continue;
        return Problem{fmt::format("{} needs {}, which comes later on rank {} (step {} > {})",
                                   a.str(), action_at(s, need).str(), r, need.index, i),
                       {{static_cast<int>(r), static_cast<int>(i)}}};
      }
    }
  return std::nullopt;
}

// --- 5. pairing ---

Found check_pairing(const Schedule& s) {
  // Per (from, to): the sends in the sender's order and the receives in the
  // receiver's; the transport matches them first to first.
  std::map<std::pair<int, int>, std::vector<Loc>> sends, recvs;
  for (size_t r = 0; r < s.actions.size(); ++r)
    for (size_t i = 0; i < s.actions[r].size(); ++i) {
      const Action& a = s.actions[r][i];
      const Loc here{static_cast<int>(r), static_cast<int>(i)};
      if (a.kind == ActionKind::SEND_F || a.kind == ActionKind::SEND_B)
        sends[{here.rank, peer(s, a)}].push_back(here);
      else if (a.kind == ActionKind::RECV_F || a.kind == ActionKind::RECV_B)
        recvs[{peer(s, a), here.rank}].push_back(here);
    }
  for (const auto& [ends, got] : recvs) {
    const auto& sent = sends[ends];
    for (size_t j = 0; j < got.size() && j < sent.size(); ++j) {
      const Action& recv = action_at(s, got[j]);
      const Action& send = action_at(s, sent[j]);
      if (carried(recv) == carried(send)) continue;
      return Problem{
          fmt::format("{} is rank {}'s receive #{} from rank {}, but rank {}'s send #{} to rank "
                      "{} is {}: a pair of ranks must send and receive in the same order",
                      recv.str(), ends.second, j, ends.first, ends.first, j, ends.second,
                      send.str()),
          {got[j], sent[j]}};
    }
  }
  return std::nullopt;
}

// --- 6. progress ---

// Plays the schedule: sends never block, a receive waits for its send, and
// before lowering a compute waits for the other ranks' compute it needs.
class Execution {
 public:
  Execution(const Schedule& s, bool lowered)
      : s_(s),
        lowered_(lowered),
        next_(s.actions.size(), 0),
        fwd_(static_cast<size_t>(s.stages() * s.micro_batches), false),
        bwd_(fwd_) {}

  Found run() {
    for (bool moved = true; moved;) {
      moved = false;
      for (size_t r = 0; r < s_.actions.size(); ++r)
        while (next_[r] < s_.actions[r].size() && ready(static_cast<int>(r), current(r))) {
          execute(static_cast<int>(r), current(r));
          ++next_[r];
          moved = true;
        }
    }
    return stuck();
  }

 private:
  const Action& current(size_t r) const { return s_.actions[r][next_[r]]; }
  size_t slot(int stage, int mb) const {
    return static_cast<size_t>(stage * s_.micro_batches + mb);
  }

  // The action `a` on `rank` is waiting for, or nullopt when it can run.
  std::optional<Action> waits_for(int rank, const Action& a) const {
    const int st = a.stage, mb = a.micro_batch;
    if (a.kind == ActionKind::RECV_F || a.kind == ActionKind::RECV_B) {
      const auto it = sent_.find({peer(s_, a), rank});
      const size_t sent = it == sent_.end() ? 0 : it->second;
      const auto got = received_.find({peer(s_, a), rank});
      const size_t taken = got == received_.end() ? 0 : got->second;
      if (taken < sent) return std::nullopt;
      return counterpart(a);
    }
    if (lowered_) return std::nullopt;
    if (a.kind == ActionKind::F && st > 0 && !fwd_[slot(st - 1, mb)])
      return Action{ActionKind::F, st - 1, mb};
    if (is_backward_input(a.kind) && st + 1 < s_.stages() && !bwd_[slot(st + 1, mb)])
      return Action{ActionKind::I, st + 1, mb};
    return std::nullopt;
  }
  bool ready(int rank, const Action& a) const { return !waits_for(rank, a); }

  void execute(int rank, const Action& a) {
    if (a.kind == ActionKind::F) fwd_[slot(a.stage, a.micro_batch)] = true;
    if (is_backward_input(a.kind)) bwd_[slot(a.stage, a.micro_batch)] = true;
    if (a.kind == ActionKind::SEND_F || a.kind == ActionKind::SEND_B) ++sent_[{rank, peer(s_, a)}];
    if (a.kind == ActionKind::RECV_F || a.kind == ActionKind::RECV_B)
      ++received_[{peer(s_, a), rank}];
  }

  Found stuck() const {
    Problem p;
    for (size_t r = 0; r < s_.actions.size(); ++r) {
      if (next_[r] == s_.actions[r].size()) continue;
      const Action& a = current(r);
      const Action need = *waits_for(static_cast<int>(r), a);
      std::string need_text = need.str();
      // Before lowering a gradient may come from a B or an I: name both.
      if (!is_message(need.kind) && need.kind == ActionKind::I)
        need_text = fmt::format(
            "{} or {}", Action{ActionKind::B, need.stage, need.micro_batch}.str(), need.str());
      p.rule += fmt::format("{}rank {} waits at {} for {} on rank {}", p.marks.empty() ? "" : "; ",
                            r, a.str(), need_text, rank_of(s_, need.stage));
      p.marks.push_back({static_cast<int>(r), static_cast<int>(next_[r])});
    }
    if (p.marks.empty()) return std::nullopt;
    p.rule = "deadlock: no rank can proceed: " + p.rule;
    return p;
  }

  const Schedule& s_;
  bool lowered_;
  std::vector<size_t> next_;
  std::vector<bool> fwd_, bwd_;
  std::map<std::pair<int, int>, size_t> sent_, received_;
};

// --- the grid ---

std::string grid(const Schedule& s, const std::vector<Loc>& marks) {
  auto marked = [&](size_t r, size_t i) {
    return std::any_of(marks.begin(), marks.end(), [&](const Loc& l) {
      return l.rank == static_cast<int>(r) && l.index == static_cast<int>(i);
    });
  };
  std::vector<std::vector<std::string>> cells(s.actions.size());
  std::vector<size_t> width;
  for (size_t r = 0; r < s.actions.size(); ++r)
    for (size_t i = 0; i < s.actions[r].size(); ++i) {
      std::string text = s.actions[r][i].str();
      if (marked(r, i)) text = "[" + text + "]";
      if (width.size() <= i) width.push_back(0);
      width[i] = std::max(width[i], text.size());
      cells[r].push_back(std::move(text));
    }
  const size_t label = fmt::format("rank {}:", s.actions.empty() ? 0 : s.actions.size() - 1).size();
  std::string out;
  for (size_t r = 0; r < cells.size(); ++r) {
    std::string row = fmt::format("{:<{}}", fmt::format("rank {}:", r), label);
    for (size_t i = 0; i < cells[r].size(); ++i)
      row += fmt::format(" {:<{}}", cells[r][i], width[i]);
    const bool flagged = std::any_of(marks.begin(), marks.end(),
                                     [&](const Loc& l) { return l.rank == static_cast<int>(r); });
    while (!row.empty() && row.back() == ' ') row.pop_back();
    if (flagged) row += "  <-- ERROR HERE";
    out += row + "\n";
  }
  return out;
}

bool has_messages(const Schedule& s) {
  for (const auto& list : s.actions)
    for (const Action& a : list)
      if (is_message(a.kind)) return true;
  return false;
}

Found first_problem(const Schedule& s) {
  if (auto p = check_layout(s)) return p;
  if (auto p = check_placement(s)) return p;
  const bool lowered = has_messages(s);
  const Where where(s);
  if (auto p = check_counts(s, where, lowered)) return p;
  if (auto p = check_local_order(s, where, lowered)) return p;
  if (lowered)
    if (auto p = check_pairing(s)) return p;
  return Execution(s, lowered).run();
}

}  // namespace

ValidationResult validate(const Schedule& s) {
  const Found p = first_problem(s);
  if (!p) return {};
  ValidationResult v;
  v.ok = false;
  if (!p->marks.empty()) {
    v.rank = p->marks.front().rank;
    v.index = p->marks.front().index;
  }
  v.message = fmt::format("schedule '{}' (pp {}, chunks {}, micro-batches {}) is invalid: {}\n{}",
                          s.name, s.pp, s.chunks, s.micro_batches, p->rule, grid(s, p->marks));
  return v;
}

std::string render_grid(const Schedule& s, int mark_rank, int mark_index) {
  if (mark_rank < 0) return grid(s, {});
  return grid(s, {{mark_rank, mark_index}});
}

}  // namespace weft::sched
