// The training loop: accumulation, resume, divergence, the LR schedule, and
// a steady-state step that allocates nothing.
#include <weft/checkpoint.h>
#include <weft/cpu_kernels.h>
#include <weft/layout.h>
#include <weft/local_communicator.h>
#include <weft/ops.h>
#include <weft/threads.h>
#include <weft/trainer.h>

#include <gtest/gtest.h>

#include "models/gpt.h"
#include "layers/linear.h"
#include "models/mlp.h"
#include "test_util.h"

#include <weft/runner.h>

#include <atomic>
#include <mutex>
#include <tuple>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <new>

#include <dlfcn.h>

// GCC inlines the replaced operators into library code and then mistakes the
// malloc/free pair for a mismatch.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"

// Counts every operator new in this binary, so a test can prove that a
// training step allocates nothing once it has run once. oneDNN's sgemm makes
// one small allocation of its own inside each call (its threading's state),
// with no way to hand it a buffer: those are counted apart, by the library
// the caller's code lies in, so that weft's own allocations are still all
// counted under either GEMM library.
static std::atomic<long> g_allocations{0}, g_gemm_library_allocations{0};
static bool called_from_onednn(void* caller) {
  Dl_info info;
  return dladdr(caller, &info) != 0 && info.dli_fname != nullptr &&
         std::strstr(info.dli_fname, "libdnnl") != nullptr;
}
void* operator new(std::size_t n) {
  (called_from_onednn(__builtin_return_address(0)) ? g_gemm_library_allocations : g_allocations)
      .fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

namespace weft {
namespace {

TokenData text_data() {
  std::string text;
  for (int i = 0; i < 200; ++i) text += "the quick brown fox jumps over the lazy dog. ";
  std::vector<int32_t> t(text.begin(), text.end());
  return TokenData::from_tokens(std::move(t), 256);
}

GptConfig small_config() {
  GptConfig c;
  c.vocab_size = 256, c.num_layers = 2, c.hidden_size = 32, c.num_heads = 4, c.seq_length = 16;
  return c;
}

TrainOptions train_options(int64_t micro, int64_t global) {
  TrainOptions o;
  o.micro_batch = micro;
  o.global_batch = global;
  o.lr.lr = 1e-2f;
  o.adam.weight_decay = 0.1f;
  o.clip_grad = 1.0;
  return o;
}

// One micro-batch of 4 and four micro-batches of 1 compute the same gradient.
TEST(Train, AccumulationMatchesOneBigMicroBatch) {
  TokenData data = text_data();
  TokenBatches batches(data, 4, small_config().seq_length);
  GptModel a = build_gpt(small_config(), 4);
  GptModel b = build_gpt(small_config(), 1);
  init_gpt(a, 7);
  init_gpt(b, 7);
  Trainer ta(a.io, batches, train_options(4, 4));
  Trainer tb(b.io, batches, train_options(1, 4));
  for (int s = 0; s < 3; ++s) {
    StepRecord ra = ta.train_step();
    StepRecord rb = tb.train_step();
    EXPECT_NEAR(ra.loss, rb.loss, 1e-5 * ra.loss) << "step " << s;
    EXPECT_NEAR(ra.grad_norm, rb.grad_norm, 1e-4 * ra.grad_norm) << "step " << s;
  }
  // The attention key bias has a true gradient of zero, so Adam turns
  // rounding noise into its updates (see test_parity): compare everything else.
  auto pa = a.graph.params(), pb = b.graph.params();
  for (size_t i = 0; i < pa.size(); ++i) {
    if (pa[i]->name.find("c_attn.bias") != std::string::npos) continue;
    EXPECT_LT(testing::rel_error(pa[i]->value, pb[i]->value), 1e-4) << pa[i]->name;
  }
}

TEST(Train, LossFallsOnRepetitiveText) {
  TokenData data = text_data();
  TokenBatches batches(data, 4, small_config().seq_length);
  GptModel m = build_gpt(small_config(), 2);
  init_gpt(m, 1);
  Trainer t(m.io, batches, train_options(2, 4));
  const double first = t.train_step().loss;
  double last = first;
  for (int s = 0; s < 30; ++s) last = t.train_step().loss;
  EXPECT_NEAR(first, std::log(256.0), 0.1);  // a fresh model is near uniform
  EXPECT_LT(last, 0.6 * first);
}

// Save after 3 steps, resume in a fresh process-like setup, and the next
// losses equal the uninterrupted run's exactly.
TEST(Train, ResumeReproducesUninterruptedLossesExactly) {
  TokenData data = text_data();
  TokenBatches batches(data, 4, small_config().seq_length);
  const std::string dir = testing::temp_dir("resume");
  std::vector<double> straight, resumed;
  {
    GptModel m = build_gpt(small_config(), 2);
    init_gpt(m, 3);
    Trainer t(m.io, batches, train_options(2, 4));
    for (int s = 0; s < 6; ++s) {
      straight.push_back(t.train_step().loss);
      if (s == 2) t.save(dir);
    }
  }
  {
    GptModel m = build_gpt(small_config(), 2);
    init_gpt(m, 99);  // overwritten by the checkpoint
    Trainer t(m.io, batches, train_options(2, 4));
    t.load(dir);
    EXPECT_EQ(t.steps_done(), 3);
    EXPECT_EQ(t.grad_sync().steps(), 3);
    for (int s = 3; s < 6; ++s) resumed.push_back(t.train_step().loss);
  }
  for (int s = 0; s < 3; ++s) EXPECT_EQ(resumed[static_cast<size_t>(s)], straight[static_cast<size_t>(s + 3)]);
  // Written atomically: the final folder and pointer, no temporaries.
  for (const auto& e : std::filesystem::directory_iterator(dir))
    EXPECT_EQ(e.path().string().find(".tmp"), std::string::npos) << e.path();
  EXPECT_TRUE(std::filesystem::exists(dir + "/iter_0000003/model-00001-of-00001.safetensors"));
  EXPECT_EQ(testing::read_file(dir + "/latest_checkpointed_iteration.txt"), "3\n");
}

TEST(Train, CheckpointOfAnotherShapeIsRefusedNamingTheTensor) {
  TokenData data = text_data();
  TokenBatches batches(data, 2, small_config().seq_length);
  const std::string dir = testing::temp_dir("shape");
  {
    GptModel m = build_gpt(small_config(), 2);
    Trainer t(m.io, batches, train_options(2, 2));
    t.save(dir);
  }
  GptConfig wider = small_config();
  wider.hidden_size = 64;
  GptModel m = build_gpt(wider, 2);
  Trainer t(m.io, batches, train_options(2, 2));
  try {
    t.load(dir);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("wte.weight"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("[256, 32]"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("[256, 64]"), std::string::npos) << e.what();
  }
}

TEST(Train, NonFiniteLossStopsNamingTheStep) {
  TokenData data = text_data();
  TokenBatches batches(data, 2, small_config().seq_length);
  GptModel m = build_gpt(small_config(), 2);
  init_gpt(m, 1);
  Trainer t(m.io, batches, train_options(2, 2));
  t.train_step();
  t.train_step();
  m.params->find("h.1.mlp.c_fc.weight")->value.data<float>()[5] = NAN;
  try {
    t.train_step();
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("step 3"), std::string::npos) << e.what();
  }
}

// Megatron's --check-for-spiky-loss: the windows of the steps in `spikes` are
// random bytes, which a model trained on repetitive text predicts badly.
TokenData spiky_data(std::initializer_list<int64_t> spikes, int64_t global, int64_t t) {
  std::string text;
  for (int i = 0; i < 200; ++i) text += "the quick brown fox jumps over the lazy dog. ";
  std::vector<int32_t> tokens(text.begin(), text.end());
  uint32_t x = 12345;
  for (int64_t s : spikes)
    for (int64_t i = s * global * t; i <= (s + 1) * global * t; ++i) {
      x = x * 1664525u + 1013904223u;
      tokens[static_cast<size_t>(i)] = static_cast<int32_t>(x >> 24);
    }
  return TokenData::from_tokens(std::move(tokens), 256);
}

TEST(Train, ALossSpikeSkipsItsUpdateAndTooManyStopTheRun) {
  const int64_t spike = 20, global = 4, t = small_config().seq_length;
  TokenData data = spiky_data({spike, spike + 4}, global, t);
  TokenBatches batches(data, global, t);
  GptModel m = build_gpt(small_config(), 2);
  init_gpt(m, 1);
  TrainOptions o = train_options(2, global);
  o.spike.enabled = true;
  o.spike.factor = 1.5;  // this text's losses fall smoothly; random bytes cost several times more
  o.spike.max_skipped = 1;
  Trainer trainer(m.io, batches, o);
  for (int64_t s = 0; s < spike; ++s) ASSERT_FALSE(trainer.train_step().skipped) << "step " << s;
  std::vector<Tensor> before;
  for (Param* p : m.graph.params()) before.push_back(p->value.clone());
  const StepRecord r = trainer.train_step();
  EXPECT_TRUE(r.skipped);
  EXPECT_GT(r.loss, 1.5 * r.spike_mean);
  EXPECT_EQ(r.json().value("skipped", false), true);
  EXPECT_TRUE(testing::contains(r.line(100), "skipped: a loss spike")) << r.line(100);
  // Nothing moved: the spike's gradients were dropped.
  for (size_t i = 0; i < before.size(); ++i)
    EXPECT_EQ(std::memcmp(before[i].raw(), m.graph.params()[i]->value.raw(), before[i].nbytes()), 0)
        << m.graph.params()[i]->name;
  EXPECT_EQ(trainer.steps_done(), spike + 1);  // its data is consumed
  for (int64_t s = spike + 1; s < spike + 4; ++s) EXPECT_FALSE(trainer.train_step().skipped);
  // The second spike is one more than --max-skipped-steps 1 allows.
  const std::string msg = testing::error_message([&] { trainer.train_step(); });
  EXPECT_TRUE(testing::contains(msg, "step 25: loss") &&
              testing::contains(msg, "more than --max-skipped-steps 1: training stopped"))
      << msg;

  // The same data without the check: the spike is applied.
  GptModel plain = build_gpt(small_config(), 2);
  init_gpt(plain, 1);
  Trainer unchecked(plain.io, batches, train_options(2, global));
  for (int64_t s = 0; s <= spike; ++s) EXPECT_FALSE(unchecked.train_step().skipped);
}

// The check's state travels with a checkpoint: a run resumed just before a
// spike skips it as the uninterrupted run does.
TEST(Train, TheLossSpikeStateResumes) {
  const int64_t spike = 14, global = 4, t = small_config().seq_length;
  TokenData data = spiky_data({spike}, global, t);
  TokenBatches batches(data, global, t);
  TrainOptions o = train_options(2, global);
  o.spike.enabled = true;
  o.spike.factor = 1.5;
  // (Each model built in place: its ModelIO points at its graph.)
  GptModel whole_model = build_gpt(small_config(), 2), first_model = build_gpt(small_config(), 2),
           second_model = build_gpt(small_config(), 2);
  for (GptModel* m : {&whole_model, &first_model, &second_model}) init_gpt(*m, 1);
  Trainer whole(whole_model.io, batches, o);
  std::vector<StepRecord> want;
  for (int s = 0; s < spike + 2; ++s) want.push_back(whole.train_step());
  ASSERT_TRUE(want[spike].skipped);

  const std::string dir = testing::temp_dir("spike-resume");
  Trainer first(first_model.io, batches, o);
  for (int s = 0; s < spike - 1; ++s) first.train_step();
  first.save(dir);
  Trainer second(second_model.io, batches, o);
  second.load(dir);
  for (int s = spike - 1; s < spike + 2; ++s) {
    const StepRecord r = second.train_step();
    EXPECT_EQ(r.skipped, want[static_cast<size_t>(s)].skipped) << "step " << s;
    EXPECT_EQ(r.loss, want[static_cast<size_t>(s)].loss) << "step " << s;
  }
}

TEST(Train, SteadyStateStepAllocatesNothing) {
  // In fp32, and with the CPU's bf16 and fp16 GEMMs (their rounded operand
  // copies are per-thread scratch that stays) and fp16's loss scale.
  struct Restore {
    ~Restore() { ops::set_matmul_precision(Device::cpu(), ops::MatmulPrecision::Fp32); }
  } restore;
  for (ops::MatmulPrecision p : {ops::MatmulPrecision::Fp32, ops::MatmulPrecision::Bf16,
                                 ops::MatmulPrecision::Fp16}) {
    ops::set_matmul_precision(Device::cpu(), p);
    TokenData data = text_data();
    TokenBatches batches(data, 4, small_config().seq_length);
    GptModel m = build_gpt(small_config(), 2);
    init_gpt(m, 1);
    TrainOptions o = train_options(2, 4);
    o.loss_scale.enabled = p == ops::MatmulPrecision::Fp16;
    o.loss_scale.initial = 1024;
    Trainer t(m.io, batches, o);
    t.train_step();  // plans the arena
    t.train_step();
    const size_t arena_allocs = t.pipeline().arena_allocations();
    const long before = g_allocations.load(), library_before = g_gemm_library_allocations.load();
    t.train_step();
    t.train_step();
    const std::string what = ops::matmul_precision_name(p);
    EXPECT_EQ(g_allocations.load() - before, 0) << what;
    if (cpu::gemm_library() == cpu::GemmLibrary::OpenBlas) {
      EXPECT_EQ(g_gemm_library_allocations.load() - library_before, 0) << what;
    }
    EXPECT_EQ(t.pipeline().arena_allocations(), arena_allocs) << what;
    EXPECT_LE(arena_allocs, 3u) << what;
  }
}

// Documents: the positions input, the masked targets and the step's count
// of terms (read from the whole global batch) reuse their buffers.
TEST(Train, SteadyStateStepWithDocumentsAllocatesNothing) {
  TokenData data = text_data();
  TokenBatches batches(data, 4, small_config().seq_length);
  DocumentOptions docs;
  docs.eod = ' ';
  docs.eod_mask_loss = docs.reset_position_ids = docs.reset_attention_mask = true;
  batches.set_documents(docs);
  GptConfig cfg = small_config();
  cfg.reset_position_ids = cfg.reset_attention_mask = true;
  GptModel m = build_gpt(cfg, 2);
  init_gpt(m, 1);
  Trainer t(m.io, batches, train_options(2, 4));
  t.train_step();
  t.train_step();
  const long before = g_allocations.load();
  t.train_step();
  t.train_step();
  EXPECT_EQ(g_allocations.load() - before, 0);
}

// --bf16 on the CPU with oneDNN's bf16 matmul (where the CPU has AVX-512
// BF16 or AMX) trains as the emulation does: the same rounded operands, the
// sums in another order. The first step's loss (a forward pass before any
// update) agrees to the GEMMs' bound: sums of k <= 128 terms, (k + 2) 2^-24
// relative each, through 2 blocks and the head: well under 1e-4 of a loss
// near ln(256). Later steps move apart only as far as Adam lets rounding
// noise move a weight (lr 1e-2 a step at most, where a gradient is near 0):
// the loss after three steps within 1e-2.
TEST(Train, Bf16OnOneDnnTrainsAsTheEmulation) {
  if (!cpu::bf16_gemm_runs()) GTEST_SKIP() << "no oneDNN, or a CPU without AVX-512 BF16 or AMX";
  struct Restore {
    cpu::Bf16Gemm saved = cpu::bf16_gemm();
    ~Restore() {
      cpu::set_bf16_gemm(saved);
      ops::set_matmul_precision(Device::cpu(), ops::MatmulPrecision::Fp32);
    }
  } restore;
  ops::set_matmul_precision(Device::cpu(), ops::MatmulPrecision::Bf16);
  std::vector<std::vector<double>> losses;
  std::vector<int64_t> gemms_widened;
  for (cpu::Bf16Gemm how : {cpu::Bf16Gemm::Emulated, cpu::Bf16Gemm::OneDnn}) {
    cpu::set_bf16_gemm(how);
    ops::reset_widened_ops();
    TokenData data = text_data();
    TokenBatches batches(data, 4, small_config().seq_length);
    GptModel m = build_gpt(small_config(), 2);
    init_gpt(m, 1);
    m.graph.set_activation_dtype(DType::BF16);
    Trainer t(m.io, batches, train_options(2, 4));
    losses.emplace_back();
    for (int s = 0; s < 4; ++s) losses.back().push_back(t.train_step().loss);
    const auto widened = ops::widened_ops();
    gemms_widened.push_back(widened.count("gemm") ? widened.at("gemm") : 0);
  }
  EXPECT_NEAR(losses[0][0], losses[1][0], 1e-4);
  EXPECT_NEAR(losses[0][3], losses[1][3], 1e-2);
  EXPECT_LT(losses[1][3], losses[1][0]);  // and it trains
  // Which path ran: both widen a GEMM's bf16 output, but only the emulation
  // widens its bf16 operands; oneDNN's matmul reads them as they are. (The
  // losses may agree bit for bit: sums of a few products of bf16 values are
  // often exact in fp32, in any order.)
  EXPECT_LT(gemms_widened[1], gemms_widened[0]);
}

TEST(Train, LearningRateSchedule) {
  LrSchedule s;
  s.lr = 1.0f;
  s.min_lr = 0.1f;
  s.warmup_iters = 4;
  s.decay = LrDecay::Cosine;
  s.decay_iters = 14;
  EXPECT_FLOAT_EQ(s.at(0), 0.25f);
  EXPECT_FLOAT_EQ(s.at(3), 1.0f);
  EXPECT_FLOAT_EQ(s.at(4), 1.0f);           // decay starts at the peak
  EXPECT_NEAR(s.at(9), 0.55f, 1e-6);        // halfway: (1 + 0.1) / 2
  EXPECT_FLOAT_EQ(s.at(14), 0.1f);
  EXPECT_FLOAT_EQ(s.at(100), 0.1f);
  s.decay = LrDecay::Constant;
  EXPECT_FLOAT_EQ(s.at(9), 1.0f);
}

TEST(Train, ClippingScalesToTheMaxNorm) {
  ParamStore ps;
  Param* a = ps.create("a", {3}, Init::constant(0));
  Param* b = ps.create("b", {2, 2}, Init::constant(0));
  float* ga = a->grad.data<float>();
  ga[0] = 3, ga[1] = 0, ga[2] = 0;
  for (int i = 0; i < 4; ++i) b->grad.data<float>()[i] = 2;  // norm 4
  std::vector<Param*> ps_all = {a, b};
  GradTables tables;
  const double norm = grad_norm(ps_all, tables);
  EXPECT_DOUBLE_EQ(norm, 5.0);
  clip_grads(ps_all, 1.0, norm, tables);
  EXPECT_NEAR(grad_norm(ps_all, tables), 1.0, 1e-6);
  clip_grads(ps_all, 10.0, 1.0, tables);  // below the limit: untouched
  EXPECT_NEAR(grad_norm(ps_all, tables), 1.0, 1e-6);
}

// An optimizer step with a clip's coefficient is clip_grads, then the step,
// bit for bit, for both optimizers; AdamW leaves the gradients unscaled.
TEST(Train, AStepWithAClipCoefficientIsClipThenStep) {
  for (const OptimizerKind kind : {OptimizerKind::Adam, OptimizerKind::Sgd, OptimizerKind::Lion}) {
    ParamStore s1, s2;
    std::vector<Param*> p1, p2;
    for (ParamStore* s : {&s1, &s2}) {
      std::vector<Param*>& ps = s == &s1 ? p1 : p2;
      ps.push_back(s->create("w", {5, 3}, Init::normal(1.0f)));
      ps.push_back(s->create("b", {3}, Init::normal(1.0f)));
      for (Param* p : ps) {
        init_param(*p, 11);
        const std::vector<float> g = testing::uniform(p->grad.numel(), 12, -3.0f, 3.0f);
        std::copy(g.begin(), g.end(), p->grad.data<float>());
      }
    }
    auto make = [&](const std::vector<Param*>& ps) -> std::unique_ptr<Optimizer> {
      if (kind == OptimizerKind::Adam) return std::make_unique<AdamW>(ps, AdamWConfig{});
      if (kind == OptimizerKind::Lion)
        return std::make_unique<Optimizer>(ps, make_lion_rule({0.9f, 0.99f, 0.1f}));
      return std::make_unique<Sgd>(ps, SgdConfig{0.9f, 0.1f});
    };
    auto o1 = make(p1), o2 = make(p2);
    GradTables tables;
    const double norm = grad_norm(p1, tables);
    const float coef = clip_coefficient(1.0, norm);
    ASSERT_LT(coef, 1.0f);
    EXPECT_EQ(clip_coefficient(1.0, 0.5), 1.0f);
    EXPECT_EQ(clip_coefficient(0.0, norm), 1.0f);  // clipping off
    clip_grads(p1, 1.0, norm, tables);
    o1->step(1e-2f);
    o2->step(1e-2f, coef);
    for (size_t k = 0; k < p1.size(); ++k)
      EXPECT_EQ(0, std::memcmp(p1[k]->value.raw(), p2[k]->value.raw(), p1[k]->value.nbytes()))
          << optimizer_name(kind) << " " << p1[k]->name;
    if (kind != OptimizerKind::Sgd) {
      EXPECT_NEAR(grad_norm(p2, tables), norm, 1e-9 * norm)
          << optimizer_name(kind) << " scaled the gradients";
    }
  }
}

// Lion's update against its formula in double (Chen et al. 2023): decoupled
// decay on the matrix only, the sign of b1 m + (1 - b1) g (0 where that is
// 0: an element with no gradient and no momentum moves by its decay alone),
// then the momentum b2 m + (1 - b2) g; the gradient read times the clip's
// coefficient. Each float operation rounds once, so every value is within a
// few ulps of the double formula: 1e-6 relative, or 1e-9 absolute near 0.
TEST(Train, LionStepIsItsFormula) {
  ParamStore store;
  std::vector<Param*> ps = {store.create("w", {4, 8}, Init::normal(1.0f)),
                            store.create("b", {8}, Init::normal(1.0f))};
  const float lr = 1e-2f, b1 = 0.9f, b2 = 0.99f, wd = 0.1f, scale = 0.5f;
  Optimizer opt(ps, make_lion_rule({b1, b2, wd}));
  std::vector<std::vector<double>> p0, g0, m0;
  for (Param* p : ps) {
    init_param(*p, 3);
    const std::vector<float> g = testing::uniform(p->grad.numel(), 4, -1.0f, 1.0f);
    std::copy(g.begin(), g.end(), p->grad.data<float>());
    p->grad.data<float>()[0] = 0.0f;  // with no momentum yet: c = 0
    p0.emplace_back(p->value.data<float>(), p->value.data<float>() + p->value.numel());
    g0.emplace_back(p->grad.data<float>(), p->grad.data<float>() + p->grad.numel());
    m0.emplace_back(p->value.numel(), 0.0);
  }
  for (int step = 0; step < 2; ++step) {
    opt.step(lr, scale);
    for (size_t k = 0; k < ps.size(); ++k) {
      const bool decay = ps[k]->weight_decay();
      EXPECT_EQ(decay, k == 0) << "decay on the matrix only";
      for (int64_t i = 0; i < ps[k]->value.numel(); ++i) {
        const size_t u = static_cast<size_t>(i);
        const double g = g0[k][u] * scale;
        const double c = b1 * m0[k][u] + (1.0 - b1) * g;
        const double sign = c > 0 ? 1.0 : c < 0 ? -1.0 : 0.0;
        p0[k][u] = p0[k][u] * (1.0 - (decay ? lr * wd : 0.0)) - lr * sign;
        m0[k][u] = b2 * m0[k][u] + (1.0 - b2) * g;
        EXPECT_NEAR(ps[k]->value.data<float>()[i], p0[k][u], 1e-6 * std::abs(p0[k][u]) + 1e-9)
            << ps[k]->name << "[" << i << "] step " << step + 1;
      }
    }
    const auto state = opt.state();
    ASSERT_EQ(state.size(), 2u);
    EXPECT_EQ(state[0].first, "w.exp_avg");
    for (int64_t i = 0; i < ps[0]->value.numel(); ++i)
      EXPECT_NEAR(state[0].second.data<float>()[i], m0[0][static_cast<size_t>(i)],
                  1e-6 * std::abs(m0[0][static_cast<size_t>(i)]) + 1e-9);
  }
  // The element whose gradient is 0 moved by its decay alone at step 1 and
  // kept its bias value exactly (no decay on vectors).
  EXPECT_EQ(ps[1]->value.data<float>()[0], static_cast<float>(p0[1][0]));
}

// The MLP model trains through the same runner with its own loss.
TEST(Train, MlpFitsALinearMap) {
  MlpModel m = build_mlp({4, 16, 2}, 8);
  for (Param* p : m.params->all()) init_param(*p, 5);
  AdamW opt(m.graph.params(), AdamWConfig{});
  MicroBatch mb(m.graph);
  const int n = static_cast<int>(m.graph.nodes().size());
  double first = 0, last = 0;
  for (int step = 0; step < 300; ++step) {
    Tensor x = mb.input(m.input), y = mb.input(m.target);
    auto u = testing::uniform(32, static_cast<uint64_t>(step));
    for (int i = 0; i < 8; ++i) {
      float* xi = x.data<float>() + i * 4;
      for (int j = 0; j < 4; ++j) xi[j] = u[static_cast<size_t>(i * 4 + j)];
      y.data<float>()[i * 2] = xi[0] - 2 * xi[1];
      y.data<float>()[i * 2 + 1] = 0.5f * xi[2] + xi[3];
    }
    zero_grads(m.graph.params());
    forward(m.graph, mb, 0, n);
    const double loss = mb.value(m.loss).data<float>()[0] / 16.0;
    if (step == 0) first = loss;
    last = loss;
    mb.seed_grad(m.loss, 1.0f / 16.0f);
    backward(m.graph, mb, 0, n);
    opt.step(1e-2f);
    mb.reset();
  }
  EXPECT_LT(last, 0.05 * first);
}


// --- the model API: any graph whose output is a loss, with inputs of any dtype ---

using testing::contains;
using testing::error_message;

// Float features and regression targets: sample i of the data is
// x = sin(0.37 i + 1.3 j), y = (x0 - 2 x1, 0.5 x2 + x3).
class RegressionBatches final : public BatchSource {
 public:
  explicit RegressionBatches(int64_t global) : global_(global) {}
  void fill(int64_t step, int64_t index, std::span<const Tensor> in) const override {
    const int64_t count = in[0].dim(0), width = in[0].dim(1);
    for (int64_t i = 0; i < count; ++i) {
      const double sample = static_cast<double>(step * global_ + index + i);
      float* x = in[0].data<float>() + i * width;
      for (int64_t j = 0; j < width; ++j)
        x[j] = static_cast<float>(std::sin(0.37 * sample + 1.3 * static_cast<double>(j)));
      in[1].data<float>()[i * 2] = x[0] - 2 * x[1];
      in[1].data<float>()[i * 2 + 1] = 0.5f * x[2] + x[3];
    }
  }

 private:
  int64_t global_;
};

// An MLP with float inputs and a squared-error loss trains on two pipeline
// stages through the same Trainer, partitioner and executor as GPT, with one
// process's losses: the same fp32 sums in another order (1e-5, as every
// layout test).
TEST(ModelApi, FloatInputsTrainOnTwoPipelineStagesAsOnOne) {
  constexpr int64_t kMicro = 2, kGlobal = 8;
  constexpr int kSteps = 6;
  RegressionBatches data(kGlobal);
  auto train = [&](Communicator* world, int pp) {
    MlpModel m = build_mlp({4, 16, 16, 16, 2}, kMicro);
    TrainOptions o;
    o.micro_batch = kMicro, o.global_batch = kGlobal;
    o.lr.lr = 1e-2f;
    LayoutOptions lo;
    lo.pp = pp;
    RankLayout rank(world, m.graph, m.io(), data, o, lo, 11);
    std::vector<double> losses;
    for (int s = 0; s < kSteps; ++s) losses.push_back(rank.trainer().train_step().loss);
    return losses;
  };
  const std::vector<double> one = train(nullptr, 1);
  std::vector<std::vector<double>> two(2);
  run_local(2, [&](Communicator& world) { two[static_cast<size_t>(world.rank())] = train(&world, 2); });
  EXPECT_LT(one.back(), one.front()) << "training moves the loss down";
  for (const auto& rank : two)
    for (int s = 0; s < kSteps; ++s)
      EXPECT_NEAR(rank[static_cast<size_t>(s)], one[static_cast<size_t>(s)],
                  1e-5 * one[static_cast<size_t>(s)])
          << "step " << s + 1;
}

// Each mistake in declaring a model is one error naming what is wrong.
TEST(ModelApi, BadModelDefinitionsAreNamed) {
  MlpModel m = build_mlp({4, 2}, 2);
  ModelIO io = m.io();
  check_model_io(io, 2);
  io.loss = -1;
  EXPECT_TRUE(contains(error_message([&] { check_model_io(io, 2); }), "the model has no loss"));
  io = m.io();
  io.loss = m.input;
  EXPECT_TRUE(contains(error_message([&] { check_model_io(io, 2); }),
                       "the loss 'input' must be one element made by a node"));
  io = m.io();
  io.inputs = {m.input};
  EXPECT_TRUE(contains(error_message([&] { check_model_io(io, 2); }),
                       "graph input 'target' has no source"));
  io = m.io();
  io.inputs = {m.input, m.target, m.loss};
  EXPECT_TRUE(contains(error_message([&] { check_model_io(io, 2); }),
                       "model input 'loss' is not a graph input"));
  EXPECT_TRUE(contains(error_message([&] { check_model_io(m.io(), 3); }),
                       "input 'input' has shape [2, 4]; its first dimension must be the "
                       "micro-batch size (3)"));
  // A node whose input does not fit is named when it is added.
  auto params = std::make_shared<ParamStore>();
  Graph g(params);
  const int x = g.input("x", {2, 4}, DType::F32);
  Param* w = params->create("w", {5, 3}, Init::constant(0));
  EXPECT_TRUE(contains(error_message([&] { g.add1("fc", std::make_unique<Linear>(w, nullptr), {x}); }),
                       "fc (linear): w: input width 4 does not match the weight's input dimension 5"));
}


// --- evaluation: the loss on other data, leaving training untouched ---

// Runs `steps` GPT steps in layout (dp, pp) on threads, evaluating on
// `valid` before every step when `eval`; returns rank 0's step losses and
// evaluations.
struct EvalRun {
  std::vector<double> losses, evals;
};
EvalRun run_with_evaluation(int dp, int pp, bool eval, bool powersgd) {
  GptConfig cfg;
  cfg.vocab_size = 256, cfg.num_layers = 2, cfg.hidden_size = 32, cfg.num_heads = 4;
  cfg.seq_length = 16;
  std::string text;
  for (int i = 0; i < 50; ++i) text += "A stitch in time saves nine; look before you leap. ";
  const TokenData data = TokenData::from_tokens(std::vector<int32_t>(text.begin(), text.end()), 256);
  const int64_t windows = data.windows(cfg.seq_length);
  const TokenBatches train(data, 8, cfg.seq_length, 0, windows - 8);
  const TokenBatches valid(data, 8, cfg.seq_length, windows - 8, 8);
  EvalRun out;
  std::mutex mu;
  auto body = [&](Communicator* world) {
    GptModel m = build_gpt(cfg, 2);
    TrainOptions o;
    o.micro_batch = 2, o.global_batch = 8;
    o.lr.lr = 3e-3f;
    LayoutOptions lo;
    lo.pp = pp;
    if (powersgd) lo.sync.compression = GradCompression::PowerSgd, lo.sync.powersgd_rank = 2;
    RankLayout rank(world, m.graph, m.io, train, o, lo, 3);
    EvalRun r;
    for (int s = 0; s < 4; ++s) {
      if (eval) r.evals.push_back(rank.trainer().evaluate(valid, 2));
      r.losses.push_back(rank.trainer().train_step().loss);
    }
    std::lock_guard<std::mutex> lock(mu);
    if (world == nullptr || world->rank() == 0) out = r;
  };
  if (dp * pp == 1)
    body(nullptr);
  else
    run_local(dp * pp, [&](Communicator& world) { body(&world); });
  return out;
}

// Evaluating between steps changes no bit of training, on one process and
// with data parallelism whose PowerSGD state a reduction would move.
TEST(Evaluate, LeavesTrainingBitForBitUnchanged) {
  for (auto [dp, pp, powersgd] : {std::tuple{1, 1, false}, std::tuple{2, 1, true},
                                  std::tuple{1, 2, false}}) {
    const EvalRun plain = run_with_evaluation(dp, pp, false, powersgd);
    const EvalRun evaluated = run_with_evaluation(dp, pp, true, powersgd);
    EXPECT_EQ(plain.losses, evaluated.losses) << "dp " << dp << " pp " << pp;
    ASSERT_EQ(evaluated.evals.size(), 4u);
    EXPECT_LT(evaluated.evals.back(), evaluated.evals.front()) << "validation loss falls";
  }
}

// The evaluation of a batch is that batch's training loss, before the update.
TEST(Evaluate, OfTheTrainingBatchIsItsLoss) {
  GptConfig cfg;
  cfg.vocab_size = 256, cfg.num_layers = 2, cfg.hidden_size = 32, cfg.num_heads = 4;
  cfg.seq_length = 16;
  std::string text(2000, 'x');
  for (size_t i = 0; i < text.size(); ++i) text[i] = static_cast<char>('a' + (i * 7) % 26);
  const TokenData data = TokenData::from_tokens(std::vector<int32_t>(text.begin(), text.end()), 256);
  const TokenBatches batches(data, 4, cfg.seq_length);
  GptModel m = build_gpt(cfg, 2);
  init_gpt(m, 9);
  TrainOptions o;
  o.micro_batch = 2, o.global_batch = 4;
  Trainer t(m.io, batches, o);
  const double eval = t.evaluate(batches, 1);  // step 0's batch
  EXPECT_EQ(eval, t.train_step().loss);
}

}  // namespace
}  // namespace weft
