// train_gpt under mpiexec with 8 processes: every dp x pp x tp layout, with
// 1F1B and with the zero-bubble schedule, and with the distributed optimizer,
// gives the single-process losses and gradient norms for 5 steps; a
// checkpoint saved by one layout resumes in others with the losses the
// uninterrupted run has.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <weft/bpe.h>
#include <weft/data.h>

#include "test_util.h"

#include <sys/wait.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <sstream>

namespace weft {
namespace {

using testing::read_file;

constexpr int kWorld = 8;

class MpiLayouts : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(testing::temp_dir("mpi-layouts"));
    std::string text;
    for (int i = 0; i < 80; ++i) text += "Call me Ishmael. Some years ago, never mind how long. ";
    testing::write_file(*dir_ + "/text.txt", text);
    reference_ = new std::vector<nlohmann::json>(train(1, ""));
    ASSERT_EQ(reference_->size(), 5u);
  }

  // 8 heads and a vocabulary of 256 divide by every tp up to 8; 8 layers
  // give every pipeline rank a block at pp 8.
  static std::string flags() {
    return "--num-layers 8 --hidden-size 32 --num-attention-heads 8 --seq-length 16 "
           "--micro-batch-size 1 --global-batch-size 8 --lr 3e-3 --clip-grad 0.5 "
           "--threads 1 --comm-timeout 60 --data-path " + *dir_ + "/text.txt";
  }

  // Runs train_gpt on `ranks` processes; returns its JSONL records.
  static std::vector<nlohmann::json> train(int ranks, const std::string& extra,
                                           int iters = 5) {
    const testing::TrainRun run = testing::run_train_gpt(ranks, flags() + " --train-iters " + std::to_string(iters) + " " + extra, *dir_);
    EXPECT_TRUE(run.ok) << run.command << "\n" << run.output;
    return run.records;
  }

  // The records match the reference's steps [first, first + size).
  static void expect_reference(const std::vector<nlohmann::json>& got, size_t first,
                               const std::string& what) {
    expect_same(got, *reference_, first, what);
  }

  static void expect_same(const std::vector<nlohmann::json>& got,
                          const std::vector<nlohmann::json>& reference, size_t first,
                          const std::string& what) {
    ASSERT_TRUE(!got.empty() && first + got.size() <= reference.size())
        << what << ": " << got.size() << " records\n"
        << read_file(*dir_ + "/out.txt");
    for (size_t s = 0; s < got.size(); ++s) {
      const auto& want = reference[first + s];
      EXPECT_EQ(got[s]["step"].get<int64_t>(), want["step"].get<int64_t>()) << what;
      const double loss = want["loss"], norm = want["grad_norm"];
      EXPECT_NEAR(got[s]["loss"].get<double>(), loss, 1e-5 * loss) << what << " step " << s;
      EXPECT_NEAR(got[s]["grad_norm"].get<double>(), norm, 1e-5 * norm) << what << " step " << s;
    }
  }

  static std::string* dir_;
  static std::vector<nlohmann::json>* reference_;
};

std::string* MpiLayouts::dir_ = nullptr;
std::vector<nlohmann::json>* MpiLayouts::reference_ = nullptr;

struct Layout {
  int dp, pp, tp;
  std::string args() const {
    return "--tp " + std::to_string(tp) + " --pp " + std::to_string(pp);
  }
  std::string str() const {
    return "(dp " + std::to_string(dp) + ", pp " + std::to_string(pp) + ", tp " +
           std::to_string(tp) + ")";
  }
};

const Layout kLayouts[] = {{2, 2, 2}, {1, 2, 4}, {2, 4, 1}, {4, 1, 2},
                           {8, 1, 1}, {1, 8, 1}, {1, 1, 8}};

TEST_F(MpiLayouts, EveryLayoutAndScheduleMatchesSingleProcess) {
  for (const Layout& l : kLayouts) {
    ASSERT_EQ(l.dp * l.pp * l.tp, kWorld);
    // Without a pipeline there is no schedule (train_gpt refuses one).
    if (l.pp == 1) {
      expect_reference(train(kWorld, l.args()), 0, l.str());
      continue;
    }
    for (const char* schedule : {"1f1b", "zb-h1"}) {
      const std::string what = l.str() + " " + schedule;
      expect_reference(train(kWorld, l.args() + " --schedule " + schedule), 0, what);
    }
  }
}

// A blend of an indexed dataset and a text file, shuffled by the seed: the
// data order is a function of the seed and the global batch only, so every
// layout reads the single process's batches.
TEST_F(MpiLayouts, ABlendOfDatasetsReadsTheSameBatchesAtEveryLayout) {
  const std::string prefix = *dir_ + "/indexed";
  {
    IndexedDatasetWriter w(prefix, 256);
    const std::string doc = "It was the best of times, it was the worst of times. ";
    for (int d = 0; d < 60; ++d) w.add_document(std::vector<int32_t>(doc.begin(), doc.end()));
    w.finish();
  }
  const std::string blend = "--data-path 0.6 " + prefix + " 0.4 " + *dir_ + "/text.txt";
  const std::vector<nlohmann::json> single = train(1, blend);
  ASSERT_EQ(single.size(), 5u);
  for (const Layout& l : {Layout{2, 2, 2}, Layout{8, 1, 1}, Layout{1, 2, 4}})
    expect_same(train(kWorld, l.args() + " " + blend), single, 0, l.str() + " blend");
  // The blend is not the text alone.
  EXPECT_NE(single[0]["loss"].get<double>(), (*reference_)[0]["loss"].get<double>());
}

TEST_F(MpiLayouts, DistributedOptimizerMatchesSingleProcess) {
  for (const Layout& l : {Layout{2, 2, 2}, Layout{8, 1, 1}, Layout{4, 1, 2}})
    expect_reference(train(kWorld, l.args() + (l.pp > 1 ? " --schedule zb-h1" : "") +
                                       " --use-distributed-optimizer"),
                     0, l.str() + " distributed optimizer");
  // Small buckets: many reductions overlap the backward, same numbers.
  expect_reference(train(kWorld, "--tp 1 --pp 1 --ddp-bucket-size 4096"), 0, "small buckets");
  // Sharded gradients (ZeRO-2), small buckets, with each axis.
  for (const Layout& l : {Layout{2, 2, 2}, Layout{8, 1, 1}})
    expect_reference(train(kWorld, l.args() + (l.pp > 1 ? " --schedule zb-h1" : "") +
                                       " --data-parallel-sharding-strategy optim_grads"
                                       " --ddp-bucket-size 4096"),
                     0, l.str() + " sharded gradients");
  // Sharded parameters (ZeRO-3): each node's buckets gathered before its
  // actions, under MPI's non-blocking all-gathers, with a pipeline whose W
  // actions gather again.
  for (const Layout& l : {Layout{2, 2, 2}, Layout{8, 1, 1}})
    expect_reference(train(kWorld, l.args() + (l.pp > 1 ? " --schedule zb-h1" : "") +
                                       " --data-parallel-sharding-strategy optim_grads_params"
                                       " --ddp-bucket-size 4096"),
                     0, l.str() + " sharded parameters");
}

// Sequence parallelism under mpiexec: the norms, residual adds and the
// loss's input split along the sequence across the tp ranks, with a
// pipeline whose W actions run apart (each gathers again), and at tp 4.
TEST_F(MpiLayouts, SequenceParallelMatchesSingleProcess) {
  expect_reference(train(kWorld, "--tp 2 --pp 2 --schedule zb-h1 --sequence-parallel"), 0,
                   "(dp 2, pp 2, tp 2) zb-h1 sequence-parallel");
  expect_reference(train(kWorld, "--tp 4 --pp 1 --sequence-parallel"), 0,
                   "(dp 2, pp 1, tp 4) sequence-parallel");
}

// Documents (--eod-mask-loss, --reset-position-ids, --reset-attention-mask)
// under mpiexec: token data a BPE made, its <|endoftext|> ending each
// document; the positions are filled on every stage, the count of loss
// terms on every rank. Without --sample: the tokenizer names the token.
TEST_F(MpiLayouts, DocumentsMatchSingleProcess) {
  if (!BpeTokenizer::available()) GTEST_SKIP() << "weft was built without PCRE2";
  const std::string docs =
      testing::write_bpe_documents(
          *dir_ + "/documents", {"Call me Ishmael. ", "Some years ago, ", "never mind how long. "},
          60) +
      " --eod-mask-loss --reset-position-ids --reset-attention-mask";
  const std::vector<nlohmann::json> single = train(1, docs);
  ASSERT_EQ(single.size(), 5u);
  for (const Layout& l : {Layout{2, 2, 2}, Layout{1, 2, 4}})
    expect_same(train(kWorld, l.args() + " " + docs), single, 0, l.str() + " documents");
}

// Parameter servers as processes: with --max-staleness 0, 4 workers and 4
// servers, 2 workers and 1, and 2 workers of 2 ranks each (pp 2, or tp 2),
// take the single-process steps (the servers
// sum in worker order, as the all-reduce does); with S = 2 each push is an
// update of its own, every step says how long the worker waited and how
// stale its update was, and rank 0 prints the servers' counts.
TEST_F(MpiLayouts, ParameterServersMatchSingleProcessWithoutStaleness) {
  expect_reference(train(kWorld, "--ps-ranks 4"), 0, "4 workers, 4 servers, S = 0");
  expect_reference(train(3, "--ps-ranks 1"), 0, "2 workers, 1 server, S = 0");
  // Workers of several ranks: 2 pipeline stages each, and 2 tensor-parallel ranks each.
  expect_reference(train(6, "--ps-ranks 2 --pp 2"), 0, "2 workers at pp 2, 2 servers, S = 0");
  expect_reference(train(5, "--ps-ranks 1 --tp 2"), 0, "2 workers at tp 2, 1 server, S = 0");
  // The workers evaluate the same parameters as data-parallel replicas.
  const std::string eval = " --split 90,10,0 --eval-interval 5 --eval-iters 2";
  const auto dp = train(2, eval), ps = train(3, "--ps-ranks 1" + eval);
  ASSERT_TRUE(!dp.empty() && !ps.empty() && dp.back().contains("val_loss") &&
              ps.back().contains("val_loss"));
  const double want = dp.back()["val_loss"];
  EXPECT_NEAR(ps.back()["val_loss"].get<double>(), want, 1e-5 * want);
}

TEST_F(MpiLayouts, ParameterServersWithStalenessTrain) {
  const auto stale = train(4, "--ps-ranks 1 --max-staleness 2 --global-batch-size 6", 8);
  const std::string out = read_file(*dir_ + "/out.txt");
  ASSERT_EQ(stale.size(), 8u) << out;
  for (const auto& r : stale) {
    EXPECT_TRUE(r.contains("ps_wait_ms") && r.contains("ps_staleness")) << r.dump();
    EXPECT_TRUE(std::isfinite(r["loss"].get<double>())) << r.dump();
  }
  EXPECT_NE(out.find("staleness of the servers' updates"), std::string::npos) << out;
  EXPECT_NE(out.find("parameter servers: world ranks 3..3 serve 3 workers"), std::string::npos)
      << out;
}

// Compressed reductions change the numbers a little, not the training.
TEST_F(MpiLayouts, CompressedReductionsTrainAlongside) {
  auto bf16 = train(kWorld, "--tp 1 --pp 2 --grad-reduce-dtype bf16");
  ASSERT_EQ(bf16.size(), reference_->size()) << read_file(*dir_ + "/out.txt");
  bool differs = false;
  for (size_t s = 0; s < bf16.size(); ++s) {
    const double want = (*reference_)[s]["loss"], got = bf16[s]["loss"];
    EXPECT_NEAR(got, want, 1e-2 * want) << "bf16, step " << s;
    differs |= got != want;
  }
  EXPECT_TRUE(differs) << "bf16 reduction gave fp32's losses bit for bit: was it used?";
  auto psgd = train(kWorld, "--tp 1 --pp 1 --grad-compression powersgd --powersgd-rank 2");
  ASSERT_EQ(psgd.size(), reference_->size()) << read_file(*dir_ + "/out.txt");
  const double first = psgd.front()["loss"], last = psgd.back()["loss"];
  EXPECT_LT(last, first - 0.3) << "PowerSGD did not train";
  EXPECT_NEAR(last, (*reference_).back()["loss"].get<double>(),
              0.1 * (*reference_).back()["loss"].get<double>());
}

// A vocabulary that tp does not divide trains: --make-vocab-size-divisible-by
// pads to a multiple of N x tp (here 257 to 258 at tp 2, with N = 1), and the
// padded run takes the unpadded single-process steps.
TEST_F(MpiLayouts, VocabularyTpDoesNotDivideIsPadded) {
  const std::string vocab = " --vocab-size 257 --make-vocab-size-divisible-by 1";
  const auto one = train(1, vocab);
  ASSERT_EQ(one.size(), 5u) << read_file(*dir_ + "/out.txt");
  const auto tp2 = train(2, "--tp 2" + vocab);
  const std::string out = read_file(*dir_ + "/out.txt");
  ASSERT_EQ(tp2.size(), 5u) << out;
  EXPECT_NE(out.find("vocabulary 257 padded to 258"), std::string::npos) << out;
  for (size_t s = 0; s < one.size(); ++s)
    for (const char* key : {"loss", "grad_norm"}) {
      const double want = one[s][key];
      EXPECT_NEAR(tp2[s][key].get<double>(), want, 1e-5 * want) << key << " step " << s + 1;
    }
}

// The bytes a load's ranks read and the bytes of the state they hold, from
// train_gpt's line "loaded DIR: the ranks read X of its slices (N bytes, at
// most M on one rank) for W bytes of state".
std::pair<int64_t, int64_t> bytes_loaded(const std::string& out) {
  const std::string mark = " of its slices (";
  const size_t at = out.find(mark);
  if (at == std::string::npos) {
    ADD_FAILURE() << "no load line in: " << out;
    return {-1, -1};
  }
  const int64_t read = std::stoll(out.substr(at + mark.size()));
  const size_t w = out.find(" for ", at);
  return {read, std::stoll(out.substr(w + 5))};
}

TEST_F(MpiLayouts, CheckpointResumesInOtherLayouts) {
  for (const char* optimizer : {"", " --use-distributed-optimizer"}) {
    const std::string ckpt = *dir_ + "/ckpt" + (optimizer[0] ? "-zero" : "");
    auto first = train(kWorld, "--tp 2 --pp 2 --save " + ckpt + optimizer, 2);
    ASSERT_EQ(first.size(), 2u);
    expect_reference(first, 0, std::string("saving at (2, 2, 2)") + optimizer);
    // 8 writers, each with its own two files.
    EXPECT_TRUE(std::filesystem::exists(ckpt + "/iter_0000002/model-00008-of-00008.safetensors"));
    // train_iters counts in total: the resumed runs take steps 3 to 5.
    for (const Layout& l : {Layout{2, 2, 2}, Layout{1, 4, 2}, Layout{8, 1, 1}}) {
      auto rest = train(kWorld, l.args() + " --load " + ckpt + optimizer);
      ASSERT_EQ(rest.size(), 3u);
      expect_reference(rest, 2, "resumed at " + l.str() + optimizer);
      // What the ranks read of the slices, against what they hold. The
      // same tensor-parallel cut: every slice a rank reads is all its own.
      // Only the distributed optimizer at dp 8 needs parts of slices saved
      // at dp 2, and reads those slices whole.
      const auto [read, wanted] = bytes_loaded(read_file(*dir_ + "/out.txt"));
      EXPECT_GT(wanted, 0) << l.str() << optimizer;
      if (optimizer[0] && l.dp == 8)
        EXPECT_GT(read, wanted) << l.str() << optimizer;
      else
        EXPECT_EQ(read, wanted) << l.str() << optimizer;
    }
    auto single = train(1, std::string("--load ") + ckpt);
    expect_reference(single, 2, std::string("resumed on one process from") + optimizer);
    const auto [read, wanted] = bytes_loaded(read_file(*dir_ + "/out.txt"));
    EXPECT_EQ(read, wanted) << "one process" << optimizer;
  }
}

TEST(MpiLayoutErrors, ImpossibleLayoutsFailBeforeCommunicating) {
  const std::string dir = testing::temp_dir("mpi-layout-errors");
  testing::write_file(dir + "/t.txt", std::string(4000, 'a'));
  auto run = [&](const std::string& args) {
    std::string cmd = std::string(std::getenv("WEFT_MPIEXEC")) + " -n 8 " +
                      std::getenv("WEFT_TRAIN_GPT") + " --data-path " + dir + "/t.txt " + args +
                      " >" + dir + "/out.txt 2>&1";
    const int status = std::system(cmd.c_str());
    EXPECT_FALSE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << cmd;
    return read_file(dir + "/out.txt");
  };
  std::string out = run("--model toy --num-attention-heads 6 --hidden-size 48 --tp 4");
  EXPECT_NE(out.find("--num-attention-heads (6) must be divisible by "
                     "--tensor-model-parallel-size (4)"),
            std::string::npos)
      << out;
  // Printed once, by rank 0 (a launcher may add its own lines, e.g. Open MPI's
  // banner about the non-zero exit).
  EXPECT_EQ(testing::count(out, "train_gpt:"), 1) << out;
  out = run("--model toy --tp 2 --micro-batch-size 2 --global-batch-size 4");
  EXPECT_NE(out.find("--global-batch-size (4) must be divisible by --micro-batch-size (2) x dp (4)"),
            std::string::npos)
      << out;
  out = run("--model toy --tp 3");
  EXPECT_NE(out.find("world size (8) must be divisible"), std::string::npos) << out;
  out = run("--model toy --tp 8 --num-attention-heads 8 --seq-length 12 --sequence-parallel");
  EXPECT_NE(out.find("--sequence-parallel splits the sequence across the tensor-parallel ranks: "
                     "--seq-length (12) must be divisible by --tensor-model-parallel-size (8)"),
            std::string::npos)
      << out;
  // Parameter servers: one line each, before any message.
  for (const auto& [args, line] : std::vector<std::pair<std::string, std::string>>{
           {"--ps-ranks 8", "--ps-ranks 8 must be below the world size 8"},
           {"--ps-ranks 2 --tp 4",
            "--ps-ranks 2 leaves 6 worker ranks, which --tp 4 x --pp 1 must divide"},
           {"--ps-ranks 2 --exit-interval 2",
            "--exit-interval is not available with --ps-ranks yet"},
           {"--ps-ranks 2 --use-distributed-optimizer",
            "--use-distributed-optimizer is not available with --ps-ranks yet"},
           {"--ps-ranks 2 --slow-rank 6 --slow-factor 2",
            "--slow-rank 6 is not a worker: the workers are ranks 0..5"},
           {"--ps-ranks 2 --slow-rank 1 --slow-factor 0.5", "--slow-factor (0.5) must be a number > 1"},
           {"--ps-ranks 2 --slow-rank 1", "--slow-rank and --slow-factor go together"},
           {"--ps-ranks 4 --micro-batch-size 2 --global-batch-size 4",
            "--global-batch-size (4) must be divisible by --micro-batch-size (2) x dp (4)"}}) {
    out = run("--model toy " + args);
    EXPECT_NE(out.find(line), std::string::npos) << args << "\n" << out;
    EXPECT_EQ(testing::count(out, "train_gpt:"), 1) << out;
  }
}

}  // namespace
}  // namespace weft
