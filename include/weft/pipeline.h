// weft/pipeline.h — running one rank's share of a pipeline schedule.
//
// The PipelineExecutor is the one place where compute meets communication:
// a loop over this rank's actions of a lowered schedule (weft/schedule.h),
// calling the runner for F/B/I/W and the communicator for SEND/RECV. Each
// run of consecutive sends and receives (a p2p step, sched::p2p_steps) is
// posted as one group (Communicator::group_start/group_end), and its
// receives are waited for when the group closes, before the next compute.
//
// Stage s runs the graph nodes plan.begin[s] .. plan.begin[s+1]. Its boundary
// is every value produced up to its end and read after it, so a stage
// boundary may carry several tensors and a value that skips stages is relayed
// through them. Each (stage, micro-batch) gets a slot: a MicroBatch (values,
// gradients, layer contexts, arena) holding its own copies of its inputs; the
// slot returns to a pool as soon as its backward (I and W) is done and its
// sends have completed. Slots are reused, so steady-state steps allocate
// nothing. With recompute, F keeps only what crosses the edges of the
// recomputed ranges of nodes (whole stages, or groups of blocks) and replays
// each range's forward right before its backward. Without a pipeline (pp 1)
// the whole graph is one stage on a group of one: every layout runs this
// executor.
#pragma once

#include <weft/communicator.h>
#include <weft/grad_sync.h>
#include <weft/graph.h>
#include <weft/partition.h>
#include <weft/runner.h>
#include <weft/schedule.h>
#include <weft/trainer.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace weft {

class SpanTimer;  // weft/profile.h

// Megatron's --recompute-method, over transformer blocks (the nodes named
// h.<i>, as the uniform partition counts them).
enum class RecomputeMethod : uint8_t { None, Uniform, Block };

struct PipelineOptions {
  // Whole stages (--recompute): F keeps only the stage's inputs and the
  // outputs it sends, and replays the stage's forward right before its
  // backward.
  bool recompute = false;
  // Record every action's start and end (for write_trace); off, a step
  // records only its compute time.
  bool trace = false;
  // Post each receive before the compute action that precedes it (Megatron's
  // --overlap-p2p-comm), so the message arrives while that action computes;
  // off, a receive is posted when its action comes and waited for at once.
  // Off by default: on the 2-core machine it measured no faster
  // (bench/p2p_overlap.sh, docs/pipeline-schedules.md).
  bool post_receives_ahead = false;
  // Where activations, received tensors and gradients live (the parameters'
  // device). Tokens are filled on the host and copied up. Device tensors
  // need a communicator that carries them (HostStagedCommunicator).
  Device device = Device::cpu();
  // Megatron's --recompute-granularity full over blocks: F drops the
  // activations of each recomputed range of blocks once the range is done,
  // keeping what its later nodes read, and B replays the range's forward
  // from its inputs before the range's backward, so that one range's
  // activations are alive at a time instead of the stage's. Uniform: each
  // stage's blocks in groups of `recompute_layers`, each group one range.
  // Block: the first `recompute_layers` blocks of each stage, each its own
  // range; the rest keep their activations. Nodes outside blocks (the
  // embedding, the head) are never recomputed. Either way W runs with I,
  // as with whole stages.
  RecomputeMethod recompute_method = RecomputeMethod::None;
  int recompute_layers = 1;
  // Megatron's --recompute-granularity selective: each attention node (kind
  // "attention") is a recomputed range of its own. F keeps its output and
  // drops what it saved; the backward replays it from qkv. The unfused
  // attention's (B, H, T, T) probabilities are then never held from a
  // micro-batch's forward to its backward; the fused one keeps only (B, H, T)
  // anyway.
  bool recompute_core_attention = false;
  bool recomputes() const {
    return recompute || recompute_method != RecomputeMethod::None || recompute_core_attention;
  }
};

// One action as it ran: microseconds since the pipeline's common start.
struct ActionSpan {
  int64_t step = 0;
  sched::Action action;
  int64_t start_us = 0, end_us = 0;
};

class PipelineExecutor {
 public:
  // `graph` is this rank's copy of the whole model (parameters of stages on
  // other ranks are simply never used); `schedule` must be lowered; `pp` is
  // the pipeline group (rank r runs schedule.actions[r]).
  PipelineExecutor(const Graph& graph, ModelIO io, StagePlan plan, sched::Schedule schedule,
                   Communicator& pp, PipelineOptions options = {});
  ~PipelineExecutor();

  // Runs every action of this rank for the schedule's micro-batches of one
  // step: parameter gradients accumulate into Param::grad (zeroed first), and
  // tied parameters held by several ranks get their gradients summed. The
  // loss is seeded with 1 / (global_batch x the model's terms per sample)
  // (global_batch 0: this pipeline's micro-batches make the whole batch, as
  // without data parallelism). The last stage's micro-batch losses (each the
  // sum of its terms) are left in losses(), where the model ran, and
  // loss_order() says in which order their forwards ran; the Trainer reads
  // and adds them. `at_end`, when given, runs after the last action and the
  // tied sums: the Trainer sends its last gradient buckets there. With
  // `measure`, the ranks' busy time and span are gathered at the end
  // (bubble_fraction; on a GPU the host waits for the device's timings);
  // without it, nothing in run waits for a GPU or for the other ranks' hosts.
  void run(const BatchSource& data, int64_t step, int64_t micro_batch, int64_t global_batch = 0,
           const std::function<void()>& at_end = {}, bool measure = true);
  // This rank's micro-batch losses of the last run, indexed by micro-batch
  // (undefined without the last stage), and the micro-batches in the order
  // their forwards ran (empty without the last stage).
  const Tensor& losses() const { return losses_; }
  const std::vector<int>& loss_order() const { return loss_order_; }
  // The last run's loss terms, over the whole global batch: the mean's
  // denominator (BatchSource::loss_terms, or global batch x terms per sample).
  int64_t loss_terms() const { return loss_terms_; }
  // fp16's loss scale: the seed above is multiplied by it (the Trainer
  // unscales the gradients). 1 unless set.
  void set_loss_scale(float scale) { loss_scale_ = scale; }

  // Parameters this rank updates (GradSync takes the norm over the whole
  // model, counting each parameter once).
  const std::vector<Param*>& params() const { return params_; }
  // Of params(): the ones this rank counts in a norm (their first holder),
  // and the ones tied with another pipeline rank (summed at the end of run).
  const std::vector<Param*>& norm_params() const { return norm_params_; }
  std::vector<Param*> tied_params() const;
  // The graph nodes of this rank's stages.
  std::vector<int> local_nodes() const;
  Communicator& group() const { return pp_; }
  int micro_batches() const { return schedule_.micro_batches; }
  // Told of every node's W action (data-parallel buckets start from it).
  void set_grad_sync(GradSync* sync) { sync_ = sync; }

  // The most micro-batch stages whose activations were held at once during
  // the last run (from F until both I and W are done, as
  // sched::peak_in_flight counts them).
  int peak_stashed() const { return peak_stashed_; }
  // The most (stage, micro-batch) slots alive at once; a slot lives from its
  // RECV_F or F until its I and W are done and its SEND_B is posted.
  int peak_slots() const { return peak_slots_; }
  // Times the slots' arenas (and recompute's work area) took memory from
  // the system: steady steps add none.
  size_t arena_allocations() const;
  // The most arena bytes the live slots (and, with recompute, the work area)
  // held at once during the last run: what sched::memory_use predicts from
  // stage_bytes(). A slot whose sends are still in flight when it is freed
  // keeps its arena until they complete; that is not counted.
  double peak_bytes() const { return peak_bytes_; }
  // Per stage (zeros for other ranks' stages): the bytes each action of this
  // rank's stages added to its slot in the last run (sched::StageBytes).
  const std::vector<sched::StageBytes>& stage_bytes() const { return stage_bytes_; }
  const std::vector<int>& local_stages() const { return local_stages_; }

  // Idle share of all pipeline ranks' time during the last run: 1 - (compute
  // time summed over ranks) / (ranks x the longest rank's span), gathered at
  // the end of run(); -1 when that run did not measure.
  double bubble_fraction() const { return bubble_; }
  // Chrome trace JSON of every recorded action on every rank (one track per
  // rank, arrows from each send to its receive), written by pipeline rank 0.
  // Collective over the pipeline group; needs PipelineOptions::trace.
  void write_trace(const std::string& path) const;

 private:
  struct Slot;
  struct Boundary;
  // A range of one stage's nodes run together: recomputed ones run in the
  // work area (weft/pipeline.h's PipelineOptions).
  struct Unit {
    int begin = 0, end = 0;
    bool recompute = false;
    std::vector<int> ins;   // values its nodes read that come from before it
    std::vector<int> outs;  // values it makes that later nodes read
  };
  std::vector<Unit> make_units(int begin, int end) const;
  std::vector<std::vector<Unit>> units_;  // per stage
  int loss_node_ = -1;                    // the node that makes the loss
  bool fold_ = false;                     // recompute folds W into I (sched::folds_weights)
  Slot& slot(int stage, int micro_batch, bool create);
  void release_if_done(int stage, int micro_batch);
  static bool sends_done(Slot& s);
  void forward_action(int stage, int mb, int64_t step);
  // forward(graph_, m, begin, end); with sharded parameters node by node,
  // each after the gather of its parameters (the next one's posted ahead).
  void forward_nodes(MicroBatch& m, int begin, int end);
  void backward_input_action(int stage, int mb, bool with_weights = false);
  void backward_weight_action(int stage, int mb);
  void fill_inputs(Slot& s, int stage, int mb, int64_t step);
  void reduce_tied();
  void set_step(int64_t step, size_t index, const sched::Action& a);
  void note_memory();
  void backward_part_done(Slot& s);
  void post_receive(const sched::Action& a, size_t i);
  void post_receives_after(size_t i);
  void end_p2p_step(const sched::P2pStep& st, int64_t step, size_t last);

  const Graph& graph_;
  ModelIO io_;
  StagePlan plan_;
  sched::Schedule schedule_;
  Communicator& pp_;
  PipelineOptions options_;
  std::vector<Boundary> boundary_;  // per stage: values it sends forward
  std::vector<int> local_stages_;
  std::vector<Param*> params_;
  std::vector<Param*> norm_params_;  // params whose norm this rank counts
  struct Tied;
  std::vector<Tied> tied_;
  std::vector<std::unique_ptr<Slot>> pool_;
  std::vector<Slot*> live_;  // indexed by stage * m + micro_batch
  const BatchSource* data_ = nullptr;
  GradSync* sync_ = nullptr;
  int64_t micro_batch_size_ = 0, step_ = 0, global_batch_ = 0, loss_terms_ = 1;
  float loss_scale_ = 1.0f;
  std::vector<Tensor> inputs_;       // the data inputs being filled, reused
  std::vector<Tensor> host_inputs_;  // on a device: filled here, then copied up
  // The last stage's micro-batch losses, gathered where the model runs (no
  // wait for a GPU inside run).
  Tensor losses_;
  std::vector<int> loss_order_;  // the micro-batches in the order their forwards ran
  int peak_slots_ = 0, slots_in_use_ = 0;
  int peak_stashed_ = 0, stashed_ = 0;
  double peak_bytes_ = 0;
  std::vector<sched::StageBytes> stage_bytes_;
  // Per action of this rank's list: whether its receive is posted, and its requests.
  std::vector<sched::P2pStep> p2p_steps_;  // of this rank's actions
  std::vector<bool> posted_;
  std::vector<std::vector<RequestPtr>> receives_;
  Tensor step_stats_, all_step_stats_;  // (busy, span): this rank's, and every rank's
  double bubble_ = 0;
  // Clocks: each rank's zero is taken right after a barrier at construction.
  std::chrono::steady_clock::time_point epoch_;
  double busy_s_ = 0, span_s_ = 0;  // last run
  std::vector<ActionSpan> spans_;
  // On a GPU: CUDA events around each action (span 0 the run's start, then
  // one per action, then its end), so that busy time and the compute
  // actions' trace spans are the device's, not the host's launching.
  std::shared_ptr<SpanTimer> device_timer_;
  std::unique_ptr<MicroBatch> work_;  // with recompute: where a range's activations live
};

// The one-process form of a pipeline: the whole graph as one stage (its
// cost and memory by `cost`), and 1F1B over one rank (each micro-batch's
// forward, then its backward). The Trainer runs a model without a pipeline
// this way, and RankLayout at pp 1.
StagePlan whole_graph_plan(const Graph& graph, const CostModel& cost);
sched::Schedule one_stage_schedule(int micro_batches);

// What each action of each stage of `plan` adds to memory (its slot's arena
// bytes), measured by running every stage on this process for one
// micro-batch: F for stages 0..S-1, then B for S-1..0, with no schedule and no
// messages. sched::memory_use composes these into any schedule's memory per
// rank, which the executor then holds exactly. Leaves the parameters as they
// were; their gradients hold one micro-batch's (zero them before a step, as
// every step does). `options` says how activations are recomputed and
// where the stages run (options.device), where every parameter must be.
// With `split_backward`, each B is I then W, as the zero-bubble schedules
// run them (which changes what recompute holds: sched::folds_weights); the
// bytes without recompute are the same either way.
std::vector<sched::StageBytes> measure_stage_bytes(const Graph& graph, const ModelIO& io,
                                                   StagePlan plan, const BatchSource& data,
                                                   int64_t micro_batch,
                                                   const PipelineOptions& options = {},
                                                   bool split_backward = false);

}  // namespace weft
