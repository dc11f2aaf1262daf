// The training job's checks (weft/job.h): every flag read, checked and
// settled (presets, the family, the checkpoint's meta.json, --plan auto)
// before any rank starts, so that every rank reaches the same verdict.
#include <weft/checkpoint.h>
#include <weft/job.h>
#include <weft/error.h>
#include <weft/layout.h>
#include <weft/link_check.h>
#include <weft/mesh.h>
#include <weft/mpi_communicator.h>
#include <weft/cpu_kernels.h>
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

#include "src/job/job_internal.h"

namespace weft::job_detail {

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

DataBlend parse_blend(const char* flag, const std::vector<std::string>& list) {
  using weft::check;
  DataBlend b;
  check(!list.empty(), "{} names no dataset", flag);
  if (list.size() == 1) {
    b.paths = list;
    return b;
  }
  auto number = [](const std::string& s, double* v) {
    char* end = nullptr;
    *v = std::strtod(s.c_str(), &end);
    return !s.empty() && end == s.c_str() + s.size();
  };
  double w = 0;
  if (!number(list[0], &w)) {
    for (const std::string& p : list)
      check(!number(p, &w),
            "{} '{}': a list that starts with a path takes no weights; give every dataset a "
            "weight (W1 PATH1 W2 PATH2 ...) or none",
            flag, p);
    b.paths = list;
    return b;
  }
  check(list.size() % 2 == 0,
        "{} takes WEIGHT PATH pairs; {} values leave a weight without its path", flag, list.size());
  double total = 0;
  for (size_t i = 0; i < list.size(); i += 2) {
    check(number(list[i], &w) && std::isfinite(w) && w >= 0,
          "{}: weight '{}' (before {}) is not a number >= 0", flag, list[i], list[i + 1]);
    b.weights.push_back(w);
    b.paths.push_back(list[i + 1]);
    total += w;
  }
  check(total > 0, "{}: the weights sum to {}; they must sum to a positive number", flag, total);
  return b;
}

nlohmann::json blend_json(const std::vector<std::string>& list) {
  if (list.empty()) return nullptr;
  if (list.size() == 1) return std::filesystem::absolute(list[0]).string();
  nlohmann::json out = nlohmann::json::array();
  const DataBlend b = parse_blend("--data-path", list);
  for (size_t i = 0; i < b.paths.size(); ++i) {
    if (!b.weights.empty()) out.push_back(list[2 * i]);
    out.push_back(std::filesystem::absolute(b.paths[i]).string());
  }
  return out;
}

nlohmann::json blend_fingerprint(const std::vector<std::string>& list, const std::string& format) {
  std::vector<std::string> files;
  for (const std::string& p : parse_blend("--data-path", list).paths)
    for (const std::string& f : weft::token_files(p, weft::parse_token_format(format)))
      files.push_back(f);
  if (files.size() == 1) return weft::data_fingerprint(files[0]);
  nlohmann::json out = nlohmann::json::array();
  for (const std::string& f : files) out.push_back(weft::data_fingerprint(f));
  return out;
}

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
  check(a.cpu_gemm == "auto" || kind != "cuda",
        "--cpu-gemm {} chooses the CPU's GEMM library, but --device cuda runs GEMMs on cuBLAS",
        a.cpu_gemm);
  if (kind != "cuda") {
    // --cpu-gemm and the environment's choices (WEFT_CPU_GEMM,
    // WEFT_CPU_BF16_GEMM) are read now, so that a bad one stops the run
    // before any work, in one line naming it.
    (void)weft::cpu::parse_gemm_library(a.cpu_gemm, "--cpu-gemm");
    (void)weft::cpu::gemm_library();
    if (a.bf16) (void)weft::cpu::bf16_gemm();
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
  // to a multiple of tp, so any --vocab-size splits), and with
  // --sequence-parallel the sequence; every stage needs a layer; the batch
  // splits into micro-batches x dp; the schedule runs those sizes.
  plan::Layout l{layout.dp(),   a.pp,
                 a.tp,          a.schedule,
                 p.chunks,      a.micro_batch,
                 a.recompute,   a.distributed_optimizer,
                 a.shard_grads, a.sequence_parallel};
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
  sync.shard_grads = a.shard_grads;
  sync.shard_params = a.shard_params;
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
  check(a.sample == 0 || (a.pp == 1 && a.tp == 1 && !a.shard_params) || !a.save.empty(),
        "--sample with --pp or --tp > 1, or with --data-parallel-sharding-strategy "
        "optim_grads_params, draws on rank 0 from the run's last checkpoint, whole: it needs "
        "--save");
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
  for (const auto& [flag, on] : {std::pair<const char*, bool>{"--group-query-attention", a.gqa},
                                 {"--num-query-groups", app.count("--num-query-groups") > 0},
                                 {"--ffn-hidden-size", app.count("--ffn-hidden-size") > 0},
                                 {"--rotary-base", app.count("--rotary-base") > 0},
                                 {"--reset-position-ids", a.reset_position_ids},
                                 {"--reset-attention-mask", a.reset_attention_mask}}) {
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
  cfg.reset_position_ids = a.reset_position_ids;
  cfg.reset_attention_mask = a.reset_attention_mask;
  return cfg;
}

// The paths a run writes or records, checked before anything starts rather
// than at the first save, after training: --save must be a folder (or be
// made one) whose checkpoint files' paths fit the system's limits, and what
// meta.json and the metrics file record must be UTF-8 (JSON text is). That
// --save can be written is checked by its lock (SaveDirLock), before step 1.
void check_paths(const Args& a) {
  namespace fs = std::filesystem;
  using weft::check;
  std::vector<std::pair<std::string, std::string>> paths{
      {"--save", a.save}, {"--load", a.load}, {"--log-jsonl", a.log_jsonl}};
  for (const auto& [flag, list] : {std::pair{"--data-path", &a.data_path},
                                   {"--train-data-path", &a.train_data_path},
                                   {"--valid-data-path", &a.valid_data_path}})
    for (const std::string& p : *list) paths.emplace_back(flag, p);
  for (const auto& [flag, value] : paths) {
    try {
      (void)nlohmann::json(value).dump();
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

// Which checkpoint the run loads, and Megatron's --use-checkpoint-args (always
// on): a shape, data or batch flag left out is taken from the checkpoint's
// meta.json; one that contradicts it is an error naming both values, unless
// --override-checkpoint-args (the flags win) or --finetune (weights only, from
// step 0) is given. Run before anything else, on every rank.
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
  // The datasets and their order. A checkpoint from before blends names one
  // path and read it in file order.
  auto paths = [](std::vector<std::string>& dest) {
    return [&dest](const nlohmann::json& v) {
      dest = v.is_string() ? std::vector<std::string>{v.get<std::string>()}
                           : v.get<std::vector<std::string>>();
    };
  };
  field("data_path", "--data-path", !a.data_path.empty(), blend_json(a.data_path),
        paths(a.data_path));
  field("train_data_path", "--train-data-path", !a.train_data_path.empty(),
        blend_json(a.train_data_path), paths(a.train_data_path));
  field("valid_data_path", "--valid-data-path", !a.valid_data_path.empty(),
        blend_json(a.valid_data_path), paths(a.valid_data_path));
  field("data_format", "--data-format", app.count("--data-format") > 0, a.data_format,
        [&](const nlohmann::json& v) { a.data_format = v.get<std::string>(); });
  if (!saved.contains("data_order") && !app.count("--data-order") && !saved.empty()) {
    a.data_order = "file";
    adopted.push_back("--data-order file");
  }
  field("data_order", "--data-order", app.count("--data-order") > 0, a.data_order,
        [&](const nlohmann::json& v) { a.data_order = v.get<std::string>(); });
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
  // The data files themselves: the same paths may hold other bytes now.
  for (const auto& [key, flag, list] :
       {std::tuple{"data_path", "--data-path", &a.data_path},
        {"train_data_path", "--train-data-path", &a.train_data_path}}) {
    const std::string fkey =
        std::string(key) == "data_path" ? "data_fingerprint" : "train_data_fingerprint";
    if (!saved.contains(fkey) || free || list->empty() || !saved.contains(key) ||
        blend_json(*list) != saved[key])
      continue;
    const nlohmann::json now = blend_fingerprint(*list, a.data_format);
    check(now.is_null() || now == saved[fkey],
          "{} {} has changed since the checkpoint was saved ({} then, {} now): the resumed run "
          "would not read the batches the saved steps continue; add --override-checkpoint-args "
          "to train on it anyway",
          flag, fmt::join(*list, " "), saved[fkey].dump(), now.dump());
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
  for (const char* flag :
       {"--exit-interval", "--exit-duration-in-mins", "--use-distributed-optimizer",
        "--data-parallel-sharding-strategy", "--local-steps", "--check-for-spiky-loss", "--sample",
        "--init-from", "--grad-compression", "--grad-reduce-dtype", "--finetune"})
    check(app.count(flag) == 0,
          "{} is not available with --ps-ranks yet: the servers hold the parameters and the "
          "optimizer, and the other ranks cannot stop, fine-tune or reduce without them",
          flag);
}

// Megatron's recompute flags: --recompute-granularity full with a method, or
// none of them.
void check_recompute_flags(const Args& a, const CLI::App& app) {
  using weft::check;
  const bool granularity = app.count("--recompute-granularity") > 0;
  check(!granularity || !a.recompute,
        "--recompute (whole stages) and --recompute-granularity {} both say what to recompute: "
        "give one",
        a.recompute_granularity);
  check(!granularity || a.recompute_granularity == "full" ||
            a.recompute_granularity == "selective",
        "--recompute-granularity '{}' must be full or selective", a.recompute_granularity);
  if (a.recompute_granularity != "full") {
    for (const char* flag : {"--recompute-method", "--recompute-num-layers"})
      check(app.count(flag) == 0, "{} says which blocks --recompute-granularity full recomputes{}",
            flag,
            granularity ? "; selective recomputes every attention node (Megatron's rule)"
                        : ": it needs --recompute-granularity full");
    return;
  }
  check(!a.recompute_method.empty(),
        "--recompute-granularity full needs --recompute-method uniform or block (Megatron's "
        "rule): uniform recomputes groups of --recompute-num-layers blocks, block the first "
        "--recompute-num-layers blocks of each stage");
  check(a.recompute_method == "uniform" || a.recompute_method == "block",
        "--recompute-method '{}' must be uniform or block", a.recompute_method);
  check(a.recompute_num_layers >= 1, "--recompute-num-layers {} must be at least 1",
        a.recompute_num_layers);
}

// Pipeline flags that would change nothing are refused: every accepted flag
// does something.
void check_pipeline_flags(const Args& a, const CLI::App& app) {
  using weft::check;
  const std::vector<std::string> names = weft::sched::schedule_names();
  check(std::find(names.begin(), names.end(), a.schedule) != names.end(),
        "--schedule '{}' is not a schedule (one of: {})", a.schedule, fmt::join(names, ", "));
  check_recompute_flags(a, app);
  if (a.pp == 1) {
    check(!a.recompute,
          "--recompute recomputes whole pipeline stages, and at --pp 1 the one stage is the "
          "whole model: nothing would be freed. Recompute blocks instead: "
          "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1");
    for (const char* flag :
         {"--schedule", "--virtual-stages", "--num-layers-per-virtual-pipeline-stage",
          "--partition", "--memory-budget", "--overlap-p2p-comm"})
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
}

// --plan auto: search the layouts weft-sched plan searches, under the same
// rules and costs, and set the layout flags to the fastest. A layout flag
// the command gives fixes that dimension; when no plan has it, the flag is
// refused, naming it.
void settle_sharding(Args& a, const CLI::App& app) {
  using weft::check;
  if (!app.count("--data-parallel-sharding-strategy")) return;
  const weft::ShardingStrategy s = weft::parse_sharding_strategy(a.sharding_strategy);
  check(!app.count("--use-distributed-optimizer") || s != weft::ShardingStrategy::NoShard,
        "--use-distributed-optimizer shards the optimizer state, and "
        "--data-parallel-sharding-strategy {} says not to: give one of them",
        a.sharding_strategy);
  a.distributed_optimizer = s != weft::ShardingStrategy::NoShard;
  a.shard_grads =
      s == weft::ShardingStrategy::OptimGrads || s == weft::ShardingStrategy::OptimGradsParams;
  a.shard_params = s == weft::ShardingStrategy::OptimGradsParams;
}

// --plan auto's flags, checked; true when the planner has its costs
// (--plan-costs) now, false when the run profiles the model first
// (plan_by_profile, in run.cc).
bool check_plan_flags(const Args& a, const CLI::App& app) {
  using weft::check;
  const bool planning = !a.plan.empty();
  for (const char* flag : {"--plan-costs", "--plan-memory", "--plan-link-latency",
                           "--plan-bandwidth", "--plan-cores", "--plan-compute-scale",
                           "--plan-wake"})
    check(planning || app.count(flag) == 0, "{} sets up the planner: it needs --plan auto", flag);
  if (!planning) return false;
  check(a.plan == "auto", "--plan '{}' must be auto (weft-sched plan prints the others)", a.plan);
  check(app.count("--global-batch-size") > 0 || a.global_batch > 0,
        "--plan auto needs --global-batch-size: the planner splits it into micro-batches");
  check(app.count("--recompute-granularity") == 0,
        "--recompute-granularity with --plan auto is not available yet: the planner prices "
        "whole-stage --recompute only (drop one of them)");
  for (const char* flag : {"--num-layers-per-virtual-pipeline-stage", "--ps-ranks"})
    check(app.count(flag) == 0,
          "{} contradicts --plan auto, which chooses the layout (fix the chunks with "
          "--virtual-stages, or drop --plan)",
          flag);
  check(app.count("--profile") == 0 || !a.plan_costs.empty(),
        "--profile with --plan auto and no --plan-costs: the plan's own profile is taken at "
        "--pp 1 before the run; give --plan-costs FILE to profile the planned layout instead");
  check(std::isfinite(a.plan_compute_scale) && a.plan_compute_scale > 0,
        "--plan-compute-scale ({}) must be a positive number", a.plan_compute_scale);
  check(a.plan_latency >= 0 && std::isfinite(a.plan_latency),
        "--plan-link-latency ({}) must be seconds >= 0", a.plan_latency);
  check(a.plan_bandwidth > 0, "--plan-bandwidth ({}) must be positive", a.plan_bandwidth);
  check(a.plan_wake >= 0 && std::isfinite(a.plan_wake), "--plan-wake ({}) must be seconds >= 0",
        a.plan_wake);
  if (a.plan_cores)
    check(std::isfinite(*a.plan_cores) && *a.plan_cores >= 0,
          "--plan-cores ({}) must be a number of cores >= 0 (0: one per rank)", *a.plan_cores);
  return !a.plan_costs.empty();
}

weft::plan::PlanInput plan_input(const Args& a, const CLI::App& app, int world,
                                 const nlohmann::json& profile, const std::string& source) {
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
  in.costs = weft::plan::profile_costs(profile, source);
  in.costs.compute_scale = a.plan_compute_scale;
  return in;
}

void adopt_plan(Args& a, const CLI::App& app, weft::plan::PlanInput in) {
  using weft::check;
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
  if (app.count("--sequence-parallel"))
    fx.sequence_parallel = true, fixed.push_back("--sequence-parallel");
  if (app.count("--data-parallel-sharding-strategy")) {
    fx.zero1 = a.distributed_optimizer, fx.zero2 = a.shard_grads, fx.zero3 = a.shard_params;
    fixed.push_back("--data-parallel-sharding-strategy " + a.sharding_strategy);
  } else if (app.count("--use-distributed-optimizer")) {
    fx.zero2 = fx.zero3 = false;  // optim, the alias's strategy
  }
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
  check(best != nullptr, "--plan auto: no layout of {} ranks runs{}{}: {} refused{}",
        in.machine.world, fixed.empty() ? "" : " with ", fmt::join(fixed, " "), r.refused,
        r.reasons.empty() ? std::string() : ", e.g. " + r.reasons.front().first);
  const weft::plan::Layout& l = best->layout;
  a.tp = l.tp;
  a.pp = l.pp;
  a.micro_batch = l.micro_batch;
  a.distributed_optimizer = l.zero1;
  a.shard_grads = l.zero2;
  a.shard_params = l.zero3;
  a.sequence_parallel = l.sequence_parallel;
  if (l.pp > 1) {
    a.schedule = l.schedule;
    a.virtual_stages = l.chunks;
    a.recompute = l.recompute;
  }
  a.plan_step_ms = 1e3 * best->step_time;
  a.plan_note = fmt::format(
      "plan auto: {}, predicted step {:.1f} ms, bubble {:.1f}%, {} per rank (the fastest of {} "
      "plans; {} refused): {}",
      l.describe(), 1e3 * best->step_time, 100 * best->bubble,
      weft::format_bytes(best->memory_per_rank), r.plans.size(), r.refused,
      fmt::join(l.flags(), " "));
}

void apply_plan(Args& a, const CLI::App& app, int world) {
  if (!check_plan_flags(a, app)) {
    a.plan_pending = !a.plan.empty();
    return;
  }
  std::ifstream file(a.plan_costs);
  weft::check(file.good(), "--plan-costs {}: cannot open the file", a.plan_costs);
  nlohmann::json profile;
  try {
    profile = nlohmann::json::parse(file);
  } catch (const nlohmann::json::exception& e) {
    throw weft::Error("--plan-costs {}: not valid JSON ({})", a.plan_costs, e.what());
  }
  adopt_plan(a, app, plan_input(a, app, world, profile, a.plan_costs));
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

// The training flags' ranges and combinations, one line each, before any
// rank starts.
void check_training_flags(const Args& a, const CLI::App& app) {
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
  check(a.valid_data_path.empty() || !a.train_data_path.empty(),
        "--valid-data-path needs --train-data-path (with --data-path, --split sets validation "
        "data apart)");
  check(!a.data_path.empty() || !a.train_data_path.empty(),
        "--data-path is required (a text file, an llm.c .bin file or a Megatron indexed "
        "dataset; or --train-data-path)");
  check(a.data_path.empty() || a.train_data_path.empty(),
        "--data-path and --train-data-path both name training data: give one (--data-path is "
        "split by --split; --train-data-path is read whole)");
  check(!app.count("--valid-data-path") || a.eval_interval > 0,
        "--valid-data-path is read by validations: it needs --eval-interval N");
  check(!a.async_save || !a.save.empty(),
        "--async-save writes checkpoints in the background: it needs --save");
  check(a.train_data_path.empty() || a.split.empty(),
        "--split '{}' splits --data-path; --train-data-path and --valid-data-path are read whole",
        a.split);
  check(a.data_order == "shuffled" || a.data_order == "file",
        "--data-order '{}' is not shuffled or file", a.data_order);
  (void)weft::parse_token_format(a.data_format);
  for (const auto& [flag, list] : {std::pair{"--data-path", &a.data_path},
                                   {"--train-data-path", &a.train_data_path},
                                   {"--valid-data-path", &a.valid_data_path}})
    if (!list->empty()) (void)parse_blend(flag, *list);
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
  // A tokenizer decodes samples, and names the end-of-document token of the
  // document flags.
  const bool documents = a.eod_mask_loss || a.reset_position_ids || a.reset_attention_mask;
  check(a.sample > 0 || documents || a.tokenizer.empty(),
        "--tokenizer decodes samples and names the end-of-document token: it needs --sample N "
        "or a document flag (--eod-mask-loss, --reset-position-ids, --reset-attention-mask)");
  check(a.tokenizer_type.empty() || a.tokenizer_type == "GPT2BPETokenizer" ||
            a.tokenizer_type == "HuggingFaceTokenizer",
        "--tokenizer-type '{}' is not GPT2BPETokenizer or HuggingFaceTokenizer", a.tokenizer_type);
  const bool gpt2 = a.tokenizer_type == "GPT2BPETokenizer";
  check(gpt2 == (!a.vocab_file.empty() && !a.merge_file.empty()) &&
            (gpt2 || (a.vocab_file.empty() && a.merge_file.empty())),
        "--tokenizer-type GPT2BPETokenizer takes --vocab-file and --merge-file, and they are "
        "read by it alone (got --tokenizer-type '{}', --vocab-file '{}', --merge-file '{}')",
        a.tokenizer_type, a.vocab_file, a.merge_file);
  check((a.tokenizer_type == "HuggingFaceTokenizer") == !a.tokenizer_model.empty(),
        "--tokenizer-type HuggingFaceTokenizer takes --tokenizer-model (a tokenizer.json), and "
        "it is read by it alone (got --tokenizer-type '{}', --tokenizer-model '{}')",
        a.tokenizer_type, a.tokenizer_model);
  check(a.sample > 0 || documents || a.tokenizer_type.empty(),
        "--tokenizer-type encodes the prompt, decodes samples and names the end-of-document "
        "token: it needs --sample N or a document flag (--eod-mask-loss, --reset-position-ids, "
        "--reset-attention-mask)");
  check(a.tokenizer.empty() || a.tokenizer_type.empty(),
        "--tokenizer (an llm.c file that decodes) and --tokenizer-type both decode samples: "
        "give one");
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
}

}  // namespace weft::job_detail
