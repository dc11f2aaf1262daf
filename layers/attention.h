// Causal self-attention core: qkv (B, T, (H + 2G) D) -> y (B, T, H D).
//
// qkv (the output of c_attn) packs three column blocks: H query heads, G key
// heads and G value heads, D columns each, head i of a block owning columns
// i*D .. i*D+D-1 of it. With G = H (the default) this is multi-head attention,
// q, k and v each C = H D wide; with G < H, grouped-query attention: G divides
// H, and query head i reads key/value head i / (H / G).
// y = softmax(q k^T / sqrt(D) + causal mask) v, heads concatenated in order.
// With a second input, positions (B, T) int32 (--reset-attention-mask: each
// token's position p within its document), query t reads keys t - p .. t
// only, its own document's; that runs unfused (ops::attention_forward).
// The projections around it are ordinary Linear layers.
//
// Tensor-parallel: rank r of tp keeps query heads r*H/tp .. (r+1)*H/tp - 1 and
// key/value heads r*G/tp .. (r+1)*G/tp - 1 (tp must divide G, as in
// Megatron), which are exactly the key/value heads its query heads read. The
// column-parallel c_attn (split in its 3 blocks, of widths H D, G D, G D)
// gives it those heads' columns, packed as above, so the parallel form is this
// same layer with H/tp and G/tp heads; the row-parallel c_proj sums the heads'
// outputs.
#pragma once

#include <weft/layer.h>

namespace weft {

class CausalSelfAttention final : public Layer {
 public:
  // Multi-head: every query head has its own key and value.
  explicit CausalSelfAttention(int64_t heads) : CausalSelfAttention(heads, heads) {}
  // Grouped-query: `groups` key/value heads, shared by heads / groups query heads each.
  CausalSelfAttention(int64_t heads, int64_t groups);
  const char* kind() const override { return "attention"; }
  std::vector<Shape> output_shapes(std::span<const Shape> in) const override;
  double flops(std::span<const Shape> in) const override;
  std::unique_ptr<LayerCtx> make_ctx() const override;
  bool writes_input_grad(size_t) const override { return true; }
  int64_t heads() const { return heads_; }
  int64_t groups() const { return groups_; }
  std::unique_ptr<Layer> tensor_parallel(TpBuild& build) const override;

  void forward(LayerCtx& ctx, Arena& arena, std::span<const Tensor> in,
               std::span<const Tensor> out) override;
  void backward_input(LayerCtx& ctx, Arena& arena, std::span<const Tensor> grad_out,
                      std::span<const Tensor> grad_in) override;

 private:
  int64_t heads_, groups_;
};

}  // namespace weft
