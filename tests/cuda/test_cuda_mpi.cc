// Several ranks sharing one GPU: train_gpt --device cuda under mpiexec, its
// tensors staged through host memory (HostStagedCommunicator), against the
// single-process GPU run. Every schedule at pp 2 and 4, pp 2 x tp 2, and
// (dp, pp, tp) = (2, 2, 2); and NCCL refused while ranks share the GPU.
//
// Error model: every layout computes in fp32 and differs from one process
// only in the order of its reductions (tensor-parallel partial sums, the
// data-parallel all-reduce), as the CPU layouts of tests/test_parallel.cc do,
// which hold 1e-5 over five steps; so do these.
// Needs a GPU; exits 77 without.
#include "weft_config.h"

#if WEFT_CUDA
#include <gtest/gtest.h>

#include <string>
#include <tuple>

#include "test_util.h"

namespace weft {
namespace {

constexpr double kTol = 1e-5;

class SharedGpu : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(testing::temp_dir("cuda-mpi"));
    std::string text;
    for (int i = 0; i < 80; ++i) text += "Call me Ishmael. Some years ago, never mind how long. ";
    testing::write_file(*dir_ + "/text.txt", text);
    const testing::TrainRun one = testing::run_train_gpt(1, flags(), *dir_);
    ASSERT_TRUE(one.ok) << one.command << "\n" << one.output;
    reference_ = new std::vector<nlohmann::json>(one.records);
    ASSERT_EQ(reference_->size(), 5u);
  }
  static std::string flags() {
    return "--device cuda --num-layers 8 --hidden-size 32 --num-attention-heads 4 "
           "--seq-length 16 --micro-batch-size 2 --global-batch-size 16 --train-iters 5 "
           "--lr 3e-3 --clip-grad 0.5 --comm-timeout 60 --data-path " + *dir_ + "/text.txt";
  }
  // Runs `ranks` processes on the one GPU; every step matches one process.
  static void expect_single_process(int ranks, const std::string& layout) {
    const testing::TrainRun run = testing::run_train_gpt(ranks, flags() + " " + layout, *dir_);
    ASSERT_TRUE(run.ok) << run.command << "\n" << run.output;
    EXPECT_TRUE(testing::contains(run.output, "| cuda:0")) << run.output;
    ASSERT_EQ(run.records.size(), reference_->size()) << run.output;
    for (size_t s = 0; s < run.records.size(); ++s) {
      const double loss = (*reference_)[s]["loss"], norm = (*reference_)[s]["grad_norm"];
      EXPECT_NEAR(run.records[s]["loss"].get<double>(), loss, kTol * loss)
          << layout << ", step " << s + 1;
      EXPECT_NEAR(run.records[s]["grad_norm"].get<double>(), norm, kTol * norm)
          << layout << ", step " << s + 1;
    }
  }
  static std::string* dir_;
  static std::vector<nlohmann::json>* reference_;
};

std::string* SharedGpu::dir_ = nullptr;
std::vector<nlohmann::json>* SharedGpu::reference_ = nullptr;

TEST_F(SharedGpu, EverySchedule) {
  for (int pp : {2, 4})
    for (const char* schedule : {"gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v"})
      expect_single_process(pp, fmt::format("--pp {} --schedule {}", pp, schedule));
}

TEST_F(SharedGpu, PipelineTimesTensorParallel) { expect_single_process(4, "--pp 2 --tp 2"); }

TEST_F(SharedGpu, DataPipelineAndTensorParallel) {
  expect_single_process(8, "--pp 2 --tp 2 --comm-backend mpi");
}

TEST_F(SharedGpu, NcclIsRefusedWhileRanksShareTheGpu) {
  const testing::TrainRun run =
      testing::run_train_gpt(2, flags() + " --pp 2 --comm-backend nccl", *dir_);
  EXPECT_FALSE(run.ok);
  EXPECT_TRUE(testing::contains(run.output, "NCCL refuses two ranks on one GPU")) << run.output;
}

}  // namespace
}  // namespace weft

#endif  // WEFT_CUDA
