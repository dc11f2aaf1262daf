// SwiGLU (Megatron's --swiglu): x (..., 2H) = [gate | up] -> y (..., H) = silu(gate) * up.
// The Linear before it produces gate and up side by side; made column-parallel
// with out_blocks = 2, each tensor-parallel rank holds its slices of both.
#pragma once

#include <weft/layer.h>

namespace weft {

class SwiGlu final : public Layer {
 public:
  const char* kind() const override { return "swiglu"; }
  std::vector<Shape> output_shapes(std::span<const Shape> in) const override;
  double flops(std::span<const Shape> in) const override { return 6.0 * in[0].numel(); }
  std::unique_ptr<LayerCtx> make_ctx() const override;
  // Element-wise over [gate_r | up_r]: the same layer on each rank's slices.
  std::unique_ptr<Layer> tensor_parallel(TpBuild& build) const override;
  void forward(LayerCtx& ctx, Arena& arena, std::span<const Tensor> in,
               std::span<const Tensor> out) override;
  void backward_input(LayerCtx& ctx, Arena& arena, std::span<const Tensor> grad_out,
                      std::span<const Tensor> grad_in) override;
};

}  // namespace weft
