#include "layers/tp_linear.h"

#include <weft/ops.h>

#include "layers/tp_regions.h"

namespace weft {

// --- ColumnParallelLinear ---

ColumnParallelLinear::ColumnParallelLinear(Communicator& group, Param* weight, Param* bias)
    : group_(&group), local_(weight, bias) {}

// x (N, in), the same on every rank -> y (N, out/tp) = x W_r + b_r
void ColumnParallelLinear::forward(LayerCtx& ctx, Arena& arena, std::span<const Tensor> in,
                                   std::span<const Tensor> out) {
  copy_to_tp_forward(*group_, in[0]);
  local_.forward(ctx, arena, in, out);
}

// dx (N, in) += sum over ranks r of dy_r (N, out/tp) W_r^T
void ColumnParallelLinear::backward_input(LayerCtx& ctx, Arena& arena,
                                          std::span<const Tensor> grad_out,
                                          std::span<const Tensor> grad_in) {
  if (!grad_in[0].defined()) {  // still keeps dy for W
    local_.backward_input(ctx, arena, grad_out, grad_in);
    return;
  }
  const Tensor part = copy_to_tp_grad_buffer(*group_, arena, grad_in[0]);
  local_.backward_input(ctx, arena, grad_out, {&part, 1});
  copy_to_tp_backward(*group_, part, grad_in[0]);
}

// dW_r (in, out/tp) += x^T dy_r; db_r += sum over rows of dy_r
void ColumnParallelLinear::backward_weight(LayerCtx& ctx, Arena& arena) {
  local_.backward_weight(ctx, arena);
}

// --- RowParallelLinear ---

namespace {
struct RowCtx : LayerCtx {
  std::unique_ptr<LayerCtx> local;  // the local matmul's
  Tensor dy;                        // (N, out), kept by I for the bias's W
};
}  // namespace

RowParallelLinear::RowParallelLinear(Communicator& group, Param* weight, Param* bias)
    : group_(&group), local_(weight, nullptr), b_(bias) {
  check(b_ == nullptr || b_->value.numel() == weight->value.dim(1),
        "{}: bias length {} does not match the output width {}", b_ ? b_->name : "",
        b_ ? b_->value.numel() : 0, weight->value.dim(1));
}

std::vector<Param*> RowParallelLinear::params() const {
  std::vector<Param*> p = local_.params();
  if (b_) p.push_back(b_);
  return p;
}

std::unique_ptr<LayerCtx> RowParallelLinear::make_ctx() const {
  auto ctx = std::make_unique<RowCtx>();
  ctx->local = local_.make_ctx();
  return ctx;
}

// x_r (N, in/tp) -> y (N, out) = sum over ranks r of x_r W_r, + b
void RowParallelLinear::forward(LayerCtx& ctx_, Arena& arena, std::span<const Tensor> in,
                                std::span<const Tensor> out) {
  auto& ctx = static_cast<RowCtx&>(ctx_);
  local_.forward(*ctx.local, arena, in, out);
  reduce_from_tp_forward(*group_, out[0]);
  if (b_) ops::add_rows(out[0], b_->value);
}

// dx_r (N, in/tp) += dy (N, out) W_r^T; dy is the same on every rank
void RowParallelLinear::backward_input(LayerCtx& ctx_, Arena& arena,
                                       std::span<const Tensor> grad_out,
                                       std::span<const Tensor> grad_in) {
  auto& ctx = static_cast<RowCtx&>(ctx_);
  reduce_from_tp_backward(*group_, grad_out[0]);
  ctx.dy = grad_out[0];
  local_.backward_input(*ctx.local, arena, grad_out, grad_in);
}

// dW_r (in/tp, out) += x_r^T dy; db (out) += sum over rows of dy, the same on every rank
void RowParallelLinear::backward_weight(LayerCtx& ctx_, Arena& arena) {
  auto& ctx = static_cast<RowCtx&>(ctx_);
  local_.backward_weight(*ctx.local, arena);
  if (b_) ops::sum_rows(ctx.dy, b_->grad);
  ctx.dy = Tensor();  // W is done with it (weft/layer.h)
}

}  // namespace weft
