#include "layers/linear.h"

#include <weft/ops.h>
#include <weft/tensor_parallel.h>

#include <fmt/ranges.h>

#include "layers/tp_linear.h"

namespace weft {

namespace {
struct Ctx : LayerCtx {
  Tensor x;   // (N, in)
  Tensor dy;  // (N, out), kept by I for W
};
}  // namespace

namespace {
std::vector<int64_t> equal_out_blocks(const Param* w, int count) {
  check(w->value.rank() == 2, "{}: a linear weight must be 2-D (in, out), got {}", w->name,
        w->value.shape().str());
  check(count > 0 && w->value.dim(1) % count == 0, "{}: the output width {} must be {} equal blocks",
        w->name, w->value.dim(1), count);
  return equal_blocks(w->value.dim(1), count);
}
}  // namespace

Linear::Linear(Param* weight, Param* bias, ParallelRole role, int out_blocks)
    : Linear(weight, bias, role, equal_out_blocks(weight, out_blocks)) {}

Linear::Linear(Param* weight, Param* bias, ParallelRole role, std::vector<int64_t> out_blocks)
    : w_(weight), b_(bias), role_(role), out_blocks_(std::move(out_blocks)) {
  check(w_->value.rank() == 2, "{}: a linear weight must be 2-D (in, out), got {}", w_->name,
        w_->value.shape().str());
  int64_t sum = 0;
  bool positive = true;
  for (int64_t width : out_blocks_) {
    sum += width;
    positive = positive && width > 0;
  }
  check(!out_blocks_.empty() && positive && sum == w_->value.dim(1),
        "{}: the output width {} must be the total of its blocks' positive widths ({})", w_->name,
        w_->value.dim(1), fmt::join(out_blocks_, " + "));
  check(b_ == nullptr || b_->value.numel() == w_->value.dim(1),
        "{}: bias length {} does not match the output width {}", b_ ? b_->name : "",
        b_ ? b_->value.numel() : 0, w_->value.dim(1));
}

std::vector<Param*> Linear::params() const {
  if (b_) return {w_, b_};
  return {w_};
}

std::vector<Shape> Linear::output_shapes(std::span<const Shape> in) const {
  check(in.size() == 1 && in[0].last() == w_->value.dim(0),
        "{}: input width {} does not match the weight's input dimension {}", w_->name,
        in[0].last(), w_->value.dim(0));
  Shape s = in[0];
  s[s.rank - 1] = w_->value.dim(1);
  return {s};
}

double Linear::flops(std::span<const Shape> in) const {
  return 2.0 * static_cast<double>(in[0].rows()) * static_cast<double>(w_->value.numel());
}

std::unique_ptr<LayerCtx> Linear::make_ctx() const { return std::make_unique<Ctx>(); }

// y (N, out) = x (N, in) W (in, out) + b
void Linear::forward(LayerCtx& ctx_, Arena&, std::span<const Tensor> in,
                     std::span<const Tensor> out) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  const Tensor& w = gemm_operand(*w_, in[0].dtype());
  if (b_)
    ops::gemm_bias(in[0], false, w, false, gemm_operand(*b_, in[0].dtype()), out[0]);
  else
    ops::gemm(in[0], false, w, false, out[0]);
  ctx.x = in[0];
}

// dx (N, in) += dy (N, out) W^T
void Linear::backward_input(LayerCtx& ctx_, Arena&, std::span<const Tensor> grad_out,
                            std::span<const Tensor> grad_in) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  ctx.dy = grad_out[0];
  if (!grad_in[0].defined()) return;
  const bool fresh = ctx.fresh_grads_in & 1u;  // beta 0: C is not read
  ops::gemm(ctx.dy, false, gemm_operand(*w_, ctx.dy.dtype()), true, grad_in[0], 1.0f,
            fresh ? 0.0f : 1.0f);
}

// dW (in, out) += x^T dy; db (out) += sum over rows of dy
void Linear::backward_weight(LayerCtx& ctx_, Arena&) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  if (b_)
    ops::gemm_bias_grad(ctx.x, true, ctx.dy, w_->grad, 1.0f, b_->grad);
  else
    ops::gemm(ctx.x, true, ctx.dy, false, w_->grad, 1.0f, 1.0f);
  ctx.dy = Tensor();  // W is done with it (weft/layer.h)
}

// Column: W (in, out) and b (out) split by columns, in each of the out_blocks.
// Row: W split by rows; b whole, added once after the reduction.
// None: a replicated copy.
std::unique_ptr<Layer> Linear::tensor_parallel(TpBuild& build) const {
  switch (role_) {
    case ParallelRole::Column:
      return std::make_unique<ColumnParallelLinear>(*build.group, build.param(*w_, 1, out_blocks_),
                                                    b_ ? build.param(*b_, 0, out_blocks_) : nullptr,
                                                    sequence_parallel(build));
    case ParallelRole::Row:
      return std::make_unique<RowParallelLinear>(*build.group, build.param(*w_, 0),
                                                 b_ ? build.param(*b_, -1) : nullptr,
                                                 sequence_parallel(build));
    case ParallelRole::None: break;
  }
  return std::make_unique<Linear>(build.param(*w_, -1), b_ ? build.param(*b_, -1) : nullptr,
                                  role_, out_blocks_);
}

}  // namespace weft
