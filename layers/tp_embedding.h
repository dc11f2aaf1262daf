// Token + position embedding with the token table split by vocabulary rows
// across a tensor-parallel group (Megatron's VocabParallelEmbedding):
//   tokens (B, T) int32, whole on every rank -> x (B, T, C), whole on every rank
//
// Rank r holds rows [r V/tp, (r+1) V/tp) of wte. It looks up the tokens in
// its range and writes zeros for the others; reduce_from_tp sums the ranks'
// rows, so every token gets its one row. wpe is whole and added once, after
// the sum: its gradient is the same on every rank, and wte's rows get the
// gradient of the tokens in their range only. Built by Embedding::tensor_parallel.
#pragma once

#include <weft/communicator.h>
#include <weft/layer.h>

namespace weft {

class VocabParallelEmbedding final : public Layer {
 public:
  // wte (V/tp, C): this rank's rows (wte->shard says which); wpe (P, C) whole.
  VocabParallelEmbedding(Communicator& group, Param* wte, Param* wpe);
  const char* kind() const override { return "vocab_parallel_embedding"; }
  std::vector<Shape> output_shapes(std::span<const Shape> in) const override;
  std::vector<Param*> params() const override { return {wte_, wpe_}; }
  std::unique_ptr<LayerCtx> make_ctx() const override;

  void forward(LayerCtx& ctx, Arena& arena, std::span<const Tensor> in,
               std::span<const Tensor> out) override;
  void backward_input(LayerCtx& ctx, Arena& arena, std::span<const Tensor> grad_out,
                      std::span<const Tensor> grad_in) override;
  void backward_weight(LayerCtx& ctx, Arena& arena) override;

 private:
  Communicator* group_;
  Param* wte_;
  Param* wpe_;
  int64_t vocab_;  // V, the whole vocabulary
  int64_t first_;  // the first token id of this rank's rows
};

}  // namespace weft
