// weft/trainer.h — the single-process training loop for a language-model graph.
//
// One step reads the global batch in DESIGN.md's order, runs it as
// global/micro micro-batches (forward, then backward, gradients accumulating),
// takes the mean loss over all its tokens, clips by global norm and applies
// AdamW. It allocates nothing after the first step.
#pragma once

#include <weft/checkpoint.h>
#include <weft/data.h>
#include <weft/graph.h>
#include <weft/optimizer.h>
#include <weft/runner.h>

#include <nlohmann/json.hpp>

#include <memory>
#include <string>

namespace weft {

class PipelineExecutor;

// Where a language-model graph takes its data and gives its loss.
struct LmGraph {
  Graph* graph = nullptr;
  int tokens = -1;   // input (B, T) int32
  int targets = -1;  // input (B, T) int32
  int loss = -1;     // output (1): the sum of token losses of the micro-batch
};

// Where the sequences of each global batch come from.
class BatchSource {
 public:
  virtual ~BatchSource() = default;
  // Fills `count` sequences (inputs and targets, count*seq_len each) starting
  // at position `index` of the global batch of `step`.
  virtual void fill(int64_t step, int64_t index, int64_t count, int64_t seq_len, int32_t* inputs,
                    int32_t* targets) const = 0;
};

// DESIGN.md's order over a token file: step s reads windows s*G .. s*G+G-1.
class TokenBatches final : public BatchSource {
 public:
  TokenBatches(const TokenData& data, int64_t global_batch, int64_t seq_len);
  void fill(int64_t step, int64_t index, int64_t count, int64_t seq_len, int32_t* inputs,
            int32_t* targets) const override;

 private:
  const TokenData& data_;
  int64_t global_batch_;
};

struct TrainOptions {
  int64_t micro_batch = 1;   // sequences per micro-batch (the graph's B)
  int64_t global_batch = 1;  // sequences per step
  int64_t seq_length = 0;    // the graph's T
  LrSchedule lr;
  AdamWConfig adam;
  double clip_grad = 1.0;  // 0 disables
  nlohmann::json config;   // recorded in checkpoints
};

struct StepRecord {
  int64_t step = 0;    // 0-based index of the step just taken
  double loss = 0;     // mean over the global batch, before the update
  double lr = 0;
  double grad_norm = 0;  // before clipping
  double step_ms = 0;
  double tokens_per_s = 0;
  double bubble_frac = -1;  // pipeline idle share of the step; -1 on one process

  nlohmann::json json() const;
  std::string line(int64_t train_iters) const;  // the one-line human log
};

class Trainer {
 public:
  Trainer(LmGraph g, const BatchSource& data, TrainOptions opt);
  // One pipeline rank: the executor runs this rank's share of each step, and
  // the optimizer updates the parameters of this rank's stages.
  Trainer(LmGraph g, const BatchSource& data, TrainOptions opt, PipelineExecutor& pipeline);

  // Runs one step; throws Error naming the step when the loss is not finite.
  StepRecord train_step();
  // Forward and backward of one global batch without an update: the mean loss,
  // with each parameter's grad holding d(mean loss)/d(param).
  double compute_gradients(int64_t step);

  int64_t steps_done() const { return steps_done_; }
  AdamW& optimizer() { return optimizer_; }
  const std::vector<Param*>& params() const { return params_; }
  MicroBatch& micro_batch_state() { return mb_; }

  void save(const std::string& dir);
  void load(const std::string& dir);

 private:
  LmGraph g_;
  const BatchSource& data_;
  TrainOptions opt_;
  PipelineExecutor* pipeline_ = nullptr;
  std::vector<Param*> params_;
  AdamW optimizer_;
  MicroBatch mb_;
  int64_t steps_done_ = 0;
};

}  // namespace weft
