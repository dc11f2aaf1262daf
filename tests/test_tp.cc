// Tensor parallelism on LocalCommunicator threads, at tp = 1, 2 and 4:
//  - every layer's parallel form against its serial twin, forward and backward: outputs,
//    input gradients (added into buffers that already hold something) and parameter
//    gradients, the ranks' pieces put back together with place_shard;
//  - the whole GPT instantiated per rank by tensor_parallel_graph against the
//    single-process model: loss and every parameter gradient, with backward run node by
//    node and split (every I first, then every W);
//  - shard initialisation (the pieces are the logical tensor, bit for bit) and the errors.
#include <gtest/gtest.h>
#include <weft/arena.h>
#include <weft/graph.h>
#include <weft/local_communicator.h>
#include <weft/runner.h>
#include <weft/tensor_parallel.h>

#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "layers/attention.h"
#include "layers/embedding.h"
#include "layers/gelu.h"
#include "layers/gelu_mlp.h"
#include "layers/layernorm.h"
#include "layers/linear.h"
#include "layers/lm_head.h"
#include "layers/mse_loss.h"
#include "layers/residual.h"
#include "layers/rmsnorm.h"
#include "layers/rotary.h"
#include "layers/swiglu.h"
#include "models/gpt.h"
#include "models/llama.h"
#include "test_util.h"

namespace weft {
namespace {

using testing::contains;
using testing::error_message;

constexpr uint64_t kSeed = 7;
constexpr int64_t kB = 2, kT = 5, kC = 16, kHeads = 4, kV = 12, kPos = 6;
constexpr double kTol = 1e-5;
const std::vector<int> kSizes = {1, 2, 4};

// A hang fails the test in seconds instead of the default five minutes.
CommOptions quick() {
  CommOptions o;
  o.timeout = std::chrono::seconds(30);
  return o;
}

size_t z(int64_t i) { return static_cast<size_t>(i); }

double norm(const Tensor& t) {
  double s = 0;
  for (int64_t i = 0; i < t.numel(); ++i) s += double(t.data<float>()[i]) * t.data<float>()[i];
  return std::sqrt(s);
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() &&
         std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

// How a rank's activation relates to the serial one: whole on every rank, or split along
// the last dimension (in `blocks` packed blocks, as c_attn's q|k|v).
// `widths`, when given, are unequal blocks (grouped-query attention's q|k|v).
struct Split {
  bool split = false;
  int blocks = 1;
  std::vector<int64_t> widths = {};
};
const Split kWhole{};
const Split kCols{true, 1};
const Split kQkv{true, 3};

Shard act_shard(const Shape& full, const Split& s, int tp, int rank) {
  if (!s.split) return Shard{-1, tp, rank, {}, full};
  return Shard{full.rank - 1, tp, rank,
               s.widths.empty() ? equal_blocks(full.last(), s.blocks) : s.widths, full};
}

// Rank `rank`'s piece of a serial tensor (int tensors are always whole).
Tensor piece(const Tensor& full, const Split& s, int tp, int rank) {
  if (full.dtype() != DType::F32 || !s.split) return full.clone();
  const Shard sh = act_shard(full.shape(), s, tp, rank);
  Tensor part = Tensor::empty(sh.local());
  slice_shard(full, sh, part);
  return part;
}

// The full tensor again from every rank's piece. A tensor that is whole on every rank must
// be the very same bits on all of them (replicas that differ would drift apart).
Tensor assemble(const std::vector<Tensor>& parts, const Shard& shard, const std::string& what) {
  if (!shard.split()) {
    for (size_t r = 1; r < parts.size(); ++r)
      EXPECT_TRUE(same_bits(parts[r], parts[0]))
          << what << " differs between rank 0 and rank " << r;
    return parts[0].clone();
  }
  Tensor full = Tensor::empty(shard.full);
  for (size_t r = 0; r < parts.size(); ++r) {
    Shard s = shard;
    s.index = static_cast<int>(r);
    place_shard(parts[r], s, full);
  }
  return full;
}

void expect_close(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  EXPECT_GT(norm(want), 1e-3) << what << " is too small to compare";
  EXPECT_LT(testing::rel_error(got, want), kTol) << what;
}

// --- one layer, run the way the runner runs it ---

struct Run {
  Arena arena;
  std::unique_ptr<LayerCtx> ctx;
  std::vector<Tensor> out, grad_in;
  std::map<std::string, Tensor> grad_after_i;  // parameter gradients after I alone
  std::map<std::string, Tensor> grad;          // ... after W
};

// Forward, then I with d out = `dout` into gradient buffers that start as `start` (float
// inputs only), then W; parameter gradients start at zero.
std::unique_ptr<Run> run_layer(Layer& layer, const std::vector<Tensor>& in,
                               const std::vector<bool>& float_input, const Tensor& dout,
                               const std::vector<Tensor>& start) {
  auto r = std::make_unique<Run>();
  for (Param* p : layer.params()) p->grad.zero_();
  std::vector<Tensor> args;
  std::vector<Shape> shapes;
  for (const Tensor& t : in) {
    Tensor a = r->arena.alloc(t.shape(), t.dtype());
    a.copy_from(t);
    args.push_back(a);
    shapes.push_back(t.shape());
  }
  for (const Shape& s : layer.output_shapes(shapes)) {
    Tensor o = r->arena.alloc(s);
    std::fill_n(o.data<float>(), o.numel(), std::nanf(""));  // unwritten shows as NaN
    r->out.push_back(o);
  }
  r->ctx = layer.make_ctx();
  layer.forward(*r->ctx, r->arena, args, r->out);
  Tensor g = r->arena.alloc(dout.shape());
  g.copy_from(dout);
  for (size_t i = 0; i < in.size(); ++i) {
    if (!float_input[i]) {
      r->grad_in.emplace_back();
      continue;
    }
    Tensor gi = r->arena.alloc(in[i].shape());
    gi.copy_from(start[i]);
    r->grad_in.push_back(gi);
  }
  layer.backward_input(*r->ctx, r->arena, {&g, 1}, r->grad_in);
  for (Param* p : layer.params()) r->grad_after_i[p->name] = p->grad.clone();
  layer.backward_weight(*r->ctx, r->arena);
  for (Param* p : layer.params()) r->grad[p->name] = p->grad.clone();
  return r;
}

struct LayerCase {
  std::shared_ptr<ParamStore> store;  // the logical parameters
  std::unique_ptr<Layer> layer;       // the serial twin
  std::vector<Tensor> in;             // serial inputs
  std::vector<Split> in_split;        // how each rank's input is cut from them
  std::vector<bool> float_input;
  Split out_split;
  bool loss = false;
  bool flops_split = false;  // the parallel form does 1/tp of the work
  std::string parallel_kind;
};

Param* make_param(ParamStore& s, const std::string& name, Shape shape) {
  Param* p = s.create(name, shape, Init::normal(0.5f));  // biases and norms too: none is 0 or 1
  init_param(*p, kSeed);
  return p;
}

// Every vocabulary range is hit, so every rank's rows of wte matter.
Tensor token_ids(int64_t mul, int64_t add) {
  Tensor t = Tensor::empty({kB, kT}, DType::I32);
  for (int64_t i = 0; i < kB * kT; ++i)
    t.data<int32_t>()[i] = static_cast<int32_t>((i * mul + add) % kV);
  return t;
}

LayerCase make_case(const std::string& name) {
  LayerCase c;
  c.store = std::make_shared<ParamStore>();
  ParamStore& s = *c.store;
  const Shape act{kB, kT, kC};
  auto x = [&](Shape shape, uint64_t seed) { return testing::uniform_tensor(shape, seed); };
  if (name == "column" || name == "column_nobias" || name == "column_packed") {
    const int blocks = name == "column_packed" ? 3 : 1;
    const int64_t out = 12 * blocks;
    Param* w = make_param(s, "fc.weight", {kC, out});
    Param* b = name == "column_nobias" ? nullptr : make_param(s, "fc.bias", {out});
    c.layer = std::make_unique<Linear>(w, b, ParallelRole::Column, blocks);
    c.in = {x(act, 1)};
    c.in_split = {kWhole};
    c.out_split = {true, blocks};
    c.flops_split = true;
    c.parallel_kind = "column_parallel_linear";
  } else if (name == "row" || name == "row_nobias") {
    Param* w = make_param(s, "proj.weight", {12, kC});
    Param* b = name == "row" ? make_param(s, "proj.bias", {kC}) : nullptr;
    c.layer = std::make_unique<Linear>(w, b, ParallelRole::Row);
    c.in = {x({kB, kT, 12}, 2)};
    c.in_split = {kCols};
    c.out_split = kWhole;
    c.flops_split = true;
    c.parallel_kind = "row_parallel_linear";
  } else if (name == "replicated_linear") {
    Param* w = make_param(s, "fc.weight", {kC, 12});
    Param* b = make_param(s, "fc.bias", {12});
    c.layer = std::make_unique<Linear>(w, b);
    c.in = {x(act, 3)};
    c.in_split = {kWhole};
    c.out_split = kWhole;
    c.parallel_kind = "linear";
  } else if (name == "attention") {
    c.layer = std::make_unique<CausalSelfAttention>(kHeads);
    c.in = {testing::uniform_tensor({kB, kT, 3 * kC}, 4, -1.5f, 1.5f)};
    c.in_split = {kQkv};
    c.out_split = kCols;
    c.flops_split = true;
    c.parallel_kind = "attention";
  } else if (name == "attention_gqa") {  // 8 query heads of 2 in 4 groups: q|k|v of C, C/2, C/2
    c.layer = std::make_unique<CausalSelfAttention>(8, 4);
    c.in = {testing::uniform_tensor({kB, kT, 2 * kC}, 4, -1.5f, 1.5f)};
    c.in_split = {Split{true, 3, {kC, kC / 2, kC / 2}}};
    c.out_split = kCols;
    c.flops_split = true;
    c.parallel_kind = "attention";
  } else if (name == "column_gqa") {  // grouped-query attention's q|k|v projection
    Param* w = make_param(s, "qkv.weight", {kC, 2 * kC});
    c.layer = std::make_unique<Linear>(w, nullptr, ParallelRole::Column,
                                       std::vector<int64_t>{kC, kC / 2, kC / 2});
    c.in = {x(act, 15)};
    c.in_split = {kWhole};
    c.out_split = {true, 3, {kC, kC / 2, kC / 2}};
    c.flops_split = true;
    c.parallel_kind = "column_parallel_linear";
  } else if (name == "embedding") {
    Param* wte = make_param(s, "wte", {kV, kC});
    Param* wpe = make_param(s, "wpe", {kPos, kC});
    c.layer = std::make_unique<Embedding>(wte, wpe);
    c.in = {token_ids(5, 3)};
    c.in_split = {kWhole};
    c.out_split = kWhole;
    c.parallel_kind = "vocab_parallel_embedding";
  } else if (name == "lm_head") {
    Param* wte = make_param(s, "wte", {kV, kC});
    auto head = std::make_unique<TiedLmHeadLoss>(wte);
    head->set_keep_logits(true);
    c.layer = std::move(head);
    c.in = {x(act, 5), token_ids(7, 2)};
    c.in_split = {kWhole, kWhole};
    c.out_split = kWhole;
    c.loss = true;
    c.flops_split = true;
    c.parallel_kind = "vocab_parallel_lm_head_loss";
  } else if (name == "layernorm") {
    c.layer = std::make_unique<LayerNorm>(make_param(s, "ln.weight", {kC}),
                                          make_param(s, "ln.bias", {kC}));
    c.in = {x(act, 6)};
    c.in_split = {kWhole};
    c.out_split = kWhole;
    c.parallel_kind = "layernorm";
  } else if (name == "gelu") {  // on a column-parallel slice, as in the MLP
    c.layer = std::make_unique<Gelu>();
    c.in = {testing::uniform_tensor({kB, kT, 4 * kC}, 7, -3.0f, 3.0f)};
    c.in_split = {kCols};
    c.out_split = kCols;
    c.flops_split = true;
    c.parallel_kind = "gelu";
  } else if (name == "gelu_mlp") {  // column then row, in one node
    Param* w1 = make_param(s, "mlp.c_fc.weight", {kC, 4 * kC});
    Param* b1 = make_param(s, "mlp.c_fc.bias", {4 * kC});
    Param* w2 = make_param(s, "mlp.c_proj.weight", {4 * kC, kC});
    Param* b2 = make_param(s, "mlp.c_proj.bias", {kC});
    c.layer = std::make_unique<GeluMlp>(w1, b1, w2, b2);
    c.in = {x(act, 16)};
    c.in_split = {kWhole};
    c.out_split = kWhole;
    c.flops_split = true;
    c.parallel_kind = "parallel_gelu_mlp";
  } else if (name == "residual") {
    c.layer = std::make_unique<Residual>();
    c.in = {x(act, 8), x(act, 9)};
    c.in_split = {kWhole, kWhole};
    c.out_split = kWhole;
    c.parallel_kind = "residual";
  } else if (name == "mse") {
    c.layer = std::make_unique<MseLoss>();
    c.in = {x({kB * kT, 4}, 10), x({kB * kT, 4}, 11)};
    c.in_split = {kWhole, kWhole};
    c.out_split = kWhole;
    c.loss = true;
    c.parallel_kind = "mse_loss";
  } else if (name == "rmsnorm") {
    c.layer = std::make_unique<RmsNorm>(make_param(s, "norm.weight", {kC}));
    c.in = {x(act, 12)};
    c.in_split = {kWhole};
    c.out_split = kWhole;
    c.parallel_kind = "rmsnorm";
  } else if (name == "swiglu") {  // on [gate_r | up_r], a column-parallel slice of two blocks
    c.layer = std::make_unique<SwiGlu>();
    c.in = {testing::uniform_tensor({kB, kT, 4 * kC}, 13, -3.0f, 3.0f)};
    c.in_split = {Split{true, 2}};
    c.out_split = kCols;
    c.flops_split = true;
    c.parallel_kind = "swiglu";
  } else if (name == "rotary") {  // heads split, as attention's
    c.layer = std::make_unique<Rotary>(kHeads, kHeads, 10000.0f);
    c.in = {x({kB, kT, 3 * kC}, 14)};
    c.in_split = {kQkv};
    c.out_split = kQkv;
    c.flops_split = true;
    c.parallel_kind = "rotary";
  } else if (name == "rotary_gqa") {
    c.layer = std::make_unique<Rotary>(8, 4, 10000.0f);
    c.in = {x({kB, kT, 2 * kC}, 16)};
    const Split gqa{true, 3, {kC, kC / 2, kC / 2}};
    c.in_split = {gqa};
    c.out_split = gqa;
    c.flops_split = true;
    c.parallel_kind = "rotary";
  } else {
    ADD_FAILURE() << "unknown case " << name;
  }
  for (const Tensor& t : c.in) c.float_input.push_back(t.dtype() == DType::F32);
  return c;
}

const std::vector<std::string> kLayerCases = {
    "column",    "column_nobias", "column_packed", "row",       "row_nobias", "replicated_linear",
    "attention", "embedding",     "lm_head",       "layernorm", "gelu",       "residual",
    "mse",       "rmsnorm",       "swiglu",        "rotary",    "attention_gqa", "column_gqa",
    "rotary_gqa", "gelu_mlp"};

// What one rank saw; filled on its thread, compared on the main one.
struct RankRun {
  std::shared_ptr<ParamStore> store;
  std::unique_ptr<Layer> layer;
  std::unique_ptr<Run> run;
  std::string kind;
  double flops = 0;
};

class TpLayers : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

// The parallel form gives each rank its piece of the serial output, of every input
// gradient (added to what the buffer held) and of every parameter gradient; parameter
// gradients come from W alone; whole values are identical on every rank.
TEST_P(TpLayers, MatchSerialTwin) {
  const auto& [name, tp] = GetParam();
  LayerCase c = make_case(name);
  std::vector<Shape> in_shapes;
  for (const Tensor& t : c.in) in_shapes.push_back(t.shape());
  const Shape out_shape = c.layer->output_shapes(in_shapes)[0];
  const Tensor dout = c.loss ? Tensor::zeros({1}) : testing::uniform_tensor(out_shape, 20);
  if (c.loss) dout.data<float>()[0] = 0.7f;
  std::vector<Tensor> start;
  for (size_t i = 0; i < c.in.size(); ++i)
    start.push_back(c.float_input[i] ? testing::uniform_tensor(c.in[i].shape(), 30 + i, 2, 3)
                                     : Tensor());
  auto serial = run_layer(*c.layer, c.in, c.float_input, dout, start);

  std::vector<RankRun> ranks(z(tp));
  run_local(
      tp,
      [&](Communicator& comm) {
        RankRun& rr = ranks[z(comm.rank())];
        rr.store = std::make_shared<ParamStore>();
        TpBuild build{&comm, rr.store.get()};
        rr.layer = c.layer->tensor_parallel(build);
        for (Param* p : rr.store->all()) init_param(*p, kSeed);
        std::vector<Tensor> in, st;
        std::vector<Shape> shapes;
        for (size_t i = 0; i < c.in.size(); ++i) {
          in.push_back(piece(c.in[i], c.in_split[i], tp, comm.rank()));
          st.push_back(c.float_input[i] ? piece(start[i], c.in_split[i], tp, comm.rank())
                                        : Tensor());
          shapes.push_back(in.back().shape());
        }
        rr.kind = rr.layer->kind();
        rr.flops = rr.layer->flops(shapes);
        rr.run =
            run_layer(*rr.layer, in, c.float_input, piece(dout, c.out_split, tp, comm.rank()), st);
      },
      quick());

  for (const RankRun& rr : ranks) EXPECT_EQ(rr.kind, c.parallel_kind);
  EXPECT_DOUBLE_EQ(ranks[0].flops * (c.flops_split ? tp : 1), c.layer->flops(in_shapes))
      << "the parallel form's FLOPs are its share";

  auto gather = [&](auto get, const Shard& shard, const std::string& what) {
    std::vector<Tensor> parts;
    for (const RankRun& rr : ranks) parts.push_back(get(rr));
    return assemble(parts, shard, what);
  };
  expect_close(gather([](const RankRun& rr) { return rr.run->out[0]; },
                      act_shard(out_shape, c.out_split, tp, 0), "output"),
               serial->out[0], name + " output");
  for (size_t i = 0; i < c.in.size(); ++i) {
    if (!c.float_input[i]) continue;
    Tensor got = gather([i](const RankRun& rr) { return rr.run->grad_in[i]; },
                        act_shard(c.in[i].shape(), c.in_split[i], tp, 0), "input gradient");
    // Compare what the layers added, so that a wrong term is not hidden under the starting
    // values (and starting values counted tp times show).
    Tensor want = serial->grad_in[i].clone();
    for (int64_t k = 0; k < want.numel(); ++k) {
      got.data<float>()[k] -= start[i].data<float>()[k];
      want.data<float>()[k] -= start[i].data<float>()[k];
    }
    expect_close(got, want, name + " d/d input " + std::to_string(i));
  }
  ASSERT_EQ(ranks[0].store->size(), c.store->size());
  for (Param* p : c.store->all()) {
    std::vector<Tensor> values, grads;
    for (const RankRun& rr : ranks) {
      const Param* q = rr.store->find(p->name);
      ASSERT_NE(q, nullptr) << p->name;
      values.push_back(q->value);
      grads.push_back(q->grad);
      EXPECT_EQ(norm(rr.run->grad_after_i.at(p->name)), 0.0) << p->name << " grad after I";
    }
    const Shard& shard = ranks[0].store->find(p->name)->shard;
    EXPECT_TRUE(same_bits(assemble(values, shard, p->name), p->value))
        << p->name << ": the pieces are not the logical initialisation";
    expect_close(assemble(grads, shard, p->name + " grad"), serial->grad.at(p->name),
                 name + " d/d " + p->name);
  }
  if (name == "lm_head") {  // each rank keeps its V/tp columns of the logits, never all V
    std::vector<Tensor> parts;
    for (const RankRun& rr : ranks) {
      parts.push_back(TiedLmHeadLoss::logits(*rr.run->ctx));
      EXPECT_EQ(parts.back().shape(), (Shape{kB * kT, kV / tp}));
    }
    expect_close(assemble(parts, Shard{1, tp, 0, {}, {kB * kT, kV}}, "logits"),
                 TiedLmHeadLoss::logits(*serial->ctx), "lm_head logits");
  }
}

INSTANTIATE_TEST_SUITE_P(
    Tp, TpLayers, ::testing::Combine(::testing::ValuesIn(kLayerCases), ::testing::ValuesIn(kSizes)),
    [](const ::testing::TestParamInfo<std::tuple<std::string, int>>& p) {
      return std::get<0>(p.param) + "_tp" + std::to_string(std::get<1>(p.param));
    });

// --- the whole GPT ---

GptConfig toy(bool skip) {
  GptConfig c;
  c.vocab_size = 64, c.num_layers = 2, c.hidden_size = 32, c.num_heads = 4, c.seq_length = 8;
  c.embedding_skip = skip;
  return c;
}
constexpr int64_t kMicro = 2;

Tensor random_tokens(uint64_t seed, int64_t vocab) {
  const std::vector<float> u = testing::uniform(kMicro * toy(false).seq_length, seed, 0, 1);
  Tensor t = Tensor::empty({kMicro, toy(false).seq_length}, DType::I32);
  for (size_t i = 0; i < u.size(); ++i)
    t.data<int32_t>()[i] =
        static_cast<int32_t>(u[i] * static_cast<float>(vocab)) % static_cast<int32_t>(vocab);
  return t;
}

// Forward, seed d loss = 1 / tokens, backward: node by node (I then W), or every I first
// and every W after (the split a zero-bubble schedule makes). Returns the loss.
double train_pass(const Graph& g, const ModelIO& io, bool split, const Tensor& tokens,
                  const Tensor& targets, bool* grads_zero_after_i = nullptr) {
  MicroBatch mb(g);
  mb.set_input(io.inputs.at(0), tokens);
  mb.set_input(io.inputs.at(1), targets);
  const int n = static_cast<int>(g.nodes().size());
  forward(g, mb, 0, n);
  const double loss = mb.value(io.loss).data<float>()[0];
  mb.seed_grad(io.loss, 1.0f / static_cast<float>(tokens.numel()));
  if (!split) {
    backward(g, mb, 0, n);
    return loss;
  }
  for (int k = n - 1; k >= 0; --k) backward_input(g, mb, k);
  if (grads_zero_after_i) {
    *grads_zero_after_i = true;
    for (Param* p : g.params()) *grads_zero_after_i = *grads_zero_after_i && norm(p->grad) == 0;
  }
  for (int k = 0; k < n; ++k) backward_weight(g, mb, k);
  return loss;
}

struct GptRank {
  std::shared_ptr<ParamStore> store;
  double loss = 0;
  bool grads_zero_after_i = false;
  std::map<std::string, std::string> kinds;  // node name -> its layer's kind
  std::vector<Shape> value_shapes;
  bool wte_tied = false;
  bool same_layout = true;
};

class TpGpt : public ::testing::TestWithParam<std::tuple<int, bool>> {};

// Every rank runs tensor_parallel_graph(logical) with its own parameter store initialised
// from the same seed: the loss (the same bits on every rank) and every parameter gradient,
// reassembled, are the single-process ones.
TEST_P(TpGpt, MatchesSingleProcess) {
  const auto& [tp, split] = GetParam();
  const GptConfig cfg = toy(split);
  GptModel m = build_gpt(cfg, kMicro);
  init_gpt(m, kSeed);
  const Tensor tokens = random_tokens(1, cfg.vocab_size),
               targets = random_tokens(2, cfg.vocab_size);
  const double serial_loss = train_pass(m.graph, m.io, split, tokens, targets);

  std::vector<GptRank> ranks(z(tp));
  run_local(
      tp,
      [&](Communicator& comm) {
        GptRank& r = ranks[z(comm.rank())];
        r.store = std::make_shared<ParamStore>();
        Graph g = tensor_parallel_graph(m.graph, comm, r.store);
        for (Param* p : r.store->all()) init_param(*p, kSeed);
        // The same nodes and values under the same ids, so the logical graph's ids apply.
        r.same_layout = g.nodes().size() == m.graph.nodes().size() &&
                        g.values().size() == m.graph.values().size() &&
                        g.outputs() == m.graph.outputs() && g.inputs() == m.graph.inputs();
        for (size_t v = 0; r.same_layout && v < g.values().size(); ++v)
          r.same_layout = g.values()[v].name == m.graph.values()[v].name &&
                          g.values()[v].producer == m.graph.values()[v].producer;
        for (const Value& v : g.values()) r.value_shapes.push_back(v.shape);
        for (const Node& nd : g.nodes()) r.kinds[nd.name] = nd.layer->kind();
        r.wte_tied = g.nodes().front().layer->params()[0] == g.nodes().back().layer->params()[0];
        r.loss = train_pass(g, m.io, split, tokens, targets, &r.grads_zero_after_i);
      },
      quick());

  for (int r = 0; r < tp; ++r) {
    const GptRank& rk = ranks[z(r)];
    EXPECT_TRUE(rk.same_layout) << "rank " << r;
    EXPECT_TRUE(rk.wte_tied) << "rank " << r << ": the head's wte is not the embedding's";
    EXPECT_EQ(rk.loss, ranks[0].loss) << "rank " << r << " has another loss";
    if (split) {
      EXPECT_TRUE(rk.grads_zero_after_i) << "rank " << r << ": a gradient before W";
    }
  }
  EXPECT_NEAR(ranks[0].loss, serial_loss, kTol * serial_loss);
  const std::map<std::string, std::string> kinds = {
      {"embed", "vocab_parallel_embedding"},         {"h.0.ln_1", "layernorm"},
      {"h.0.attn.c_attn", "column_parallel_linear"}, {"h.0.attn.core", "attention"},
      {"h.1.attn.c_proj", "row_parallel_linear"},    {"h.1.mlp", "parallel_gelu_mlp"},
      {"lm_head", "vocab_parallel_lm_head_loss"}};
  for (const auto& [node, kind] : kinds) EXPECT_EQ(ranks[0].kinds.at(node), kind) << node;
  // Inside a split region a rank holds its slice: qkv of its heads, its MLP columns.
  const int64_t T = cfg.seq_length, C = cfg.hidden_size;
  EXPECT_EQ(ranks[0].value_shapes[z(m.graph.find_value("h.0.attn.c_attn"))],
            (Shape{kMicro, T, 3 * C / tp}));
  EXPECT_EQ(ranks[0].store->find("h.0.mlp.c_fc.weight")->value.shape(), (Shape{C, 4 * C / tp}));
  EXPECT_EQ(ranks[0].store->find("h.0.mlp.c_proj.weight")->value.shape(), (Shape{4 * C / tp, C}));
  EXPECT_EQ(ranks[0].value_shapes[z(m.graph.find_value("h.0.res_2"))], (Shape{kMicro, T, C}));

  ASSERT_EQ(ranks[0].store->size(), m.params->size());
  for (Param* p : m.params->all()) {
    std::vector<Tensor> values, grads;
    for (const GptRank& r : ranks) {
      values.push_back(r.store->find(p->name)->value);
      grads.push_back(r.store->find(p->name)->grad);
    }
    const Shard& shard = ranks[0].store->find(p->name)->shard;
    EXPECT_EQ(shard.full, p->value.shape()) << p->name;
    EXPECT_TRUE(same_bits(assemble(values, shard, p->name), p->value))
        << p->name << ": the pieces are not the logical initialisation";
    expect_close(assemble(grads, shard, p->name + " grad"), p->grad, "d loss / d " + p->name);
  }
}

INSTANTIATE_TEST_SUITE_P(Tp, TpGpt,
                         ::testing::Combine(::testing::ValuesIn(kSizes), ::testing::Bool()),
                         [](const ::testing::TestParamInfo<std::tuple<int, bool>>& p) {
                           return "tp" + std::to_string(std::get<0>(p.param)) +
                                  (std::get<1>(p.param) ? "_split_backward_skip" : "");
                         });

// How each GPT parameter is cut: Megatron's layout.
TEST(TpGpt, ParametersAreSplitMegatronStyle) {
  GptModel m = build_gpt(toy(false), kMicro);
  auto world = make_local_world(2);  // building communicates nothing: rank 1 alone will do
  auto store = std::make_shared<ParamStore>();
  (void)tensor_parallel_graph(m.graph, *world[1], store);
  struct Layout {
    std::string name;
    int dim, blocks;
  };
  const std::vector<Layout> want = {{"wte.weight", 0, 1},
                                    {"wpe.weight", -1, 1},
                                    {"h.0.ln_1.weight", -1, 1},
                                    {"h.0.attn.c_attn.weight", 1, 3},
                                    {"h.0.attn.c_attn.bias", 0, 3},
                                    {"h.0.attn.c_proj.weight", 0, 1},
                                    {"h.0.attn.c_proj.bias", -1, 1},
                                    {"h.0.mlp.c_fc.weight", 1, 1},
                                    {"h.0.mlp.c_fc.bias", 0, 1},
                                    {"h.0.mlp.c_proj.weight", 0, 1},
                                    {"h.0.mlp.c_proj.bias", -1, 1},
                                    {"ln_f.bias", -1, 1}};
  for (const Layout& l : want) {
    const Param* p = store->find(l.name);
    ASSERT_NE(p, nullptr) << l.name;
    EXPECT_EQ(p->shard.dim, l.dim) << l.name;
    EXPECT_EQ(std::max<size_t>(p->shard.blocks.size(), 1), static_cast<size_t>(l.blocks))
        << l.name;
    EXPECT_EQ(p->shard.index, 1) << l.name;
    EXPECT_EQ(p->shard.parts, 2) << l.name;
    EXPECT_TRUE(p->init.kind == m.params->find(l.name)->init.kind) << l.name;
    EXPECT_EQ(p->init.value, m.params->find(l.name)->init.value) << l.name;
  }
  EXPECT_EQ(store->find("h.0.attn.c_attn.weight")->value.shape(), (Shape{32, 48}));
  EXPECT_EQ(store->find("h.0.attn.c_attn.bias")->value.shape(), (Shape{48}));
  EXPECT_EQ(store->find("h.0.mlp.c_proj.weight")->value.shape(), (Shape{64, 32}));
}

// --- TpBuild and the errors ---

TEST(TpBuild, SameNameGivesTheSameParamAndItsShard) {
  auto world = make_local_world(4);
  ParamStore logical, local;
  Param* w = logical.create("fc.weight", {8, 24}, Init::normal(0.1f));
  TpBuild build{world[2].get(), &local};
  Param* a = build.param(*w, 1, 3);
  EXPECT_EQ(build.param(*w, 1, 3), a);
  EXPECT_EQ(local.size(), 1u);
  EXPECT_EQ(a->value.shape(), (Shape{8, 6}));
  EXPECT_EQ(a->grad.shape(), (Shape{8, 6}));
  EXPECT_EQ(a->shard.index, 2);
  EXPECT_EQ(a->shard.full, (Shape{8, 24}));
  const std::string msg = error_message([&] { build.param(*w, 0); });
  EXPECT_TRUE(contains(msg, "fc.weight") && contains(msg, "already held along dimension 1")) << msg;
}

TEST(TpBuild, NonDivisibleDimensionNamesParameterAndSizes) {
  auto world = make_local_world(4);
  ParamStore logical, local;
  TpBuild build{world[0].get(), &local};
  Param* w = logical.create("fc.weight", {8, 10}, Init::normal(0.1f));
  std::string msg = error_message([&] { build.param(*w, 1); });
  EXPECT_TRUE(contains(msg,
                       "fc.weight: dimension 1 (10) must be divisible by tensor-parallel "
                       "size (4)"))
      << msg;
  Param* qkv = logical.create("qkv.weight", {8, 18}, Init::normal(0.1f));
  msg = error_message([&] { build.param(*qkv, 1, 3); });
  EXPECT_TRUE(contains(msg,
                       "qkv.weight: dimension 1 (18) must be divisible by tensor-parallel "
                       "size (4) in each of its 3 blocks"))
      << msg;
  EXPECT_EQ(local.size(), 0u);
}

// Config errors come from building the graph, before any communication: one rank's
// communicator is enough to see them.
std::string tp_graph_error(const GptConfig& cfg, int tp) {
  GptModel m = build_gpt(cfg, 1);
  auto world = make_local_world(tp);
  return error_message(
      [&] { (void)tensor_parallel_graph(m.graph, *world[0], std::make_shared<ParamStore>()); });
}

TEST(TpErrors, HeadsNotDivisible) {
  GptConfig cfg = toy(false);
  cfg.hidden_size = 48, cfg.num_heads = 6;  // every width divides by 4: only the heads do not
  const std::string msg = tp_graph_error(cfg, 4);
  EXPECT_TRUE(contains(msg, "attention heads (6) must be divisible by tensor-parallel size (4)"))
      << msg;
  EXPECT_TRUE(contains(msg, "h.0.attn.core")) << msg;
  EXPECT_EQ(tp_graph_error(cfg, 2), "");
}

// Megatron's rule: each tensor-parallel rank holds whole key/value groups.
TEST(TpErrors, QueryGroupsNotDivisible) {
  LlamaConfig cfg;
  cfg.vocab_size = 64, cfg.num_layers = 1, cfg.hidden_size = 32, cfg.num_heads = 4;
  cfg.num_query_groups = 1, cfg.seq_length = 8;
  LlamaModel m = build_llama(cfg, 1);
  auto world = make_local_world(2);
  const std::string msg = error_message(
      [&] { (void)tensor_parallel_graph(m.graph, *world[0], std::make_shared<ParamStore>()); });
  EXPECT_TRUE(contains(msg, "query groups (1) must be divisible by tensor-parallel size (2)"))
      << msg;
  EXPECT_TRUE(contains(msg, "h.0.attn")) << msg;
  cfg.num_query_groups = 2;
  LlamaModel ok = build_llama(cfg, 1);
  EXPECT_EQ(error_message([&] {
              (void)tensor_parallel_graph(ok.graph, *world[0], std::make_shared<ParamStore>());
            }),
            "");
}

TEST(TpErrors, VocabularyNotDivisible) {
  GptConfig cfg = toy(false);
  cfg.vocab_size = 257;
  const std::string msg = tp_graph_error(cfg, 2);
  EXPECT_TRUE(contains(msg, "vocabulary (257) must be divisible by tensor-parallel size (2)"))
      << msg;
  EXPECT_TRUE(contains(msg, "embed")) << msg;

  // The head alone says the same.
  ParamStore logical, local;
  TiedLmHeadLoss head(logical.create("wte", {257, 8}, Init::normal(0.1f)));
  auto world = make_local_world(2);
  TpBuild build{world[1].get(), &local};
  const std::string head_msg = error_message([&] { (void)head.tensor_parallel(build); });
  EXPECT_TRUE(contains(head_msg, "vocabulary (257) must be divisible by tensor-parallel size (2)"))
      << head_msg;
}

// A layer kind without a parallel form.
class Doubler final : public Layer {
 public:
  const char* kind() const override { return "doubler"; }
  std::vector<Shape> output_shapes(std::span<const Shape> in) const override { return {in[0]}; }
  void forward(LayerCtx&, Arena&, std::span<const Tensor> in,
               std::span<const Tensor> out) override {
    for (int64_t i = 0; i < in[0].numel(); ++i)
      out[0].data<float>()[i] = 2 * in[0].data<float>()[i];
  }
  void backward_input(LayerCtx&, Arena&, std::span<const Tensor>,
                      std::span<const Tensor>) override {}
};

TEST(TpErrors, LayerWithoutParallelForm) {
  auto params = std::make_shared<ParamStore>();
  Graph g(params);
  const int x = g.input("x", {2, 4}, DType::F32, true);
  g.mark_output(g.add1("twice", std::make_unique<Doubler>(), {x}));
  auto world = make_local_world(2);
  const std::string msg = error_message(
      [&] { (void)tensor_parallel_graph(g, *world[0], std::make_shared<ParamStore>()); });
  EXPECT_TRUE(contains(msg, "twice (doubler)")) << msg;
  EXPECT_TRUE(contains(msg, "layers of kind 'doubler' have no tensor-parallel form")) << msg;
}

// Sequence parallelism refuses, naming the node, what would silently see
// 1/tp of the tokens: a layer between regions that is not token by token,
// and a layer that splits parameters with no sequence-parallel form. At tp
// 1 there is nothing to split.
class SequenceMean final : public Layer {  // (B, T, C) -> (B, C)
 public:
  const char* kind() const override { return "sequence_mean"; }
  std::vector<Shape> output_shapes(std::span<const Shape> in) const override {
    return {Shape{in[0][0], in[0][2]}};
  }
  void forward(LayerCtx&, Arena&, std::span<const Tensor>, std::span<const Tensor>) override {}
  void backward_input(LayerCtx&, Arena&, std::span<const Tensor>,
                      std::span<const Tensor>) override {}
  std::unique_ptr<Layer> tensor_parallel(TpBuild&) const override {
    return std::make_unique<SequenceMean>();
  }
};

class ColumnsOnly final : public Layer {  // x W, W split by columns, no sequence form
 public:
  explicit ColumnsOnly(Param* w) : w_(w) {}
  const char* kind() const override { return "columns_only"; }
  std::vector<Shape> output_shapes(std::span<const Shape> in) const override {
    Shape s = in[0];
    s[s.rank - 1] = w_->value.dim(1);
    return {s};
  }
  std::vector<Param*> params() const override { return {w_}; }
  void forward(LayerCtx&, Arena&, std::span<const Tensor>, std::span<const Tensor>) override {}
  void backward_input(LayerCtx&, Arena&, std::span<const Tensor>,
                      std::span<const Tensor>) override {}
  std::unique_ptr<Layer> tensor_parallel(TpBuild& build) const override {
    return std::make_unique<ColumnsOnly>(build.param(*w_, 1));
  }

 private:
  Param* w_;
};

TEST(TpErrors, SequenceParallelRefusesWhatWouldSeeOnlyItsTokens) {
  auto graph_with = [](auto make_layer) {
    auto params = std::make_shared<ParamStore>();
    Graph g(params);
    const int tokens = g.input("tokens", {2, 8}, DType::I32);
    Param* wte = params->create("wte", {16, 4}, Init::normal(0.1f));
    const int x = g.add1("embed", std::make_unique<Embedding>(wte, nullptr), {tokens});
    g.mark_output(g.add1("odd", make_layer(*params), {x}));
    return g;
  };
  const Graph pooled = graph_with([](ParamStore&) { return std::make_unique<SequenceMean>(); });
  EXPECT_EQ(error_message([&] { check_tensor_parallel(pooled, 2); }), "");
  std::string msg = error_message([&] { check_tensor_parallel(pooled, 2, true); });
  EXPECT_TRUE(contains(msg,
                       "odd (sequence_mean): under --sequence-parallel its input holds 1/2 "
                       "of the tokens, and its output [2, 4] (whole: [2, 4]) does not"))
      << msg;
  const Graph columns = graph_with([](ParamStore& p) {
    return std::make_unique<ColumnsOnly>(p.create("w", {4, 8}, Init::normal(0.1f)));
  });
  EXPECT_EQ(error_message([&] { check_tensor_parallel(columns, 2); }), "");
  msg = error_message([&] { check_tensor_parallel(columns, 2, true); });
  EXPECT_TRUE(contains(msg,
                       "odd (columns_only): --sequence-parallel needs every layer that "
                       "splits parameters"))
      << msg;
  msg = error_message([&] { check_tensor_parallel(columns, 1, true); });
  EXPECT_TRUE(contains(msg, "--sequence-parallel needs --tensor-model-parallel-size above 1"))
      << msg;
  // A sequence that does not divide, named by the embedding.
  msg = error_message([&] { check_tensor_parallel(pooled, 16, true); });
  EXPECT_TRUE(contains(msg, "embed")) << msg;
  EXPECT_TRUE(contains(msg, "must be divisible by tensor-parallel size (16)")) << msg;
}

}  // namespace
}  // namespace weft
