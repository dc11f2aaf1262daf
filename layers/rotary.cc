#include "layers/rotary.h"

#include <weft/communicator.h>
#include <weft/ops.h>
#include <weft/tensor_parallel.h>

namespace weft {

namespace {
struct Ctx : LayerCtx {
  Tensor positions;  // (B, T) int32, or undefined: t
};
}  // namespace

Rotary::Rotary(int64_t heads, int64_t groups, float base)
    : heads_(heads), groups_(groups), base_(base) {
  check(heads > 0 && base > 0, "rotary: heads ({}) and base ({}) must be positive", heads, base);
  check(groups > 0 && heads % groups == 0,
        "rotary: query groups ({}) must divide the attention heads ({})", groups, heads);
}

std::vector<Shape> Rotary::output_shapes(std::span<const Shape> in) const {
  const int64_t n = heads_ + 2 * groups_;
  check((in.size() == 1 || in.size() == 2) && in[0].rank == 3 && in[0][2] % n == 0,
        "rotary with {} heads and {} key/value groups takes a packed qkv (B, T, {} x head "
        "size), and optionally positions (B, T), got {}",
        heads_, groups_, n, in.empty() ? "nothing" : in[0].str());
  check(in.size() == 1 || (in[1].rank == 2 && in[1][0] == in[0][0] && in[1][1] == in[0][1]),
        "rotary: positions {} must be (B, T) of qkv {}", in.size() > 1 ? in[1].str() : "",
        in[0].str());
  check((in[0][2] / n) % 2 == 0, "rotary: the head size {} must be even", in[0][2] / n);
  return {in[0]};
}

std::unique_ptr<Layer> Rotary::tensor_parallel(TpBuild& build) const {
  const int tp = build.group->size();
  check(heads_ % tp == 0 && groups_ % tp == 0,
        "rotary heads ({}) and query groups ({}) must be divisible by tensor-parallel size ({})",
        heads_, groups_, tp);
  return std::make_unique<Rotary>(heads_ / tp, groups_ / tp, base_);
}

std::unique_ptr<LayerCtx> Rotary::make_ctx() const { return std::make_unique<Ctx>(); }

// y = [rotate(q), rotate(k), v]
void Rotary::forward(LayerCtx& ctx, Arena&, std::span<const Tensor> in,
                     std::span<const Tensor> out) {
  Tensor& positions = static_cast<Ctx&>(ctx).positions;
  positions = in.size() > 1 ? in[1] : Tensor();
  ops::rope_forward(in[0], out[0], heads_, groups_, base_, positions);
}

// dx += [rotate^-1(dq), rotate^-1(dk), dv]: a rotation's inverse is its transpose.
void Rotary::backward_input(LayerCtx& ctx, Arena&, std::span<const Tensor> grad_out,
                            std::span<const Tensor> grad_in) {
  if (!grad_in[0].defined()) return;
  ops::rope_backward(grad_out[0], grad_in[0], heads_, groups_, base_,
                     static_cast<Ctx&>(ctx).positions);
}

}  // namespace weft
