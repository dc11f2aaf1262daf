// The training job's run (weft/job.h): on this rank, the steps from the
// communicators to the last save, and --check-links.
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
#include <weft/bpe.h>
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

// 75 s -> "1m15s"; 4000 s -> "1h06m40s".
std::string duration(double seconds) {
  const int64_t s = static_cast<int64_t>(std::llround(std::max(0.0, seconds)));
  if (s >= 3600) return fmt::format("{}h{:02d}m{:02d}s", s / 3600, s / 60 % 60, s % 60);
  if (s >= 60) return fmt::format("{}m{:02d}s", s / 60, s % 60);
  return fmt::format("{}s", s);
}

// Entropy of the data's token frequencies, in nats: the loss of the best
// model that ignores context, which a trained model should beat by far.
// Counted over the first 2^24 tokens of each dataset (a dataset is read in
// place, and may be far larger than that).
double unigram_entropy(const std::vector<std::shared_ptr<const weft::TokenData>>& data) {
  constexpr int64_t kMost = int64_t{1} << 24;
  std::vector<int64_t> counts;
  std::vector<int32_t> chunk;
  double n = 0;
  for (const auto& d : data) {
    chunk.resize(static_cast<size_t>(std::min(d->size(), kMost)));
    d->read(0, static_cast<int64_t>(chunk.size()), chunk.data());
    for (int32_t t : chunk) {
      if (static_cast<size_t>(t) >= counts.size()) counts.resize(static_cast<size_t>(t) + 1, 0);
      ++counts[static_cast<size_t>(t)];
    }
    n += static_cast<double>(chunk.size());
  }
  double h = 0;
  for (int64_t c : counts)
    if (c > 0) h -= static_cast<double>(c) / n * std::log(static_cast<double>(c) / n);
  return h;
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
                      const weft::BatchSource& data, weft::Communicator* world,
                      weft::Device device) {
  using namespace weft;
  CostModel cost = CostModel::analytic(graph);
  if (a.profile.empty()) return cost;
  const int64_t n = static_cast<int64_t>(cost.nodes.size());
  Tensor t = Tensor::zeros({3 * n});
  float* d = t.data<float>();
  if (world == nullptr || world->rank() == 0) {
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
  if (world != nullptr) world->broadcast(t, 0);
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

// One rank's run, step by step in the order run() takes them: each step a
// method, each method's state the members it leaves for the next.
// What the flags say the device computes in, set on `device` and `graph`:
// the run's, and --plan auto's profile, which must time and measure what
// the run will run. Mixed precision rounds every GEMM's inputs. --bf16 also
// stores the activations between nodes in bf16 (Megatron's --bf16);
// weights, gradients and optimizer state stay fp32 (weft/ops.h). --fp16
// keeps fp32 activations: its loss scale guards the gradients, not the
// values. Then the attention backend.
void set_precision(const Args& a, weft::Device device, weft::Graph& graph) {
  using namespace weft;
  if (a.tf32) ops::set_matmul_precision(device, ops::MatmulPrecision::Tf32);
  if (a.bf16) {
    ops::set_matmul_precision(device, ops::MatmulPrecision::Bf16);
    graph.set_activation_dtype(DType::BF16);
  }
  if (a.fp16) ops::set_matmul_precision(device, ops::MatmulPrecision::Fp16);
  ops::set_attention_backend(device, ops::parse_attention_backend(a.attention_backend));
  if (a.cpu_gemm != "auto")
    cpu::set_gemm_library(cpu::parse_gemm_library(a.cpu_gemm, "--cpu-gemm"));
}

class Run {
 public:
  Run(const Args& args, const CLI::App& parsed, Communicator* w)
      : a(args),
        app(parsed),
        world(w),
        cfg(resolve_config(a, app)),
        global(a.global_batch > 0 ? a.global_batch : a.micro_batch) {}

  int operator()() {
    // Before this job allocates anything on this host: by the time the
    // memory check runs, this rank and its neighbours have built their
    // models, and what is left would count their weights twice.
    host_available = static_cast<double>(host_memory_available());
    check_training_flags(a, app);
    plan_ranks();
    connect();                         // the communicators: staged or NCCL over MPI, the rank table
    read_data();                       // the tokens, the split, a tokenizer for samples
    build_model();                     // the family's logical model
    set_options();                     // precision, the Trainer's and the layout's options
    lock_save();                       // one writer per --save, its leftovers cleaned
    if (serve_parameters()) return 0;  // a parameter server's run ends here
    build_layout();                    // this rank's part: stages, schedule, Trainer
    check_host_memory();
    resume();               // --load, or the newest checkpoint in --save
    announce();             // notes and the run's first line
    if (train()) return 0;  // stopped by a signal, a time limit or --exit-interval
    report();               // trace, memory, mean loss, plot, the last save
    if (a.sample > 0) sample();
    return 0;
  }

 private:
  void plan_ranks() {
    world_size = world ? world->size() : 1;
    check_param_servers(a, app, world_size);
    workers = world_size - a.ps_ranks;  // every rank when there are no servers
    setup = check_parallel(a, cfg, workers, global);
  }

  void connect() {
    if (setup.staged) world = &staged_world.emplace(*world);
    if (setup.nccl) {
      nccl = nccl_world(*world, setup.device.index, world->options());
      world = nccl.get();
    }
    rank0 = world == nullptr || world->rank() == 0;
    ranks = rank_table(world, setup.device);
    if (rank0) {
      for (const auto& r : ranks)
        fmt::print("rank {} | host {} | pid {} | {}\n", r["rank"].get<int>(),
                   r["host"].get<std::string>(), r["pid"].get<int>(),
                   r["device"].get<std::string>());
      if (const char* path = std::getenv("WEFT_RANK_TABLE"); path != nullptr && *path != 0) {
        const std::string tmp = std::string(path) + ".tmp";
        std::ofstream(tmp) << nlohmann::json{{"ranks", ranks}}.dump() << '\n';
        check(std::rename(tmp.c_str(), path) == 0, "WEFT_RANK_TABLE {}: cannot write it", path);
      }
      std::fflush(stdout);
    }
  }

  // The datasets, each read in place, and the orders training and validation
  // read their windows in (weft/data.h).
  void read_data() {
    set_threads(a.threads > 0 ? a.threads : default_threads());
    const TokenFormat format = parse_token_format(a.data_format);
    const bool shuffle = a.data_order == "shuffled";
    const int64_t t = cfg.seq_length;
    auto load = [&](const char* flag, const std::vector<std::string>& list) {
      const DataBlend blend = parse_blend(flag, list);
      std::vector<BlendPart> parts;
      for (size_t i = 0; i < blend.paths.size(); ++i) {
        auto d = std::make_shared<const TokenData>(TokenData::load(blend.paths[i], format));
        // The first MiB of tokens is checked against the vocabulary now; the
        // rest as it is read.
        std::vector<int32_t> head(static_cast<size_t>(std::min<int64_t>(d->size(), 1 << 20)));
        d->read(0, static_cast<int64_t>(head.size()), head.data());
        const int32_t top = *std::max_element(head.begin(), head.end());
        if (top >= head_top) {
          head_top = top;
          head_top_path = blend.paths[i];
        }
        check(top < cfg.vocab_size, "{} holds token id {}, outside --vocab-size ({})",
              blend.paths[i], top, cfg.vocab_size);
        const double w =
            blend.weights.empty() ? static_cast<double>(d->windows(t)) : blend.weights[i];
        if (w > 0) parts.push_back({std::move(d), w, 0, 0});
      }
      return parts;
    };
    std::vector<BlendPart> train, valid;
    if (!a.train_data_path.empty()) {
      train = load("--train-data-path", a.train_data_path);
      if (!a.valid_data_path.empty()) valid = load("--valid-data-path", a.valid_data_path);
    } else {
      // --split cuts each dataset's windows: the first share trains, the next validates.
      for (BlendPart& p : load("--data-path", a.data_path)) {
        const DataSplit split = split_windows(a.split, p.data->windows(t));
        if (split.valid > 0) valid.push_back({p.data, p.weight, split.train, split.valid});
        train.push_back({std::move(p.data), p.weight, 0, split.train});
      }
    }
    for (const BlendPart& p : train) data_.push_back(p.data);
    text_data = std::all_of(train.begin(), train.end(),
                            [](const BlendPart& p) { return p.data->is_text(); });
    const uint64_t seed = static_cast<uint64_t>(a.seed);
    train_order = std::make_shared<const WindowOrder>(train, t, shuffle, seed);
    if (!valid.empty())
      valid_order = std::make_shared<const WindowOrder>(valid, t, shuffle, seed ^ 0x76616c6964ULL);

    // Token data decodes through an llm.c tokenizer file; it cannot encode, so
    // a prompt is text data's only.
    if (!a.tokenizer.empty()) {
      check(!text_data, "--tokenizer decodes token data; {} is text (bytes need none)",
            fmt::join(train_paths(), " "));
      tokenizer = Tokenizer::load(a.tokenizer);
      check(tokenizer->vocab_size() > head_top,
            "--tokenizer {} has {} tokens; {} holds token id {}", a.tokenizer,
            tokenizer->vocab_size(), head_top_path, head_top);
    }
    if (!a.tokenizer_type.empty()) {
      check(!text_data,
            "--tokenizer-type {} encodes text into token data; {} is text (bytes "
            "need none)",
            a.tokenizer_type, fmt::join(train_paths(), " "));
      bpe.emplace(a.tokenizer_type == "GPT2BPETokenizer"
                      ? BpeTokenizer::load(a.vocab_file, a.merge_file)
                      : BpeTokenizer::load_json(a.tokenizer_model));
      check(bpe->vocab_size() > head_top, "--tokenizer-type {} has {} tokens; {} holds token id {}",
            a.tokenizer_type, bpe->vocab_size(), head_top_path, head_top);
    }
    // Documents: the tokenizer's end-of-document token ends each.
    if (a.eod_mask_loss || a.reset_position_ids || a.reset_attention_mask) {
      const char* flag = a.eod_mask_loss        ? "--eod-mask-loss"
                         : a.reset_position_ids ? "--reset-position-ids"
                                                : "--reset-attention-mask";
      check(!text_data,
            "{} needs documents, which an end-of-document token ends; {} is text (bytes have "
            "none): tokenize it with weft-preprocess --append-eod",
            flag, fmt::join(train_paths(), " "));
      docs.eod = bpe && bpe->eod() >= 0               ? bpe->eod()
                 : tokenizer && tokenizer->eot() >= 0 ? tokenizer->eot()
                 : bpe || tokenizer                   ? -1
                                                      : 50256;  // GPT-2's
      check(docs.eod >= 0,
            "{} needs an end-of-document token, and the tokenizer's vocabulary "
            "has no <|endoftext|>",
            flag);
      check(docs.eod < cfg.vocab_size,
            "{}: the end-of-document token {} ({}) is outside --vocab-size ({}); give the "
            "tokenizer the data was made with (--tokenizer-type or --tokenizer)",
            flag, docs.eod, bpe || tokenizer ? "the tokenizer's" : "GPT-2's, without a tokenizer",
            cfg.vocab_size);
      docs.eod_mask_loss = a.eod_mask_loss;
      docs.reset_position_ids = a.reset_position_ids;
      docs.reset_attention_mask = a.reset_attention_mask;
    }
    check(text_data || bpe || !app.count("--sample-prompt"),
          "--sample-prompt needs text data, or a tokenizer that encodes (--tokenizer-type "
          "GPT2BPETokenizer --vocab-file --merge-file): {} holds token ids, and an llm.c "
          "tokenizer file only decodes (the sample starts from end-of-text)",
          fmt::join(train_paths(), " "));
    check(a.eval_interval >= 0, "--eval-interval ({}) must be >= 0 (0: no validation)",
          a.eval_interval);
    check(a.eval_iters > 0, "--eval-iters ({}) must be positive", a.eval_iters);
    check(a.eval_interval == 0 || valid_order,
          "--eval-interval {} needs validation data: give --split (e.g. --split 98,2,0) with "
          "--data-path, or --valid-data-path with --train-data-path{}",
          a.eval_interval,
          a.split.empty() ? "" : fmt::format(" (--split '{}' leaves none)", a.split));
    entropy = unigram_entropy(data_);
  }

  // " | 70% of the sequences" for a part of a blend; "" for a lone dataset.
  static std::string share(const WindowOrder& order, size_t part) {
    if (order.parts().size() == 1) return "";
    double total = 0;
    for (const BlendPart& p : order.parts()) total += p.weight;
    return fmt::format(" | {:.3g}% of the sequences", 100 * order.parts()[part].weight / total);
  }

  const std::vector<std::string>& train_paths() const {
    return a.train_data_path.empty() ? a.data_path : a.train_data_path;
  }

  // The logical model; the layout instantiates this rank's part of it.
  void build_model() {
    family = &family_of(a, app);
    model.emplace(family->build(model_args(a, cfg)));
    model->io.graph = &model->graph;
    check(a.sample == 0 || model->head != nullptr || model->decode,
          "--sample {}: the {} family's model has no LM head (JobModel::head) and no decode "
          "hook (JobModel::decode) to read logits from",
          a.sample, family->name);
    check(!docs.positions() || model->positions >= 0,
          "--reset-position-ids and --reset-attention-mask need a model that reads positions "
          "within documents; the {} family's takes none (JobModel::positions)",
          family->name);
  }

  void set_options() {
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
    opt.async_save = a.async_save;
    // A loss four times a uniform guess's, ln(vocabulary), is no training.
    opt.max_loss = a.max_loss >= 0 ? a.max_loss : 4 * std::log(static_cast<double>(cfg.vocab_size));
    opt.device = setup.device;
    opt.local = {a.local_steps, a.outer_optimizer == "nesterov", a.outer_lr, a.outer_momentum};
    opt.spike.enabled = a.check_spiky_loss;
    opt.spike.factor = a.spiky_loss_factor;
    opt.spike.max_skipped = a.max_skipped_steps;
    set_precision(a, setup.device, model->graph);
    opt.loss_scale.enabled = a.fp16;
    opt.loss_scale.fixed = a.loss_scale;
    opt.loss_scale.initial = a.initial_loss_scale;
    opt.loss_scale.min = a.min_loss_scale;
    opt.loss_scale.window = a.loss_scale_window;
    opt.loss_scale.hysteresis = a.hysteresis;
    opt.config = {{"num_layers", cfg.num_layers},
                  {"hidden_size", cfg.hidden_size},
                  {"num_heads", cfg.num_heads},
                  {"seq_length", cfg.seq_length},
                  {"vocab_size", cfg.vocab_size},
                  {"max_positions", cfg.positions()},
                  {"make_vocab_size_divisible_by", a.vocab_divisor},
                  {"micro_batch_size", a.micro_batch},
                  {"global_batch_size", global},
                  {"seed", a.seed},
                  {"data_format", a.data_format},
                  {"data_order", a.data_order},
                  {"arch", family->name},
                  {"optimizer", weft::optimizer_name(weft::parse_optimizer(a.optimizer))},
                  {"precision", a.bf16   ? "bf16"
                                : a.fp16 ? "fp16"
                                         : "fp32"},
                  {"split", a.split},
                  {"lr", a.lr},
                  {"min_lr", a.min_lr},
                  {"lr_decay_style", a.lr_decay_style},
                  {"lr_warmup_iters", a.lr_warmup_iters},
                  {"lr_decay_iters", opt.lr.decay_iters}};
    // The datasets, and what a resume checks of their files.
    if (!a.data_path.empty()) {
      opt.config["data_path"] = blend_json(a.data_path);
      opt.config["data_fingerprint"] = blend_fingerprint(a.data_path, a.data_format);
    } else {
      opt.config["train_data_path"] = blend_json(a.train_data_path);
      opt.config["train_data_fingerprint"] = blend_fingerprint(a.train_data_path, a.data_format);
      if (!a.valid_data_path.empty()) opt.config["valid_data_path"] = blend_json(a.valid_data_path);
    }
    opt.config.update(model->config);  // the family's own fields
    batches.emplace(train_order, global, cfg.vocab_size);
    batches->set_documents(docs);
    if (valid_order) {
      validation.emplace(valid_order, global, cfg.vocab_size);
      validation->set_documents(docs);
    }
    if (rank0) {
      for (size_t i = 0; i < train_order->parts().size(); ++i) {
        const BlendPart& p = train_order->parts()[i];
        const BlendPart* v = nullptr;
        if (valid_order)
          for (const BlendPart& q : valid_order->parts())
            if (q.data == p.data) v = &q;
        fmt::print(
            "data {} | {}{} | {} tokens{} | windows [{}, {}) train{}\n", p.data->path(),
            token_format_name(p.data->format()),
            p.data->documents() > 1 ? fmt::format(", {} documents", p.data->documents()) : "",
            p.data->size(), share(*train_order, i), p.first_window,
            p.first_window + train_order->windows(static_cast<int>(i)),
            v == nullptr ? ""
                         : fmt::format(", [{}, {}) validate", v->first_window,
                                       v->first_window + v->num_windows));
      }
      if (valid_order && !a.valid_data_path.empty())
        for (const BlendPart& p : valid_order->parts())
          fmt::print("validation data {} | {} tokens{}\n", p.data->path(), p.data->size(),
                     share(*valid_order, static_cast<size_t>(&p - valid_order->parts().data())));
      fmt::print("data order: {}\n", train_order->shuffled()
                                         ? fmt::format("shuffled by --seed {}", a.seed)
                                         : std::string("file order (--data-order file)"));
    }
    lo.tp = a.tp;
    lo.sequence_parallel = a.sequence_parallel;
    lo.pp = a.pp;
    lo.schedule = a.schedule;
    lo.chunks = setup.chunks;
    lo.partition = parse_partition_method(a.partition);
    lo.pipeline = PipelineOptions{a.recompute, !a.trace.empty(), a.overlap_p2p_comm};
    if (a.recompute_granularity == "selective") {
      lo.pipeline.recompute_core_attention = true;
    } else if (a.recompute_granularity == "full") {
      lo.pipeline.recompute_method =
          a.recompute_method == "block" ? RecomputeMethod::Block : RecomputeMethod::Uniform;
      lo.pipeline.recompute_layers = a.recompute_num_layers;
    }
    if (!a.memory_budget.empty())
      lo.memory_budget = parse_bytes("--memory-budget", a.memory_budget);
    lo.sync.distributed_optimizer = a.distributed_optimizer;
    lo.sync.shard_grads = a.shard_grads;
    lo.sync.shard_params = a.shard_params;
    lo.sync.bucket_elements = a.ddp_bucket_size;
    lo.sync.overlap = a.overlap_grad_reduce;
    set_grad_compression(a, lo.sync);
  }

  void lock_save() {
    // One writer per --save folder: world rank 0, the writer, locks it for the
    // job's life, before it touches anything there; a second job stops here.
    if (rank0 && !a.save.empty()) save_lock.emplace(a.save);
    // What an interrupted save left behind goes first (world rank 0
    // completes checkpoints, so it cleans them).
    if (rank0 && !a.save.empty())
      for (const std::string& line : clean_stale_checkpoint_files(a.save)) fmt::print("{}\n", line);
    // Nobody reads before the cleaning is done; the disk bounds this wait.
    if (world != nullptr && !a.save.empty()) world->barrier_without_deadline();
  }

  // Parameter servers: the last --ps-ranks ranks serve; the others train,
  // as data-parallel replicas of their own group. True on a server, once
  // it has served.
  bool serve_parameters() {
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
      assign_to_servers(model->graph.params(),
                        ps.servers);  // refuses too many servers on every rank
      std::vector<int> w(static_cast<size_t>(workers)), s(static_cast<size_t>(a.ps_ranks));
      std::iota(w.begin(), w.end(), 0);
      std::iota(s.begin(), s.end(), workers);
      role = world->split({w, s}, "ps");
      if (rank0)
        fmt::print(
            "parameter servers: world ranks {}..{} serve {} workers (ranks 0..{}), "
            "--max-staleness {}\n",
            workers, world_size - 1, workers, workers - 1, a.max_staleness);
      if (world->rank() >= workers) {
        for (Param* p : model->graph.params()) init_param(*p, static_cast<uint64_t>(a.seed));
        PsServer server(*world, *role, model->graph.params(), ps);
        int64_t first = 0;
        if (!a.resume_from.empty()) {
          const Checkpoint c = open_checkpoint(a.resume_from, a.load_unverified);
          server.load(c);
          first = c.meta.step;
        }
        server.serve(first, a.train_iters);
        return true;
      }
      ps_worker.emplace(*world, model->graph.params(), ps);
      lo.ps = &*ps_worker;
    }
    return false;
  }

  void build_layout() {
    Communicator* team = role ? role.get() : world;  // the ranks that train
    if (a.pp > 1 || !a.profile.empty())
      cost = costs(a, model->graph, model->io, *batches, world, opt.device);
    layout.emplace(team, model->graph, model->io, *batches, opt, lo, static_cast<uint64_t>(a.seed),
                   cost ? &*cost : nullptr);
    if (!a.init_from.empty()) layout->trainer().load_weights(a.init_from);
    if (rank0 && layout->mesh())
      fmt::print("mesh: {}{}\n", layout->mesh()->layout.describe(),
                 a.sequence_parallel ? " | sequence-parallel" : "");
    PipelineExecutor* pipeline = layout->pipeline();
    if (pipeline) {
      // The plan's per-stage sums join the node costs: what weft-sched --costs reads.
      // With the whole model's layers on this process (tp 1), it also measures
      // what each stage's actions add to memory, for weft-sched's memory figures.
      PipelineOptions stage_options = lo.pipeline;
      stage_options.device = opt.device;
      if (rank0 && !a.profile.empty())
        with_params_on(model->graph.params(), opt.device, [&] {
          write_profile(a.profile, *cost, layout->plan(), model->graph,
                        a.tp == 1
                            ? measure_stage_bytes(model->graph, model->io, layout->plan(), *batches,
                                                  a.micro_batch, stage_options,
                                                  !sched::folds_weights(layout->schedule(), true))
                            : std::vector<sched::StageBytes>{},
                        a.recomputes(),
                        {{"micro_batch_size", a.micro_batch},
                         {"tp", a.tp},
                         {"num_layers", cfg.num_layers},
                         {"hidden_size", cfg.hidden_size},
                         {"num_attention_heads", cfg.num_heads},
                         {"seq_length", cfg.seq_length},
                         {"vocab_size", cfg.vocab_size}});
        });
      if (rank0 && a.pp > 1)
        fmt::print("schedule {} over {} stages; partition {}:\n{}", a.schedule,
                   layout->schedule().stages(), a.partition, layout->plan().describe(model->graph));
    }
  }

  void check_host_memory() {
    // Before the first step: the memory a micro-batch needs at the least. The
    // sum of every node's outputs (the activations kept for the backward) over
    // pp x tp ranks, and each rank's share of the weights, gradients and AdamW
    // moments, times the ranks on this host. A shape far too large for the
    // machine is refused here rather than found by the kernel's OOM killer.
    if (setup.device.is_cpu()) {
      const CostModel analytic = CostModel::analytic(model->graph);
      double outputs = 0;
      for (const NodeCost& c : analytic.nodes) outputs += c.output_bytes;
      const double shards = static_cast<double>(a.pp * a.tp);
      const double dp = static_cast<double>((world ? world->size() : 1) / (a.pp * a.tp));
      // Values (a replica's slice with --data-parallel-sharding-strategy
      // optim_grads_params), gradients (a slice with optim_grads) and AdamW's
      // two moments (a slice with the distributed optimizer).
      const double state = 4.0 * static_cast<double>(model->graph.param_count()) / shards *
                           ((a.shard_params ? 1.0 / dp : 1.0) + (a.shard_grads ? 1.0 / dp : 1.0) +
                            2.0 / (a.distributed_optimizer ? dp : 1.0));
      char host[64] = {};
      gethostname(host, sizeof host - 1);
      int here = 0;
      for (const auto& r : ranks) here += r["host"].get<std::string>() == host;
      const double need = (outputs / shards + state) * here;
      const double avail = host_available;
      check(
          need <= avail,
          "out of host memory: this run needs at least {} on {} ({} rank{} x ({} of activations "
          "per micro-batch + {} of weights, gradients and AdamW state)), and {} were available "
          "as it started: use "
          "a smaller --micro-batch-size or --seq-length, or more --pp or --tp ranks",
          format_bytes(need), host, here, here == 1 ? "" : "s", format_bytes(outputs / shards),
          format_bytes(state), format_bytes(avail));
    }
  }

  void resume() {
    Trainer& trainer = layout->trainer();
    const std::string& load = a.resume_from;
    if (!load.empty()) {
      const CheckpointSource source = trainer.load(load, a.load_unverified, a.weights_only);
      if (rank0) {
        for (const auto& [folder, why] : source.skipped)
          fmt::print("warning: skipped {}, which does not verify: {}\n", folder, why);
        if (!source.verified)
          fmt::print("note: {} has no manifest.json: loaded unverified (--load-unverified)\n",
                     source.path);
        // Each rank reads the slices holding its state: at the layout that
        // saved, exactly its own bytes.
        fmt::print(
            "loaded {}: the ranks read {} of its slices ({} bytes, at most {} on one rank) for "
            "{} bytes of state\n",
            source.path, format_bytes(static_cast<double>(source.all_read)), source.all_read,
            source.most_read, source.all_wanted);
      }
    }
  }

  void announce() {
    Trainer& trainer = layout->trainer();
    if (rank0)
      for (const std::string& note : a.notes) fmt::print("note: {}\n", note);
    if (rank0 && !a.rewound.empty())
      fmt::print(
          "note: --overwrite-checkpoints: the first save removes {} from --save (newer than "
          "the step this run starts after)\n",
          fmt::join(a.rewound, ", "));

    const int64_t padding = cfg.table_rows() - cfg.vocab_size;
    if (rank0 && padding > 0)
      fmt::print(
          "vocabulary {} padded to {} (--make-vocab-size-divisible-by {} x tp {}): {} rows "
          "of zeros with masked logits, not saved\n",
          cfg.vocab_size, cfg.table_rows(), a.vocab_divisor, a.tp, padding);
    if (rank0)
      fmt::print(
          "weft {} | layers {} | hidden {} | heads {} | seq {} | vocab {} | params {} "
          "| micro-batch {} x {} = global {} | {} | data {} ({} tokens, unigram entropy "
          "{:.3f} nats)\n",
          a.job->program, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.seq_length,
          cfg.vocab_size, true_param_count(model->graph), a.micro_batch, global / a.micro_batch,
          global,
          setup.device.is_cpu()
              ? fmt::format(
                    "threads {} | GEMM {}{}", get_threads(),
                    cpu::describe_gemm_library(cpu::gemm_library()),
                    a.bf16 && cpu::bf16_gemm() == cpu::Bf16Gemm::OneDnn
                        ? fmt::format(" | bf16 ({}; activations rounded)",
                                      cpu::describe_bf16_gemm(cpu::Bf16Gemm::OneDnn))
                    : a.bf16 || a.fp16
                        ? fmt::format(" | {} (emulated on the CPU: GEMM inputs{} rounded, "
                                      "slower than fp32)",
                                      a.bf16 ? "bf16" : "fp16", a.bf16 ? " and activations" : "")
                        : "")
              : fmt::format("{}{}{}", setup.device.str(),
                            a.tf32   ? " tf32"
                            : a.bf16 ? " bf16"
                            : a.fp16 ? " fp16"
                                     : "",
                            ops::attention_uses_fused(setup.device, cfg.hidden_size / cfg.num_heads)
                                ? " fused-attention"
                                : ""),
          fmt::join(train_paths(), " "), total_tokens(), entropy);
    if (rank0 && !a.adopted_note.empty()) fmt::print("{}\n", a.adopted_note);
    if (trainer.steps_done() > 0 && rank0)
      fmt::print("resumed from {} at step {}{}\n", a.resume_from, trainer.steps_done(),
                 a.load.empty() || a.finetune
                     ? " (automatic: --save holds it; --no-load starts over)"
                     : "");
    if (a.weights_only && rank0)
      fmt::print("fine-tuning from the weights of {} (--finetune: no optimizer state, step 0)\n",
                 a.resume_from);
  }

  // " (0.52 steps)": a stall against the last step read.
  std::string stall_in_steps(double ms) const {
    const double step_ms = recent_ms.empty() ? 0 : recent_ms.back();
    return step_ms > 0 ? fmt::format(" ({:.2f} steps)", ms / step_ms) : "";
  }

  // Every save goes through here: once per step, pruned, and said. With
  // --async-save the writing goes on in the background unless `wait` (the
  // run's last save, or a stop): the next save waits for it first.
  void save(bool wait = false) {
    Trainer& trainer = layout->trainer();
    if (!a.save.empty() && last_saved != trainer.steps_done()) {
      trainer.save(a.save, a.keep_last);
      last_saved = trainer.steps_done();
      if (a.async_save && rank0)
        fmt::print(
            "saving checkpoint at step {} to {} in the background: training stalled "
            "{:.1f} ms{}\n",
            trainer.steps_done(), a.save, trainer.last_save_stall_ms(),
            stall_in_steps(trainer.last_save_stall_ms()));
      if (!a.async_save && rank0)
        fmt::print("saved checkpoint at step {} to {}: training stalled {:.1f} ms{}\n",
                   trainer.steps_done(), a.save, trainer.last_save_stall_ms(),
                   stall_in_steps(trainer.last_save_stall_ms()));
    }
    if (wait && a.async_save && !a.save.empty()) {
      trainer.wait_for_saves();
      if (rank0) fmt::print("saved checkpoint at step {} to {}\n", last_saved, a.save);
    }
  }

  // The steps up to --train-iters; true when the run stopped before them
  // (saved, and said why).
  bool train() {
    Trainer& trainer = layout->trainer();
    if (!a.log_jsonl.empty() && rank0) {
      jsonl.open(a.log_jsonl, trainer.steps_done() > 0 ? std::ios::app : std::ios::trunc);
      check(jsonl.good(), "--log-jsonl {}: cannot open for writing", a.log_jsonl);
      // A header line for every start (a resumed run appends one): step records
      // are the lines with a "step".
      jsonl << nlohmann::json{{"start_step", trainer.steps_done()}, {"ranks", ranks}}.dump()
            << '\n';
    }
    // The family's count (GPT's: 6 x parameters without wpe + attention's
    // 12 L T C), else 6 x parameters.
    flops_per_token = model->flops_per_token > 0
                          ? model->flops_per_token
                          : 6.0 * static_cast<double>(true_param_count(model->graph));
    const auto started = std::chrono::steady_clock::now();
    Tensor stop_flags = Tensor::zeros({2});
    // Signals are caught with --save; a time limit is checked whenever it is
    // set. Parameter servers take neither yet: a signal ends the job, which
    // resumes from its last checkpoint (scripts/weft-run).
    const bool catch_signals = !a.save.empty() && !ps_worker;
    if (catch_signals) install_stop_handlers(a.job->program);
    const bool check_stop = catch_signals || a.exit_duration_mins > 0;
    last_saved = trainer.steps_done();  // a resumed run's step is on disk already
    // A step's record, once read: the ETA's pace, the plot, the metrics file
    // and the log line.
    // --plan auto: its predicted step against this run's first steps (the
    // first, warming up, left out when there are more).
    const auto plan_check =
        static_cast<size_t>(std::clamp<int64_t>(a.train_iters - trainer.steps_done(), 1, 6));
    auto take = [&, this](const StepRecord& r, std::optional<double> val_loss) {
      if (recent.size() == kRecent)
        recent.erase(recent.begin()), recent_ms.erase(recent_ms.begin());
      recent.push_back(r.loss);
      recent_ms.push_back(r.step_ms);
      if (rank0 && a.plan_step_ms > 0 && recent_ms.size() == plan_check)
        check_plan(
            std::vector<double>(recent_ms.begin() + (plan_check > 1 ? 1 : 0), recent_ms.end()),
            r.step + 1);
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
    auto take_all = [&, this](bool eval = false) {
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
      fmt::print(
          "note: the run resumes after step {}, and --train-iters is {}: no step to take "
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
          check_stop && can_stop
              ? stop_requested(world, stop_flags,
                               a.exit_duration_mins > 0 && elapsed >= a.exit_duration_mins * 60)
              : StopReason{};
      const bool at_exit_interval =
          a.exit_interval > 0 && trainer.steps_done() % a.exit_interval == 0;
      if (stop.any() || at_exit_interval) {
        take_all();
        save(/*wait=*/true);
        if (rank0) {
          const std::string why = stop.signal > 0 ? fmt::format("on {}", signal_name(stop.signal))
                                  : stop.out_of_time
                                      ? fmt::format("after {:g} minutes (--exit-duration-in-mins)",
                                                    a.exit_duration_mins)
                                      : fmt::format("at --exit-interval {}", a.exit_interval);
          fmt::print("stopping {} after step {}; {}\n", why, trainer.steps_done(),
                     a.save.empty() ? std::string("nothing was saved (no --save)")
                                    : fmt::format("run again with --load {} to continue", a.save));
        }
        std::fflush(stdout);
        return true;
      }
    }
    return false;
  }

  // The planner's validation (docs/plan_validate.md) holds every step it
  // predicts within 15% on this machine: a plan further off than that says
  // so, for its prediction (and the choice it made from it) is suspect.
  void check_plan(std::vector<double> ms, int64_t last_step) const {
    constexpr double kStatedError = 0.15;
    std::sort(ms.begin(), ms.end());
    const double median = ms[ms.size() / 2];
    const double error = median / a.plan_step_ms - 1;
    fmt::print(
        "plan auto: predicted {:.1f} ms a step; steps {}-{} took {:.1f} ms (median; "
        "{:.1f}-{:.1f}), "
        "{:+.1f}%{}\n",
        a.plan_step_ms, last_step - static_cast<int64_t>(ms.size()) + 1, last_step, median,
        ms.front(), ms.back(), 100 * error,
        std::abs(error) <= kStatedError
            ? ", within the planner's stated error (15%)"
            : ": beyond the planner's stated error (15%), so the plan it chose may not be the "
              "fastest here; weft-sched plan --profile with a --profile of this run ranks the "
              "layouts again");
    std::fflush(stdout);
  }

  void report() {
    PipelineExecutor* pipeline = layout->pipeline();
    if (pipeline && !a.trace.empty()) {
      pipeline->write_trace(a.trace);
      if (rank0) fmt::print("wrote the trace of every action to {}\n", a.trace);
    }
    if (pipeline) {
      // Each rank's peak of activation memory in the last step, measured (arena
      // bytes) and as the schedule's model composes it from what this rank's
      // actions added (sched::memory_use): the two agree exactly.
      const int me = pipeline->group().rank();
      const double modelled = sched::memory_use(layout->schedule(), pipeline->stage_bytes(),
                                                a.recomputes(), a.overlap_p2p_comm)
                                  .peak[static_cast<size_t>(me)];
      Tensor all = Tensor::zeros({2 * a.pp}), mine = Tensor::zeros({2});
      mine.data<float>()[0] = static_cast<float>(pipeline->peak_bytes());
      mine.data<float>()[1] = static_cast<float>(modelled);
      pipeline->group().all_gather(mine, all);
      const std::vector<int> promised = sched::peak_in_flight(layout->schedule(), a.recomputes());
      if (rank0) {
        std::vector<std::string> measured, composed;
        for (int r = 0; r < a.pp; ++r) {
          measured.push_back(format_bytes(all.data<float>()[2 * r]));
          composed.push_back(format_bytes(all.data<float>()[2 * r + 1]));
        }
        fmt::print(
            "activation memory, peak per pipeline rank: [{}] held, [{}] by {}'s model; "
            "[{}] micro-batch stages\n",
            fmt::join(measured, ", "), fmt::join(composed, ", "), a.schedule,
            fmt::join(promised, ", "));
      }
    }
    if (rank0 && a.ps_ranks == 0) {
      // What rank 0 keeps for its parameters (weft/grad_sync.h's Memory):
      // the sharding strategy's effect, beside the activations above.
      // What GradSync runs, not what was asked: at dp 1 nothing is sharded.
      const GradSync& sync = layout->trainer().grad_sync();
      const GradSync::Memory m = sync.memory();
      fmt::print(
          "training state on rank 0 ({}): {} of values{}, {} of gradients{}, {} of optimizer "
          "state; {} in all\n",
          sync.sharded_params()     ? "optimizer state, gradients and parameters sharded over dp"
          : sync.sharded_grads()    ? "optimizer state and gradients sharded over dp"
          : sync.distributed()      ? "optimizer state sharded over dp"
          : a.distributed_optimizer ? "nothing sharded: dp is 1"
                                    : "nothing sharded",
          format_bytes(m.values),
          m.value_buffers > 0
              ? fmt::format(" + {} of gathered-parameter buffers", format_bytes(m.value_buffers))
              : std::string(),
          format_bytes(m.grads),
          m.grad_buffers > 0
              ? fmt::format(" + {} of micro-batch gradient buffers", format_bytes(m.grad_buffers))
              : std::string(),
          format_bytes(m.state), format_bytes(m.total()));
    }
    if (!recent.empty() && rank0) {
      double mean = 0;
      for (double l : recent) mean += l;
      mean /= static_cast<double>(recent.size());
      fmt::print(
          "mean loss of the last {} steps: {:.4f} nats ({:.2f} bits per token); unigram "
          "entropy of the data: {:.4f} nats\n",
          recent.size(), mean, mean / std::log(2.0), entropy);
    }
    if (rank0 && !a.loss_plot.empty()) {
      write_loss_plot(
          a.loss_plot, train_points, val_points,
          fmt::format("{} layers x {}, global batch {}", cfg.num_layers, cfg.hidden_size, global));
      fmt::print("wrote the loss curve to {}\n", a.loss_plot);
    }
    save(/*wait=*/true);  // the last step, once (unless the interval has just saved it)
    if (ps_worker && rank0) {
      const std::vector<int64_t> h = ps_worker->staleness_histogram();
      std::vector<std::string> bins;
      for (size_t s = 0; s < h.size(); ++s)
        if (h[s] > 0)
          bins.push_back(fmt::format("{}{}: {}", s, s + 1 == h.size() ? "+" : "", h[s]));
      fmt::print(
          "staleness of the servers' updates (updates from other workers between a "
          "worker's read and its push): {}\n",
          fmt::join(bins, ", "));
    }
  }

  void sample() {
    if (!rank0) return;  // one sample, drawn by rank 0
    {
      std::vector<int32_t> prompt;
      if (text_data) {
        for (unsigned char ch : a.sample_prompt) prompt.push_back(ch);
      } else if (bpe && !a.sample_prompt.empty()) {
        prompt = bpe->encode(a.sample_prompt);
        for (int32_t t : prompt)
          check(t < cfg.vocab_size,
                "--sample-prompt: token {} of its encoding is outside "
                "--vocab-size ({})",
                t, cfg.vocab_size);
      } else {  // token data: start from end-of-text (the tokenizer's, else GPT-2's)
        const int32_t eot = bpe && bpe->eod() >= 0               ? bpe->eod()
                            : tokenizer && tokenizer->eot() >= 0 ? tokenizer->eot()
                                                                 : 50256;
        prompt.push_back(eot < cfg.vocab_size ? eot : 0);
      }
      // The family's model for one sequence at a time, with the trained weights.
      ModelArgs one = model_args(a, cfg);
      one.micro_batch = 1;
      JobModel sampler = family->build(one);
      sampler.io.graph = &sampler.graph;
      if (a.pp > 1 || a.tp > 1 || a.shard_params) {
        // The trained weights are split over the ranks: rank 0 reads them
        // whole from the run's last checkpoint (saved above, and verified as
        // it is read).
        const Checkpoint c = open_checkpoint(a.save);
        c.read_model(sampler.graph.params());
        fmt::print("sampling on rank 0 with the weights of {} (step {})\n", c.source.path,
                   c.meta.step);
      } else {
        place_params(model->graph.params(), Device::cpu());  // sampling runs on the host
        for (Param* p : sampler.graph.params()) {
          const Param* trained = model->params->find(p->name);
          check(trained != nullptr,
                "--sample: the {} family's model for one sequence has {}, which "
                "the trained model lacks",
                family->name, p->name);
          p->value.copy_from(trained->value);
        }
      }
      auto tokens = sample_tokens(sampler, cfg, prompt, a.sample, a.sample_temperature,
                                  static_cast<uint64_t>(a.seed), docs.eod);
      fmt::print("--- sample ({} tokens, temperature {}) ---\n", a.sample, a.sample_temperature);
      if (text_data) {
        std::string s(a.sample_prompt);
        for (int32_t t : tokens) s.push_back(static_cast<char>(t));
        fmt::print("{}\n", s);
      } else if (bpe) {
        fmt::print("{}{}\n", a.sample_prompt, bpe->decode(tokens));
      } else if (tokenizer) {
        std::string s;
        for (int32_t t : tokens) s += tokenizer->decode(t);
        fmt::print("{}\n", s);
      } else {
        for (int32_t t : tokens) fmt::print("{} ", t);
        fmt::print("\n(token ids: give --tokenizer-type or --tokenizer to decode them)\n");
      }
    }
  }

  const Args& a;
  const CLI::App& app;
  Communicator* world;  // the MPI world, or the staged or NCCL one over it
  const GptConfig cfg;
  const int64_t global;  // sequences per step
  double host_available = 0;  // the host's available memory as the run started
  int world_size = 1, workers = 1;
  PipelineSetup setup;
  std::optional<HostStagedCommunicator> staged_world;
  std::unique_ptr<Communicator> nccl;  // over the MPI world, which carries host tensors
  bool rank0 = true;
  nlohmann::json ranks;
  std::vector<std::shared_ptr<const TokenData>> data_;  // the training datasets

  int64_t total_tokens() const {
    int64_t n = 0;
    for (const auto& d : data_) n += d->size();
    return n;
  }
  std::optional<Tokenizer> tokenizer;
  DocumentOptions docs;  // --eod-mask-loss, --reset-position-ids, --reset-attention-mask
  std::optional<BpeTokenizer> bpe;
  std::shared_ptr<const WindowOrder> train_order, valid_order;
  bool text_data = false;
  int32_t head_top = -1;  // the largest token id of the datasets' first MiB of tokens
  std::string head_top_path;
  double entropy = 0;
  const ModelFamily* family = nullptr;
  std::optional<JobModel> model;
  TrainOptions opt;
  std::optional<TokenBatches> batches, validation;
  LayoutOptions lo;
  std::optional<SaveDirLock> save_lock;
  std::unique_ptr<Communicator> role;
  std::optional<PsWorker> ps_worker;
  std::optional<CostModel> cost;
  std::optional<RankLayout> layout;
  // What the steps leave for the report: the metrics file, the recent
  // steps' losses (noisy, each reads one stretch of the data: the run is
  // summarised by their mean) and the curves.
  std::ofstream jsonl;
  double flops_per_token = 0;
  static constexpr size_t kRecent = 50;
  std::vector<double> recent, recent_ms;
  std::vector<std::pair<double, double>> train_points, val_points;  // (step, loss)
  int64_t last_saved = 0;
};

}  // namespace

// --plan auto without --plan-costs: rank 0 profiles the model as train_gpt
// --pp 2 --profile would (every node's F, I and W on the run's device, at
// the --micro-batch-size given, else 1; what each of two stages' actions
// hold; the update), on tokens drawn from the seed, since a step's time does
// not depend on which tokens it reads. Every rank measures the links
// (check_links, 1 MiB messages), unless --plan-link-latency and
// --plan-bandwidth say them. Rank 0 plans, and every rank takes its layout.
void plan_by_profile(Args& a, const CLI::App& app, weft::Communicator* world) {
  using namespace weft;
  const int size = world ? world->size() : 1;
  const bool rank0 = world == nullptr || world->rank() == 0;
  const GptConfig cfg = resolve_config(a, app);
  std::string links = "one rank, no links";
  if (size > 1) {
    const std::vector<LinkResult> measured = check_links(*world, int64_t{1} << 20, 3);
    std::vector<double> lat, bw;
    for (const LinkResult& l : measured) lat.push_back(l.latency_us), bw.push_back(l.gb_per_s);
    auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v.empty() ? 0.0 : v[v.size() / 2];
    };
    if (app.count("--plan-link-latency") == 0) a.plan_latency = median(lat) * 1e-6;
    if (app.count("--plan-bandwidth") == 0) a.plan_bandwidth = median(bw) * 1e9;
    links = fmt::format("links {:.1f} us, {:.2f} GB/s ({}, median of {} pairs)",
                        a.plan_latency * 1e6, a.plan_bandwidth / 1e9,
                        app.count("--plan-link-latency") + app.count("--plan-bandwidth") == 2
                            ? "as given"
                            : "measured",
                        measured.size());
  }
  const std::vector<std::string> schedules = sched::schedule_names();
  Tensor choice = Tensor::zeros({11}, DType::I32);
  int32_t* c = choice.data<int32_t>();
  std::string error;
  if (rank0) {
    try {
      Args b = a;
      b.micro_batch = app.count("--micro-batch-size") ? a.micro_batch : 1;
      bool staged = false, nccl = false;
      const Device device = resolve_device(a, size, staged, nccl);
      JobModel model = family_of(a, app).build(model_args(b, cfg));
      model.io.graph = &model.graph;
      set_precision(a, device, model.graph);  // the run's precision and attention
      for (Param* q : model.graph.params()) init_param(*q, static_cast<uint64_t>(a.seed));
      std::vector<int32_t> tokens(static_cast<size_t>(b.micro_batch * (cfg.seq_length + 1) * 4));
      uint64_t x = static_cast<uint64_t>(a.seed) * 0x9E3779B97F4A7C15ull + 1;
      for (int32_t& t : tokens) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        t = static_cast<int32_t>(x % static_cast<uint64_t>(cfg.vocab_size));
      }
      const TokenData data =
          TokenData::from_tokens(std::move(tokens), static_cast<int32_t>(cfg.vocab_size));
      TokenBatches batches(data, b.micro_batch, cfg.seq_length);
      if (model.positions >= 0) {  // documents at token 0: the time is the same
        DocumentOptions docs;
        docs.eod = 0;
        docs.reset_position_ids = cfg.reset_position_ids;
        docs.reset_attention_mask = cfg.reset_attention_mask;
        batches.set_documents(docs);
      }
      nlohmann::json profile;
      const auto started = std::chrono::steady_clock::now();
      with_params_on(model.graph.params(), device, [&] {
        const CostModel cost = profile_costs(model.graph, model.io, batches, b.micro_batch, 5);
        PartitionOptions po;
        po.pp = cfg.num_layers >= 2 ? 2 : 1;
        const StagePlan stages = partition(model.graph, cost, po);
        PipelineOptions options;
        options.device = device;
        profile = cost_model_json(cost, model.graph);
        profile.update(stage_costs_json(
            cost, stages, model.graph, profile_updates(model.graph, stages),
            measure_stage_bytes(model.graph, model.io, stages, batches, b.micro_batch, options)));
      });
      profile["micro_batch_size"] = b.micro_batch;
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      adopt_plan(b, app, plan_input(b, app, size, profile, "--plan auto's profile"));
      a.plan_note =
          fmt::format("plan auto: profiled on rank 0 at micro-batch {} on {} in {:.1f} s; {}\n{}",
                      b.micro_batch, device.str(), seconds, links, b.plan_note);
      a.plan_step_ms = b.plan_step_ms;
      const auto at = std::find(schedules.begin(), schedules.end(), b.schedule);
      c[0] = 1, c[1] = b.tp, c[2] = b.pp, c[3] = b.virtual_stages;
      c[4] = static_cast<int32_t>(b.micro_batch), c[5] = b.recompute,
      c[6] = b.distributed_optimizer;
      c[7] = b.shard_grads, c[8] = b.sequence_parallel;
      c[9] = static_cast<int32_t>(at - schedules.begin());
      c[10] = b.shard_params;
    } catch (const std::exception& e) {
      error = e.what();
      c[0] = -1;
    }
  }
  if (world) {
    world->barrier_without_deadline();  // the profile takes what it takes
    world->broadcast(choice, 0);
  }
  if (c[0] < 0)
    throw Error("{}", rank0 ? error : "--plan auto: rank 0 could not plan (its error says why)");
  a.tp = c[1], a.pp = c[2], a.virtual_stages = c[3], a.micro_batch = c[4];
  a.recompute = c[5] != 0, a.distributed_optimizer = c[6] != 0, a.shard_grads = c[7] != 0;
  a.sequence_parallel = c[8] != 0, a.shard_params = c[10] != 0;
  if (c[9] >= 0 && c[9] < static_cast<int32_t>(schedules.size()))
    a.schedule = schedules[static_cast<size_t>(c[9])];
  a.plan_pending = false;
  if (rank0) fmt::print("{}\n", a.plan_note);
}

int run(const Args& a, const CLI::App& app, weft::Communicator* world) {
  if (!a.plan_pending) return Run(a, app, world)();
  Args planned = a;
  plan_by_profile(planned, app, world);
  return Run(planned, app, world)();
}

// The MPI links (host memory) always; then, where the job's device tensors
// would go by NCCL (--device cuda, a GPU per rank or WEFT_NCCL_ONE_GPU=1 with
// --comm-backend nccl), NCCL's links between the ranks' GPUs too.
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

}  // namespace weft::job_detail
