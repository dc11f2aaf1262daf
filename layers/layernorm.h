// LayerNorm over the last dimension: x (..., C) -> y (..., C), eps inside the sqrt.
#pragma once

#include <weft/layer.h>

namespace weft {

class LayerNorm final : public Layer {
 public:
  LayerNorm(Param* weight, Param* bias, float eps = 1e-5f);  // weight, bias (C)
  const char* kind() const override { return "layernorm"; }
  std::vector<Shape> output_shapes(std::span<const Shape> in) const override;
  std::vector<Param*> params() const override { return {w_, b_}; }
  double flops(std::span<const Shape> in) const override { return 8.0 * in[0].numel(); }
  std::unique_ptr<LayerCtx> make_ctx() const override;
  // Tensor-parallel: a copy with the whole weight and bias (its input is whole
  // on every rank, so their gradients are the same on every rank).
  std::unique_ptr<Layer> tensor_parallel(TpBuild& build) const override;

  void forward(LayerCtx& ctx, Arena& arena, std::span<const Tensor> in,
               std::span<const Tensor> out) override;
  void backward_input(LayerCtx& ctx, Arena& arena, std::span<const Tensor> grad_out,
                      std::span<const Tensor> grad_in) override;
  void backward_weight(LayerCtx& ctx, Arena& arena) override;

 private:
  Param* w_;
  Param* b_;
  float eps_;
};

}  // namespace weft
