// weft/schedule.h — pipeline schedules as plain data.
//
// A schedule says, for every pipeline rank, the order of its actions. An
// action is {kind, stage, micro-batch}; its text form is the stage, the kind
// and the micro-batch: "2F0" (stage 2, forward, micro-batch 0), "1B3",
// "0I1", "0W1", "1SEND_F0", "2RECV_B4". Stages are global: with pp ranks and
// v chunks per rank there are pp*v stages, stage s reading stage s-1's output.
// Which rank holds a stage is part of the schedule (stage_rank): round-robin
// (s % pp) for GPipe, 1F1B and interleaved 1F1B; a V shape for ZB-V.
//
// Generators are pure functions of (pp, micro-batches, chunks) and return
// compute actions only (F, B, or I and W). lower() adds the SEND/RECV
// actions in an order that cannot deadlock; validate() checks a (lowered or
// not) schedule and, when it rejects one, names the failing action and draws
// the rank x step grid with it marked. One representation serves generation,
// lowering, validation, simulation, rendering and execution.
//
//   Schedule s = lower(one_f_one_b(4, 8));
//   ValidationResult v = validate(s);
//   if (!v.ok) fmt::print("{}\n", v.message);   // includes the grid
//   for (const Action& a : s.actions[rank]) ...  // the executor's loop
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace weft::sched {

enum class ActionKind : uint8_t {
  F,            // forward of (stage, micro-batch)
  B,            // full backward: I then W
  I,            // backward for the input (activation gradient)
  W,            // backward for the weights
  SEND_F,       // send stage's forward output to the next stage's rank
  RECV_F,       // receive stage's forward input from the previous stage's rank
  SEND_B,       // send stage's input gradient to the previous stage's rank
  RECV_B,       // receive stage's output gradient from the next stage's rank
  REDUCE_GRAD,  // data-parallel gradient reduction of a stage (micro_batch = -1)
  REDUCE_TIED,  // sum tied-weight gradients across the stages that hold a copy
  STEP,         // optimizer step (stage = -1, micro_batch = -1)
};

// F, B, I and W: the actions that compute (the others move or reduce tensors).
constexpr bool is_compute(ActionKind k) {
  return k == ActionKind::F || k == ActionKind::B || k == ActionKind::I || k == ActionKind::W;
}

// SEND_F, RECV_F, SEND_B and RECV_B: the actions that move a tensor between ranks.
constexpr bool is_p2p(ActionKind k) {
  return k == ActionKind::SEND_F || k == ActionKind::RECV_F || k == ActionKind::SEND_B ||
         k == ActionKind::RECV_B;
}

struct Action {
  ActionKind kind = ActionKind::F;
  int stage = 0;
  int micro_batch = 0;

  // "2F0", "1SEND_B3", "0REDUCE_GRAD", "STEP".
  std::string str() const;
  // Inverse of str(); throws weft::Error naming the text on bad input.
  static Action parse(std::string_view text);
  bool operator==(const Action&) const = default;
};

struct Schedule {
  std::string name;       // "gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", ...
  int pp = 1;             // pipeline ranks
  int chunks = 1;         // stages per rank (v)
  int micro_batches = 1;  // m
  std::vector<int> stage_rank;                // stage -> rank, size pp * chunks
  std::vector<std::vector<Action>> actions;   // per rank, in execution order

  int stages() const { return pp * chunks; }
};

// The frame every generator fills: name and sizes set, one empty action list
// per rank, stages placed round-robin (stage s on rank s % pp). Throws
// weft::Error, prefixed with the name, when pp or micro_batches is below 1.
Schedule empty_schedule(std::string name, int pp, int micro_batches, int chunks = 1);

// --- generators: compute actions only ---
Schedule gpipe(int pp, int micro_batches);
Schedule one_f_one_b(int pp, int micro_batches);
// Megatron's interleaved 1F1B: `chunks` model chunks per rank, round-robin.
Schedule interleaved_1f1b(int pp, int micro_batches, int chunks);
// Zero bubble H1 (split I/W, 1F1B's memory, about a third of its bubble).
Schedule zb_h1(int pp, int micro_batches);
// Zero bubble V (two chunks per rank in a V: rank r holds stages r and 2pp-1-r).
Schedule zb_v(int pp, int micro_batches);

// Names accepted by make_schedule, everywhere (weft-sched, train_gpt --schedule).
std::vector<std::string> schedule_names();
// By name; throws weft::Error naming the value and the rule (an unknown name,
// micro-batches fewer than the schedule needs, chunks a schedule does not
// support, ...). chunks is ignored by schedules with a fixed number.
Schedule make_schedule(const std::string& name, int pp, int micro_batches, int chunks = 1);
// Model chunks per rank (virtual stages): the count a schedule runs when
// none is asked for, as train_gpt --virtual-stages defaults it (2 for
// interleaved-1f1b and zb-v, 1 for the schedules that run one chunk per
// rank); and the rule a count breaks for a schedule ("zb-v runs exactly 2
// chunks per rank (its V shape)"), empty when it runs that count. Both throw
// weft::Error on an unknown name.
int default_chunks(const std::string& name);
std::string chunks_rule(const std::string& name, int chunks);

// --- lowering, validation, text ---
// Inserts SEND_F/RECV_F/SEND_B/RECV_B for every stage boundary that crosses
// ranks, placed so that the lowered schedule cannot deadlock when sends are
// non-blocking and receives block.
Schedule lower(const Schedule& compute);

struct ValidationResult {
  bool ok = true;
  int rank = -1;           // the failing action, when !ok
  int index = -1;
  std::string message;     // the rule broken, then the grid with "<-- ERROR HERE"
};
// Checks: every (stage, micro-batch) has exactly one F and either one B or
// one I and one W, on the rank that holds the stage; F(s, m) follows
// F(s-1, m); I/B(s, m) follows F(s, m) and I/B(s+1, m); W follows I; in a
// lowered schedule every SEND meets one RECV of the same tensor on the peer
// rank, in the same per-peer FIFO order, and executing it with blocking
// receives terminates (no deadlock).
ValidationResult validate(const Schedule& s);

// The rank x step grid, one row per rank: "rank 0: 0F0 0F1 ... ".
std::string render_grid(const Schedule& s, int mark_rank = -1, int mark_index = -1);
// The key to that grid: what "2F0" means, then one line for each action
// kind that appears in s ("F       forward", "SEND_F  send the stage's ...").
std::string render_legend(const Schedule& s);
// CSV: one line per rank, actions separated by commas. Round-trips.
std::string to_csv(const Schedule& s);
// Parses actions per rank; stage_rank, pp, chunks and micro-batches are
// inferred (pp = lines); throws weft::Error naming the line and cell.
Schedule from_csv(std::string_view csv, const std::string& name = "csv");

// The most micro-batches whose activations a rank holds at once, walking
// its actions in order: a (stage, micro-batch) counts from its F until both
// its input gradient (I, or B) and its weight gradient (W, or B) are done,
// since W still reads what F saved. GPipe: m; 1F1B: pp - rank (capped by m);
// ZB-H1 and ZB-V more than the count up to I alone, by the W they defer.
// With recompute, I runs W as well and ends it, unless the schedule splits
// the backward (folds_weights).
std::vector<int> peak_in_flight(const Schedule& s, bool recompute = false);

// Whether recompute folds W into I: with B actions only. A schedule that
// splits the backward (I and W actions: ZB-H1, ZB-V) keeps them apart, and
// its I replays a recomputed range into the slot, where its W finds it.
bool folds_weights(const Schedule& s, bool recompute);

// What one (stage, micro-batch) adds to its rank's memory, by action (bytes,
// as the executor's arenas count them). A rank's memory is the sum over its
// live (stage, micro-batch) slots; a slot is freed once its I and W are done
// and, when the previous stage is on another rank, its SEND_B has been
// posted.
struct StageBytes {
  double recv_f = 0;  // the stage's inputs from stage s-1: at RECV_F, or at F
                      // when s-1 is on the same rank (a copy) or the schedule
                      // is not lowered
  double f = 0;       // what F keeps (with recompute: only the outputs it sends)
  double recv_b = 0;  // the gradient of the stage's outputs: at RECV_B, or added
                      // by I of stage s+1 on the same rank, or at I when not lowered
  double i = 0;       // what I adds (with recompute, 0: see below)
  double w = 0;       // what W adds
  // With recompute, F and I run in one shared work area freed at the end of
  // the action: they add f_work and i_work for the action's duration only.
  // When stage s-1 is on another rank, I then keeps in the slot a copy of
  // the gradient it sends back (i_keep: recv_b of stage s-1, less what
  // already lives in the slot, a gradient relayed through the stage).
  double f_work = 0, i_work = 0, i_keep = 0;
  // With recompute over several ranges of a stage (Megatron's
  // --recompute-method), I replays them one after another: the most the
  // ranges above the stage's first held at once beyond i, before the edge's
  // gradients are placed. F's ranges are within f_work. What I adds to the
  // slot beyond the edge's gradients (gradients between ranges, the kept
  // ranges' backward) is i.
  double i_work_above = 0;
  bool operator==(const StageBytes&) const = default;
};

struct MemoryUse {
  std::vector<double> peak;                // per rank: the most bytes held at once
  std::vector<int> peak_slots;             // per rank: the most slots alive at once
  std::vector<std::vector<double>> held;   // per rank, parallel to its actions: bytes after each
};

// Plays each rank's actions in order against `bytes` (one per stage). A
// rank's memory changes only through its own actions, so this needs no
// timing: it is what the executor measures, exactly. With `receives_ahead`
// (PipelineOptions::post_receives_ahead), a receive's tensors are taken
// before the compute action that precedes it. `recompute` folds W into I
// where folds_weights says so; the transients (f_work, i_work, i_work_above)
// count whenever `bytes` has them. Throws weft::Error when `bytes` does not have one
// entry per stage or holds a negative or non-finite number.
MemoryUse memory_use(const Schedule& s, const std::vector<StageBytes>& bytes,
                     bool recompute = false, bool receives_ahead = false);

// --- point-to-point steps ---
// A rank's p2p steps: each maximal run of consecutive sends and receives in
// its action list, as [begin, end) indices. The executor posts one step's
// messages as a group (Communicator::group_start/group_end) and waits for its
// receives only after the group is closed, so that a transport which starts a
// group's sends and receives together (NCCL) never has one of them wait
// behind another of the same step.
struct P2pStep {
  size_t begin = 0, end = 0;
  bool operator==(const P2pStep&) const = default;
};
std::vector<P2pStep> p2p_steps(const std::vector<Action>& actions);

// Whether a lowered schedule completes when every p2p step is a rendezvous,
// as on NCCL: a rank's steps run one after another on its communication
// stream, a message moves only while the sender's and the receiver's steps
// holding it are both running, and a step ends when all its messages have
// moved. (Host transports buffer sends, so any valid lowered schedule runs on
// them.) Pairs of ranks match messages in order, as validate() checks.
// Returns "" when every rank finishes, else the steps the ranks are stuck in:
// "rank 0 stuck in step 3 (1SEND_F2 ...), rank 1 ...".
std::string check_grouped_p2p(const Schedule& s);

}  // namespace weft::sched
