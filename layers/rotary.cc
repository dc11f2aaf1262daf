#include "layers/rotary.h"

#include <weft/communicator.h>
#include <weft/ops.h>
#include <weft/tensor_parallel.h>

namespace weft {

Rotary::Rotary(int64_t heads, float base) : heads_(heads), base_(base) {
  check(heads > 0 && base > 0, "rotary: heads ({}) and base ({}) must be positive", heads, base);
}

std::vector<Shape> Rotary::output_shapes(std::span<const Shape> in) const {
  check(in.size() == 1 && in[0].rank == 3 && in[0][2] % 3 == 0,
        "rotary takes a packed qkv (B, T, 3C), got {}", in.empty() ? "nothing" : in[0].str());
  const int64_t c = in[0][2] / 3;
  check(c % heads_ == 0 && (c / heads_) % 2 == 0,
        "rotary: width {} must split into {} heads of an even size", c, heads_);
  return {in[0]};
}

std::unique_ptr<Layer> Rotary::tensor_parallel(TpBuild& build) const {
  const int tp = build.group->size();
  check(heads_ % tp == 0, "rotary heads ({}) must be divisible by tensor-parallel size ({})",
        heads_, tp);
  return std::make_unique<Rotary>(heads_ / tp, base_);
}

// y (B, T, 3C) = [rotate(q), rotate(k), v]
void Rotary::forward(LayerCtx&, Arena&, std::span<const Tensor> in, std::span<const Tensor> out) {
  ops::rope_forward(in[0], out[0], heads_, base_);
}

// dx += [rotate^-1(dq), rotate^-1(dk), dv]: a rotation's inverse is its transpose.
void Rotary::backward_input(LayerCtx&, Arena&, std::span<const Tensor> grad_out,
                            std::span<const Tensor> grad_in) {
  if (!grad_in[0].defined()) return;
  ops::rope_backward(grad_out[0], grad_in[0], heads_, base_);
}

}  // namespace weft
