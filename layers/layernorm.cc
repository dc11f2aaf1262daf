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

ResidualLayerNorm::ResidualLayerNorm(Param* weight, Param* bias, float eps)
    : w_(weight), b_(bias), eps_(eps) {}

std::vector<Shape> ResidualLayerNorm::output_shapes(std::span<const Shape> in) const {
  check(in.size() == 2 && in[0] == in[1], "residual adds two equal shapes, got {} and {}",
        in.empty() ? "nothing" : in[0].str(), in.size() > 1 ? in[1].str() : "nothing");
  check(in[0].last() == w_->value.numel(),
        "{}: input width {} does not match the normalised width {}", w_->name, in[0].last(),
        w_->value.numel());
  return {in[0], in[0]};
}

std::unique_ptr<Layer> ResidualLayerNorm::tensor_parallel(TpBuild& build) const {
  return std::make_unique<ResidualLayerNorm>(build.param(*w_, -1), build.param(*b_, -1), eps_);
}

std::unique_ptr<LayerCtx> ResidualLayerNorm::make_ctx() const { return std::make_unique<Ctx>(); }

void ResidualLayerNorm::forward(LayerCtx& ctx_, Arena& arena, std::span<const Tensor> in,
                                std::span<const Tensor> out) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  const int64_t n = in[0].shape().rows();
  ctx.x = out[0];  // the sum is what was normalised
  ctx.mean = arena.alloc({n});
  ctx.rstd = arena.alloc({n});
  ops::add_layernorm_forward(in[0], in[1], w_->value, b_->value, out[0], out[1], ctx.mean,
                             ctx.rstd, eps_);
}

// In input order, as Residual's: the first input that needs its gradient
// written whole gets it in the kernel that adds LayerNorm's part to s's
// gradient; another copies it, or adds it where its buffer already holds a
// gradient; a shared one is s's gradient buffer itself.
void ResidualLayerNorm::backward_input(LayerCtx& ctx_, Arena&, std::span<const Tensor> grad_out,
                                       std::span<const Tensor> grad_in) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  ctx.dy = grad_out[1];
  const Tensor& ds = grad_out[0];
  if (!grad_in[0].defined() && !grad_in[1].defined()) return;
  bool added = false;
  for (size_t i = 0; i < grad_in.size(); ++i) {
    const Tensor& g = grad_in[i];
    if (!g.defined() || (ctx.shared_grads_in & (1u << i))) continue;
    if (!added && (ctx.fresh_grads_in & (1u << i))) {
      ops::layernorm_backward_input_copy(ctx.dy, ctx.x, w_->value, ctx.mean, ctx.rstd, ds, g);
      added = true;
      continue;
    }
    if (!added) {
      ops::layernorm_backward_input(ctx.dy, ctx.x, w_->value, ctx.mean, ctx.rstd, ds);
      added = true;
    }
    if (ctx.fresh_grads_in & (1u << i))
      g.copy_from(ds);
    else
      ops::add(g, ds);
  }
  if (!added) ops::layernorm_backward_input(ctx.dy, ctx.x, w_->value, ctx.mean, ctx.rstd, ds);
}

void ResidualLayerNorm::backward_weight(LayerCtx& ctx_, Arena&) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  ops::layernorm_backward_weight(ctx.dy, ctx.x, ctx.mean, ctx.rstd, w_->grad, b_->grad);
  ctx.dy = Tensor();  // W is done with it (weft/layer.h)
}

}  // namespace weft
