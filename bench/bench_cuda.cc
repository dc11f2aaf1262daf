// bench_cuda — GPT training throughput on one GPU, as a table: the step
// train_gpt --device cuda runs (the same graph, layers, Trainer and
// optimizer; weft/ops.h picks the CUDA kernels).
//
//   bench_cuda                                   # GPT-2 124M, B 16, T 1024; fp32, tf32
//                                                # and tf32+fused (where built)
//   bench_cuda --model mini --batch 8 --steps 5 --modes tf32,tf32+fused
//   bench_cuda --make-vocab-size-divisible-by 1  # GPT-2's odd 50257 rows, unpadded
//
// The vocabulary is padded as train_gpt pads it (default 128: 50257 -> 50304).
// A mode is the GEMMs' precision (fp32, tf32), with "+fused" for cuDNN's
// fused attention (train_gpt --attention-backend fused) instead of the
// unfused one; the default list has tf32+fused in builds with cuDNN.
//
// A timed step is Trainer::train_step: zero the gradients, upload the
// tokens, forward and backward, gradient norm, clipping, AdamW. FLOPs per token = 6 x (parameters
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
#include <weft/cuda/runtime.h>
#include <weft/ops.h>
#include <weft/trainer.h>

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
  std::vector<std::string> modes;  // default: fp32, tf32 and, where built, tf32+fused
  double peak_tflops = 989.0;
  int64_t vocab_divisor = 128;  // train_gpt's --make-vocab-size-divisible-by
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
    else
      throw weft::Error("unknown argument '{}' (--model, --batch, --steps, --warmup, --modes, "
                        "--peak-tflops, --make-vocab-size-divisible-by)",
                        a);
  }
  if (o.modes.empty()) {
    o.modes = {"fp32", "tf32"};
    if (weft::ops::fused_attention_built()) o.modes.push_back("tf32+fused");
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

int run(const Options& o) {
  weft::GptConfig cfg = weft::gpt_preset(o.model);
  cfg.padded_vocab_size = weft::padded_vocab(cfg.vocab_size, o.vocab_divisor);
  const int64_t T = cfg.seq_length, tokens = o.batch * T;
  fmt::print("weft bench_cuda | model {} ({} x {}, {} heads, vocab {} in {} rows) | {} parameters "
             "| B {} T {} | the train_gpt --device cuda step | MFU against {} TFLOP/s\n",
             o.model, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.vocab_size,
             cfg.table_rows(),
             cfg.param_count(), o.batch, T, o.peak_tflops);
  RandomTokens data(tokens, static_cast<int32_t>(cfg.vocab_size));
  const weft::Device gpu = weft::Device::cuda(0);
  weft::cuda::Context& ctx = weft::cuda::context(0);

  fmt::print("\n| mode | step ms | tokens/s | TFLOP/s | MFU | loss | peak GiB | cudaMalloc in timed steps |\n");
  fmt::print("|---|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const std::string& name : o.modes) {
    const size_t plus = name.find('+');
    const std::string precision = name.substr(0, plus);
    const bool fused = plus != std::string::npos;
    weft::check(precision == "fp32" || precision == "tf32",
                "--modes: '{}' is not available on the train_gpt path (fp32, tf32)", precision);
    weft::check(!fused || name.substr(plus) == "+fused",
                "--modes: '{}': the one suffix is +fused (cuDNN's fused attention)", name);
    weft::check(!fused || weft::ops::fused_attention_built(),
                "--modes {}: weft was built without cuDNN's fused attention", name);
    weft::ops::set_matmul_precision(gpu, precision == "tf32" ? weft::ops::MatmulPrecision::Tf32
                                                             : weft::ops::MatmulPrecision::Fp32);
    weft::ops::set_attention_backend(gpu, fused ? weft::ops::AttentionBackend::Fused
                                                : weft::ops::AttentionBackend::Unfused);
    // Each mode starts from an empty cache, and its peak is its own.
    ctx.allocator().empty_cache();
    ctx.allocator().reset_peak();
    weft::GptModel model = weft::build_gpt(cfg, o.batch);
    weft::init_gpt(model, 1);
    weft::TrainOptions opt;
    opt.micro_batch = opt.global_batch = o.batch;
    opt.lr.lr = 6e-4f;
    opt.adam.weight_decay = 0.1f;
    opt.device = gpu;
    double loss = 0;
    {
      weft::Trainer trainer(model.io, data, opt);
      for (int i = 0; i < o.warmup; ++i) trainer.train_step();
      ctx.synchronize();
      const size_t mallocs = ctx.allocator().stats().device_mallocs;
      const auto t0 = Clock::now();
      for (int i = 0; i < o.steps; ++i) loss = trainer.train_step().loss;
      ctx.synchronize();
      const double seconds = std::chrono::duration<double>(Clock::now() - t0).count() / o.steps;
      const weft::cuda::AllocatorStats stats = ctx.allocator().stats();
      const double tok_s = static_cast<double>(tokens) / seconds;
      const double tflops = cfg.train_flops_per_token() * tok_s / 1e12;
      fmt::print("| {} | {:.1f} | {:.0f} | {:.1f} | {:.1f}% | {:.4f} | {:.1f} | {} |\n", name,
                 seconds * 1e3, tok_s, tflops, 100.0 * tflops / o.peak_tflops, loss,
                 static_cast<double>(stats.peak_bytes_in_use) / (1 << 30),
                 stats.device_mallocs - mallocs);
    }
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
