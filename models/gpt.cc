#include "models/gpt.h"

#include <weft/runner.h>

#include "layers/attention.h"
#include "layers/embedding.h"
#include "layers/gelu_mlp.h"
#include "layers/layernorm.h"
#include "layers/linear.h"
#include "layers/residual.h"

#include <cmath>
#include <random>
#include <utility>

namespace weft {

int64_t padded_vocab(int64_t vocab, int64_t multiple) {
  check(multiple >= 1, "a vocabulary is padded to a multiple of at least 1, not {}", multiple);
  return (vocab + multiple - 1) / multiple * multiple;
}

namespace {
// Marks the rows of a vocabulary table past `vocab` as padding.
Param* vocab_table(Param* p, int64_t vocab) {
  if (p->value.dim(0) > vocab) p->true_rows = vocab;
  return p;
}
}  // namespace

void GptConfig::validate() const {
  check(num_layers > 0, "--num-layers ({}) must be at least 1", num_layers);
  check(hidden_size > 0, "--hidden-size ({}) must be positive", hidden_size);
  check(num_heads > 0, "--num-attention-heads ({}) must be positive", num_heads);
  check(hidden_size % num_heads == 0,
        "--num-attention-heads ({}) must divide --hidden-size ({})", num_heads, hidden_size);
  check(seq_length > 0, "--seq-length ({}) must be positive", seq_length);
  check(vocab_size > 0 && vocab_size <= (int64_t{1} << 31) - 1,
        "--vocab-size ({}) must be between 1 and 2^31-1", vocab_size);
  check(padded_vocab_size == 0 ||
            (padded_vocab_size >= vocab_size && padded_vocab_size <= (int64_t{1} << 31) - 1),
        "the padded vocabulary ({}) must be between --vocab-size ({}) and 2^31-1",
        padded_vocab_size, vocab_size);
  check(seq_length <= positions(),
        "--seq-length ({}) must not exceed --max-position-embeddings ({})", seq_length,
        positions());
}

int64_t GptConfig::param_count() const {
  const int64_t c = hidden_size;
  const int64_t per_layer = 2 * c + (c * 3 * c + 3 * c) + (c * c + c) + 2 * c + (c * 4 * c + 4 * c) +
                            (4 * c * c + c);
  return vocab_size * c + positions() * c + num_layers * per_layer + 2 * c;
}

double GptConfig::train_flops_per_token() const {
  const double n = static_cast<double>(param_count() - positions() * hidden_size);
  return 6.0 * n + 12.0 * static_cast<double>(num_layers * seq_length * hidden_size);
}

GptConfig gpt_preset(const std::string& name) {
  GptConfig c;
  if (name == "toy") {
    c.num_layers = 2, c.hidden_size = 64, c.num_heads = 4, c.seq_length = 64;
  } else if (name == "mini") {
    c.num_layers = 4, c.hidden_size = 256, c.num_heads = 4, c.seq_length = 128;
  } else if (name == "small") {
    c.num_layers = 6, c.hidden_size = 384, c.num_heads = 6, c.seq_length = 256;
  } else if (name == "gpt2") {
    c.num_layers = 12, c.hidden_size = 768, c.num_heads = 12, c.seq_length = 1024;
    c.vocab_size = 50257, c.max_positions = 1024;
  } else {
    std::string names;
    for (const auto& n : gpt_preset_names()) names += (names.empty() ? "" : ", ") + n;
    throw Error("--model '{}' is not a preset; choose one of: {}", name, names);
  }
  return c;
}

std::vector<std::string> gpt_preset_names() { return {"toy", "mini", "small", "gpt2"}; }

GptModel build_gpt(const GptConfig& cfg, int64_t micro_batch,
                   std::shared_ptr<ParamStore> params) {
  cfg.validate();
  check(micro_batch > 0, "--micro-batch-size ({}) must be positive", micro_batch);
  const bool create = params == nullptr;
  if (create) params = std::make_shared<ParamStore>();
  ParamStore& ps = *params;
  const int64_t c = cfg.hidden_size, L = cfg.num_layers;
  const float proj_std = 0.02f / std::sqrt(2.0f * static_cast<float>(L));
  auto param = [&](const std::string& name, Shape shape, Init init) {
    if (create) return ps.create(name, shape, init);
    Param* p = ps.find(name);
    check(p != nullptr && p->value.shape() == shape, "shared parameters lack '{}' {}", name,
          shape.str());
    return p;
  };
  // Each weight made before its bias, in statements: the order of a call's
  // arguments is the compiler's (GCC makes the last first), and the store's
  // order is the optimizer's and the gradient norm's.
  auto norm_params = [&](const std::string& prefix) {
    Param* w = param(prefix + ".weight", {c}, Init::constant(1));
    return std::pair{w, param(prefix + ".bias", {c}, Init::constant(0))};
  };
  auto norm = [&](const std::string& prefix) {
    const auto [w, b] = norm_params(prefix);
    return std::make_unique<LayerNorm>(w, b);
  };
  auto linear = [&](const std::string& prefix, int64_t in, int64_t out, float std,
                    ParallelRole role, int out_blocks = 1) {
    Param* w = param(prefix + ".weight", {in, out}, Init::normal(std));
    Param* b = param(prefix + ".bias", {out}, Init::constant(0));
    return std::make_unique<Linear>(w, b, role, out_blocks);
  };

  GptModel m{params, Graph(params), {}, -1, -1, -1, nullptr};
  Graph& g = m.graph;
  const int64_t B = micro_batch, T = cfg.seq_length;
  Param* wte = vocab_table(param("wte.weight", {cfg.table_rows(), c}, Init::normal(0.02f)),
                           cfg.vocab_size);
  Param* wpe = param("wpe.weight", {cfg.positions(), c}, Init::normal(0.02f));
  m.tokens = g.input("tokens", {B, T}, DType::I32);
  m.targets = g.input("targets", {B, T}, DType::I32);
  m.io.inputs = {m.tokens, m.targets};
  if (cfg.reset_position_ids || cfg.reset_attention_mask) {
    m.positions = g.input("positions", {B, T}, DType::I32);
    m.io.inputs.push_back(m.positions);
  }
  m.io.terms_per_sample = T;
  const int embedded = g.add1("embed", std::make_unique<Embedding>(wte, wpe),
                              cfg.reset_position_ids ? std::vector<int>{m.tokens, m.positions}
                                                     : std::vector<int>{m.tokens});
  const std::vector<int> masked =
      cfg.reset_attention_mask ? std::vector<int>{m.positions} : std::vector<int>{};
  int x = embedded;
  for (int64_t i = 0; i < L; ++i) {
    const std::string h = fmt::format("h.{}", i);
    int a = g.add1(h + ".ln_1", norm(h + ".ln_1"), {x});
    a = g.add1(h + ".attn.c_attn", linear(h + ".attn.c_attn", c, 3 * c, 0.02f, ParallelRole::Column, 3), {a});
    std::vector<int> core_in{a};
    core_in.insert(core_in.end(), masked.begin(), masked.end());
    a = g.add1(h + ".attn.core", std::make_unique<CausalSelfAttention>(cfg.num_heads), core_in);
    a = g.add1(h + ".attn.c_proj", linear(h + ".attn.c_proj", c, c, proj_std, ParallelRole::Row), {a});
    // The attention's residual add and ln_2 as one node (layers/layernorm.h):
    // outputs the residual stream, then ln_2 of it. The add that ends the
    // block stays a node of its own, so a block boundary is still one value.
    const auto [ln_2_w, ln_2_b] = norm_params(h + ".ln_2");
    const std::vector<int> xf =
        g.add(h + ".ln_2", std::make_unique<ResidualLayerNorm>(ln_2_w, ln_2_b), {x, a});
    x = xf[0];
    int f = xf[1];
    // c_fc, GELU and c_proj as one node (layers/gelu_mlp.h); the parameters
    // made in this order, as two Linear layers made them
    Param* w_fc = param(h + ".mlp.c_fc.weight", {c, 4 * c}, Init::normal(0.02f));
    Param* b_fc = param(h + ".mlp.c_fc.bias", {4 * c}, Init::constant(0));
    Param* w_proj = param(h + ".mlp.c_proj.weight", {4 * c, c}, Init::normal(proj_std));
    Param* b_proj = param(h + ".mlp.c_proj.bias", {c}, Init::constant(0));
    f = g.add1(h + ".mlp", std::make_unique<GeluMlp>(w_fc, b_fc, w_proj, b_proj), {f});
    x = g.add1(h + ".res_2", std::make_unique<Residual>(), {x, f});
  }
  if (cfg.embedding_skip) x = g.add1("embedding_skip", std::make_unique<Residual>(), {x, embedded});
  x = g.add1("ln_f", norm("ln_f"), {x});
  auto head = std::make_unique<TiedLmHeadLoss>(wte);
  m.head = head.get();
  m.io.loss = g.add1("lm_head", std::move(head), {x, m.targets});
  g.mark_output(m.io.loss);
  m.io.graph = &m.graph;
  return m;
}

void init_gpt(GptModel& model, uint64_t seed) {
  for (Param* p : model.params->all()) init_param(*p, seed);
}

}  // namespace weft
