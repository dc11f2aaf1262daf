// Residual add: (x, y) -> x + y, same shapes.
#pragma once

#include <weft/layer.h>

namespace weft {

class Residual final : public Layer {
 public:
  const char* kind() const override { return "residual"; }
  std::vector<Shape> output_shapes(std::span<const Shape> in) const override;
  double flops(std::span<const Shape> in) const override { return static_cast<double>(in[0].numel()); }
  // Element-wise: the same layer on whatever the rank holds.
  std::unique_ptr<Layer> tensor_parallel(TpBuild& build) const override;

  void forward(LayerCtx& ctx, Arena& arena, std::span<const Tensor> in,
               std::span<const Tensor> out) override;
  void backward_input(LayerCtx& ctx, Arena& arena, std::span<const Tensor> grad_out,
                      std::span<const Tensor> grad_in) override;
  bool writes_input_grad(size_t) const override { return true; }
  bool may_share_input_grad(size_t) const override { return true; }
};

}  // namespace weft
