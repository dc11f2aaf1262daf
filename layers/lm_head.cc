#include "layers/lm_head.h"

#include <weft/ops.h>
#include <weft/tensor_parallel.h>

#include "layers/tp_lm_head.h"

namespace weft {

namespace {
struct Ctx : LayerCtx {
  Tensor x;        // (N, C)
  Tensor targets;  // (N)
  Tensor probs;    // (N, V); turned into dlogits in place by backward_input
  Tensor logits;   // (N, V), only with keep_logits
};
}  // namespace

TiedLmHeadLoss::TiedLmHeadLoss(Param* wte) : wte_(wte) {}

std::vector<Shape> TiedLmHeadLoss::output_shapes(std::span<const Shape> in) const {
  check(in.size() == 2, "lm head takes (x, targets), got {} inputs", in.size());
  check(in[0].last() == wte_->value.dim(1),
        "lm head: input width {} does not match the embedding width {}", in[0].last(),
        wte_->value.dim(1));
  check(in[1].numel() == in[0].rows(), "lm head: {} targets for {} positions", in[1].numel(),
        in[0].rows());
  return {Shape{1}};
}

double TiedLmHeadLoss::flops(std::span<const Shape> in) const {
  return 2.0 * static_cast<double>(in[0].rows()) * static_cast<double>(wte_->value.numel());
}

std::unique_ptr<Layer> TiedLmHeadLoss::tensor_parallel(TpBuild& build) const {
  const int tp = build.group->size();
  check(wte_->value.dim(0) % tp == 0,
        "vocabulary ({}) must be divisible by tensor-parallel size ({})", wte_->value.dim(0), tp);
  auto head = std::make_unique<VocabParallelLmHeadLoss>(*build.group, build.param(*wte_, 0));
  head->set_keep_logits(keep_logits_);
  return head;
}

std::unique_ptr<LayerCtx> TiedLmHeadLoss::make_ctx() const { return std::make_unique<Ctx>(); }

const Tensor& TiedLmHeadLoss::logits(LayerCtx& ctx) { return static_cast<Ctx&>(ctx).logits; }

// logits (N, V) = x (N, C) wte^T; loss = sum -log softmax[target]
void TiedLmHeadLoss::forward(LayerCtx& ctx_, Arena& arena, std::span<const Tensor> in,
                             std::span<const Tensor> out) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  const int64_t n = in[0].shape().rows(), v = wte_->value.dim(0);
  ctx.x = in[0];
  ctx.targets = in[1];
  ctx.probs = arena.alloc({n, v});
  ops::gemm(in[0], false, wte_->value, true, ctx.probs);
  if (keep_logits_) {
    ctx.logits = arena.alloc({n, v});
    ctx.logits.copy_from(ctx.probs);
  }
  Tensor losses = arena.alloc({n});
  const double total = ops::softmax_cross_entropy(ctx.probs, in[1], losses);
  ops::set_item(out[0], static_cast<float>(total));
}

// dlogits = (p - onehot) * g, where g = d loss_total / d (this sum); dx += dlogits wte
void TiedLmHeadLoss::backward_input(LayerCtx& ctx_, Arena&, std::span<const Tensor> grad_out,
                                    std::span<const Tensor> grad_in) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  const float g = ops::item(grad_out[0]);
  ops::cross_entropy_backward(ctx.probs, ctx.targets, 0, ctx.probs, g);  // in place: dlogits
  if (!grad_in[0].defined()) return;
  ops::gemm(ctx.probs, false, wte_->value, false, grad_in[0], 1.0f, 1.0f);
}

// dwte (V, C) += dlogits^T x
void TiedLmHeadLoss::backward_weight(LayerCtx& ctx_, Arena&) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  ops::gemm(ctx.probs, true, ctx.x, false, wte_->grad, 1.0f, 1.0f);
}

}  // namespace weft
