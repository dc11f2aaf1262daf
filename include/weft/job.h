// The training job as a library: a model family (a function that builds the
// model's graph from the shape flags) and a main of a few lines get every
// flag and behaviour of train_gpt: layouts and schedules, --plan auto,
// checkpoints with their fault tolerance, evaluation, plots, JSONL, signals
// and --exit-*, parameter servers and local SGD, threads that are right
// under mpiexec, and sampling.
//
//   weft::JobModel build(const weft::ModelArgs& args) { ... }
//   int main(int argc, char** argv) {
//     weft::Job job{"first_model", "a byte-level MLP language model"};
//     job.families.push_back({"mlp", "MLP blocks", build});
//     job.defaults = {{"--num-layers", "4"}, {"--hidden-size", "32"}};
//     return weft::train_main(argc, argv, job);
//   }
//
// train_gpt is this main with the GPT-2 and Llama families (gpt_family(),
// llama_family()). `train_main` parses Megatron's flags (--help lists them),
// starts MPI when launched by mpiexec or srun, and returns the exit status:
// 0, or 1 after one line naming the value and the rule it broke.
#pragma once

#include <weft/graph.h>
#include <weft/trainer.h>

#include "models/gpt.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace weft {

class MicroBatch;
class TiedLmHeadLoss;

// What the command line says of the model, resolved (preset, shape flags,
// the checkpoint's meta.json): a family builds its graph from this.
struct ModelArgs {
  // --num-layers, --hidden-size, --num-attention-heads, --seq-length,
  // --max-position-embeddings, --vocab-size; table_rows() is the vocabulary
  // padded for --make-vocab-size-divisible-by x --tp.
  GptConfig shape;
  int64_t micro_batch = 1;  // the graph's first dimension
  // The optional flags a family reads (ModelFamily::reads); their defaults
  // when not given.
  int64_t num_query_groups = 0;  // --num-query-groups; 0: one per head
  int64_t ffn_hidden_size = 0;   // --ffn-hidden-size; 0: the family's default
  float rotary_base = 10000.0f;  // --rotary-base
};

// A model the job trains: the logical graph (the layout instantiates each
// rank's part of it) and what the job needs to know about it.
struct JobModel {
  explicit JobModel(std::shared_ptr<ParamStore> p = std::make_shared<ParamStore>())
      : params(p), graph(std::move(p)) {}
  std::shared_ptr<ParamStore> params;
  Graph graph;
  // Inputs the data fills ({tokens, targets}, each (micro-batch, seq)), and
  // the loss, a sum of `loss_terms` per sequence. The job points io.graph
  // at `graph`.
  ModelIO io;
  // For sampling (--sample): the (B, T) int32 token input and the LM head,
  // whose logits are read.
  int tokens = -1, targets = -1;
  TiedLmHeadLoss* head = nullptr;
  // Sampling through a head of the model's own (any layer that keeps its
  // logits): after a forward of one sequence through nodes 0 .. decode_node,
  // decode(mb, t) points at position t's logits, the true vocabulary's
  // first (shape.vocab_size values, on the host). Set, it is used in place
  // of `head`; a family with neither is refused --sample before training.
  int decode_node = -1;
  std::function<const float*(MicroBatch& mb, int64_t t)> decode;
  // The (B, T) int32 positions within documents, where the shape asks for
  // them (GptConfig::reset_position_ids or reset_attention_mask): the data
  // fills them as its third input, sampling from the prompt's documents.
  int positions = -1;
  // Training FLOPs per token for the GFLOP/s figure; 0: 6 x parameters.
  double flops_per_token = 0;
  // What the family records in a checkpoint's meta.json beside the shape
  // (e.g. its SwiGLU width); a resume compares it.
  nlohmann::json config = nlohmann::json::object();
};

// Megatron's flags that describe a transformer's parts. Without --arch, the
// family is the one whose parts the flags describe (flags left out take
// Megatron's defaults: LayerNorm, learned positions, GELU, tied head,
// biases), and flags that describe no family are one error naming them.
struct ArchTraits {
  std::string normalization = "LayerNorm";                  // or RMSNorm
  std::string position_embedding_type = "learned_absolute";  // or rope
  bool swiglu = false;
  bool untie = false;         // --untie-embeddings-and-output-weights
  bool disable_bias = false;  // --disable-bias-linear
  std::string describe() const;
};

struct ModelFamily {
  ModelFamily() = default;
  ModelFamily(std::string family, std::string line, std::function<JobModel(const ModelArgs&)> f)
      : name(std::move(family)), about(std::move(line)), build(std::move(f)) {}
  std::string name;   // --arch's value
  std::string about;  // one line for --help
  // Builds the logical model for micro-batches of args.micro_batch. Every
  // parameter is made by name with its Init (ParamStore::create): each rank
  // of every layout initialises it from (seed, name).
  std::function<JobModel(const ModelArgs&)> build;
  // Throws Error naming the value and the rule for a shape the family cannot
  // build; run before any rank starts. Optional.
  std::function<void(const ModelArgs&)> validate;
  // The parts --normalization and its kin describe; none: a family those
  // flags do not describe (they are refused with it).
  std::optional<ArchTraits> traits;
  // The optional model flags it reads, of --max-position-embeddings,
  // --group-query-attention, --num-query-groups, --ffn-hidden-size and
  // --rotary-base; the others are refused with it.
  std::vector<std::string> reads;
};

struct Job {
  std::string program;  // in --help and in every error line
  std::string about;
  // The first is the default family.
  std::vector<ModelFamily> families;
  // Flag defaults of this program, e.g. {"--num-layers", "4"}: the flag's
  // value when the command line leaves it out (it still counts as left out,
  // so a resume takes the checkpoint's).
  std::vector<std::pair<std::string, std::string>> defaults;
};

// Parses the command line, runs the job on this process's rank (MPI when
// launched by mpiexec or srun) and returns the exit status.
int train_main(int argc, char** argv, const Job& job);

// The built-in families: GPT-2 (LayerNorm, learned positions, GELU MLP,
// tied head, biases) and Llama (RMSNorm, rope, SwiGLU, untied head, no
// biases, grouped-query attention).
ModelFamily gpt_family();
ModelFamily llama_family();

// Tokens after `prompt`, sampled from `model`'s softmax at `temperature`
// (0: greedy) over a sliding window of `shape.seq_length`; `model` is built
// for micro-batches of 1 and has a head. A model with positions reads them
// from the window's documents, which `eod` ends.
std::vector<int32_t> sample_tokens(JobModel& model, const GptConfig& shape,
                                   std::vector<int32_t> prompt, int64_t count, float temperature,
                                   uint64_t seed, int32_t eod = -1);

}  // namespace weft
