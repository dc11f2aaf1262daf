// Several ranks sharing one GPU: train_gpt --device cuda under mpiexec, its
// tensors staged through host memory (HostStagedCommunicator), against the
// single-process GPU run. Every schedule at pp 2 and 4, pp 2 x tp 2, and
// (dp, pp, tp) = (2, 2, 2); the distributed optimizer (ZeRO-1) with its
// shards on the GPU at dp 2 and dp 2 x pp 2, against the plain optimizer and
// the CPU, and its checkpoints resumed on the GPU and on the CPU; the
// compressed reductions refused on a GPU; and NCCL refused while ranks share
// the GPU.
//
// Error model: every layout computes in fp32 and differs from one process
// only in the order of its reductions (tensor-parallel partial sums, the
// data-parallel all-reduce), as the CPU layouts of tests/test_parallel.cc do,
// which hold 1e-5 over five steps; so do these.
// Needs a GPU; exits 77 without.
#include "weft_config.h"

#if WEFT_CUDA
#include <weft/safetensors.h>

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <tuple>

#include "layout_test_util.h"
#include "params_close.h"
#include "test_util.h"

namespace weft {
namespace {

constexpr double kTol = 1e-5;

std::string cpu_flags(std::string f) { return f.replace(f.find("--device cuda"), 13, "--device cpu"); }

class SharedGpu : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(testing::temp_dir("cuda-mpi"));
    flags_ = new std::string(testing::small_gpt(*dir_));
    const testing::TrainRun one = testing::run_train_gpt(1, flags(), *dir_);
    ASSERT_TRUE(one.ok) << one.command << "\n" << one.output;
    reference_ = new std::vector<nlohmann::json>(one.records);
    ASSERT_EQ(reference_->size(), 5u);
  }
  static std::string flags() { return *flags_; }
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
  static std::string* flags_;
  static std::vector<nlohmann::json>* reference_;
};

std::string* SharedGpu::dir_ = nullptr;
std::string* SharedGpu::flags_ = nullptr;
std::vector<nlohmann::json>* SharedGpu::reference_ = nullptr;

TEST_F(SharedGpu, EverySchedule) {
  for (int pp : {2, 4})
    for (const char* schedule : {"gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v"})
      expect_single_process(pp, fmt::format("--pp {} --schedule {}", pp, schedule));
}

TEST_F(SharedGpu, PipelineTimesTensorParallel) {
  expect_single_process(4, "--pp 2 --tp 2");
  // Sequence parallelism: all-gathers and reduce-scatters of device
  // tensors through host buffers, into the ranks' shared device buffers.
  expect_single_process(4, "--pp 2 --tp 2 --schedule zb-h1 --sequence-parallel");
}

// --profile on a GPU: rank 0 times the whole model's nodes and measures each
// stage's memory on the GPU (the parameters of the stages it does not run
// placed there for the measurement, then returned), and the time-balanced
// cut trains as one process does. It once ran them on the CPU with some of
// the parameters on the GPU, and stopped. On the same cut a stage's forward
// keeps what the CPU's keeps, and its backward adds less: the GPU's
// activation gradients come from the caching allocator, freed as they die,
// not from the arena.
TEST_F(SharedGpu, ProfileMeasuresTheStagesOnTheGpu) {
  const std::string gpu = *dir_ + "/profile-gpu.json", cpu = *dir_ + "/profile-cpu.json";
  expect_single_process(2, "--pp 2 --partition time --profile " + gpu);
  const testing::TrainRun on_cpu = testing::run_train_gpt(
      2, cpu_flags(flags()) + " --pp 2 --partition uniform --profile " + cpu, *dir_);
  ASSERT_TRUE(on_cpu.ok) << on_cpu.command << "\n" << on_cpu.output;
  const testing::TrainRun uniform = testing::run_train_gpt(
      2, flags() + " --pp 2 --partition uniform --profile " + gpu, *dir_);
  ASSERT_TRUE(uniform.ok) << uniform.command << "\n" << uniform.output;
  const nlohmann::json g = nlohmann::json::parse(testing::read_file(gpu));
  const nlohmann::json c = nlohmann::json::parse(testing::read_file(cpu));
  ASSERT_EQ(g["stages"].size(), 2u);
  ASSERT_EQ(c["stages"].size(), 2u);
  for (size_t s = 0; s < 2; ++s) {
    EXPECT_EQ(g["stages"][s]["first"], c["stages"][s]["first"]) << "the same uniform cut";
    EXPECT_GT(g["stages"][s]["f"].get<double>(), 0.0) << "stage " << s;
    EXPECT_GT(g["stages"][s]["update"].get<double>(), 0.0) << "stage " << s;
    const nlohmann::json &gm = g["stages"][s]["memory"], &cm = c["stages"][s]["memory"];
    EXPECT_GT(gm["f"].get<double>(), 0.0) << "stage " << s;
    EXPECT_EQ(gm["f"], cm["f"]) << "stage " << s << ": the same activations kept";
    EXPECT_LT(gm["i"].get<double>(), cm["i"].get<double>()) << "stage " << s;
  }
}

TEST_F(SharedGpu, DataPipelineAndTensorParallel) {
  expect_single_process(8, "--pp 2 --tp 2 --comm-backend mpi");
}

// --- the distributed optimizer (ZeRO-1) with its shards on the GPU ---

// Parameters after training, as tests/test_parallel.cc compares two layouts:
// kTol relative, plus kParamAbs per element absolute (tests/params_close.h
// says why; here the float noise also differs between two GPU runs: the token
// embedding's gradient is a scatter-add with atomics).
constexpr double kParamAbs = 1e-6;
::testing::AssertionResult params_close(const Tensor& got, const Tensor& want) {
  return testing::params_close(got, want, kTol, kParamAbs);
}

// The same tensor names, dtypes and shapes in two safetensors files.
void expect_same_layout(const std::string& got, const std::string& want) {
  const safetensors::File a = safetensors::File::open(got), b = safetensors::File::open(want);
  ASSERT_EQ(a.tensors().size(), b.tensors().size()) << got << " vs " << want;
  for (const safetensors::TensorInfo& t : b.tensors()) {
    const safetensors::TensorInfo* u = a.find(t.name);
    ASSERT_NE(u, nullptr) << got << " lacks " << t.name;
    EXPECT_EQ(u->dtype, t.dtype) << t.name;
    EXPECT_EQ(u->shape, t.shape) << t.name;
  }
}

// The files of a checkpoint's writers ("model" or "optimizer"), one per rank.
std::vector<std::string> writer_files(const char* part, int ranks) {
  std::vector<std::string> out;
  for (int r = 1; r <= ranks; ++r)
    out.push_back(fmt::format("/{}-{:05d}-of-{:05d}.safetensors", part, r, ranks));
  return out;
}

// Every parameter of two model files within params_close.
void expect_params_close(const std::string& got, const std::string& want) {
  const safetensors::File a = safetensors::File::open(got), b = safetensors::File::open(want);
  ASSERT_EQ(a.tensors().size(), b.tensors().size()) << got << " vs " << want;
  for (const safetensors::TensorInfo& t : b.tensors())
    EXPECT_TRUE(params_close(a.get(t.name), b.get(t.name))) << t.name << ": " << got;
}

void expect_steps_close(const std::vector<nlohmann::json>& got,
                        const std::vector<nlohmann::json>& want, size_t first,
                        const std::string& what) {
  testing::expect_steps_close(got, want, first, kTol, what);
}

// Two ranks on the one GPU, data-parallel, ZeRO-1 (saving at step 3 and at
// the end), the plain optimizer, and ZeRO-1 on the CPU: run once for the
// tests below.
struct Zero1Runs {
  std::string dir;
  testing::TrainRun gpu, plain, cpu;
};
const Zero1Runs& zero1_runs(const std::string& dir, const std::string& flags) {
  static const Zero1Runs runs = [&] {
    Zero1Runs r;
    r.dir = dir;
    const std::string zero1 = " --use-distributed-optimizer --comm-backend mpi --save-interval 3";
    r.gpu = testing::run_train_gpt(2, flags + zero1 + " --save " + dir + "/zero1-gpu", dir);
    r.plain = testing::run_train_gpt(2, flags + " --comm-backend mpi --save " + dir + "/plain-gpu",
                                     dir);
    r.cpu = testing::run_train_gpt(2, cpu_flags(flags) + zero1 + " --save " + dir + "/zero1-cpu",
                                   dir);
    return r;
  }();
  return runs;
}

// Error model: ZeRO-1 sums each bucket by a reduce-scatter where the plain
// optimizer all-reduces it; two replicas' sums are the same in either order,
// so the two differ only where two GPU runs do (the embedding's atomics),
// and the CPU only in the order of its reductions (tests/cuda/test_cuda_train):
// the CPU layouts' 1e-5 over five steps holds for both.
TEST_F(SharedGpu, DistributedOptimizerGivesThePlainOptimizersAndTheCpusNumbers) {
  const Zero1Runs& r = zero1_runs(*dir_, flags());
  ASSERT_TRUE(r.gpu.ok) << r.gpu.command << "\n" << r.gpu.output;
  ASSERT_TRUE(r.plain.ok) << r.plain.command << "\n" << r.plain.output;
  ASSERT_TRUE(r.cpu.ok) << r.cpu.command << "\n" << r.cpu.output;
  EXPECT_TRUE(testing::contains(r.gpu.output, "| cuda:0")) << r.gpu.output;
  expect_steps_close(r.gpu.records, *reference_, 0, "ZeRO-1 on the GPU against one process");
  expect_steps_close(r.gpu.records, r.plain.records, 0, "ZeRO-1 against the plain optimizer");
  expect_steps_close(r.gpu.records, r.cpu.records, 0, "ZeRO-1 on the GPU against the CPU");
  // The parameters after five steps, gathered from the GPU's shards.
  for (const std::string& file : writer_files("model", 2)) {
    const std::string last = "/iter_0000005" + file;
    expect_params_close(r.dir + "/zero1-gpu" + last, r.dir + "/plain-gpu" + last);
    expect_params_close(r.dir + "/zero1-gpu" + last, r.dir + "/zero1-cpu" + last);
  }
  // With a pipeline too: the pipeline-parallel groups hold their own buckets.
  expect_single_process(4, "--pp 2 --use-distributed-optimizer --comm-backend mpi");
}

// A GPU ZeRO-1 checkpoint holds what a CPU one does (each replica's moment
// shards copied to the host and gathered), and resumes on both devices.
// Resumed on the GPU, step 4's loss is the uninterrupted run's bit for bit:
// the forward pass reads only the saved parameters (fp32, written exactly)
// and its kernels reduce in a fixed order. Its backward is not (the
// embedding's atomics), so the later numbers get the error model above, as
// does the CPU run resumed from the GPU's files.
TEST_F(SharedGpu, DistributedOptimizerCheckpointsResumeOnTheGpuAndTheCpu) {
  const Zero1Runs& r = zero1_runs(*dir_, flags());
  ASSERT_TRUE(r.gpu.ok) << r.gpu.command << "\n" << r.gpu.output;
  ASSERT_TRUE(r.cpu.ok) << r.cpu.command << "\n" << r.cpu.output;
  const std::string gpu3 = r.dir + "/zero1-gpu/iter_0000003", cpu3 = r.dir + "/zero1-cpu/iter_0000003";
  for (const std::string& file : writer_files("model", 2)) {
    expect_same_layout(gpu3 + file, cpu3 + file);
    expect_params_close(gpu3 + file, cpu3 + file);
  }
  for (const std::string& file : writer_files("optimizer", 2))
    expect_same_layout(gpu3 + file, cpu3 + file);

  const std::string zero1 = " --use-distributed-optimizer --comm-backend mpi --load " + gpu3;
  const testing::TrainRun on_gpu = testing::run_train_gpt(
      2, flags() + zero1 + " --save " + r.dir + "/resumed-gpu", r.dir);
  ASSERT_TRUE(on_gpu.ok) << on_gpu.command << "\n" << on_gpu.output;
  EXPECT_TRUE(testing::contains(on_gpu.output, "resumed from " + gpu3 + " at step 3"))
      << on_gpu.output;
  ASSERT_EQ(on_gpu.records.size(), 2u) << on_gpu.output;
  EXPECT_EQ(on_gpu.records[0]["loss"].get<double>(), r.gpu.records[3]["loss"].get<double>());
  expect_steps_close(on_gpu.records, r.gpu.records, 3, "resumed on the GPU");

  const testing::TrainRun on_cpu = testing::run_train_gpt(
      2, cpu_flags(flags()) + zero1 + " --save " + r.dir + "/resumed-cpu", r.dir);
  ASSERT_TRUE(on_cpu.ok) << on_cpu.command << "\n" << on_cpu.output;
  expect_steps_close(on_cpu.records, r.cpu.records, 3, "the GPU's checkpoint resumed on the CPU");
}

// What data parallelism still refuses on a GPU, in one line that names it.
TEST_F(SharedGpu, CompressedReductionsAreRefusedOnTheGpu) {
  for (const char* flag : {"--grad-reduce-dtype bf16", "--grad-compression powersgd"}) {
    const testing::TrainRun run = testing::run_train_gpt(
        2, flags() + " --comm-backend mpi " + flag, *dir_);
    EXPECT_FALSE(run.ok) << flag;
    EXPECT_TRUE(testing::contains(
        run.output, "on cuda:0, data parallelism reduces fp32 gradients: --grad-reduce-dtype bf16 "
                    "and --grad-compression powersgd are not available on a GPU yet"))
        << flag << "\n" << run.output;
  }
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
