// A vocabulary table padded past the true vocabulary (Megatron's
// --make-vocab-size-divisible-by; Param::true_rows) trains the unpadded model:
//  - the masking kernels give the padding columns probability and dlogits exactly 0, in
//    the fused softmax and in the vocabulary-parallel steps, a slice of only padding too;
//  - initialisation: the real rows are the unpadded tensor's bits, the padding zero;
//  - AdamW steps with weight decay and clipping, padded against unpadded, GPT (tied) and
//    Llama (untied head) on one process, and GPT at tp 2 on threads with a vocabulary 2
//    does not divide (one padding has rank 1 hold only padding): the same losses,
//    gradient norms and real rows; the padding rows stay exactly zero;
//  - checkpoints hold the true rows only, and load at another padding;
//  - sampling never returns a padding token.
//
// Error model for the comparisons: the two runs compute the same sums, some with extra
// exact zeros (the padding columns) and, at tp 2, split across ranks. Every sum has at
// most a few hundred fp32 terms, 2^-24 sqrt(K) < 1e-6 relative; AdamW's update m / sqrt(v)
// is scale-free, so such differences do not grow over five steps, and 1e-5 holds (the
// PyTorch parity tests' tolerance, for the same kind of difference). The one exception
// is the same as there: GPT's key bias, whose true gradient is zero, holds rounding noise
// that Adam turns into steps of about lr of noisy sign; it is bounded by the steps taken.
#include <gtest/gtest.h>
#include <weft/checkpoint.h>
#include <weft/cpu_kernels.h>
#include <weft/layout.h>
#include <weft/job.h>
#include <weft/local_communicator.h>
#include <weft/ops.h>
#include <weft/runner.h>
#include <weft/safetensors.h>
#include <weft/trainer.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "models/gpt.h"
#include "models/llama.h"
#include "test_util.h"

namespace weft {
namespace {

using testing::rel_error;

constexpr uint64_t kSeed = 11;
constexpr int64_t kV = 61;  // odd: no tensor-parallel size above 1 divides it
constexpr int kSteps = 5;
constexpr float kLr = 3e-3f;
constexpr double kTol = 1e-5;
constexpr float kInf = std::numeric_limits<float>::infinity();

GptConfig gpt(int64_t padded) {
  GptConfig c;
  c.vocab_size = kV, c.padded_vocab_size = padded;
  c.num_layers = 2, c.hidden_size = 32, c.num_heads = 4, c.seq_length = 8;
  return c;
}

LlamaConfig llama(int64_t padded) {
  LlamaConfig c;
  c.vocab_size = kV, c.padded_vocab_size = padded;
  c.num_layers = 2, c.hidden_size = 32, c.num_heads = 4, c.seq_length = 8;
  return c;
}

// Tokens from (step, sequence, position) alone, below the true vocabulary.
class RandomTokens final : public BatchSource {
 public:
  void fill(int64_t step, int64_t index, std::span<const Tensor> io) const override {
    const int64_t count = io[0].dim(0), t = io[0].dim(1);
    auto token = [&](int64_t i, int64_t j) {
      uint64_t x = static_cast<uint64_t>((step * 1000 + index + i) * 100 + j) * 0x9e3779b97f4a7c15ULL;
      x ^= x >> 29;
      return static_cast<int32_t>(x % static_cast<uint64_t>(kV));
    };
    for (int64_t i = 0; i < count; ++i)
      for (int64_t j = 0; j < t; ++j) {
        io[0].data<int32_t>()[i * t + j] = token(i, j);
        io[1].data<int32_t>()[i * t + j] = token(i, j + 1);
      }
  }
};

TrainOptions options() {
  TrainOptions o;
  o.micro_batch = 2, o.global_batch = 4;
  o.lr.lr = kLr;
  o.adam = {0.9f, 0.95f, 1e-8f, 0.1f};  // weight decay on the tables
  o.clip_grad = 0.05;                   // low enough that every step clips
  return o;
}

struct Steps {
  std::vector<double> loss, norm;
};

Steps train(Trainer& t, int steps) {
  Steps s;
  for (int i = 0; i < steps; ++i) {
    const StepRecord r = t.train_step();
    s.loss.push_back(r.loss);
    s.norm.push_back(r.grad_norm);
  }
  return s;
}

void expect_same_steps(const Steps& got, const Steps& want, const std::string& what) {
  ASSERT_EQ(got.loss.size(), want.loss.size()) << what;
  for (size_t i = 0; i < want.loss.size(); ++i) {
    EXPECT_NEAR(got.loss[i], want.loss[i], kTol * want.loss[i]) << what << " step " << i + 1;
    EXPECT_NEAR(got.norm[i], want.norm[i], kTol * want.norm[i]) << what << " step " << i + 1;
  }
  EXPECT_GT(want.norm.front(), options().clip_grad) << "the steps should clip";
}

bool all_zero(const Tensor& t) {
  const float* d = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i)
    if (d[i] != 0.0f) return false;
  return true;
}

// `padded` (a full tensor, padding included) against `want` (no padding):
// the real rows to kTol (the key bias bounded as above), the padding exactly zero.
void expect_real_rows(const Param& p, const Tensor& padded, const Tensor& want) {
  const Tensor real = unpad_rows(p, padded);
  ASSERT_EQ(real.shape(), want.shape()) << p.name;
  if (p.true_rows > 0) {
    EXPECT_TRUE(all_zero(padded.slice0(p.true_rows, padded.dim(0)).clone()))
        << p.name << ": a padding row is not zero";
  }
  if (p.name.find("attn.c_attn.bias") == std::string::npos) {
    EXPECT_LT(rel_error(real.clone(), want), kTol) << p.name;
    return;
  }
  const int64_t c = want.numel() / 3;
  const float* got = real.data<float>();
  const float* ref = want.data<float>();
  EXPECT_LT(rel_error(got, ref, c), kTol) << p.name << " (query)";
  EXPECT_LT(rel_error(got + 2 * c, ref + 2 * c, c), kTol) << p.name << " (value)";
  for (int64_t i = c; i < 2 * c; ++i)
    EXPECT_LE(std::abs(got[i] - ref[i]), 2.0f * kSteps * kLr) << p.name << " (key)";
}

// --- the kernels ---

// Masked columns take probability exactly 0 in the fused softmax, and the loss is the
// softmax over the columns before them.
TEST(VocabPaddingKernels, FusedSoftmaxGivesMaskedColumnsExactZeros) {
  const int64_t n = 3, v = 11, real = 7;
  Tensor logits = testing::uniform_tensor({n, v}, 3, -4, 4);
  Tensor narrow = Tensor::empty({n, real});
  for (int64_t i = 0; i < n; ++i)
    std::copy(logits.data<float>() + i * v, logits.data<float>() + i * v + real,
              narrow.data<float>() + i * real);
  Tensor targets = Tensor::empty({n}, DType::I32);
  for (int64_t i = 0; i < n; ++i) targets.data<int32_t>()[i] = static_cast<int32_t>(2 * i);
  ops::mask_columns(logits, real);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = real; j < v; ++j) ASSERT_EQ(logits.data<float>()[i * v + j], -kInf);
  Tensor losses = Tensor::empty({n}), narrow_losses = Tensor::empty({n});
  const double loss = ops::softmax_cross_entropy(logits, targets, losses);
  const double want = ops::softmax_cross_entropy(narrow, targets, narrow_losses);
  EXPECT_EQ(loss, want) << "the same Eigen sums over the same columns";
  ops::cross_entropy_backward(logits, targets, 0, logits, 0.25f);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = real; j < v; ++j) EXPECT_EQ(logits.data<float>()[i * v + j], 0.0f);
    for (int64_t j = 0; j < real; ++j)
      EXPECT_EQ(logits.data<float>()[i * v + j],
                narrow.data<float>()[i * real + j] * 0.25f - (j == 2 * i ? 0.25f : 0.0f));
  }
}

// The vocabulary-parallel steps on a slice with some padding and on one of only padding
// (its row max is -inf; the all-reduced max of the real slice is what exp uses).
TEST(VocabPaddingKernels, ParallelStepsGiveMaskedColumnsExactZeros) {
  const int64_t n = 2, v = 6;
  for (const int64_t real : {int64_t{4}, int64_t{0}}) {
    Tensor logits = testing::uniform_tensor({n, v}, 5, -3, 3);
    ops::mask_columns(logits, real);
    Tensor max = Tensor::empty({n});
    ops::row_max(logits, max);
    if (real == 0) {
      EXPECT_EQ(max.data<float>()[0], -kInf);
    }
    for (int64_t i = 0; i < n; ++i) max.data<float>()[i] = 3.0f;  // the group's max
    Tensor targets = Tensor::zeros({n}, DType::I32);
    Tensor stats = Tensor::empty({2, n});
    ops::exp_and_stats(logits, targets, 100, max, stats);  // targets held elsewhere
    if (real == 0) {
      EXPECT_EQ(stats.data<float>()[0], 0.0f) << "padding adds nothing to S";
    }
    for (int64_t i = 0; i < n; ++i) stats.data<float>()[i] += 2.0f;  // the group's S
    ops::normalise_and_loss(logits, stats, targets, Tensor::zeros({1}));
    ops::cross_entropy_backward(logits, targets, 100, logits, 1.0f);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = real; j < v; ++j)
        EXPECT_EQ(logits.data<float>()[i * v + j], 0.0f) << "real " << real << " column " << j;
  }
}

// --- initialisation ---

TEST(VocabPadding, RealRowsInitialiseAsUnpaddedAndPaddingIsZero) {
  GptModel plain = build_gpt(gpt(0), 1), padded = build_gpt(gpt(64), 1);
  init_gpt(plain, kSeed);
  init_gpt(padded, kSeed);
  const Param& p = *padded.params->find("wte.weight");
  EXPECT_EQ(p.true_rows, kV);
  EXPECT_EQ(p.value.shape(), (Shape{64, 32}));
  EXPECT_EQ(file_shape(p), (Shape{kV, 32}));
  const Tensor real = unpad_rows(p, p.value);
  const Tensor want = plain.params->find("wte.weight")->value;
  EXPECT_EQ(std::memcmp(real.raw(), want.raw(), want.nbytes()), 0) << "not the same numbers";
  EXPECT_TRUE(all_zero(p.value.slice0(kV, 64).clone()));
  EXPECT_EQ(plain.params->find("wte.weight")->true_rows, 0) << "no padding: every row is real";
  EXPECT_EQ(build_gpt(gpt(kV), 1).params->find("wte.weight")->true_rows, 0);
  EXPECT_TRUE(testing::contains(testing::error_message([] { build_gpt(gpt(60), 1); }),
                                "the padded vocabulary (60) must be between --vocab-size (61)"));
}

// --- training, padded against unpadded ---

TEST(VocabPadding, GptOneProcessTrainsTheUnpaddedModel) {
  RandomTokens data;
  auto run = [&](int64_t padded, GptModel& m) {
    init_gpt(m, kSeed);
    Trainer t(m.io, data, options());
    return train(t, kSteps);
  };
  GptModel plain = build_gpt(gpt(0), 2), padded = build_gpt(gpt(128), 2);
  const Steps want = run(0, plain), got = run(128, padded);
  expect_same_steps(got, want, "gpt padded to 128");
  for (Param* p : padded.graph.params())
    expect_real_rows(*p, p->value, plain.params->find(p->name)->value);
}

TEST(VocabPadding, LlamaOneProcessTrainsTheUnpaddedModel) {
  RandomTokens data;
  auto run = [&](LlamaModel& m) {
    init_llama(m, kSeed);
    Trainer t(m.io, data, options());
    return train(t, kSteps);
  };
  LlamaModel plain = build_llama(llama(0), 2), padded = build_llama(llama(64), 2);
  const Steps want = run(plain), got = run(padded);
  expect_same_steps(got, want, "llama padded to 64");
  EXPECT_EQ(padded.params->find("lm_head.weight")->true_rows, kV) << "the untied head";
  for (Param* p : padded.graph.params())
    expect_real_rows(*p, p->value, plain.params->find(p->name)->value);
}

// tp 2 on threads: 61 rows do not split in two; 64 (rank 1 holds 29 real rows and 3 of
// padding) and 128 (rank 1 holds only padding) do.
class VocabPaddingTp : public ::testing::TestWithParam<int64_t> {};

TEST_P(VocabPaddingTp, GptTp2MatchesUnpaddedOneProcess) {
  const int64_t rows = GetParam();
  RandomTokens data;
  GptModel plain = build_gpt(gpt(0), 2);
  init_gpt(plain, kSeed);
  Trainer single(plain.io, data, options());
  const Steps want = train(single, kSteps);

  struct Rank {
    Steps steps;
    std::map<std::string, Tensor> values;  // this rank's pieces, copied
  };
  std::vector<Rank> ranks(2);
  std::map<std::string, Param> layout;  // name -> shard and padding (rank 0's)
  run_local(2, [&](Communicator& world) {
    GptModel m = build_gpt(gpt(rows), 2);
    LayoutOptions lo;
    lo.tp = 2;
    RankLayout rank(&world, m.graph, m.io, data, options(), lo, kSeed);
    Rank& r = ranks[static_cast<size_t>(world.rank())];
    r.steps = train(rank.trainer(), kSteps);
    for (Param* p : rank.graph().params()) {
      r.values[p->name] = p->value.clone();
      if (world.rank() == 0) {
        Param copy;
        copy.name = p->name, copy.shard = p->shard, copy.true_rows = p->true_rows;
        layout[p->name] = copy;
      }
    }
  });
  for (int r = 0; r < 2; ++r)
    expect_same_steps(ranks[static_cast<size_t>(r)].steps, want,
                      "tp 2, " + std::to_string(rows) + " rows, rank " + std::to_string(r));
  ASSERT_EQ(layout.size(), plain.params->size());
  EXPECT_EQ(layout.at("wte.weight").shard.full, (Shape{rows, 32}));
  EXPECT_EQ(layout.at("wte.weight").true_rows, kV);
  for (const auto& [name, p] : layout) {
    Tensor full = Tensor::zeros(p.shard.full);
    if (p.shard.split()) {
      for (int r = 0; r < 2; ++r) {
        Shard s = p.shard;
        s.index = r;
        place_shard(ranks[static_cast<size_t>(r)].values.at(name), s, full);
      }
    } else {
      full.copy_from(ranks[0].values.at(name));
    }
    expect_real_rows(p, full, plain.params->find(name)->value);
  }
}

INSTANTIATE_TEST_SUITE_P(Rows, VocabPaddingTp, ::testing::Values(64, 128));

// --- checkpoints ---

// A checkpoint of a run padded to 64 holds 61 rows of wte and of its moments; it loads
// into a model padded to 128 and into one without padding, and both continue alike.
TEST(VocabPadding, CheckpointHoldsTrueRowsAndLoadsAtAnotherPadding) {
  RandomTokens data;
  const std::string dir = testing::temp_dir("vocab_padding_ckpt");
  {
    GptModel m = build_gpt(gpt(64), 2);
    init_gpt(m, kSeed);
    Trainer t(m.io, data, options());
    train(t, 2);
    t.save(dir, 0);
  }
  const Checkpoint c = open_checkpoint(dir);
  using Part = Checkpoint::Part;
  auto shape_of = [&](Part part, const std::string& name) {
    for (const auto& [n, shape] : c.tensors(part))
      if (n == name) return shape;
    return Shape{};
  };
  EXPECT_EQ(shape_of(Part::Model, "wte.weight"), (Shape{kV, 32}));
  EXPECT_EQ(shape_of(Part::Optimizer, "wte.weight.exp_avg"), (Shape{kV, 32}));
  EXPECT_EQ(shape_of(Part::Optimizer, "wte.weight.exp_avg_sq"), (Shape{kV, 32}));
  const Tensor saved_wte = c.read_whole(Part::Model, "wte.weight");

  std::vector<Steps> after;
  std::vector<Tensor> wte;
  for (const int64_t rows : {int64_t{128}, int64_t{0}}) {
    GptModel m = build_gpt(gpt(rows), 2);
    init_gpt(m, kSeed + 1);  // overwritten by the load
    Trainer t(m.io, data, options());
    t.load(dir);
    const Param& p = *m.params->find("wte.weight");
    EXPECT_EQ(std::memcmp(unpad_rows(p, p.value).raw(), saved_wte.raw(),
                          static_cast<size_t>(kV * 32 * 4)),
              0)
        << rows << " rows: the loaded real rows are the file's";
    if (rows > 0) {
      EXPECT_TRUE(all_zero(p.value.slice0(kV, rows).clone()));
    }
    after.push_back(train(t, 3));
    wte.push_back(unpad_rows(p, p.value).clone());
  }
  expect_same_steps(after[0], after[1], "resumed at 128 rows against no padding");
  EXPECT_LT(rel_error(wte[0], wte[1]), kTol);

  // A file of the padded shape is not a checkpoint of this model: named with both shapes.
  GptModel m = build_gpt(gpt(64), 2);
  const std::string bad = dir + "/padded.safetensors";
  safetensors::save(bad, {{"wte.weight", Tensor::zeros({64, 32})}});
  const std::string msg = testing::error_message([&] {
    load_weights(bad, {m.params->find("wte.weight")});
  });
  EXPECT_TRUE(testing::contains(msg, "has shape [64, 32] but the model expects [61, 32] (padded "
                                     "to [64, 32] in memory)"))
      << msg;
}

// --- sampling ---

// ln_f's weight 0 and bias 1 make every position's features all ones, and real rows of
// -0.5 make every real logit -16: below the padding rows' 0, were they not masked.
TEST(VocabPadding, SamplingNeverReturnsAPaddingToken) {
  ModelArgs args;
  args.shape = gpt(64);
  JobModel m = gpt_family().build(args);
  m.io.graph = &m.graph;
  for (Param* p : m.params->all()) init_param(*p, kSeed);
  Param& wte = *m.params->find("wte.weight");
  for (int64_t i = 0; i < kV * 32; ++i) wte.value.data<float>()[i] = -0.5f;
  m.params->find("ln_f.weight")->value.zero_();
  for (int64_t i = 0; i < 32; ++i) m.params->find("ln_f.bias")->value.data<float>()[i] = 1.0f;
  for (const float temperature : {0.0f, 1.0f, 100.0f}) {
    const std::vector<int32_t> out = sample_tokens(m, args.shape, {1, 2, 3}, 40, temperature, 9);
    ASSERT_EQ(out.size(), 40u);
    for (int32_t t : out) EXPECT_LT(t, kV) << "temperature " << temperature;
  }
}

// A model samples through a decode hook of its own (here reading the same
// head's kept logits, so the tokens must be the head's), and a family with
// neither a head nor a hook is refused --sample before step 1.
TEST(Sampling, ThroughAModelsOwnDecodeHookAndRefusedWithoutOne) {
  ModelArgs args;
  args.shape = gpt(64);
  JobModel by_head = gpt_family().build(args), by_hook = gpt_family().build(args);
  for (JobModel* m : {&by_head, &by_hook}) {
    m->io.graph = &m->graph;
    for (Param* p : m->params->all()) init_param(*p, kSeed);
  }
  TiedLmHeadLoss* head = by_hook.head;
  const int64_t stride = args.shape.table_rows();
  by_hook.head = nullptr;
  by_hook.decode_node = static_cast<int>(by_hook.graph.nodes().size()) - 1;
  head->set_keep_logits(true);
  int calls = 0;
  by_hook.decode = [&](MicroBatch& mb, int64_t t) {
    ++calls;
    return TiedLmHeadLoss::logits(mb.ctx(by_hook.decode_node)).data<float>() + t * stride;
  };
  for (const float temperature : {0.0f, 1.0f}) {
    const std::vector<int32_t> want =
        sample_tokens(by_head, args.shape, {1, 2, 3}, 12, temperature, 9);
    EXPECT_EQ(sample_tokens(by_hook, args.shape, {1, 2, 3}, 12, temperature, 9), want);
  }
  EXPECT_EQ(calls, 24);
  by_hook.decode = nullptr;
  EXPECT_TRUE(testing::contains(
      testing::error_message([&] { sample_tokens(by_hook, args.shape, {1}, 2, 0.0f, 9); }),
      "has neither"));

  // train_main with a family that has neither: refused before any step.
  const std::string dir = testing::temp_dir("decode-hook");
  testing::write_file(dir + "/t.txt", testing::best_of_times(20));
  Job job;
  job.program = "headless";
  ModelFamily f = gpt_family();
  f.name = "headless";
  const auto build = f.build;
  f.build = [build](const ModelArgs& a) {
    JobModel m = build(a);
    m.head = nullptr;
    return m;
  };
  job.families = {f};
  const std::string data = dir + "/t.txt";
  std::vector<std::string> args_s = {
      "headless", "--num-layers", "1",  "--hidden-size",      "32", "--num-attention-heads",
      "4",        "--seq-length", "16", "--micro-batch-size", "2",  "--train-iters",
      "3",        "--data-path",  data, "--sample",           "5",  "--device",
      "cpu"};
  std::vector<char*> argv;
  for (std::string& s : args_s) argv.push_back(s.data());
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  const int rc = train_main(static_cast<int>(argv.size()), argv.data(), job);
  const std::string out = ::testing::internal::GetCapturedStdout();
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(rc, 1) << out << err;
  EXPECT_TRUE(testing::contains(err, "--sample 5: the headless family's model has no LM head"))
      << err;
  EXPECT_FALSE(testing::contains(out, "step     1/")) << out;  // no step ran
}

}  // namespace
}  // namespace weft
