#include "layers/tp_linear.h"

#include <weft/ops.h>

#include "layers/tp_regions.h"

namespace weft {

// --- ColumnParallelLinear ---

namespace {
// The sequence-parallel forms' own: what they keep between actions, this
// rank's tokens only (the whole tensors are gathered when needed).
struct SpCtx : LayerCtx {
  Tensor x;   // the input: this rank's tokens (column), or whole (row)
  Tensor dy;  // the output's gradient: whole (column), or this rank's tokens (row)
};

// y = x W (+ b), with the weight (and bias) as the GEMM reads them for x's dtype.
void linear_forward(const Tensor& x, const Param& w, const Param* b, const Tensor& y) {
  if (b)
    ops::gemm_bias(x, false, gemm_operand(w, x.dtype()), false, gemm_operand(*b, x.dtype()), y);
  else
    ops::gemm(x, false, gemm_operand(w, x.dtype()), false, y);
}
}  // namespace

ColumnParallelLinear::ColumnParallelLinear(Communicator& group, Param* weight, Param* bias,
                                           std::optional<SequenceParallel> sp)
    : group_(&group), local_(weight, bias), w_(weight), b_(bias), sp_(std::move(sp)) {}

std::vector<Shape> ColumnParallelLinear::output_shapes(std::span<const Shape> in) const {
  if (!sp_ || in.size() != 1) return local_.output_shapes(in);
  const Shape whole = sp_->whole_shape(in[0]);
  return local_.output_shapes({&whole, 1});
}

double ColumnParallelLinear::flops(std::span<const Shape> in) const {
  if (!sp_) return local_.flops(in);
  const Shape whole = sp_->whole_shape(in[0]);
  return local_.flops({&whole, 1});
}

std::unique_ptr<LayerCtx> ColumnParallelLinear::make_ctx() const {
  if (sp_) return std::make_unique<SpCtx>();
  return local_.make_ctx();
}

// x (N, in), the same on every rank -> y (N, out/tp) = x W_r + b_r. Under
// sequence parallelism x is gathered from the group's tokens first.
void ColumnParallelLinear::forward(LayerCtx& ctx, Arena& arena, std::span<const Tensor> in,
                                   std::span<const Tensor> out) {
  if (sp_) {
    linear_forward(sp_->gather(in[0], SequenceScratch::kWholeA), *w_, b_, out[0]);
    static_cast<SpCtx&>(ctx).x = in[0];
    return;
  }
  copy_to_tp_forward(*group_, in[0]);
  local_.forward(ctx, arena, in, out);
}

// dx (N, in) += sum over ranks r of dy_r (N, out/tp) W_r^T (this rank's
// tokens of it under sequence parallelism)
void ColumnParallelLinear::backward_input(LayerCtx& ctx, Arena& arena,
                                          std::span<const Tensor> grad_out,
                                          std::span<const Tensor> grad_in) {
  if (sp_) {
    auto& c = static_cast<SpCtx&>(ctx);
    c.dy = grad_out[0];
    if (!grad_in[0].defined()) return;
    const Tensor part = sp_->whole(grad_in[0], SequenceScratch::kWholeA);
    ops::gemm(c.dy, false, gemm_operand(*w_, c.dy.dtype()), true, part, 1.0f, 0.0f);
    sp_->gather_backward(part, grad_in[0], c.fresh_grads_in & 1u);
    return;
  }
  if (!grad_in[0].defined()) {  // still keeps dy for W
    local_.backward_input(ctx, arena, grad_out, grad_in);
    return;
  }
  const Tensor part = copy_to_tp_grad_buffer(*group_, arena, grad_in[0]);
  local_.backward_input(ctx, arena, grad_out, {&part, 1});
  copy_to_tp_backward(*group_, part, grad_in[0]);
}

// dW_r (in, out/tp) += x^T dy_r; db_r += sum over rows of dy_r (x gathered
// again under sequence parallelism)
void ColumnParallelLinear::backward_weight(LayerCtx& ctx, Arena& arena) {
  if (!sp_) {
    local_.backward_weight(ctx, arena);
    return;
  }
  auto& c = static_cast<SpCtx&>(ctx);
  const Tensor x = sp_->gather(c.x, SequenceScratch::kWholeA);
  if (b_)
    ops::gemm_bias_grad(x, true, c.dy, w_->grad, 1.0f, b_->grad);
  else
    ops::gemm(x, true, c.dy, false, w_->grad, 1.0f, 1.0f);
  c.dy = Tensor();  // W is done with it (weft/layer.h)
}

// --- RowParallelLinear ---

namespace {
struct RowCtx : LayerCtx {
  std::unique_ptr<LayerCtx> local;  // the local matmul's
  Tensor dy;                        // (N, out), kept by I for the bias's W
};
}  // namespace

RowParallelLinear::RowParallelLinear(Communicator& group, Param* weight, Param* bias,
                                     std::optional<SequenceParallel> sp)
    : group_(&group), local_(weight, nullptr), w_(weight), b_(bias), sp_(std::move(sp)) {
  check(b_ == nullptr || b_->value.numel() == weight->value.dim(1),
        "{}: bias length {} does not match the output width {}", b_ ? b_->name : "",
        b_ ? b_->value.numel() : 0, weight->value.dim(1));
}

std::vector<Param*> RowParallelLinear::params() const {
  std::vector<Param*> p = local_.params();
  if (b_) p.push_back(b_);
  return p;
}

std::vector<Shape> RowParallelLinear::output_shapes(std::span<const Shape> in) const {
  std::vector<Shape> out = local_.output_shapes(in);
  if (sp_) out[0] = sp_->slice_shape(out[0]);
  return out;
}

std::unique_ptr<LayerCtx> RowParallelLinear::make_ctx() const {
  if (sp_) return std::make_unique<SpCtx>();
  auto ctx = std::make_unique<RowCtx>();
  ctx->local = local_.make_ctx();
  return ctx;
}

// x_r (N, in/tp) -> y (N, out) = sum over ranks r of x_r W_r, + b; under
// sequence parallelism y is this rank's tokens of it (a reduce-scatter).
void RowParallelLinear::forward(LayerCtx& ctx_, Arena& arena, std::span<const Tensor> in,
                                std::span<const Tensor> out) {
  if (sp_) {
    const Tensor partial = sp_->whole(out[0], SequenceScratch::kWholeA);
    ops::gemm(in[0], false, gemm_operand(*w_, in[0].dtype()), false, partial);
    sp_->scatter(partial, out[0]);
    if (b_) ops::add_rows(out[0], b_->value);
    static_cast<SpCtx&>(ctx_).x = in[0];
    return;
  }
  auto& ctx = static_cast<RowCtx&>(ctx_);
  local_.forward(*ctx.local, arena, in, out);
  reduce_from_tp_forward(*group_, out[0]);
  if (b_) ops::add_rows(out[0], b_->value);
}

// dx_r (N, in/tp) += dy (N, out) W_r^T; dy is the same on every rank
void RowParallelLinear::backward_input(LayerCtx& ctx_, Arena& arena,
                                       std::span<const Tensor> grad_out,
                                       std::span<const Tensor> grad_in) {
  if (sp_) {  // dy gathered from the group's tokens
    auto& c = static_cast<SpCtx&>(ctx_);
    c.dy = grad_out[0];
    if (!grad_in[0].defined()) return;
    const Tensor dy = sp_->gather(c.dy, SequenceScratch::kWholeA);
    ops::gemm(dy, false, gemm_operand(*w_, dy.dtype()), true, grad_in[0], 1.0f, 1.0f);
    return;
  }
  auto& ctx = static_cast<RowCtx&>(ctx_);
  reduce_from_tp_backward(*group_, grad_out[0]);
  ctx.dy = grad_out[0];
  local_.backward_input(*ctx.local, arena, grad_out, grad_in);
}

// dW_r (in/tp, out) += x_r^T dy; db (out) += sum over rows of dy, the same on every rank
void RowParallelLinear::backward_weight(LayerCtx& ctx_, Arena& arena) {
  if (sp_) {  // dy gathered again
    auto& c = static_cast<SpCtx&>(ctx_);
    const Tensor dy = sp_->gather(c.dy, SequenceScratch::kWholeA);
    ops::gemm(c.x, true, dy, false, w_->grad, 1.0f, 1.0f);
    if (b_) ops::sum_rows(dy, b_->grad);
    c.dy = Tensor();
    return;
  }
  auto& ctx = static_cast<RowCtx&>(ctx_);
  local_.backward_weight(*ctx.local, arena);
  if (b_) ops::sum_rows(ctx.dy, b_->grad);
  ctx.dy = Tensor();  // W is done with it (weft/layer.h)
}

}  // namespace weft
