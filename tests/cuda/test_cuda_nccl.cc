// train_gpt --device cuda --comm-backend nccl under mpiexec: activations,
// gradients and reductions through NCCL, against the single-process GPU run.
// pp 2 with every schedule NCCL can run (interleaved 1F1B refused with the
// place it would hang), pp 4, tp 2, dp 2 with and without the distributed
// optimizer (ZeRO-1), pp 2 x tp 2, (dp, pp, tp) = (2, 2, 2) on 8 ranks,
// --bf16 at pp 2 x tp 2, sequence parallelism with each, and a checkpoint
// saved over NCCL resumed.
//
// The ranks get NCCL one of two ways. Where there are GPUs enough, each rank
// takes its own (the GPU emulator gives the ranks WEFT_EMU_DEVICES=8 here).
// Where there are fewer GPUs than ranks (one H200), each rank is its own NCCL
// "host" on the shared GPU (WEFT_NCCL_ONE_GPU=1: a distinct NCCL_HOSTID per
// rank, NCCL's socket transport); the emulator runs that mode too, for the
// layouts a one-GPU machine runs.
//
// Error model: as tests/cuda/test_cuda_mpi.cc's for the host-staged path:
// fp32 layouts differ from one process only in the order of their
// reductions, 1e-5 over five steps. --bf16 with tensor parallelism sums bf16
// partial outputs, one more bf16 rounding per row-parallel output
// (tests/test_precision.cc, TensorParallelismWithBf16ActivationsStaysWithinItsErrorModel):
// the losses stay within 2 x 2^-8 of the single-process --bf16 run.
// Needs a GPU (or the emulator); exits 77 without.
#include "weft_config.h"

#if WEFT_CUDA
#include <weft/device.h>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <regex>
#include <string>

#include "layout_test_util.h"
#include "test_util.h"

namespace weft {
namespace {

constexpr double kTol = 1e-5;

class NcclRanks : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(testing::temp_dir("cuda-nccl"));
    testing::small_gpt(*dir_);
    const testing::TrainRun one = testing::run_train_gpt(1, flags(), *dir_);
    ASSERT_TRUE(one.ok) << one.command << "\n" << one.output;
    reference_ = new std::vector<nlohmann::json>(one.records);
    ASSERT_EQ(reference_->size(), 5u);
  }
  void SetUp() override { use_gpus(8); }
  void TearDown() override {
    unsetenv("WEFT_NCCL_ONE_GPU");
    unsetenv("WEFT_EMU_DEVICES");
  }

  // The ranks' GPUs: `n` of them on the emulator; elsewhere the machine's,
  // each rank its own NCCL host where they are fewer than 8.
  static void use_gpus(int n) {
#if WEFT_GPU_EMULATOR
    setenv("WEFT_EMU_DEVICES", std::to_string(n).c_str(), 1);
    unsetenv("WEFT_NCCL_ONE_GPU");
    if (n == 1) setenv("WEFT_NCCL_ONE_GPU", "1", 1);
#else
    (void)n;
    if (cuda_device_count() < 8) setenv("WEFT_NCCL_ONE_GPU", "1", 1);
#endif
  }

  static std::string flags(const std::string& device = "cuda") {
    return testing::small_gpt(*dir_, device);
  }
  static testing::TrainRun nccl(int ranks, const std::string& layout,
                                const std::string& device = "cuda") {
    return testing::run_train_gpt(ranks, flags(device) + " --comm-backend nccl " + layout, *dir_);
  }
  static void expect_steps(const testing::TrainRun& run, const std::vector<nlohmann::json>& want,
                           size_t first, double tol, const std::string& what) {
    ASSERT_TRUE(run.ok) << run.command << "\n" << run.output;
    testing::expect_steps_close(run.records, want, first, tol, what + "\n" + run.output);
  }
  // Runs `ranks` processes over NCCL; every step matches one process.
  static void expect_single_process(int ranks, const std::string& layout) {
    const testing::TrainRun run = nccl(ranks, layout);
    expect_steps(run, *reference_, 0, kTol, layout);
  }
  static std::string* dir_;
  static std::vector<nlohmann::json>* reference_;
};

std::string* NcclRanks::dir_ = nullptr;
std::vector<nlohmann::json>* NcclRanks::reference_ = nullptr;

TEST_F(NcclRanks, EveryScheduleAtPp2AndPp4) {
  for (const char* schedule : {"gpipe", "1f1b", "zb-h1", "zb-v"})
    expect_single_process(2, fmt::format("--pp 2 --schedule {}", schedule));
  for (const char* schedule : {"gpipe", "1f1b", "zb-h1"})
    expect_single_process(4, fmt::format("--pp 4 --schedule {}", schedule));
}

// Interleaved 1F1B posts, in one p2p step, a send its peer receives only
// after a step that waits for this rank's later one. Run anyway (the
// emulator's NCCL, in which a group completes only when every peer has
// reached the matching group, as NCCL's sends complete only once their
// receive is posted), both ranks hang at step 1 until --comm-timeout: so it
// is refused before anything starts, naming where it would hang.
TEST_F(NcclRanks, InterleavedIsRefusedNamingWhereItWouldHang) {
  const testing::TrainRun run = nccl(2, "--pp 2 --schedule interleaved-1f1b");
  EXPECT_FALSE(run.ok);
  EXPECT_TRUE(testing::contains(run.output, "--schedule interleaved-1f1b cannot run over NCCL"))
      << run.output;
}

TEST_F(NcclRanks, TensorAndDataParallel) {
  expect_single_process(2, "--tp 2");
  expect_single_process(2, "");  // dp 2
  expect_single_process(2, "--use-distributed-optimizer");
  // Sharded gradients: each micro-batch's buffer is reduce-scattered on the
  // NCCL stream and retired by the compute stream waiting for it.
  expect_single_process(2, "--data-parallel-sharding-strategy optim_grads --ddp-bucket-size 4096");
  // Sharded parameters: each node's buckets all-gathered on the NCCL stream,
  // the next node's posted ahead, the compute stream waiting for each.
  expect_single_process(
      2, "--data-parallel-sharding-strategy optim_grads_params --ddp-bucket-size 4096");
  expect_single_process(4, "--pp 2 --tp 2");
  // Sequence parallelism: all-gathers and reduce-scatters on the NCCL
  // stream, into whole-sequence buffers the layers reuse in the compute
  // stream's order.
  expect_single_process(2, "--tp 2 --sequence-parallel");
}

TEST_F(NcclRanks, DataPipelineAndTensorParallelOnEightRanks) {
  expect_single_process(8, "--pp 2 --tp 2");
  expect_single_process(8, "--pp 2 --tp 2 --schedule zb-h1 --sequence-parallel");
  expect_single_process(8, "--pp 2 --tp 2 --use-distributed-optimizer");
  expect_single_process(8, "--pp 2 --tp 2 --data-parallel-sharding-strategy optim_grads");
  expect_single_process(8,
                        "--pp 2 --tp 2 --schedule zb-h1 --data-parallel-sharding-strategy "
                        "optim_grads_params --ddp-bucket-size 4096");
}

// The same layouts with every rank on one GPU, each its own NCCL host
// (WEFT_NCCL_ONE_GPU=1), as a one-GPU machine runs them.
TEST_F(NcclRanks, RanksSharingOneGpuAsNcclHosts) {
  use_gpus(1);
  const testing::TrainRun run = nccl(4, "--pp 2 --tp 2");
  expect_steps(run, *reference_, 0, kTol, "pp 2 x tp 2, one GPU");
  EXPECT_TRUE(testing::contains(run.output, "rank 3 | host")) << run.output;
  expect_single_process(2, "--use-distributed-optimizer");
  expect_single_process(4, "--pp 2 --tp 2 --sequence-parallel");
}

TEST_F(NcclRanks, Bf16WithinItsErrorModel) {
  const testing::TrainRun one = testing::run_train_gpt(1, flags() + " --bf16", *dir_);
  ASSERT_TRUE(one.ok) << one.command << "\n" << one.output;
  const testing::TrainRun run = nccl(4, "--pp 2 --tp 2 --bf16");
  expect_steps(run, one.records, 0, 2 * std::ldexp(1.0, -8), "--bf16 at pp 2 x tp 2");
  // Sequence parallelism reduce-scatters the same bf16 partial outputs the
  // all-reduce summed: one rounding per row-parallel output, as before.
  expect_steps(nccl(4, "--pp 2 --tp 2 --bf16 --sequence-parallel"), one.records, 0,
               2 * std::ldexp(1.0, -8), "--bf16 at pp 2 x tp 2, sequence-parallel");
  // ... and it is a bf16 run, not fp32's.
  double apart = 0;
  for (size_t s = 0; s < run.records.size() && s < reference_->size(); ++s)
    apart = std::max(apart, std::abs(run.records[s]["loss"].get<double>() -
                                     (*reference_)[s]["loss"].get<double>()));
  EXPECT_GT(apart, 0.0) << "--bf16 gave fp32's losses";
}

// A checkpoint written by a pp 2 x tp 2 job over NCCL, resumed by the same
// layout over NCCL: step 4's loss is the uninterrupted run's bit for bit (the
// forward pass reads only the saved parameters, fp32, exactly written, and
// reduces in a fixed order); the later numbers within the layouts' bound
// (the embedding's backward adds with atomics on a GPU).
TEST_F(NcclRanks, CheckpointSavedOverNcclResumes) {
  const std::string save = *dir_ + "/ckpt";
  const testing::TrainRun whole =
      nccl(4, "--pp 2 --tp 2 --save-interval 3 --save " + save);
  expect_steps(whole, *reference_, 0, kTol, "pp 2 x tp 2 saving");
  const testing::TrainRun resumed = nccl(
      4, "--pp 2 --tp 2 --load " + save + "/iter_0000003 --save " + *dir_ + "/ckpt-resumed");
  ASSERT_TRUE(resumed.ok) << resumed.command << "\n" << resumed.output;
  EXPECT_TRUE(testing::contains(resumed.output, "at step 3")) << resumed.output;
  ASSERT_EQ(resumed.records.size(), 2u) << resumed.output;
  EXPECT_EQ(resumed.records[0]["loss"].get<double>(), whole.records[3]["loss"].get<double>());
  expect_steps(resumed, whole.records, 3, kTol, "resumed over NCCL");
}

// The host runs ahead of its GPU: in a steady step that is not read (not a
// logging, evaluation or save step), no rank waits for its device at all,
// neither for communication nor for the loss, the gradient norm or the
// clip's coefficient, which stay on the device (Trainer::launch_step).
// Counted by the GPU emulator in the profiled range (--profile-step-start
// 2 --profile-step-end 3: step 3; --log-interval 4 reads at step 4), per
// rank, over NCCL at pp 2 x tp 2 and in one process. Before communication
// was stream-ordered a pp 2 x tp 2 step waited 27 to 42 times per rank (a
// wait per message and per tensor-parallel all-reduce, and one per small
// upload's staging slot); before the norm and the losses stayed on the
// device, 2 to 3. A step that is read waits for its values once, and a
// pipeline's also for the device's timings of its actions (the bubble).
TEST_F(NcclRanks, SteadyStepsDoNotWaitForTheDevice) {
#if !WEFT_GPU_EMULATOR
  GTEST_SKIP() << "counted by the GPU emulator (tests/cuda_emu)";
#endif
  const std::regex waited("waited for the device ([0-9]+) times");
  auto waits = [&](const testing::TrainRun& run) {
    std::vector<int> per_rank;
    for (auto it = std::sregex_iterator(run.output.begin(), run.output.end(), waited);
         it != std::sregex_iterator(); ++it)
      per_rank.push_back(std::stoi((*it)[1]));
    return per_rank;
  };
  const std::string range = " --profile-step-start 2 --profile-step-end 3";
  const testing::TrainRun pp_tp = nccl(4, "--pp 2 --tp 2 --log-interval 4" + range);
  ASSERT_TRUE(pp_tp.ok) << pp_tp.command << "\n" << pp_tp.output;
  EXPECT_EQ(waits(pp_tp), std::vector<int>(4, 0)) << pp_tp.output;
  ASSERT_EQ(pp_tp.records.size(), 5u) << "every step's record, read later";
  const testing::TrainRun one = testing::run_train_gpt(1, flags() + " --log-interval 4" + range, *dir_);
  ASSERT_TRUE(one.ok) << one.command << "\n" << one.output;
  EXPECT_EQ(waits(one), std::vector<int>(1, 0)) << one.output;
  // Read every step (--log-interval 1, the default).
  const testing::TrainRun read = nccl(4, "--pp 2 --tp 2" + range);
  ASSERT_TRUE(read.ok) << read.command << "\n" << read.output;
  for (int w : waits(read)) EXPECT_LE(w, 2) << read.output;
  EXPECT_EQ(waits(read).size(), 4u) << read.output;
}

// --check-links on GPUs with NCCL: the MPI links, then NCCL's between the
// ranks' GPUs, each pair once.
TEST_F(NcclRanks, CheckLinksMeasuresNcclToo) {
  const testing::TrainRun run = testing::run_train_gpt(
      3, "--check-links --check-links-mib 1 --device cuda --comm-backend nccl", *dir_);
  ASSERT_TRUE(run.ok) << run.command << "\n" << run.output;
  EXPECT_TRUE(testing::contains(run.output, "links between 3 ranks over MPI (host memory)"))
      << run.output;
  EXPECT_TRUE(testing::contains(run.output, "links between 3 ranks over NCCL (GPU memory)"))
      << run.output;
  EXPECT_EQ(testing::count(run.output, "over 3 links; slowest"), 2) << run.output;
}

// Bad input, one line each and nothing started: a GPU index past the
// visible devices, and one GPU named for several ranks.
TEST_F(NcclRanks, BadDevices) {
  use_gpus(2);
  const testing::TrainRun past = testing::run_train_gpt(1, flags("cuda:9"), *dir_);
  EXPECT_FALSE(past.ok);
  EXPECT_TRUE(testing::contains(past.output, "--device cuda:9: ")) << past.output;
  EXPECT_TRUE(testing::contains(past.output, "see nvidia-smi and CUDA_VISIBLE_DEVICES"))
      << past.output;
  EXPECT_FALSE(testing::contains(past.output, "step ")) << past.output;
  const testing::TrainRun one = nccl(2, "--pp 2", "cuda:0");
  EXPECT_FALSE(one.ok);
  EXPECT_TRUE(testing::contains(
      one.output, "--device cuda:0 places one process on one GPU; with 2 ranks each takes the "
                  "GPU of its local rank: use --device cuda"))
      << one.output;
}

}  // namespace
}  // namespace weft

#endif  // WEFT_CUDA
