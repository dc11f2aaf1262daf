// A whole GPT training step on the GPU (weft/cuda/gpt.h) against the CPU
// graph (models/gpt.cc) from the same parameters and tokens: the loss, every
// parameter's gradient, the gradient norm and the parameters after two AdamW
// steps with clipping. fp32 within 1e-5 relative; TF32 and bf16 within their
// rounding. And the caching allocator's promise: from the second step on, a
// step makes no cudaMalloc. Needs a GPU; exits 77 (SKIP) without one.
#include "weft_config.h"

#if WEFT_CUDA
#include <weft/cuda/gpt.h>
#include <weft/optimizer.h>
#include <weft/runner.h>

#include "models/gpt.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "test_util.h"

namespace weft::cuda {
namespace {

using weft::testing::rel_error;

GptConfig config() {
  GptConfig c;
  c.num_layers = 2, c.hidden_size = 64, c.num_heads = 4, c.seq_length = 64, c.vocab_size = 256;
  return c;
}
constexpr int64_t kBatch = 4;
constexpr uint64_t kSeed = 1234;

GptShape shape_of(const GptConfig& c, int64_t batch) {
  return GptShape{c.vocab_size, c.positions(), c.num_layers, c.hidden_size, c.num_heads,
                  c.seq_length, batch};
}

std::vector<int32_t> tokens(int64_t n, uint64_t seed) {
  std::vector<float> u = weft::testing::uniform(n, seed, 0.0f, 256.0f);
  std::vector<int32_t> t;
  for (float f : u) t.push_back(std::min(255, static_cast<int32_t>(f)));
  return t;
}

// The CPU graph: forward, seed, backward; returns the loss sum.
struct CpuGpt {
  GptModel model = build_gpt(config(), kBatch);
  MicroBatch mb{model.graph};
  CpuGpt() { init_gpt(model, kSeed); }

  double step(const std::vector<int32_t>& tok, const std::vector<int32_t>& tgt, float scale) {
    const int n = static_cast<int>(model.graph.nodes().size());
    std::copy(tok.begin(), tok.end(), mb.input(model.io.tokens).data<int32_t>());
    std::copy(tgt.begin(), tgt.end(), mb.input(model.io.targets).data<int32_t>());
    forward(model.graph, mb, 0, n);
    const double loss = mb.value(model.io.loss).data<float>()[0];
    mb.seed_grad(model.io.loss, scale);
    backward(model.graph, mb, 0, n);
    mb.reset();
    return loss;
  }
};

// Relative errors allowed: the loss, each parameter's gradient, all gradients
// together. fp32 is the CPU result up to summation order. TF32 and bf16 round
// every GEMM input (to 2^-11 and 2^-9); the errors compound through the
// layers, most in the small tensors (biases, wpe) at the far end of backward.
struct Tolerance {
  double loss, grad, all_grads;
};

Tolerance tolerance(MathMode mode) {
  switch (mode) {
    case MathMode::FP32: return {1e-5, 1e-5, 1e-5};
    case MathMode::TF32: return {1e-3, 3e-2, 1e-2};
    case MathMode::BF16: return {5e-3, 1e-1, 4e-2};
  }
  return {};
}

// All gradients of a store, concatenated in the order of `order`'s names.
std::vector<float> all_grads(ParamStore& store, const std::vector<Param*>& order) {
  std::vector<float> out;
  for (const Param* p : order) {
    const Tensor& g = store.find(p->name)->grad;
    out.insert(out.end(), g.data<float>(), g.data<float>() + g.numel());
  }
  return out;
}

// Compares the GPU step with the CPU graph. In fp32 the comparison runs over
// two AdamW steps with clipping and ends with the parameters; in TF32 and bf16
// only the first step's loss and gradients are compared, since Adam's first
// update is lr * sign(g), which a rounding error flips wherever g is near 0.
void check_step(MathMode mode) {
  SCOPED_TRACE(math_mode_name(mode));
  const Tolerance tol = tolerance(mode);
  const bool exact = mode == MathMode::FP32;
  const GptConfig cfg = config();
  const int64_t tokens_per_batch = kBatch * cfg.seq_length;
  const float scale = 1.0f / static_cast<float>(tokens_per_batch);
  CpuGpt cpu;
  GptStep gpu(shape_of(cfg, kBatch), *cpu.model.params, mode);
  GptModel from_gpu = build_gpt(cfg, kBatch);  // receives the GPU's values and gradients
  AdamWConfig adam;
  adam.weight_decay = 0.1f;
  AdamW opt(cpu.model.graph.params(), adam);
  size_t mallocs_after_first = 0;

  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE(step);
    const auto tok = tokens(tokens_per_batch, 10 + static_cast<uint64_t>(step));
    const auto tgt = tokens(tokens_per_batch, 20 + static_cast<uint64_t>(step));
    zero_grads(cpu.model.graph.params());
    gpu.zero_grads();
    const double gpu_loss = gpu.forward_backward(tok.data(), tgt.data(), scale);
    EXPECT_NEAR(gpu.forward(tok.data(), tgt.data()), gpu_loss, 1e-6 * std::abs(gpu_loss));
    const double gpu_norm = gpu.grad_norm();
    if (step == 0) mallocs_after_first = gpu.context().allocator().stats().device_mallocs;
    if (step == 1) {
      EXPECT_EQ(gpu.context().allocator().stats().device_mallocs, mallocs_after_first)
          << "the second step must be served from the allocator's cache";
    }

    if (step == 0 || exact) {
      const double cpu_loss = cpu.step(tok, tgt, scale);
      EXPECT_NEAR(gpu_loss, cpu_loss, tol.loss * std::abs(cpu_loss));
      gpu.copy_grads_to(*from_gpu.params);
      for (Param* p : cpu.model.params->all())
        EXPECT_LT(rel_error(from_gpu.params->find(p->name)->grad, p->grad), tol.grad) << p->name;
      const std::vector<Param*> order = cpu.model.params->all();
      const std::vector<float> want = all_grads(*cpu.model.params, order);
      const std::vector<float> got = all_grads(*from_gpu.params, order);
      EXPECT_LT(rel_error(got.data(), want.data(), static_cast<int64_t>(want.size())),
                tol.all_grads);
      const double cpu_norm = grad_norm(cpu.model.graph.params());
      EXPECT_NEAR(gpu_norm, cpu_norm, tol.all_grads * cpu_norm);
      // A max norm below the norm, so that clipping really scales.
      clip_grads(cpu.model.graph.params(), 0.5 * cpu_norm, cpu_norm);
      opt.step(1e-3f);
    }
    gpu.clip_grads(0.5 * gpu_norm, gpu_norm);
    gpu.adamw_step(1e-3f, adam);
  }
  if (!exact) return;
  gpu.copy_params_to(*from_gpu.params);
  for (Param* p : cpu.model.params->all())
    EXPECT_LT(rel_error(from_gpu.params->find(p->name)->value, p->value), 1e-5) << p->name;
}

TEST(CudaGptStep, Fp32MatchesTheCpuGraph) { check_step(MathMode::FP32); }
TEST(CudaGptStep, Tf32IsClose) { check_step(MathMode::TF32); }
TEST(CudaGptStep, Bf16IsClose) { check_step(MathMode::BF16); }

TEST(CudaGptStep, RejectsTokensOutsideTheVocabulary) {
  CpuGpt cpu;
  GptStep gpu(shape_of(config(), kBatch), *cpu.model.params, MathMode::FP32);
  std::vector<int32_t> tok(static_cast<size_t>(kBatch * config().seq_length), 1);
  tok[5] = 256;
  EXPECT_TRUE(weft::testing::contains(
      weft::testing::error_message([&] { gpu.forward(tok.data(), tok.data()); }),
      "token 256 at position 5 is outside the vocabulary [0, 256)"));
}

TEST(CudaGptStep, RejectsAParameterOfTheWrongShape) {
  GptConfig wide = config();
  wide.hidden_size = 128;
  GptModel m = build_gpt(wide, kBatch);
  EXPECT_TRUE(weft::testing::contains(
      weft::testing::error_message(
          [&] { GptStep(shape_of(config(), kBatch), *m.params, MathMode::FP32); }),
      "parameter 'wte.weight' is F32 [256, 128]"));
}

}  // namespace
}  // namespace weft::cuda
#endif  // WEFT_CUDA
