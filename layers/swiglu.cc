#include "layers/swiglu.h"

#include <weft/ops.h>

namespace weft {

namespace {
struct Ctx : LayerCtx {
  Tensor x;  // (N, 2H)
};
}  // namespace

std::vector<Shape> SwiGlu::output_shapes(std::span<const Shape> in) const {
  check(in.size() == 1 && in[0].last() % 2 == 0,
        "swiglu takes one input whose width is even (gate | up), got width {}", in[0].last());
  Shape s = in[0];
  s[s.rank - 1] /= 2;
  return {s};
}

std::unique_ptr<Layer> SwiGlu::tensor_parallel(TpBuild&) const {
  return std::make_unique<SwiGlu>();
}

std::unique_ptr<LayerCtx> SwiGlu::make_ctx() const { return std::make_unique<Ctx>(); }

// y (N, H) = silu(x[:, :H]) * x[:, H:]
void SwiGlu::forward(LayerCtx& ctx, Arena&, std::span<const Tensor> in,
                     std::span<const Tensor> out) {
  static_cast<Ctx&>(ctx).x = in[0];
  ops::swiglu_forward(in[0], out[0]);
}

// dgate += dy up silu'(gate); dup += dy silu(gate)
void SwiGlu::backward_input(LayerCtx& ctx, Arena&, std::span<const Tensor> grad_out,
                            std::span<const Tensor> grad_in) {
  if (!grad_in[0].defined()) return;
  ops::swiglu_backward(grad_out[0], static_cast<Ctx&>(ctx).x, grad_in[0]);
}

}  // namespace weft
