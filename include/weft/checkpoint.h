// weft/checkpoint.h — weights in and out, and resumable checkpoints.
//
// A checkpoint directory holds one folder per saved step and a pointer file:
//   <dir>/iter_0000020/model.safetensors      parameters, full shapes, HF names
//   <dir>/iter_0000020/optimizer.safetensors  "<name>.exp_avg", "<name>.exp_avg_sq"
//   <dir>/iter_0000020/meta.json              step, consumed samples, config
//   <dir>/latest_checkpointed_iteration.txt   "20"
// Each folder is written under a temporary name and renamed when complete,
// and the pointer file is replaced atomically, so a crash mid-save leaves the
// previous checkpoint intact.
#pragma once

#include <weft/optimizer.h>
#include <weft/param.h>
#include <weft/safetensors.h>

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace weft {

// Loads parameters from a safetensors file with Hugging Face GPT-2 names: an
// optional "transformer." prefix is stripped; attention mask buffers
// (attn.bias, attn.masked_bias) and a tied lm_head.weight are ignored. Throws
// Error naming the tensor for one that is missing, extra, of the wrong dtype
// or of the wrong shape (with both shapes).
void load_weights(const std::string& path, const std::vector<Param*>& params);
void save_weights(const std::string& path, const std::vector<Param*>& params,
                  const std::map<std::string, std::string>& metadata = {});

struct CheckpointMeta {
  int64_t step = 0;              // steps completed
  int64_t consumed_samples = 0;  // sequences read
  nlohmann::json config;         // what the run was started with
  nlohmann::json trainer;        // the trainer's own state (the loss-spike check); may be null
};

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

// Writes <dir>/iter_<step>/ atomically and points latest at it. `model` and
// `optimizer` hold full tensors (every layout's pieces put together), so any
// other layout can load them.
// The step the checkpoint pointer of `dir` names, or -1 when `dir` holds no
// checkpoint.
int64_t newest_checkpoint_step(const std::string& dir);

// Removes all but the newest `keep` complete checkpoints in `dir` (keep <= 0:
// keeps every one).
void prune_checkpoints(const std::string& dir, int64_t keep);
// Removes what an interrupted save leaves behind in `dir`: iter_N.tmp
// directories, and iter_N.old copies whose replacement iter_N is complete.
// Returns the removed paths.
std::vector<std::string> clean_stale_checkpoint_files(const std::string& dir);

void save_checkpoint(const std::string& dir, const NamedTensors& model,
                     const NamedTensors& optimizer, int64_t optimizer_steps,
                     const CheckpointMeta& meta);

// The latest checkpoint of a directory, opened.
struct Checkpoint {
  CheckpointMeta meta;
  int64_t optimizer_steps = 0;
  safetensors::File model, optimizer;

  // Loads every parameter (a tensor-parallel piece gets its slice of the
  // full tensor). Throws Error naming the tensor and both shapes when the
  // checkpoint does not fit, or a tensor that is missing or extra.
  void read_model(const std::vector<Param*>& params) const;
  // Adam's moments of these parameters, shaped like their values (pieces
  // sliced), named "<param>.exp_avg" and "<param>.exp_avg_sq".
  NamedTensors read_optimizer(const std::vector<Param*>& params) const;
};
Checkpoint open_checkpoint(const std::string& dir);

}  // namespace weft
