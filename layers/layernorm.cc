#include "layers/layernorm.h"

#include <weft/cpu_kernels.h>
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
  const int64_t n = in[0].shape().rows(), c = in[0].shape().last();
  ctx.x = in[0];
  ctx.mean = arena.alloc({n});
  ctx.rstd = arena.alloc({n});
  cpu::layernorm_forward(in[0].data<float>(), w_->value.data<float>(), b_->value.data<float>(),
                         out[0].data<float>(), ctx.mean.data<float>(), ctx.rstd.data<float>(), n,
                         c, eps_);
}

void LayerNorm::backward_input(LayerCtx& ctx_, Arena&, std::span<const Tensor> grad_out,
                               std::span<const Tensor> grad_in) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  ctx.dy = grad_out[0];
  if (!grad_in[0].defined()) return;
  const int64_t n = ctx.x.shape().rows(), c = ctx.x.shape().last();
  cpu::layernorm_backward_input(ctx.dy.data<float>(), ctx.x.data<float>(),
                                w_->value.data<float>(), ctx.mean.data<float>(),
                                ctx.rstd.data<float>(), grad_in[0].data<float>(), n, c);
}

void LayerNorm::backward_weight(LayerCtx& ctx_, Arena&) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  const int64_t n = ctx.x.shape().rows(), c = ctx.x.shape().last();
  cpu::layernorm_backward_weight(ctx.dy.data<float>(), ctx.x.data<float>(),
                                 ctx.mean.data<float>(), ctx.rstd.data<float>(),
                                 w_->grad.data<float>(), b_->grad.data<float>(), n, c);
}

}  // namespace weft
