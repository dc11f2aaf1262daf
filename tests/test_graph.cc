// Graphs: shapes, parameter counts and FLOPs of the models, and shape errors.
#include <weft/graph.h>
#include <weft/ops.h>
#include <weft/runner.h>

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "layers/linear.h"
#include "layers/residual.h"
#include "models/gpt.h"
#include "models/mlp.h"

namespace weft {
namespace {

TEST(Graph, Gpt2PresetHasGpt2SmallParameterCount) {
  const GptConfig c = gpt_preset("gpt2");
  EXPECT_EQ(c.param_count(), 124439808);  // Hugging Face gpt2, wpe included, head tied
}

TEST(Graph, GptGraphCountsMatchTheConfig) {
  for (const char* name : {"toy", "mini"}) {
    GptConfig c = gpt_preset(name);
    GptModel m = build_gpt(c, 2);
    EXPECT_EQ(m.graph.param_count(), c.param_count()) << name;
    // wte is shared by the embedding and the head but counted once.
    EXPECT_EQ(m.graph.params().size(), 2u + 12u * static_cast<size_t>(c.num_layers) + 2u);
    EXPECT_EQ(m.graph.params().front()->name, "wte.weight");
    // 2 per multiply-add over the weight matrices (head included, wpe not),
    // plus attention's 4 B T^2 C per layer; the element-wise layers add a little.
    const double tokens = 2.0 * static_cast<double>(c.seq_length);
    const double matmul = 2.0 * tokens *
                          static_cast<double>(12 * c.num_layers * c.hidden_size * c.hidden_size +
                                              c.vocab_size * c.hidden_size);
    const double attn = 4.0 * tokens * static_cast<double>(c.seq_length * c.hidden_size * c.num_layers);
    const double f = m.graph.forward_flops();
    EXPECT_GE(f, matmul + attn);
    EXPECT_LT(f, 1.05 * (matmul + attn)) << name;
  }
}

TEST(Graph, GptValuesHaveTheExpectedShapes) {
  GptConfig c = gpt_preset("toy");
  GptModel m = build_gpt(c, 3);
  auto shape = [&](const std::string& v) {
    int id = m.graph.find_value(v);
    EXPECT_GE(id, 0) << v;
    return id < 0 ? Shape{} : m.graph.values()[static_cast<size_t>(id)].shape;
  };
  EXPECT_EQ(shape("embed"), (Shape{3, 64, 64}));
  EXPECT_EQ(shape("h.0.attn.c_attn"), (Shape{3, 64, 192}));
  EXPECT_EQ(shape("h.1.mlp"), (Shape{3, 64, 64}));  // (its hidden 256 stays inside the node)
  EXPECT_EQ(shape("lm_head"), (Shape{1}));
  // A block's input, on the residual stream, is read by ln_1 and by the
  // add fused with ln_2; that node's sum, the stream, by the add that ends
  // the block alone, and its LayerNorm by the MLP.
  const Value& x = m.graph.values()[static_cast<size_t>(m.graph.find_value("h.0.res_2"))];
  EXPECT_EQ(x.consumers.size(), 2u);
  EXPECT_EQ(shape("h.0.ln_2:0"), (Shape{3, 64, 64}));
  EXPECT_EQ(shape("h.0.ln_2:1"), (Shape{3, 64, 64}));
  const auto& stream = m.graph.values()[static_cast<size_t>(m.graph.find_value("h.0.ln_2:0"))];
  ASSERT_EQ(stream.consumers.size(), 1u);
  EXPECT_EQ(m.graph.nodes()[static_cast<size_t>(stream.consumers[0])].name, "h.0.res_2");
  EXPECT_FALSE(m.graph.values()[static_cast<size_t>(m.tokens)].requires_grad);
}

// bf16 activations: every value one node writes and another reads is
// stored in bf16; the tokens stay int32 and the loss, read by the host, fp32.
TEST(Graph, ActivationDtypeTypesTheValuesBetweenNodes) {
  GptModel m = build_gpt(gpt_preset("toy"), 2);
  m.graph.set_activation_dtype(DType::BF16);
  EXPECT_EQ(m.graph.activation_dtype(), DType::BF16);
  int bf16 = 0;
  for (const Value& v : m.graph.values()) {
    if (v.producer < 0) {
      EXPECT_EQ(v.dtype, DType::I32) << v.name;
    } else if (v.consumers.empty()) {
      EXPECT_EQ(v.dtype, DType::F32) << v.name;
    } else {
      EXPECT_EQ(v.dtype, DType::BF16) << v.name;
      ++bf16;
    }
  }
  EXPECT_GT(bf16, 10);
  EXPECT_EQ(m.graph.values()[static_cast<size_t>(m.graph.find_value("lm_head"))].dtype,
            DType::F32);
  m.graph.set_activation_dtype(DType::F32);
  for (const Value& v : m.graph.values())
    if (v.producer >= 0) {
      EXPECT_EQ(v.dtype, DType::F32) << v.name;
    }
  EXPECT_THROW(m.graph.set_activation_dtype(DType::I32), Error);
}

// What a forward holds in its arena with bf16 activations: every value
// between nodes at half its fp32 bytes, the LM head's logits (N, V) too
// (bf16, replaced by bf16 dlogits in place), and everything else (the
// norms' statistics, attention's probabilities, the losses, the inputs, the
// loss) as in fp32. Predicted from the graph's shapes to the byte: the
// arena rounds each tensor up to its 64-byte alignment (Arena::bytes_for).
TEST(Graph, Bf16ActivationsHalveTheValuesAForwardHolds) {
  auto forward_bytes = [](DType acts, size_t* between_fp32, size_t* between_bf16) {
    GptModel m = build_gpt(gpt_preset("toy"), 2);
    init_gpt(m, 1);
    m.graph.set_activation_dtype(acts);
    *between_fp32 = *between_bf16 = 0;
    for (const Value& v : m.graph.values())
      if (v.producer >= 0 && !v.consumers.empty()) {
        *between_fp32 += Arena::bytes_for(v.shape, DType::F32);
        *between_bf16 += Arena::bytes_for(v.shape, DType::BF16);
      }
    // Each MLP node keeps its hidden pre-activation and activation, (B T, 4C)
    // each, in the activations' dtype too.
    const GptConfig c = gpt_preset("toy");
    const Shape hidden{2 * c.seq_length, 4 * c.hidden_size};
    for (const Node& n : m.graph.nodes())
      if (std::string(n.layer->kind()) == "gelu_mlp") {
        *between_fp32 += 2 * Arena::bytes_for(hidden, DType::F32);
        *between_bf16 += 2 * Arena::bytes_for(hidden, DType::BF16);
      }
    MicroBatch mb(m.graph);
    mb.input(m.tokens).zero_();
    mb.input(m.targets).zero_();
    forward(m.graph, mb, 0, static_cast<int>(m.graph.nodes().size()));
    return mb.arena().used();
  };
  size_t f32 = 0, b16 = 0;
  const size_t fp32 = forward_bytes(DType::F32, &f32, &b16);
  const size_t bf16 = forward_bytes(DType::BF16, &f32, &b16);
  const GptModel shapes = build_gpt(gpt_preset("toy"), 2);
  const Shape logits{shapes.graph.values()[static_cast<size_t>(shapes.targets)].shape.numel(),
                     shapes.head->params()[0]->value.dim(0)};
  EXPECT_EQ(bf16, fp32 - f32 + b16 - Arena::bytes_for(logits, DType::F32) +
                      Arena::bytes_for(logits, DType::BF16));
  std::printf("toy, B 2: a forward holds %zu bytes in fp32, %zu with bf16 activations\n", fp32,
              bf16);
}

// The toy model's tokens and targets: i * stride % 50 at position i.
void fill_tokens(const GptModel& m, MicroBatch& mb, int64_t stride) {
  for (int v : {m.tokens, m.targets}) {
    Tensor t = mb.input(v);
    for (int64_t i = 0; i < t.numel(); ++i)
      t.data<int32_t>()[i] = static_cast<int32_t>(i * stride % 50);
  }
}

// Gradients that a layer writes whole (linear layers, residual adds) get
// uninitialised buffers: the second pass through one MicroBatch reuses the
// first pass's arena, whose bytes hold the first pass's gradients at the
// same places, so a layer that added to its fresh buffer instead of writing
// it would give twice the gradients. Both passes must agree bit for bit.
// Both with fp32 activations and with bf16 ones (whose gradients are bf16).
void expect_fresh_buffers_written(DType acts) {
  GptModel m = build_gpt(gpt_preset("toy"), 2);
  init_gpt(m, 3);
  m.graph.set_activation_dtype(acts);
  MicroBatch mb(m.graph);
  const int n = static_cast<int>(m.graph.nodes().size());
  // Three passes: the first reset() replaces the arena's blocks by one (new
  // memory, zeros from the system); the third pass reuses the second's bytes.
  std::vector<std::vector<float>> grads[3];
  for (auto& pass : grads) {
    for (Param* p : m.graph.params()) p->grad.zero_();
    fill_tokens(m, mb, 1);
    forward(m.graph, mb, 0, n);
    mb.seed_grad(m.io.loss, 1.0f);
    backward(m.graph, mb, 0, n);
    for (Param* p : m.graph.params())
      pass.emplace_back(p->grad.data<float>(), p->grad.data<float>() + p->grad.numel());
    mb.reset();
  }
  EXPECT_EQ(grads[0], grads[1]);
  EXPECT_EQ(grads[0], grads[2]);
}

TEST(Graph, FreshGradientBuffersAreWrittenNotAddedTo) {
  for (DType acts : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_name(acts));
    expect_fresh_buffers_written(acts);
  }
}


// A loss layer takes its gradient from the runner's seed (what seed_grad
// was given, known on the host) rather than reading the gradient tensor back,
// which on a GPU would wait for it: a seed tensor overwritten after seeding
// changes nothing, and the parameter gradients are the seed's.
TEST(Graph, ALossLayerTakesItsSeededGradientFromTheRunner) {
  auto grads = [](bool overwrite) {
    GptModel m = build_gpt(gpt_preset("toy"), 2);
    init_gpt(m, 9);
    MicroBatch mb(m.graph);
    const int n = static_cast<int>(m.graph.nodes().size());
    fill_tokens(m, mb, 3);
    for (Param* p : m.graph.params()) p->grad.zero_();
    forward(m.graph, mb, 0, n);
    mb.seed_grad(m.io.loss, 0.25f);
    if (overwrite) ops::fill(mb.grad(m.io.loss), 7.0f);
    backward(m.graph, mb, 0, n);
    std::vector<float> out;
    for (Param* p : m.graph.params())
      out.insert(out.end(), p->grad.data<float>(), p->grad.data<float>() + p->grad.numel());
    return out;
  };
  const std::vector<float> seeded = grads(false);
  EXPECT_EQ(grads(true), seeded);
  bool nonzero = false;
  for (float g : seeded) nonzero = nonzero || g != 0.0f;
  EXPECT_TRUE(nonzero);
}

// With bf16 activations, each value's gradient is bf16 as the value is (what
// a layer's I writes, what a pipeline stage sends back), and the parameters'
// gradients stay fp32; they are the fp32-activation run's within bf16's
// rounding, and not that run's bit for bit.
TEST(Graph, Bf16ActivationsHaveBf16GradientsAndFp32ParameterGradients) {
  auto grads = [](DType acts, int* bf16_grads) {
    GptModel m = build_gpt(gpt_preset("toy"), 2);
    init_gpt(m, 5);
    m.graph.set_activation_dtype(acts);
    MicroBatch mb(m.graph);
    const int n = static_cast<int>(m.graph.nodes().size());
    fill_tokens(m, mb, 7);
    for (Param* p : m.graph.params()) p->grad.zero_();
    forward(m.graph, mb, 0, n);
    mb.seed_grad(m.io.loss, 1.0f);
    *bf16_grads = 0;
    for (int k = n - 1; k >= 0; --k) {
      backward_input(m.graph, mb, k);
      for (int v : m.graph.nodes()[static_cast<size_t>(k)].inputs) {
        const Value& val = m.graph.values()[static_cast<size_t>(v)];
        if (!val.requires_grad) continue;
        EXPECT_EQ(mb.grad(v).dtype(), val.dtype) << val.name;
        *bf16_grads += mb.grad(v).dtype() == DType::BF16;
      }
      backward_weight(m.graph, mb, k);
    }
    std::vector<std::vector<float>> out;
    for (Param* p : m.graph.params()) {
      EXPECT_EQ(p->grad.dtype(), DType::F32) << p->name;
      out.emplace_back(p->grad.data<float>(), p->grad.data<float>() + p->grad.numel());
    }
    return out;
  };
  int none = 0, some = 0;
  const auto fp32 = grads(DType::F32, &none);
  const auto bf16 = grads(DType::BF16, &some);
  EXPECT_EQ(none, 0);
  EXPECT_GT(some, 10);
  // Each parameter's gradient against the fp32 run's, relative to the
  // tensor's largest element: bf16 stores every activation and activation
  // gradient with 8 significant bits (2^-9 relative), and a gradient element
  // is a sum over the batch's rows of products of two such values, each
  // after a chain of a few roundings through the toy model's 2 blocks: a
  // few times 2^-8 of the tensor's scale: 2^-6.
  ASSERT_EQ(fp32.size(), bf16.size());
  bool identical = true;
  for (size_t i = 0; i < fp32.size(); ++i) {
    float scale = 0;
    for (float x : fp32[i]) scale = std::max(scale, std::abs(x));
    for (size_t j = 0; j < fp32[i].size(); ++j)
      ASSERT_NEAR(bf16[i][j], fp32[i][j], std::ldexp(scale, -6)) << "parameter " << i;
    identical = identical && fp32[i] == bf16[i];
  }
  EXPECT_FALSE(identical);
}

// A --bf16 batch's weight copies (Bf16Copies, one ops::convert_multi): in
// the scope every parameter's value16 is its value rounded to bf16, bit for
// bit what convert gives it alone; out of it value16 is dropped. A second
// batch reuses the copies' memory and the lists' capacity, and rounds the
// values as they are then (the optimizer's update between batches); the
// lists hold no tensor between batches. An fp32 graph makes no copy.
TEST(Graph, Bf16CopiesRoundEveryWeightAndReuseTheirMemory) {
  GptModel m = build_gpt(gpt_preset("toy"), 2);
  init_gpt(m, 9);
  const std::vector<Param*> params = m.graph.params();
  Bf16Tables tables;
  {
    const Bf16Copies none(m.graph, params, tables);
    for (const Param* p : params)
      EXPECT_FALSE(p->value16.defined() || p->value16_store.defined()) << p->name;
  }
  m.graph.set_activation_dtype(DType::BF16);
  std::vector<const void*> stores;
  for (int batch = 0; batch < 2; ++batch) {
    SCOPED_TRACE(batch);
    if (batch == 1)
      for (Param* p : params) ops::scale(p->value, 0.75f);
    {
      const Bf16Copies copies(m.graph, params, tables);
      EXPECT_TRUE(tables.values.empty() && tables.copies.empty());
      for (size_t i = 0; i < params.size(); ++i) {
        const Param& p = *params[i];
        ASSERT_TRUE(p.value16.defined()) << p.name;
        ASSERT_EQ(p.value16.dtype(), DType::BF16) << p.name;
        ASSERT_EQ(p.value16.shape(), p.value.shape()) << p.name;
        const Tensor want = Tensor::empty(p.value.shape(), DType::BF16);
        ops::convert(p.value, want);
        EXPECT_EQ(std::memcmp(p.value16.raw(), want.raw(),
                              static_cast<size_t>(p.value.numel()) * sizeof(uint16_t)),
                  0)
            << p.name;
        if (batch == 0) stores.push_back(p.value16.raw());
        EXPECT_EQ(p.value16.raw(), stores[i]) << p.name << ": the copy moved";
      }
    }
    for (const Param* p : params) EXPECT_FALSE(p->value16.defined()) << p->name;
  }
  EXPECT_GE(tables.values.capacity(), params.size());
}

TEST(Graph, ShapeErrorsNameTheNodeAndShapes) {
  auto ps = std::make_shared<ParamStore>();
  Graph g(ps);
  int x = g.input("x", {2, 8}, DType::F32, true);
  Param* w = ps->create("w", {4, 3}, Init::normal(0.1f));
  try {
    g.add("proj", std::make_unique<Linear>(w, nullptr), {x});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("proj"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("8"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("4"), std::string::npos) << e.what();
  }
  EXPECT_THROW(g.add("bad", std::make_unique<Residual>(), {x, 7}), Error);
}

TEST(Graph, ConfigErrorsNameTheRule) {
  GptConfig c = gpt_preset("toy");
  c.num_heads = 6;
  EXPECT_THROW(c.validate(), Error);
  c = gpt_preset("toy");
  c.max_positions = 32;
  EXPECT_THROW(build_gpt(c, 1), Error);
  EXPECT_THROW(gpt_preset("gpt5"), Error);
}

// A skip connection: the graph input is read again three nodes later, so its
// gradient gets two contributions.
TEST(Graph, SkipConnectionGradientAccumulates) {
  auto ps = std::make_shared<ParamStore>();
  Graph g(ps);
  int x = g.input("x", {1, 3}, DType::F32, true);
  Param* w = ps->create("w", {3, 3}, Init::constant(0));
  for (int i = 0; i < 3; ++i) w->value.data<float>()[i * 3 + i] = 2.0f;  // 2 I
  int h = g.add1("fc", std::make_unique<Linear>(w, nullptr), {x});
  int y = g.add1("skip", std::make_unique<Residual>(), {x, h});
  MicroBatch mb(g);
  Tensor in = mb.input(x);
  for (int i = 0; i < 3; ++i) in.data<float>()[i] = static_cast<float>(i + 1);
  forward(g, mb, 0, 2);
  EXPECT_FLOAT_EQ(mb.value(y).data<float>()[2], 9.0f);  // 3 + 2*3
  Tensor& gy = mb.grad(y);
  gy = mb.arena().zeros({1, 3});
  gy.data<float>()[1] = 1.0f;
  backward(g, mb, 0, 2);
  EXPECT_FLOAT_EQ(mb.grad(x).data<float>()[1], 3.0f);  // 1 (skip) + 2 (through W)
  EXPECT_FLOAT_EQ(w->grad.data<float>()[1 * 3 + 1], 2.0f);  // x[1] * dy[1]
  // Each node's output gradients are dropped once its W is done (on a GPU
  // that frees them); the graph input's stays for whoever asked for it.
  EXPECT_FALSE(mb.grad(y).defined());
  EXPECT_FALSE(mb.grad(h).defined());
  EXPECT_TRUE(mb.grad(x).defined());
}

// A residual branch's gradient is the output's gradient buffer itself, not
// a copy (Layer::may_share_input_grad), where the branch's value has no
// other reader; the stream (read twice), a value added to itself, and the
// second of two single-reader inputs each get a buffer of their own. The
// gradients are those of the copies.
TEST(Graph, AResidualBranchTakesItsOutputsGradientBuffer) {
  auto ps = std::make_shared<ParamStore>();
  Graph g(ps);
  const int x = g.input("x", {1, 3}, DType::F32, true);
  const int u = g.input("u", {1, 3}, DType::F32, true);
  Param* w = ps->create("w", {3, 3}, Init::constant(0));
  for (int i = 0; i < 3; ++i) w->value.data<float>()[i * 3 + i] = 2.0f;  // 2 I
  const int h = g.add1("fc", std::make_unique<Linear>(w, nullptr), {x});
  const int y = g.add1("skip", std::make_unique<Residual>(), {x, h});      // x read twice
  const int z = g.add1("twice", std::make_unique<Residual>(), {u, u});     // u + u
  const int r = g.add1("both", std::make_unique<Residual>(), {y, z});      // each read once
  MicroBatch mb(g);
  mb.input(x).zero_();
  mb.input(u).zero_();
  forward(g, mb, 0, 4);
  Tensor& gr = mb.grad(r);
  gr = mb.arena().zeros({1, 3});
  gr.data<float>()[1] = 1.0f;
  const void* out = gr.raw();
  backward_input(g, mb, 3);  // both: y shares r's buffer, z (the second) gets its own
  EXPECT_EQ(mb.grad(y).raw(), out);
  EXPECT_NE(mb.grad(z).raw(), out);
  backward_weight(g, mb, 3);
  backward_input(g, mb, 2);  // twice: u is read twice by it, so it is not shared
  EXPECT_NE(mb.grad(u).raw(), mb.grad(z).raw());
  backward_weight(g, mb, 2);
  backward_input(g, mb, 1);  // skip: h shares y's buffer, x (read by fc too) does not
  EXPECT_EQ(mb.grad(h).raw(), out);
  EXPECT_NE(mb.grad(x).raw(), out);
  backward_weight(g, mb, 1);
  backward(g, mb, 0, 1);
  EXPECT_FLOAT_EQ(mb.grad(x).data<float>()[1], 3.0f);  // 1 (skip) + 2 (through W)
  EXPECT_FLOAT_EQ(mb.grad(u).data<float>()[1], 2.0f);  // 1 + 1
  EXPECT_FLOAT_EQ(mb.grad(x).data<float>()[0], 0.0f);
  EXPECT_FLOAT_EQ(w->grad.data<float>()[1 * 3 + 1], 0.0f);  // x = 0
}

// In a GPT block the add fused with ln_2 has two outputs; the runner still
// hands the attention branch (read by that node alone) the buffer of output
// 0's gradient, which the node updates in place, and the block's input (read
// by ln_1 too) a buffer of its own. The stream between the two adds is read
// by the block's last add alone, which shares its buffer with it in turn.
TEST(Graph, TheAddFusedWithLayerNormSharesItsStreamsBufferWithTheBranch) {
  GptModel m = build_gpt(gpt_preset("toy"), 1);
  init_gpt(m, 3);
  const Graph& g = m.graph;
  const int n = static_cast<int>(g.nodes().size());
  auto value = [&](const char* name) {
    const int v = g.find_value(name);
    EXPECT_GE(v, 0) << name;
    return v;
  };
  int fused = -1;
  for (int k = 0; k < n; ++k)
    if (g.nodes()[static_cast<size_t>(k)].name == "h.1.ln_2") fused = k;
  ASSERT_GE(fused, 0);
  MicroBatch mb(g);
  for (int64_t i = 0; i < mb.input(m.tokens).numel(); ++i) {
    mb.input(m.tokens).data<int32_t>()[i] = static_cast<int32_t>(i % 7);
    mb.input(m.targets).data<int32_t>()[i] = static_cast<int32_t>(i % 5);
  }
  forward(g, mb, 0, n);
  mb.seed_grad(m.io.loss, 1.0f);
  for (int k = n - 1; k > fused; --k) {
    backward_input(g, mb, k);
    if (g.nodes()[static_cast<size_t>(k)].name == "h.1.res_2") {
      EXPECT_EQ(mb.grad(value("h.1.ln_2:0")).raw(), mb.grad(value("h.1.res_2")).raw());
    }
    backward_weight(g, mb, k);
  }
  const Tensor stream = mb.grad(value("h.1.ln_2:0"));
  const Tensor before = stream.clone();
  backward_input(g, mb, fused);
  EXPECT_EQ(mb.grad(value("h.1.attn.c_proj")).raw(), stream.raw());
  EXPECT_NE(mb.grad(value("h.0.res_2")).raw(), stream.raw());
  // Both inputs' gradients hold the stream's plus LayerNorm's, the same values.
  EXPECT_EQ(0, std::memcmp(mb.grad(value("h.0.res_2")).raw(), stream.raw(), stream.nbytes()));
  EXPECT_NE(0, std::memcmp(before.raw(), stream.raw(), stream.nbytes()));
}

}  // namespace
}  // namespace weft
