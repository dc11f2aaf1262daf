#include "models/llama.h"

#include "layers/attention.h"
#include "layers/embedding.h"
#include "layers/linear.h"
#include "layers/lm_head.h"
#include "layers/residual.h"
#include "layers/rmsnorm.h"
#include "layers/rotary.h"
#include "layers/swiglu.h"

#include <fmt/core.h>

#include <cmath>

namespace weft {

int64_t LlamaConfig::ffn() const {
  if (ffn_hidden_size > 0) return ffn_hidden_size;
  const int64_t f = 8 * hidden_size / 3;
  return (f + 63) / 64 * 64;
}

void LlamaConfig::validate() const {
  check(vocab_size > 0, "--vocab-size ({}) must be positive", vocab_size);
  check(padded_vocab_size == 0 || padded_vocab_size >= vocab_size,
        "the padded vocabulary ({}) must not be smaller than --vocab-size ({})",
        padded_vocab_size, vocab_size);
  check(num_layers > 0, "--num-layers ({}) must be positive", num_layers);
  check(num_heads > 0 && hidden_size % num_heads == 0,
        "--hidden-size ({}) must be divisible by --num-attention-heads ({})", hidden_size,
        num_heads);
  check((hidden_size / num_heads) % 2 == 0,
        "the head size {} (--hidden-size / --num-attention-heads) must be even for rotary "
        "embedding",
        hidden_size / num_heads);
  check(num_query_groups >= 0, "--num-query-groups ({}) must not be negative", num_query_groups);
  check(num_heads % groups() == 0,
        "--num-query-groups ({}) must divide --num-attention-heads ({})", groups(), num_heads);
  check(seq_length > 0, "--seq-length ({}) must be positive", seq_length);
  check(ffn_hidden_size >= 0, "--ffn-hidden-size ({}) must not be negative", ffn_hidden_size);
  check(rope_base > 0, "--rotary-base ({}) must be positive", rope_base);
}

LlamaModel build_llama(const LlamaConfig& cfg, int64_t micro_batch) {
  cfg.validate();
  check(micro_batch > 0, "--micro-batch-size ({}) must be positive", micro_batch);
  auto params = std::make_shared<ParamStore>();
  ParamStore& ps = *params;
  const int64_t c = cfg.hidden_size, f = cfg.ffn(), L = cfg.num_layers;
  const int64_t heads = cfg.num_heads, groups = cfg.groups(), kv = groups * (c / heads);
  const float proj_std = 0.02f / std::sqrt(2.0f * static_cast<float>(L));
  auto norm = [&](const std::string& name) {
    return std::make_unique<RmsNorm>(ps.create(name + ".weight", {c}, Init::constant(1)),
                                     cfg.norm_eps);
  };
  auto linear = [&](const std::string& name, int64_t in, std::vector<int64_t> out_blocks,
                    float std, ParallelRole role) {
    int64_t out = 0;
    for (int64_t w : out_blocks) out += w;
    return std::make_unique<Linear>(ps.create(name + ".weight", {in, out}, Init::normal(std)),
                                    nullptr, role, std::move(out_blocks));
  };

  LlamaModel m{params, Graph(params), {}, -1, -1, -1, nullptr};
  Graph& g = m.graph;
  const int64_t B = micro_batch, T = cfg.seq_length;
  m.tokens = g.input("tokens", {B, T}, DType::I32);
  m.targets = g.input("targets", {B, T}, DType::I32);
  if (cfg.reset_position_ids || cfg.reset_attention_mask)
    m.positions = g.input("positions", {B, T}, DType::I32);
  auto with_positions = [&](int v, bool yes) {
    return yes ? std::vector<int>{v, m.positions} : std::vector<int>{v};
  };
  // Padding rows past vocab_size (Param::true_rows), as GPT's.
  auto vocab_table = [&](const std::string& name) {
    Param* p = ps.create(name, {cfg.table_rows(), c}, Init::normal(0.02f));
    if (cfg.table_rows() > cfg.vocab_size) p->true_rows = cfg.vocab_size;
    return p;
  };
  Param* wte = vocab_table("wte.weight");
  int x = g.add1("embed", std::make_unique<Embedding>(wte, nullptr), {m.tokens});
  for (int64_t i = 0; i < L; ++i) {
    const std::string h = fmt::format("h.{}", i);
    int a = g.add1(h + ".input_norm", norm(h + ".input_norm"), {x});
    a = g.add1(h + ".attn.qkv",
               linear(h + ".attn.qkv", c, {c, kv, kv}, 0.02f, ParallelRole::Column), {a});
    a = g.add1(h + ".attn.rotary", std::make_unique<Rotary>(heads, groups, cfg.rope_base),
               with_positions(a, cfg.reset_position_ids));
    a = g.add1(h + ".attn.core", std::make_unique<CausalSelfAttention>(heads, groups),
               with_positions(a, cfg.reset_attention_mask));
    a = g.add1(h + ".attn.o", linear(h + ".attn.o", c, {c}, proj_std, ParallelRole::Row), {a});
    x = g.add1(h + ".res_1", std::make_unique<Residual>(), {x, a});
    int y = g.add1(h + ".post_attn_norm", norm(h + ".post_attn_norm"), {x});
    y = g.add1(h + ".mlp.gate_up",
               linear(h + ".mlp.gate_up", c, {f, f}, 0.02f, ParallelRole::Column), {y});
    y = g.add1(h + ".mlp.swiglu", std::make_unique<SwiGlu>(), {y});
    y = g.add1(h + ".mlp.down", linear(h + ".mlp.down", f, {c}, proj_std, ParallelRole::Row), {y});
    x = g.add1(h + ".res_2", std::make_unique<Residual>(), {x, y});
  }
  x = g.add1("norm", norm("norm"), {x});
  Param* head = vocab_table("lm_head.weight");
  auto lm_head = std::make_unique<TiedLmHeadLoss>(head);
  m.head = lm_head.get();
  const int loss = g.add1("lm_head", std::move(lm_head), {x, m.targets});
  g.mark_output(loss);
  m.io = ModelIO{&m.graph, {m.tokens, m.targets}, loss, T};
  if (m.positions >= 0) m.io.inputs.push_back(m.positions);
  return m;
}

void init_llama(LlamaModel& model, uint64_t seed) {
  for (Param* p : model.params->all()) init_param(*p, seed);
}

}  // namespace weft
