// A Llama-style decoder: token embedding without learned positions,
// pre-RMSNorm blocks with rotary attention and a SwiGLU MLP, no biases, and
// an LM head of its own (not tied to the embedding).
//
//   x = wte[tokens]
//   each block:  x = x + o(attention(rotary(qkv(rmsnorm(x)))))
//                x = x + down(swiglu(gate_up(rmsnorm(x))))
//   loss = cross-entropy(rmsnorm(x) lm_head^T, targets)
//
// Parameter names: wte.weight (V, C); h.{i}.input_norm.weight (C);
// h.{i}.attn.qkv.weight (C, C + 2 G D); h.{i}.attn.o.weight (C, C);
// h.{i}.post_attn_norm.weight (C); h.{i}.mlp.gate_up.weight (C, 2F);
// h.{i}.mlp.down.weight (F, C); norm.weight (C); lm_head.weight (V, C).
// Linear weights are [in, out], as weft's GPT's. The qkv projection packs
// [q (C) | k (G D) | v (G D)] for H heads of size D = C / H and G key/value
// heads (grouped-query attention, Megatron's --num-query-groups: query head i
// reads key/value head i / (H / G); G = H without it).
#pragma once

#include <weft/graph.h>
#include <weft/trainer.h>

#include <memory>

namespace weft {

struct LlamaConfig {
  int64_t vocab_size = 256;
  int64_t padded_vocab_size = 0;  // rows of wte and lm_head; 0: vocab_size (GptConfig's)
  int64_t num_layers = 4;
  int64_t hidden_size = 128;
  int64_t num_heads = 4;
  int64_t num_query_groups = 0;  // 0: as many as heads (no grouped-query attention)
  int64_t ffn_hidden_size = 0;  // 0: Llama's rounding of 8C/3 up to a multiple of 64
  int64_t seq_length = 64;
  float rope_base = 10000.0f;
  float norm_eps = 1e-5f;
  // Documents, as GptConfig's: rotary reads the positions within documents
  // (reset_position_ids), attention masks by them (reset_attention_mask).
  bool reset_position_ids = false;
  bool reset_attention_mask = false;

  int64_t ffn() const;
  int64_t table_rows() const { return padded_vocab_size > 0 ? padded_vocab_size : vocab_size; }
  int64_t groups() const { return num_query_groups > 0 ? num_query_groups : num_heads; }
  // Throws Error naming the value and the rule it breaks.
  void validate() const;
};

struct LlamaModel {
  std::shared_ptr<ParamStore> params;
  Graph graph;
  ModelIO io;  // inputs {tokens, targets}; the loss sums T terms per sequence
  int tokens = -1, targets = -1;
  int positions = -1;  // (B, T) int32, with reset_position_ids or reset_attention_mask
  class TiedLmHeadLoss* head = nullptr;  // the LM head (set_keep_logits for tests, sampling)
};

// The graph for micro-batches of `micro_batch` sequences; parameters are
// created zero-filled (see init_llama).
LlamaModel build_llama(const LlamaConfig& cfg, int64_t micro_batch);
// Matrices and embeddings normal(0, 0.02), the output projections
// normal(0, 0.02 / sqrt(2 L)), norm weights 1: a function of (seed, name).
void init_llama(LlamaModel& model, uint64_t seed);

}  // namespace weft
