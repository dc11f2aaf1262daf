// Token + position embedding: tokens (B, T) int32 -> x (B, T, C).
//   x[b, t] = wte[tokens[b, t]] + wpe[t]
// With a second input, positions (B, T) int32 (--reset-position-ids: each
// token's position within its document), wpe[positions[b, t]] in place of wpe[t].
//
// One layer for one process and for a tensor-parallel group (Megatron's
// VocabParallelEmbedding): with a group of tp ranks, rank r holds rows
// [r V/tp, (r+1) V/tp) of wte, looks up the tokens in its range and writes
// zeros for the others, and reduce_from_tp sums the ranks' rows, so every
// token gets its one row. wpe is whole; rank 0 adds it before the sum, which
// is exact (one rank holds each row, the others add zeros), so every layout
// computes the same bits. Without a group (or a group of one) it is the plain
// lookup: vocabulary offset 0, nothing to sum. A padded table
// (wte->true_rows) has rows no token reads: tokens must be below the true
// vocabulary, so the padding rows get no gradient. Under sequence
// parallelism the sum is reduce-scattered, each rank keeping its tokens,
// and W gathers the output's gradient whole (wpe's gradient, whole, is then
// the same on every rank).
#pragma once

#include <weft/communicator.h>
#include <weft/layer.h>

#include <optional>

#include "layers/tp_regions.h"

namespace weft {

class Embedding final : public Layer {
 public:
  // wte (V, C), or this rank's rows (V/tp, C) of it (wte->shard says which);
  // wpe (P, C) whole, or null for a model without learned positions (Llama's
  // rotary embedding works inside attention). `group`: the tensor-parallel
  // group, or null.
  // `sp`: the output is this rank's tokens (sequence parallelism,
  // layers/tp_regions.h), reduce-scattered rather than all-reduced.
  Embedding(Param* wte, Param* wpe, Communicator* group = nullptr,
            std::optional<SequenceParallel> sp = std::nullopt);
  const char* kind() const override { return group_ ? "vocab_parallel_embedding" : "embedding"; }
  std::vector<Shape> output_shapes(std::span<const Shape> in) const override;
  std::vector<Param*> params() const override {
    return wpe_ ? std::vector<Param*>{wte_, wpe_} : std::vector<Param*>{wte_};
  }
  std::unique_ptr<LayerCtx> make_ctx() const override;
  // The same layer over this rank's rows of wte; the vocabulary must divide
  // by the group size.
  std::unique_ptr<Layer> tensor_parallel(TpBuild& build) const override;
  void forward(LayerCtx& ctx, Arena& arena, std::span<const Tensor> in,
               std::span<const Tensor> out) override;
  void backward_input(LayerCtx& ctx, Arena& arena, std::span<const Tensor> grad_out,
                      std::span<const Tensor> grad_in) override;
  void backward_weight(LayerCtx& ctx, Arena& arena) override;

 private:
  Communicator* group_;
  Param* wte_;
  Param* wpe_;
  int64_t vocab_;  // V, the whole vocabulary without padding
  int64_t first_;  // the first token id of this rank's rows
  std::optional<SequenceParallel> sp_;
};

}  // namespace weft
