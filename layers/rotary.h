// Rotary position embedding (RoPE, Llama's): applied to a packed
// qkv (B, T, (H + 2G) D) before attention (the layout of layers/attention.h:
// H query, G key and G value heads). Each query and key head (size D) rotates
// in pairs (i, i + D/2) by the angle t * base^(-2i/D), t the position in the
// sequence; v passes through. Relative positions then enter q.k directly.
// With a second input, positions (B, T) int32 (--reset-position-ids), t is
// each token's position within its document.
#pragma once

#include <weft/layer.h>

namespace weft {

class Rotary final : public Layer {
 public:
  // `heads` query heads and `groups` key/value heads (= heads without grouped-query attention).
  Rotary(int64_t heads, int64_t groups, float base);
  const char* kind() const override { return "rotary"; }
  std::vector<Shape> output_shapes(std::span<const Shape> in) const override;
  std::unique_ptr<LayerCtx> make_ctx() const override;
  double flops(std::span<const Shape> in) const override { return 2.0 * in[0].numel(); }
  // Query and key/value heads are split across tensor-parallel ranks, as attention's are.
  std::unique_ptr<Layer> tensor_parallel(TpBuild& build) const override;
  void forward(LayerCtx& ctx, Arena& arena, std::span<const Tensor> in,
               std::span<const Tensor> out) override;
  void backward_input(LayerCtx& ctx, Arena& arena, std::span<const Tensor> grad_out,
                      std::span<const Tensor> grad_in) override;

 private:
  int64_t heads_, groups_;
  float base_;
};

}  // namespace weft
