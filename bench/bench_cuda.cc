// bench_cuda — GPT training throughput on one GPU, as a table: the step
// train_gpt --device cuda runs (the same graph, layers, Trainer and
// optimizer; weft/ops.h picks the CUDA kernels).
//
//   bench_cuda                                   # GPT-2 124M, B 16, T 1024; bf16+fused,
//                                                # bf16g+fused, tf32+fused (where built),
//                                                # bf16, tf32, fp32
//   bench_cuda --model mini --batch 8 --steps 5 --modes tf32,bf16+fused
//   bench_cuda --make-vocab-size-divisible-by 1  # GPT-2's odd 50257 rows, unpadded
//   bench_cuda --profile --json out.jsonl        # + where each mode's step time goes
//
// The vocabulary is padded as train_gpt pads it (default 128: 50257 -> 50304).
// A mode is the GEMMs' precision (fp32, tf32, or bf16 as train_gpt --bf16
// runs it: bf16 GEMMs and activations stored in bf16; bf16g is bf16 GEMM
// inputs with fp32 activations, for comparison), with "+fused" for cuDNN's
// fused attention (train_gpt --attention-backend fused) instead of the
// unfused one; the default list adds tf32+fused, bf16g+fused and bf16+fused
// in builds with cuDNN.
//
// A timed step is Trainer::train_step: zero the gradients, upload the
// tokens, forward and backward, gradient norm, AdamW with the clip. Each timed
// step runs between two synchronizes of the GPU and "step ms" is their
// median (as bench/pytorch_gpt_cuda.py times PyTorch's), after --warmup
// untimed steps. FLOPs per token = 6 x (parameters
// without wpe) + 12 x L x T x C, as bench_train and llm.c count them. MFU is
// the achieved FLOP/s over --peak-tflops (default 989: the H100/H200 SXM dense
// bf16 tensor-core peak), for every mode, so the rows compare. "peak GiB" is
// the caching allocator's most bytes in use during the mode. The last column
// counts cudaMalloc calls during the timed steps (0: the caching allocator
// served every step). Exits 77 without a GPU.
//
// --json FILE writes one JSON object per line (JSON Lines), one per mode, as
// soon as the mode is done: {"framework": "weft", "mode", "step_ms",
// "tokens_per_s", "tflops", "mfu" (a fraction), "peak_gib", "loss", ...}, which
// scripts/gpu-check.sh merges with PyTorch's rows (bench/cuda_table.py).
//
// --profile, after each mode's timed steps, times every graph node's forward,
// backward-input and backward-weight, and the update's parts (zeroing the
// gradients, their norm, AdamW with the clip), with weft/profile.h's profilers
// (the same as train_gpt --profile on the CPU): CUDA events around each
// node's work on the compute stream, read after one synchronize per pass,
// median of 3 passes. It prints one table per mode after the main one: time
// per node kind (attention, linear layers' GEMMs, layernorm, the residual
// add fused with layernorm, gelu, lm head and loss, embedding, residual)
// and per update part, in ms and as a share of the step; the rest of the
// step ("outside the nodes") is uploads, the host's waits and the GPU's idle
// gaps between nodes. With --json, each mode's object gets "profile": every
// node's seconds and the update's parts.
//
// --kernel-profile opens the CUDA profiler's collection range around each
// mode's first timed step and nothing else, so that `ncu --profile-from-start
// off --metrics gpu__time_duration.sum --csv bench_cuda --modes bf16+fused
// --steps 1 --kernel-profile` records every kernel of one whole step and none
// of the set-up, warm-up or other steps (bench/kernel_table.py sums them by
// kernel; scripts/gpu-check.sh runs it).
#include <weft/device.h>

#include "weft_config.h"

#include <fmt/core.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#if WEFT_CUDA
#include <weft/cuda/runtime.h>
#include <weft/ops.h>
#include <weft/profile.h>
#include <weft/trainer.h>

#include "models/gpt.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <map>
#include <random>

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::string model = "gpt2";
  int64_t batch = 16;
  int steps = 10;
  int warmup = 2;
  std::vector<std::string> modes;  // default: bf16, tf32, fp32, after their +fused where built
  double peak_tflops = 989.0;
  int64_t vocab_divisor = 128;  // train_gpt's --make-vocab-size-divisible-by
  std::string json;             // --json FILE: one JSON line per mode
  bool profile = false;         // --profile: where each mode's step time goes
  bool kernel_profile = false;  // --kernel-profile: the profiler's range around one step
};

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    const size_t comma = std::min(s.find(',', start), s.size());
    if (comma > start) out.push_back(s.substr(start, comma - start));
    start = comma + 1;
  }
  return out;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      weft::check(i + 1 < argc, "{} needs a value", a);
      return argv[++i];
    };
    if (a == "--model") o.model = value();
    else if (a == "--batch") o.batch = std::stoll(value());
    else if (a == "--steps") o.steps = std::stoi(value());
    else if (a == "--warmup") o.warmup = std::stoi(value());
    else if (a == "--modes") o.modes = split(value());
    else if (a == "--peak-tflops") o.peak_tflops = std::stod(value());
    else if (a == "--make-vocab-size-divisible-by") o.vocab_divisor = std::stoll(value());
    else if (a == "--json") o.json = value();
    else if (a == "--profile") o.profile = true;
    else if (a == "--kernel-profile") o.kernel_profile = true;
    else
      throw weft::Error("unknown argument '{}' (--model, --batch, --steps, --warmup, --modes, "
                        "--peak-tflops, --make-vocab-size-divisible-by, --json, --profile, "
                        "--kernel-profile)",
                        a);
  }
  if (o.modes.empty()) {
    // train_gpt --bf16's step first: a run cut short by a deadline keeps it.
    o.modes = {"bf16", "tf32", "fp32"};
    if (weft::ops::fused_attention_built())
      o.modes.insert(o.modes.begin(), {"bf16+fused", "bf16g+fused", "tf32+fused"});
  }
  for (const std::string& name : o.modes) {
    const size_t plus = name.find('+');
    const std::string precision = name.substr(0, plus);
    weft::check(precision == "fp32" || precision == "tf32" || precision == "bf16" ||
                    precision == "bf16g",
                "--modes: '{}' is not available on the train_gpt path (fp32, tf32, bf16, bf16g)",
                precision);
    weft::check(plus == std::string::npos || name.substr(plus) == "+fused",
                "--modes: '{}': the one suffix is +fused (cuDNN's fused attention)", name);
    weft::check(plus == std::string::npos || weft::ops::fused_attention_built(),
                "--modes {}: weft was built without cuDNN's fused attention", name);
  }
  weft::check(o.vocab_divisor >= 1 && o.vocab_divisor <= (int64_t{1} << 20),
              "--make-vocab-size-divisible-by ({}) must be between 1 (no padding) and 2^20",
              o.vocab_divisor);
  weft::check(o.batch > 0 && o.steps > 0 && o.warmup >= 0 && o.peak_tflops > 0,
              "--batch ({}) and --steps ({}) must be positive, --warmup ({}) not negative",
              o.batch, o.steps, o.warmup);
  return o;
}

// Random tokens, the same every step: the bench times compute, not data.
class RandomTokens final : public weft::BatchSource {
 public:
  RandomTokens(int64_t count, int32_t vocab) : tok_(static_cast<size_t>(count)), tgt_(tok_.size()) {
    std::mt19937 rng(7);
    std::uniform_int_distribution<int32_t> dist(0, vocab - 1);
    for (size_t i = 0; i < tok_.size(); ++i) tok_[i] = dist(rng), tgt_[i] = dist(rng);
  }
  void fill(int64_t, int64_t index, std::span<const weft::Tensor> in) const override {
    const int64_t seq_len = in[0].dim(1);
    const size_t at = static_cast<size_t>(index * seq_len), n = static_cast<size_t>(in[0].numel());
    std::copy_n(tok_.begin() + static_cast<std::ptrdiff_t>(at), n, in[0].data<int32_t>());
    std::copy_n(tgt_.begin() + static_cast<std::ptrdiff_t>(at), n, in[1].data<int32_t>());
  }

 private:
  std::vector<int32_t> tok_, tgt_;
};

// The per-node kinds of a GPT graph, in the profile table's order, and their names there.
const std::vector<std::pair<std::string, std::string>>& kind_rows() {
  static const std::vector<std::pair<std::string, std::string>> rows = {
      {"attention", "attention (QK^T, softmax, PV)"},
      {"linear", "attention's linear layers (GEMMs, bias)"},
      {"gelu_mlp", "MLP (c_fc, GELU, c_proj)"},
      {"layernorm", "layernorm"},
      {"residual_layernorm", "residual add + layernorm"},
      {"lm_head_loss", "lm head + loss"},
      {"embedding", "embedding"},
      {"residual", "residual adds"}};
  return rows;
}

// One mode's profile: its table (printed after the main one) and its JSON.
struct Profile {
  std::string table;
  nlohmann::json json;
};

Profile profile_of(const std::string& mode, const weft::Graph& g, const weft::CostModel& cost,
                   const weft::UpdateCosts& update, double step_s) {
  struct Row {
    int nodes = 0;
    double f = 0, i = 0, w = 0;
  };
  std::map<std::string, Row> by_kind;
  for (size_t k = 0; k < cost.nodes.size(); ++k) {
    Row& r = by_kind[g.nodes()[k].layer->kind()];
    r.nodes += 1, r.f += cost.nodes[k].f, r.i += cost.nodes[k].i, r.w += cost.nodes[k].w;
  }
  std::vector<std::pair<std::string, Row>> rows;
  for (const auto& [kind, label] : kind_rows()) {
    auto it = by_kind.find(kind);
    if (it == by_kind.end()) continue;
    rows.emplace_back(label, it->second);
    by_kind.erase(it);
  }
  for (const auto& [kind, r] : by_kind) rows.emplace_back(kind, r);  // any other kind, by name
  const double ms = 1e3;
  auto share = [&](double s) { return 100.0 * s / step_s; };
  std::string t = fmt::format(
      "\nprofile of {} (CUDA events around each node's work, median of 3 passes; the step: "
      "{:.1f} ms, the median timed step)\n\n"
      "| part | nodes | forward ms | backward-input ms | backward-weight ms | ms | share of step |\n"
      "|---|---:|---:|---:|---:|---:|---:|\n",
      mode, step_s * ms);
  double spans = 0;
  for (const auto& [label, r] : rows) {
    const double total = r.f + r.i + r.w;
    spans += total;
    t += fmt::format("| {} | {} | {:.2f} | {:.2f} | {:.2f} | {:.2f} | {:.1f}% |\n", label, r.nodes,
                     r.f * ms, r.i * ms, r.w * ms, total * ms, share(total));
  }
  const std::pair<const char*, double> parts[] = {
      {"update: zero the gradients", update.zero},
      {"update: gradient norm", update.norm},
      {"update: AdamW (the clip folded in)", update.adamw}};
  for (const auto& [label, s] : parts) {
    spans += s;
    t += fmt::format("| {} | | | | | {:.2f} | {:.1f}% |\n", label, s * ms, share(s));
  }
  t += fmt::format(
      "| outside the nodes (uploads, host waits, idle gaps) | | | | | {:.2f} | {:.1f}% |\n",
      (step_s - spans) * ms, share(step_s - spans));
  nlohmann::json j = {{"unit", "seconds"},
                      {"nodes", weft::cost_model_json(cost, g)["nodes"]},
                      {"update",
                       {{"zero", update.zero},
                        {"norm", update.norm},
                        {"adamw", update.adamw}}}};
  return {std::move(t), std::move(j)};
}

int run(const Options& o) {
  weft::GptConfig cfg = weft::gpt_preset(o.model);
  cfg.padded_vocab_size = weft::padded_vocab(cfg.vocab_size, o.vocab_divisor);
  const int64_t T = cfg.seq_length, tokens = o.batch * T;
  fmt::print("weft bench_cuda | model {} ({} x {}, {} heads, vocab {} in {} rows) | {} parameters "
             "| B {} T {} | the train_gpt --device cuda step | MFU against {} TFLOP/s\n",
             o.model, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.vocab_size,
             cfg.table_rows(),
             cfg.param_count(), o.batch, T, o.peak_tflops);
  std::ofstream json;
  if (!o.json.empty()) {
    json.open(o.json, std::ios::trunc);
    weft::check(json.good(), "--json {}: cannot write", o.json);
  }
  RandomTokens data(tokens, static_cast<int32_t>(cfg.vocab_size));
  const weft::Device gpu = weft::Device::cuda(0);
  weft::cuda::Context& ctx = weft::cuda::context(0);

  fmt::print("\n| mode | step ms | tokens/s | TFLOP/s | MFU | loss | peak GiB | cudaMalloc in timed steps |\n");
  fmt::print("|---|---:|---:|---:|---:|---:|---:|---:|\n");
  std::fflush(stdout);
  // --profile's tables come after the main one, which stays one table.
  std::vector<std::string> tables, widen_lines;
  for (const std::string& name : o.modes) {
    const size_t plus = name.find('+');
    const std::string precision = name.substr(0, plus);
    const bool fused = plus != std::string::npos;
    const bool bf16_gemms = precision == "bf16" || precision == "bf16g";
    weft::ops::set_matmul_precision(gpu, precision == "tf32" ? weft::ops::MatmulPrecision::Tf32
                                         : bf16_gemms        ? weft::ops::MatmulPrecision::Bf16
                                                             : weft::ops::MatmulPrecision::Fp32);
    weft::ops::set_attention_backend(gpu, fused ? weft::ops::AttentionBackend::Fused
                                                : weft::ops::AttentionBackend::Unfused);
    // Each mode starts from an empty cache, and its peak is its own.
    ctx.allocator().empty_cache();
    ctx.allocator().reset_peak();
    weft::GptModel model = weft::build_gpt(cfg, o.batch);
    weft::init_gpt(model, 1);
    if (precision == "bf16") model.graph.set_activation_dtype(weft::DType::BF16);
    weft::TrainOptions opt;
    opt.micro_batch = opt.global_batch = o.batch;
    opt.lr.lr = 6e-4f;
    opt.adam.weight_decay = 0.1f;
    opt.device = gpu;
    double loss = 0, step_s = 0;
    nlohmann::json row;
    {
      weft::Trainer trainer(model.io, data, opt);
      for (int i = 0; i < o.warmup; ++i) trainer.train_step();
      ctx.synchronize();
      const size_t mallocs = ctx.allocator().stats().device_mallocs;
      weft::ops::reset_widened_ops();
      // GEMMs whose cuBLASLt epilogue found no algorithm and ran as two steps.
      const int64_t fallbacks_before[3] = {ctx.bias_epilogue_fallbacks(),
                                           ctx.gelu_epilogue_fallbacks(),
                                           ctx.bias_grad_epilogue_fallbacks()};
      std::vector<double> steps;
      for (int i = 0; i < o.steps; ++i) {
        const bool record = o.kernel_profile && i == 0;
        if (record) weft::cuda::profiler_start(ctx);
        const auto t0 = Clock::now();
        loss = trainer.train_step().loss;
        ctx.synchronize();
        steps.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
        if (record) weft::cuda::profiler_stop(ctx);
      }
      std::sort(steps.begin(), steps.end());
      step_s = steps[steps.size() / 2];
      // Operations that had no kernel for their dtypes on the GPU and
      // widened bf16 tensors to fp32 around an fp32 one, per timed step.
      nlohmann::json widened = nlohmann::json::object();
      std::string widened_line;
      for (const auto& [op, count] : weft::ops::widened_ops()) {
        const double per_step = static_cast<double>(count) / o.steps;
        widened[op] = per_step;
        widened_line += fmt::format("{}{} x {:g}", widened_line.empty() ? "" : ", ", op, per_step);
      }
      const int64_t fallbacks[3] = {ctx.bias_epilogue_fallbacks() - fallbacks_before[0],
                                    ctx.gelu_epilogue_fallbacks() - fallbacks_before[1],
                                    ctx.bias_grad_epilogue_fallbacks() - fallbacks_before[2]};
      nlohmann::json unfused = nlohmann::json::object();
      std::string unfused_line;
      const char* epilogue_names[3] = {"bias", "gelu", "bias gradient"};
      for (int k = 0; k < 3; ++k) {
        if (fallbacks[k] == 0) continue;
        const double per_step = static_cast<double>(fallbacks[k]) / o.steps;
        unfused[epilogue_names[k]] = per_step;
        unfused_line += fmt::format(", {} x {:g}", epilogue_names[k], per_step);
      }
      widen_lines.push_back(fmt::format(
          "- {}: {}{}\n", name, widened_line.empty() ? "none" : widened_line,
          unfused_line.empty() ? ""
                               : "; cuBLASLt epilogues run as two steps (no algorithm)" +
                                     unfused_line));
      const weft::cuda::AllocatorStats stats = ctx.allocator().stats();
      const double tok_s = static_cast<double>(tokens) / step_s;
      const double tflops = cfg.train_flops_per_token() * tok_s / 1e12;
      const double peak_gib = static_cast<double>(stats.peak_bytes_in_use) / (1 << 30);
      fmt::print("| {} | {:.1f} | {:.0f} | {:.1f} | {:.1f}% | {:.4f} | {:.1f} | {} |\n", name,
                 step_s * 1e3, tok_s, tflops, 100.0 * tflops / o.peak_tflops, loss, peak_gib,
                 stats.device_mallocs - mallocs);
      row = {{"framework", "weft"},
             {"mode", name},
             {"precision", precision},
             {"attention", fused ? "fused (cuDNN)" : "unfused"},
             {"model", o.model},
             {"layers", cfg.num_layers},
             {"hidden", cfg.hidden_size},
             {"heads", cfg.num_heads},
             {"vocab", cfg.vocab_size},
             {"vocab_rows", cfg.table_rows()},
             {"batch", o.batch},
             {"seq_length", T},
             {"params", cfg.param_count()},
             {"flops_per_token", cfg.train_flops_per_token()},
             {"peak_tflops", o.peak_tflops},
             {"warmup", o.warmup},
             {"steps", o.steps},
             {"step_ms", step_s * 1e3},
             {"step_ms_min", steps.front() * 1e3},
             {"step_ms_max", steps.back() * 1e3},
             {"tokens_per_s", tok_s},
             {"tflops", tflops},
             {"mfu", tflops / o.peak_tflops},
             {"loss", loss},
             {"peak_gib", peak_gib},
             {"cuda_mallocs", stats.device_mallocs - mallocs},
             {"widened_per_step", widened},
             {"epilogue_fallbacks_per_step", unfused}};
    }  // the Trainer's activations and optimizer state go back to the cache
    std::fflush(stdout);
    if (o.profile) {
      // The graph's parameters stay on the GPU, where the Trainer put them.
      const weft::CostModel cost = weft::profile_costs(model.graph, model.io, data, o.batch, 3);
      const weft::UpdateCosts update = weft::profile_update(model.graph.params(), 3);
      Profile p = profile_of(name, model.graph, cost, update, step_s);
      tables.push_back(std::move(p.table));
      row["profile"] = std::move(p.json);
    }
    if (json.is_open()) {
      json << row.dump() << '\n';
      json.flush();
      weft::check(json.good(), "--json {}: cannot write", o.json);
    }
  }
  fmt::print("\nwidened to fp32 around an fp32 kernel, calls per timed step (no kernel for "
             "their dtypes on the GPU), and cuBLASLt epilogues that found no algorithm:\n");
  for (const std::string& l : widen_lines) fmt::print("{}", l);
  for (const std::string& t : tables) fmt::print("{}", t);
  return 0;
}

}  // namespace
#endif  // WEFT_CUDA

int main(int argc, char** argv) {
  if (weft::cuda_device_count() == 0) {
    fmt::print("SKIP: {}\n", weft::cuda_built() ? "no CUDA device is visible"
                                               : "weft was built without CUDA");
    return 77;
  }
#if WEFT_CUDA
  try {
    return run(parse(argc, argv));
  } catch (const weft::Error& e) {
    fmt::print(stderr, "bench_cuda: {}\n", e.what());
    return 1;
  }
#else
  (void)argc;
  (void)argv;
  return 77;
#endif
}
