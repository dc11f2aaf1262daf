// Point-to-point steps, and the rendezvous check for transports that run
// each step's sends and receives as one group (NCCL).
#include <weft/error.h>
#include <weft/schedule.h>

#include <fmt/format.h>

#include <map>
#include <utility>

namespace weft::sched {

std::vector<P2pStep> p2p_steps(const std::vector<Action>& actions) {
  std::vector<P2pStep> steps;
  for (size_t i = 0; i < actions.size(); ++i) {
    if (!is_p2p(actions[i].kind)) continue;
    if (steps.empty() || steps.back().end != i) steps.push_back({i, i});
    steps.back().end = i + 1;
  }
  return steps;
}

namespace {

// The rank at the other end of a message action.
int peer_of(const Schedule& s, const Action& a) {
  const bool toward_next = a.kind == ActionKind::SEND_F || a.kind == ActionKind::RECV_B;
  const int stage = toward_next ? a.stage + 1 : a.stage - 1;
  check(stage >= 0 && stage < s.stages(), "{}: {} names stage {}, outside [0, {})", s.name,
        a.str(), stage, s.stages());
  return s.stage_rank[static_cast<size_t>(stage)];
}

bool is_send(ActionKind k) { return k == ActionKind::SEND_F || k == ActionKind::SEND_B; }

}  // namespace

std::string check_grouped_p2p(const Schedule& s) {
  const size_t ranks = s.actions.size();
  // Every message action gets a place: (rank, step); and its partner, the
  // k-th receive on the peer of the k-th send on this pair of ranks.
  struct Op {
    int rank = 0;
    size_t step = 0;
    size_t partner = 0;  // index into ops
    bool moved = false;
  };
  std::vector<Op> ops;
  std::vector<std::vector<P2pStep>> steps(ranks);
  std::vector<std::vector<std::vector<size_t>>> ops_of_step(ranks);
  std::map<std::pair<int, int>, std::vector<size_t>> sends, recvs;  // (from, to) -> ops in order
  for (size_t r = 0; r < ranks; ++r) {
    steps[r] = p2p_steps(s.actions[r]);
    ops_of_step[r].resize(steps[r].size());
    for (size_t k = 0; k < steps[r].size(); ++k)
      for (size_t i = steps[r][k].begin; i < steps[r][k].end; ++i) {
        const Action& a = s.actions[r][i];
        const int me = static_cast<int>(r), peer = peer_of(s, a);
        ops_of_step[r][k].push_back(ops.size());
        (is_send(a.kind) ? sends[{me, peer}] : recvs[{peer, me}]).push_back(ops.size());
        ops.push_back({me, k, 0, false});
      }
  }
  for (const auto& [pair, list] : sends) {
    const auto it = recvs.find(pair);
    const size_t n = it == recvs.end() ? 0 : it->second.size();
    check(n == list.size(), "{}: rank {} sends {} messages to rank {}, which receives {}", s.name,
          pair.first, list.size(), pair.second, n);
    for (size_t k = 0; k < n; ++k) {
      ops[list[k]].partner = it->second[k];
      ops[it->second[k]].partner = list[k];
    }
  }
  for (const auto& [pair, list] : recvs)
    check(sends.contains(pair), "{}: rank {} receives {} messages from rank {}, which sends none",
          s.name, pair.second, list.size(), pair.first);

  std::vector<size_t> current(ranks, 0);  // the step each rank's stream is running
  for (bool progress = true; progress;) {
    progress = false;
    for (size_t r = 0; r < ranks; ++r) {
      if (current[r] == steps[r].size()) continue;
      bool all = true;
      for (size_t o : ops_of_step[r][current[r]]) {
        Op& op = ops[o];
        const Op& other = ops[op.partner];
        if (!op.moved && current[static_cast<size_t>(other.rank)] == other.step) {
          op.moved = true;
          ops[op.partner].moved = true;
        }
        all = all && op.moved;
      }
      if (all) {
        ++current[r];
        progress = true;
      }
    }
  }
  std::string stuck;
  for (size_t r = 0; r < ranks; ++r) {
    if (current[r] == steps[r].size()) continue;
    const P2pStep& st = steps[r][current[r]];
    std::string acts;
    for (size_t i = st.begin; i < st.end; ++i) {
      if (i > st.begin) acts += ' ';
      acts += s.actions[r][i].str();
    }
    stuck += fmt::format("{}rank {} stuck in step {} ({})", stuck.empty() ? "" : ", ", r,
                         current[r], acts);
  }
  return stuck;
}

}  // namespace weft::sched
