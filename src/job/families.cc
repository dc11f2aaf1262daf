// The built-in model families of the training job (weft/job.h), and
// sampling through any family's LM head.
#include <weft/error.h>
#include <weft/job.h>

#include "layers/lm_head.h"
#include "models/gpt.h"
#include "models/llama.h"

#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <random>

namespace weft {

std::string ArchTraits::describe() const {
  return fmt::format("{}, {} positions, {} MLP, {} head, {}", normalization,
                     position_embedding_type, swiglu ? "SwiGLU" : "GELU",
                     untie ? "untied" : "tied", disable_bias ? "no biases" : "biases");
}

namespace {

LlamaConfig llama_config(const ModelArgs& a) {
  LlamaConfig l;
  const GptConfig& s = a.shape;
  l.vocab_size = s.vocab_size, l.padded_vocab_size = s.padded_vocab_size;
  l.num_layers = s.num_layers, l.hidden_size = s.hidden_size;
  l.num_heads = s.num_heads, l.seq_length = s.seq_length;
  l.ffn_hidden_size = a.ffn_hidden_size, l.rope_base = a.rotary_base;
  l.num_query_groups = a.num_query_groups;
  l.reset_position_ids = s.reset_position_ids, l.reset_attention_mask = s.reset_attention_mask;
  return l;
}

}  // namespace

ModelFamily gpt_family() {
  ModelFamily f;
  f.name = "gpt2";
  f.about = "GPT-2: LayerNorm, learned positions, GELU MLP, tied LM head, biases";
  f.traits = ArchTraits{};
  f.reads = {"--max-position-embeddings", "--reset-position-ids", "--reset-attention-mask"};
  f.validate = [](const ModelArgs& a) { a.shape.validate(); };
  f.build = [](const ModelArgs& a) {
    GptModel g = build_gpt(a.shape, a.micro_batch);
    JobModel m(g.params);
    m.graph = std::move(g.graph);
    m.io = g.io;
    m.tokens = g.tokens, m.targets = g.targets, m.head = g.head, m.positions = g.positions;
    m.flops_per_token = a.shape.train_flops_per_token();
    return m;
  };
  return f;
}

ModelFamily llama_family() {
  ModelFamily f;
  f.name = "llama";
  f.about = "Llama: RMSNorm, rope, SwiGLU MLP, untied LM head, no biases, grouped-query attention";
  f.traits = ArchTraits{"RMSNorm", "rope", true, true, true};
  f.reads = {"--group-query-attention", "--num-query-groups",   "--ffn-hidden-size",
             "--rotary-base",           "--reset-position-ids", "--reset-attention-mask"};
  f.validate = [](const ModelArgs& a) { llama_config(a).validate(); };
  f.build = [](const ModelArgs& a) {
    const LlamaConfig cfg = llama_config(a);
    LlamaModel l = build_llama(cfg, a.micro_batch);
    JobModel m(l.params);
    m.graph = std::move(l.graph);
    m.io = l.io;
    m.tokens = l.tokens, m.targets = l.targets, m.head = l.head, m.positions = l.positions;
    // 6 x parameters x tokens + attention's 12 L T C.
    m.flops_per_token = 6.0 * static_cast<double>(m.graph.param_count()) +
                        12.0 * static_cast<double>(cfg.num_layers * cfg.seq_length *
                                                   cfg.hidden_size);
    m.config = {{"ffn_hidden_size", cfg.ffn()},
                {"rotary_base", cfg.rope_base},
                {"num_query_groups", cfg.groups()}};
    return m;
  };
  return f;
}

std::vector<int32_t> sample_tokens(JobModel& model, const GptConfig& shape,
                                   std::vector<int32_t> prompt, int64_t count, float temperature,
                                   uint64_t seed, int32_t eod) {
  check(!prompt.empty(), "sampling needs a prompt of at least one token");
  check(model.tokens >= 0 && (model.head != nullptr || model.decode),
        "sampling reads the logits of the model's LM head (JobModel::head) or of its decode "
        "hook (JobModel::decode), and this model has neither");
  Graph& g = model.graph;
  const int n = static_cast<int>(g.nodes().size());
  int head_node = model.decode ? model.decode_node : -1;
  if (!model.decode) {
    for (int k = 0; k < n; ++k)
      if (g.nodes()[static_cast<size_t>(k)].layer.get() == model.head) head_node = k;
    check(head_node >= 0, "sampling: the model's head is not a node of its graph");
    model.head->set_keep_logits(true);
  }
  check(head_node >= 0 && head_node < n,
        "sampling: JobModel::decode_node ({}) is not a node of the graph's {}", head_node, n);
  // Logits rows hold the padded vocabulary; only the true one is sampled.
  const int64_t T = shape.seq_length, V = shape.vocab_size, stride = shape.table_rows();
  MicroBatch mb(g);
  std::mt19937_64 rng(seed);
  std::vector<int32_t> out = prompt;
  std::vector<double> p(static_cast<size_t>(V));
  for (int64_t k = 0; k < count; ++k) {
    const int64_t len = std::min<int64_t>(static_cast<int64_t>(out.size()), T);
    const int32_t* ctx_tokens = out.data() + out.size() - static_cast<size_t>(len);
    int32_t* tok = mb.input(model.tokens).data<int32_t>();
    for (int64_t t = 0; t < T; ++t)
      tok[t] = t < len ? ctx_tokens[t] : 0;  // causal: padding after len is never seen
    if (model.targets >= 0) std::fill_n(mb.input(model.targets).data<int32_t>(), T, 0);
    if (model.positions >= 0)
      document_positions(tok, mb.input(model.positions).data<int32_t>(), 1, T, eod);
    forward(g, mb, 0, head_node + 1);
    const float* logits =
        model.decode ? model.decode(mb, len - 1)
                     : TiedLmHeadLoss::logits(mb.ctx(head_node)).data<float>() + (len - 1) * stride;
    int32_t next = 0;
    if (temperature <= 0) {
      for (int64_t j = 1; j < V; ++j)
        if (logits[j] > logits[next]) next = static_cast<int32_t>(j);
    } else {
      float mx = logits[0];
      for (int64_t j = 1; j < V; ++j) mx = std::max(mx, logits[j]);
      for (int64_t j = 0; j < V; ++j)
        p[static_cast<size_t>(j)] = std::exp((logits[j] - mx) / temperature);
      std::discrete_distribution<int32_t> dist(p.begin(), p.end());
      next = dist(rng);
    }
    out.push_back(next);
    mb.reset();
  }
  return std::vector<int32_t>(out.begin() + static_cast<std::ptrdiff_t>(prompt.size()), out.end());
}

}  // namespace weft
