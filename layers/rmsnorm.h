// RMSNorm over the last dimension (Llama's): x (..., C) -> y = x / rms(x) * w,
// rms(x) = sqrt(mean(x^2) + eps). No bias, no mean subtraction.
#pragma once

#include <weft/layer.h>

namespace weft {

class RmsNorm final : public Layer {
 public:
  explicit RmsNorm(Param* weight, float eps = 1e-5f);  // weight (C)
  const char* kind() const override { return "rmsnorm"; }
  std::vector<Shape> output_shapes(std::span<const Shape> in) const override;
  std::vector<Param*> params() const override { return {w_}; }
  double flops(std::span<const Shape> in) const override { return 4.0 * in[0].numel(); }
  std::unique_ptr<LayerCtx> make_ctx() const override;
  // Replicated: every tensor-parallel rank normalises the whole width.
  std::unique_ptr<Layer> tensor_parallel(TpBuild& build) const override;
  void forward(LayerCtx& ctx, Arena& arena, std::span<const Tensor> in,
               std::span<const Tensor> out) override;
  void backward_input(LayerCtx& ctx, Arena& arena, std::span<const Tensor> grad_out,
                      std::span<const Tensor> grad_in) override;
  void backward_weight(LayerCtx& ctx, Arena& arena) override;

 private:
  Param* w_;
  float eps_;
};

}  // namespace weft
