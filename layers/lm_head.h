// Tied LM head + cross-entropy: (x (B, T, C), targets (B, T) int32) -> loss (1).
//
//   logits = x wte^T          (B, T, V), wte shared with the embedding
//   loss   = sum over tokens of -log softmax(logits)[target]
// The output is the SUM of token losses; the caller seeds its gradient with
// 1 / (tokens in the global batch), which makes the result the gradient of the
// mean whatever the split into micro-batches and replicas.
#pragma once

#include <weft/layer.h>

namespace weft {

class TiedLmHeadLoss final : public Layer {
 public:
  explicit TiedLmHeadLoss(Param* wte);  // wte (V, C)
  const char* kind() const override { return "lm_head_loss"; }
  std::vector<Shape> output_shapes(std::span<const Shape> in) const override;
  std::vector<Param*> params() const override { return {wte_}; }
  double flops(std::span<const Shape> in) const override;
  std::unique_ptr<LayerCtx> make_ctx() const override;

  // Keep the raw logits (B, T, V) in the ctx after forward, for sampling and tests.
  void set_keep_logits(bool keep) { keep_logits_ = keep; }
  // Logits of the last forward on this ctx (needs set_keep_logits(true)).
  static const Tensor& logits(LayerCtx& ctx);
  // Tensor-parallel: VocabParallelLmHeadLoss (layers/tp_lm_head.h), with the
  // same rows of wte as the embedding's; the vocabulary must divide by the
  // group size.
  std::unique_ptr<Layer> tensor_parallel(TpBuild& build) const override;

  void forward(LayerCtx& ctx, Arena& arena, std::span<const Tensor> in,
               std::span<const Tensor> out) override;
  void backward_input(LayerCtx& ctx, Arena& arena, std::span<const Tensor> grad_out,
                      std::span<const Tensor> grad_in) override;
  void backward_weight(LayerCtx& ctx, Arena& arena) override;

 private:
  Param* wte_;
  bool keep_logits_ = false;
};

}  // namespace weft
