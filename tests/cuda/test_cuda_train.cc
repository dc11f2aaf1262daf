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
#include <weft/trainer.h>

#include "models/gpt.h"

#include <gtest/gtest.h>

#include <string>

#include "test_util.h"

namespace weft {
namespace {

constexpr double kTol = 1e-5;

std::string text() {
  std::string s;
  for (int i = 0; i < 80; ++i) s += "It was the best of times, it was the worst of times. ";
  return s;
}

TEST(CudaTrain, TrainGptOnTheGpuGivesTheCpuLosses) {
  const std::string dir = testing::temp_dir("cuda-train");
  testing::write_file(dir + "/t.txt", text());
  const std::string flags = "--model toy --seq-length 32 --micro-batch-size 4 "
                            "--global-batch-size 8 --train-iters 5 --lr 3e-3 --data-path " +
                            dir + "/t.txt";
  const testing::TrainRun cpu = testing::run_train_gpt(1, flags + " --device cpu", dir);
  const testing::TrainRun gpu = testing::run_train_gpt(1, flags + " --device cuda", dir);
  ASSERT_TRUE(cpu.ok) << cpu.output;
  ASSERT_TRUE(gpu.ok) << gpu.output;
  EXPECT_TRUE(testing::contains(gpu.output, "| cuda:0 |")) << gpu.output;
  ASSERT_EQ(gpu.records.size(), cpu.records.size());
  for (size_t s = 0; s < cpu.records.size(); ++s) {
    const double lc = cpu.records[s]["loss"], lg = gpu.records[s]["loss"];
    const double nc = cpu.records[s]["grad_norm"], ng = gpu.records[s]["grad_norm"];
    EXPECT_NEAR(lg, lc, kTol * lc) << "step " << s + 1;
    EXPECT_NEAR(ng, nc, kTol * nc) << "step " << s + 1;
  }
}

// After the first steps have sized the arena and the allocator's free lists,
// a step reuses what it had: no cudaMalloc.
TEST(CudaTrain, SteadyStepsCallNoCudaMalloc) {
  GptConfig cfg;
  cfg.vocab_size = 256, cfg.num_layers = 2, cfg.hidden_size = 64, cfg.num_heads = 4;
  cfg.seq_length = 32;
  const std::string s = text();
  const TokenData data = TokenData::from_tokens(std::vector<int32_t>(s.begin(), s.end()), 256);
  TokenBatches batches(data, 8, cfg.seq_length);
  GptModel m = build_gpt(cfg, 4);
  init_gpt(m, 7);
  TrainOptions o;
  o.micro_batch = 4, o.global_batch = 8;
  o.lr.lr = 1e-3f;
  o.device = Device::cuda(0);
  Trainer t(m.io, batches, o);
  t.train_step();
  t.train_step();
  const size_t before = cuda::context(0).allocator().stats().device_mallocs;
  for (int i = 0; i < 3; ++i) t.train_step();
  EXPECT_EQ(cuda::context(0).allocator().stats().device_mallocs, before);
}

}  // namespace
}  // namespace weft

#endif  // WEFT_CUDA
