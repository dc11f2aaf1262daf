// weft/hf.h — Hugging Face transformers' GPT-2 and Llama weights, out and in.
//
// Export: a weft checkpoint (weft/checkpoint.h) becomes a folder that
// transformers' from_pretrained reads, model.safetensors + config.json
// (GPT2LMHeadModel or LlamaForCausalLM). Import: such a folder becomes one
// safetensors file of weft's names, which train_gpt's --init-from reads, with
// the train_gpt flags of its shape. `weft-hf` (tools/weft_hf.cc) is the command.
//
// GPT-2: weft's names are transformers' without "transformer.", and the
// layouts are the same (Conv1D weights are [in, out]); the tied LM head is not
// written (transformers ties it on load).
//
// Llama: weft fuses what transformers keeps apart, and stores linear weights
// [in, out] where nn.Linear's are [out, in] (H query heads, G key/value heads,
// D = C / H, F the SwiGLU width):
//   weft                                 transformers
//   wte.weight (V, C)                    model.embed_tokens.weight (V, C)
//   h.{i}.input_norm.weight (C)          model.layers.{i}.input_layernorm.weight
//   h.{i}.attn.qkv.weight (C, HD + 2GD)  model.layers.{i}.self_attn.q_proj.weight (HD, C),
//                                        k_proj.weight (GD, C), v_proj.weight (GD, C):
//                                        the column blocks [q | k | v], each transposed
//   h.{i}.attn.o.weight (C, C)           model.layers.{i}.self_attn.o_proj.weight, transposed
//   h.{i}.post_attn_norm.weight (C)      model.layers.{i}.post_attention_layernorm.weight
//   h.{i}.mlp.gate_up.weight (C, 2F)     model.layers.{i}.mlp.gate_proj.weight (F, C),
//                                        up_proj.weight (F, C): [gate | up], transposed
//   h.{i}.mlp.down.weight (F, C)         model.layers.{i}.mlp.down_proj.weight (C, F)
//   norm.weight (C)                      model.norm.weight
//   lm_head.weight (V, C)                lm_head.weight (V, C)
// Head h owns rows h D .. h D + D - 1 of q_proj (and of k_proj, v_proj) on
// both sides, and both rotate the pairs (i, i + D/2) of a head (the
// rotate-half convention, layers/rotary.h), so no row is permuted.
//
// Both directions move bytes only: an export imported again gives back the
// checkpoint's tensors bit for bit.
#pragma once

#include <weft/checkpoint.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace weft::hf {

// A model shape that both weft's train_gpt and transformers hold.
struct ModelShape {
  std::string arch = "gpt2";  // train_gpt's --arch: "gpt2" or "llama"
  int64_t num_layers = 0;
  int64_t hidden_size = 0;
  int64_t num_heads = 0;
  int64_t num_query_groups = 0;  // llama: key/value heads (num_heads without grouped-query)
  int64_t ffn_hidden_size = 0;   // llama: the SwiGLU width (GPT-2's MLP is 4 x hidden_size)
  int64_t vocab_size = 0;        // rows of the vocabulary tables, without padding
  // GPT-2: rows of wpe. Llama (no position table): transformers'
  // max_position_embeddings, the longest sequence the model is meant for.
  int64_t max_positions = 0;
  double rotary_base = 10000.0;  // llama

  bool llama() const { return arch == "llama"; }
  // weft's tensors of this shape, (name, shape), in the order the model makes them.
  std::vector<std::pair<std::string, Shape>> weft_tensors() const;
  // train_gpt's flags for this shape: "--arch llama --num-layers 2 ...".
  std::string train_gpt_flags() const;
};

// The shape of a checkpoint's meta.json "config" (as train_gpt writes it).
// Throws Error naming `where` and the field that is missing or impossible.
ModelShape shape_from_meta(const nlohmann::json& config, const std::string& where);
// transformers' config.json for the shape.
nlohmann::json hf_config(const ModelShape& shape);
// The shape of a transformers config.json. Throws Error naming `where` and
// the field for a model weft does not have: a model_type other than gpt2 and
// llama, rope_scaling, biases in Llama's linear layers, another activation,
// another norm epsilon, an untied GPT-2 head, and so on.
ModelShape shape_from_hf_config(const nlohmann::json& config, const std::string& where);

using TensorMap = std::map<std::string, Tensor>;

// weft's tensors of `shape` (F32) under transformers' names and layouts, in
// transformers' order. Throws Error naming `where` and the tensor for one that
// is missing, extra, or of another shape.
NamedTensors to_hf(const ModelShape& shape, const TensorMap& weft, const std::string& where);
// The reverse. `hf` may hold GPT-2's names with or without "transformer.",
// GPT-2's attention mask buffers, a tied LM head (a tied Llama's head is a
// copy of the embedding) and Llama's rotary_emb.inv_freq buffers; those are
// left out. Throws Error as to_hf does.
NamedTensors from_hf(const ModelShape& shape, const TensorMap& hf, const std::string& where);

// export: the checkpoint `load` (a checkpoint folder's newest step that
// verifies, or one iter_N folder) to dir/model.safetensors + dir/config.json.
struct ExportResult {
  ModelShape shape;
  CheckpointSource source;
  int64_t tensors = 0;
};
ExportResult export_checkpoint(const std::string& load, const std::string& dir,
                               bool allow_unverified = false);

// import: a transformers folder (config.json and model.safetensors, or the
// shards that model.safetensors.index.json lists; F32 or BF16, which becomes
// F32 exactly) to one safetensors file of weft's names at `output`.
struct ImportResult {
  ModelShape shape;
  int64_t tensors = 0;
  int64_t parameters = 0;
  std::vector<std::string> notes;  // what a user should know (a tied head copied, ...)
};
ImportResult import_folder(const std::string& dir, const std::string& output);

}  // namespace weft::hf
