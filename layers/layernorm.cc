#include "layers/layernorm.h"

#include <weft/ops.h>
#include <weft/tensor_parallel.h>

namespace weft {

namespace {
struct Ctx : LayerCtx {
  Tensor x;     // (N, C)
  Tensor mean;  // (N)
  Tensor rstd;  // (N)
  Tensor dy;    // (N, C), kept by I for W
};
}  // namespace

LayerNorm::LayerNorm(Param* weight, Param* bias, float eps) : w_(weight), b_(bias), eps_(eps) {}

std::vector<Shape> LayerNorm::output_shapes(std::span<const Shape> in) const {
  check(in.size() == 1 && in[0].last() == w_->value.numel(),
        "{}: input width {} does not match the normalised width {}", w_->name, in[0].last(),
        w_->value.numel());
  return {in[0]};
}

std::unique_ptr<Layer> LayerNorm::tensor_parallel(TpBuild& build) const {
  return std::make_unique<LayerNorm>(build.param(*w_, -1), build.param(*b_, -1), eps_);
}

std::unique_ptr<LayerCtx> LayerNorm::make_ctx() const { return std::make_unique<Ctx>(); }

void LayerNorm::forward(LayerCtx& ctx_, Arena& arena, std::span<const Tensor> in,
                        std::span<const Tensor> out) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  const int64_t n = in[0].shape().rows();
  ctx.x = in[0];
  ctx.mean = arena.alloc({n});
  ctx.rstd = arena.alloc({n});
  ops::layernorm_forward(in[0], w_->value, b_->value, out[0], ctx.mean, ctx.rstd, eps_);
}

void LayerNorm::backward_input(LayerCtx& ctx_, Arena&, std::span<const Tensor> grad_out,
                               std::span<const Tensor> grad_in) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  ctx.dy = grad_out[0];
  if (!grad_in[0].defined()) return;
  ops::layernorm_backward_input(ctx.dy, ctx.x, w_->value, ctx.mean, ctx.rstd, grad_in[0]);
}

void LayerNorm::backward_weight(LayerCtx& ctx_, Arena&) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  ops::layernorm_backward_weight(ctx.dy, ctx.x, ctx.mean, ctx.rstd, w_->grad, b_->grad);
  ctx.dy = Tensor();  // W is done with it (weft/layer.h)
}

}  // namespace weft
