// Documents in the token stream: Megatron's --reset-position-ids,
// --reset-attention-mask and --eod-mask-loss. The references:
//   - a packed sequence [A eod B] under both resets gives each document's
//     tokens the logits the plain model gives that document on its own;
//   - the masked loss is the mean of the plain model's per-token losses over
//     the tokens that are not an end of document, and its gradient is that
//     mean's (the seed is one over the step's counted terms).
// Every layout's parity with one process is tests/test_parallel.cc's.
#include <weft/ops.h>
#include <weft/runner.h>
#include <weft/targets.h>
#include <weft/trainer.h>

#include <gtest/gtest.h>

#include "models/gpt.h"
#include "models/llama.h"
#include "test_util.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace weft {
namespace {

constexpr int32_t kEod = 0;

size_t z(int64_t i) { return static_cast<size_t>(i); }

TEST(Documents, PositionsRestartAfterEachEndOfDocument) {
  const std::vector<int32_t> tokens = {5, 0, 7, 8, 0, 0, 3, 4,   // sequence 0
                                       1, 2, 3, 0, 4, 5, 6, 7};  // sequence 1
  std::vector<int32_t> pos(tokens.size());
  document_positions(tokens.data(), pos.data(), 2, 8, kEod);
  // An end of document belongs to its document; each sequence starts at 0.
  EXPECT_EQ(pos, (std::vector<int32_t>{0, 1, 0, 1, 2, 0, 0, 1, 0, 1, 2, 3, 0, 1, 2, 3}));
  document_positions(tokens.data(), pos.data(), 2, 8, -1);  // no documents: t
  EXPECT_EQ(pos, (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7}));
}

// A stream of documents of 1 to 6 tokens, each ended by kEod.
TokenData document_stream(int64_t n, int32_t vocab) {
  std::vector<int32_t> t;
  uint64_t x = 12345;
  while (static_cast<int64_t>(t.size()) < n) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    const int len = 1 + static_cast<int>((x >> 33) % 6);
    for (int k = 0; k < len; ++k)
      t.push_back(1 + static_cast<int32_t>((x >> (8 + 4 * k)) % (vocab - 1)));
    t.push_back(kEod);
  }
  t.resize(z(n));
  return TokenData::from_tokens(std::move(t), vocab);
}

TEST(Documents, TokenBatchesMaskTheTokenAfterEachEndAndFillPositions) {
  const TokenData data = document_stream(400, 32);
  const int64_t g = 4, t = 12;
  TokenBatches plain(data, g, t), docs(data, g, t);
  DocumentOptions d;
  d.eod = kEod;
  d.eod_mask_loss = d.reset_attention_mask = true;
  docs.set_documents(d);
  for (int64_t step : {0, 3}) {
    Tensor tok = Tensor::empty({g, t}, DType::I32), tgt = tok.clone(), pos = tok.clone();
    Tensor tok0 = tok.clone(), tgt0 = tok.clone();
    plain.fill(step, 0, std::vector<Tensor>{tok0, tgt0});
    docs.fill(step, 0, std::vector<Tensor>{tok, tgt, pos});
    std::vector<int32_t> want_pos(z(g * t));
    document_positions(tok.data<int32_t>(), want_pos.data(), g, t, kEod);
    int64_t counted = 0;
    for (int64_t i = 0; i < g * t; ++i) {
      const int32_t in = tok.data<int32_t>()[i];
      EXPECT_EQ(in, tok0.data<int32_t>()[i]);
      EXPECT_EQ(tgt.data<int32_t>()[i], in == kEod ? kIgnoredTarget : tgt0.data<int32_t>()[i]);
      EXPECT_EQ(pos.data<int32_t>()[i], want_pos[z(i)]);
      counted += in != kEod;
    }
    EXPECT_GT(counted, 0);
    EXPECT_LT(counted, g * t) << "no end of document in the batch: the test would be vacuous";
    EXPECT_EQ(docs.loss_terms(step), counted);
    EXPECT_EQ(plain.loss_terms(step), -1);
  }
  // Two inputs for a model with positions is an error naming the count.
  Tensor a = Tensor::empty({1, t}, DType::I32), b = a.clone();
  EXPECT_TRUE(testing::contains(testing::error_message([&] {
                                  docs.fill(0, 0, std::vector<Tensor>{a, b});
                                }),
                                "fill 3 inputs"));
  d.eod = 32;
  TokenBatches bad(std::make_shared<const WindowOrder>(
                       std::vector<BlendPart>{{std::make_shared<const TokenData>(data), 1.0, 0, 0}},
                       t, false, 0),
                   g, 32);
  EXPECT_TRUE(testing::contains(testing::error_message([&] { bad.set_documents(d); }),
                                "end-of-document token 32 is outside the vocabulary"));
}

// The logits (T, V) of a one-sequence forward of `graph` on `tokens`.
struct Forward {
  std::vector<float> logits;
  int64_t v = 0;
};
template <class Model>
Forward run_forward(Model& m, const std::vector<int32_t>& tokens) {
  m.head->set_keep_logits(true);
  Graph& g = m.graph;
  MicroBatch mb(g);
  const int64_t t = static_cast<int64_t>(tokens.size());
  const Tensor in = mb.input(m.tokens), targets = mb.input(m.targets);
  std::copy(tokens.begin(), tokens.end(), in.data<int32_t>());
  std::fill_n(targets.data<int32_t>(), t, 1);
  if (m.positions >= 0) {
    const Tensor positions = mb.input(m.positions);
    document_positions(tokens.data(), positions.data<int32_t>(), 1, t, kEod);
  }
  forward(g, mb, 0, static_cast<int>(g.nodes().size()));
  const int head = static_cast<int>(g.nodes().size()) - 1;
  const Tensor& l = TiedLmHeadLoss::logits(mb.ctx(head));
  Forward f;
  f.v = l.numel() / t;
  f.logits.assign(l.data<float>(), l.data<float>() + l.numel());
  return f;
}

// Rows [from, from + n) of `a` against rows [0, n) of `b`: the largest difference.
double row_diff(const Forward& a, int64_t from, const Forward& b, int64_t n) {
  double worst = 0;
  for (int64_t i = 0; i < n * a.v; ++i)
    worst = std::max(worst,
                     std::abs(static_cast<double>(a.logits[z(from * a.v + i)]) - b.logits[z(i)]));
  return worst;
}

// Document A (5 tokens, its end included) then B (7): under both resets, B's
// logits are the plain model's on B alone, A's on A alone. The tails after
// a document alone are tokens the causal mask keeps from its rows.
// fp32 error model: the same products summed in another order (a score row
// of T columns, zeros included, against one of the document's), through two
// blocks of width 32: a few ulps of logits below 1, so 1e-5 absolute.
// `relative`: positions enter only relative to each other (rope), so the
// attention mask alone already gives the document alone.
template <class Model, class Config, class Build>
void expect_documents_alone(Config cfg, Build build, bool relative) {
  const std::vector<int32_t> a = {3, 4, 5, 6, kEod}, b = {7, 8, 9, 10, 11, 12, 13};
  std::vector<int32_t> packed = a;
  packed.insert(packed.end(), b.begin(), b.end());
  const int64_t t = static_cast<int64_t>(packed.size());
  cfg.seq_length = t;
  Model plain = build(cfg);
  cfg.reset_position_ids = cfg.reset_attention_mask = true;
  Model docs = build(cfg);
  ASSERT_GE(docs.positions, 0);
  auto padded = [&](std::vector<int32_t> d) {
    d.resize(z(t), 2);
    return d;
  };
  const Forward both = run_forward(docs, packed), alone_a = run_forward(plain, padded(a)),
                alone_b = run_forward(plain, padded(b));
  EXPECT_LT(row_diff(both, 0, alone_a, 5), 1e-5);
  EXPECT_LT(row_diff(both, 5, alone_b, 7), 1e-5);
  // The plain model on the packed sequence reads A from B's rows.
  EXPECT_GT(row_diff(run_forward(plain, packed), 5, alone_b, 7), 1e-3);
  // Either reset alone differs from both (each does something of its own),
  // but for the mask alone with relative positions.
  for (bool positions : {true, false}) {
    cfg.reset_position_ids = positions, cfg.reset_attention_mask = !positions;
    Model one = build(cfg);
    const double d = row_diff(run_forward(one, packed), 5, alone_b, 7);
    const char* which = positions ? "--reset-position-ids alone" : "--reset-attention-mask alone";
    if (relative && !positions)
      EXPECT_LT(d, 1e-5) << which;
    else
      EXPECT_GT(d, 1e-4) << which;
  }
}

TEST(Documents, EachDocumentOfAPackedGptSequenceIsTheModelOnItsOwn) {
  GptConfig cfg;
  cfg.vocab_size = 32, cfg.num_layers = 2, cfg.hidden_size = 32, cfg.num_heads = 4;
  expect_documents_alone<GptModel>(
      cfg,
      [](const GptConfig& c) {
        GptModel m = build_gpt(c, 1);
        init_gpt(m, 7);
        // Larger than GPT-2's 0.02: positions must move the logits visibly.
        for (Param* p : m.graph.params())
          if (p->name == "wpe.weight") ops::scale(p->value, 25.0f);
        return m;
      },
      /*relative=*/false);
}

TEST(Documents, EachDocumentOfAPackedLlamaSequenceIsTheModelOnItsOwn) {
  LlamaConfig cfg;
  cfg.vocab_size = 32, cfg.num_layers = 2, cfg.hidden_size = 32, cfg.num_heads = 4;
  cfg.rope_base = 4.0f;  // fast rotations: a shifted position changes the scores
  expect_documents_alone<LlamaModel>(
      cfg,
      [](const LlamaConfig& c) {
        LlamaModel m = build_llama(c, 1);
        init_llama(m, 7);
        for (Param* p : m.graph.params())  // sharper scores than the 0.02 init gives
          if (p->name.find("attn.qkv") != std::string::npos) ops::scale(p->value, 20.0f);
        return m;
      },
      /*relative=*/true);
}

// The targets of `batches` with the end-of-document inputs' ignored, and
// every term counted: its gradient is the masked terms' sum over G T.
class MaskedButCountedAll final : public BatchSource {
 public:
  explicit MaskedButCountedAll(const TokenBatches& all) : all_(all) {}
  void fill(int64_t step, int64_t index, std::span<const Tensor> inputs) const override {
    all_.fill(step, index, inputs);
    for (int64_t i = 0; i < inputs[0].numel(); ++i)
      if (inputs[0].data<int32_t>()[i] == kEod) inputs[1].data<int32_t>()[i] = kIgnoredTarget;
  }

 private:
  const TokenBatches& all_;
};

TEST(Documents, TheMaskedLossIsTheMeanOverTheOtherTokensAndSoIsItsGradient) {
  GptConfig cfg;
  cfg.vocab_size = 32, cfg.num_layers = 2, cfg.hidden_size = 32, cfg.num_heads = 4;
  cfg.seq_length = 12;
  const int64_t g = 4, t = cfg.seq_length;
  const TokenData data = document_stream(400, 32);
  TokenBatches plain(data, g, t), masked(data, g, t);
  DocumentOptions d;
  d.eod = kEod;
  d.eod_mask_loss = true;
  masked.set_documents(d);
  TrainOptions o;
  o.micro_batch = 2, o.global_batch = g, o.clip_grad = 0;
  // The reference: the plain model's per-token losses, in double, over the
  // tokens whose input is not an end of document.
  GptModel ref = build_gpt(cfg, 1);
  init_gpt(ref, 3);
  double sum = 0;
  int64_t counted = 0;
  Tensor tok = Tensor::empty({g, t}, DType::I32), tgt = tok.clone();
  plain.fill(0, 0, std::vector<Tensor>{tok, tgt});
  for (int64_t s = 0; s < g; ++s) {
    const std::vector<int32_t> seq(tok.data<int32_t>() + s * t, tok.data<int32_t>() + (s + 1) * t);
    const Forward f = run_forward(ref, seq);
    for (int64_t i = 0; i < t; ++i) {
      if (seq[z(i)] == kEod) continue;
      const float* row = f.logits.data() + i * f.v;
      double mx = row[0], e = 0;
      for (int64_t j = 1; j < f.v; ++j) mx = std::max(mx, static_cast<double>(row[j]));
      for (int64_t j = 0; j < f.v; ++j) e += std::exp(row[j] - mx);
      sum += std::log(e) + mx - row[tgt.data<int32_t>()[s * t + i]];
      ++counted;
    }
  }
  ASSERT_LT(counted, g * t);
  GptModel m = build_gpt(cfg, 2);
  init_gpt(m, 3);
  Trainer trainer(m.io, masked, o);
  const StepRecord r = trainer.train_step();
  // fp32 sums of 48 terms near ln 32 = 3.5: 1e-5 relative is far above their rounding.
  EXPECT_NEAR(r.loss, sum / static_cast<double>(counted), 1e-5 * r.loss);
  // The same ignored targets with every term counted: the gradient is the
  // same sum over G T instead of over the counted terms.
  GptModel m2 = build_gpt(cfg, 2);
  init_gpt(m2, 3);
  const MaskedButCountedAll all(plain);
  Trainer trainer2(m2.io, all, o);
  const StepRecord r2 = trainer2.train_step();
  EXPECT_NEAR(r.grad_norm, r2.grad_norm * static_cast<double>(g * t) / static_cast<double>(counted),
              1e-5 * r.grad_norm);
  EXPECT_NEAR(r.loss, r2.loss * static_cast<double>(g * t) / static_cast<double>(counted),
              1e-5 * r.loss);
}

}  // namespace
}  // namespace weft
