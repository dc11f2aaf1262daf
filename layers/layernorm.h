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

// A residual add and the LayerNorm of its sum as one node: (x, a) -> (s =
// x + a, LayerNorm(s)), s first. The same bits as Residual then LayerNorm,
// forward and backward, on every device; on a GPU each way is one kernel
// (ops::add_layernorm_forward, ops::layernorm_backward_input_copy): x and a
// read once and s not read back forward, the gradient written to both inputs
// in the pass that makes it backward.
//
// Backward, the gradient of both inputs is s's gradient plus LayerNorm's
// input gradient. The layer adds the second to the first in place, in the
// buffer of output 0's gradient (the node's own, which nothing reads again),
// so one input may have that buffer as its own (Layer::may_share_input_grad).
class ResidualLayerNorm final : public Layer {
 public:
  ResidualLayerNorm(Param* weight, Param* bias, float eps = 1e-5f);  // weight, bias (C)
  const char* kind() const override { return "residual_layernorm"; }
  std::vector<Shape> output_shapes(std::span<const Shape> in) const override;
  std::vector<Param*> params() const override { return {w_, b_}; }
  double flops(std::span<const Shape> in) const override { return 9.0 * in[0].numel(); }
  std::unique_ptr<LayerCtx> make_ctx() const override;
  // Tensor-parallel: a copy with the whole weight and bias, as LayerNorm's.
  std::unique_ptr<Layer> tensor_parallel(TpBuild& build) const override;

  void forward(LayerCtx& ctx, Arena& arena, std::span<const Tensor> in,
               std::span<const Tensor> out) override;
  void backward_input(LayerCtx& ctx, Arena& arena, std::span<const Tensor> grad_out,
                      std::span<const Tensor> grad_in) override;
  void backward_weight(LayerCtx& ctx, Arena& arena) override;
  bool writes_input_grad(size_t) const override { return true; }
  bool may_share_input_grad(size_t) const override { return true; }

 private:
  Param* w_;
  Param* b_;
  float eps_;
};

}  // namespace weft
