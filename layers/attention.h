// Causal self-attention core: qkv (B, T, 3C) -> y (B, T, C).
//
// q, k, v are consecutive C-wide column blocks of qkv (the output of
// c_attn); head h owns columns h*D .. h*D+D-1 of each block, D = C / heads.
// y = softmax(q k^T / sqrt(D) + causal mask) v, heads concatenated in order.
// The projections around it are ordinary Linear layers.
#pragma once

#include <weft/layer.h>

namespace weft {

class CausalSelfAttention final : public Layer {
 public:
  explicit CausalSelfAttention(int64_t heads);
  const char* kind() const override { return "attention"; }
  std::vector<Shape> output_shapes(std::span<const Shape> in) const override;
  double flops(std::span<const Shape> in) const override;
  std::unique_ptr<LayerCtx> make_ctx() const override;
  int64_t heads() const { return heads_; }

  void forward(LayerCtx& ctx, Arena& arena, std::span<const Tensor> in,
               std::span<const Tensor> out) override;
  void backward_input(LayerCtx& ctx, Arena& arena, std::span<const Tensor> grad_out,
                      std::span<const Tensor> grad_in) override;

 private:
  int64_t heads_;
};

}  // namespace weft
