// GELU, tanh approximation: y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
#pragma once

#include <weft/layer.h>

namespace weft {

class Gelu final : public Layer {
 public:
  const char* kind() const override { return "gelu"; }
  std::vector<Shape> output_shapes(std::span<const Shape> in) const override;
  double flops(std::span<const Shape> in) const override { return 10.0 * in[0].numel(); }
  std::unique_ptr<LayerCtx> make_ctx() const override;
  bool writes_input_grad(size_t) const override { return true; }
  // Element-wise: the same layer on whatever slice the rank holds.
  std::unique_ptr<Layer> tensor_parallel(TpBuild& build) const override;

  void forward(LayerCtx& ctx, Arena& arena, std::span<const Tensor> in,
               std::span<const Tensor> out) override;
  void backward_input(LayerCtx& ctx, Arena& arena, std::span<const Tensor> grad_out,
                      std::span<const Tensor> grad_in) override;
};

}  // namespace weft
