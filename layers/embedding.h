// Token + position embedding: tokens (B, T) int32 -> x (B, T, C).
//   x[b, t] = wte[tokens[b, t]] + wpe[t]
#pragma once

#include <weft/layer.h>

namespace weft {

class Embedding final : public Layer {
 public:
  Embedding(Param* wte, Param* wpe);  // wte (V, C), wpe (P, C)
  const char* kind() const override { return "embedding"; }
  std::vector<Shape> output_shapes(std::span<const Shape> in) const override;
  std::vector<Param*> params() const override { return {wte_, wpe_}; }
  std::unique_ptr<LayerCtx> make_ctx() const override;
  // Tensor-parallel: VocabParallelEmbedding (layers/tp_embedding.h); the
  // vocabulary must divide by the group size.
  std::unique_ptr<Layer> tensor_parallel(TpBuild& build) const override;

  void forward(LayerCtx& ctx, Arena& arena, std::span<const Tensor> in,
               std::span<const Tensor> out) override;
  void backward_input(LayerCtx& ctx, Arena& arena, std::span<const Tensor> grad_out,
                      std::span<const Tensor> grad_in) override;
  void backward_weight(LayerCtx& ctx, Arena& arena) override;

 private:
  Param* wte_;
  Param* wpe_;
};

}  // namespace weft
