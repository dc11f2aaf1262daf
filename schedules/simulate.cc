// The timed simulator. Every rank's order is fixed, so an action's start is
// fully determined by its rank's previous end and the ends of what it needs:
// the simulation sweeps the ranks, running each one's next action as soon as
// those are known, until all are done. That gives the same times as an event
// queue ordered by time, without one.
//
// Dependencies follow validate(): F(s, m) needs F(s-1, m); I/B(s, m) needs
// F(s, m) and I/B(s+1, m); W needs I. Before lowering, an input from another
// rank arrives one link time after it is produced; after lowering it arrives
// by RECV, which waits for the matching SEND (per pair of ranks, first sent
// is first received) and the link time.
#include <weft/error.h>
#include <weft/simulate.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <map>

namespace weft::sched {
namespace {

constexpr double kNotDone = -1;

bool is_message(ActionKind k) {
  return k == ActionKind::SEND_F || k == ActionKind::RECV_F || k == ActionKind::SEND_B ||
         k == ActionKind::RECV_B;
}
bool is_send(ActionKind k) { return k == ActionKind::SEND_F || k == ActionKind::SEND_B; }
bool is_recv(ActionKind k) { return k == ActionKind::RECV_F || k == ActionKind::RECV_B; }
bool is_backward_input(ActionKind k) { return k == ActionKind::B || k == ActionKind::I; }

bool has_messages(const Schedule& s) {
  for (const auto& list : s.actions)
    for (const Action& a : list)
      if (is_message(a.kind)) return true;
  return false;
}

// The stage boundary (b -> b + 1) a message crosses.
int boundary(const Action& a) {
  return a.kind == ActionKind::SEND_F || a.kind == ActionKind::RECV_B ? a.stage : a.stage - 1;
}

void check_costs(const Schedule& s, const SimCost& c) {
  const size_t n = static_cast<size_t>(s.stages());
  check(static_cast<int>(s.actions.size()) == s.pp && s.stage_rank.size() == n,
        "simulate: schedule '{}' has {} action lists and {} placed stages, not pp ({}) and "
        "pp x chunks ({})",
        s.name, s.actions.size(), s.stage_rank.size(), s.pp, n);
  const std::pair<const char*, const std::vector<double>*> per_stage[] = {
      {"f", &c.f},
      {"i", &c.i},
      {"w", &c.w},
      {"activation_bytes", &c.activation_bytes},
      {"stash_bytes", &c.stash_bytes},
      {"update", &c.update},
      {"f_wait", &c.f_wait},
      {"i_wait", &c.i_wait},
      {"w_wait", &c.w_wait}};
  for (const auto& [name, v] : per_stage) {
    const bool optional = (v == &c.activation_bytes || v == &c.stash_bytes || v == &c.update ||
                           v == &c.f_wait || v == &c.i_wait || v == &c.w_wait) &&
                          v->empty();
    check(optional || v->size() == n, "simulate: cost {} has {} entries, not one per stage ({})",
          name, v->size(), n);
    for (size_t st = 0; st < v->size(); ++st)
      check((*v)[st] >= 0 && std::isfinite((*v)[st]),
            "simulate: cost {}[{}] = {} must be finite and not negative", name, st, (*v)[st]);
  }
  check(c.link_latency >= 0 && std::isfinite(c.link_latency),
        "simulate: link_latency ({}) must be finite and not negative", c.link_latency);
  check(c.bandwidth > 0, "simulate: bandwidth ({}) must be positive", c.bandwidth);
  check(c.cores >= 0 && std::isfinite(c.cores),
        "simulate: cores ({}) must be finite and not negative (0: a core per process)", c.cores);
  check(c.processes_per_rank >= 1, "simulate: processes_per_rank ({}) must be at least 1",
        c.processes_per_rank);
  check(c.wake >= 0 && std::isfinite(c.wake),
        "simulate: wake ({}) must be finite and not negative", c.wake);
  check(c.memory.empty() || c.memory.size() == n,
        "simulate: cost memory has {} entries, not one per stage ({})", c.memory.size(), n);
}

// Stages and micro-batches index the simulator's tables: refuse what is out
// of range before using them (validate() says more about why).
void check_actions(const Schedule& s) {
  for (size_t r = 0; r < s.actions.size(); ++r)
    for (const Action& a : s.actions[r]) {
      if (!is_compute(a.kind) && !is_message(a.kind)) continue;
      check(a.stage >= 0 && a.stage < s.stages() && a.micro_batch >= 0 &&
                a.micro_batch < s.micro_batches,
            "simulate: {} on rank {} is outside stages 0..{} or micro-batches 0..{}", a.str(), r,
            s.stages() - 1, s.micro_batches - 1);
      const bool toward_next = a.kind == ActionKind::SEND_F || a.kind == ActionKind::RECV_B;
      const int other = a.stage + (toward_next ? 1 : -1);
      check(!is_message(a.kind) || (other >= 0 && other < s.stages()),
            "simulate: {} on rank {} has no stage {} to exchange with", a.str(), r, other);
    }
  for (int st = 0; st < s.stages(); ++st) {
    const int r = s.stage_rank[static_cast<size_t>(st)];
    check(r >= 0 && r < s.pp, "simulate: stage {} is placed on rank {}, outside 0..{}", st, r,
          s.pp - 1);
  }
}

class Simulator {
 public:
  Simulator(const Schedule& s, const SimCost& c)
      : s_(s),
        c_(c),
        lowered_(has_messages(s)),
        next_(s.actions.size(), 0),
        free_(s.actions.size(), 0),
        fwd_(slots(), kNotDone),
        bwd_(slots(), kNotDone) {
    r_.times.resize(s.actions.size());
    r_.bytes_sent.assign(s.actions.size(), 0);
    for (size_t r = 0; r < s.actions.size(); ++r) r_.times[r].resize(s.actions[r].size());
  }

  SimResult run() {
    if (c_.cores > 0) return run_shared();
    for (bool moved = true; moved;) {
      moved = false;
      for (size_t r = 0; r < s_.actions.size(); ++r)
        while (next_[r] < s_.actions[r].size() && step(static_cast<int>(r))) {
          ++next_[r];
          moved = true;
        }
    }
    check_finished();
    return std::move(r_);
  }

 private:
  size_t slots() const { return static_cast<size_t>(s_.stages() * s_.micro_batches); }
  size_t slot(int stage, int mb) const {
    return static_cast<size_t>(stage * s_.micro_batches + mb);
  }
  int rank_of(int stage) const { return s_.stage_rank[static_cast<size_t>(stage)]; }
  double bytes(int b) const {
    return c_.activation_bytes.empty() ? 0 : c_.activation_bytes[static_cast<size_t>(b)];
  }
  double link(int b) const { return c_.link_latency + bytes(b) / c_.bandwidth; }
  int peer(const Action& a) const {
    const bool toward_next = a.kind == ActionKind::SEND_F || a.kind == ActionKind::RECV_B;
    return rank_of(a.stage + (toward_next ? 1 : -1));
  }

  double duration(const Action& a) const {
    const size_t st = static_cast<size_t>(a.stage);
    switch (a.kind) {
      case ActionKind::F: return c_.f[st];
      case ActionKind::I: return c_.i[st];
      case ActionKind::W: return c_.w[st];
      case ActionKind::B: return c_.i[st] + c_.w[st];
      default: return 0;
    }
  }

  // Of an action's time, what it spends waiting on other ranks inside it
  // (tensor-parallel collectives): it takes no core.
  double waiting(const Action& a) const {
    const size_t st = static_cast<size_t>(a.stage);
    auto at = [st](const std::vector<double>& v) { return v.empty() ? 0.0 : v[st]; };
    switch (a.kind) {
      case ActionKind::F: return at(c_.f_wait);
      case ActionKind::I:
        return at(c_.i_wait);
      case ActionKind::W:
        return at(c_.w_wait);
      case ActionKind::B:
        return at(c_.i_wait) + at(c_.w_wait);
      default: return 0;
    }
  }

  // Raises `start` to when the input at (`stage`, mb) in `done` is usable on
  // `rank`, crossing `b`; false while it is not produced yet.
  bool need(const std::vector<double>& done, int stage, int mb, int rank, int b, double& start) {
    const double end = done[slot(stage, mb)];
    if (end == kNotDone) return false;
    if (rank_of(stage) == rank) {
      start = std::max(start, end);
    } else if (!lowered_) {
      start = std::max(start, end + link(b));
    }  // lowered: the RECV before this action already waited for it
    return true;
  }

  // When compute `a` on `rank` can start, or false while an input is missing.
  bool compute_ready(int rank, const Action& a, double& start) {
    const int st = a.stage, mb = a.micro_batch;
    if (a.kind == ActionKind::F) return st == 0 || need(fwd_, st - 1, mb, rank, st - 1, start);
    if (a.kind == ActionKind::W) return need(bwd_, st, mb, rank, st, start);
    if (!need(fwd_, st, mb, rank, st, start)) return false;
    return st + 1 == s_.stages() || need(bwd_, st + 1, mb, rank, st, start);
  }

  void finish_compute(int rank, const Action& a, double end) {
    const size_t at = slot(a.stage, a.micro_batch);
    if (a.kind == ActionKind::F) fwd_[at] = end;
    if (is_backward_input(a.kind)) bwd_[at] = end;
    if (lowered_) return;
    // Unlowered, the cross-rank inputs this action consumed were still sent.
    if (a.kind == ActionKind::F && a.stage > 0 && rank_of(a.stage - 1) != rank)
      r_.bytes_sent[static_cast<size_t>(rank_of(a.stage - 1))] += bytes(a.stage - 1);
    if (is_backward_input(a.kind) && a.stage + 1 < s_.stages() && rank_of(a.stage + 1) != rank)
      r_.bytes_sent[static_cast<size_t>(rank_of(a.stage + 1))] += bytes(a.stage);
  }

  void send(int rank, const Action& a, double start) {
    const int b = boundary(a);
    const double arrives = start + link(b);
    const double end = c_.overlap ? start : arrives;
    const size_t index = next_[static_cast<size_t>(rank)];
    channel_[{rank, peer(a)}].push_back(
        {rank, static_cast<int>(index), -1, -1, start, arrives, bytes(b)});
    r_.bytes_sent[static_cast<size_t>(rank)] += bytes(b);
    record(rank, start, end);
  }

  bool receive(int rank, const Action& a, double start) {
    auto& queue = channel_[{peer(a), rank}];
    if (queue.empty()) return false;
    SimMessage m = queue.front();
    queue.pop_front();
    m.to_rank = rank;
    m.to_index = static_cast<int>(next_[static_cast<size_t>(rank)]);
    r_.messages.push_back(m);
    record(rank, start, m.arrives > start ? m.arrives + c_.wake : start);
    return true;
  }

  void record(int rank, double start, double end) {
    const size_t r = static_cast<size_t>(rank);
    r_.times[r][next_[r]] = {start, end};
    free_[r] = end;
  }

  // Runs `rank`'s next action if it can start; false when it must wait.
  bool step(int rank) {
    const size_t r = static_cast<size_t>(rank);
    const Action& a = s_.actions[r][next_[r]];
    double start = free_[r];
    if (is_send(a.kind)) {
      send(rank, a, start);
      return true;
    }
    if (is_recv(a.kind)) return receive(rank, a, start);
    if (!is_compute(a.kind)) {
      record(rank, start, start);  // reductions and the step are not timed here
      return true;
    }
    if (!compute_ready(rank, a, start)) return false;
    const double end = start + duration(a) + waiting(a);
    record(rank, start, end);
    finish_compute(rank, a, end);
    return true;
  }

  // Processor sharing: the ranks' compute can only be timed together. An
  // event loop: every rank runs what it can (messages and waits take no
  // core) up to its next compute, whose start is then known; the computes
  // running at once share the cores, and time moves to the next start or
  // finish.
  SimResult run_shared() {
    const size_t n = s_.actions.size();
    // tail: when a rank whose compute is done ends the wait inside it.
    std::vector<double> pending(n, kNotDone), remaining(n, 0), began(n, 0), tail(n, kNotDone);
    std::vector<bool> active(n, false);
    const double group = std::max(1, c_.processes_per_rank);
    double now = 0;
    for (;;) {
      for (size_t r = 0; r < n; ++r)
        if (tail[r] != kNotDone && tail[r] <= now) {
          end_compute(static_cast<int>(r), began[r], tail[r]);
          tail[r] = kNotDone;
        }
      // Each idle rank up to its next compute (or a wait on a missing input).
      for (bool moved = true; moved;) {
        moved = false;
        for (size_t r = 0; r < n; ++r)
          while (!active[r] && pending[r] == kNotDone && tail[r] == kNotDone &&
                 next_[r] < s_.actions[r].size()) {
            const Action& a = s_.actions[r][next_[r]];
            if (is_compute(a.kind)) {
              double start = free_[r];
              if (!compute_ready(static_cast<int>(r), a, start)) break;
              pending[r] = std::max(start, now);
              break;
            }
            if (!step(static_cast<int>(r))) break;
            ++next_[r];
            moved = true;
          }
      }
      // Computes due now start; one that takes no time ends at once.
      bool ended_now = false;
      for (size_t r = 0; r < n; ++r)
        if (pending[r] != kNotDone && pending[r] <= now) {
          pending[r] = kNotDone;
          const Action& a = s_.actions[r][next_[r]];
          const double work = duration(a);
          began[r] = now;
          if (work > 0) {
            active[r] = true;
            remaining[r] = work;
          } else if (waiting(a) > 0) {
            tail[r] = now + waiting(a);
          } else {
            end_compute(static_cast<int>(r), now, now);
            ended_now = true;
          }
        }
      if (ended_now) continue;
      const double running = group * static_cast<double>(std::count(active.begin(), active.end(), true));
      const double rate = core_share(running, c_.cores);
      double next = std::numeric_limits<double>::infinity();
      for (size_t r = 0; r < n; ++r) {
        if (active[r]) next = std::min(next, now + remaining[r] / rate);
        if (pending[r] != kNotDone) next = std::min(next, pending[r]);
        if (tail[r] != kNotDone) next = std::min(next, tail[r]);
      }
      if (!std::isfinite(next)) break;  // nothing runs or waits on time: done, or stuck
      for (size_t r = 0; r < n; ++r) {
        if (!active[r]) continue;
        const bool ends = now + remaining[r] / rate <= next;
        remaining[r] -= (next - now) * rate;
        if (ends) {
          active[r] = false;
          const double wait = waiting(s_.actions[r][next_[r]]);
          if (wait > 0)
            tail[r] = next + wait;
          else
            end_compute(static_cast<int>(r), began[r], next);
        }
      }
      now = next;
    }
    check_finished();
    return std::move(r_);
  }

  void end_compute(int rank, double start, double end) {
    const size_t r = static_cast<size_t>(rank);
    const Action& a = s_.actions[r][next_[r]];
    record(rank, start, end);
    finish_compute(rank, a, end);
    ++next_[r];
  }

  void check_finished() const {
    for (size_t r = 0; r < s_.actions.size(); ++r)
      if (next_[r] < s_.actions[r].size())
        throw Error(
            "simulate: schedule '{}' cannot finish: rank {} waits forever at {} (step {}); "
            "validate() names the rule it breaks",
            s_.name, r, s_.actions[r][next_[r]].str(), next_[r]);
  }

  const Schedule& s_;
  const SimCost& c_;
  bool lowered_;
  std::vector<size_t> next_;
  std::vector<double> free_;
  std::vector<double> fwd_, bwd_;
  std::map<std::pair<int, int>, std::deque<SimMessage>> channel_;
  SimResult r_;
};

void summarize_time(const Schedule& s, const SimCost& c, SimResult& r) {
  bool any = false;
  for (size_t rank = 0; rank < r.times.size(); ++rank) {
    double busy = 0;
    for (size_t i = 0; i < r.times[rank].size(); ++i) {
      const ActionTime& t = r.times[rank][i];
      r.first_start = any ? std::min(r.first_start, t.start) : t.start;
      r.last_end = any ? std::max(r.last_end, t.end) : t.end;
      any = true;
      if (is_compute(s.actions[rank][i].kind)) busy += t.end - t.start;
    }
    r.busy.push_back(busy);
  }
  r.pipeline_time = r.last_end - r.first_start;
  r.update.assign(s.actions.size(), 0);
  for (size_t st = 0; st < c.update.size(); ++st)
    r.update[static_cast<size_t>(s.stage_rank[st])] += c.update[st];
  if (c.cores > 0 && !r.update.empty()) {
    // Every process updates at once: each rank's replicas as many jobs.
    std::vector<double> jobs;
    for (double u : r.update) jobs.insert(jobs.end(), static_cast<size_t>(std::max(1, c.processes_per_rank)), u);
    r.update_time = shared_makespan(jobs, c.cores);
  } else {
    r.update_time = r.update.empty() ? 0 : *std::max_element(r.update.begin(), r.update.end());
  }
  r.step_time = r.pipeline_time + r.update_time;
  const double span = r.pipeline_time;
  double all_busy = 0;
  for (double busy : r.busy) {
    r.rank_bubble.push_back(span > 0 ? (span - busy) / span : 0);
    all_busy += busy;
  }
  const double all = span * static_cast<double>(r.busy.size());
  r.bubble_fraction = all > 0 ? (all - all_busy) / all : 0;
}

void summarize_memory(const Schedule& s, const SimCost& c, SimResult& r) {
  r.peak_activations = peak_in_flight(s, c.recompute);
  if (!c.memory.empty()) {
    r.peak_activation_bytes = memory_use(s, c.memory, c.recompute, c.receives_ahead).peak;
    return;
  }
  // Only a stash per stage: it is what F adds, held as long as the slot.
  const std::vector<double>& stash = c.stash_bytes.empty() ? c.activation_bytes : c.stash_bytes;
  std::vector<StageBytes> bytes(static_cast<size_t>(s.stages()));
  for (size_t st = 0; st < stash.size() && st < bytes.size(); ++st) bytes[st].f = stash[st];
  r.peak_activation_bytes = memory_use(s, bytes, c.recompute, c.receives_ahead).peak;
}

}  // namespace

double core_share(double n, double cores) {
  if (cores <= 0 || n <= cores) return 1.0;
  // The scheduler keeps each process on one core; the busiest core holds
  // ceil(n / cores) of them, and each of those runs that share of it. (Equal
  // shares of all the cores, cores / n, are what n does not divide: 3
  // processes on 2 cores run at 1/2, 1/2 and 1, not 2/3 each, and ranks
  // that wait on each other go at the slowest's pace.)
  return 1.0 / std::ceil(n / cores);
}

double shared_makespan(std::vector<double> work, double cores) {
  if (work.empty()) return 0;
  std::sort(work.begin(), work.end());
  if (cores <= 0) return work.back();
  // Jobs end shortest first; between ends, the n unfinished share the cores.
  double t = 0, done = 0;
  for (size_t j = 0; j < work.size(); ++j) {
    const double unfinished = static_cast<double>(work.size() - j);
    const double rate = core_share(unfinished, cores);
    t += (work[j] - done) / rate;
    done = work[j];
  }
  return t;
}

SimCost uniform_cost(const Schedule& s, double f, double i, double w, double comm, double bytes) {
  const size_t n = static_cast<size_t>(s.stages());
  const double share = 1.0 / std::max(1, s.chunks);
  SimCost c;
  c.f.assign(n, f * share);
  c.i.assign(n, i * share);
  c.w.assign(n, w * share);
  c.link_latency = comm;
  c.activation_bytes.assign(n, bytes);
  return c;
}

SimResult simulate(const Schedule& s, const SimCost& cost) {
  check_costs(s, cost);
  check_actions(s);
  SimResult r = Simulator(s, cost).run();
  summarize_time(s, cost, r);
  summarize_memory(s, cost, r);
  return r;
}

SimResult summarize(const Schedule& s, std::vector<std::vector<ActionTime>> times,
                    const SimCost& cost) {
  check(times.size() == s.actions.size(), "summarize: {} timed ranks for {} ranks of actions",
        times.size(), s.actions.size());
  for (size_t r = 0; r < times.size(); ++r)
    check(times[r].size() == s.actions[r].size(),
          "summarize: rank {} has {} times for {} actions", r, times[r].size(),
          s.actions[r].size());
  for (const std::vector<double>* v : {&cost.activation_bytes, &cost.stash_bytes, &cost.update})
    check(v->empty() || v->size() == static_cast<size_t>(s.stages()),
          "summarize: the costs give {} stages, the schedule has {}", v->size(), s.stages());
  check_actions(s);
  SimResult r;
  r.times = std::move(times);
  r.bytes_sent.assign(s.actions.size(), 0);
  for (size_t rank = 0; rank < s.actions.size(); ++rank)
    for (const Action& a : s.actions[rank])
      if (is_send(a.kind) && !cost.activation_bytes.empty())
        r.bytes_sent[rank] += cost.activation_bytes[static_cast<size_t>(boundary(a))];
  summarize_time(s, cost, r);
  summarize_memory(s, cost, r);
  return r;
}

}  // namespace weft::sched
