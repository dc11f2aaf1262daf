#include "layers/rmsnorm.h"

#include <weft/ops.h>
#include <weft/tensor_parallel.h>

namespace weft {

namespace {
struct Ctx : LayerCtx {
  Tensor x;     // (N, C)
  Tensor rstd;  // (N)
  Tensor dy;    // (N, C), kept by I for W
};
}  // namespace

RmsNorm::RmsNorm(Param* weight, float eps) : w_(weight), eps_(eps) {}

std::vector<Shape> RmsNorm::output_shapes(std::span<const Shape> in) const {
  check(in.size() == 1 && in[0].last() == w_->value.numel(),
        "{}: input width {} does not match the normalised width {}", w_->name, in[0].last(),
        w_->value.numel());
  return {in[0]};
}

std::unique_ptr<Layer> RmsNorm::tensor_parallel(TpBuild& build) const {
  return std::make_unique<RmsNorm>(build.param(*w_, -1), eps_);
}

std::unique_ptr<LayerCtx> RmsNorm::make_ctx() const { return std::make_unique<Ctx>(); }

// y (N, C) = x r w, r (N) = 1 / sqrt(mean(x^2) + eps)
void RmsNorm::forward(LayerCtx& ctx_, Arena& arena, std::span<const Tensor> in,
                      std::span<const Tensor> out) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  ctx.x = in[0];
  ctx.rstd = arena.alloc({in[0].shape().rows()});
  ops::rmsnorm_forward(in[0], w_->value, out[0], ctx.rstd, eps_);
}

// dx (N, C) += r w dy - x r^3 mean(w dy x)
void RmsNorm::backward_input(LayerCtx& ctx_, Arena&, std::span<const Tensor> grad_out,
                             std::span<const Tensor> grad_in) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  ctx.dy = grad_out[0];
  if (!grad_in[0].defined()) return;
  ops::rmsnorm_backward_input(ctx.dy, ctx.x, w_->value, ctx.rstd, grad_in[0]);
}

// dw (C) += sum over rows of dy x r
void RmsNorm::backward_weight(LayerCtx& ctx_, Arena&) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  ops::rmsnorm_backward_weight(ctx.dy, ctx.x, ctx.rstd, w_->grad);
  ctx.dy = Tensor();  // W is done with it (weft/layer.h)
}

}  // namespace weft
