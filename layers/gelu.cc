#include "layers/gelu.h"

#include <weft/ops.h>

namespace weft {

namespace {
struct Ctx : LayerCtx {
  Tensor x;
};
}  // namespace

std::vector<Shape> Gelu::output_shapes(std::span<const Shape> in) const {
  check(in.size() == 1, "gelu takes one input, got {}", in.size());
  return {in[0]};
}

std::unique_ptr<Layer> Gelu::tensor_parallel(TpBuild&) const { return std::make_unique<Gelu>(); }

std::unique_ptr<LayerCtx> Gelu::make_ctx() const { return std::make_unique<Ctx>(); }

void Gelu::forward(LayerCtx& ctx, Arena&, std::span<const Tensor> in,
                   std::span<const Tensor> out) {
  static_cast<Ctx&>(ctx).x = in[0];
  ops::gelu_forward(in[0], out[0]);
}

void Gelu::backward_input(LayerCtx& ctx, Arena&, std::span<const Tensor> grad_out,
                          std::span<const Tensor> grad_in) {
  if (!grad_in[0].defined()) return;
  const Tensor& x = static_cast<Ctx&>(ctx).x;
  ops::gelu_backward(grad_out[0], x, grad_in[0], !(ctx.fresh_grads_in & 1u));
}

}  // namespace weft
