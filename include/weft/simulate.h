// weft/simulate.h — timing a schedule before running it.
//
// simulate() plays a schedule (compute-only or lowered) against a cost model:
// each rank runs its actions in order, and an action starts once its rank is
// free and everything it needs has finished (plus the link time when that
// crosses ranks). What comes back is the timeline the executor would follow
// on a machine that behaves like the costs: step time, each rank's bubble,
// its activation stash and the bytes it sends.
//
//   Schedule s = lower(zb_h1(4, 8));
//   SimResult r = simulate(s, uniform_cost(s, 1, 1, 1));
//   fmt::print("{:.1f}% idle\n", 100 * r.bubble_fraction);
//   write(chrome_trace(s, r));   // open in Perfetto
//
// Times are in cost units; the trace writer takes one unit as a millisecond.
#pragma once

#include <weft/schedule.h>

#include <limits>
#include <string>
#include <vector>

namespace weft::sched {

struct SimCost {
  // Per stage (size stages()): forward, input-gradient and weight-gradient
  // time. A full backward B costs I + W.
  std::vector<double> f, i, w;
  // Per stage, optional: of F's, I's and W's (and B's) time, what is spent
  // waiting inside the action for other ranks (tensor-parallel collectives;
  // W's: sequence parallelism's gathers), which takes no core when ranks
  // share cores. Added to f, i and w. Empty: 0.
  std::vector<double> f_wait, i_wait, w_wait;
  // A message takes link_latency + bytes / bandwidth to arrive.
  double link_latency = 0;
  double bandwidth = std::numeric_limits<double>::infinity();  // bytes per time unit
  // Per stage: bytes of its output, which is both what crosses the boundary
  // to the next stage (forward, and the gradient back) and what a stash of it
  // holds. Empty means zero.
  std::vector<double> activation_bytes;
  // Per stage: bytes a (stage, micro-batch) keeps from its F until its I and
  // W are done, when that differs from the boundary (a profiled stage
  // stashes all its layers' activations). Empty means activation_bytes.
  std::vector<double> stash_bytes;
  // Per stage: what each action adds to its rank's memory, as the executor
  // measures it (PipelineExecutor::stage_bytes, or a --costs file). When
  // given, the memory figures come from sched::memory_use and stash_bytes is
  // not used. `recompute` as the run's --recompute.
  std::vector<StageBytes> memory;
  bool recompute = false;
  bool receives_ahead = false;  // as the executor's PipelineOptions::post_receives_ahead
  // Per stage: time to update its parameters once the pipeline has drained
  // (gradient norm, clipping, the optimizer step). A rank updates its stages
  // after the last rank has finished, all ranks at once. Empty means zero.
  std::vector<double> update;
  // With overlap a send only hands the tensor to the link; without it the
  // sender is occupied until the message has arrived.
  bool overlap = true;
  // Cores the ranks share, and how many processes each simulated rank stands
  // for (its data- and tensor-parallel replicas, which compute in step with
  // it). 0 cores: every process has one of its own. Otherwise processor
  // sharing: while n processes compute at once, each progresses at
  // core_share(n, cores) of its profiled speed (F, I, W and the update):
  // 1 / ceil(n / cores) once n exceeds the cores.
  // Waiting and messages take no core.
  double cores = 0;
  int processes_per_rank = 1;
  // Time a rank that waited for a message takes to run again once it has
  // arrived: a waiting process polls, yields and sleeps, and while processes
  // outnumber cores it then waits for its turn. Added to every receive that
  // found its message not yet there (and, in the planner, to every
  // tensor-parallel collective). Measured, not fitted: bench/sched_report.py
  // reads it from a calibration run's trace at the same processes per core.
  double wake = 0;
};

// The speed of each of n processes computing at once on `cores` cores: 1
// while they fit, else 1 / ceil(n / cores), the share each process on the
// busiest core gets (the scheduler keeps a process on its core). cores 0:
// a core each.
double core_share(double n, double cores);

// The time until all of `work` (one entry per process, started together) is
// done on `cores` cores, each job progressing at core_share(n, cores) while
// n are unfinished. cores 0: max(work).
double shared_makespan(std::vector<double> work, double cores);

// The same costs for every stage. f, i, w and bytes are for a whole rank's
// share of the model, so a chunk of a `chunks`-way split gets 1/chunks of the
// compute; a boundary tensor is the same size however the model is cut.
SimCost uniform_cost(const Schedule& s, double f, double i, double w, double comm = 0,
                     double bytes = 1);

struct ActionTime {
  double start = 0;
  double end = 0;
};

// A SEND and the RECV it met (matched per pair of ranks in FIFO order, as
// validate() pairs them).
struct SimMessage {
  int from_rank = 0, from_index = 0;  // the SEND
  int to_rank = 0, to_index = 0;      // the RECV
  double sent = 0, arrives = 0;
  double bytes = 0;
};

struct SimResult {
  std::vector<std::vector<ActionTime>> times;  // parallel to Schedule::actions
  std::vector<SimMessage> messages;
  double first_start = 0, last_end = 0;
  double pipeline_time = 0;  // last_end - first_start
  // The slowest rank's update (SimCost::update summed over its stages).
  std::vector<double> update;  // per rank
  double update_time = 0;
  double step_time = 0;  // pipeline_time + update_time
  // Compute time (F, B, I, W) per rank; waiting and communicating are idle.
  std::vector<double> busy;
  // Idle share of [first_start, last_end] (the pipeline, without the
  // update): per rank and over all ranks.
  std::vector<double> rank_bubble;
  double bubble_fraction = 0;
  // Most (stage, micro-batch) stashes held at once (F done, I and W not
  // both), the same count as peak_in_flight(), and the most bytes held at
  // once: memory_use() of SimCost::memory, or else stash bytes over the
  // same lifetimes.
  std::vector<int> peak_activations;
  std::vector<double> peak_activation_bytes;
  std::vector<double> bytes_sent;  // per rank
};

// Throws weft::Error when the costs do not fit the schedule (sizes, negative
// times) or when no rank can proceed (validate() explains why).
SimResult simulate(const Schedule& s, const SimCost& cost);

// The summary of a timeline measured rather than simulated (`times` parallel
// to s.actions, as a trace records them): step time, busy time and bubble per
// rank, peak stashes; bytes from `cost` when it has them. Throws weft::Error
// when `times` does not match the actions.
SimResult summarize(const Schedule& s, std::vector<std::vector<ActionTime>> times,
                    const SimCost& cost = {});

// Chrome trace JSON (Perfetto, chrome://tracing): one complete event per
// action on thread `rank`, flow arrows from each SEND to its RECV.
std::string chrome_trace(const Schedule& s, const SimResult& r);
// SVG timeline: one row per rank, compute coloured by kind, idle left white.
// `unit` (e.g. "ms") follows the step time in the title.
std::string timeline_svg(const Schedule& s, const SimResult& r, const std::string& unit = "");

}  // namespace weft::sched
