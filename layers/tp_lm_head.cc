#include "layers/tp_lm_head.h"

#include <weft/cpu_kernels.h>

#include <algorithm>
#include <cmath>

#include "layers/tp_regions.h"

namespace weft {

namespace {
struct Ctx : LayerCtx {
  Tensor x;        // (N, C)
  Tensor targets;  // (N)
  Tensor probs;    // (N, V/tp); turned into dlogits in place by backward_input
  Tensor logits;   // (N, V/tp), only with keep_logits
};
}  // namespace

VocabParallelLmHeadLoss::VocabParallelLmHeadLoss(Communicator& group, Param* wte)
    : group_(&group), wte_(wte) {
  check(wte->value.rank() == 2, "{}: the lm head's table must be 2-D (V, C), got {}", wte->name,
        wte->value.shape().str());
  check(wte->shard.dim == 0 || !wte->shard.split(),
        "{}: a vocabulary-parallel table is split by rows, not along dimension {}", wte->name,
        wte->shard.dim);
  vocab_ = wte->shard.full[0];
  first_ = wte->shard.split() ? wte->shard.index * wte->value.dim(0) : 0;
}

std::vector<Shape> VocabParallelLmHeadLoss::output_shapes(std::span<const Shape> in) const {
  check(in.size() == 2, "lm head takes (x, targets), got {} inputs", in.size());
  check(in[0].last() == wte_->value.dim(1),
        "lm head: input width {} does not match the embedding width {}", in[0].last(),
        wte_->value.dim(1));
  check(in[1].numel() == in[0].rows(), "lm head: {} targets for {} positions", in[1].numel(),
        in[0].rows());
  return {Shape{1}};
}

double VocabParallelLmHeadLoss::flops(std::span<const Shape> in) const {
  return 2.0 * static_cast<double>(in[0].rows()) * static_cast<double>(wte_->value.numel());
}

std::unique_ptr<LayerCtx> VocabParallelLmHeadLoss::make_ctx() const {
  return std::make_unique<Ctx>();
}

const Tensor& VocabParallelLmHeadLoss::logits(LayerCtx& ctx) {
  return static_cast<Ctx&>(ctx).logits;
}

// logits_r (N, V/tp) = x (N, C) wte_r^T; loss = sum over tokens of log S - z_t
void VocabParallelLmHeadLoss::forward(LayerCtx& ctx_, Arena& arena, std::span<const Tensor> in,
                                      std::span<const Tensor> out) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  const int64_t n = in[0].shape().rows(), c = in[0].shape().last(), v = wte_->value.dim(0);
  const int32_t* tgt = in[1].data<int32_t>();
  for (int64_t i = 0; i < n; ++i)
    check(tgt[i] >= 0 && tgt[i] < vocab_,
          "target token {} at position {} is outside the vocabulary [0, {})", tgt[i], i, vocab_);
  copy_to_tp_forward(*group_, in[0]);
  ctx.x = in[0];
  ctx.targets = in[1];
  ctx.probs = arena.alloc({n, v});
  float* p = ctx.probs.data<float>();
  cpu::gemm(false, true, n, v, c, 1.0f, in[0].data<float>(), c, wte_->value.data<float>(), c, 0.0f,
            p, v);
  if (keep_logits_) {
    ctx.logits = arena.alloc({n, v});
    ctx.logits.copy_from(ctx.probs);
  }

  // m (N): the row max over the whole vocabulary.
  Tensor max = arena.alloc({n});
  float* m = max.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) m[i] = *std::max_element(p + i * v, p + i * v + v);
  if (group_->size() > 1) group_->all_reduce(max, ReduceOp::Max);

  // stats (2, N): S's local terms, then z_t where this rank holds the target (0 elsewhere).
  Tensor stats = arena.alloc({2, n});
  float* sum = stats.data<float>();
  float* z = sum + n;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    float* row = p + i * v;
    const int64_t col = tgt[i] - first_;
    z[i] = col >= 0 && col < v ? row[col] - m[i] : 0.0f;
    float s = 0.0f;
    for (int64_t j = 0; j < v; ++j) s += (row[j] = std::exp(row[j] - m[i]));
    sum[i] = s;
  }
  if (group_->size() > 1) group_->all_reduce(stats, ReduceOp::Sum);

  // probs_r = exp(logit - m) / S; every rank sums the same losses in the same order.
  double total = 0;
#pragma omp parallel for schedule(static) reduction(+ : total)
  for (int64_t i = 0; i < n; ++i) {
    float* row = p + i * v;
    const float inv = 1.0f / sum[i];
    for (int64_t j = 0; j < v; ++j) row[j] *= inv;
    total += static_cast<double>(std::log(sum[i]) - z[i]);
  }
  out[0].data<float>()[0] = static_cast<float>(total);
}

// dlogits_r = (p_r - onehot_r(target)) * g; dx += sum over ranks of dlogits_r wte_r
void VocabParallelLmHeadLoss::backward_input(LayerCtx& ctx_, Arena& arena,
                                             std::span<const Tensor> grad_out,
                                             std::span<const Tensor> grad_in) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  const int64_t n = ctx.x.shape().rows(), c = ctx.x.shape().last(), v = wte_->value.dim(0);
  const float g = grad_out[0].data<float>()[0];
  const int32_t* tgt = ctx.targets.data<int32_t>();
  float* dl = ctx.probs.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    float* row = dl + i * v;
    for (int64_t j = 0; j < v; ++j) row[j] *= g;
    const int64_t col = tgt[i] - first_;
    if (col >= 0 && col < v) row[col] -= g;
  }
  if (!grad_in[0].defined()) return;
  const Tensor part = copy_to_tp_grad_buffer(*group_, arena, grad_in[0]);
  cpu::gemm(false, false, n, c, v, 1.0f, dl, v, wte_->value.data<float>(), c, 1.0f,
            part.data<float>(), c);
  copy_to_tp_backward(*group_, part, grad_in[0]);
}

// dwte_r (V/tp, C) += dlogits_r^T x
void VocabParallelLmHeadLoss::backward_weight(LayerCtx& ctx_, Arena&) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  const int64_t n = ctx.x.shape().rows(), c = ctx.x.shape().last(), v = wte_->value.dim(0);
  cpu::gemm(true, false, v, c, n, 1.0f, ctx.probs.data<float>(), v, ctx.x.data<float>(), c, 1.0f,
            wte_->grad.data<float>(), c);
}

}  // namespace weft
