#include "layers/residual.h"

#include <weft/ops.h>

namespace weft {

std::vector<Shape> Residual::output_shapes(std::span<const Shape> in) const {
  check(in.size() == 2 && in[0] == in[1], "residual adds two equal shapes, got {} and {}",
        in.empty() ? "nothing" : in[0].str(), in.size() > 1 ? in[1].str() : "nothing");
  return {in[0]};
}

std::unique_ptr<Layer> Residual::tensor_parallel(TpBuild&) const {
  return std::make_unique<Residual>();
}

void Residual::forward(LayerCtx&, Arena&, std::span<const Tensor> in,
                       std::span<const Tensor> out) {
  ops::add(in[0], in[1], out[0]);
}

// In input order: where both inputs are one value, the first copies and the
// second adds. An input whose gradient is the output's own buffer
// (LayerCtx::shared_grads_in) already holds it.
void Residual::backward_input(LayerCtx& ctx, Arena&, std::span<const Tensor> grad_out,
                              std::span<const Tensor> grad_in) {
  for (size_t i = 0; i < grad_in.size(); ++i) {
    const Tensor& g = grad_in[i];
    if (!g.defined() || (ctx.shared_grads_in & (1u << i))) continue;
    if (ctx.fresh_grads_in & (1u << i))
      g.copy_from(grad_out[0]);
    else
      ops::add(g, grad_out[0]);
  }
}

}  // namespace weft
