#include "layers/tp_embedding.h"

#include <algorithm>

#include "layers/tp_regions.h"

namespace weft {

namespace {
struct Ctx : LayerCtx {
  Tensor tokens;  // (B, T) int32
  Tensor dy;      // (B, T, C), kept by I for W
};
constexpr int64_t kColBlock = 64;
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
void VocabParallelEmbedding::forward(LayerCtx& ctx_, Arena&, std::span<const Tensor> in,
                                     std::span<const Tensor> out) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  const Tensor& tok = in[0];
  const int64_t b = tok.dim(0), t = tok.dim(1), c = wte_->value.dim(1);
  const int64_t rows = wte_->value.dim(0);
  const int32_t* tp = tok.data<int32_t>();
  for (int64_t i = 0; i < b * t; ++i)
    check(tp[i] >= 0 && tp[i] < vocab_, "token {} at position {} is outside the vocabulary [0, {})",
          tp[i], i, vocab_);
  const float* wte = wte_->value.data<float>();
  const float* wpe = wpe_->value.data<float>();
  float* y = out[0].data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < b * t; ++i) {
    const int64_t row = tp[i] - first_;
    if (row >= 0 && row < rows)
      std::copy_n(wte + row * c, c, y + i * c);
    else
      std::fill_n(y + i * c, c, 0.0f);
  }
  reduce_from_tp_forward(*group_, out[0]);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < b * t; ++i) {
    const float* p = wpe + (i % t) * c;
    for (int64_t j = 0; j < c; ++j) y[i * c + j] += p[j];
  }
  ctx.tokens = tok;
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
  const int64_t b = ctx.tokens.dim(0), t = ctx.tokens.dim(1), c = wte_->value.dim(1);
  const int64_t rows = wte_->value.dim(0);
  const int32_t* tp = ctx.tokens.data<int32_t>();
  const float* dy = ctx.dy.data<float>();
  float* dwte = wte_->grad.data<float>();
  float* dwpe = wpe_->grad.data<float>();
  const int64_t blocks = (c + kColBlock - 1) / kColBlock;
  // Column blocks, as in Embedding: no two threads touch the same element, and
  // the summation order is the token order whatever the thread count.
#pragma omp parallel for schedule(static)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t j0 = blk * kColBlock, j1 = std::min(c, j0 + kColBlock);
    for (int64_t i = 0; i < b * t; ++i) {
      float* p = dwpe + (i % t) * c;
      for (int64_t j = j0; j < j1; ++j) p[j] += dy[i * c + j];
      const int64_t row = tp[i] - first_;
      if (row < 0 || row >= rows) continue;
      float* e = dwte + row * c;
      for (int64_t j = j0; j < j1; ++j) e[j] += dy[i * c + j];
    }
  }
}

}  // namespace weft
