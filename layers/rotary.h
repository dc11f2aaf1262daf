// Rotary position embedding (RoPE, Llama's): applied to a packed
// qkv (B, T, 3C) before attention. Each head's q and k (head size D) rotate
// in pairs (i, i + D/2) by the angle t * base^(-2i/D), t the position in the
// sequence; v passes through. Relative positions then enter q.k directly.
#pragma once

#include <weft/layer.h>

namespace weft {

class Rotary final : public Layer {
 public:
  explicit Rotary(int64_t heads, float base = 10000.0f);
  const char* kind() const override { return "rotary"; }
  std::vector<Shape> output_shapes(std::span<const Shape> in) const override;
  double flops(std::span<const Shape> in) const override { return 2.0 * in[0].numel(); }
  // Heads are split across tensor-parallel ranks, as attention's are.
  std::unique_ptr<Layer> tensor_parallel(TpBuild& build) const override;
  void forward(LayerCtx& ctx, Arena& arena, std::span<const Tensor> in,
               std::span<const Tensor> out) override;
  void backward_input(LayerCtx& ctx, Arena& arena, std::span<const Tensor> grad_out,
                      std::span<const Tensor> grad_in) override;

 private:
  int64_t heads_;
  float base_;
};

}  // namespace weft
