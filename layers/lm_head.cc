#include "layers/lm_head.h"

#include <weft/cpu_kernels.h>
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
  const int64_t n = in[0].shape().rows(), c = in[0].shape().last(), v = wte_->value.dim(0);
  ctx.x = in[0];
  ctx.targets = in[1];
  ctx.probs = arena.alloc({n, v});
  cpu::gemm(false, true, n, v, c, 1.0f, in[0].data<float>(), c, wte_->value.data<float>(), c,
            0.0f, ctx.probs.data<float>(), v);
  if (keep_logits_) {
    ctx.logits = arena.alloc({n, v});
    ctx.logits.copy_from(ctx.probs);
  }
  Tensor losses = arena.alloc({n});
  double total = cpu::softmax_cross_entropy(ctx.probs.data<float>(), in[1].data<int32_t>(),
                                            losses.data<float>(), n, v);
  out[0].data<float>()[0] = static_cast<float>(total);
}

// dlogits = (p - onehot) * g, where g = d loss_total / d (this sum); dx += dlogits wte
void TiedLmHeadLoss::backward_input(LayerCtx& ctx_, Arena&, std::span<const Tensor> grad_out,
                                    std::span<const Tensor> grad_in) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  const int64_t n = ctx.x.shape().rows(), c = ctx.x.shape().last(), v = wte_->value.dim(0);
  const float g = grad_out[0].data<float>()[0];
  float* dl = ctx.probs.data<float>();
  cpu::cross_entropy_backward(dl, ctx.targets.data<int32_t>(), dl, g, n, v);
  if (!grad_in[0].defined()) return;
  cpu::gemm(false, false, n, c, v, 1.0f, dl, v, wte_->value.data<float>(), c, 1.0f,
            grad_in[0].data<float>(), c);
}

// dwte (V, C) += dlogits^T x
void TiedLmHeadLoss::backward_weight(LayerCtx& ctx_, Arena&) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  const int64_t n = ctx.x.shape().rows(), c = ctx.x.shape().last(), v = wte_->value.dim(0);
  cpu::gemm(true, false, v, c, n, 1.0f, ctx.probs.data<float>(), v, ctx.x.data<float>(), c, 1.0f,
            wte_->grad.data<float>(), c);
}

}  // namespace weft
