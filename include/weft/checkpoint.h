// weft/checkpoint.h — weights in and out, and resumable checkpoints.
//
// A checkpoint directory holds one folder per saved step and a pointer file:
//   <dir>/iter_0000020/model-00001-of-00004.safetensors      what writer 1 of 4 holds
//   <dir>/iter_0000020/optimizer-00001-of-00004.safetensors  of the weights, and of
//   ...                                                      the optimizer's state
//   <dir>/iter_0000020/meta.json              step, consumed samples, config
//   <dir>/iter_0000020/manifest.json          what the folder holds (below)
//   <dir>/latest_checkpointed_iteration.txt   "20", for Megatron's tools; weft never reads it
//
// Every byte has one writer. Each rank writes the slices it holds: its
// tensor-parallel piece of a tensor (pipeline ranks the tensors of their
// stages), and of that piece the elements its data-parallel replica owns
// (the distributed optimizer's slice of each bucket; without it, the same
// cut). A tensor replicated across a tensor-parallel group is written by its
// rank 0; one tied across pipeline stages by the stage that owns it. A slice
// is a tensor of its rank's files, named as the whole tensor ("h.0.mlp.c_fc.weight",
// "wte.weight.exp_avg"): its piece's shape when it is all of the piece, else
// flat. Nothing funnels the model through one process.
//
// The manifest (version 2) lists every file with its size and every slice
// with its dtype, shape, XXH3-64 checksum (xxHash) and where it sits in the
// whole tensor: the piece (the split dimension, the parts, this piece's
// index, the packed blocks, the padded shape) and the piece's elements
// [lo, hi); a padded vocabulary table's padding rows are never written. A
// slice file's header has its own checksum, so every byte of the folder is
// covered:
//   {"format": "weft checkpoint manifest", "version": 2, "checksum": "xxh3_64",
//    "step": 20, "writers": 4, "files": [
//     {"name": "model-00001-of-00004.safetensors", "holds": "model", "size": 1234,
//      "header_xxh3_64": "3f0c...", "tensors": [{"name": "wte.weight", "dtype": "F32",
//      "shape": [128, 64], "xxh3_64": "9a1e...", "slice": {"shape": [256, 64],
//      "padded": [256, 64], "dim": 0, "parts": 2, "index": 0, "blocks": [],
//      "elements": [0, 8192]}}, ...]}, ..., {"name": "meta.json", "size": .., "xxh3_64": ..}]}
//
// Saving: world rank 0 makes an empty iter_N.tmp; every writer writes its two
// files there and a part-R-of-W.json (its files' manifest entries), flushed;
// rank 0 waits for every part, checks that the slices cover every tensor
// once, writes meta.json and the manifest last, flushes, and renames the
// folder to iter_N. A step saved again keeps its complete old folder as
// iter_N.old until the new one is in place. A save makes its step the
// newest: folders of later steps (abandoned by a run rewound to an earlier
// checkpoint) are removed once it is in place. The pointer file is replaced
// atomically last. A process killed at any point of a save leaves every
// earlier checkpoint intact; clean_stale_checkpoint_files tidies what it
// left. A writer that fails leaves part-R-of-W.failed with its reason, which
// rank 0 reports.
//
// Loading trusts no pointer. A checkpoint directory's checkpoint is its newest
// iter_N (or iter_N.old, left by an interrupted replacement) whose manifest,
// sizes, headers and slices agree: every file has the manifest's size, every
// header its checksum and the manifest's tensors, meta.json its checksum,
// and the slices of each tensor cover it exactly once. The data are read
// when a rank asks for them: each rank reads only the slices that hold its
// piece (at the layout that saved, exactly its own bytes), with a positioned
// read, and checks each slice's checksum as it reads it; bytes_read() counts
// them. Trainer::load agrees on the outcome across ranks and, given a
// directory, falls back to the next older folder when a slice fails. One
// iter_N folder named explicitly must verify, or loading fails naming the
// file and tensor at fault. A folder without manifest.json (saved before
// checkpoints had manifests) loads unverified, and says so.
//
// Checkpoints of version 1 (one writer, whole tensors in model.safetensors
// and optimizer.safetensors) load as they did: every file is read and
// checked whole when opened.
//
// Fault injection, for tests of interrupted saves: WEFT_FAULT_INJECT=PHASE
// kills the saving process with SIGKILL at that phase of a save, or of the
// save of step S with PHASE@S:
//   writing-tensors   a writer's model file partly written (its first slice)
//   before-fsync      every file of iter_N.tmp written, the manifest too; the folder
//                     not yet flushed to disk, nothing renamed
//   between-renames   an existing iter_N moved to iter_N.old, iter_N.tmp not yet renamed
//   pointer-update    iter_N in place; the new pointer written but not yet renamed
// WEFT_FAULT_INJECT=slow-save:MS makes world rank 0 sleep MS milliseconds before it
// completes the folder.
// check_fault_injection() refuses any other value up front.
#pragma once

#include <weft/optimizer.h>
#include <weft/param.h>
#include <weft/safetensors.h>

#include <nlohmann/json.hpp>

#include <memory>
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

// One slice a rank writes: elements [lo, hi) of its piece `shard` of the
// tensor `name` (shard.full is the whole tensor's shape, padded when it is a
// padded vocabulary table, whose true rows are then `true_rows`; shard.dim
// -1: the whole tensor), in the piece's row-major order. `data`: those
// hi - lo fp32 values, on the host.
struct SliceOut {
  std::string name;
  Shard shard;
  int64_t true_rows = 0;
  int64_t lo = 0, hi = 0;
  Tensor data;
};

struct RankSlices {
  std::vector<SliceOut> model, optimizer;
};

// A writer of a save: `rank` of `ranks` (every rank that trains writes).
struct SaveRank {
  int rank = 0, ranks = 1;
  double timeout_s = 1800;  // how long rank 0 waits for the other writers' parts; 0: no limit
};

// A save in three steps (the layout above). 1: rank 0 alone, before any
// writer starts (then a barrier): an empty iter_N.tmp.
void begin_checkpoint(const std::string& dir, int64_t step);
// 2: every writer: its files and its part of the manifest, flushed.
void write_checkpoint_slices(const std::string& dir, int64_t step, const SaveRank& who,
                             const RankSlices& slices, const std::string& optimizer,
                             int64_t optimizer_steps);
// 3: rank 0, after its own step 2: waits for every part (up to
// who.timeout_s; a writer's .failed ends the wait at once), checks that the
// slices cover every tensor exactly once, writes meta.json and the manifest,
// and puts the folder in place. Throws Error naming the writer or the tensor
// at fault.
void finish_checkpoint(const std::string& dir, const CheckpointMeta& meta, int64_t optimizer_steps,
                       const SaveRank& who);

// One process with whole tensors: the three steps, one writer.
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
  // Trainer::load: the bytes of tensor data this rank read, and the bytes of
  // the elements it asked for (equal when the layout saved is the layout
  // loaded); then their sums over the ranks, and the most one rank read.
  int64_t bytes_read = 0, bytes_wanted = 0;
  int64_t all_read = 0, all_wanted = 0, most_read = 0;
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

// One checkpoint, opened and verified (its data as they are read).
struct Checkpoint {
  CheckpointSource source;
  CheckpointMeta meta;
  int64_t optimizer_steps = 0;

  enum class Part : uint8_t { Model, Optimizer };
  // The tensors of a part, whole (a padded table's true rows), by name.
  std::vector<std::pair<std::string, Shape>> tensors(Part part) const;
  // Elements [lo, hi) of the piece `shard` of tensor `name` into `dest`
  // (hi - lo fp32 on the host); shard.full as in SliceOut, true_rows the
  // reader's padding (rows past them read as zero). Reads the slices that
  // hold them and checks each one's checksum. Throws Error naming the file
  // and tensor: absent, another shape, a checksum that differs.
  void read(Part part, const std::string& name, const Shard& shard, int64_t true_rows, int64_t lo,
            int64_t hi, const Tensor& dest) const;
  // A whole tensor, on the host.
  Tensor read_whole(Part part, const std::string& name) const;

  // Loads every parameter (a tensor-parallel piece gets its slice of the
  // full tensor). Throws Error naming the tensor and both shapes when the
  // checkpoint does not fit, or a tensor that is missing or extra.
  void read_model(const std::vector<Param*>& params) const;
  // read_model's two parts: throws Error naming a tensor the checkpoint
  // holds that none of `params` is; reads each of `params` whole.
  void check_model(const std::vector<Param*>& params) const;
  void read_values(const std::vector<Param*>& params) const;
  // The optimizer state of these parameters, shaped like their values
  // (pieces sliced), named "<param><suffix>": Adam's ".exp_avg" and
  // ".exp_avg_sq" by default (weft/optimizer.h, optimizer_state_suffixes).
  NamedTensors read_optimizer(const std::vector<Param*>& params,
                              const std::vector<std::string>& suffixes = {".exp_avg",
                                                                          ".exp_avg_sq"}) const;
  // The bytes of tensor data read so far (a version-1 checkpoint: its files,
  // when opened), and the bytes of the elements asked for.
  int64_t bytes_read() const;
  int64_t bytes_wanted() const;

  struct Store;
  std::shared_ptr<Store> store;
};
// `dir` is a checkpoint directory (its newest checkpoint that verifies; throws
// Error saying why each failed when none does) or one iter_N folder (which
// must verify; throws Error naming the file and the tensor at fault). A
// folder without a manifest cannot be verified: a directory's scan skips it,
// and one named alone loads only with `allow_unverified` (train_gpt's
// --load-unverified), its source then saying verified = false.
//
// `failed`: folders (path, why) whose data did not verify when read; a
// directory's scan passes over them as over any folder that does not verify.
Checkpoint open_checkpoint(const std::string& dir, bool allow_unverified = false,
                           const std::vector<std::pair<std::string, std::string>>& failed = {});
// Whether open_checkpoint(dir) opens `dir` as one folder (named iter_N, or
// holding a checkpoint's files) rather than as a directory of them.
bool is_checkpoint_folder(const std::string& dir);

}  // namespace weft
