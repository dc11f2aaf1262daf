// Mean-squared-error loss as a sum: (pred (N, K), target (N, K)) -> loss (1)
//   loss = 0.5 * sum (pred - target)^2
// Like the LM head, it returns a sum; the caller seeds 1 / (elements in the batch).
#pragma once

#include <weft/layer.h>

namespace weft {

class MseLoss final : public Layer {
 public:
  const char* kind() const override { return "mse_loss"; }
  std::vector<Shape> output_shapes(std::span<const Shape> in) const override;
  double flops(std::span<const Shape> in) const override { return 3.0 * in[0].numel(); }
  std::unique_ptr<LayerCtx> make_ctx() const override;
  // A copy: its inputs are whole on every rank, and so is the loss.
  std::unique_ptr<Layer> tensor_parallel(TpBuild& build) const override;

  void forward(LayerCtx& ctx, Arena& arena, std::span<const Tensor> in,
               std::span<const Tensor> out) override;
  void backward_input(LayerCtx& ctx, Arena& arena, std::span<const Tensor> grad_out,
                      std::span<const Tensor> grad_in) override;
};

}  // namespace weft
