// GPT-2-style transformers as weft graphs.
//
//   tokens -> embedding -> L x [x + attn(ln_1(x)); x + mlp(ln_2(x))] -> ln_f -> tied head + CE
//
// Parameter names are Hugging Face GPT-2's, so `--init-from` reads a GPT-2
// safetensors file directly. models/ knows nothing of parallelism.
#pragma once

#include <weft/graph.h>
#include <weft/trainer.h>

#include "layers/lm_head.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace weft {

// The vocabulary padded up to a multiple of `multiple` (>= 1): Megatron's
// --make-vocab-size-divisible-by, whose multiple is that flag times the
// tensor-parallel size. 50257 -> 50304 at 128.
int64_t padded_vocab(int64_t vocab, int64_t multiple);

struct GptConfig {
  int64_t vocab_size = 256;
  // Rows of wte: vocab_size, or more (0 means vocab_size). The rows past
  // vocab_size are padding: zero, never trained, their logits masked and left
  // out of saved files (Param::true_rows), so only the speed of the LM-head
  // GEMMs changes (an odd 50257 runs on slow unaligned kernels on GPUs).
  int64_t padded_vocab_size = 0;
  int64_t max_positions = 0;  // rows of wpe; 0 means seq_length
  int64_t num_layers = 2;
  int64_t hidden_size = 64;
  int64_t num_heads = 4;
  int64_t seq_length = 64;
  // Adds the embedding output to the last block's output before ln_f: a skip
  // connection that crosses every pipeline stage (not part of GPT-2).
  bool embedding_skip = false;
  // Documents (weft/trainer.h's DocumentOptions): the graph takes a third
  // input, each token's position within its document, which the position
  // embedding reads (reset_position_ids) and/or every attention masks by
  // (reset_attention_mask: a query reads its own document's keys only).
  bool reset_position_ids = false;
  bool reset_attention_mask = false;

  int64_t positions() const { return max_positions > 0 ? max_positions : seq_length; }
  int64_t table_rows() const { return padded_vocab_size > 0 ? padded_vocab_size : vocab_size; }
  // Throws Error naming the value and the rule for an impossible shape.
  void validate() const;
  // Parameters (without padding), and training FLOPs per token (6 N + 12 L T
  // C, N without wpe).
  int64_t param_count() const;
  double train_flops_per_token() const;
};

// Named shapes: "toy" (2 x 64), "mini" (4 x 256), "small" (6 x 384, T 256),
// "gpt2" (GPT-2 124M: 12 x 768, T 1024, vocab 50257).
GptConfig gpt_preset(const std::string& name);
std::vector<std::string> gpt_preset_names();

struct GptModel {
  std::shared_ptr<ParamStore> params;
  Graph graph;
  ModelIO io;  // inputs {tokens, targets[, positions]}; the loss sums T terms per sequence
  int tokens = -1, targets = -1;  // the (B, T) int32 inputs
  int positions = -1;             // (B, T) int32, with reset_position_ids or reset_attention_mask
  TiedLmHeadLoss* head = nullptr;
};

// Builds the graph for micro-batches of `micro_batch` sequences. Creates the
// parameters (zero-filled; see init_gpt) unless `params` is given, in which
// case they are shared (a sampling graph shares the training graph's weights).
GptModel build_gpt(const GptConfig& cfg, int64_t micro_batch,
                   std::shared_ptr<ParamStore> params = nullptr);
// Initialises every parameter from (seed, name): normal(0, 0.02), residual
// projections normal(0, 0.02 / sqrt(2 L)), biases 0, LayerNorm weights 1.
void init_gpt(GptModel& model, uint64_t seed);

}  // namespace weft
