// train_gpt under mpiexec: every schedule at pp 2 and 4 gives the
// single-process losses and gradient norms for 5 steps, on real processes.
#include <weft/checkpoint.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <fmt/core.h>

#include "test_util.h"

#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <regex>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <thread>

namespace weft {
namespace {

using testing::read_file;

// (schedule, pp, receives posted ahead with --overlap-p2p-comm)
class MpiPipeline : public ::testing::TestWithParam<std::tuple<std::string, int, bool>> {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(testing::temp_dir("mpi-pipeline"));
    std::string text;
    for (int i = 0; i < 80; ++i) text += "Call me Ishmael. Some years ago, never mind how long. ";
    testing::write_file(*dir_ + "/text.txt", text);
    reference_ = new std::vector<nlohmann::json>(train(1, ""));
    ASSERT_EQ(reference_->size(), 5u);
  }

  static std::string flags() {
    return "--num-layers 8 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
           "--micro-batch-size 2 --global-batch-size 16 --train-iters 5 --lr 3e-3 "
           "--clip-grad 0.5 --threads 1 --comm-timeout 60 --data-path " + *dir_ + "/text.txt";
  }

  // Runs train_gpt on `ranks` processes and returns its JSONL records.
  static std::vector<nlohmann::json> train(int ranks, const std::string& extra) {
    const testing::TrainRun run = testing::run_train_gpt(ranks, flags() + " " + extra, *dir_);
    EXPECT_TRUE(run.ok) << run.command << "\n" << run.output;
    return run.records;
  }

  static std::string* dir_;
  static std::vector<nlohmann::json>* reference_;
};

std::string* MpiPipeline::dir_ = nullptr;
std::vector<nlohmann::json>* MpiPipeline::reference_ = nullptr;

TEST_P(MpiPipeline, MatchesSingleProcess) {
  const auto& [schedule, pp, ahead] = GetParam();
  auto got = train(pp, "--pp " + std::to_string(pp) + " --schedule " + schedule +
                           (ahead ? " --overlap-p2p-comm" : ""));
  ASSERT_EQ(got.size(), reference_->size()) << read_file(*dir_ + "/out.txt");
  for (size_t s = 0; s < got.size(); ++s) {
    const double loss = (*reference_)[s]["loss"], norm = (*reference_)[s]["grad_norm"];
    EXPECT_NEAR(got[s]["loss"].get<double>(), loss, 1e-5 * loss) << "step " << s;
    EXPECT_NEAR(got[s]["grad_norm"].get<double>(), norm, 1e-5 * norm) << "step " << s;
  }
  const std::string out = read_file(*dir_ + "/out.txt");
  // Each rank's peak of arena bytes, measured, is what the schedule's memory
  // model composes from the bytes that rank's actions added: the same text.
  const std::string head = "activation memory, peak per pipeline rank: [";
  const size_t at = out.find(head);
  ASSERT_NE(at, std::string::npos) << out;
  const size_t held_end = out.find("] held, [", at);
  ASSERT_NE(held_end, std::string::npos) << out;
  const size_t model_begin = held_end + 9, model_end = out.find("] by ", model_begin);
  ASSERT_NE(model_end, std::string::npos) << out;
  EXPECT_EQ(out.substr(at + head.size(), held_end - at - head.size()),
            out.substr(model_begin, model_end - model_begin))
      << out.substr(at, model_end - at);
}

INSTANTIATE_TEST_SUITE_P(
    Schedules, MpiPipeline,
    ::testing::Combine(::testing::Values("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v"),
                       ::testing::Values(2, 4), ::testing::Values(false)),
    [](const auto& param_info) {
      std::string n = std::get<0>(param_info.param) + "_pp" +
                      std::to_string(std::get<1>(param_info.param));
      for (char& c : n)
        if (c == '-') c = '_';
      return n;
    });

INSTANTIATE_TEST_SUITE_P(
    ReceivesAhead, MpiPipeline,
    ::testing::Values(std::tuple<std::string, int, bool>{"zb-h1", 4, true},
                      std::tuple<std::string, int, bool>{"interleaved-1f1b", 2, true}),
    [](const auto& param_info) {
      std::string n = std::get<0>(param_info.param) + "_pp" +
                      std::to_string(std::get<1>(param_info.param)) + "_ahead";
      for (char& c : n)
        if (c == '-') c = '_';
      return n;
    });

// A measured trace: one complete event per action of the lowered schedule per
// step, on one track per rank, every send's arrow ending at its receive; the
// log gains each step's bubble.
TEST_F(MpiPipeline, TraceRecordsEveryActionOnEveryRank) {
  const std::string trace = *dir_ + "/trace.json";
  auto got = train(2, "--pp 2 --schedule zb-h1 --trace " + trace);
  ASSERT_EQ(got.size(), 5u);
  for (const auto& rec : got) {
    ASSERT_TRUE(rec.contains("bubble_frac"));
    EXPECT_GE(rec["bubble_frac"].get<double>(), 0.0);
    EXPECT_LT(rec["bubble_frac"].get<double>(), 1.0);
  }
  auto events = nlohmann::json::parse(read_file(trace))["traceEvents"];
  size_t complete = 0;
  std::map<int64_t, int> flows;
  std::set<int> tracks;
  for (const auto& e : events) {
    ASSERT_TRUE(e.contains("ph") && e.contains("pid") && e.contains("tid")) << e.dump();
    const std::string ph = e["ph"];
    if (ph == "X") {
      ++complete;
      tracks.insert(e["tid"].get<int>());
      EXPECT_GE(e["dur"].get<int64_t>(), 0);
    }
    if (ph == "s") ++flows[e["id"].get<int64_t>()];
    if (ph == "f") --flows[e["id"].get<int64_t>()];
  }
  // zb-h1 at pp 2 with 8 micro-batches: per rank 8 F + 8 I + 8 W + 16 messages.
  EXPECT_EQ(complete, 5u * 2u * (3u * 8u + 2u * 8u));
  EXPECT_EQ(tracks, (std::set<int>{0, 1}));
  EXPECT_EQ(flows.size(), 5u * 2u * 8u);
  for (const auto& [id, balance] : flows) EXPECT_EQ(balance, 0) << id;
}

// A layout's steps against one process's: losses to 1e-5 relative, norms to
// 1e-5 at the first step and to `norm_tol` after the first update.
void expect_same_steps(const testing::TrainRun& got, const testing::TrainRun& one,
                       double norm_tol) {
  ASSERT_EQ(got.records.size(), one.records.size());
  for (size_t s = 0; s < one.records.size(); ++s) {
    const double loss = one.records[s]["loss"], norm = one.records[s]["grad_norm"];
    EXPECT_NEAR(got.records[s]["loss"].get<double>(), loss, 1e-5 * loss) << "step " << s + 1;
    EXPECT_NEAR(got.records[s]["grad_norm"].get<double>(), norm,
                (s == 0 ? 1e-5 : norm_tol) * norm)
        << "step " << s + 1;
  }
}

// Messages above MPI's eager limit (here 32 KiB) complete only once their
// receiver posts: a rank that waited for its sends before going on to its
// next actions deadlocked interleaved 1F1B with as many micro-batches as ranks.
TEST(MpiPipelineLarge, InterleavedWithLargeMessagesAndFewMicroBatchesFinishes) {
  const std::string dir = testing::temp_dir("mpi-pipeline-large");
  std::string text;
  for (int i = 0; i < 200; ++i) text += "Call me Ishmael. Some years ago, never mind how long. ";
  testing::write_file(dir + "/t.txt", text);
  const std::string cmd = std::string(std::getenv("WEFT_MPIEXEC")) + " -n 4 " +
                          std::getenv("WEFT_TRAIN_GPT") + " --data-path " + dir +
                          "/t.txt --num-layers 8 --hidden-size 128 --num-attention-heads 4 "
                          "--seq-length 64 --micro-batch-size 1 --global-batch-size 4 --pp 4 "
                          "--schedule interleaved-1f1b --train-iters 2 --threads 1 "
                          "--comm-timeout 30 >" + dir + "/out.txt 2>&1";
  const int status = std::system(cmd.c_str());
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << read_file(dir + "/out.txt");
  EXPECT_NE(read_file(dir + "/out.txt").find("step     2/2"), std::string::npos);
}

TEST(MpiPipelineErrors, ImpossibleLayoutsFailOnEveryRankBeforeCommunicating) {
  const std::string dir = testing::temp_dir("mpi-pipeline-errors");
  testing::write_file(dir + "/t.txt", std::string(4000, 'a'));
  auto run = [&](const std::string& args) {
    std::string cmd = std::string(std::getenv("WEFT_MPIEXEC")) + " -n 4 " +
                      std::getenv("WEFT_TRAIN_GPT") + " --data-path " + dir + "/t.txt " + args +
                      " >" + dir + "/out.txt 2>&1";
    const int status = std::system(cmd.c_str());
    EXPECT_FALSE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << cmd;
    return read_file(dir + "/out.txt");
  };
  std::string out = run("--model toy --pp 3");
  EXPECT_NE(out.find("world size (4) must be divisible"), std::string::npos) << out;
  // Printed once, by rank 0 (a launcher may add its own lines, e.g. Open MPI's
  // banner about the non-zero exit).
  EXPECT_EQ(testing::count(out, "train_gpt:"), 1) << out;
  out = run("--model toy --num-layers 8 --pp 4 --schedule zb-v --micro-batch-size 2 "
            "--global-batch-size 4");
  EXPECT_NE(out.find("micro-batches (2) must be at least pp (4)"), std::string::npos) << out;
  out = run("--model toy --pp 4 --schedule interleaved-1f1b --micro-batch-size 1 "
            "--global-batch-size 8");
  EXPECT_NE(out.find("--num-layers (2)"), std::string::npos) << out;
  out = run("--model toy --num-layers 4 --pp 4 --schedule pipedream");
  EXPECT_NE(out.find("pipedream"), std::string::npos) << out;
}

// The Llama family under mpiexec with pp 2 and tp 2 gives the single-process
// losses and norms (the same sums in another order: 1e-5). With grouped-query
// attention (4 query heads, 2 key/value heads), so each tensor-parallel rank
// holds unequal q|k|v blocks; multi-head Llama's layouts are checked on
// threads (test_parity). With --sequence-parallel too: RMSNorm's gradients
// summed over the group, rotary inside the regions, the untied head
// gathering its input; two sequences a micro-batch, so each rank's tokens
// are one whole sequence of the two (layers/tp_regions.h).
TEST(MpiLlama, Pp2Tp2GivesTheSingleProcessLosses) {
  const std::string dir = testing::temp_dir("mpi-llama");
  std::string text;
  for (int i = 0; i < 60; ++i) text += "Whether 'tis nobler in the mind to suffer the slings. ";
  testing::write_file(dir + "/text.txt", text);
  const std::string flags =
      "--arch llama --num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
      "--group-query-attention --num-query-groups 2 "
      "--micro-batch-size 2 --global-batch-size 8 --train-iters 4 --lr 3e-3 --clip-grad 0.5 "
      "--threads 1 --comm-timeout 60 --data-path " + dir + "/text.txt";
  const testing::TrainRun one = testing::run_train_gpt(1, flags, dir);
  ASSERT_TRUE(one.ok) << one.output;
  for (const char* sp : {"", " --sequence-parallel"}) {
    SCOPED_TRACE(sp);
    const testing::TrainRun four = testing::run_train_gpt(4, flags + " --pp 2 --tp 2" + sp, dir);
    ASSERT_TRUE(four.ok) << four.command << "\n" << four.output;
    expect_same_steps(four, one, 1e-5);
  }
}

// --plan auto with no other planning flag, on 4 processes: rank 0 profiles
// the model, every rank measures the links, and every rank runs the layout
// rank 0 chose (the mesh it builds is the plan's), with the prediction set
// beside the first steps.
TEST(MpiPlanAuto, ProfilesPlansAndRunsThePlanOnEveryRank) {
  const std::string dir = testing::temp_dir("mpi-plan-auto");
  std::string text;
  for (int i = 0; i < 60; ++i) text += "All the world's a stage, and all the men and women. ";
  testing::write_file(dir + "/text.txt", text);
  const testing::TrainRun run = testing::run_train_gpt(
      4,
      "--model toy --global-batch-size 8 --train-iters 3 --threads 1 --comm-timeout 60 "
      "--plan auto --data-path " +
          dir + "/text.txt",
      dir);
  ASSERT_TRUE(run.ok) << run.command << "\n" << run.output;
  EXPECT_TRUE(
      testing::contains(run.output, "plan auto: profiled on rank 0 at micro-batch 1 on cpu"))
      << run.output;
  EXPECT_TRUE(testing::contains(run.output, "(measured, median of 6 pairs)")) << run.output;
  const std::regex chose(R"(plan auto: \(dp (\d+), pp (\d+), tp (\d+)\))");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(run.output, m, chose)) << run.output;
  EXPECT_TRUE(testing::contains(run.output, "mesh: world 4 = tp " + m[3].str() + " x dp " +
                                                m[1].str() + " x pp " + m[2].str()))
      << run.output;
  EXPECT_TRUE(testing::contains(run.output, " ms a step; steps 2-3 took ")) << run.output;
  EXPECT_EQ(run.records.size(), 3u);
}

// --fp16 on real processes at dp 2 x pp 2: the skip decision comes from the
// all-reduced gradient norm, so the job skips exactly the steps one process
// skips (the default 2^32 scale overflows at first, then halves), with the
// same scales, and its losses are one process's to the fp32 layout
// tolerance (1e-5; test_precision holds the threads' layouts to the same).
// So do the distributed optimizer and sharded gradients, whose unscaling
// acts on each replica's reduced slices; their norms are one process's too
// (the unscaled gradients': the same bound as the losses at step 1, and
// 1e-4 after, as for bf16 below). Before, the distributed optimizer's norm
// was the scaled gradients' (scale x the norm) and its clipping acted on
// them.
TEST(MpiMixedPrecision, Fp16AtDp2Pp2SkipsWhereOneProcessDoes) {
  const std::string dir = testing::temp_dir("mpi-fp16");
  std::string text;
  for (int i = 0; i < 60; ++i) text += "It is a truth universally acknowledged, that a single. ";
  testing::write_file(dir + "/text.txt", text);
  const std::string flags =
      "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
      "--micro-batch-size 1 --global-batch-size 4 --train-iters 16 --lr 3e-3 --fp16 "
      "--loss-scale-window 4 --threads 1 --comm-timeout 60 --data-path " + dir + "/text.txt";
  const testing::TrainRun one = testing::run_train_gpt(1, flags, dir);
  ASSERT_TRUE(one.ok) << one.output;
  for (const char* sharding :
       {"", " --use-distributed-optimizer", " --data-parallel-sharding-strategy optim_grads",
        " --data-parallel-sharding-strategy optim_grads_params"}) {
    SCOPED_TRACE(sharding);
    const testing::TrainRun four = testing::run_train_gpt(4, flags + " --pp 2" + sharding, dir);
    ASSERT_TRUE(four.ok) << four.command << "\n" << four.output;
    ASSERT_EQ(four.records.size(), one.records.size());
    int skipped = 0, compared = 0;
    for (size_t s = 0; s < one.records.size(); ++s) {
      const nlohmann::json &a = one.records[s], &b = four.records[s];
      EXPECT_EQ(b.value("skipped", false), a.value("skipped", false)) << "step " << s + 1;
      EXPECT_EQ(b.value("loss_scale", 0.0), a.value("loss_scale", 0.0)) << "step " << s + 1;
      const double loss = a["loss"];
      EXPECT_NEAR(b["loss"].get<double>(), loss, 1e-5 * loss) << "step " << s + 1;
      skipped += a.value("skipped", false);
      if (a.value("skipped", false)) continue;
      const double norm = a["grad_norm"];
      EXPECT_NEAR(b["grad_norm"].get<double>(), norm, (compared++ == 0 ? 1e-5 : 1e-4) * norm)
          << "step " << s + 1;
    }
    EXPECT_GT(skipped, 0);
    EXPECT_GT(compared, 0);
  }
  EXPECT_FALSE(one.records.back().value("skipped", false)) << "the scale never fitted";
}

// --sample at pp 2 x tp 2: the weights are split over the ranks, so rank 0
// draws the sample from the run's last checkpoint, read whole. The same
// checkpoint loaded by one process (the trainer's own load, tensor by
// tensor) gives the same sample bit for bit, at temperature 1 (each token
// drawn from the softmax, so any weight out of place changes it); the
// sample is printed once; without --save the run is refused before it
// starts.
TEST(MpiSample, AtPp2Tp2RankZeroSamplesTheLastCheckpoint) {
  const std::string dir = testing::temp_dir("mpi-sample");
  std::string text;
  for (int i = 0; i < 60; ++i) text += "It is a truth universally acknowledged, that a single. ";
  testing::write_file(dir + "/text.txt", text);
  const std::string flags =
      "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
      "--micro-batch-size 1 --global-batch-size 4 --train-iters 6 --lr 1e-2 --threads 1 "
      "--comm-timeout 60 --sample 24 --sample-temperature 1 --sample-prompt 'It is' "
      "--data-path " +
      dir + "/text.txt";
  const testing::TrainRun four =
      testing::run_train_gpt(4, flags + " --pp 2 --tp 2 --save " + dir + "/ckpt", dir);
  ASSERT_TRUE(four.ok) << four.command << "\n" << four.output;
  EXPECT_TRUE(testing::contains(
      four.output, "sampling on rank 0 with the weights of " + dir + "/ckpt/iter_0000006 (step 6)"))
      << four.output;
  auto sample = [](const std::string& out) {
    const size_t at = out.find("--- sample (24 tokens");
    EXPECT_NE(at, std::string::npos) << out;
    EXPECT_EQ(out.find("--- sample", at + 1), std::string::npos) << "sampled twice:\n" << out;
    const size_t from = out.find('\n', at) + 1;
    return at == std::string::npos ? std::string() : out.substr(from, out.find('\n', from) - from);
  };
  const testing::TrainRun one = testing::run_train_gpt(1, flags + " --load " + dir + "/ckpt", dir);
  ASSERT_TRUE(one.ok) << one.command << "\n" << one.output;
  const std::string drawn = sample(four.output);
  EXPECT_EQ(drawn.substr(0, 5), "It is");
  EXPECT_EQ(drawn, sample(one.output));
  // Sharded parameters at dp 4: no rank holds the weights whole, so rank 0
  // samples the checkpoint as well, the same tokens.
  const std::string zero3_flags = flags + " --data-parallel-sharding-strategy optim_grads_params";
  const testing::TrainRun zero3 =
      testing::run_train_gpt(4, zero3_flags + " --save " + dir + "/ckpt3", dir);
  ASSERT_TRUE(zero3.ok) << zero3.command << "\n" << zero3.output;
  EXPECT_TRUE(testing::contains(zero3.output, "sampling on rank 0 with the weights of " + dir +
                                                  "/ckpt3/iter_0000006 (step 6)"))
      << zero3.output;
  const testing::TrainRun zero3_one =
      testing::run_train_gpt(1, flags + " --load " + dir + "/ckpt3", dir);
  ASSERT_TRUE(zero3_one.ok) << zero3_one.command << "\n" << zero3_one.output;
  EXPECT_EQ(sample(zero3.output), sample(zero3_one.output));
  const testing::TrainRun zero3_refused = testing::run_train_gpt(4, zero3_flags, dir);
  EXPECT_FALSE(zero3_refused.ok);
  EXPECT_TRUE(testing::contains(zero3_refused.output,
                                "or with --data-parallel-sharding-strategy "
                                "optim_grads_params, draws on rank 0"))
      << zero3_refused.output;
  const testing::TrainRun refused = testing::run_train_gpt(4, flags + " --pp 2 --tp 2", dir);
  EXPECT_FALSE(refused.ok);
  EXPECT_TRUE(testing::contains(refused.output,
                                "--sample with --pp or --tp > 1, or with "
                                "--data-parallel-sharding-strategy optim_grads_params, draws on "
                                "rank 0 from the run's last checkpoint, whole: it needs --save"))
      << refused.output;
}

// --bf16 on real processes at dp 2 x pp 2: the stages send bf16 activations
// through MPI, the same bytes one process keeps, so the losses and norms are
// one process's to test_precision's bounds for the threads' layouts (1e-5
// for the losses, 1e-4 for the norms after the first update).
TEST(MpiMixedPrecision, Bf16ActivationsAtDp2Pp2GiveOneProcessRun) {
  const std::string dir = testing::temp_dir("mpi-bf16");
  std::string text;
  for (int i = 0; i < 60; ++i) text += "It is a truth universally acknowledged, that a single. ";
  testing::write_file(dir + "/text.txt", text);
  const std::string flags =
      "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
      "--micro-batch-size 1 --global-batch-size 4 --train-iters 5 --lr 3e-3 --bf16 "
      "--threads 1 --comm-timeout 60 --data-path " + dir + "/text.txt";
  const testing::TrainRun one = testing::run_train_gpt(1, flags, dir);
  ASSERT_TRUE(one.ok) << one.output;
  const testing::TrainRun four = testing::run_train_gpt(4, flags + " --pp 2", dir);
  ASSERT_TRUE(four.ok) << four.command << "\n" << four.output;
  expect_same_steps(four, one, 1e-4);
  // Sharded parameters: each gathered bucket rounded to bf16 once, in place
  // of the batch's copies; the same bits as rounding each weight.
  const testing::TrainRun zero3 = testing::run_train_gpt(
      4,
      flags + " --pp 2 --data-parallel-sharding-strategy optim_grads_params --ddp-bucket-size 2048",
      dir);
  ASSERT_TRUE(zero3.ok) << zero3.command << "\n" << zero3.output;
  expect_same_steps(zero3, one, 1e-4);
}

// Polls `done` every 20 ms for up to two minutes; its last answer.
bool wait_for(const std::function<bool()>& done) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (!done() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  return done();
}

// Step records a running job has written to its JSONL so far (0 while the
// file is missing or a line is half written).
size_t logged_steps(const std::string& jsonl) {
  try {
    return std::filesystem::exists(jsonl) ? testing::jsonl_steps(jsonl).size() : 0;
  } catch (const std::exception&) {
    return 0;
  }
}

// kill -9 of a rank under scripts/weft-run, as a machine failure would: the
// job runs in the background, and once three steps are logged, rank 1 (its
// PID from train_gpt's rank table) is killed. Returns the wrapper's output.
struct KilledJob {
  std::string out, rc, jsonl;
  int pid = 0;
};

KilledJob run_and_kill_rank1(const std::string& dir, const std::string& wrapper_flags,
                             const std::string& flags) {
  KilledJob k;
  k.jsonl = dir + "/job.jsonl";
  const std::string rc = dir + "/job.rc";
  std::filesystem::remove(k.jsonl);
  std::filesystem::remove(rc);
  std::filesystem::remove_all(dir + "/ckpt");
  const std::string job = "WEFT_MPIEXEC='" + std::string(std::getenv("WEFT_MPIEXEC")) + "' " +
                          testing::source_path("scripts/weft-run") + " " + wrapper_flags +
                          " -- " + std::getenv("WEFT_TRAIN_GPT") + " " + flags + " --save " +
                          dir + "/ckpt --log-jsonl " + k.jsonl;
  EXPECT_EQ(std::system(("( " + job + " >" + dir + "/job.out 2>&1; echo $? >" + rc + " ) &").c_str()),
            0);
  if (wait_for([&] { return logged_steps(k.jsonl) >= 3; })) {
    k.pid = testing::jsonl_headers(k.jsonl).at(0)["ranks"].at(1)["pid"].get<int>();
    EXPECT_EQ(::kill(k.pid, SIGKILL), 0);
  }
  EXPECT_TRUE(wait_for([&] { return !read_file(rc).empty(); })) << "weft-run did not finish";
  k.out = read_file(dir + "/job.out");
  k.rc = read_file(rc);
  return k;
}

std::string restart_flags(const std::string& dir) {
  return "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
         "--micro-batch-size 2 --global-batch-size 4 --train-iters 60 --lr 3e-3 --threads 1 "
         "--comm-timeout 60 --device cpu --save-interval 1 --data-path " + dir + "/text.txt";
}

std::string restart_dir() {
  const std::string dir = testing::temp_dir("mpi-restart");
  testing::write_file(dir + "/text.txt", testing::best_of_times(60));
  return dir;
}

// The restarted job's losses are the uninterrupted run's, bit for bit (the
// same layout, the same sums). Steps run again after the restart are logged
// twice: the last record counts.
// The job's losses (the last logged for each step) against the whole run's
// from step `first` + 1 on: bit for bit, or within `tol` relative.
void expect_uninterrupted_losses(const KilledJob& k, const testing::TrainRun& full,
                                 size_t first = 0, double tol = 0) {
  std::map<int, double> loss;
  for (const auto& r : testing::jsonl_steps(k.jsonl)) loss[r["step"].get<int>()] = r["loss"];
  ASSERT_EQ(loss.size(), full.records.size() - first) << k.out;
  for (size_t i = first; i < full.records.size(); ++i) {
    const auto& r = full.records[i];
    const double want = r["loss"].get<double>();
    if (tol == 0)
      EXPECT_EQ(loss.at(r["step"].get<int>()), want) << "step " << r["step"];
    else
      EXPECT_NEAR(loss.at(r["step"].get<int>()), want, tol * want) << "step " << r["step"];
  }
}

// The same with parameter servers: world rank 2 serves workers 0 and 1 at
// --max-staleness 0. Killing worker 1 ends the job, the wrapper names it and
// restarts, the servers load their state from the newest checkpoint, and the
// run ends with the uninterrupted losses, bit for bit.
TEST(MpiRestart, KilledParameterServerWorkerIsNamedAndTheJobResumesBitExactly) {
  const std::string dir = restart_dir(), flags = restart_flags(dir) + " --ps-ranks 1";
  const testing::TrainRun full = testing::run_train_gpt(3, flags, dir);
  ASSERT_TRUE(full.ok) << full.output;
  ASSERT_EQ(full.records.size(), 60u);
  const KilledJob k = run_and_kill_rank1(dir, "-n 3 --backoff 0", flags);
  ASSERT_GT(k.pid, 0) << k.out;
  EXPECT_EQ(k.rc, "0\n") << k.out;
  EXPECT_TRUE(testing::contains(k.out, "weft-run: rank 1 (host ") ||
              testing::contains(k.out, "(as the launcher reports it)"))
      << k.out;
  EXPECT_TRUE(testing::contains(k.out, "resumed from " + dir + "/ckpt at step")) << k.out;
  expect_uninterrupted_losses(k, full);
}

// The wrapper names the rank that died, restarts the job, which resumes from
// its newest checkpoint, and the run ends with the uninterrupted run's losses.
TEST(MpiRestart, KilledRankIsNamedAndTheJobResumesBitExactly) {
  const std::string dir = restart_dir(), flags = restart_flags(dir);
  const testing::TrainRun full = testing::run_train_gpt(2, flags, dir);
  ASSERT_TRUE(full.ok) << full.output;
  ASSERT_EQ(full.records.size(), 60u);
  const KilledJob k = run_and_kill_rank1(dir, "-n 2 --backoff 0", flags);
  ASSERT_GT(k.pid, 0) << k.out;
  EXPECT_EQ(k.rc, "0\n") << k.out;
  EXPECT_TRUE(testing::contains(k.out, "weft-run: rank 1 (host ") &&
              testing::contains(k.out, "pid " + std::to_string(k.pid) + ", cpu) died first"))
      << k.out;
  EXPECT_TRUE(testing::contains(k.out, "weft-run: restarting from the newest checkpoint")) << k.out;
  EXPECT_TRUE(testing::contains(k.out, "resumed from " + dir + "/ckpt at step")) << k.out;
  expect_uninterrupted_losses(k, full);
  EXPECT_GE(testing::jsonl_headers(k.jsonl).size(), 2u) << "a header for each start";

  // What weft-run cannot restart is refused before anything runs.
  const std::string bare = testing::source_path("scripts/weft-run") + " -n 2 -- " +
                           std::getenv("WEFT_TRAIN_GPT") + " " + flags;
  const int status = std::system((bare + " >" + dir + "/bad.out 2>&1").c_str());
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 2);
  EXPECT_TRUE(testing::contains(read_file(dir + "/bad.out"), "the job has no --save DIR"))
      << read_file(dir + "/bad.out");
}

// A job started from --load X with --save Y: once Y holds a checkpoint, a
// restart resumes from Y's newest, not from X again (which redid every step
// since X and, now refused, would rewind Y). The losses are the uninterrupted
// run's. weft-run also reads Megatron's spelling of the layout flags, and
// refuses a --backoff that is not a number of seconds.
TEST(MpiRestart, ARestartResumesFromSaveNotFromLoad) {
  const std::string dir = restart_dir(), flags = restart_flags(dir);
  const testing::TrainRun full = testing::run_train_gpt(2, flags, dir);
  ASSERT_TRUE(full.ok) << full.output;
  const std::string start = dir + "/start";
  std::string two = flags;
  two.replace(two.find("--train-iters 60"), 16, "--train-iters 2");
  const testing::TrainRun first = testing::run_train_gpt(2, two + " --save " + start, dir);
  ASSERT_TRUE(first.ok) << first.output;
  const KilledJob k = run_and_kill_rank1(dir, "-n 2 --backoff 0",
                                         flags + " --load " + start + "/iter_0000002");
  ASSERT_GT(k.pid, 0) << k.out;
  EXPECT_EQ(k.rc, "0\n") << k.out;
  EXPECT_TRUE(testing::contains(k.out, "restarts resume from it, not from --load")) << k.out;
  EXPECT_TRUE(testing::contains(k.out, "resumed from " + dir + "/ckpt at step")) << k.out;
  expect_uninterrupted_losses(k, full, 2);  // steps 3 to 60: the job started after step 2

  const std::string wrapper = testing::source_path("scripts/weft-run");
  const std::string bad = wrapper + " -n 2 --backoff inf -- " +
                          std::getenv("WEFT_TRAIN_GPT") + " " + flags + " --save " + dir + "/x";
  const int status = std::system((bad + " >" + dir + "/bad.out 2>&1").c_str());
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 2);
  EXPECT_TRUE(testing::contains(read_file(dir + "/bad.out"),
                                "--backoff (inf) must be a number of seconds in [0, 3600]"))
      << read_file(dir + "/bad.out");
  const std::string odd = wrapper + " -n 3 --min-ranks 2 -- " + std::getenv("WEFT_TRAIN_GPT") +
                          " " + flags + " --tensor-model-parallel-size 0 --save " + dir + "/x";
  const int odd_status = std::system((odd + " >" + dir + "/odd.out 2>&1").c_str());
  EXPECT_FALSE(WIFEXITED(odd_status) && WEXITSTATUS(odd_status) == 0);
  EXPECT_TRUE(testing::contains(read_file(dir + "/odd.out"),
                                "--tp (0) must be a positive integer"))
      << read_file(dir + "/odd.out");
}

// --min-ranks: the restart leaves out the failed data-parallel replica and
// goes on with one rank, from the same checkpoint; one replica computes the
// same sums in another order, so the losses agree to 1e-5.
TEST(MpiRestart, MinRanksRestartsWithoutTheFailedReplica) {
  const std::string dir = restart_dir(), flags = restart_flags(dir);
  const testing::TrainRun full = testing::run_train_gpt(2, flags, dir);
  ASSERT_TRUE(full.ok) << full.output;
  const KilledJob k = run_and_kill_rank1(dir, "-n 2 --backoff 0 --min-ranks 1", flags);
  ASSERT_GT(k.pid, 0) << k.out;
  EXPECT_EQ(k.rc, "0\n") << k.out;
  EXPECT_TRUE(testing::contains(k.out, "1 ranks from now on (--min-ranks 1)")) << k.out;
  EXPECT_TRUE(testing::contains(k.out, "weft-run: starting 1 rank: ")) << k.out;
  ASSERT_EQ(full.records.size(), 60u);
  expect_uninterrupted_losses(k, full, 0, 1e-5);
}

// A rank killed before training started (before the rank table exists) is
// no bad flag: weft-run restarts it. Here the job is a script that kills
// itself with SIGKILL on its first start only; a bad flag is still not
// restarted.
TEST(MpiRestart, ARankKilledAtStartUpIsRestarted) {
  const std::string dir = restart_dir(), flags = restart_flags(dir);
  const std::string marker = dir + "/started-once", script = dir + "/job.sh";
  std::filesystem::remove(marker);
  std::filesystem::remove_all(dir + "/ckpt");
  testing::write_file(script, "#!/bin/sh\nif [ ! -e " + marker + " ]; then touch " + marker +
                                  "; kill -9 $$; fi\nexec \"$@\"\n");
  std::filesystem::permissions(script, std::filesystem::perms::owner_all);
  const std::string wrapper = testing::source_path("scripts/weft-run") + " --backoff 0 -- " +
                              script + " " + std::getenv("WEFT_TRAIN_GPT") + " ";
  std::string two = flags;
  two.replace(two.find("--train-iters 60"), 16, "--train-iters 2");
  int status = std::system((wrapper + two + " --save " + dir + "/ckpt >" + dir + "/out.txt 2>&1").c_str());
  std::string out = read_file(dir + "/out.txt");
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out;
  EXPECT_TRUE(testing::contains(out, "the job was killed before training started (signal 9), not a "
                                     "bad flag: restarting it"))
      << out;
  EXPECT_EQ(newest_checkpoint_step(dir + "/ckpt"), 2) << out;
  status = std::system(
      (wrapper + two + " --num-layers 0 --save " + dir + "/bad >" + dir + "/bad.txt 2>&1").c_str());
  out = read_file(dir + "/bad.txt");
  EXPECT_FALSE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out;
  EXPECT_TRUE(testing::contains(out, "not restarting, it would fail the same way")) << out;
}

// --min-ranks from dp 4 (micro-batches of 3, global batch 12): without rank
// 1's replica, 12 does not split over 3 replicas in micro-batches of 3, so
// the restart keeps the global batch in micro-batches of 2 (two each per
// step) rather than give up; the losses stay the one-process run's to 1e-5
// (the same sums in another order).
TEST(MpiRestart, MinRanksKeepsTheGlobalBatchWhenAReplicaGoes) {
  const std::string dir = restart_dir();
  std::string flags = restart_flags(dir);
  flags.replace(flags.find("--micro-batch-size 2 --global-batch-size 4"), 42,
                "--micro-batch-size 3 --global-batch-size 12");
  const testing::TrainRun full = testing::run_train_gpt(1, flags, dir);
  ASSERT_TRUE(full.ok) << full.output;
  const KilledJob k = run_and_kill_rank1(dir, "-n 4 --backoff 0 --min-ranks 3", flags);
  ASSERT_GT(k.pid, 0) << k.out;
  EXPECT_EQ(k.rc, "0\n") << k.out;
  EXPECT_TRUE(testing::contains(k.out, "3 ranks from now on (--min-ranks 3), global batch 12 in "
                                       "micro-batches of 2"))
      << k.out;
  EXPECT_TRUE(testing::contains(k.out, "--micro-batch-size 2")) << k.out;
  ASSERT_EQ(full.records.size(), 60u);
  expect_uninterrupted_losses(k, full, 0, 1e-5);
}

// Runs `job` (a launcher's command line that saves to dir/ckpt and logs to
// `jsonl`) in the background, sends its launcher SIGTERM once three steps
// are logged, as a scheduler does at its time limit, and checks that the
// job stopped gracefully: exit 0, one line saying so, a checkpoint. Returns
// the step it stopped after (0 where a check failed).
int stop_with_sigterm(const std::string& job, const std::string& dir, const std::string& jsonl,
                      int train_iters) {
  const std::string rc = dir + "/job.rc";
  std::filesystem::remove(jsonl);
  std::filesystem::remove(rc);
  std::filesystem::remove_all(dir + "/ckpt");
  // The launcher in the background; its PID is $!.
  EXPECT_EQ(std::system(("( " + job + " >" + dir + "/job.out 2>&1 & echo $! >" + dir +
                         "/job.pid; wait $!; echo $? >" + rc + " ) &")
                            .c_str()),
            0);
  if (!wait_for([&] { return logged_steps(jsonl) >= 3; })) {
    ADD_FAILURE() << read_file(dir + "/job.out");
    return 0;
  }
  EXPECT_EQ(::kill(std::stoi(read_file(dir + "/job.pid")), SIGTERM), 0);
  if (!wait_for([&] { return !read_file(rc).empty(); })) {
    ADD_FAILURE() << "the job did not stop";
    return 0;
  }
  const std::string out = read_file(dir + "/job.out");
  EXPECT_EQ(read_file(rc), "0\n") << out;
  EXPECT_TRUE(testing::contains(out, "stopping on SIGTERM after step")) << out;
  const int stopped = std::stoi(read_file(dir + "/ckpt/latest_checkpointed_iteration.txt"));
  EXPECT_GE(stopped, 3);
  EXPECT_LT(stopped, train_iters) << "the job ended before the signal";
  return stopped >= 3 && stopped < train_iters ? stopped : 0;
}

// SIGTERM to mpiexec (what a scheduler sends at its time limit) reaches every
// rank: they agree on the step, save once and exit 0; running the same
// command again continues with the uninterrupted run's losses, bit for bit.
TEST(MpiSigterm, EveryRankStopsAtTheSameStepAndTheJobResumesBitExactly) {
  const std::string dir = restart_dir(), flags = restart_flags(dir);
  const testing::TrainRun full = testing::run_train_gpt(2, flags + " --pp 2", dir);
  ASSERT_TRUE(full.ok) << full.output;
  const std::string jsonl = dir + "/job.jsonl";
  const std::string job = std::string(std::getenv("WEFT_MPIEXEC")) + " -n 2 " +
                          std::getenv("WEFT_TRAIN_GPT") + " " + flags +
                          " --pp 2 --save-interval 0 --save " + dir + "/ckpt --log-jsonl " + jsonl;
  const int stopped = stop_with_sigterm(job, dir, jsonl, 60);
  ASSERT_GT(stopped, 0);
  // The same command again: it resumes by itself and finishes.
  const testing::TrainRun rest = testing::run_train_gpt(
      2, flags + " --pp 2 --save-interval 0 --save " + dir + "/ckpt", dir);
  ASSERT_TRUE(rest.ok) << rest.output;
  EXPECT_TRUE(testing::contains(rest.output, "resumed from " + dir + "/ckpt at step " +
                                                 std::to_string(stopped)))
      << rest.output;
  ASSERT_EQ(rest.records.size(), full.records.size() - static_cast<size_t>(stopped));
  for (size_t i = 0; i < rest.records.size(); ++i)
    EXPECT_EQ(rest.records[i]["loss"].get<double>(),
              full.records[static_cast<size_t>(stopped) + i]["loss"].get<double>())
        << "step " << stopped + static_cast<int>(i) + 1;
}

// Ctrl-C on scripts/weft-run, as a terminal sends it: SIGINT to the whole
// foreground process group. mpiexec runs in its own group, so it gets one
// SIGINT, from weft-run (hydra takes two as "abort now", which lost the
// save); a second Ctrl-C is held. Every rank stops after the same step, one
// checkpoint is saved, and weft-run exits 0 without restarting.
TEST(MpiSigterm, CtrlCOnWeftRunSavesOnce) {
  const std::string dir = restart_dir(), flags = restart_flags(dir);
  const std::string jsonl = dir + "/job.jsonl", rc = dir + "/job.rc", pid = dir + "/job.pid";
  for (const std::string& f : {jsonl, rc, pid}) std::filesystem::remove(f);
  std::filesystem::remove_all(dir + "/ckpt");
  // setsid: weft-run leads a process group of its own, as a shell's job does.
  const std::string job = "WEFT_MPIEXEC='" + std::string(std::getenv("WEFT_MPIEXEC")) +
                          "' setsid " + testing::source_path("scripts/weft-run") +
                          " -n 2 --backoff 0 -- " + std::getenv("WEFT_TRAIN_GPT") + " " + flags +
                          " --pp 2 --save-interval 0 --save " + dir + "/ckpt --log-jsonl " + jsonl;
  ASSERT_EQ(std::system(("( " + job + " >" + dir + "/job.out 2>&1 & echo $! >" + pid +
                         "; wait $!; echo $? >" + rc + " ) &")
                            .c_str()),
            0);
  ASSERT_TRUE(wait_for([&] { return logged_steps(jsonl) >= 3; })) << read_file(dir + "/job.out");
  const int group = std::stoi(read_file(pid));
  ASSERT_EQ(::kill(-group, SIGINT), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_EQ(::kill(-group, SIGINT), 0);
  ASSERT_TRUE(wait_for([&] { return !read_file(rc).empty(); })) << "the job did not stop";
  const std::string out = read_file(dir + "/job.out");
  EXPECT_EQ(read_file(rc), "0\n") << out;
  EXPECT_TRUE(testing::contains(out, "stopping on SIGINT after step")) << out;
  EXPECT_TRUE(testing::contains(out, "SIGINT again: held")) << out;
  EXPECT_EQ(testing::count(out, "weft-run: starting 2 ranks"), 1) << out;
  const int stopped = std::stoi(read_file(dir + "/ckpt/latest_checkpointed_iteration.txt"));
  EXPECT_GE(stopped, 3);
  EXPECT_LT(stopped, 60) << "the job ended before the signal";
}

// The example of docs/your-first-model.md (a model family and a main of a
// few lines on weft/job.h), run as its page runs it. Under mpiexec -n 4 with
// --pp 2 --tp 2 it trains one process's model (losses to 1e-5: the same fp32
// sums in another order), takes its threads from the ranks per host by
// itself, stops on SIGTERM with a checkpoint, and the same command again
// resumes with the uninterrupted run's losses, bit for bit. The layouts are
// compared over the first 5 steps: at the example's --lr 1e-2, AdamW's
// normalised update soon turns the rounding of gradients near zero into
// differences of the size of the learning rate.
TEST(MpiFirstModel, TrainsStopsOnSigtermAndResumesWithTheSameCommand) {
  const char* exe = std::getenv("WEFT_FIRST_MODEL");
  ASSERT_NE(exe, nullptr) << "WEFT_FIRST_MODEL names the example's build";
  const std::string dir = testing::temp_dir("first-model");
  const testing::TrainRun one = testing::run_job(exe, 1, "--train-iters 5 --log-interval 1", dir);
  ASSERT_TRUE(one.ok) << one.output;
  const std::string layout = " --pp 2 --tp 2 --comm-timeout 60 --log-interval 1";
  const testing::TrainRun four = testing::run_job(exe, 4, "--train-iters 5" + layout, dir);
  ASSERT_TRUE(four.ok) << four.command << "\n" << four.output;
  expect_same_steps(four, one, 1e-4);
  const int threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / 4);
  EXPECT_TRUE(testing::contains(four.output, fmt::format("threads {} |", threads))) << four.output;

  const std::string run = layout + " --train-iters 200 --save " + dir + "/ckpt";
  const testing::TrainRun full = testing::run_job(exe, 4, "--train-iters 200" + layout, dir);
  ASSERT_TRUE(full.ok) << full.output;
  const std::string jsonl = dir + "/job.jsonl";
  const std::string job = std::string(std::getenv("WEFT_MPIEXEC")) + " -n 4 " + exe + run +
                          " --device cpu --log-jsonl " + jsonl;
  const int stopped = stop_with_sigterm(job, dir, jsonl, 200);
  ASSERT_GT(stopped, 0);
  const testing::TrainRun rest = testing::run_job(exe, 4, run, dir);
  ASSERT_TRUE(rest.ok) << rest.output;
  EXPECT_TRUE(testing::contains(rest.output, fmt::format("at step {}", stopped))) << rest.output;
  ASSERT_EQ(rest.records.size(), full.records.size() - static_cast<size_t>(stopped));
  for (size_t i = 0; i < rest.records.size(); ++i)
    EXPECT_EQ(rest.records[i]["loss"].get<double>(),
              full.records[static_cast<size_t>(stopped) + i]["loss"].get<double>())
        << "step " << stopped + static_cast<int>(i) + 1;
}

// Local SGD under mpiexec: with --optimizer sgd and --local-steps 1 the two
// replicas average their parameters every step, which gives synchronous data
// parallelism's losses to 1e-5 (the same sums in another order; SGD is
// linear in the gradient).
TEST(MpiLocalSgd, OneLocalStepGivesSynchronousLosses) {
  const std::string dir = restart_dir();
  const std::string flags = restart_flags(dir) +
                            " --optimizer sgd --sgd-momentum 0.9 --clip-grad 0 --lr 0.05 "
                            "--train-iters 6 --global-batch-size 8";
  const testing::TrainRun sync = testing::run_train_gpt(2, flags, dir);
  ASSERT_TRUE(sync.ok) << sync.output;
  const testing::TrainRun local = testing::run_train_gpt(2, flags + " --local-steps 1", dir);
  ASSERT_TRUE(local.ok) << local.output;
  ASSERT_EQ(local.records.size(), sync.records.size());
  for (size_t s = 0; s < sync.records.size(); ++s) {
    const double want = sync.records[s]["loss"];
    EXPECT_NEAR(local.records[s]["loss"].get<double>(), want, 1e-5 * want) << "step " << s + 1;
  }
  // DiLoCo runs, and its checkpoints fall on the averages.
  const testing::TrainRun diloco = testing::run_train_gpt(
      2, flags + " --local-steps 3 --outer-optimizer nesterov --save-interval 3 --save " + dir +
             "/diloco",
      dir);
  ASSERT_TRUE(diloco.ok) << diloco.output;
  EXPECT_TRUE(testing::contains(diloco.output, "saved checkpoint at step 3")) << diloco.output;
}

// --memory-budget reaches the partitioner: a budget no cut fits is refused
// with the least any cut needs; a roomy one runs.
TEST(MpiMemoryBudget, ReachesThePartitioner) {
  const std::string dir = testing::temp_dir("mpi-budget");
  std::string text;
  for (int i = 0; i < 40; ++i) text += "Happy families are all alike; every unhappy family is. ";
  testing::write_file(dir + "/text.txt", text);
  const std::string flags =
      "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
      "--micro-batch-size 2 --global-batch-size 4 --train-iters 1 --threads 1 --pp 2 "
      "--partition time --data-path " + dir + "/text.txt --memory-budget ";
  testing::TrainRun tight = testing::run_train_gpt(2, flags + "1KiB", dir);
  EXPECT_FALSE(tight.ok);
  EXPECT_TRUE(testing::contains(tight.output, "no plan fits the memory budget of 1024 bytes per "
                                              "rank: the least peak rank memory of any cut into 2 "
                                              "stages is"))
      << tight.output;
  testing::TrainRun roomy = testing::run_train_gpt(2, flags + "2GiB", dir);
  EXPECT_TRUE(roomy.ok) << roomy.output;
  EXPECT_TRUE(testing::contains(roomy.output, "time plan: 2 stages")) << roomy.output;
}

// --check-links measures each of the N (N - 1) / 2 links once, with 5 ranks
// (an odd count: every round leaves one rank out), and lists them all.
TEST(MpiCheckLinks, EveryPairOnce) {
  const std::string dir = testing::temp_dir("mpi-links");
  const std::string cmd = std::string(std::getenv("WEFT_MPIEXEC")) + " -n 5 " +
                          std::getenv("WEFT_TRAIN_GPT") + " --check-links --check-links-mib 1 >" +
                          dir + "/out.txt 2>&1";
  const int status = std::system(cmd.c_str());
  const std::string out = read_file(dir + "/out.txt");
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out;
  std::set<std::pair<int, int>> pairs;
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);) {
    int a = -1, b = -1;
    double gb = 0;
    char host_a[64] = {}, host_b[64] = {};
    if (std::sscanf(line.c_str(), "rank %d (%63[^)]) <-> rank %d (%63[^)]): %lf GB/s", &a, host_a,
                    &b, host_b, &gb) == 5) {
      EXPECT_LT(a, b) << line;
      EXPECT_GT(gb, 0.0) << line;
      EXPECT_TRUE(pairs.insert({a, b}).second) << "measured twice: " << line;
    }
  }
  EXPECT_EQ(pairs.size(), 10u) << out;
  EXPECT_TRUE(testing::contains(out, "over 10 links; slowest")) << out;
}

}  // namespace
}  // namespace weft
