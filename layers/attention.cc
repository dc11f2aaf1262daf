#include "layers/attention.h"

#include <weft/ops.h>
#include <weft/tensor_parallel.h>

namespace weft {

namespace {
struct Ctx : LayerCtx {
  Tensor qkv;    // (B, T, 3C)
  Tensor probs;  // (B, H, T, T)
};
}  // namespace

CausalSelfAttention::CausalSelfAttention(int64_t heads) : heads_(heads) {
  check(heads > 0, "attention heads ({}) must be positive", heads);
}

std::vector<Shape> CausalSelfAttention::output_shapes(std::span<const Shape> in) const {
  check(in.size() == 1 && in[0].rank == 3 && in[0][2] % 3 == 0,
        "attention takes qkv (B, T, 3C), got {}", in.empty() ? "nothing" : in[0].str());
  const int64_t c = in[0][2] / 3;
  check(c % heads_ == 0, "attention heads ({}) must divide the hidden size ({})", heads_, c);
  return {Shape{in[0][0], in[0][1], c}};
}

double CausalSelfAttention::flops(std::span<const Shape> in) const {
  // q k^T and p v, full T x T (the causal half is computed and masked).
  const double b = static_cast<double>(in[0][0]), t = static_cast<double>(in[0][1]);
  const double c = static_cast<double>(in[0][2]) / 3.0;
  return 4.0 * b * t * t * c;
}

std::unique_ptr<Layer> CausalSelfAttention::tensor_parallel(TpBuild& build) const {
  const int tp = build.group->size();
  check(heads_ % tp == 0, "attention heads ({}) must be divisible by tensor-parallel size ({})",
        heads_, tp);
  return std::make_unique<CausalSelfAttention>(heads_ / tp);
}

std::unique_ptr<LayerCtx> CausalSelfAttention::make_ctx() const {
  return std::make_unique<Ctx>();
}

void CausalSelfAttention::forward(LayerCtx& ctx_, Arena& arena, std::span<const Tensor> in,
                                  std::span<const Tensor> out) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  const int64_t b = in[0].dim(0), t = in[0].dim(1);
  ctx.qkv = in[0];
  ctx.probs = arena.alloc({b, heads_, t, t});
  ops::attention_forward(in[0], out[0], ctx.probs, heads_);
}

void CausalSelfAttention::backward_input(LayerCtx& ctx_, Arena& arena,
                                         std::span<const Tensor> grad_out,
                                         std::span<const Tensor> grad_in) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  if (!grad_in[0].defined()) return;
  const int64_t b = ctx.qkv.dim(0), t = ctx.qkv.dim(1);
  Tensor scratch = arena.alloc({b, heads_, t, t});
  ops::attention_backward(grad_out[0], ctx.qkv, ctx.probs, grad_in[0], scratch, heads_);
}

}  // namespace weft
