// The training job (weft/job.h): a model family's model trained on a text or
// llm.c token file, e.g. train_gpt's
//
//   train_gpt --model mini --data-path /usr/share/games/fortunes/fortunes
//             --micro-batch-size 16 --train-iters 300 --lr 1e-3
//
// Flags follow Megatron-LM's names. Errors print one line naming the value
// and the rule it broke, and exit with status 1.
#include <weft/checkpoint.h>
#include <weft/job.h>
#include <weft/error.h>
#include <weft/layout.h>
#include <weft/link_check.h>
#include <weft/mesh.h>
#include <weft/mpi_communicator.h>
#include <weft/ops.h>
#include <weft/param_server.h>
#include <weft/nccl_communicator.h>
#include <weft/staged_communicator.h>
#include <weft/partition.h>
#include <weft/pipeline.h>
#include <weft/profile.h>
#include <weft/schedule.h>
#include <weft/threads.h>
#include <weft/plot.h>
#include <weft/tokenizer.h>
#include <weft/trainer.h>
#include <weft/units.h>
#include <weft/plan.h>

#include "models/gpt.h"

#include <climits>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <fmt/core.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numeric>
#include <optional>
#include <limits>
#include <thread>
#include <set>
#include <span>
#include <string>
#include <tuple>

namespace {

// Graceful stop (Megatron's exit-signal handling, on whenever --save is set):
// SIGTERM, SIGINT or SIGUSR1 (Slurm's warning before its time limit) asks
// every rank to stop after the step in flight and save. A second signal is
// held (a launcher or a terminal often sends two), so the save still
// happens; a third ends the process at once, losing the save, and says so.
std::atomic<int> g_stop_signal{0};
std::atomic<int> g_signals{0};
// What the handler writes, made before it is installed (it may not allocate).
std::string g_held_line, g_abort_line;

extern "C" void on_stop_signal(int sig) {
  const int n = g_signals.fetch_add(1) + 1;
  if (n == 1) {
    g_stop_signal.store(sig);
    return;
  }
  // Only async-signal-safe calls here: write(2), then the default action.
  if (n == 2) {
    (void)!::write(STDERR_FILENO, g_held_line.data(), g_held_line.size());
    return;
  }
  (void)!::write(STDERR_FILENO, g_abort_line.data(), g_abort_line.size());
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

void install_stop_handlers(const std::string& program) {
  g_held_line = program + ": a second signal: held, the job stops and saves after the step in "
                          "flight (a third signal ends it at once, without saving)\n";
  g_abort_line = program + ": a third signal: ending at once, without saving\n";
  for (int sig : {SIGTERM, SIGINT, SIGUSR1}) std::signal(sig, on_stop_signal);
}

// Why a run stops before --train-iters: every rank reaches the same answer
// after the same step (one all-reduce of two numbers per step): a signal any
// rank received, or --exit-duration-in-mins passed on any rank's clock.
struct StopReason {
  int signal = 0;
  bool out_of_time = false;
  bool any() const { return signal > 0 || out_of_time; }
};

StopReason stop_requested(weft::Communicator* world, weft::Tensor& flags, bool out_of_time) {
  flags.data<float>()[0] = static_cast<float>(g_stop_signal.load());
  flags.data<float>()[1] = out_of_time ? 1.0f : 0.0f;
  if (world != nullptr && world->size() > 1) world->all_reduce(flags, weft::ReduceOp::Max);
  return {static_cast<int>(flags.data<float>()[0]), flags.data<float>()[1] > 0};
}

const char* signal_name(int sig) {
  switch (sig) {
    case SIGTERM: return "SIGTERM";
    case SIGINT: return "SIGINT";
    case SIGUSR1: return "SIGUSR1";
    default: return "a signal";
  }
}

// Which process is which rank: host, PID and device of every rank, gathered
// at start-up so that a rank that dies later can be named (rank 0 prints it,
// writes it as the JSONL's first line and, for scripts/weft-run, to the file
// $WEFT_RANK_TABLE).
nlohmann::json rank_table(weft::Communicator* world, const weft::Device& device) {
  constexpr int64_t kHost = 64, kDevice = 16, kRecord = 1 + kHost + kDevice;
  char host[kHost] = {};
  gethostname(host, kHost - 1);
  const std::string dev = device.str();
  weft::Tensor mine = weft::Tensor::zeros({kRecord}, weft::DType::I32);
  int32_t* m = mine.data<int32_t>();
  m[0] = static_cast<int32_t>(getpid());
  for (int64_t i = 0; i < kHost && host[i] != 0; ++i) m[1 + i] = static_cast<unsigned char>(host[i]);
  for (size_t i = 0; i < dev.size() && i < static_cast<size_t>(kDevice); ++i)
    m[1 + kHost + static_cast<int64_t>(i)] = static_cast<unsigned char>(dev[i]);
  const int n = world != nullptr ? world->size() : 1;
  weft::Tensor all = weft::Tensor::zeros({n * kRecord}, weft::DType::I32);
  if (world != nullptr && n > 1)
    world->all_gather(mine, all);
  else
    all.copy_from(mine);
  auto text = [](const int32_t* p, int64_t len) {
    std::string t;
    for (int64_t i = 0; i < len && p[i] != 0; ++i) t.push_back(static_cast<char>(p[i]));
    return t;
  };
  nlohmann::json ranks = nlohmann::json::array();
  for (int r = 0; r < n; ++r) {
    const int32_t* p = all.data<int32_t>() + r * kRecord;
    ranks.push_back({{"rank", r}, {"host", text(p + 1, kHost)}, {"pid", p[0]},
                     {"device", text(p + 1 + kHost, kDevice)}});
  }
  return ranks;
}

// --check-links: every pair of ranks measured; rank 0 lists the links,
// slowest first, and marks those below half the median bandwidth.
void print_links(std::vector<weft::LinkResult> links, const nlohmann::json& ranks, int64_t mib,
                 int reps, const std::string& over) {
  std::sort(links.begin(), links.end(),
            [](const auto& x, const auto& y) { return x.gb_per_s < y.gb_per_s; });
  std::vector<double> bw;
  for (const auto& l : links) bw.push_back(l.gb_per_s);
  const double median = bw[bw.size() / 2];
  auto host = [&](int r) { return ranks[static_cast<size_t>(r)]["host"].get<std::string>(); };
  fmt::print("links between {} ranks over {} ({} MiB messages; one way, from the median of {} "
             "round trips), slowest first:\n",
             ranks.size(), over, mib, reps);
  for (const auto& l : links)
    fmt::print("rank {} ({}) <-> rank {} ({}): {:.2f} GB/s, latency {:.1f} us{}\n", l.a, host(l.a),
               l.b, host(l.b), l.gb_per_s, l.latency_us,
               l.gb_per_s < median / 2 ? "  <- below half the median" : "");
  fmt::print("median {:.2f} GB/s over {} links; slowest {:.2f} GB/s (rank {} <-> rank {})\n",
             median, links.size(), links.front().gb_per_s, links.front().a, links.front().b);
}

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
  double save_timeout = 1800;  // seconds the ranks wait for a save; 0: none
  float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f;
  int64_t seed = 1234;  // >= 0; read signed so that a negative one is refused, not wrapped
  std::string data_path, init_from, save, load, log_jsonl, tokenizer, loss_plot;
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
  bool tf32 = false, bf16 = false, fp16 = false;
  // fp16's loss scaling (Megatron's flags and defaults; 0: dynamic).
  double loss_scale = 0, initial_loss_scale = 4294967296.0, min_loss_scale = 1.0;
  int64_t loss_scale_window = 1000, hysteresis = 2;
  std::string attention_backend = "auto";
  // Parallelism (Megatron's names; dp = world / (tp x pp)).
  int tp = 1, pp = 1;
  std::string schedule = "1f1b";
  int virtual_stages = 0;       // chunks per pipeline rank
  int layers_per_virtual = 0;   // --num-layers-per-virtual-pipeline-stage
  std::string partition = "uniform";
  std::string profile;  // write measured per-node costs here (JSON) and partition by them
  std::string trace;    // Chrome trace of every action on every rank
  bool recompute = false;
  std::string memory_budget;  // per pipeline rank for the partitioner: "2GiB", "512MiB", bytes
  double comm_timeout = 300;  // seconds
  // Data parallelism.
  bool distributed_optimizer = false;
  // --plan auto: weft-sched plan's best layout, from a profile.
  std::string plan, plan_costs, plan_memory;
  double plan_latency = 0, plan_bandwidth = std::numeric_limits<double>::infinity();
  double plan_compute_scale = 1, plan_wake = 0;
  std::optional<double> plan_cores;
  std::string plan_note;  // what the planner chose, printed by rank 0
  int64_t ddp_bucket_size = int64_t{1} << 20;  // elements
  bool overlap_grad_reduce = true;
  bool overlap_p2p_comm = false;  // post pipeline receives ahead
  std::string grad_reduce_dtype = "fp32";
  std::string grad_compression = "none";
  int powersgd_rank = 4;
  int64_t powersgd_start_iter = 0;
};

// --grad-reduce-dtype, --grad-compression and --powersgd-* into `sync`
// (which holds the other data-parallel flags), checked against them.
void set_grad_compression(const Args& a, weft::GradSyncOptions& sync) {
  sync.optimizer = weft::parse_optimizer(a.optimizer);
  sync.sgd = {a.sgd_momentum, a.weight_decay};
  sync.lion = {a.lion_beta1, a.lion_beta2, a.weight_decay};
  sync.reduce_dtype = weft::parse_grad_reduce_dtype(a.grad_reduce_dtype);
  sync.compression = weft::parse_grad_compression(a.grad_compression);
  sync.powersgd_rank = a.powersgd_rank;
  sync.powersgd_start_iter = a.powersgd_start_iter;
  weft::check_grad_sync_options(sync);
}

// The data's windows cut by --split "train,valid,test" weights (Megatron's
// flag; a test share is set aside and not read): [0, train) trains, [train,
// train + valid) validates.
struct DataSplit {
  int64_t train = 0, valid = 0;  // windows; train 0 = every window (no --split)
};

DataSplit split_windows(const std::string& split, int64_t windows) {
  using weft::check;
  DataSplit s;
  if (split.empty()) return s;
  std::vector<double> w;
  size_t at = 0;
  while (at <= split.size()) {
    const size_t comma = std::min(split.find(',', at), split.size());
    const std::string part = split.substr(at, comma - at);
    char* end = nullptr;
    const double v = std::strtod(part.c_str(), &end);
    check(!part.empty() && end == part.c_str() + part.size() && std::isfinite(v) && v >= 0,
          "--split '{}': '{}' is not a non-negative number", split, part);
    w.push_back(v);
    at = comma + 1;
  }
  check(w.size() <= 3, "--split '{}' has {} weights; it takes train,valid,test", split, w.size());
  w.resize(3, 0.0);
  const double total = w[0] + w[1] + w[2];
  check(total > 0, "--split '{}': the weights sum to 0", split);
  s.train = static_cast<int64_t>(static_cast<double>(windows) * w[0] / total);
  s.valid = static_cast<int64_t>(static_cast<double>(windows) * w[1] / total);
  check(s.train > 0, "--split '{}' leaves no window for training (the data has {})", split,
        windows);
  return s;
}

// 75 s -> "1m15s"; 4000 s -> "1h06m40s".
std::string duration(double seconds) {
  const int64_t s = static_cast<int64_t>(std::llround(std::max(0.0, seconds)));
  if (s >= 3600) return fmt::format("{}h{:02d}m{:02d}s", s / 3600, s / 60 % 60, s % 60);
  if (s >= 60) return fmt::format("{}m{:02d}s", s / 60, s % 60);
  return fmt::format("{}s", s);
}

// Entropy of the data's token frequencies, in nats: the loss of the best
// model that ignores context, which a trained model should beat by far.
double unigram_entropy(const weft::TokenData& data) {
  std::vector<int64_t> counts(static_cast<size_t>(data.max_token()), 0);
  for (int32_t t : data.tokens()) ++counts[static_cast<size_t>(t)];
  double h = 0;
  const double n = static_cast<double>(data.size());
  for (int64_t c : counts)
    if (c > 0) h -= static_cast<double>(c) / n * std::log(static_cast<double>(c) / n);
  return h;
}

// Pipeline settings checked before any communication: every rank reaches the
// same verdict from the flags and the world size alone.
struct PipelineSetup {
  int chunks = 1;
  int64_t micro_batches = 1;
  weft::Device device;
  bool staged = false;  // device tensors travel through the host (HostStagedCommunicator)
  bool nccl = false;    // device tensors travel by NCCL (one GPU per rank)
};

// --device, --comm-backend and the precision flags. auto is cuda when a GPU
// is visible. Each rank takes the GPU of its local rank (the launcher's
// variables, weft/launcher.h) modulo the GPUs visible. When each rank has a
// GPU of its own, NCCL carries device tensors (auto or nccl); when ranks
// share a GPU, NCCL cannot, and they travel through the host (auto or mpi).
weft::Device resolve_device(const Args& a, int world, bool& staged, bool& nccl) {
  using namespace weft;
  check(!(a.bf16 && a.fp16), "--bf16 and --fp16 are mutually exclusive: choose one");
  check(!a.tf32 || (!a.bf16 && !a.fp16),
        "--tf32 changes nothing with --{}: every GEMM takes {} inputs", a.bf16 ? "bf16" : "fp16",
        a.bf16 ? "bf16" : "fp16");
  // cuda:N: one process on GPU N (as PyTorch names it).
  int index = -1;
  if (a.device.starts_with("cuda:")) {
    const std::string n = a.device.substr(5);
    check(!n.empty() && n.size() <= 4 && n.find_first_not_of("0123456789") == std::string::npos,
          "--device '{}' must be cpu, cuda, cuda:N (N a GPU index) or auto", a.device);
    index = std::stoi(n);
  } else {
    check(a.device == "auto" || a.device == "cpu" || a.device == "cuda",
          "--device '{}' must be cpu, cuda, cuda:N (N a GPU index) or auto", a.device);
  }
  check(a.comm_backend == "auto" || a.comm_backend == "mpi" || a.comm_backend == "nccl",
        "--comm-backend '{}' must be auto, mpi or nccl", a.comm_backend);
  const int gpus = cuda_device_count();
  const std::string kind = index >= 0        ? "cuda"
                           : a.device == "auto" ? (gpus > 0 ? "cuda" : "cpu")
                                                : a.device;
  check(kind == "cuda" || a.comm_backend != "nccl",
        "--comm-backend nccl carries GPU tensors: it needs --device cuda");
  check(world > 1 || a.comm_backend == "auto",
        "--comm-backend {} chooses how ranks talk, but the job is one process", a.comm_backend);
  staged = false;
  nccl = false;
  // Megatron's names: 'fused' is cuDNN's fused attention (Transformer Engine's
  // name for it); 'flash' (Dao's FlashAttention) and 'local' are not in weft.
  check(a.attention_backend != "flash" && a.attention_backend != "local",
        "--attention-backend {}: weft has no such kernel; 'fused' is cuDNN's fused flash "
        "attention (auto, fused or unfused)",
        a.attention_backend);
  check(a.attention_backend == "auto" || a.attention_backend == "fused" ||
            a.attention_backend == "unfused",
        "--attention-backend '{}' must be auto, fused or unfused", a.attention_backend);
  check(a.attention_backend == "auto" || kind == "cuda",
        "--attention-backend {} chooses the attention kernel on a GPU: the CPU computes "
        "attention unfused (needs --device cuda)",
        a.attention_backend);
  check(a.attention_backend == "auto" || ops::fused_attention_built(),
        "--attention-backend {}: weft was built without cuDNN's fused attention, so attention "
        "is always unfused (set-up needs cuDNN and scripts/cudnn-frontend.sh's headers)",
        a.attention_backend);
  if (kind != "cuda") {
    check(!a.tf32, "--tf32 needs --device cuda: the CPU computes in fp32");
  } else {
    check(cuda_built(), "--device cuda: weft was built without CUDA (meson setup -Dcuda=enabled)");
    check(gpus > 0, "--device {}: no CUDA device is visible (see nvidia-smi and "
                    "CUDA_VISIBLE_DEVICES)", a.device);
    check(index < gpus, "--device {}: {} CUDA device{} visible (cuda:0{}); see nvidia-smi and "
                        "CUDA_VISIBLE_DEVICES",
          a.device, gpus, gpus == 1 ? " is" : "s are",
          gpus == 1 ? "" : fmt::format(" to cuda:{}", gpus - 1));
    check(index < 0 || world == 1,
          "--device {} places one process on one GPU; with {} ranks each takes the GPU of its "
          "local rank: use --device cuda",
          a.device, world);
  }
  if (kind != "cuda") return Device::cpu();
  if (index >= 0) return Device::cuda(index);
  const LaunchInfo launch = detect_launch();
  const DeviceTransport transport =
      choose_device_transport(a.comm_backend, world, launch.local_size, gpus,
                              nccl_ranks_as_hosts());
  staged = transport == DeviceTransport::HostStaged;
  nccl = transport == DeviceTransport::Nccl;
  if (nccl) {
    // A receive posted ahead of its p2p step would be an NCCL call of its own,
    // holding the communication stream until its message comes.
    check(!a.overlap_p2p_comm,
          "--overlap-p2p-comm with NCCL ({}): a receive posted ahead of its step would hold "
          "the communication stream until its message comes; drop the flag or use "
          "--comm-backend mpi",
          a.comm_backend == "nccl" ? "--comm-backend nccl"
                                   : "chosen by --comm-backend auto: each rank has its own GPU");
  }
  return Device::cuda(launch.local_rank % gpus);
}

// Numeric flags outside their range: one line each, before anything runs.
void check_numbers(const Args& a) {
  using weft::check;
  check(a.global_batch >= 0, "--global-batch-size ({}) must be positive (0: one micro-batch)",
        a.global_batch);
  check(a.lr_warmup_iters >= 0, "--lr-warmup-iters ({}) must not be negative", a.lr_warmup_iters);
  check(a.lr_decay_iters >= 0, "--lr-decay-iters ({}) must not be negative (0: --train-iters)",
        a.lr_decay_iters);
  check(a.threads >= 0 && a.threads <= 4096,
        "--threads ({}) must be in [0, 4096] (0: cores / local ranks)", a.threads);
  check(a.seed >= 0, "--seed ({}) must not be negative", a.seed);
  check(a.gpt.max_positions >= 0,
        "--max-position-embeddings ({}) must be positive (or 0: --seq-length)",
        a.gpt.max_positions);
  check(std::isfinite(a.comm_timeout) && a.comm_timeout > 0 && a.comm_timeout <= 86400 * 7,
        "--comm-timeout ({}) must be a number of seconds in (0, 604800]", a.comm_timeout);
  check(a.sample >= 0, "--sample ({}) must not be negative", a.sample);
  check(a.keep_last >= 0, "--keep-last-checkpoints ({}) must not be negative (0: keep all)",
        a.keep_last);
  check(std::isfinite(a.sample_temperature) && a.sample_temperature >= 0,
        "--sample-temperature ({}) must be a number >= 0 (0: greedy)", a.sample_temperature);
  check(std::isfinite(a.weight_decay) && a.weight_decay >= 0,
        "--weight-decay ({}) must be a number >= 0", a.weight_decay);
  check(std::isfinite(a.lr), "--lr ({}) must be a number", a.lr);
  check(std::isfinite(a.clip_grad), "--clip-grad ({}) must be a number", a.clip_grad);
  check(a.tp > 0 && a.pp > 0, "--tp ({}) and --pp ({}) must be positive", a.tp, a.pp);
  check(a.virtual_stages >= 0 && a.layers_per_virtual >= 0,
        "--virtual-stages ({}) and --num-layers-per-virtual-pipeline-stage ({}) must not be "
        "negative",
        a.virtual_stages, a.layers_per_virtual);
}

weft::plan::ModelShape shape_of(const weft::GptConfig& cfg) {
  return {cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.seq_length, cfg.vocab_size};
}

PipelineSetup check_parallel(const Args& a, const weft::GptConfig& cfg, int world, int64_t global) {
  using namespace weft;
  check_numbers(a);
  MeshLayout layout(world, a.tp, a.pp);
  PipelineSetup p;
  p.device = resolve_device(a, world, p.staged, p.nccl);
  if (a.layers_per_virtual > 0) {
    check(cfg.num_layers % (a.pp * a.layers_per_virtual) == 0,
          "--num-layers ({}) must be divisible by --pp ({}) x "
          "--num-layers-per-virtual-pipeline-stage ({})",
          cfg.num_layers, a.pp, a.layers_per_virtual);
    p.chunks = static_cast<int>(cfg.num_layers / (a.pp * a.layers_per_virtual));
  } else if (a.virtual_stages > 0) {
    p.chunks = a.virtual_stages;
  } else {
    p.chunks = sched::default_chunks(a.schedule);
  }
  // The rules weft-sched plan searches under, in the same words: tensor
  // parallelism splits heads and the MLP's columns (the vocabulary is padded
  // to a multiple of tp, so any --vocab-size splits); every stage needs a layer; the batch splits into micro-batches x dp; the
  // schedule runs those sizes.
  plan::Layout l{layout.dp(), a.pp, a.tp, a.schedule, p.chunks, a.micro_batch, a.recompute,
                 a.distributed_optimizer};
  const std::string rule = plan::layout_rule(shape_of(cfg), global, world, l);
  check(rule.empty(), "{}", rule);
  p.micro_batches = global / (a.micro_batch * layout.dp());
  // Throws naming the rule when the schedule cannot run these sizes.
  if (a.pp > 1) {
    const sched::Schedule schedule =
        sched::make_schedule(a.schedule, a.pp, static_cast<int>(p.micro_batches), p.chunks);
    // NCCL runs each p2p step as a rendezvous: refuse a schedule that would
    // hang that way (interleaved 1F1B), naming where. Evidence: interleaved
    // 1F1B at pp 2 with 8 micro-batches, run without this refusal on the GPU
    // emulator's NCCL (a group completes once each peer reached the matching
    // group), hung at step 1 where this check says: rank 1 timed out at
    // action 14 (1RECV_F2) waiting for activation mb 2 chunk 0. Not yet tried
    // on a real NCCL.
    if (p.nccl) {
      const std::string stuck = sched::check_grouped_p2p(sched::lower(schedule));
      check(stuck.empty(),
            "--schedule {} cannot run over NCCL at --pp {} with {} micro-batches: with each "
            "p2p step a rendezvous, {}; use gpipe, 1f1b or zb-h1, or --comm-backend mpi",
            a.schedule, a.pp, p.micro_batches, stuck);
    }
  }
  parse_partition_method(a.partition);
  check(a.ddp_bucket_size > 0, "--ddp-bucket-size ({}) must be positive", a.ddp_bucket_size);
  GradSyncOptions sync;  // the compression flags, checked before any message
  sync.distributed_optimizer = a.distributed_optimizer;
  set_grad_compression(a, sync);
  // Compression shapes the data-parallel reduction; one replica has none.
  for (const auto& [flag, value, plain] :
       {std::tuple<const char*, const std::string&, const char*>{"--grad-reduce-dtype",
                                                                 a.grad_reduce_dtype, "fp32"},
        {"--grad-compression", a.grad_compression, "none"}})
    check(layout.dp() > 1 || value == plain,
          "{} {} compresses the data-parallel reduction, and there is none: dp is 1 (world {} / "
          "(tp {} x pp {}))",
          flag, value, world, a.tp, a.pp);
  check(a.sample == 0 || (a.pp == 1 && a.tp == 1),
        "--sample with --pp or --tp > 1 is not available yet (save a checkpoint and sample from "
        "it on one process)");
  if (a.pp == 1) check(a.trace.empty(), "--trace records pipeline actions: it needs --pp > 1");
  return p;
}

// "a", "a or b", "a, b or c".
std::string one_of(const std::vector<std::string>& names) {
  if (names.size() < 2) return names.empty() ? "" : names[0];
  return fmt::format("{} or {}",
                     fmt::join(names.begin(), names.end() - 1, ", "), names.back());
}

// The model family: --arch's, else the one whose parts Megatron's flags
// (--normalization and its kin) describe, else the job's first. Each flag
// given must describe the family, and each optional model flag given must be
// one the family reads.
const weft::ModelFamily& family_of(const Args& a, const CLI::App& app) {
  using weft::check;
  const std::vector<weft::ModelFamily>& families = a.job->families;
  check(!families.empty(), "{} has no model family to train", a.job->program);
  std::vector<std::string> names;
  for (const weft::ModelFamily& f : families) names.push_back(f.name);
  if (app.count("--normalization"))
    check(a.normalization == "LayerNorm" || a.normalization == "RMSNorm",
          "--normalization '{}' must be LayerNorm or RMSNorm", a.normalization);
  if (app.count("--position-embedding-type"))
    check(a.position_embedding_type == "learned_absolute" || a.position_embedding_type == "rope",
          "--position-embedding-type '{}' must be learned_absolute or rope",
          a.position_embedding_type);
  // The parts the flags describe, Megatron's defaults for those left out,
  // and the flags given, as a user wrote them.
  weft::ArchTraits said;
  std::vector<std::string> given;
  struct Part {
    const char* flag;
    bool given;
    std::string shown;
    std::function<bool(const weft::ArchTraits&)> agrees;
  };
  const std::vector<Part> parts = {
      {"--normalization", app.count("--normalization") > 0, a.normalization,
       [&](const weft::ArchTraits& t) { return t.normalization == a.normalization; }},
      {"--position-embedding-type", app.count("--position-embedding-type") > 0,
       a.position_embedding_type,
       [&](const weft::ArchTraits& t) {
         return t.position_embedding_type == a.position_embedding_type;
       }},
      {"--swiglu", a.swiglu, "", [](const weft::ArchTraits& t) { return t.swiglu; }},
      {"--untie-embeddings-and-output-weights", a.untie, "",
       [](const weft::ArchTraits& t) { return t.untie; }},
      {"--disable-bias-linear", a.disable_bias, "",
       [](const weft::ArchTraits& t) { return t.disable_bias; }},
  };
  for (const Part& p : parts)
    if (p.given) given.push_back(p.shown.empty() ? p.flag : fmt::format("{} {}", p.flag, p.shown));
  if (app.count("--normalization")) said.normalization = a.normalization;
  if (app.count("--position-embedding-type")) said.position_embedding_type = a.position_embedding_type;
  said.swiglu = a.swiglu, said.untie = a.untie, said.disable_bias = a.disable_bias;
  auto same = [](const weft::ArchTraits& x, const weft::ArchTraits& y) {
    return x.normalization == y.normalization &&
           x.position_embedding_type == y.position_embedding_type && x.swiglu == y.swiglu &&
           x.untie == y.untie && x.disable_bias == y.disable_bias;
  };
  const weft::ModelFamily* family = nullptr;
  if (!a.arch.empty()) {
    for (const weft::ModelFamily& f : families)
      if (f.name == a.arch) family = &f;
    check(family != nullptr, "--arch '{}' must be {}", a.arch, one_of(names));
    for (const Part& p : parts) {
      if (!p.given || (family->traits && p.agrees(*family->traits))) continue;
      const std::string flag = p.shown.empty() ? p.flag : fmt::format("{} {}", p.flag, p.shown);
      for (const weft::ModelFamily& f : families)
        check(!f.traits || !p.agrees(*f.traits), "{} describes the {} family, but --arch is {}",
              flag, f.name, family->name);
      throw weft::Error("{} describes no part of the {} family{}", flag, family->name,
                        family->traits ? " (" + family->traits->describe() + ")" : "");
    }
  } else if (given.empty()) {
    family = &families.front();
  } else {
    std::vector<std::string> known;
    for (const weft::ModelFamily& f : families) {
      if (!f.traits) continue;
      if (!family && same(*f.traits, said)) family = &f;
      known.push_back(fmt::format("{} ({})", f.name, f.traits->describe()));
    }
    check(family != nullptr,
          "{} describe{} no model family (flags left out are Megatron's defaults: {}); the "
          "families are {}: give all of one's flags, or --arch",
          fmt::join(given, " "), given.size() == 1 ? "s" : "", weft::ArchTraits{}.describe(),
          known.empty() ? std::string("none of these") : fmt::format("{}", fmt::join(known, "; ")));
  }
  // The optional model flags.
  for (const auto& [flag, on] :
       {std::pair<const char*, bool>{"--group-query-attention", a.gqa},
        {"--num-query-groups", app.count("--num-query-groups") > 0},
        {"--ffn-hidden-size", app.count("--ffn-hidden-size") > 0},
        {"--rotary-base", app.count("--rotary-base") > 0}}) {
    if (!on || std::count(family->reads.begin(), family->reads.end(), flag)) continue;
    std::vector<std::string> readers;
    for (const weft::ModelFamily& f : families)
      if (std::count(f.reads.begin(), f.reads.end(), flag)) readers.push_back(f.name);
    throw weft::Error("{} is not a flag of the {} family{}", flag, family->name,
                      readers.empty() ? "" : fmt::format(" ({} reads it)", one_of(readers)));
  }
  check(a.gqa || !app.count("--num-query-groups"),
        "--num-query-groups {} needs --group-query-attention (without it every head has its own "
        "key and value)",
        a.num_query_groups);
  check(!app.count("--num-query-groups") || a.num_query_groups >= 1,
        "--num-query-groups ({}) must be >= 1", a.num_query_groups);
  return *family;
}

// What the family builds from: the shape, and the optional flags it reads.
weft::ModelArgs model_args(const Args& a, const weft::GptConfig& cfg) {
  weft::ModelArgs m;
  m.shape = cfg;
  m.micro_batch = a.micro_batch;
  // Megatron's default: --group-query-attention alone shares one key/value head.
  m.num_query_groups = a.gqa ? (a.num_query_groups > 0 ? a.num_query_groups : 1) : 0;
  m.ffn_hidden_size = a.ffn_hidden_size;
  m.rotary_base = a.rotary_base;
  return m;
}

// The preset, with explicit shape flags overriding it.
// The shape the flags describe: the preset, with explicit shape flags (and
// those taken from the checkpoint) overriding it. Not validated.
weft::GptConfig flag_config(const Args& a, const CLI::App& app) {
  auto given = [&](const char* flag) {
    return app.count(flag) > 0 || a.from_checkpoint.count(flag) > 0;
  };
  weft::GptConfig cfg = a.model.empty() ? a.gpt : weft::gpt_preset(a.model);
  if (given("--num-layers")) cfg.num_layers = a.gpt.num_layers;
  if (given("--hidden-size")) cfg.hidden_size = a.gpt.hidden_size;
  if (given("--num-attention-heads")) cfg.num_heads = a.gpt.num_heads;
  if (given("--seq-length")) cfg.seq_length = a.gpt.seq_length;
  if (given("--max-position-embeddings")) cfg.max_positions = a.gpt.max_positions;
  if (given("--vocab-size")) cfg.vocab_size = a.gpt.vocab_size;
  return cfg;
}

// Which checkpoint the run loads, and Megatron's --use-checkpoint-args (always
// on): a shape, data or batch flag left out is taken from the checkpoint's
// meta.json; one that contradicts it is an error naming both values, unless
// --override-checkpoint-args (the flags win) or --finetune (weights only, from
// step 0) is given. Run before anything else, on every rank.
// The paths a run writes or records, checked before anything starts rather
// than at the first save, after training: --save must be a folder (or be
// made one) whose checkpoint files' paths fit the system's limits, and what
// meta.json and the metrics file record must be UTF-8 (JSON text is). That
// --save can be written is checked by its lock (SaveDirLock), before step 1.
void check_paths(const Args& a) {
  namespace fs = std::filesystem;
  using weft::check;
  for (const auto& [flag, value] :
       {std::pair<const char*, const std::string*>{"--data-path", &a.data_path},
        {"--save", &a.save}, {"--load", &a.load}, {"--log-jsonl", &a.log_jsonl}}) {
    try {
      (void)nlohmann::json(*value).dump();
    } catch (const nlohmann::json::exception&) {
      throw weft::Error("{} is not valid UTF-8, and checkpoints and metrics record it as JSON "
                        "text: rename the path",
                        flag);
    }
  }
  if (a.save.empty()) return;
  const fs::path longest = fs::absolute(a.save) / "iter_0000000.tmp" / "optimizer.safetensors";
  check(longest.string().size() < PATH_MAX,
        "--save is too long: a checkpoint's files would have paths of {} bytes, past the "
        "system's limit of {}",
        longest.string().size(), PATH_MAX - 1);
  for (const fs::path& part : fs::absolute(a.save))
    check(part.string().size() <= NAME_MAX,
          "--save: the folder name '{}...' has {} bytes, past the system's limit of {}",
          part.string().substr(0, 16), part.string().size(), NAME_MAX);
  std::error_code ec;
  check(!fs::exists(a.save, ec) || fs::is_directory(a.save, ec),
        "--save {} is a file, not a folder: checkpoints are folders inside it", a.save);
}

void adopt_checkpoint_args(Args& a, const CLI::App& app) {
  using weft::check;
  check_paths(a);
  check(!a.no_load || a.load.empty(), "--no-load and --load {} contradict each other", a.load);
  check(a.no_load || !a.load.empty() || !a.overwrite_checkpoints,
        "--overwrite-checkpoints only matters with --no-load or --load (a run resumes from "
        "--save otherwise)");
  check(!a.load_unverified || !a.load.empty(),
        "--load-unverified loads the folder --load names: give it with --load DIR/iter_N");
  check(!a.finetune || !a.load.empty(),
        "--finetune starts from the weights of --load DIR: give the checkpoint to start from");
  check(!a.finetune || !a.no_load, "--finetune loads --load {}; --no-load contradicts it", a.load);
  if (!a.save.empty()) weft::check_fault_injection();
  // The checkpoint a resume from --save would read: the newest that verifies.
  const weft::CheckpointSource existing =
      a.save.empty() ? weft::CheckpointSource{} : weft::scan_checkpoints(a.save);
  const bool holds = existing.step >= 0 || !existing.skipped.empty();
  check(!a.no_load || !holds || a.overwrite_checkpoints,
        "--save {} already holds checkpoints ({}): run without --no-load to resume from it, add "
        "--overwrite-checkpoints to start over and replace them, or save elsewhere",
        a.save,
        existing.step >= 0 ? fmt::format("the newest is step {}", existing.step)
                           : "none of them verifies");
  check(a.no_load || !a.load.empty() || existing.step >= 0 || existing.skipped.empty(),
        "--save {} holds checkpoints, but none of them verifies ({}): resume from a good copy "
        "with --load, or start over with --no-load --overwrite-checkpoints",
        a.save, existing.skipped.empty() ? "" : existing.skipped.front().second);
  // Resume: --load, else the newest checkpoint in --save, unless --no-load. A
  // fine-tune that has saved already (a restarted job) resumes its own checkpoints.
  if (a.finetune && existing.step >= 0) {
    a.resume_from = a.save;
    a.notes.push_back(fmt::format(
        "--finetune: --save {} holds this fine-tune's step {} already, so the run resumes from "
        "it; --load {} is not read (to start the fine-tune over, save elsewhere)",
        a.save, existing.step, a.load));
  } else {
    a.resume_from = !a.load.empty() ? a.load : (!a.no_load && existing.step >= 0 ? a.save : "");
    a.weights_only = a.finetune;
  }
  if (a.resume_from.empty()) return;
  // Its meta.json: the scan of --save has verified that folder already.
  const weft::CheckpointSource from =
      a.resume_from == a.save ? existing
                              : weft::open_checkpoint(a.resume_from, a.load_unverified).source;
  const std::string folder = from.path;
  // A rewind: this run's first save would remove --save's newer checkpoints.
  if (!a.save.empty() && a.resume_from != a.save) {
    const int64_t start = a.weights_only ? 0 : from.step;
    const std::vector<std::string> newer = weft::checkpoints_after(a.save, start);
    check(newer.empty() || a.overwrite_checkpoints,
          "--load {} starts after step {}, but --save {} holds newer checkpoints ({}): the run's "
          "first save would remove them; add --overwrite-checkpoints to let it, or save "
          "elsewhere",
          a.resume_from, start, a.save, fmt::join(newer, ", "));
    a.rewound = newer;
  }
  const std::string where = (std::filesystem::path(folder) / "meta.json").string();
  nlohmann::json meta;
  try {
    std::ifstream(where) >> meta;
  } catch (const nlohmann::json::exception& e) {
    throw weft::Error("--load {}: {} is not valid JSON: {}", a.resume_from, where, e.what());
  }
  const nlohmann::json saved = meta.contains("config") && meta["config"].is_object()
                                   ? meta["config"]
                                   : nlohmann::json::object();
  const bool free = a.override_checkpoint_args || a.weights_only;
  std::vector<std::string> adopted;
  // One field: `key` in meta.json, `flag` on the command line. `given` says
  // whether the flags set it; `ours` is the value they give; `take` adopts
  // the checkpoint's.
  auto field = [&](const char* key, const char* flag, bool given, const nlohmann::json& ours,
                   const std::function<void(const nlohmann::json&)>& take, bool must_agree = true) {
    if (!saved.contains(key)) return;
    const nlohmann::json& theirs = saved[key];
    if (given) {
      // Paths agree when they name the same file.
      const bool same = ours == theirs || (ours.is_string() && theirs.is_string() &&
                                           std::filesystem::weakly_canonical(ours.get<std::string>()) ==
                                               std::filesystem::weakly_canonical(theirs.get<std::string>()));
      check(!must_agree || free || same,
            "{} {} contradicts the checkpoint's {} {} ({}): drop the flag to use the "
            "checkpoint's, or add --override-checkpoint-args (or --finetune: its weights only, "
            "from step 0)",
            flag, ours.dump(), key, theirs.dump(), where);
      if (!same && !a.weights_only)
        a.notes.push_back(fmt::format("{} {} differs from the checkpoint's {}: the flag's is used",
                                      flag, ours.dump(), theirs.dump()));
      return;
    }
    take(theirs);
    a.from_checkpoint.insert(flag);
    adopted.push_back(fmt::format("{} {}", flag,
                                  theirs.is_string() ? theirs.get<std::string>() : theirs.dump()));
  };
  const weft::GptConfig flags = flag_config(a, app);
  const bool preset = !a.model.empty();
  auto shape = [&](const char* key, const char* flag, int64_t ours, int64_t& dest) {
    field(key, flag, preset || app.count(flag) > 0, ours,
          [&](const nlohmann::json& v) { dest = v.get<int64_t>(); });
  };
  // The family: --arch, or the one the flags of its parts name.
  const bool arch_given = app.count("--arch") || app.count("--normalization") ||
                          app.count("--position-embedding-type") || a.swiglu || a.untie ||
                          a.disable_bias;
  field("arch", "--arch", arch_given, arch_given ? family_of(a, app).name : a.arch,
        [&](const nlohmann::json& v) { a.arch = v.get<std::string>(); });
  const weft::ModelFamily& family = family_of(a, app);
  auto reads = [&](const char* flag) {
    return std::count(family.reads.begin(), family.reads.end(), flag) > 0;
  };
  shape("num_layers", "--num-layers", flags.num_layers, a.gpt.num_layers);
  shape("hidden_size", "--hidden-size", flags.hidden_size, a.gpt.hidden_size);
  shape("num_heads", "--num-attention-heads", flags.num_heads, a.gpt.num_heads);
  shape("seq_length", "--seq-length", flags.seq_length, a.gpt.seq_length);
  shape("vocab_size", "--vocab-size", flags.vocab_size, a.gpt.vocab_size);
  // Padding changes no result but rounding: a resume keeps the checkpoint's
  // unless the flag says otherwise (checkpoints hold the true rows only).
  field("make_vocab_size_divisible_by", "--make-vocab-size-divisible-by",
        app.count("--make-vocab-size-divisible-by") > 0, a.vocab_divisor,
        [&](const nlohmann::json& v) { a.vocab_divisor = v.get<int64_t>(); },
        /*must_agree=*/false);
  shape("max_positions", "--max-position-embeddings", flags.positions(), a.gpt.max_positions);
  if (reads("--ffn-hidden-size"))
    field("ffn_hidden_size", "--ffn-hidden-size", app.count("--ffn-hidden-size") > 0,
          a.ffn_hidden_size, [&](const nlohmann::json& v) { a.ffn_hidden_size = v.get<int64_t>(); });
  if (reads("--rotary-base"))
    field("rotary_base", "--rotary-base", app.count("--rotary-base") > 0, a.rotary_base,
          [&](const nlohmann::json& v) { a.rotary_base = v.get<float>(); });
  if (reads("--num-query-groups")) {
    const bool gqa_given = app.count("--group-query-attention") || app.count("--num-query-groups");
    const int64_t heads = flag_config(a, app).num_heads;  // the checkpoint's, when taken
    field("num_query_groups", "--num-query-groups", gqa_given,
          a.gqa ? (a.num_query_groups > 0 ? a.num_query_groups : 1) : heads,
          [&](const nlohmann::json& v) {
            if (v.get<int64_t>() == heads) return;  // one per head: no grouped-query attention
            a.gqa = true;
            a.num_query_groups = v.get<int64_t>();
          });
  }
  field("optimizer", "--optimizer", app.count("--optimizer") > 0,
        weft::optimizer_name(weft::parse_optimizer(a.optimizer)),
        [&](const nlohmann::json& v) {
          const std::string name = v.get<std::string>();
          a.optimizer = name == "sgd" || name == "lion" ? name : "adam";
        });
  field("data_path", "--data-path", !a.data_path.empty(), a.data_path,
        [&](const nlohmann::json& v) { a.data_path = v.get<std::string>(); });
  field("micro_batch_size", "--micro-batch-size", app.count("--micro-batch-size") > 0,
        a.micro_batch, [&](const nlohmann::json& v) { a.micro_batch = v.get<int64_t>(); },
        /*must_agree=*/false);
  field("global_batch_size", "--global-batch-size", app.count("--global-batch-size") > 0,
        a.global_batch > 0 ? a.global_batch : a.micro_batch,
        [&](const nlohmann::json& v) { a.global_batch = v.get<int64_t>(); });
  field("seed", "--seed", app.count("--seed") > 0, a.seed,
        [&](const nlohmann::json& v) { a.seed = v.get<int64_t>(); });
  field("split", "--split", app.count("--split") > 0, a.split,
        [&](const nlohmann::json& v) { a.split = v.get<std::string>(); });
  // The learning-rate schedule (decay over the steps it was given, not over
  // a new --train-iters): taken when left out; a flag that differs is refused
  // unless --override-opt_param-scheduler (Megatron's) lets the flags win.
  const bool new_schedule = !a.override_scheduler;
  field("lr", "--lr", app.count("--lr") > 0, a.lr,
        [&](const nlohmann::json& v) { a.lr = v.get<float>(); }, new_schedule);
  field("min_lr", "--min-lr", app.count("--min-lr") > 0, a.min_lr,
        [&](const nlohmann::json& v) { a.min_lr = v.get<float>(); }, new_schedule);
  field("lr_decay_style", "--lr-decay-style", app.count("--lr-decay-style") > 0, a.lr_decay_style,
        [&](const nlohmann::json& v) { a.lr_decay_style = v.get<std::string>(); }, new_schedule);
  field("lr_warmup_iters", "--lr-warmup-iters", app.count("--lr-warmup-iters") > 0,
        a.lr_warmup_iters, [&](const nlohmann::json& v) { a.lr_warmup_iters = v.get<int64_t>(); },
        new_schedule);
  field("lr_decay_iters", "--lr-decay-iters", app.count("--lr-decay-iters") > 0,
        a.lr_decay_iters, [&](const nlohmann::json& v) { a.lr_decay_iters = v.get<int64_t>(); },
        new_schedule);
  // The data file itself: the same path may hold other bytes now.
  if (saved.contains("data_fingerprint") && !free &&
      std::filesystem::weakly_canonical(a.data_path) ==
          std::filesystem::weakly_canonical(saved.value("data_path", ""))) {
    const nlohmann::json now = weft::data_fingerprint(a.data_path);
    check(now.is_null() || now == saved["data_fingerprint"],
          "--data-path {} has changed since the checkpoint was saved ({} then, {} now): the "
          "resumed run would not read the batches the saved steps continue; add "
          "--override-checkpoint-args to train on it anyway",
          a.data_path, saved["data_fingerprint"].dump(), now.dump());
  }
  // Mixed precision: a resume that names none takes the checkpoint's (an
  // fp16 run's loss scale resumes with it); one named on the command line
  // wins, since a run may change its precision.
  if (saved.contains("precision") && !a.bf16 && !a.fp16 && !a.tf32) {
    const nlohmann::json& p = saved["precision"];
    check(p == "fp32" || p == "bf16" || p == "fp16",
          "--load {}: {}'s config.precision {} is not \"fp32\", \"bf16\" or \"fp16\"",
          a.resume_from, where, p.dump());
    if (p != "fp32") {
      (p == "bf16" ? a.bf16 : a.fp16) = true;
      const std::string flag = "--" + p.get<std::string>();
      a.from_checkpoint.insert(flag);
      adopted.push_back(flag);
    }
  }
  if (!adopted.empty())
    a.adopted_note = fmt::format("from the checkpoint ({}): {}", where, fmt::join(adopted, " "));
}

// --ps-ranks and its companions, before any message: what the servers do not
// support yet is refused rather than ignored.
void check_param_servers(const Args& a, const CLI::App& app, int world) {
  using weft::check;
  check(a.ps_ranks >= 0, "--ps-ranks ({}) must not be negative", a.ps_ranks);
  check(a.max_staleness >= 0, "--max-staleness ({}) must be >= 0 (0: synchronous)",
        a.max_staleness);
  if (a.ps_ranks == 0) {
    for (const char* flag : {"--max-staleness", "--slow-rank", "--slow-factor"})
      check(app.count(flag) == 0, "{} shapes the parameter servers: it needs --ps-ranks", flag);
    return;
  }
  check(a.ps_ranks < world,
        "--ps-ranks {} must be below the world size {}: at least one rank must be a worker",
        a.ps_ranks, world);
  check(a.tp <= 0 || a.pp <= 0 || (world - a.ps_ranks) % (a.tp * a.pp) == 0,
        "--ps-ranks {} leaves {} worker ranks, which --tp {} x --pp {} must divide: each worker is "
        "a group of tp x pp ranks",
        a.ps_ranks, world - a.ps_ranks, a.tp, a.pp);
  check(app.count("--slow-rank") == app.count("--slow-factor"),
        "--slow-rank and --slow-factor go together: which worker, and how much slower");
  check(a.slow_rank < 0 || a.slow_rank < world - a.ps_ranks,
        "--slow-rank {} is not a worker: the workers are ranks 0..{}", a.slow_rank,
        world - a.ps_ranks - 1);
  check(!app.count("--slow-factor") || (std::isfinite(a.slow_factor) && a.slow_factor > 1),
        "--slow-factor ({}) must be a number > 1", a.slow_factor);
  // Not built yet with servers: say so instead of running something else.
  for (const char* flag : {"--exit-interval",
                           "--exit-duration-in-mins", "--use-distributed-optimizer",
                           "--local-steps", "--check-for-spiky-loss", "--sample", "--init-from",
                           "--grad-compression", "--grad-reduce-dtype", "--finetune"})
    check(app.count(flag) == 0,
          "{} is not available with --ps-ranks yet: the servers hold the parameters and the "
          "optimizer, and the other ranks cannot stop, fine-tune or reduce without them",
          flag);
}

// Pipeline flags that would change nothing are refused: every accepted flag
// does something.
void check_pipeline_flags(const Args& a, const CLI::App& app) {
  using weft::check;
  const std::vector<std::string> names = weft::sched::schedule_names();
  check(std::find(names.begin(), names.end(), a.schedule) != names.end(),
        "--schedule '{}' is not a schedule (one of: {})", a.schedule, fmt::join(names, ", "));
  if (a.pp == 1) {
    for (const char* flag : {"--schedule", "--virtual-stages", "--num-layers-per-virtual-pipeline-stage",
                             "--partition", "--profile", "--recompute", "--memory-budget",
                             "--overlap-p2p-comm"})
      check(app.count(flag) == 0,
            "{} shapes the pipeline, and there is none: it needs --pp > 1 (--pp is 1)", flag);
    return;
  }
  if (!a.memory_budget.empty()) weft::parse_bytes("--memory-budget", a.memory_budget);
  // The chunk counts each schedule runs, as weft-sched checks them.
  if (app.count("--virtual-stages")) {
    const std::string rule = weft::sched::chunks_rule(a.schedule, a.virtual_stages);
    check(rule.empty(), "--virtual-stages {}: {}", a.virtual_stages, rule);
  }
  check(!app.count("--num-layers-per-virtual-pipeline-stage") ||
            weft::sched::default_chunks(a.schedule) > 1,
        "--num-layers-per-virtual-pipeline-stage gives each rank several model chunks, which "
        "only interleaved-1f1b and zb-v run; --schedule {} runs one per rank",
        a.schedule);
  // Recompute folds each W into its I, which turns a zero-bubble order into 1F1B's.
  if (a.recompute) {
    const std::string rule = weft::plan::recompute_rule(a.schedule);
    check(rule.empty(), "{}", rule);
  }
}

// --plan auto: search the layouts weft-sched plan searches, under the same
// rules and costs, and set the layout flags to the fastest. A layout flag
// the command gives fixes that dimension; when no plan has it, the flag is
// refused, naming it.
void apply_plan(Args& a, const CLI::App& app, int world) {
  using weft::check;
  const bool planning = !a.plan.empty();
  for (const char* flag : {"--plan-costs", "--plan-memory", "--plan-link-latency",
                           "--plan-bandwidth", "--plan-cores", "--plan-compute-scale",
                           "--plan-wake"})
    check(planning || app.count(flag) == 0, "{} sets up the planner: it needs --plan auto", flag);
  if (!planning) return;
  check(a.plan == "auto", "--plan '{}' must be auto (weft-sched plan prints the others)", a.plan);
  check(!a.plan_costs.empty(),
        "--plan auto needs --plan-costs FILE: node costs that {} --pp 2 --profile FILE "
        "measured for this model",
        a.job->program);
  check(app.count("--global-batch-size") > 0 || a.global_batch > 0,
        "--plan auto needs --global-batch-size: the planner splits it into micro-batches");
  for (const char* flag : {"--num-layers-per-virtual-pipeline-stage", "--ps-ranks"})
    check(app.count(flag) == 0,
          "{} contradicts --plan auto, which chooses the layout (fix the chunks with "
          "--virtual-stages, or drop --plan)",
          flag);
  check(std::isfinite(a.plan_compute_scale) && a.plan_compute_scale > 0,
        "--plan-compute-scale ({}) must be a positive number", a.plan_compute_scale);
  check(a.plan_latency >= 0 && std::isfinite(a.plan_latency),
        "--plan-link-latency ({}) must be seconds >= 0", a.plan_latency);
  check(a.plan_bandwidth > 0, "--plan-bandwidth ({}) must be positive", a.plan_bandwidth);
  check(a.plan_wake >= 0 && std::isfinite(a.plan_wake), "--plan-wake ({}) must be seconds >= 0",
        a.plan_wake);
  const weft::GptConfig cfg = flag_config(a, app);
  weft::plan::PlanInput in;
  in.shape = shape_of(cfg);
  in.global_batch = a.global_batch;
  in.machine.world = world;
  in.machine.intra = {a.plan_latency, a.plan_bandwidth};
  in.machine.inter = in.machine.intra;
  in.machine.wake = a.plan_wake;
  if (!a.plan_memory.empty()) in.machine.memory = weft::parse_bytes("--plan-memory", a.plan_memory);
  in.machine.cores = a.plan_cores ? *a.plan_cores
                                  : static_cast<double>(std::max(1u, std::thread::hardware_concurrency()));
  check(std::isfinite(in.machine.cores) && in.machine.cores >= 0,
        "--plan-cores ({}) must be a number of cores >= 0 (0: one per rank)", in.machine.cores);
  std::ifstream file(a.plan_costs);
  check(file.good(), "--plan-costs {}: cannot open the file", a.plan_costs);
  nlohmann::json profile;
  try {
    profile = nlohmann::json::parse(file);
  } catch (const nlohmann::json::exception& e) {
    throw weft::Error("--plan-costs {}: not valid JSON ({})", a.plan_costs, e.what());
  }
  in.costs = weft::plan::profile_costs(profile, a.plan_costs);
  in.costs.compute_scale = a.plan_compute_scale;
  // The layout flags given are constraints.
  std::vector<std::string> fixed;
  weft::plan::Constraints& fx = in.fixed;
  if (app.count("--tensor-model-parallel-size")) fx.tp = a.tp, fixed.push_back(fmt::format("--tp {}", a.tp));
  if (app.count("--pipeline-model-parallel-size")) fx.pp = a.pp, fixed.push_back(fmt::format("--pp {}", a.pp));
  if (app.count("--schedule")) fx.schedule = a.schedule, fixed.push_back("--schedule " + a.schedule);
  if (app.count("--virtual-stages"))
    fx.chunks = a.virtual_stages, fixed.push_back(fmt::format("--virtual-stages {}", a.virtual_stages));
  if (app.count("--micro-batch-size"))
    fx.micro_batch = a.micro_batch, fixed.push_back(fmt::format("--micro-batch-size {}", a.micro_batch));
  if (app.count("--recompute")) fx.recompute = true, fixed.push_back("--recompute");
  if (app.count("--use-distributed-optimizer"))
    fx.zero1 = true, fixed.push_back("--use-distributed-optimizer");
  // Pipeline flags need a pipeline: a plan at pp 1 would have them refused.
  const bool needs_pipeline = app.count("--schedule") || app.count("--virtual-stages") ||
                              app.count("--recompute") || app.count("--partition") ||
                              app.count("--profile") || app.count("--memory-budget") ||
                              app.count("--trace") || app.count("--overlap-p2p-comm");
  const weft::plan::PlanResult r = weft::plan::plan(in);
  const weft::plan::Plan* best = nullptr;
  for (const weft::plan::Plan& p : r.plans)
    if (!needs_pipeline || p.layout.pp > 1) {
      best = &p;
      break;
    }
  check(best != nullptr,
        "--plan auto: no layout of {} ranks runs{}{}: {} refused{}", world,
        fixed.empty() ? "" : " with ", fmt::join(fixed, " "), r.refused,
        r.reasons.empty() ? std::string() : ", e.g. " + r.reasons.front().first);
  const weft::plan::Layout& l = best->layout;
  a.tp = l.tp;
  a.pp = l.pp;
  a.micro_batch = l.micro_batch;
  a.distributed_optimizer = l.zero1;
  if (l.pp > 1) {
    a.schedule = l.schedule;
    a.virtual_stages = l.chunks;
    a.recompute = l.recompute;
  }
  a.plan_note = fmt::format(
      "plan auto: {}, predicted step {:.1f} ms, bubble {:.1f}%, {} per rank (the fastest of {} "
      "plans; {} refused): {}",
      l.describe(), 1e3 * best->step_time, 100 * best->bubble,
      weft::format_bytes(best->memory_per_rank), r.plans.size(), r.refused,
      fmt::join(l.flags(), " "));
}

weft::GptConfig resolve_config(const Args& a, const CLI::App& app) {
  check_pipeline_flags(a, app);
  weft::GptConfig cfg = flag_config(a, app);
  weft::check(a.vocab_divisor >= 1 && a.vocab_divisor <= (int64_t{1} << 20),
        "--make-vocab-size-divisible-by ({}) must be between 1 (no padding) and 2^20",
        a.vocab_divisor);
  // Megatron's rule: a multiple of the divisor on every tensor-parallel rank
  // (a --tp below 1 is refused by check_parallel).
  cfg.padded_vocab_size =
      weft::padded_vocab(cfg.vocab_size, a.vocab_divisor * std::max(a.tp, 1));
  // What the job reads (the data's windows and tokens); the family's own
  // rules next.
  weft::check(cfg.seq_length > 0, "--seq-length ({}) must be positive", cfg.seq_length);
  weft::check(cfg.vocab_size > 0 && cfg.vocab_size <= (int64_t{1} << 31) - 1,
              "--vocab-size ({}) must be between 1 and 2^31-1", cfg.vocab_size);
  const weft::ModelFamily& family = family_of(a, app);
  if (family.validate) family.validate(model_args(a, cfg));
  return cfg;
}

// Runs f() with every parameter in `params` on `device`, then returns those
// that were elsewhere to where they were: a measurement of the whole model
// on the run's device, before the layout has placed its stage's parameters
// there or after (those stay put). On a GPU the whole model's parameters and
// one micro-batch's activations must then fit on it.
template <typename F>
void with_params_on(const std::vector<weft::Param*>& params, weft::Device device, F&& f) {
  std::vector<std::pair<weft::Param*, weft::Device>> home;
  for (weft::Param* p : params)
    if (p->value.device() != device) home.emplace_back(p, p->value.device());
  weft::place_params(params, device);
  f();  // (when it throws, the run ends with its error)
  for (const auto& [p, where] : home) weft::place_params({p}, where);
}

// The partitioner's cost model: analytic FLOPs, or with --profile times
// measured on rank 0, on the run's device, and broadcast, so every rank cuts
// the model the same way.
weft::CostModel costs(const Args& a, weft::Graph& graph, const weft::ModelIO& io,
                      const weft::BatchSource& data, weft::Communicator& world,
                      weft::Device device) {
  using namespace weft;
  CostModel cost = CostModel::analytic(graph);
  if (a.profile.empty()) return cost;
  const int64_t n = static_cast<int64_t>(cost.nodes.size());
  Tensor t = Tensor::zeros({3 * n});
  float* d = t.data<float>();
  if (world.rank() == 0) {
    with_params_on(graph.params(), device,
                   [&] { cost = profile_costs(graph, io, data, a.micro_batch); });
    for (int64_t k = 0; k < n; ++k) {
      const NodeCost& c = cost.nodes[static_cast<size_t>(k)];
      d[3 * k] = static_cast<float>(c.f), d[3 * k + 1] = static_cast<float>(c.i);
      d[3 * k + 2] = static_cast<float>(c.w);
    }
    std::ofstream f(a.profile, std::ios::trunc);
    f << cost_model_json(cost, graph).dump(2) << '\n';
    check(f.good(), "--profile {}: cannot write", a.profile);
  }
  world.broadcast(t, 0);
  for (int64_t k = 0; k < n; ++k) {
    NodeCost& c = cost.nodes[static_cast<size_t>(k)];
    c.f = d[3 * k], c.i = d[3 * k + 1], c.w = d[3 * k + 2];
  }
  return cost;
}

// Parameters without the vocabulary tables' padding rows.
int64_t true_param_count(const weft::Graph& graph) {
  int64_t n = graph.param_count();
  for (const weft::Param* p : graph.params())
    if (p->true_rows > 0 && p->value.shape().rank > 0)
      n -= (p->value.shape()[0] - p->true_rows) * (p->value.numel() / p->value.shape()[0]);
  return n;
}

int run(const Args& a, const CLI::App& app, weft::Communicator* world) {
  using namespace weft;
  const GptConfig cfg = resolve_config(a, app);

  const int64_t global = a.global_batch > 0 ? a.global_batch : a.micro_batch;
  check(a.micro_batch > 0, "--micro-batch-size ({}) must be positive", a.micro_batch);
  check(global % a.micro_batch == 0,
        "--global-batch-size ({}) must be a multiple of --micro-batch-size ({})", global,
        a.micro_batch);
  check(a.train_iters >= 0, "--train-iters ({}) must not be negative", a.train_iters);
  check((a.profile_step_start < 0) == (a.profile_step_end < 0),
        "--profile-step-start ({}) and --profile-step-end ({}) go together", a.profile_step_start,
        a.profile_step_end);
  check(a.profile_step_start < a.profile_step_end || a.profile_step_start < 0,
        "--profile-step-end ({}) must be past --profile-step-start ({})", a.profile_step_end,
        a.profile_step_start);
  check(a.lr > 0, "--lr ({}) must be positive", a.lr);
  check(a.min_lr >= 0 && a.min_lr <= a.lr, "--min-lr ({}) must be between 0 and --lr ({})",
        a.min_lr, a.lr);
  check(a.lr_decay_style == "constant" || a.lr_decay_style == "cosine",
        "--lr-decay-style '{}' must be constant or cosine", a.lr_decay_style);
  check(a.beta1 >= 0 && a.beta1 < 1, "--adam-beta1 ({}) must be in [0, 1)", a.beta1);
  check(a.beta2 >= 0 && a.beta2 < 1, "--adam-beta2 ({}) must be in [0, 1)", a.beta2);
  check(a.eps > 0, "--adam-eps ({}) must be positive", a.eps);
  check(a.clip_grad >= 0, "--clip-grad ({}) must be >= 0 (0 turns clipping off)", a.clip_grad);
  check(std::isfinite(a.save_timeout) && a.save_timeout >= 0 && a.save_timeout <= 86400 * 7,
        "--save-timeout ({}) must be a number of seconds in [0, 604800] (0: no deadline)",
        a.save_timeout);
  check(std::isfinite(a.max_loss) && (a.max_loss >= 0 || a.max_loss == -1),
        "--max-loss ({}) must be >= 0 (0 turns the check off)", a.max_loss);
  check(a.log_interval > 0, "--log-interval ({}) must be positive", a.log_interval);
  check(a.save_interval >= 0, "--save-interval ({}) must be >= 0", a.save_interval);
  check(a.exit_interval >= 0, "--exit-interval ({}) must be >= 0", a.exit_interval);
  check(std::isfinite(a.exit_duration_mins) && a.exit_duration_mins >= 0,
        "--exit-duration-in-mins ({}) must be a number of minutes >= 0", a.exit_duration_mins);
  check(!a.data_path.empty(), "--data-path is required (a text file, or an llm.c .bin file)");
  check(!a.save.empty() || a.keep_last == 0,
        "--keep-last-checkpoints {} needs --save: it rotates the checkpoints written there",
        a.keep_last);
  check(a.check_spiky_loss || (!app.count("--spiky-loss-factor") && !app.count("--max-skipped-steps")),
        "--spiky-loss-factor and --max-skipped-steps set the loss-spike check: they need "
        "--check-for-spiky-loss");
  check(std::isfinite(a.spiky_loss_factor) && a.spiky_loss_factor > 1,
        "--spiky-loss-factor ({}) must be a number > 1", a.spiky_loss_factor);
  check(a.max_skipped_steps >= 0, "--max-skipped-steps ({}) must be >= 0", a.max_skipped_steps);
  // fp16's loss scaling: Megatron's flags, refused where they would do nothing.
  {
    const bool dynamic_flags = app.count("--initial-loss-scale") || app.count("--min-loss-scale") ||
                               app.count("--loss-scale-window") || app.count("--hysteresis");
    check(a.fp16 || (!app.count("--loss-scale") && !dynamic_flags),
          "--loss-scale, --initial-loss-scale, --min-loss-scale, --loss-scale-window and "
          "--hysteresis set fp16's loss scaling: they need --fp16");
    check(!app.count("--loss-scale") || (std::isfinite(a.loss_scale) && a.loss_scale > 0),
          "--loss-scale ({}) must be a positive number", a.loss_scale);
    check(!app.count("--loss-scale") || !dynamic_flags,
          "--initial-loss-scale, --min-loss-scale, --loss-scale-window and --hysteresis shape "
          "the dynamic loss scale, which --loss-scale {} replaces by a fixed one",
          a.loss_scale);
    check(std::isfinite(a.initial_loss_scale) && a.initial_loss_scale > 0,
          "--initial-loss-scale ({}) must be a positive number", a.initial_loss_scale);
    check(std::isfinite(a.min_loss_scale) && a.min_loss_scale > 0 &&
              a.min_loss_scale <= a.initial_loss_scale,
          "--min-loss-scale ({}) must be positive and at most --initial-loss-scale ({})",
          a.min_loss_scale, a.initial_loss_scale);
    check(a.loss_scale_window >= 1, "--loss-scale-window ({}) must be at least 1",
          a.loss_scale_window);
    check(a.hysteresis >= 1, "--hysteresis ({}) must be at least 1", a.hysteresis);
    check(!a.fp16 || (a.ps_ranks == 0 && a.local_steps == 0 && a.grad_compression == "none"),
          "--fp16 skips a step when the all-reduced gradients overflow: it cannot be combined "
          "with {}",
          a.ps_ranks > 0      ? fmt::format("--ps-ranks {} (the servers step)", a.ps_ranks)
          : a.local_steps > 0 ? fmt::format("--local-steps {} (gradients are not all-reduced)",
                                            a.local_steps)
                              : fmt::format("--grad-compression {} (the overflow would enter its "
                                            "error feedback)",
                                            a.grad_compression));
  }
  check(a.eval_interval > 0 || !app.count("--eval-iters"),
        "--eval-iters sets the batches of each validation: it needs --eval-interval");
  check(a.sample > 0 || a.tokenizer.empty(), "--tokenizer decodes samples: it needs --sample N");
  // Local SGD / DiLoCo: the replicas agree only every --local-steps steps, so
  // the run saves and stops there.
  check(a.optimizer == "sgd" || !app.count("--sgd-momentum"),
        "--sgd-momentum sets SGD's momentum: it needs --optimizer sgd");
  check(a.optimizer == "lion" || (!app.count("--lion-beta1") && !app.count("--lion-beta2")),
        "--lion-beta1 and --lion-beta2 set Lion's interpolation and momentum: they need "
        "--optimizer lion");
  for (const auto& [flag, beta] : {std::pair<const char*, float>{"--lion-beta1", a.lion_beta1},
                                   {"--lion-beta2", a.lion_beta2}})
    check(beta >= 0 && beta < 1, "{} ({}) must be in [0, 1)", flag, beta);
  check(a.local_steps >= 0, "--local-steps ({}) must be >= 0", a.local_steps);
  check(a.outer_optimizer == "none" || a.outer_optimizer == "nesterov",
        "--outer-optimizer '{}' must be none or nesterov", a.outer_optimizer);
  check(a.local_steps > 0 || !app.count("--outer-optimizer"),
        "--outer-optimizer steps the average of local SGD: it needs --local-steps");
  check(a.outer_optimizer == "nesterov" || (!app.count("--outer-lr") && !app.count("--outer-momentum")),
        "--outer-lr and --outer-momentum set DiLoCo's outer step: they need --outer-optimizer "
        "nesterov");
  if (a.local_steps > 0)
    for (const auto& [flag, n] : {std::pair<const char*, int64_t>{"--train-iters", a.train_iters},
                                  {"--save-interval", a.save_interval},
                                  {"--exit-interval", a.exit_interval}})
      check(n % a.local_steps == 0,
            "{} ({}) must be a multiple of --local-steps ({}): the replicas agree, and the run "
            "can save or stop, only after such steps",
            flag, n, a.local_steps);
  const std::string& load = a.resume_from;
  const int world_size = world ? world->size() : 1;
  check_param_servers(a, app, world_size);
  const int workers = world_size - a.ps_ranks;  // every rank when there are no servers
  const PipelineSetup setup = check_parallel(a, cfg, workers, global);
  std::optional<HostStagedCommunicator> staged_world;
  if (setup.staged) world = &staged_world.emplace(*world);
  std::unique_ptr<Communicator> nccl;  // over the MPI world, which carries host tensors
  if (setup.nccl) {
    nccl = nccl_world(*world, setup.device.index, world->options());
    world = nccl.get();
  }
  const bool rank0 = world == nullptr || world->rank() == 0;
  const nlohmann::json ranks = rank_table(world, setup.device);
  if (rank0) {
    for (const auto& r : ranks)
      fmt::print("rank {} | host {} | pid {} | {}\n", r["rank"].get<int>(),
                 r["host"].get<std::string>(), r["pid"].get<int>(), r["device"].get<std::string>());
    if (const char* path = std::getenv("WEFT_RANK_TABLE"); path != nullptr && *path != 0) {
      const std::string tmp = std::string(path) + ".tmp";
      std::ofstream(tmp) << nlohmann::json{{"ranks", ranks}}.dump() << '\n';
      check(std::rename(tmp.c_str(), path) == 0, "WEFT_RANK_TABLE {}: cannot write it", path);
    }
    std::fflush(stdout);
  }

  set_threads(a.threads > 0 ? a.threads : default_threads());
  TokenData data = TokenData::load(a.data_path);
  check(data.max_token() <= cfg.vocab_size,
        "{} holds token id {}, outside --vocab-size ({})", a.data_path, data.max_token() - 1,
        cfg.vocab_size);

  // Token data decodes through an llm.c tokenizer file; it cannot encode, so
  // a prompt is text data's only.
  std::optional<Tokenizer> tokenizer;
  if (!a.tokenizer.empty()) {
    check(!data.is_text(), "--tokenizer decodes token data; {} is text (bytes need none)",
          a.data_path);
    tokenizer = Tokenizer::load(a.tokenizer);
    check(tokenizer->vocab_size() >= data.max_token(),
          "--tokenizer {} has {} tokens; {} holds token id {}", a.tokenizer,
          tokenizer->vocab_size(), a.data_path, data.max_token() - 1);
  }
  check(data.is_text() || !app.count("--sample-prompt"),
        "--sample-prompt needs text data: {} holds token ids, and a tokenizer file only decodes "
        "(the sample starts from end-of-text)",
        a.data_path);
  check(a.eval_interval >= 0, "--eval-interval ({}) must be >= 0 (0: no validation)",
        a.eval_interval);
  check(a.eval_iters > 0, "--eval-iters ({}) must be positive", a.eval_iters);
  const DataSplit split = split_windows(a.split, data.windows(cfg.seq_length));
  check(a.eval_interval == 0 || split.valid > 0,
        "--eval-interval {} needs validation data: --split '{}' gives it none of the {} windows "
        "of {} tokens (e.g. --split 98,2,0)",
        a.eval_interval, a.split, data.windows(cfg.seq_length), cfg.seq_length);
  const double entropy = unigram_entropy(data);
  // The logical model; the layout instantiates this rank's part of it.
  const ModelFamily& family = family_of(a, app);
  JobModel model = family.build(model_args(a, cfg));
  Graph& graph = model.graph;
  model.io.graph = &graph;
  const ModelIO io = model.io;

  TrainOptions opt;
  opt.micro_batch = a.micro_batch;
  opt.global_batch = global;
  opt.lr.lr = a.lr;
  opt.lr.min_lr = a.min_lr;
  opt.lr.decay = a.lr_decay_style == "cosine" ? LrDecay::Cosine : LrDecay::Constant;
  opt.lr.warmup_iters = a.lr_warmup_iters;
  opt.lr.decay_iters = a.lr_decay_iters > 0 ? a.lr_decay_iters : a.train_iters;
  opt.adam = {a.beta1, a.beta2, a.eps, a.weight_decay};
  opt.clip_grad = a.clip_grad;
  opt.save_timeout_s = a.save_timeout;
  // A loss four times a uniform guess's, ln(vocabulary), is no training.
  opt.max_loss = a.max_loss >= 0 ? a.max_loss : 4 * std::log(static_cast<double>(cfg.vocab_size));
  opt.device = setup.device;
  opt.local = {a.local_steps, a.outer_optimizer == "nesterov", a.outer_lr, a.outer_momentum};
  opt.spike.enabled = a.check_spiky_loss;
  opt.spike.factor = a.spiky_loss_factor;
  opt.spike.max_skipped = a.max_skipped_steps;
  // Mixed precision rounds every GEMM's inputs. --bf16 also stores the
  // activations between nodes in bf16 (Megatron's --bf16); weights,
  // gradients and optimizer state stay fp32 (weft/ops.h). --fp16 keeps fp32
  // activations: its loss scale guards the gradients, not the values.
  if (a.tf32) ops::set_matmul_precision(setup.device, ops::MatmulPrecision::Tf32);
  if (a.bf16) {
    ops::set_matmul_precision(setup.device, ops::MatmulPrecision::Bf16);
    graph.set_activation_dtype(DType::BF16);
  }
  if (a.fp16) ops::set_matmul_precision(setup.device, ops::MatmulPrecision::Fp16);
  opt.loss_scale.enabled = a.fp16;
  opt.loss_scale.fixed = a.loss_scale;
  opt.loss_scale.initial = a.initial_loss_scale;
  opt.loss_scale.min = a.min_loss_scale;
  opt.loss_scale.window = a.loss_scale_window;
  opt.loss_scale.hysteresis = a.hysteresis;
  ops::set_attention_backend(setup.device, ops::parse_attention_backend(a.attention_backend));
  opt.config = {{"num_layers", cfg.num_layers},   {"hidden_size", cfg.hidden_size},
                {"num_heads", cfg.num_heads},     {"seq_length", cfg.seq_length},
                {"vocab_size", cfg.vocab_size},   {"max_positions", cfg.positions()},
                {"make_vocab_size_divisible_by", a.vocab_divisor},
                {"micro_batch_size", a.micro_batch}, {"global_batch_size", global},
                {"seed", a.seed},
                {"data_path", std::filesystem::absolute(a.data_path).string()},
                {"arch", family.name},
                {"optimizer", weft::optimizer_name(weft::parse_optimizer(a.optimizer))},
                {"precision", a.bf16 ? "bf16" : a.fp16 ? "fp16" : "fp32"},
                {"split", a.split},
                {"lr", a.lr},
                {"min_lr", a.min_lr},
                {"lr_decay_style", a.lr_decay_style},
                {"lr_warmup_iters", a.lr_warmup_iters},
                {"lr_decay_iters", opt.lr.decay_iters},
                {"data_fingerprint", weft::data_fingerprint(a.data_path)}};
  opt.config.update(model.config);  // the family's own fields
  TokenBatches batches(data, global, cfg.seq_length, 0, split.train);
  std::optional<TokenBatches> validation;
  if (split.valid > 0) validation.emplace(data, global, cfg.seq_length, split.train, split.valid);
  if (rank0 && split.train > 0)
    fmt::print("data split {}: windows [0, {}) train, [{}, {}) validate\n", a.split, split.train,
               split.train, split.train + split.valid);
  LayoutOptions lo;
  lo.tp = a.tp;
  lo.pp = a.pp;
  lo.schedule = a.schedule;
  lo.chunks = setup.chunks;
  lo.partition = parse_partition_method(a.partition);
  lo.pipeline = PipelineOptions{a.recompute, !a.trace.empty(), a.overlap_p2p_comm};
  if (!a.memory_budget.empty()) lo.memory_budget = parse_bytes("--memory-budget", a.memory_budget);
  lo.sync.distributed_optimizer = a.distributed_optimizer;
  lo.sync.bucket_elements = a.ddp_bucket_size;
  lo.sync.overlap = a.overlap_grad_reduce;
  set_grad_compression(a, lo.sync);
  // One writer per --save folder: world rank 0, the writer, locks it for the
  // job's life, before it touches anything there; a second job stops here.
  std::optional<SaveDirLock> save_lock;
  if (rank0 && !a.save.empty()) save_lock.emplace(a.save);
  // What an interrupted save left behind goes first (world rank 0 writes
  // checkpoints, so it cleans them).
  if (rank0 && !a.save.empty())
    for (const std::string& line : clean_stale_checkpoint_files(a.save)) fmt::print("{}\n", line);
  // Nobody reads before the cleaning is done; the disk bounds this wait.
  if (world != nullptr && !a.save.empty()) world->barrier_without_deadline();
  // Parameter servers: the last --ps-ranks ranks serve; the others train,
  // as data-parallel replicas of their own group.
  std::unique_ptr<Communicator> role;
  std::optional<PsWorker> ps_worker;
  if (a.ps_ranks > 0) {
    PsConfig ps;
    ps.servers = a.ps_ranks;
    ps.max_staleness = a.max_staleness;
    ps.optimizer = parse_optimizer(a.optimizer);
    ps.adam = opt.adam;
    ps.sgd = {a.sgd_momentum, a.weight_decay};
    ps.lion = {a.lion_beta1, a.lion_beta2, a.weight_decay};
    ps.lr = opt.lr;
    ps.clip_grad = opt.clip_grad;
    ps.save_interval = a.save.empty() ? 0 : a.save_interval;
    ps.save_last = !a.save.empty();
    if (world->rank() == a.slow_rank) ps.slow_factor = a.slow_factor;
    assign_to_servers(graph.params(), ps.servers);  // refuses too many servers on every rank
    std::vector<int> w(static_cast<size_t>(workers)), s(static_cast<size_t>(a.ps_ranks));
    std::iota(w.begin(), w.end(), 0);
    std::iota(s.begin(), s.end(), workers);
    role = world->split({w, s}, "ps");
    if (rank0)
      fmt::print("parameter servers: world ranks {}..{} serve {} workers (ranks 0..{}), "
                 "--max-staleness {}\n",
                 workers, world_size - 1, workers, workers - 1, a.max_staleness);
    if (world->rank() >= workers) {
      for (Param* p : graph.params()) init_param(*p, static_cast<uint64_t>(a.seed));
      PsServer server(*world, *role, graph.params(), ps);
      int64_t first = 0;
      if (!load.empty()) {
        const Checkpoint c = open_checkpoint(load, a.load_unverified);
        server.load(c);
        first = c.meta.step;
      }
      server.serve(first, a.train_iters);
      return 0;
    }
    ps_worker.emplace(*world, graph.params(), ps);
    lo.ps = &*ps_worker;
  }
  Communicator* team = role ? role.get() : world;  // the ranks that train
  std::optional<CostModel> cost;
  if (a.pp > 1) cost = costs(a, graph, io, batches, *world, opt.device);
  RankLayout layout(team, graph, io, batches, opt, lo, static_cast<uint64_t>(a.seed),
                    cost ? &*cost : nullptr);
  if (!a.init_from.empty()) load_weights(a.init_from, layout.graph().params());
  if (rank0 && layout.mesh()) fmt::print("mesh: {}\n", layout.mesh()->layout.describe());
  PipelineExecutor* pipeline = layout.pipeline();
  const sched::Schedule& schedule = layout.schedule();
  if (pipeline) {
    // The plan's per-stage sums join the node costs: what weft-sched --costs reads.
    // With the whole model's layers on this process (tp 1), it also measures
    // what each stage's actions add to memory, for weft-sched's memory figures.
    if (rank0 && !a.profile.empty())
      with_params_on(graph.params(), opt.device, [&] {
        write_profile(a.profile, *cost, layout.plan(), graph,
                      a.tp == 1 ? measure_stage_bytes(graph, io, layout.plan(), batches,
                                                      a.micro_batch, a.recompute, opt.device)
                                : std::vector<sched::StageBytes>{},
                      a.recompute,
                      {{"micro_batch_size", a.micro_batch}, {"tp", a.tp},
                       {"num_layers", cfg.num_layers}, {"hidden_size", cfg.hidden_size},
                       {"num_attention_heads", cfg.num_heads}, {"seq_length", cfg.seq_length},
                       {"vocab_size", cfg.vocab_size}});
      });
    if (rank0) fmt::print("schedule {} over {} stages; partition {}:\n{}", a.schedule,
                          schedule.stages(), a.partition, layout.plan().describe(graph));
  }
  // Before the first step: the memory a micro-batch needs at the least. The
  // sum of every node's outputs (the activations kept for the backward) over
  // pp x tp ranks, and each rank's share of the weights, gradients and AdamW
  // moments, times the ranks on this host. A shape far too large for the
  // machine is refused here rather than found by the kernel's OOM killer.
  if (setup.device.is_cpu()) {
    const CostModel analytic = CostModel::analytic(graph);
    double outputs = 0;
    for (const NodeCost& c : analytic.nodes) outputs += c.output_bytes;
    const double shards = static_cast<double>(a.pp * a.tp);
    const double dp = static_cast<double>((world ? world->size() : 1) / (a.pp * a.tp));
    const double state = 4.0 * static_cast<double>(graph.param_count()) / shards *
                         (2.0 + 2.0 / (a.distributed_optimizer ? dp : 1.0));
    char host[64] = {};
    gethostname(host, sizeof host - 1);
    int here = 0;
    for (const auto& r : ranks) here += r["host"].get<std::string>() == host;
    const double need = (outputs / shards + state) * here;
    const double avail = static_cast<double>(host_memory_available());
    check(need <= avail,
          "out of host memory: this run needs at least {} on {} ({} rank{} x ({} of activations "
          "per micro-batch + {} of weights, gradients and AdamW state)), and {} are available: use "
          "a smaller --micro-batch-size or --seq-length, or more --pp or --tp ranks",
          format_bytes(need), host, here, here == 1 ? "" : "s", format_bytes(outputs / shards),
          format_bytes(state), format_bytes(avail));
  }
  Trainer& trainer = layout.trainer();
  if (!load.empty() && a.weights_only) {
    open_checkpoint(load, a.load_unverified).read_model(layout.graph().params());  // --finetune
  } else if (!load.empty()) {
    const CheckpointSource source = trainer.load(load, a.load_unverified);
    if (rank0) {
      for (const auto& [folder, why] : source.skipped)
        fmt::print("warning: skipped {}, which does not verify: {}\n", folder, why);
      if (!source.verified)
        fmt::print("note: {} has no manifest.json: loaded unverified (--load-unverified)\n",
                   source.path);
    }
  }
  if (rank0)
    for (const std::string& note : a.notes) fmt::print("note: {}\n", note);
  if (rank0 && !a.rewound.empty())
    fmt::print("note: --overwrite-checkpoints: the first save removes {} from --save (newer than "
               "the step this run starts after)\n",
               fmt::join(a.rewound, ", "));

  const int64_t padding = cfg.table_rows() - cfg.vocab_size;
  if (rank0 && padding > 0)
    fmt::print("vocabulary {} padded to {} (--make-vocab-size-divisible-by {} x tp {}): {} rows "
               "of zeros with masked logits, not saved\n",
               cfg.vocab_size, cfg.table_rows(), a.vocab_divisor, a.tp, padding);
  if (rank0) fmt::print("weft {} | layers {} | hidden {} | heads {} | seq {} | vocab {} | params {} "
             "| micro-batch {} x {} = global {} | {} | data {} ({} tokens, unigram entropy "
             "{:.3f} nats)\n",
             a.job->program, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.seq_length, cfg.vocab_size,
             true_param_count(graph), a.micro_batch,
             global / a.micro_batch, global,
             setup.device.is_cpu()
                 ? fmt::format("threads {}{}", get_threads(),
                               a.bf16 || a.fp16
                                   ? fmt::format(" {} (emulated on the CPU: GEMM inputs{} rounded, "
                                                 "slower than fp32)",
                                                 a.bf16 ? "bf16" : "fp16",
                                                 a.bf16 ? " and activations" : "")
                                   : "")
                 : fmt::format("{}{}{}", setup.device.str(),
                               a.tf32 ? " tf32" : a.bf16 ? " bf16" : a.fp16 ? " fp16" : "",
                               ops::attention_uses_fused(setup.device,
                                                         cfg.hidden_size / cfg.num_heads)
                                   ? " fused-attention"
                                   : ""),
             a.data_path, data.size(), entropy);
  if (rank0 && !a.adopted_note.empty()) fmt::print("{}\n", a.adopted_note);
  if (trainer.steps_done() > 0 && rank0)
    fmt::print("resumed from {} at step {}{}\n", load, trainer.steps_done(),
               a.load.empty() || a.finetune ? " (automatic: --save holds it; --no-load starts over)"
                                            : "");
  if (a.weights_only && rank0)
    fmt::print("fine-tuning from the weights of {} (--finetune: no optimizer state, step 0)\n",
               load);

  std::ofstream jsonl;
  if (!a.log_jsonl.empty() && rank0) {
    jsonl.open(a.log_jsonl, trainer.steps_done() > 0 ? std::ios::app : std::ios::trunc);
    check(jsonl.good(), "--log-jsonl {}: cannot open for writing", a.log_jsonl);
    // A header line for every start (a resumed run appends one): step records
    // are the lines with a "step".
    jsonl << nlohmann::json{{"start_step", trainer.steps_done()}, {"ranks", ranks}}.dump() << '\n';
  }
  // The family's count (GPT's: 6 x parameters without wpe + attention's
  // 12 L T C), else 6 x parameters.
  const double flops_per_token = model.flops_per_token > 0
                                     ? model.flops_per_token
                                     : 6.0 * static_cast<double>(true_param_count(graph));
  // Step losses are noisy (each reads one stretch of the data): summarise the
  // run by the mean of its last steps.
  constexpr size_t kRecent = 50;
  std::vector<double> recent, recent_ms;
  std::vector<std::pair<double, double>> train_points, val_points;  // (step, loss)
  const auto started = std::chrono::steady_clock::now();
  Tensor stop_flags = Tensor::zeros({2});
  // Signals are caught with --save; a time limit is checked whenever it is
  // set. Parameter servers take neither yet: a signal ends the job, which
  // resumes from its last checkpoint (scripts/weft-run).
  const bool catch_signals = !a.save.empty() && !ps_worker;
  if (catch_signals) install_stop_handlers(a.job->program);
  const bool check_stop = catch_signals || a.exit_duration_mins > 0;
  // Every save goes through here: once per step, pruned, and said.
  int64_t last_saved = trainer.steps_done();  // a resumed run's step is on disk already
  auto save = [&] {
    if (a.save.empty() || last_saved == trainer.steps_done()) return;
    trainer.save(a.save, a.keep_last);
    last_saved = trainer.steps_done();
    if (rank0) fmt::print("saved checkpoint at step {} to {}\n", trainer.steps_done(), a.save);
  };
  // A step's record, once read: the ETA's pace, the plot, the metrics file
  // and the log line.
  auto take = [&](const StepRecord& r, std::optional<double> val_loss) {
    if (recent.size() == kRecent) recent.erase(recent.begin()), recent_ms.erase(recent_ms.begin());
    recent.push_back(r.loss);
    recent_ms.push_back(r.step_ms);
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    // The remaining steps at the recent steps' mean pace.
    double mean_ms = 0;
    for (double ms : recent_ms) mean_ms += ms / static_cast<double>(recent_ms.size());
    const double eta = mean_ms / 1e3 * static_cast<double>(a.train_iters - r.step - 1);
    train_points.emplace_back(static_cast<double>(r.step + 1), r.loss);
    if (jsonl.is_open()) {
      auto j = r.json();
      j["gflops"] = flops_per_token * r.tokens_per_s / 1e9;
      j["elapsed_s"] = elapsed;
      if (val_loss) j["val_loss"] = *val_loss;
      jsonl << j.dump() << '\n';
      jsonl.flush();
    }
    if (rank0 && ((r.step + 1) % a.log_interval == 0 || r.step + 1 == a.train_iters || r.skipped))
      fmt::print("{} | {:.1f} GFLOP/s | elapsed {} | eta {}\n", r.line(a.train_iters),
                 flops_per_token * r.tokens_per_s / 1e9, duration(elapsed), duration(eta));
  };
  // The records not yet read; the last one's step evaluated when `eval`.
  auto take_all = [&](bool eval = false) {
    const std::vector<StepRecord>& records = trainer.take_records();
    std::optional<double> val_loss;
    if (eval) {
      val_loss = trainer.evaluate(*validation, a.eval_iters);
      val_points.emplace_back(static_cast<double>(trainer.steps_done()), *val_loss);
      if (rank0)
        fmt::print("validation loss {:.4f} at step {} ({} batches)\n", *val_loss,
                   trainer.steps_done(), a.eval_iters);
    }
    for (size_t i = 0; i < records.size(); ++i)
      take(records[i], i + 1 == records.size() ? val_loss : std::nullopt);
    std::fflush(stdout);
  };
  if (rank0 && trainer.steps_done() >= a.train_iters && a.train_iters > 0)
    fmt::print("note: the run resumes after step {}, and --train-iters is {}: no step to take "
               "(raise --train-iters to train further)\n",
               trainer.steps_done(), a.train_iters);
  while (trainer.steps_done() < a.train_iters) {
    if (trainer.steps_done() == a.profile_step_start) profiler_range(setup.device, true);
    // The records are read at logging, evaluation and save steps and at the
    // last: between them, on a GPU, the host queues steps without waiting
    // for the device (Trainer::launch_step).
    const int64_t next = trainer.steps_done() + 1;
    const bool eval_now =
        a.eval_interval > 0 && (next % a.eval_interval == 0 || next == a.train_iters);
    const bool save_now = a.save_interval > 0 && next % a.save_interval == 0;
    const bool read_now = next % a.log_interval == 0 || next == a.train_iters || eval_now ||
                          save_now || (a.exit_interval > 0 && next % a.exit_interval == 0);
    trainer.launch_step(read_now);
    if (read_now) take_all(eval_now);
    if (trainer.steps_done() == a.profile_step_end) profiler_range(setup.device, false);
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    if (a.save_interval > 0 && trainer.steps_done() % a.save_interval == 0) save();
    if (trainer.steps_done() >= a.train_iters) continue;
    // With --local-steps, the replicas agree (and can save) only every H steps.
    const bool can_stop = a.local_steps == 0 || trainer.steps_done() % a.local_steps == 0;
    const StopReason stop =
        check_stop && can_stop ? stop_requested(world, stop_flags,
                                    a.exit_duration_mins > 0 && elapsed >= a.exit_duration_mins * 60)
                   : StopReason{};
    const bool at_exit_interval = a.exit_interval > 0 && trainer.steps_done() % a.exit_interval == 0;
    if (stop.any() || at_exit_interval) {
      take_all();
      save();
      if (rank0) {
        const std::string why =
            stop.signal > 0 ? fmt::format("on {}", signal_name(stop.signal))
            : stop.out_of_time
                ? fmt::format("after {:g} minutes (--exit-duration-in-mins)", a.exit_duration_mins)
                : fmt::format("at --exit-interval {}", a.exit_interval);
        fmt::print("stopping {} after step {}; {}\n", why, trainer.steps_done(),
                   a.save.empty() ? std::string("nothing was saved (no --save)")
                                  : fmt::format("run again with --load {} to continue", a.save));
      }
      std::fflush(stdout);
      return 0;
    }
  }
  if (pipeline && !a.trace.empty()) {
    pipeline->write_trace(a.trace);
    if (rank0) fmt::print("wrote the trace of every action to {}\n", a.trace);
  }
  if (pipeline) {
    // Each rank's peak of activation memory in the last step, measured (arena
    // bytes) and as the schedule's model composes it from what this rank's
    // actions added (sched::memory_use): the two agree exactly.
    const int me = pipeline->group().rank();
    const double modelled =
        sched::memory_use(schedule, pipeline->stage_bytes(), a.recompute, a.overlap_p2p_comm)
            .peak[static_cast<size_t>(me)];
    Tensor all = Tensor::zeros({2 * a.pp}), mine = Tensor::zeros({2});
    mine.data<float>()[0] = static_cast<float>(pipeline->peak_bytes());
    mine.data<float>()[1] = static_cast<float>(modelled);
    pipeline->group().all_gather(mine, all);
    const std::vector<int> promised = sched::peak_in_flight(schedule, a.recompute);
    if (rank0) {
      std::vector<std::string> measured, composed;
      for (int r = 0; r < a.pp; ++r) {
        measured.push_back(format_bytes(all.data<float>()[2 * r]));
        composed.push_back(format_bytes(all.data<float>()[2 * r + 1]));
      }
      fmt::print("activation memory, peak per pipeline rank: [{}] held, [{}] by {}'s model; "
                 "[{}] micro-batch stages\n",
                 fmt::join(measured, ", "), fmt::join(composed, ", "), a.schedule,
                 fmt::join(promised, ", "));
    }
  }
  if (!recent.empty() && rank0) {
    double mean = 0;
    for (double l : recent) mean += l;
    mean /= static_cast<double>(recent.size());
    fmt::print("mean loss of the last {} steps: {:.4f} nats ({:.2f} bits per token); unigram "
               "entropy of the data: {:.4f} nats\n",
               recent.size(), mean, mean / std::log(2.0), entropy);
  }
  if (rank0 && !a.loss_plot.empty()) {
    write_loss_plot(a.loss_plot, train_points, val_points,
                    fmt::format("{} layers x {}, global batch {}", cfg.num_layers, cfg.hidden_size,
                                global));
    fmt::print("wrote the loss curve to {}\n", a.loss_plot);
  }
  save();  // the last step, once (unless the interval has just saved it)
  if (ps_worker && rank0) {
    const std::vector<int64_t> h = ps_worker->staleness_histogram();
    std::vector<std::string> bins;
    for (size_t s = 0; s < h.size(); ++s)
      if (h[s] > 0)
        bins.push_back(fmt::format("{}{}: {}", s, s + 1 == h.size() ? "+" : "", h[s]));
    fmt::print("staleness of the servers' updates (updates from other workers between a "
               "worker's read and its push): {}\n",
               fmt::join(bins, ", "));
  }
  if (a.sample > 0) {
    place_params(graph.params(), Device::cpu());  // sampling runs on the host
    std::vector<int32_t> prompt;
    if (data.is_text()) {
      for (unsigned char ch : a.sample_prompt) prompt.push_back(ch);
    } else {  // token data: start from end-of-text (the tokenizer's, else GPT-2's)
      const int32_t eot = tokenizer && tokenizer->eot() >= 0 ? tokenizer->eot() : 50256;
      prompt.push_back(eot < cfg.vocab_size ? eot : 0);
    }
    // The family's model for one sequence at a time, with the trained weights.
    ModelArgs one = model_args(a, cfg);
    one.micro_batch = 1;
    JobModel sampler = family.build(one);
    sampler.io.graph = &sampler.graph;
    for (Param* p : sampler.graph.params()) {
      const Param* trained = model.params->find(p->name);
      check(trained != nullptr, "--sample: the {} family's model for one sequence has {}, which "
            "the trained model lacks", family.name, p->name);
      p->value.copy_from(trained->value);
    }
    auto tokens = sample_tokens(sampler, cfg, prompt, a.sample, a.sample_temperature,
                                static_cast<uint64_t>(a.seed));
    fmt::print("--- sample ({} tokens, temperature {}) ---\n", a.sample, a.sample_temperature);
    if (data.is_text()) {
      std::string s(a.sample_prompt);
      for (int32_t t : tokens) s.push_back(static_cast<char>(t));
      fmt::print("{}\n", s);
    } else if (tokenizer) {
      std::string s;
      for (int32_t t : tokens) s += tokenizer->decode(t);
      fmt::print("{}\n", s);
    } else {
      for (int32_t t : tokens) fmt::print("{} ", t);
      fmt::print("\n(token ids: give --tokenizer to decode them)\n");
    }
  }
  return 0;
}

}  // namespace

// The MPI links (host memory) always; then, where the job's device tensors
// would go by NCCL (--device cuda, a GPU per rank or WEFT_NCCL_ONE_GPU=1 with
// --comm-backend nccl), NCCL's links between the ranks' GPUs too.
namespace {
int run_link_check(const Args& a, weft::Communicator& world) {
  constexpr int kReps = 5;
  const int64_t bytes = a.check_links_mib << 20;
  bool staged = false, nccl = false;
  const weft::Device device = resolve_device(a, world.size(), staged, nccl);
  const nlohmann::json ranks = rank_table(&world, device);
  std::vector<weft::LinkResult> links = weft::check_links(world, bytes, kReps);
  if (world.rank() == 0) print_links(links, ranks, a.check_links_mib, kReps, "MPI (host memory)");
  if (nccl) {
    std::unique_ptr<weft::Communicator> gpus = weft::nccl_world(world, device.index, world.options());
    links = weft::check_links(*gpus, bytes, kReps, device);
    if (world.rank() == 0) print_links(links, ranks, a.check_links_mib, kReps, "NCCL (GPU memory)");
  }
  std::fflush(stdout);
  return 0;
}

}  // namespace

namespace weft {

int train_main(int argc, char** argv, const Job& job) {
  Args a;
  a.job = &job;
  CLI::App app{job.about, job.program};
  app.option_defaults()->always_capture_default()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--model", a.model, "shape preset: toy, mini, small, gpt2 (flags override)");
  std::vector<std::string> families;
  for (const ModelFamily& f : job.families) families.push_back(fmt::format("{} ({})", f.name, f.about));
  app.add_option("--arch", a.arch,
                 fmt::format("model family: {} (default: the one the flags below describe, else "
                             "the first)",
                             fmt::join(families, "; ")));
  app.add_option("--normalization", a.normalization, "LayerNorm or RMSNorm");
  app.add_option("--position-embedding-type", a.position_embedding_type,
                 "learned_absolute or rope");
  app.add_flag("--swiglu", a.swiglu, "SwiGLU MLP");
  app.add_flag("--untie-embeddings-and-output-weights", a.untie, "an LM head of its own");
  app.add_flag("--disable-bias-linear", a.disable_bias, "linear layers without biases");
  app.add_flag("--group-query-attention", a.gqa,
               "grouped-query attention: query heads share key/value heads (llama)");
  app.add_option("--num-query-groups", a.num_query_groups,
                 "key/value heads with --group-query-attention (default 1); must divide "
                 "--num-attention-heads and be divisible by --tp");
  app.add_option("--ffn-hidden-size", a.ffn_hidden_size,
                 "SwiGLU width (llama; default 8 x hidden / 3 rounded up to 64)");
  app.add_option("--rotary-base", a.rotary_base, "rotary embedding base (llama)");
  app.add_option("--num-layers", a.gpt.num_layers, "transformer blocks");
  app.add_option("--hidden-size", a.gpt.hidden_size, "model width");
  app.add_option("--num-attention-heads", a.gpt.num_heads, "attention heads");
  app.add_option("--seq-length", a.gpt.seq_length, "tokens per sequence");
  app.add_option("--max-position-embeddings", a.gpt.max_positions,
                 "rows of the position table (default: --seq-length)");
  app.add_option("--vocab-size", a.gpt.vocab_size, "vocabulary (256 for byte data)");
  app.add_option("--make-vocab-size-divisible-by", a.vocab_divisor,
                 "pad the vocabulary table to a multiple of this x --tp (default 128; 1: no "
                 "padding); padding rows are masked, zero and never saved");
  app.add_option("--micro-batch-size", a.micro_batch, "sequences per micro-batch");
  app.add_option("--global-batch-size", a.global_batch,
                 "sequences per step (a multiple of the micro-batch size; default: one micro-batch)");
  app.add_option("--train-iters", a.train_iters, "steps to train (in total, when resuming)");
  app.add_option("--lr", a.lr, "peak learning rate");
  app.add_option("--min-lr", a.min_lr, "final learning rate of the cosine decay");
  app.add_option("--lr-decay-style", a.lr_decay_style, "constant or cosine");
  app.add_option("--lr-warmup-iters", a.lr_warmup_iters, "linear warmup steps");
  app.add_option("--lr-decay-iters", a.lr_decay_iters, "cosine length (default: --train-iters)");
  app.add_option("--weight-decay", a.weight_decay, "AdamW decay on 2-D parameters");
  app.add_option("--clip-grad", a.clip_grad, "global gradient-norm clip (0 = off)");
  app.add_option("--max-loss", a.max_loss,
                 "stop, naming the step, at a loss above this (default: 4 x ln(vocabulary), four "
                 "times a uniform guess's; 0 = off)");
  app.add_option("--adam-beta1", a.beta1);
  app.add_option("--adam-beta2", a.beta2);
  app.add_option("--adam-eps", a.eps);
  app.add_option("--seed", a.seed, "initialisation seed");
  app.add_option("--data-path", a.data_path, "text file (bytes) or llm.c .bin token file");
  app.add_option("--init-from", a.init_from, "safetensors weights with Hugging Face GPT-2 names");
  app.add_option("--save", a.save, "checkpoint directory to write");
  app.add_option("--load", a.load,
                 "checkpoint directory (or one iter_N in it) to resume from (default: --save, "
                 "when it holds one)");
  app.add_flag("--no-load", a.no_load, "start over even when --save holds checkpoints");
  app.add_flag("--finetune", a.finetune,
               "start from the weights of --load only: no optimizer state, step 0, and flags may "
               "differ from its meta.json");
  app.add_flag("--override-opt_param-scheduler", a.override_scheduler,
               "on a resume, let --lr, --min-lr, --lr-decay-style, --lr-warmup-iters and "
               "--lr-decay-iters that differ from the checkpoint's win (Megatron's flag)");
  app.add_flag("--override-checkpoint-args", a.override_checkpoint_args,
               "let flags that contradict the checkpoint's meta.json win (shape, data path, "
               "global batch, seed); flags left out still come from it");
  app.add_flag("--overwrite-checkpoints", a.overwrite_checkpoints,
               "with --no-load: let the new run replace the checkpoints in --save; with --load "
               "of an older step: let its saves remove the newer ones in --save");
  app.add_flag("--load-unverified", a.load_unverified,
               "load the one folder --load names although it has no manifest.json (nothing in "
               "it can be verified)");
  app.add_option("--save-interval", a.save_interval, "save every N steps (0 = only at the end)");
  app.add_option("--optimizer", a.optimizer,
                 "adam (AdamW, the default), sgd (torch.optim.SGD; --weight-decay as L2) or lion "
                 "(Lion: every element moves by the learning rate, so take it 3-10x smaller "
                 "than AdamW's; --weight-decay decoupled)");
  app.add_option("--lion-beta1", a.lion_beta1,
                 "Lion's interpolation of momentum and gradient (with --optimizer lion)");
  app.add_option("--lion-beta2", a.lion_beta2, "Lion's momentum decay (with --optimizer lion)");
  app.add_option("--sgd-momentum", a.sgd_momentum, "SGD's momentum (with --optimizer sgd)");
  app.add_option("--local-steps", a.local_steps,
                 "local SGD: each data-parallel replica updates alone from its own gradients, "
                 "and the replicas' parameters are averaged every N steps (0: reduce every step)");
  app.add_option("--outer-optimizer", a.outer_optimizer,
                 "with --local-steps: none (take the average) or nesterov (DiLoCo's outer step "
                 "on start - average)");
  app.add_option("--ps-ranks", a.ps_ranks,
                 "parameter servers: the last K ranks hold the parameters and the optimizer; "
                 "the others are workers, one data-parallel replica each (0: none)");
  app.add_option("--max-staleness", a.max_staleness,
                 "with --ps-ranks: no worker starts a step more than S steps ahead of the "
                 "slowest (0: synchronous, the same steps as data parallelism)");
  app.add_option("--slow-rank", a.slow_rank,
                 "benchmarking, with --ps-ranks: this worker takes --slow-factor times its "
                 "compute time per step");
  app.add_option("--slow-factor", a.slow_factor, "how much slower --slow-rank computes (> 1)");
  app.add_option("--outer-lr", a.outer_lr, "DiLoCo's outer learning rate");
  app.add_option("--outer-momentum", a.outer_momentum, "DiLoCo's outer Nesterov momentum");
  app.add_flag("--check-for-spiky-loss", a.check_spiky_loss,
               "skip the update of a step whose loss is over --spiky-loss-factor x the mean of the "
               "last 10 updated steps, and log it");
  app.add_option("--spiky-loss-factor", a.spiky_loss_factor,
                 "with --check-for-spiky-loss: how far over the recent mean a loss spikes");
  app.add_option("--max-skipped-steps", a.max_skipped_steps,
                 "with --check-for-spiky-loss: stop with an error after this many skipped steps");
  app.add_flag("--check-links", a.check_links,
               "measure every link between the ranks (bandwidth and latency, by rank and host), "
               "print them slowest first and exit: a check of a new cluster");
  app.add_option("--check-links-mib", a.check_links_mib,
                 "message size of --check-links, in MiB");
  app.add_option("--exit-interval", a.exit_interval,
                 "stop (saving with --save) after a step divisible by N (0: never)");
  app.add_option("--exit-duration-in-mins", a.exit_duration_mins,
                 "stop (saving with --save) after the step that ends this many minutes into "
                 "training (0: never)");
  app.add_option("--keep-last-checkpoints", a.keep_last,
                 "keep only the newest N checkpoints in --save (0: keep all)");
  app.add_option("--log-interval", a.log_interval, "print every N steps");
  app.add_option("--log-jsonl", a.log_jsonl, "write one JSON object per step here");
  app.add_option("--split", a.split,
                 "train,valid,test weights over the data's windows, e.g. 98,2,0 (default: all "
                 "train)");
  app.add_option("--eval-interval", a.eval_interval,
                 "validation loss every N steps and at the end (0: never; needs --split)");
  app.add_option("--eval-iters", a.eval_iters, "global batches per validation");
  app.add_option("--loss-plot", a.loss_plot, "write the train and validation loss curve (SVG)");
  app.add_option("--sample", a.sample, "generate N tokens at the end");
  app.add_option("--sample-temperature", a.sample_temperature, "0 = greedy");
  app.add_option("--sample-prompt", a.sample_prompt, "text the sample continues (text data)");
  app.add_option("--tokenizer", a.tokenizer,
                 "llm.c tokenizer file (e.g. gpt2_tokenizer.bin) to decode samples of token data");
  app.add_option("--threads", a.threads, "CPU threads (default: cores / local ranks)");
  app.add_option("--device", a.device,
                 "cpu, cuda, cuda:N or auto: cuda when a GPU is visible; each rank takes the GPU "
                 "of its local rank (cuda:N: one process on GPU N)");
  app.add_option("--comm-backend", a.comm_backend,
                 "auto, mpi or nccl: how ranks on GPUs exchange tensors (mpi: staged through "
                 "host memory, which works when ranks share a GPU)");
  app.add_flag("--tf32", a.tf32, "GEMMs on tensor cores with TF32 inputs (--device cuda)");
  app.add_option("--attention-backend", a.attention_backend,
                 "auto, fused or unfused (--device cuda): fused is cuDNN's fused flash attention "
                 "(bf16 q, k, v; no T x T tensor); auto takes it with bf16 GEMMs");
  app.add_flag("--bf16", a.bf16,
               "mixed precision: GEMM inputs rounded to bf16 and activations stored in bf16; "
               "fp32 master weights, gradients and optimizer state (emulated on the CPU)");
  app.add_flag("--fp16", a.fp16,
               "mixed precision: GEMM inputs rounded to fp16, with a dynamic loss scale "
               "(emulated on the CPU)");
  app.add_option("--loss-scale", a.loss_scale,
                 "with --fp16: a fixed loss scale instead of the dynamic one");
  app.add_option("--initial-loss-scale", a.initial_loss_scale,
                 "with --fp16: the dynamic loss scale's start (2^32)");
  app.add_option("--min-loss-scale", a.min_loss_scale,
                 "with --fp16: the dynamic loss scale's floor (1)");
  app.add_option("--loss-scale-window", a.loss_scale_window,
                 "with --fp16: steps without overflow before the loss scale doubles (1000)");
  app.add_option("--hysteresis", a.hysteresis,
                 "with --fp16: overflows before the loss scale halves (2)");
  app.add_option("--tensor-model-parallel-size,--tp", a.tp, "tensor-parallel ranks");
  app.add_option("--pipeline-model-parallel-size,--pp", a.pp, "pipeline ranks");
  app.add_option("--schedule", a.schedule,
                 "pipeline schedule: gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-v");
  app.add_option("--virtual-stages", a.virtual_stages, "model chunks per pipeline rank");
  app.add_option("--num-layers-per-virtual-pipeline-stage", a.layers_per_virtual,
                 "layers per chunk (sets the virtual stages as Megatron does)");
  app.add_option("--partition", a.partition, "stage partition: uniform, parameters, time");
  app.add_flag("--recompute", a.recompute, "recompute activations in the backward pass");
  app.add_option("--memory-budget", a.memory_budget,
                 "per pipeline rank, for the partitioner (e.g. 2GiB): stages are cut so that each "
                 "rank's weights, optimizer state and stashed activations fit, or the run is "
                 "refused naming the least any cut needs");
  app.add_option("--trace", a.trace,
                 "write a Chrome trace (Perfetto) of every pipeline action on every rank");
  app.add_option("--profile-step-start", a.profile_step_start,
                 "open the CUDA profiler's range (cudaProfilerStart: nsys --capture-range="
                 "cudaProfilerApi, ncu --profile-from-start off) when this many steps have run");
  app.add_option("--profile-step-end", a.profile_step_end,
                 "close it (cudaProfilerStop) when this many steps have run");
  app.add_option("--profile", a.profile,
                 "time every node's F, I and W on this machine's --device (rank 0, the whole "
                 "model: on a GPU it must fit there), write them to this JSON file and use them "
                 "for --partition time");
  app.add_flag("--use-distributed-optimizer", a.distributed_optimizer,
               "shard AdamW's state across data-parallel replicas (ZeRO-1)");
  app.add_option("--ddp-bucket-size", a.ddp_bucket_size,
                 "gradient elements per data-parallel reduction bucket");
  // Two flags, so that --help shows the real default (a negated alias would print {false}).
  app.add_flag("--overlap-grad-reduce", a.overlap_grad_reduce,
               "start each bucket's reduction as soon as its gradients are final (default on)")
      ->default_str("");
  app.add_flag_callback(
      "--no-overlap-grad-reduce", [&a] { a.overlap_grad_reduce = false; },
      "reduce every bucket after the backward instead");
  app.add_flag("--overlap-p2p-comm", a.overlap_p2p_comm,
               "post each pipeline receive before the compute action ahead of it, so the "
               "message arrives while that computes (default off: each receive is posted "
               "when its action comes)");
  app.add_option("--grad-reduce-dtype", a.grad_reduce_dtype,
                 "data-parallel gradient reduction: fp32, or bf16 (rounded; half the bytes); with "
                 "--local-steps, the averages' deltas and optimizer state");
  app.add_option("--grad-compression", a.grad_compression,
                 "data-parallel gradient compression: none, or powersgd (error feedback; plain "
                 "data parallelism only); with --local-steps, the averages' deltas");
  app.add_option("--powersgd-rank", a.powersgd_rank, "rank of the PowerSGD gradient factors");
  app.add_option("--powersgd-start-iter", a.powersgd_start_iter,
                 "steps reduced uncompressed before PowerSGD starts (e.g. the LR warmup)");
  app.add_option("--plan", a.plan,
                 "auto: run the layout weft-sched plan ranks fastest (dp, pp, tp, schedule, "
                 "virtual stages, micro-batch size, recompute, ZeRO-1); layout flags given fix "
                 "theirs");
  app.add_option("--plan-costs", a.plan_costs,
                 "node costs for --plan auto: a --profile file of this model");
  app.add_option("--plan-memory", a.plan_memory, "memory per rank for --plan auto, e.g. 4GiB");
  app.add_option("--plan-link-latency", a.plan_latency, "seconds per message for --plan auto");
  app.add_option("--plan-bandwidth", a.plan_bandwidth, "link bytes per second for --plan auto");
  app.add_option("--plan-cores", a.plan_cores,
                 "cores the ranks share for --plan auto (default: this machine's; 0: one per rank)");
  app.add_option("--plan-compute-scale", a.plan_compute_scale,
                 "multiply the profiled F, I and W times for --plan auto (a calibration)");
  app.add_option("--plan-wake", a.plan_wake,
                 "seconds a rank that waited takes to run again, per received message and "
                 "all-reduce round, for --plan auto (weft-sched plan --wake)");
  app.add_option("--save-timeout", a.save_timeout,
                 "seconds the ranks wait for a checkpoint's writer before failing (default 1800; "
                 "0: no deadline)");
  app.add_option("--comm-timeout", a.comm_timeout,
                 "seconds any rank waits for a message or collective before failing");
  // A whole number past 64 bits is refused, not saturated (CLI11 would give
  // --seed 99999999999999999999 as INT64_MAX).
  const CLI::Validator in_range(
      [](std::string& text) -> std::string {
        int64_t v = 0;
        const char* end = text.data() + text.size();
        if (std::from_chars(text.data(), end, v).ec == std::errc::result_out_of_range)
          return "the value " + text + " is past the range of a 64-bit integer";
        return {};
      },
      "");
  for (CLI::Option* o : app.get_options())
    if (o->get_type_name() == "INT" || o->get_type_name() == "UINT") o->check(in_range);
  // The program's own defaults: values of flags left out.
  for (const auto& [flag, value] : job.defaults) {
    CLI::Option* o = app.get_option_no_throw(flag);
    if (o == nullptr) {
      fmt::print(stderr, "{}: error: its default for {} names no flag of the job\n", job.program,
                 flag);
      return 1;
    }
    try {
      o->default_val(value);
    } catch (const CLI::Error& e) {
      fmt::print(stderr, "{}: error: its default {} {}: {}\n", job.program, flag, value, e.what());
      return 1;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  const weft::LaunchInfo launch = weft::detect_launch();
  if (!a.check_links) {
    try {
      adopt_checkpoint_args(a, app);
      apply_plan(a, app, launch.size);
      if (launch.rank == 0 && !a.plan_note.empty()) fmt::print("{}\n", a.plan_note);
    } catch (const std::exception& e) {
      if (launch.rank == 0) fmt::print(stderr, "{}: error: {}\n", job.program, e.what());
      return 1;
    }
  }
  if (a.check_links) {
    if (a.check_links_mib < 1 || a.check_links_mib > 4096) {
      fmt::print(stderr, "{}: error: --check-links-mib ({}) must be in [1, 4096]\n", job.program,
                 a.check_links_mib);
      return 1;
    }
    if (launch.size == 1) {
      fmt::print("--check-links: one rank, so no link to check (run it under mpiexec or srun)\n");
      return 0;
    }
    weft::CommOptions comm;
    comm.timeout = std::chrono::milliseconds(static_cast<int64_t>(a.comm_timeout * 1000));
    return weft::mpi_main(
        argc, argv, [&](weft::Communicator& world) { return run_link_check(a, world); },
        comm);
  }
  if (launch.size == 1) {
    try {
      return run(a, app, nullptr);
    } catch (const std::exception& e) {
      fmt::print(stderr, "{}: error: {}\n", job.program, e.what());
      return 1;
    }
  }
  // Several ranks: catch bad flags before any communication, printed once.
  try {
    check_param_servers(a, app, launch.size);
    check_parallel(a, resolve_config(a, app), launch.size - a.ps_ranks,
                   a.global_batch > 0 ? a.global_batch : a.micro_batch);
  } catch (const std::exception& e) {
    if (launch.rank == 0) fmt::print(stderr, "{}: error: {}\n", job.program, e.what());
    return 1;
  }
  weft::CommOptions comm;
  comm.timeout = std::chrono::milliseconds(static_cast<int64_t>(a.comm_timeout * 1000));
  return weft::mpi_main(argc, argv, [&](weft::Communicator& world) { return run(a, app, &world); },
                        comm);
}

}  // namespace weft
