// weft/checkpoint.h — weights in and out, and resumable checkpoints.
//
// A checkpoint directory holds one folder per saved step and a pointer file:
//   <dir>/iter_0000020/model.safetensors      parameters, full shapes, HF names
//   <dir>/iter_0000020/optimizer.safetensors  "<name>.exp_avg", "<name>.exp_avg_sq"
//   <dir>/iter_0000020/meta.json              step, consumed samples, config
//   <dir>/iter_0000020/manifest.json          what the folder must hold (below)
//   <dir>/latest_checkpointed_iteration.txt   "20", for Megatron's tools; weft never reads it
//
// The manifest lists every file of the folder with its size in bytes and its
// XXH3-64 checksum (xxHash), and every tensor of the safetensors files with
// its dtype, shape and the checksum of its bytes:
//   {"format": "weft checkpoint manifest", "version": 1, "checksum": "xxh3_64",
//    "step": 20, "files": [{"name": "model.safetensors", "size": 1234,
//    "xxh3_64": "3f0c...", "tensors": [{"name": "wte.weight", "dtype": "F32",
//    "shape": [256, 64], "xxh3_64": "9a1e..."}, ...]}, ..., {"name": "meta.json", ...}]}
//
// Saving: the folder is written as iter_N.tmp, the manifest last, fsynced,
// then renamed to iter_N. A step saved again keeps its complete old folder
// as iter_N.old until the new one is in place. A save makes its step the
// newest: folders of later steps (abandoned by a run rewound to an earlier
// checkpoint) are removed once it is in place. The pointer file is replaced
// atomically last. A process killed at any point of a save leaves every
// earlier checkpoint intact; clean_stale_checkpoint_files tidies what it
// left.
//
// Loading trusts no pointer. A checkpoint directory's checkpoint is its newest
// iter_N (or iter_N.old, left by an interrupted replacement) that verifies:
// - every file has the manifest's size and checksum;
// - every tensor has its name, dtype, shape and checksum;
// - meta.json parses.
// Newer folders that do not verify are skipped, and each is reported with the
// file and tensor at fault. One iter_N folder named explicitly must verify,
// or loading fails naming them. A folder without manifest.json (saved before
// checkpoints had manifests) loads unverified, and says so.
//
// Fault injection, for tests of interrupted saves: WEFT_FAULT_INJECT=PHASE
// kills the saving process with SIGKILL at that phase of a save, or of the
// save of step S with PHASE@S:
//   writing-tensors   model.safetensors partly written (its first tensor)
//   before-fsync      every file of iter_N.tmp written, the manifest too; the folder
//                     not yet flushed to disk, nothing renamed
//   between-renames   an existing iter_N moved to iter_N.old, iter_N.tmp not yet renamed
//   pointer-update    iter_N in place; the new pointer written but not yet renamed
// WEFT_FAULT_INJECT=slow-save:MS makes the writer sleep MS milliseconds first.
// check_fault_injection() refuses any other value up front.
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
// or of the wrong shape (with both shapes). A padded vocabulary table
// (Param::true_rows) is read from its true rows, the padding set to zero; every
// file here, checkpoints too, holds a padded table's true rows only, so it
// loads at any padding.
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

// Writes <dir>/iter_<step>/ with its manifest atomically and points latest
// at it. `model` and `optimizer` hold full tensors (every layout's pieces put
// together), so any other layout can load them.
void save_checkpoint(const std::string& dir, const NamedTensors& model,
                     const NamedTensors& optimizer, int64_t optimizer_steps,
                     const CheckpointMeta& meta);

// Throws Error naming WEFT_FAULT_INJECT's value when it is set to something
// other than the forms above (a save reads it too; this says so before the
// first one).
void check_fault_injection();

// Which checkpoint a load reads, and what it passed over.
struct CheckpointSource {
  std::string path;       // the iter_N folder; empty when none verifies
  int64_t step = -1;      // its step; -1 when none verifies
  bool verified = false;  // its manifest matched; false: it has none, loaded as allowed
  // Newer folders that do not verify, newest first: (folder, why), where
  // `why` names the file and the tensor at fault.
  std::vector<std::pair<std::string, std::string>> skipped;
};

// The checkpoint open_checkpoint(dir) reads, found the same way (each folder
// read and verified, newest first, until one verifies); a folder that does
// not verify is listed in `skipped`, not thrown. step is -1 when none
// verifies, or when `dir` does not exist.
CheckpointSource scan_checkpoints(const std::string& dir);
// scan_checkpoints(dir).step: the step a run resuming from `dir` starts after.
int64_t newest_checkpoint_step(const std::string& dir);
// The folders of `dir` newer than `step`, newest first: what a save of
// `step` there removes (a run rewound to an older checkpoint abandons them).
std::vector<std::string> checkpoints_after(const std::string& dir, int64_t step);

// Removes all but the newest `keep` complete checkpoints in `dir` (keep <= 0:
// keeps every one).
void prune_checkpoints(const std::string& dir, int64_t keep);
// Tidies what an interrupted save leaves behind in `dir`: removes iter_N.tmp
// folders, the pointer's temporary file, and iter_N.old copies whose
// replacement iter_N is in place; renames an iter_N.old whose replacement
// never arrived back to iter_N; points the pointer file at the newest
// complete iter_N. Returns one line per thing done ("removed <path>, left by
// an interrupted save").
std::vector<std::string> clean_stale_checkpoint_files(const std::string& dir);

// What a resume checks of a data file (meta.json's config.data_fingerprint):
// {"bytes": its size, "head_tail_xxh3": XXH3-64 of its first and last MiB},
// cheap for any size; a file rewritten in place or replaced changes one of
// them in practice. null when the file cannot be read.
nlohmann::json data_fingerprint(const std::string& path);

// One writer per checkpoint folder: the folder `dir` (made if absent) locked
// (flock on dir/weft.lock, which says who holds it) for this object's life.
// Throws Error naming the path when it is not a folder, cannot be made or
// written, or when another process holds the lock: that process's host and
// PID, as the lock file gives them. The kernel lets go of the lock when the
// holder exits, however it ends.
class SaveDirLock {
 public:
  explicit SaveDirLock(const std::string& dir);
  ~SaveDirLock();
  SaveDirLock(const SaveDirLock&) = delete;
  SaveDirLock& operator=(const SaveDirLock&) = delete;
  static constexpr const char* kFile = "weft.lock";

 private:
  int fd_ = -1;
};

// One checkpoint, opened and verified.
struct Checkpoint {
  CheckpointSource source;
  CheckpointMeta meta;
  int64_t optimizer_steps = 0;
  safetensors::File model, optimizer;

  // Loads every parameter (a tensor-parallel piece gets its slice of the
  // full tensor). Throws Error naming the tensor and both shapes when the
  // checkpoint does not fit, or a tensor that is missing or extra.
  void read_model(const std::vector<Param*>& params) const;
  // The optimizer state of these parameters, shaped like their values
  // (pieces sliced), named "<param><suffix>": Adam's ".exp_avg" and
  // ".exp_avg_sq" by default (weft/optimizer.h, optimizer_state_suffixes).
  NamedTensors read_optimizer(const std::vector<Param*>& params,
                              const std::vector<std::string>& suffixes = {".exp_avg",
                                                                          ".exp_avg_sq"}) const;
};
// `dir` is a checkpoint directory (its newest checkpoint that verifies; throws
// Error saying why each failed when none does) or one iter_N folder (which
// must verify; throws Error naming the file and the tensor at fault). A
// folder without a manifest cannot be verified: a directory's scan skips it,
// and one named alone loads only with `allow_unverified` (train_gpt's
// --load-unverified), its source then saying verified = false.
Checkpoint open_checkpoint(const std::string& dir, bool allow_unverified = false);

}  // namespace weft
