// The single-process engine on cuda:0: train_gpt --device cuda against
// --device cpu, and a steady step that never calls cudaMalloc.
//
// Error model: both devices compute in fp32 and differ only in the order of
// their reductions, as two CPU layouts do (tests/test_parallel.cc compares
// those over five steps to 1e-5); so do these.
// Needs a GPU; exits 77 without.
#include "weft_config.h"

#if WEFT_CUDA
#include <weft/cuda/runtime.h>
#include <weft/ops.h>
#include <weft/profile.h>
#include <weft/trainer.h>

#include "models/gpt.h"
#include "models/llama.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "test_util.h"

namespace weft {
namespace {

constexpr double kTol = 1e-5;

std::string text() {
  std::string s;
  for (int i = 0; i < 80; ++i) s += "It was the best of times, it was the worst of times. ";
  return s;
}

// train_gpt with `flags` on the CPU and on the GPU: the GPU's header names
// cuda:0, and every step's loss and gradient norm are the CPU's to kTol.
void expect_gpu_follows_cpu(const std::string& flags, const std::string& dir,
                            const std::string& what) {
  const testing::TrainRun cpu = testing::run_train_gpt(1, flags + " --device cpu", dir);
  const testing::TrainRun gpu = testing::run_train_gpt(1, flags + " --device cuda", dir);
  ASSERT_TRUE(cpu.ok) << cpu.output;
  ASSERT_TRUE(gpu.ok) << gpu.output;
  EXPECT_TRUE(testing::contains(gpu.output, "| cuda:0 |")) << gpu.output;
  ASSERT_EQ(gpu.records.size(), cpu.records.size()) << what;
  for (size_t s = 0; s < cpu.records.size(); ++s) {
    const double lc = cpu.records[s]["loss"], lg = gpu.records[s]["loss"];
    const double nc = cpu.records[s]["grad_norm"], ng = gpu.records[s]["grad_norm"];
    EXPECT_NEAR(lg, lc, kTol * lc) << what << ", step " << s + 1;
    EXPECT_NEAR(ng, nc, kTol * nc) << what << ", step " << s + 1;
  }
}

// Two micro-batches a step, and one (the GPU gathers the micro-batches'
// losses on the device and reads them once a step: a first step with one
// micro-batch once found no tensor to gather into).
TEST(CudaTrain, TrainGptOnTheGpuGivesTheCpuLosses) {
  const std::string dir = testing::temp_dir("cuda-train");
  testing::write_file(dir + "/t.txt", text());
  for (const char* micro : {"4", "8"}) {
    const std::string flags = fmt::format(
        "--model toy --seq-length 32 --micro-batch-size {} --global-batch-size 8 "
        "--train-iters 5 --lr 3e-3 --data-path {}/t.txt",
        micro, dir);
    expect_gpu_follows_cpu(flags, dir, fmt::format("micro-batch {}", micro));
  }
}

// The Llama family through the same graph on the GPU: RMSNorm, the rotary
// embedding, SwiGLU, grouped-query attention (4 query heads over 2 key/value
// heads) and the untied head, each layer's GPU kernels, five AdamW steps
// with clipping. Same error model as GPT's above: fp32 on both devices, only
// the reductions' order differs.
TEST(CudaTrain, TrainLlamaOnTheGpuGivesTheCpuLosses) {
  const std::string dir = testing::temp_dir("cuda-llama");
  testing::write_file(dir + "/t.txt", text());
  const std::string flags = fmt::format(
      "--arch llama --num-layers 2 --hidden-size 32 --num-attention-heads 4 "
      "--group-query-attention --num-query-groups 2 --seq-length 32 --micro-batch-size 4 "
      "--global-batch-size 8 --train-iters 5 --lr 3e-3 --clip-grad 0.5 --data-path {}/t.txt",
      dir);
  expect_gpu_follows_cpu(flags, dir, "llama");
}

// Documents (--eod-mask-loss, --reset-position-ids, --reset-attention-mask;
// spaces end them, so every sequence holds several) on the GPU: the
// positions go up with the tokens, attention runs unfused within each
// document, the ignored targets' rows are zero, and the step divides by
// the counted terms. GPT and Llama, five steps, the CPU's losses and norms;
// the error model above.
TEST(CudaTrain, DocumentsOnTheGpuGiveTheCpuLosses) {
  const std::string s = text();
  const TokenData data = TokenData::from_tokens(std::vector<int32_t>(s.begin(), s.end()), 256);
  DocumentOptions docs;
  docs.eod = ' ';
  docs.eod_mask_loss = docs.reset_position_ids = docs.reset_attention_mask = true;
  TrainOptions o;
  o.micro_batch = 4, o.global_batch = 8, o.lr.lr = 3e-3f;
  for (const bool llama : {false, true}) {
    std::vector<StepRecord> runs[2];
    for (int on_gpu = 0; on_gpu < 2; ++on_gpu) {
      o.device = on_gpu ? Device::cuda(0) : Device::cpu();
      TokenBatches batches(data, o.global_batch, 32);
      batches.set_documents(docs);
      auto train = [&](auto& m) {
        Trainer t(m.io, batches, o);
        for (int k = 0; k < 5; ++k) runs[on_gpu].push_back(t.train_step());
      };
      if (llama) {
        LlamaConfig c;
        c.num_layers = 2, c.hidden_size = 32, c.num_heads = 4, c.seq_length = 32;
        c.reset_position_ids = c.reset_attention_mask = true;
        LlamaModel m = build_llama(c, o.micro_batch);
        init_llama(m, 5);
        train(m);
      } else {
        GptConfig c = gpt_preset("toy");
        c.seq_length = 32;
        c.reset_position_ids = c.reset_attention_mask = true;
        GptModel m = build_gpt(c, o.micro_batch);
        init_gpt(m, 5);
        train(m);
      }
    }
    for (size_t k = 0; k < runs[0].size(); ++k) {
      EXPECT_NEAR(runs[1][k].loss, runs[0][k].loss, kTol * runs[0][k].loss)
          << (llama ? "llama" : "gpt") << " step " << k + 1;
      EXPECT_NEAR(runs[1][k].grad_norm, runs[0][k].grad_norm, kTol * runs[0][k].grad_norm)
          << (llama ? "llama" : "gpt") << " step " << k + 1;
    }
  }
  // cuDNN's fused attention has only the causal mask: asked for by name
  // with documents, a step stops saying so.
  if (!ops::fused_attention_built()) return;
  ops::set_attention_backend(o.device, ops::AttentionBackend::Fused);
  GptConfig c = gpt_preset("toy");
  c.seq_length = 32;
  c.reset_position_ids = c.reset_attention_mask = true;
  GptModel m = build_gpt(c, o.micro_batch);
  init_gpt(m, 5);
  TokenBatches batches(data, o.global_batch, 32);
  batches.set_documents(docs);
  Trainer t(m.io, batches, o);
  const std::string err = testing::error_message([&] { t.train_step(); });
  ops::set_attention_backend(o.device, ops::AttentionBackend::Auto);
  EXPECT_TRUE(testing::contains(err, "--reset-attention-mask")) << err;
}

// --bf16 and --fp16 on the GPU (fp32 GEMM operands rounded by round_values,
// then TF32 tensor cores) against the CPU's emulation of the same rounding.
// --bf16 also stores the activations in bf16 on both devices; the GPU's
// bf16 kernels round each store once, as the CPU's widened operations do
// (test_cuda_bf16_kernels checks them one by one), and both devices round
// GEMM operands to nearest even, so the two differ by fp32 summation order
// and the bf16 rounding-boundary crossings it causes (test_precision: ~1e-4
// of the norms). The bound is the one test_precision holds bf16 (fp16) to
// against fp32 itself: 2 x 2^-8 (2 x 2^-11) over these steps. The fp16
// run's loss scale must overflow and skip exactly where the emulation's
// does: that checks that the GPU's fp16 rounding gives inf past 65504, which
// loss scaling relies on (cuBLAS's CUBLAS_COMPUTE_32F_FAST_16F, used before,
// did not: on an H200 the GPU run skipped no step where the CPU skipped 3).
// The model and batches are test_precision's (4 x 32, T 16, 4 sequences a
// step), where that bound was established: on the toy model at B 4, T 32 the
// loss on this repeated text jumps at step 16 and two bf16 runs (the CPU's
// against fp32 itself, and so any two) part by up to 16 x 2^-8 there,
// chaotic growth no rounding bound describes. Here the GPU path, run on the
// GPU emulator (tests/cuda_emu), stays within 0.3 x 2^-8 of the CPU's
// emulation over the 20 steps.
TEST(CudaTrain, MixedPrecisionFollowsTheCpuEmulation) {
  const std::string dir = testing::temp_dir("cuda-mixed");
  testing::write_file(dir + "/t.txt", text());
  const std::string flags = "--num-layers 4 --hidden-size 32 --num-attention-heads 4 "
                            "--seq-length 16 --micro-batch-size 1 --global-batch-size 4 "
                            "--train-iters 20 --lr 3e-3 --data-path " +
                            dir + "/t.txt";
  for (const auto& [flag, unit] : {std::pair<std::string, double>{"--bf16", 0x1p-8},
                                   std::pair<std::string, double>{"--fp16", 0x1p-11}}) {
    const testing::TrainRun cpu = testing::run_train_gpt(1, flags + " --device cpu " + flag, dir);
    const testing::TrainRun gpu = testing::run_train_gpt(1, flags + " --device cuda " + flag, dir);
    ASSERT_TRUE(cpu.ok) << cpu.output;
    ASSERT_TRUE(gpu.ok) << gpu.output;
    // --bf16 takes cuDNN's fused attention where it is built (the default
    // backend, auto); --fp16 the unfused one.
    const bool fused = flag == "--bf16" && WEFT_CUDNN;
    EXPECT_TRUE(testing::contains(gpu.output, "| cuda:0 " + flag.substr(2) +
                                                  (fused ? " fused-attention |" : " |")))
        << gpu.output;
    ASSERT_EQ(gpu.records.size(), cpu.records.size());
    int skipped = 0;
    for (size_t s = 0; s < cpu.records.size(); ++s) {
      const bool sc = cpu.records[s].value("skipped", false);
      EXPECT_EQ(gpu.records[s].value("skipped", false), sc) << flag << " step " << s + 1;
      EXPECT_EQ(gpu.records[s].value("loss_scale", 0.0), cpu.records[s].value("loss_scale", 0.0))
          << flag << " step " << s + 1;
      skipped += sc;
      const double lc = cpu.records[s]["loss"], lg = gpu.records[s]["loss"];
      EXPECT_NEAR(lg, lc, 2 * unit * lc) << flag << " step " << s + 1;
    }
    if (flag == "--fp16") {
      EXPECT_GT(skipped, 0) << "2^32 x the seed gradient must overflow fp16";
    }
  }
}

// After the first steps have sized the arena and the allocator's free lists,
// a step reuses what it had: no cudaMalloc.
// A 2 x 64 GPT over the text's bytes.
GptConfig small_config() {
  GptConfig cfg;
  cfg.vocab_size = 256, cfg.num_layers = 2, cfg.hidden_size = 64, cfg.num_heads = 4;
  cfg.seq_length = 32;
  return cfg;
}

TokenData text_tokens() {
  const std::string s = text();
  return TokenData::from_tokens(std::vector<int32_t>(s.begin(), s.end()), 256);
}

// The same with --bf16's activations: the weights' bf16 copies keep their
// memory from step to step, and widened temporaries come from the free lists.
// With cuDNN's attention, every operation of a steady --bf16 step has a
// kernel for its dtypes on the GPU: nothing is widened to fp32
// (ops::widened_ops; bench_cuda lists the same for GPT-2), and without it
// only the attention is. Both families: GPT's layers, and Llama's RMSNorm,
// rotary embedding, SwiGLU, grouped-query attention and untied head.
void expect_steady_steps_allocate_nothing(Graph& graph, ModelIO& io, const std::string& what) {
  const TokenData data = text_tokens();
  TokenBatches batches(data, 8, 32);
  for (bool bf16 : {false, true}) {
    const std::string mode = what + (bf16 ? ", bf16 activations" : ", fp32");
    if (bf16) {
      ops::set_matmul_precision(Device::cuda(0), ops::MatmulPrecision::Bf16);
      graph.set_activation_dtype(DType::BF16);
    }
    TrainOptions o;
    o.micro_batch = 4, o.global_batch = 8;
    o.lr.lr = 1e-3f;
    o.device = Device::cuda(0);
    Trainer t(io, batches, o);
    t.train_step();
    t.train_step();
    const size_t before = cuda::context(0).allocator().stats().device_mallocs;
    ops::reset_widened_ops();
    for (int i = 0; i < 3; ++i) t.train_step();
    EXPECT_EQ(cuda::context(0).allocator().stats().device_mallocs, before) << mode;
    // Without cuDNN the attention's unfused kernels are fp32 only: nothing
    // else may widen.
    std::string widened;
    for (const auto& [op, count] : ops::widened_ops()) {
      if (!WEFT_CUDNN && (op == "attention_forward" || op == "attention_backward")) continue;
      widened += fmt::format(" {} x {}", op, count);
    }
    EXPECT_TRUE(widened.empty()) << mode << ", widened in 3 steps:" << widened;
    ops::set_matmul_precision(Device::cuda(0), ops::MatmulPrecision::Fp32);
  }
}

TEST(CudaTrain, SteadyStepsCallNoCudaMalloc) {
  GptModel m = build_gpt(small_config(), 4);
  init_gpt(m, 7);
  expect_steady_steps_allocate_nothing(m.graph, m.io, "GPT");
}

TEST(CudaTrain, SteadyLlamaStepsCallNoCudaMalloc) {
  LlamaConfig cfg;
  cfg.vocab_size = 256, cfg.num_layers = 2, cfg.hidden_size = 64, cfg.num_heads = 4;
  cfg.num_query_groups = 2, cfg.seq_length = 32;
  LlamaModel m = build_llama(cfg, 4);
  init_llama(m, 7);
  expect_steady_steps_allocate_nothing(m.graph, m.io, "Llama");
}

Tensor on_host(const Tensor& t) {
  Tensor h = Tensor::zeros(t.shape(), t.dtype());
  h.copy_from(t);
  return h;
}

// Steps launched ahead of their reads (Trainer::launch_step: the loss, the
// gradient norm and the clip's coefficient stay on the device, AdamW reads
// the coefficient there) are the steps train_step takes, bit for bit: every
// record's loss and norm, and the parameters after. 70 launches without a
// read pass the 64 rows the Trainer keeps on the device, so the ring's read
// when full is in it; a clip of 0.05 is active in every step.
TEST(CudaTrain, LaunchedStepsAreTrainStepsBitForBit) {
  const TokenData data = text_tokens();
  TokenBatches batches(data, 2, 8);
  GptConfig cfg = small_config();
  cfg.num_layers = 1, cfg.hidden_size = 16, cfg.seq_length = 8;
  GptModel a = build_gpt(cfg, 1), b = build_gpt(cfg, 1);
  init_gpt(a, 5);
  init_gpt(b, 5);
  TrainOptions o;
  o.micro_batch = 1, o.global_batch = 2;
  o.lr.lr = 1e-3f;
  o.clip_grad = 0.05;
  o.device = Device::cuda(0);
  Trainer ta(a.io, batches, o), tb(b.io, batches, o);
  constexpr int kSteps = 70;
  std::vector<StepRecord> one_by_one;
  for (int i = 0; i < kSteps; ++i) one_by_one.push_back(ta.train_step());
  std::vector<StepRecord> launched;
  for (int i = 0; i < 3; ++i) tb.launch_step();
  EXPECT_EQ(tb.launched(), 3);
  for (const StepRecord& r : tb.take_records()) launched.push_back(r);
  for (int i = 3; i < kSteps; ++i) tb.launch_step();
  for (const StepRecord& r : tb.take_records()) launched.push_back(r);
  ASSERT_EQ(launched.size(), one_by_one.size());
  for (size_t i = 0; i < launched.size(); ++i) {
    EXPECT_EQ(launched[i].step, static_cast<int64_t>(i));
    EXPECT_EQ(launched[i].loss, one_by_one[i].loss) << "step " << i + 1;
    EXPECT_EQ(launched[i].grad_norm, one_by_one[i].grad_norm) << "step " << i + 1;
    EXPECT_EQ(launched[i].lr, one_by_one[i].lr) << "step " << i + 1;
    EXPECT_GT(launched[i].grad_norm, 0.05) << "the clip must be active, step " << i + 1;
    EXPECT_GT(launched[i].step_ms, 0) << "step " << i + 1;
  }
  for (size_t k = 0; k < a.graph.params().size(); ++k) {
    const Tensor pa = on_host(a.graph.params()[k]->value), pb = on_host(b.graph.params()[k]->value);
    EXPECT_EQ(std::memcmp(pa.raw(), pb.raw(), pa.nbytes()), 0) << a.graph.params()[k]->name;
  }
  // train_step refuses to run over records not taken.
  tb.launch_step();
  const std::string msg = testing::error_message([&] { tb.train_step(); });
  EXPECT_TRUE(testing::contains(msg, "the records of 1 launched steps (from step 71) are not "
                                     "taken yet"))
      << msg;
}

// A step that diverges while the host runs ahead is named when its record is
// read, as train_step names it, and a save reads first: nothing is written
// from a diverged run.
TEST(CudaTrain, ADivergedLaunchedStepIsNamedWhenRead) {
  const TokenData data = text_tokens();
  TokenBatches batches(data, 4, 32);
  GptConfig cfg = small_config();
  cfg.num_layers = 1;
  GptModel m = build_gpt(cfg, 2);
  init_gpt(m, 5);
  TrainOptions o;
  o.micro_batch = 2, o.global_batch = 4;
  o.lr.lr = 1e30f;  // the first update sends the weights to inf, step 2's loss is NaN
  o.clip_grad = 0;
  o.device = Device::cuda(0);
  Trainer t(m.io, batches, o);
  for (int i = 0; i < 4; ++i) t.launch_step();
  const std::string dir = testing::temp_dir("cuda-diverged");
  std::string msg = testing::error_message([&] { t.save(dir); });
  EXPECT_TRUE(testing::contains(msg, "training diverged")) << msg;
  EXPECT_TRUE(testing::contains(msg, "step 2: loss is ")) << msg;
  EXPECT_FALSE(std::filesystem::exists(dir + "/latest_checkpointed_iteration.txt"));
}

// bench_cuda --profile's path: the CPU's profilers on the GPU, timing by CUDA
// events. Every node's forward queues at least one kernel between its two
// events, so its span is at least that kernel's run (a microsecond or more,
// events resolve about half of one); a span below 0.1 us would be a unit slip
// (CUDA's milliseconds taken for seconds: 1000x too little). All spans of one pass lie inside the host's wall time of the
// whole call, so their medians summed cannot exceed it (1000x too much
// would). Profiling leaves the parameters as they were, bit for bit, and the
// gradients zero.
TEST(CudaTrain, ProfilingOnTheGpuTimesEveryNodeAndChangesNothing) {
  const GptConfig cfg = small_config();
  const TokenData data = text_tokens();
  TokenBatches batches(data, 4, cfg.seq_length);
  GptModel m = build_gpt(cfg, 4);
  init_gpt(m, 7);
  TrainOptions o;
  o.micro_batch = o.global_batch = 4;
  o.device = Device::cuda(0);
  { Trainer t(m.io, batches, o); }  // places the parameters on the GPU, where they stay
  ASSERT_TRUE(params_device(m.graph.params()) == Device::cuda(0));
  std::vector<Tensor> before;
  for (Param* p : m.graph.params()) before.push_back(on_host(p->value));

  const auto t0 = std::chrono::steady_clock::now();
  const CostModel cost = profile_costs(m.graph, m.io, batches, 4, 2);
  const UpdateCosts update = profile_update(m.graph.params(), 2);
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  ASSERT_EQ(cost.nodes.size(), m.graph.nodes().size());
  double sum = update.total();
  for (size_t k = 0; k < cost.nodes.size(); ++k) {
    EXPECT_GT(cost.nodes[k].f, 1e-7) << m.graph.nodes()[k].name;
    EXPECT_GE(cost.nodes[k].i, 0.0) << m.graph.nodes()[k].name;
    EXPECT_GE(cost.nodes[k].w, 0.0) << m.graph.nodes()[k].name;
    sum += cost.nodes[k].f + cost.nodes[k].i + cost.nodes[k].w;
  }
  EXPECT_GT(update.zero, 1e-7);
  EXPECT_GT(update.norm, 1e-7);
  EXPECT_GT(update.adamw, 1e-7);
  EXPECT_LT(sum, wall);
  const std::vector<Param*> params = m.graph.params();
  for (size_t k = 0; k < params.size(); ++k) {
    EXPECT_EQ(testing::rel_error(on_host(params[k]->value), before[k]), 0.0)
        << params[k]->name;
    EXPECT_EQ(ops::sum_squares(params[k]->grad), 0.0) << params[k]->name;
  }
}

}  // namespace
}  // namespace weft

#endif  // WEFT_CUDA
