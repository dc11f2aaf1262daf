// Tied LM head + cross-entropy with the vocabulary split across a
// tensor-parallel group (Megatron's vocab-parallel cross-entropy):
//   (x (B, T, C) whole, targets (B, T) int32) -> loss (1), the same on every rank
//
// Rank r holds rows [r V/tp, (r+1) V/tp) of wte (tied with the embedding's)
// and computes only its logits, x wte_r^T (B, T, V/tp). The softmax over the
// whole vocabulary needs three numbers per token, combined across the group:
//   m   = max over ranks of the local row max                (all-reduce Max)
//   S   = sum over ranks of sum_j exp(logit_j - m)            (all-reduce Sum)
//   z_t = the target's logit - m, from the rank that holds it (same all-reduce)
// loss = sum over tokens of log S - z_t. No rank ever holds full logits. As
// with TiedLmHeadLoss the output is the SUM of token losses. x enters through
// copy_to_tp, so dx is the sum of every rank's dlogits_r wte_r. Built by
// TiedLmHeadLoss::tensor_parallel.
#pragma once

#include <weft/communicator.h>
#include <weft/layer.h>

namespace weft {

class VocabParallelLmHeadLoss final : public Layer {
 public:
  // wte (V/tp, C): this rank's rows (wte->shard says which).
  VocabParallelLmHeadLoss(Communicator& group, Param* wte);
  const char* kind() const override { return "vocab_parallel_lm_head_loss"; }
  std::vector<Shape> output_shapes(std::span<const Shape> in) const override;
  std::vector<Param*> params() const override { return {wte_}; }
  double flops(std::span<const Shape> in) const override;
  std::unique_ptr<LayerCtx> make_ctx() const override;

  // Keep this rank's logits (B, T, V/tp) in the ctx after forward.
  void set_keep_logits(bool keep) { keep_logits_ = keep; }
  // This rank's logits (N, V/tp) of the last forward on this ctx: columns
  // first_token() .. of the full logits (needs set_keep_logits(true)).
  static const Tensor& logits(LayerCtx& ctx);
  int64_t first_token() const { return first_; }

  void forward(LayerCtx& ctx, Arena& arena, std::span<const Tensor> in,
               std::span<const Tensor> out) override;
  void backward_input(LayerCtx& ctx, Arena& arena, std::span<const Tensor> grad_out,
                      std::span<const Tensor> grad_in) override;
  void backward_weight(LayerCtx& ctx, Arena& arena) override;

 private:
  Communicator* group_;
  Param* wte_;
  int64_t vocab_;  // V, the whole vocabulary
  int64_t first_;  // the first token id of this rank's rows
  bool keep_logits_ = false;
};

}  // namespace weft
