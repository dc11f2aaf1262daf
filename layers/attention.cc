#include "layers/attention.h"

#include <weft/ops.h>
#include <weft/tensor_parallel.h>

namespace weft {

namespace {
struct Ctx : LayerCtx {
  Tensor qkv;    // (B, T, (H + 2G) D)
  Tensor probs;  // (B, H, T, T), unfused
  // Fused (cuDNN): the row log-sum-exp (B, H, T) instead of probs, and the
  // output, which the runner keeps until the micro-batch's backward is done.
  bool fused = false;
  Tensor lse, out;
};
}  // namespace

CausalSelfAttention::CausalSelfAttention(int64_t heads, int64_t groups)
    : heads_(heads), groups_(groups) {
  check(heads > 0, "attention heads ({}) must be positive", heads);
  check(groups > 0 && heads % groups == 0,
        "attention query groups ({}) must divide the attention heads ({})", groups, heads);
}

std::vector<Shape> CausalSelfAttention::output_shapes(std::span<const Shape> in) const {
  const int64_t n = heads_ + 2 * groups_;
  check((in.size() == 1 || in.size() == 2) && in[0].rank == 3 && in[0][2] % n == 0,
        "attention with {} heads and {} key/value groups takes qkv (B, T, {} x head size), and "
        "optionally positions (B, T), got {}",
        heads_, groups_, n, in.empty() ? "nothing" : in[0].str());
  check(in.size() == 1 || (in[1].rank == 2 && in[1][0] == in[0][0] && in[1][1] == in[0][1]),
        "attention: positions {} must be (B, T) of qkv {}", in.size() > 1 ? in[1].str() : "",
        in[0].str());
  return {Shape{in[0][0], in[0][1], in[0][2] / n * heads_}};
}

double CausalSelfAttention::flops(std::span<const Shape> in) const {
  // q k^T and p v per query head, full T x T (the causal half is computed and masked).
  const double b = static_cast<double>(in[0][0]), t = static_cast<double>(in[0][1]);
  const double c = static_cast<double>(in[0][2] / (heads_ + 2 * groups_) * heads_);
  return 4.0 * b * t * t * c;
}

std::unique_ptr<Layer> CausalSelfAttention::tensor_parallel(TpBuild& build) const {
  const int tp = build.group->size();
  check(heads_ % tp == 0, "attention heads ({}) must be divisible by tensor-parallel size ({})",
        heads_, tp);
  check(groups_ % tp == 0,
        "attention query groups ({}) must be divisible by tensor-parallel size ({})", groups_, tp);
  return std::make_unique<CausalSelfAttention>(heads_ / tp, groups_ / tp);
}

std::unique_ptr<LayerCtx> CausalSelfAttention::make_ctx() const {
  return std::make_unique<Ctx>();
}

void CausalSelfAttention::forward(LayerCtx& ctx_, Arena& arena, std::span<const Tensor> in,
                                  std::span<const Tensor> out) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  const int64_t b = in[0].dim(0), t = in[0].dim(1);
  ctx.qkv = in[0];
  // The method is the device's (ops::set_attention_backend), chosen again at
  // every forward and kept for this micro-batch's backward.
  // Documents (positions given) run unfused: cuDNN's fused attention here
  // has no mask but the causal one.
  const bool documents = in.size() > 1;
  ctx.fused = !documents &&
              ops::attention_uses_fused(in[0].device(), in[0].dim(2) / (heads_ + 2 * groups_));
  check(!documents || ops::attention_backend(in[0].device()) != ops::AttentionBackend::Fused,
        "attention within documents (--reset-attention-mask) runs unfused; "
        "--attention-backend fused cannot run it (use auto or unfused)");
  if (ctx.fused) {
    ctx.lse = arena.alloc({b, heads_, t});
    ctx.out = out[0];
    ctx.probs = Tensor();
    ops::attention_forward_fused(in[0], out[0], ctx.lse, heads_, groups_);
    return;
  }
  ctx.lse = ctx.out = Tensor();
  ctx.probs = arena.alloc({b, heads_, t, t});
  ops::attention_forward(in[0], out[0], ctx.probs, heads_, groups_, documents ? in[1] : Tensor());
}

void CausalSelfAttention::backward_input(LayerCtx& ctx_, Arena& arena,
                                         std::span<const Tensor> grad_out,
                                         std::span<const Tensor> grad_in) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  if (!grad_in[0].defined()) return;
  const bool fresh = ctx.fresh_grads_in & 1u;  // then write dqkv, not add to it
  if (ctx.fused) {
    ops::attention_backward_fused(grad_out[0], ctx.qkv, ctx.out, ctx.lse, grad_in[0], heads_,
                                  groups_, !fresh);
    return;
  }
  if (fresh) grad_in[0].zero_();  // the unfused backward only adds
  const int64_t b = ctx.qkv.dim(0), t = ctx.qkv.dim(1);
  Tensor scratch = arena.alloc({b, heads_, t, t});
  ops::attention_backward(grad_out[0], ctx.qkv, ctx.probs, grad_in[0], scratch, heads_, groups_);
}

}  // namespace weft
