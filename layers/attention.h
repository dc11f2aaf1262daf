// Causal self-attention core: qkv (B, T, 3C) -> y (B, T, C).
//
// q, k, v are consecutive C-wide column blocks of qkv (the output of
// c_attn); head h owns columns h*D .. h*D+D-1 of each block, D = C / heads.
// y = softmax(q k^T / sqrt(D) + causal mask) v, heads concatenated in order.
// The projections around it are ordinary Linear layers.
//
// Tensor-parallel: rank r of tp keeps heads r*H/tp .. (r+1)*H/tp - 1. The
// column-parallel c_attn (split in 3 blocks) gives it exactly those heads' q,
// k and v columns, packed as above for H/tp heads, so the parallel form is this
// same layer with H/tp heads; the row-parallel c_proj sums the heads' outputs.
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
  std::unique_ptr<Layer> tensor_parallel(TpBuild& build) const override;

  void forward(LayerCtx& ctx, Arena& arena, std::span<const Tensor> in,
               std::span<const Tensor> out) override;
  void backward_input(LayerCtx& ctx, Arena& arena, std::span<const Tensor> grad_out,
                      std::span<const Tensor> grad_in) override;

 private:
  int64_t heads_;
};

}  // namespace weft
