// bench_cuda — GPT training throughput on one GPU (weft/cuda/gpt.h), as a table.
//
//   bench_cuda                                   # GPT-2 124M, B 16, T 1024; fp32, tf32, bf16
//   bench_cuda --model mini --batch 8 --steps 5 --modes bf16
//
// A timed step is a whole training step: zero the gradients, forward and
// backward, gradient norm, clipping, AdamW. FLOPs per token = 6 x (parameters
// without wpe) + 12 x L x T x C, as bench_train and llm.c count them. MFU is
// the achieved FLOP/s over --peak-tflops (default 989: the H100/H200 SXM dense
// bf16 tensor-core peak), for every mode, so the rows compare. The last column
// counts cudaMalloc calls during the timed steps (0: the caching allocator
// served every step). Exits 77 without a GPU.
#include <weft/device.h>

#include "weft_config.h"

#include <fmt/core.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#if WEFT_CUDA
#include <weft/cuda/gpt.h>

#include "models/gpt.h"

#include <algorithm>
#include <chrono>
#include <random>

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::string model = "gpt2";
  int64_t batch = 16;
  int steps = 10;
  int warmup = 2;
  std::vector<std::string> modes = {"fp32", "tf32", "bf16"};
  double peak_tflops = 989.0;
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
    else
      throw weft::Error("unknown argument '{}' (--model, --batch, --steps, --warmup, --modes, "
                        "--peak-tflops)",
                        a);
  }
  weft::check(o.batch > 0 && o.steps > 0 && o.warmup >= 0 && o.peak_tflops > 0,
              "--batch ({}) and --steps ({}) must be positive, --warmup ({}) not negative",
              o.batch, o.steps, o.warmup);
  return o;
}

int run(const Options& o) {
  const weft::GptConfig cfg = weft::gpt_preset(o.model);
  const int64_t T = cfg.seq_length, tokens = o.batch * T;
  const weft::cuda::GptShape shape{cfg.vocab_size, cfg.positions(), cfg.num_layers,
                                   cfg.hidden_size, cfg.num_heads,  T,
                                   o.batch};
  fmt::print("weft bench_cuda | model {} ({} x {}, {} heads, vocab {}) | {} parameters | B {} T {} "
             "| MFU against {} TFLOP/s\n",
             o.model, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.vocab_size,
             cfg.param_count(), o.batch, T, o.peak_tflops);
  weft::GptModel cpu = weft::build_gpt(cfg, 1);  // the parameters; its graph is not run
  weft::init_gpt(cpu, 1);
  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> tok_dist(0, static_cast<int32_t>(cfg.vocab_size - 1));
  std::vector<int32_t> tok(static_cast<size_t>(tokens)), tgt(static_cast<size_t>(tokens));
  for (size_t i = 0; i < tok.size(); ++i) tok[i] = tok_dist(rng), tgt[i] = tok_dist(rng);
  weft::AdamWConfig adam;
  adam.weight_decay = 0.1f;

  fmt::print("\n| mode | step ms | tokens/s | TFLOP/s | MFU | loss | peak GiB | cudaMalloc in timed steps |\n");
  fmt::print("|---|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const std::string& name : o.modes) {
    const weft::cuda::MathMode mode = weft::cuda::parse_math_mode(name);
    // Each mode starts from an empty cache, and its peak is its own.
    weft::cuda::context(0).allocator().empty_cache();
    weft::cuda::context(0).allocator().reset_peak();
    weft::cuda::GptStep gpu(shape, *cpu.params, mode);
    double loss = 0;
    auto step = [&] {
      gpu.zero_grads();
      loss = gpu.forward_backward(tok.data(), tgt.data(), 1.0f / static_cast<float>(tokens));
      const double norm = gpu.grad_norm();
      gpu.clip_grads(1.0, norm);
      gpu.adamw_step(6e-4f, adam);
    };
    for (int i = 0; i < o.warmup; ++i) step();
    gpu.context().synchronize();
    const size_t mallocs = gpu.context().allocator().stats().device_mallocs;
    const auto t0 = Clock::now();
    for (int i = 0; i < o.steps; ++i) step();
    gpu.context().synchronize();
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count() / o.steps;
    const weft::cuda::AllocatorStats stats = gpu.context().allocator().stats();
    const double tok_s = static_cast<double>(tokens) / seconds;
    const double tflops = cfg.train_flops_per_token() * tok_s / 1e12;
    fmt::print("| {} | {:.1f} | {:.0f} | {:.1f} | {:.1f}% | {:.4f} | {:.1f} | {} |\n", name,
               seconds * 1e3, tok_s, tflops, 100.0 * tflops / o.peak_tflops,
               loss / static_cast<double>(tokens),
               static_cast<double>(stats.peak_bytes_in_use) / (1 << 30),
               stats.device_mallocs - mallocs);
    std::fflush(stdout);
  }
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
