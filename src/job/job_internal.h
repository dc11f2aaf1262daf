// The training job's parts (weft/job.h): the parsed flags, the checks that
// run before any rank starts, and the run itself. Internal to src/job/.
#pragma once

#include <weft/communicator.h>
#include <weft/grad_sync.h>
#include <weft/job.h>
#include <weft/partition.h>
#include <weft/plan.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace weft::job_detail {

struct Args {
  const weft::Job* job = nullptr;  // the program: its name and model families
  std::string model;
  weft::GptConfig gpt;
  // The model family (empty: the one the flags below describe, else the
  // job's first) and Megatron's flags that describe its parts.
  std::string arch;
  std::string normalization, position_embedding_type;
  bool swiglu = false, untie = false, disable_bias = false, gqa = false;
  int64_t num_query_groups = 0, ffn_hidden_size = 0;
  float rotary_base = 10000.0f;
  // Megatron's document flags (weft/trainer.h's DocumentOptions): the
  // tokenizer's end-of-document token ends a document.
  bool eod_mask_loss = false, reset_position_ids = false, reset_attention_mask = false;
  // Megatron's --make-vocab-size-divisible-by: the vocabulary table is padded
  // to a multiple of this times --tp (1: no padding).
  int64_t vocab_divisor = 128;
  int64_t micro_batch = 8;
  int64_t global_batch = 0;  // 0 = micro_batch
  int64_t train_iters = 100;
  float lr = 3e-4f;
  float min_lr = 0.0f;
  std::string lr_decay_style = "constant";
  int64_t lr_warmup_iters = 0;
  int64_t lr_decay_iters = 0;  // 0 = train_iters
  float weight_decay = 0.1f;
  double clip_grad = 1.0;
  double max_loss = -1;  // -1: 4 x ln(vocabulary); 0: off
  double save_timeout = 1800;
  bool async_save = false;  // Megatron's: each rank writes its slices while training goes on  // seconds
                            // the ranks wait for a save; 0: none
  float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f;
  int64_t seed = 1234;  // >= 0; read signed so that a negative one is refused, not wrapped
  // Megatron's dataset lists: PATH, or W1 PATH1 W2 PATH2 ..., or PATH1 PATH2
  // ... (each read in proportion to its size). --data-path is split by
  // --split; --train-data-path and --valid-data-path name each role's own.
  std::vector<std::string> data_path, train_data_path, valid_data_path;
  // As given: one list per time the flag is given; the last one counts.
  std::vector<std::vector<std::string>> data_path_given, train_data_path_given,
      valid_data_path_given;
  std::string data_format = "auto";     // weft/data.h's TokenFormat names
  std::string data_order = "shuffled";  // or "file": every dataset's windows in file order
  std::string init_from, save, load, log_jsonl, tokenizer, loss_plot;
  // Megatron's tokenizer flags: GPT2BPETokenizer (--vocab-file, --merge-file)
  // or HuggingFaceTokenizer (--tokenizer-model, a tokenizer.json), to encode
  // --sample-prompt and decode samples of token data.
  std::string tokenizer_type, vocab_file, merge_file, tokenizer_model;
  // Megatron's train/validation/test weights over the data's windows; empty:
  // every window trains. Validation every eval_interval steps (0: never).
  std::string split;
  int64_t eval_interval = 0, eval_iters = 10;
  int64_t save_interval = 0, log_interval = 1, keep_last = 0;
  // Megatron's: the CUDA profiler's range opens when this many steps have
  // run and closes when the end's have (-1: no range).
  int64_t profile_step_start = -1, profile_step_end = -1;
  std::string optimizer = "adam";  // Megatron's --optimizer adam|sgd
  float sgd_momentum = 0;
  float lion_beta1 = 0.9f, lion_beta2 = 0.99f;  // Lion's defaults (Chen et al.)
  int64_t local_steps = 0;         // local SGD / DiLoCo: average replicas every N steps
  int ps_ranks = 0;                // parameter servers: the last K ranks
  int64_t max_staleness = 0;
  int slow_rank = -1;              // benchmarking: this worker computes slower
  double slow_factor = 1.0;
  std::string outer_optimizer = "none";
  float outer_lr = 0.7f, outer_momentum = 0.9f;
  bool check_spiky_loss = false;   // Megatron's: skip the update of a step whose loss spikes
  double spiky_loss_factor = 10;
  int64_t max_skipped_steps = 10;
  bool check_links = false;        // measure every link between ranks, then exit
  int64_t check_links_mib = 16;
  int64_t exit_interval = 0;       // Megatron's: stop after a step divisible by it
  double exit_duration_mins = 0;   // Megatron's: stop once training has run this long
  bool no_load = false, overwrite_checkpoints = false, load_unverified = false;
  std::vector<std::string> rewound;  // --save's folders this run's first save removes
  std::vector<std::string> notes;    // said by rank 0 once the run starts
  // Megatron's: load weights only and start at step 0; or let flags that
  // contradict the checkpoint's meta.json win.
  bool finetune = false, override_checkpoint_args = false, override_scheduler = false;
  // Settled before the run by adopt_checkpoint_args: the checkpoint it loads
  // ("" for none), whether only its weights, the flags taken from its
  // meta.json (--use-checkpoint-args, Megatron's, always on) and what to say.
  std::string resume_from;
  bool weights_only = false;
  std::set<std::string> from_checkpoint;
  std::string adopted_note;
  int64_t sample = 0;
  float sample_temperature = 0.8f;
  std::string sample_prompt = "\n";
  int threads = 0;
  // Device and precision (Megatron's names).
  std::string device = "auto";
  std::string comm_backend = "auto";
  std::string cpu_gemm = "auto";  // auto, openblas or onednn (cpu::GemmLibrary)
  bool tf32 = false, bf16 = false, fp16 = false;
  // fp16's loss scaling (Megatron's flags and defaults; 0: dynamic).
  double loss_scale = 0, initial_loss_scale = 4294967296.0, min_loss_scale = 1.0;
  int64_t loss_scale_window = 1000, hysteresis = 2;
  std::string attention_backend = "auto";
  // Parallelism (Megatron's names; dp = world / (tp x pp)).
  int tp = 1, pp = 1;
  bool sequence_parallel = false;  // tp > 1: the tokens split outside the tensor-parallel regions
  std::string schedule = "1f1b";
  int virtual_stages = 0;       // chunks per pipeline rank
  int layers_per_virtual = 0;   // --num-layers-per-virtual-pipeline-stage
  std::string partition = "uniform";
  std::string profile;  // write measured per-node costs here (JSON) and partition by them
  std::string trace;    // Chrome trace of every action on every rank
  bool recompute = false;  // whole stages
  // Megatron's recompute over blocks (weft::PipelineOptions); empty: not given.
  std::string recompute_granularity, recompute_method;
  int recompute_num_layers = 1;
  bool recomputes() const { return recompute || !recompute_granularity.empty(); }
  std::string memory_budget;  // per pipeline rank for the partitioner: "2GiB", "512MiB", bytes
  double comm_timeout = 300;  // seconds
  // Data parallelism.
  bool distributed_optimizer = false;
  // --data-parallel-sharding-strategy (Megatron-FSDP's names); settled by
  // settle_sharding into distributed_optimizer, shard_grads and shard_params.
  std::string sharding_strategy;
  bool shard_grads = false;
  bool shard_params = false;
  // --plan auto: weft-sched plan's best layout, from a profile.
  std::string plan, plan_costs, plan_memory;
  double plan_latency = 0, plan_bandwidth = std::numeric_limits<double>::infinity();
  double plan_compute_scale = 1, plan_wake = 0;
  std::optional<double> plan_cores;
  std::string plan_note;  // what the planner chose, printed by rank 0
  double plan_step_ms = 0;    // its predicted step, against the first steps measured
  bool plan_pending = false;  // --plan auto without --plan-costs: planned by the run
  int64_t ddp_bucket_size = int64_t{1} << 20;  // elements
  bool overlap_grad_reduce = true;
  bool overlap_p2p_comm = false;  // post pipeline receives ahead
  std::string grad_reduce_dtype = "fp32";
  std::string grad_compression = "none";
  int powersgd_rank = 4;
  int64_t powersgd_start_iter = 0;
};

// The data's windows cut by --split "train,valid,test" weights (Megatron's
// flag; a test share is set aside and not read): [0, train) trains, [train,
// train + valid) validates.
struct DataSplit {
  int64_t train = 0, valid = 0;  // windows; train 0 = every window (no --split)
};

// A dataset list as Megatron's --data-path takes it: PATH; W1 PATH1 W2 PATH2
// ...; or PATH1 PATH2 ... (weights empty: each dataset in proportion to its
// windows).
struct DataBlend {
  std::vector<std::string> paths;
  std::vector<double> weights;
};

// Pipeline settings checked before any communication: every rank reaches the
// same verdict from the flags and the world size alone.
struct PipelineSetup {
  int chunks = 1;
  int64_t micro_batches = 1;
  weft::Device device;
  bool staged = false;  // device tensors travel through the host (HostStagedCommunicator)
  bool nccl = false;    // device tensors travel by NCCL (one GPU per rank)
};

// flags.cc: every flag of the job, into `a`.
void add_flags(CLI::App& app, Args& a, const Job& job);

// checks.cc: what runs before any rank starts. Each throws Error naming the
// value and the rule it broke.
void set_grad_compression(const Args& a, GradSyncOptions& sync);
DataSplit split_windows(const std::string& split, int64_t windows);
DataBlend parse_blend(const char* flag, const std::vector<std::string>& list);
// What meta.json records of a list: a lone path as its absolute path (as
// before blends), else the list with each path made absolute.
nlohmann::json blend_json(const std::vector<std::string>& list);
// The files a list reads, fingerprinted (weft/checkpoint.h) one by one: a
// lone file's fingerprint, else an array of them.
nlohmann::json blend_fingerprint(const std::vector<std::string>& list, const std::string& format);
Device resolve_device(const Args& a, int world, bool& staged, bool& nccl);
PipelineSetup check_parallel(const Args& a, const GptConfig& cfg, int world, int64_t global);
const ModelFamily& family_of(const Args& a, const CLI::App& app);
ModelArgs model_args(const Args& a, const GptConfig& cfg);
void adopt_checkpoint_args(Args& a, const CLI::App& app);
void check_param_servers(const Args& a, const CLI::App& app, int world);
// --plan auto: with --plan-costs, sets the layout flags to the planner's
// best plan now; without, only checks the flags (the run profiles the
// model and plans once the ranks are connected: plan_by_profile).
void apply_plan(Args& a, const CLI::App& app, int world);
bool check_plan_flags(const Args& a, const CLI::App& app);
// The planner's input from the flags and a profile (train_gpt --profile's
// JSON, named `source` in errors); the best plan under the layout flags
// given, into a's layout flags, plan_note and plan_step_ms.
plan::PlanInput plan_input(const Args& a, const CLI::App& app, int world,
                           const nlohmann::json& profile, const std::string& source);
void adopt_plan(Args& a, const CLI::App& app, plan::PlanInput in);
// --data-parallel-sharding-strategy and its alias --use-distributed-optimizer
// into distributed_optimizer and shard_grads; throws naming a contradiction.
void settle_sharding(Args& a, const CLI::App& app);
GptConfig resolve_config(const Args& a, const CLI::App& app);
void check_training_flags(const Args& a, const CLI::App& app);

// run.cc: the run on this rank (world: null for one process), and --check-links.
int run(const Args& a, const CLI::App& app, Communicator* world);
int run_link_check(const Args& a, Communicator& world);

}  // namespace weft::job_detail
