#include "layers/embedding.h"

#include <weft/tensor_parallel.h>

#include <algorithm>

#include "layers/tp_embedding.h"

namespace weft {

namespace {
struct Ctx : LayerCtx {
  Tensor tokens;  // (B, T) int32
  Tensor dy;      // (B, T, C), kept by I for W
};
constexpr int64_t kColBlock = 64;
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

// tokens (B, T) -> y (B, T, C)
void Embedding::forward(LayerCtx& ctx_, Arena&, std::span<const Tensor> in,
                        std::span<const Tensor> out) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  const Tensor& tok = in[0];
  const int64_t b = tok.dim(0), t = tok.dim(1), c = wte_->value.dim(1);
  const int64_t v = wte_->value.dim(0);
  const int32_t* tp = tok.data<int32_t>();
  for (int64_t i = 0; i < b * t; ++i)
    check(tp[i] >= 0 && tp[i] < v, "token {} at position {} is outside the vocabulary [0, {})",
          tp[i], i, v);
  const float* wte = wte_->value.data<float>();
  const float* wpe = wpe_->value.data<float>();
  float* y = out[0].data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < b * t; ++i) {
    const float* e = wte + static_cast<int64_t>(tp[i]) * c;
    const float* p = wpe + (i % t) * c;
    for (int64_t j = 0; j < c; ++j) y[i * c + j] = e[j] + p[j];
  }
  ctx.tokens = tok;
}

void Embedding::backward_input(LayerCtx& ctx_, Arena&, std::span<const Tensor> grad_out,
                               std::span<const Tensor>) {
  static_cast<Ctx&>(ctx_).dy = grad_out[0];  // tokens have no gradient
}

// dwte[tokens[i]] += dy[i]; dwpe[t] += sum_b dy[b, t]
void Embedding::backward_weight(LayerCtx& ctx_, Arena&) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  const int64_t b = ctx.tokens.dim(0), t = ctx.tokens.dim(1), c = wte_->value.dim(1);
  const int32_t* tp = ctx.tokens.data<int32_t>();
  const float* dy = ctx.dy.data<float>();
  float* dwte = wte_->grad.data<float>();
  float* dwpe = wpe_->grad.data<float>();
  const int64_t blocks = (c + kColBlock - 1) / kColBlock;
  // Column blocks: no two threads touch the same element, and the summation
  // order is the token order whatever the thread count.
#pragma omp parallel for schedule(static)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t j0 = blk * kColBlock, j1 = std::min(c, j0 + kColBlock);
    for (int64_t i = 0; i < b * t; ++i) {
      float* e = dwte + static_cast<int64_t>(tp[i]) * c;
      float* p = dwpe + (i % t) * c;
      for (int64_t j = j0; j < j1; ++j) {
        e[j] += dy[i * c + j];
        p[j] += dy[i * c + j];
      }
    }
  }
}

}  // namespace weft
