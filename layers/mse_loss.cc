#include "layers/mse_loss.h"

#include <weft/ops.h>

namespace weft {

namespace {
struct Ctx : LayerCtx {
  Tensor pred, target;
};
}  // namespace

std::vector<Shape> MseLoss::output_shapes(std::span<const Shape> in) const {
  check(in.size() == 2 && in[0] == in[1], "mse loss compares two equal shapes, got {} and {}",
        in.empty() ? "nothing" : in[0].str(), in.size() > 1 ? in[1].str() : "nothing");
  return {Shape{1}};
}

std::unique_ptr<Layer> MseLoss::tensor_parallel(TpBuild&) const {
  return std::make_unique<MseLoss>();
}

std::unique_ptr<LayerCtx> MseLoss::make_ctx() const { return std::make_unique<Ctx>(); }

void MseLoss::forward(LayerCtx& ctx_, Arena&, std::span<const Tensor> in,
                      std::span<const Tensor> out) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  ctx.pred = in[0];
  ctx.target = in[1];
  ops::set_item(out[0], static_cast<float>(ops::mse_loss(in[0], in[1])));
}

void MseLoss::backward_input(LayerCtx& ctx_, Arena&, std::span<const Tensor> grad_out,
                             std::span<const Tensor> grad_in) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  const float g = ctx.seeded_grad_out ? *ctx.seeded_grad_out : ops::item(grad_out[0]);
  for (int k = 0; k < 2; ++k) {
    if (!grad_in[static_cast<size_t>(k)].defined()) continue;
    ops::mse_backward(ctx.pred, ctx.target, k == 0 ? g : -g, grad_in[static_cast<size_t>(k)]);
  }
}

}  // namespace weft
