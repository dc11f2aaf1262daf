// weft/trainer.h — the single-process training loop for a language-model graph.
//
// One step reads the global batch in docs/design.md's order, runs it as
// global/micro micro-batches (forward, then backward, gradients accumulating),
// takes the mean loss over all its tokens, clips by global norm and applies
// AdamW. It allocates nothing after the first step.
#pragma once

#include <weft/checkpoint.h>
#include <weft/data.h>
#include <weft/grad_sync.h>
#include <weft/graph.h>
#include <weft/optimizer.h>
#include <weft/runner.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <set>
#include <span>
#include <string>

namespace weft {

class PipelineExecutor;
class PsWorker;

// A model to train, in any layout: a graph, the inputs a BatchSource fills,
// and the loss. Any graph whose loss is a one-element output trains with any
// (dp, pp, tp, schedule) through the same Trainer, partitioner and executor.
//
//   ModelIO io{&graph, {tokens, targets}, loss, /*terms_per_sample=*/T};
struct ModelIO {
  Graph* graph = nullptr;
  // Graph inputs, filled by the BatchSource in this order for each
  // micro-batch; each has the micro-batch size as its first dimension. Every
  // graph input must be here (an input nothing fills is an error).
  std::vector<int> inputs;
  // Output (1): the SUM of the micro-batch's loss terms.
  int loss = -1;
  // Loss terms per sample (tokens per sequence for a language model; 1 for a
  // per-sample loss). The step's loss is the mean over the global batch's
  // terms, and the gradients are that mean's, however the batch is split.
  int64_t terms_per_sample = 1;
};

// Checks `io` against its graph; throws Error naming what is wrong: no loss,
// a loss that is not one element, an input that is not a graph input, a
// graph input nothing fills, a first dimension that is not the micro-batch.
void check_model_io(const ModelIO& io, int64_t micro_batch);

// Where the samples of each global batch come from.
class BatchSource {
 public:
  virtual ~BatchSource() = default;
  // Fills samples [index, index + count) of the global batch of `step`, where
  // count is the first dimension of every tensor of `inputs` (host tensors,
  // in ModelIO::inputs order).
  virtual void fill(int64_t step, int64_t index, std::span<const Tensor> inputs) const = 0;
  // The loss terms of `step`'s whole global batch where some targets are
  // kIgnoredTarget (weft/targets.h): the step's loss, and the gradients, are
  // the mean over these, on every layout. -1, the default: every term
  // counts (global batch x ModelIO::terms_per_sample).
  virtual int64_t loss_terms(int64_t /*step*/) const { return -1; }
};

// Documents in a token stream (Megatron's flags): the token `eod` ends a
// document, and belongs to it.
struct DocumentOptions {
  int32_t eod = -1;
  // --eod-mask-loss: a target whose input token is eod (the next document's
  // first token) is kIgnoredTarget (weft/targets.h), no loss term.
  bool eod_mask_loss = false;
  // --reset-position-ids / --reset-attention-mask: a third input, each
  // token's position within its document (0 after each eod), which the
  // model reads for its position embedding and/or its attention mask.
  bool reset_position_ids = false;
  bool reset_attention_mask = false;
  bool positions() const { return reset_position_ids || reset_attention_mask; }
  bool any() const { return eod_mask_loss || positions(); }
};

// Token batches: the run's sequence k (k = step * G + index) is the window
// a WindowOrder (weft/data.h) names. Fills two inputs: tokens and targets,
// (count, T) int32 each; and with DocumentOptions::positions(), a third:
// each token's position within its document.
class TokenBatches final : public BatchSource {
 public:
  // With vocab > 0, a token outside [0, vocab) stops the run naming it.
  TokenBatches(std::shared_ptr<const WindowOrder> order, int64_t global_batch, int64_t vocab = 0);
  // One dataset in file order; with num_windows > 0, only windows
  // [first_window, first_window + num_windows): a train or validation split.
  TokenBatches(const TokenData& data, int64_t global_batch, int64_t seq_len,
               int64_t first_window = 0, int64_t num_windows = 0);
  void fill(int64_t step, int64_t index, std::span<const Tensor> inputs) const override;
  // With eod_mask_loss: the global batch's tokens that are not eod (read
  // once a step, on every rank alike); else -1.
  int64_t loss_terms(int64_t step) const override;
  const WindowOrder& order() const { return *order_; }
  // Throws Error for an eod outside [0, vocab) when documents are asked for.
  void set_documents(const DocumentOptions& docs);
  const DocumentOptions& documents() const { return docs_; }

 private:
  std::shared_ptr<const WindowOrder> order_;
  int64_t global_batch_;
  int64_t vocab_ = 0;
  DocumentOptions docs_;
  // loss_terms' last step and count, and the global batch it read.
  mutable std::mutex terms_mu_;
  mutable int64_t terms_step_ = -1, terms_ = 0;
  mutable std::vector<int32_t> terms_tokens_, terms_targets_;
};

// Each token's position within its document: 0 at a sequence's start and
// after each eod, else one more than the token before. tokens and positions
// are `count` sequences of `t`.
void document_positions(const int32_t* tokens, int32_t* positions, int64_t count, int64_t t,
                        int32_t eod);

struct TrainOptions {
  int64_t micro_batch = 1;   // sequences per micro-batch (the graph's B)
  int64_t global_batch = 1;  // sequences per step
  LrSchedule lr;
  AdamWConfig adam;
  double clip_grad = 1.0;  // 0 disables
  // How long the ranks wait at a save for the writer (world rank 0) to
  // finish, in seconds; past it they stop with an error naming the save
  // (train_gpt's --save-timeout). 0: no deadline.
  double save_timeout_s = 0;
  // Megatron's --async-save: save() returns once each rank's slices are
  // copied to the host, and each rank writes its own on a thread while
  // training goes on; wait_for_saves() waits for them.
  bool async_save = false;
  // A step whose loss is above this stops training (train_step or
  // take_records throws naming the step), as a non-finite one does: a
  // bound known before training (train_gpt: 4 x ln(vocabulary), four times
  // a uniform guess's loss). 0 disables.
  double max_loss = 0;
  nlohmann::json config;   // recorded in checkpoints
  // Where parameters, activations, gradients and optimizer state live; the
  // layers run that device's kernels (weft/ops.h). Parameters are placed
  // there when the Trainer is made. A GPU runs one process for now.
  Device device = Device::cpu();
  // Megatron's --check-for-spiky-loss: a step whose loss exceeds `factor`
  // times the mean of the last `window` updated steps' losses updates nothing
  // (its gradients are dropped; its data is consumed). Past `max_skipped`
  // such steps, train_step throws. Checked once `window` losses are known.
  struct SpikeCheck {
    bool enabled = false;
    double factor = 10.0;
    int64_t max_skipped = 10;
    int64_t window = 10;
  } spike;
  // Local SGD and DiLoCo (--local-steps H): each data-parallel replica
  // updates alone from its own gradients, which are not reduced; after every
  // H steps the replicas' parameters, and their optimizer states, are
  // averaged. With `nesterov` (DiLoCo's
  // outer optimizer), the average is not taken as it is: the outer gradient
  // delta = start - average (start: the parameters the H steps began from)
  // takes a Nesterov step, buf = momentum buf + delta,
  // parameters = start - outer_lr (delta + momentum buf). steps = 0: off
  // (gradients are reduced every step).
  // --fp16's loss scaling (Megatron's DynamicGradScaler and flags): the
  // loss's seed gradient is multiplied by the scale, so that small gradients
  // survive fp16 GEMM inputs, and the gradients are divided by it before the
  // norm, clipping and the optimizer. A step whose (global) gradient norm is
  // not finite overflowed: it updates nothing (parameters, optimizer state
  // and Adam's step count stay; its data is consumed), and each overflow
  // after the first `hysteresis` - 1 since the scale last grew halves the
  // scale, never below `min`. After `window` steps in a row without overflow
  // the scale doubles. With `fixed` > 0 (--loss-scale) the scale is that
  // number and never changes; overflowing steps are still skipped.
  struct LossScale {
    bool enabled = false;
    double fixed = 0;
    double initial = 4294967296.0;  // 2^32
    double min = 1.0;
    int64_t window = 1000;
    int64_t hysteresis = 2;
  } loss_scale;
  struct LocalSgd {
    int64_t steps = 0;
    bool nesterov = false;
    float outer_lr = 0.7f;
    float outer_momentum = 0.9f;
  } local;
};

struct StepRecord {
  int64_t step = 0;    // 0-based index of the step just taken
  double loss = 0;     // mean over the global batch, before the update
  double lr = 0;
  double grad_norm = 0;  // before clipping
  double step_ms = 0;
  double tokens_per_s = 0;
  double bubble_frac = -1;  // pipeline idle share of the step; -1 on one process
  double dp_wait_ms = -1;   // data-parallel reduction not hidden by the backward; -1 without dp
  // This rank's share of the data-parallel bytes of the step (a ring
  // all-reduce sends 2 (dp - 1) / dp of its buffer): the gradients', or local
  // SGD's averages; -1 without dp.
  double dp_bytes = -1;
  double ps_wait_ms = -1;     // parameter servers: from the push until the parameters were back
  int64_t ps_staleness = -1;  // parameter servers: of this worker's update (PsStep)
  bool skipped = false;     // the update was not applied: a loss spike, or an overflow
  double spike_mean = 0;    // a loss spike: the recent mean it was compared with
  // --fp16: the loss scale this step's gradients were computed with (0:
  // no scaling), and whether they overflowed (the step is then skipped).
  double loss_scale = 0;
  bool overflow = false;
  double next_loss_scale = 0;  // the scale after this step's update of it

  nlohmann::json json() const;
  std::string line(int64_t train_iters) const;  // the one-line human log
};

// This rank's place in a dp x pp x tp layout (weft/mesh.h).
struct Parallel {
  ParallelGroups groups;                  // null members are groups of one
  PipelineExecutor* pipeline = nullptr;   // runs this rank's stages when pp > 1
  GradSyncOptions sync;
  // A parameter-server worker (weft/param_server.h): gradients go to the
  // servers, which update the parameters; nothing is reduced over dp.
  PsWorker* ps = nullptr;
};

// Replica r of a data-parallel group reads sequences
// [r * G / dp, (r + 1) * G / dp) of each global batch of G sequences.
class ReplicaBatches final : public BatchSource {
 public:
  ReplicaBatches(const BatchSource& all, int64_t offset) : all_(all), offset_(offset) {}
  void fill(int64_t step, int64_t index, std::span<const Tensor> inputs) const override {
    all_.fill(step, offset_ + index, inputs);
  }
  int64_t loss_terms(int64_t step) const override { return all_.loss_terms(step); }

 private:
  const BatchSource& all_;
  int64_t offset_;
};

class Trainer {
 public:
  // `g` is the graph this rank runs: the model, or its tensor-parallel form
  // (weft/tensor_parallel.h) when par.groups.tp has more than one rank. With a
  // pipeline, the executor runs this rank's stages and the optimizer updates
  // their parameters. Every layout takes the same steps as one process.
  Trainer(ModelIO g, const BatchSource& data, TrainOptions opt, Parallel par = {});
  // One pipeline rank (pp only).
  Trainer(ModelIO g, const BatchSource& data, TrainOptions opt, PipelineExecutor& pipeline);
  ~Trainer();

  // Runs one step and reads its loss and gradient norm; throws Error naming
  // the step when either is not finite. Launched steps whose records were
  // not taken are an error (take_records first).
  StepRecord train_step();
  // Queues one step and returns once the host has queued its work. On a GPU
  // the loss, the gradient norm and the clip's coefficient stay on the
  // device and the update reads the coefficient there, so with NCCL (or one
  // process) the host waits for the device nowhere in the step: it runs
  // ahead, as PyTorch's does until loss.item(). The step's record comes from
  // take_records(). With `measure`, the pipeline's bubble is measured (a
  // wait for the device's timings). Where the host must decide on the
  // values before the update (the CPU, loss scaling, the loss-spike check,
  // parameter servers, local SGD), they are read within the step, as
  // train_step does.
  void launch_step(bool measure = false);
  // The records of the launched steps not yet taken, in step order: their
  // values are read in one copy (on a GPU, the one wait) and summed over the
  // groups in one collective each. A deferred step's step_ms is the mean
  // over the steps read together (from the first one's launch to the read).
  // Throws Error naming the first step whose loss or norm is not finite.
  // Collective. The list is the Trainer's, valid until the next call (a
  // steady step allocates nothing).
  const std::vector<StepRecord>& take_records();
  // Steps launched whose records are not taken yet.
  int64_t launched() const { return launched_; }
  // Forward and backward of one global batch without an update: the mean loss,
  // with each parameter's grad holding d(mean loss)/d(param), times the loss
  // scale under TrainOptions::loss_scale (train_step divides it out).
  double compute_gradients(int64_t step);
  // The mean loss over `iters` global batches of `data` (batch k for k = 0 ..
  // iters - 1), on every layout, without reducing gradients or touching the
  // optimizer: training continues as if it had not run. Collective.
  double evaluate(const BatchSource& data, int64_t iters);

  int64_t steps_done() const { return steps_done_; }
  GradSync& grad_sync() { return *sync_; }
  const std::vector<Param*>& params() const { return sync_->params(); }
  // The executor that runs this rank's stages: the pipeline's, or without
  // one the Trainer's own, which runs the whole graph as one stage (each
  // micro-batch's forward, then its backward: 1F1B on one rank).
  PipelineExecutor& pipeline() { return *par_.pipeline; }
  // Micro-batches of micro_batch sequences each replica runs per step.
  // The loss-spike check's state (recent losses, steps skipped), kept in
  // checkpoints so that a resumed run decides as the uninterrupted one would.
  nlohmann::json spike_state() const;
  void set_spike_state(const nlohmann::json& state);
  // The loss scaler's state (scale, clean steps since it last changed,
  // overflows left before it halves), in checkpoints for a bit-exact resume.
  nlohmann::json loss_scale_state() const;
  void set_loss_scale_state(const nlohmann::json& state);
  double loss_scale() const { return scale_; }
  int64_t micro_batches() const { return micro_batches_; }

  // Collective over every rank: a checkpoint that any other layout can load
  // (weft/checkpoint.h). Every rank writes the slices it holds; world rank 0
  // completes the folder, then keeps only the newest `keep_last` (0: all).
  // The ranks wait for the writers without the communicators' deadline.
  // With TrainOptions::async_save, the writing goes on after save()
  // returns: a save, or wait_for_saves(), first waits for the one before it,
  // and throws what went wrong in it.
  void save(const std::string& dir, int64_t keep_last = 0);
  // Sets the weights from a safetensors file (weft/checkpoint.h's
  // load_weights: --init-from); with sharded parameters each replica keeps
  // only its slices of what it reads.
  void load_weights(const std::string& path);
  // Collective: returns once every save started is on disk (a no-op
  // without async_save beyond the check for an earlier failure).
  void wait_for_saves();
  // How long the last save() held this rank's training, in milliseconds.
  double last_save_stall_ms() const { return save_stall_ms_; }
  // Collective: every rank reads its own pieces of the newest checkpoint in
  // `dir` that verifies, or of the one iter_N folder `dir` names
  // (weft/checkpoint.h); returns which one, the newer ones it skipped, and
  // the bytes this rank read. The ranks agree: a slice that fails its
  // checksum on any rank sends every rank to the next older folder (or,
  // `dir` naming one folder, stops them all naming it). `weights_only`: the
  // parameters alone (a fine-tune's start), the step and optimizer untouched.
  CheckpointSource load(const std::string& dir, bool allow_unverified = false,
                        bool weights_only = false);

 private:
  // The writer's thread, joined (rethrowing its failure) before the next save.
  void join_writer();
  // Every rank waits for the writer of step `step`, within --save-timeout.
  void await_writer(const std::string& dir, int64_t step);
  // This rank's place among the writers of a save.
  SaveRank save_rank() const;
  // Reads this rank's state from one opened checkpoint (load's body).
  void read_checkpoint(const Checkpoint& c, bool weights_only);
  // Whether any rank of the job says yes (a collective over tp, pp and dp).
  bool any_rank(bool yes);
  // A barrier of every rank (each group in turn).
  void barrier_all();
  std::thread writer_;
  std::exception_ptr writer_error_;
  int64_t writing_step_ = -1;
  std::string writing_dir_;
  double save_stall_ms_ = 0;

  ModelIO g_;
  TrainOptions opt_;
  Parallel par_;
  int64_t micro_batches_ = 0;
  double run_batch(const BatchSource& data, int64_t step);  // compute_gradients on `data`
  // Forward and backward of one batch; the micro-batch loss sums go to
  // `losses` (micro_batches_ F32 on the device; a pipeline's last stage
  // only), `order` the order to add them in.
  // Returns the step's loss terms (PipelineExecutor::loss_terms).
  double run_batch_into(const BatchSource& data, int64_t step, const Tensor& losses,
                        std::vector<int>& order, bool measure);
  void mean_losses(std::span<const float* const> rows,
                   std::span<const std::vector<int>* const> orders, std::span<const double> terms,
                   std::span<double> out);
  // A launched step: its record, and what reading its values needs.
  struct Launched {
    StepRecord record;
    std::vector<int> loss_order;  // this rank's micro-batch losses, in the order to add them
    double terms = 0;             // the step's loss terms (BatchSource::loss_terms)
    std::chrono::steady_clock::time_point start;
  };
  std::vector<Launched> launches_;
  int64_t launched_ = 0;
  std::vector<StepRecord> taken_;
  // The first launched_ entries are this list's (entries are reused, so
  // their buffers stay); the last unread_ of them have their values on the device only, in
  // rows 0 .. unread_ - 1 of values_: each row micro_batches_ loss sums, then
  // the squared gradient norm. A full ring is read before the next launch.
  static constexpr int64_t kRows = 64;
  int64_t unread_ = 0;
  Tensor values_, host_values_;
  Tensor coef_;                          // the clip's coefficient, on the device
  Tensor scratch_values_, scratch_host_;  // run_batch's row (evaluation)
  Tensor loss_sums_;                     // mean_losses' host buffer for the collectives
  std::vector<const float*> rows_;
  std::vector<const std::vector<int>*> orders_;
  std::vector<double> terms_;
  std::vector<double> read_losses_;
  bool host_decides() const;
  Tensor row_losses(int64_t row) const;
  Tensor row_norm(int64_t row) const;
  void read_values();
  void check_finite(const StepRecord& r) const;
  ReplicaBatches data_;
  // Without a pipeline: a group of one, and the one-stage executor over it.
  std::unique_ptr<Communicator> self_;
  std::unique_ptr<PipelineExecutor> own_pipeline_;
  bool pipelined() const;  // more than one pipeline rank
  std::unique_ptr<GradSync> sync_;
  int64_t steps_done_ = 0;
  std::set<const Param*> owned_;  // counted and saved by this rank (its pipeline share)
  Tensor scalar_;
  void exchange_with_servers(StepRecord& r, std::chrono::steady_clock::time_point t0);
  double average_replicas();  // local SGD's synchronisation; returns its bytes (as dp_bytes)
  bool local() const { return opt_.local.steps > 0; }
  // Local SGD's averages travel as deltas, rounded or low-rank.
  bool compressed_averages() const {
    return local() && (par_.sync.reduce_dtype != DType::F32 ||
                       par_.sync.compression != GradCompression::None);
  }
  std::vector<Tensor> outer_start_, outer_buf_;  // DiLoCo: the period's start, the momentum
  Bf16Tables bf16_tables_;  // --bf16: the weights' copies, one launch on a GPU (run_batch)
  // Local SGD's x dp, loss scaling's 1 / scale, on what the update reads (one
  // launch on a GPU).
  void scale_grads(float s);
  std::deque<double> recent_losses_;  // the loss-spike check's window (updated steps only)
  int64_t skipped_ = 0;               // steps whose update a loss spike skipped
  bool scaling() const { return opt_.loss_scale.enabled; }
  void update_loss_scale(bool overflow);
  double scale_ = 1;             // the loss scale (1 without --fp16)
  int64_t growth_tracker_ = 0;   // clean steps since the scale last changed or overflowed
  int64_t hysteresis_left_ = 0;  // overflows left before the scale halves
};

}  // namespace weft
