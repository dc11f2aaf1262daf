#include "layers/tp_embedding.h"

#include <weft/ops.h>

#include "layers/tp_regions.h"

namespace weft {

namespace {
struct Ctx : LayerCtx {
  Tensor tokens;  // (B, T) int32
  Tensor dy;      // (B, T, C), kept by I for W
};
}  // namespace

VocabParallelEmbedding::VocabParallelEmbedding(Communicator& group, Param* wte, Param* wpe)
    : group_(&group), wte_(wte), wpe_(wpe) {
  check(wte->value.rank() == 2 && wpe->value.rank() == 2 && wte->value.dim(1) == wpe->value.dim(1),
        "embedding tables {} {} and {} {} must be 2-D with the same width", wte->name,
        wte->value.shape().str(), wpe->name, wpe->value.shape().str());
  check(wte->shard.dim == 0 || !wte->shard.split(),
        "{}: a vocabulary-parallel table is split by rows, not along dimension {}", wte->name,
        wte->shard.dim);
  vocab_ = wte->shard.full[0];
  first_ = wte->shard.split() ? wte->shard.index * wte->value.dim(0) : 0;
}

std::vector<Shape> VocabParallelEmbedding::output_shapes(std::span<const Shape> in) const {
  check(in.size() == 1 && in[0].rank == 2, "embedding takes tokens (B, T), got {} inputs",
        in.size());
  check(in[0][1] <= wpe_->value.dim(0),
        "sequence length ({}) must not exceed the position table ({} positions)", in[0][1],
        wpe_->value.dim(0));
  return {Shape{in[0][0], in[0][1], wte_->value.dim(1)}};
}

std::unique_ptr<LayerCtx> VocabParallelEmbedding::make_ctx() const {
  return std::make_unique<Ctx>();
}

// tokens (B, T) -> y (B, T, C) = sum over ranks of (wte_r row, or 0) + wpe[t]
// Tensor-parallel rank 0 adds the positions before the sum: exactly one rank
// holds each token's row and adding zeros is exact, so every rank ends with
// wte[token] + wpe[t] bit for bit, as on one rank.
void VocabParallelEmbedding::forward(LayerCtx& ctx_, Arena&, std::span<const Tensor> in,
                                     std::span<const Tensor> out) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  ops::check_token_range(in[0], vocab_, "token");
  ops::embedding_forward(in[0], wte_->value, first_, group_->rank() == 0 ? wpe_->value : Tensor(),
                         out[0]);
  reduce_from_tp_forward(*group_, out[0]);
  ctx.tokens = in[0];
}

void VocabParallelEmbedding::backward_input(LayerCtx& ctx_, Arena&,
                                            std::span<const Tensor> grad_out,
                                            std::span<const Tensor>) {
  reduce_from_tp_backward(*group_, grad_out[0]);
  static_cast<Ctx&>(ctx_).dy = grad_out[0];  // tokens have no gradient
}

// dwte_r[tokens[i] - first] += dy[i] for this rank's tokens; dwpe[t] += sum_b dy[b, t]
void VocabParallelEmbedding::backward_weight(LayerCtx& ctx_, Arena&) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  ops::embedding_backward(ctx.tokens, ctx.dy, wte_->grad, first_, wpe_->grad);
}

}  // namespace weft
