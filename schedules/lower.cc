// Lowering: adds the point-to-point messages a compute-only schedule implies.
//
// Every receive sits immediately before the compute that consumes it, so a
// blocking receive waits exactly as long as the compute would have waited for
// its input anyway. Every send goes right after the compute that produces it,
// except when that would put it ahead of a message the peer receives first:
// a pair of ranks shares one ordered channel (as NCCL and most transports
// match point-to-point messages), so a send is held back until everything the
// peer receives before it has been sent. That adds no waiting: the peer could
// not have taken this message before the earlier ones anyway. Hence a
// lowered schedule runs to completion exactly when its compute order does.
#include <weft/error.h>
#include <weft/schedule.h>

#include <algorithm>
#include <map>
#include <optional>
#include <tuple>
#include <utility>

namespace weft::sched {
namespace {

bool is_backward_input(ActionKind k) { return k == ActionKind::B || k == ActionKind::I; }

// The message a compute action has to receive first, if its input comes from
// another rank: {message to receive, the send that matches it}.
std::optional<std::pair<Action, Action>> needed_message(const Schedule& s, const Action& a) {
  const auto rank_of = [&](int stage) { return s.stage_rank[static_cast<size_t>(stage)]; };
  if (a.kind != ActionKind::F && !is_backward_input(a.kind)) return std::nullopt;
  const int here = rank_of(a.stage);
  if (a.kind == ActionKind::F && a.stage > 0 && rank_of(a.stage - 1) != here)
    return std::pair{Action{ActionKind::RECV_F, a.stage, a.micro_batch},
                     Action{ActionKind::SEND_F, a.stage - 1, a.micro_batch}};
  if (is_backward_input(a.kind) && a.stage + 1 < s.stages() && rank_of(a.stage + 1) != here)
    return std::pair{Action{ActionKind::RECV_B, a.stage, a.micro_batch},
                     Action{ActionKind::SEND_B, a.stage + 1, a.micro_batch}};
  return std::nullopt;
}

// The compute action whose output a send carries.
Action producer_of(const Action& send) {
  return {send.kind == ActionKind::SEND_F ? ActionKind::F : ActionKind::I, send.stage,
          send.micro_batch};
}

void check_compute_only(const Schedule& s) {
  check(static_cast<int>(s.actions.size()) == s.pp,
        "lower: schedule '{}' has action lists for {} ranks, not pp ({})", s.name, s.actions.size(),
        s.pp);
  check(static_cast<int>(s.stage_rank.size()) == s.stages(),
        "lower: schedule '{}' places {} stages, not pp x chunks ({})", s.name, s.stage_rank.size(),
        s.stages());
  for (int stage = 0; stage < s.stages(); ++stage) {
    const int r = s.stage_rank[static_cast<size_t>(stage)];
    check(r >= 0 && r < s.pp, "lower: stage {} is placed on rank {}, outside 0..{}", stage, r,
          s.pp - 1);
  }
  for (size_t r = 0; r < s.actions.size(); ++r) {
    for (const Action& a : s.actions[r]) {
      const bool message = a.kind == ActionKind::SEND_F || a.kind == ActionKind::RECV_F ||
                           a.kind == ActionKind::SEND_B || a.kind == ActionKind::RECV_B;
      check(!message, "lower: rank {} already has the message {}; lower a compute-only schedule", r,
            a.str());
      const bool staged = a.kind != ActionKind::STEP;
      check(!staged || (a.stage >= 0 && a.stage < s.stages()),
            "lower: rank {} has {}, whose stage is outside 0..{}", r, a.str(), s.stages() - 1);
    }
  }
}

}  // namespace

Schedule lower(const Schedule& compute) {
  check_compute_only(compute);
  const size_t pp = compute.actions.size();

  // Where each compute action sits on its rank, to find a send's producer.
  std::map<std::pair<int, std::tuple<int, int, int>>, size_t> position;
  for (size_t r = 0; r < pp; ++r)
    for (size_t i = 0; i < compute.actions[r].size(); ++i) {
      const Action& a = compute.actions[r][i];
      const ActionKind k = a.kind == ActionKind::B ? ActionKind::I : a.kind;
      position[{static_cast<int>(r), {static_cast<int>(k), a.stage, a.micro_batch}}] = i;
    }

  // Receives, and per (sender, receiver) the sends in the receiver's order.
  std::vector<std::vector<std::vector<Action>>> recv_before(pp);
  std::map<std::pair<int, int>, std::vector<Action>> channel;
  for (size_t r = 0; r < pp; ++r) {
    recv_before[r].resize(compute.actions[r].size());
    for (size_t i = 0; i < compute.actions[r].size(); ++i) {
      auto msg = needed_message(compute, compute.actions[r][i]);
      if (!msg) continue;
      recv_before[r][i].push_back(msg->first);
      const int src = compute.stage_rank[static_cast<size_t>(msg->second.stage)];
      channel[{src, static_cast<int>(r)}].push_back(msg->second);
    }
  }

  // Each send goes after its producer and after the channel's previous send.
  std::vector<std::vector<std::vector<Action>>> send_after(pp);
  for (size_t r = 0; r < pp; ++r) send_after[r].resize(compute.actions[r].size());
  for (const auto& [ends, sends] : channel) {
    const int src = ends.first;
    size_t at = 0;
    for (const Action& send : sends) {
      const Action p = producer_of(send);
      auto it = position.find({src, {static_cast<int>(p.kind), p.stage, p.micro_batch}});
      if (it == position.end()) continue;  // nothing produces it: validate() says so
      at = std::max(at, it->second);
      send_after[static_cast<size_t>(src)][at].push_back(send);
    }
  }

  Schedule out = compute;
  for (size_t r = 0; r < pp; ++r) {
    auto& list = out.actions[r];
    list.clear();
    for (size_t i = 0; i < compute.actions[r].size(); ++i) {
      list.insert(list.end(), recv_before[r][i].begin(), recv_before[r][i].end());
      list.push_back(compute.actions[r][i]);
      list.insert(list.end(), send_after[r][i].begin(), send_after[r][i].end());
    }
  }
  return out;
}

}  // namespace weft::sched
