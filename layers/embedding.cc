#include "layers/embedding.h"

#include <weft/ops.h>
#include <weft/tensor_parallel.h>

#include "layers/tp_embedding.h"

namespace weft {

namespace {
struct Ctx : LayerCtx {
  Tensor tokens;  // (B, T) int32
  Tensor dy;      // (B, T, C), kept by I for W
};
}  // namespace

Embedding::Embedding(Param* wte, Param* wpe) : wte_(wte), wpe_(wpe) {
  check(wte->value.rank() == 2 && wpe->value.rank() == 2 &&
            wte->value.dim(1) == wpe->value.dim(1),
        "embedding tables {} {} and {} {} must be 2-D with the same width", wte->name,
        wte->value.shape().str(), wpe->name, wpe->value.shape().str());
}

std::vector<Shape> Embedding::output_shapes(std::span<const Shape> in) const {
  check(in.size() == 1 && in[0].rank == 2, "embedding takes tokens (B, T), got {} inputs",
        in.size());
  check(in[0][1] <= wpe_->value.dim(0),
        "sequence length ({}) must not exceed the position table ({} positions)", in[0][1],
        wpe_->value.dim(0));
  return {Shape{in[0][0], in[0][1], wte_->value.dim(1)}};
}

std::unique_ptr<Layer> Embedding::tensor_parallel(TpBuild& build) const {
  const int tp = build.group->size();
  check(wte_->value.dim(0) % tp == 0,
        "vocabulary ({}) must be divisible by tensor-parallel size ({})", wte_->value.dim(0), tp);
  return std::make_unique<VocabParallelEmbedding>(*build.group, build.param(*wte_, 0),
                                                  build.param(*wpe_, -1));
}

std::unique_ptr<LayerCtx> Embedding::make_ctx() const { return std::make_unique<Ctx>(); }

// tokens (B, T) -> y (B, T, C) = wte[tokens] + wpe[t]
void Embedding::forward(LayerCtx& ctx_, Arena&, std::span<const Tensor> in,
                        std::span<const Tensor> out) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  ops::check_token_range(in[0], wte_->value.dim(0), "token");
  ops::embedding_forward(in[0], wte_->value, 0, wpe_->value, out[0]);
  ctx.tokens = in[0];
}

void Embedding::backward_input(LayerCtx& ctx_, Arena&, std::span<const Tensor> grad_out,
                               std::span<const Tensor>) {
  static_cast<Ctx&>(ctx_).dy = grad_out[0];  // tokens have no gradient
}

// dwte[tokens[i]] += dy[i]; dwpe[t] += sum_b dy[b, t]
void Embedding::backward_weight(LayerCtx& ctx_, Arena&) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  ops::embedding_backward(ctx.tokens, ctx.dy, wte_->grad, 0, wpe_->grad);
}

}  // namespace weft
