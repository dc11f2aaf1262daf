#include "layers/gelu_mlp.h"

#include <weft/ops.h>
#include <weft/tensor_parallel.h>

#include "layers/tp_regions.h"

namespace weft {

namespace {
struct Ctx : LayerCtx {
  Tensor x;     // (N, C)
  Tensor pre;   // (N, H): x W_fc + b_fc
  Tensor h;     // (N, H): gelu(pre)
  Tensor dy;    // (N, C), kept by I for W
  Tensor dpre;  // (N, H), kept by I for W
};

// A gradient buffer the layer makes itself, as the runner makes them: from
// the arena on the CPU, from the caching allocator on a GPU (freed by W).
Tensor new_grad(Arena& arena, Shape shape, DType dtype, Device device) {
  if (device.is_cpu()) return arena.alloc(shape, dtype);
  return Tensor::empty(shape, dtype, device);
}
}  // namespace

GeluMlp::GeluMlp(Param* w_fc, Param* b_fc, Param* w_proj, Param* b_proj, Communicator* group,
                 std::optional<SequenceParallel> sp)
    : w_fc_(w_fc),
      b_fc_(b_fc),
      w_proj_(w_proj),
      b_proj_(b_proj),
      group_(group),
      sp_(std::move(sp)) {
  check(w_fc_ && b_fc_ && w_proj_ && b_proj_, "a GELU MLP takes two weights and two biases");
  check(w_fc_->value.rank() == 2 && w_proj_->value.rank() == 2,
        "{}, {}: the MLP's weights must be 2-D (in, out), got {} and {}", w_fc_->name,
        w_proj_->name, w_fc_->value.shape().str(), w_proj_->value.shape().str());
  check(w_proj_->value.dim(0) == w_fc_->value.dim(1),
        "{} {} and {} {}: the first weight's output width must be the second's input width",
        w_fc_->name, w_fc_->value.shape().str(), w_proj_->name, w_proj_->value.shape().str());
  check(b_fc_->value.numel() == w_fc_->value.dim(1),
        "{}: bias length {} does not match the output width {}", b_fc_->name,
        b_fc_->value.numel(), w_fc_->value.dim(1));
  check(b_proj_->value.numel() == w_proj_->value.dim(1),
        "{}: bias length {} does not match the output width {}", b_proj_->name,
        b_proj_->value.numel(), w_proj_->value.dim(1));
}

std::vector<Param*> GeluMlp::params() const { return {w_fc_, b_fc_, w_proj_, b_proj_}; }

std::vector<Shape> GeluMlp::output_shapes(std::span<const Shape> in) const {
  check(in.size() == 1 && in[0].last() == w_fc_->value.dim(0),
        "{}: input width {} does not match the weight's input dimension {}", w_fc_->name,
        in.empty() ? 0 : in[0].last(), w_fc_->value.dim(0));
  Shape s = in[0];
  s[s.rank - 1] = w_proj_->value.dim(1);
  return {s};
}

double GeluMlp::whole_rows(const Shape& in) const {
  return static_cast<double>(sp_ ? sp_->whole_shape(in).rows() : in.rows());
}

// The two GEMMs, and GELU's 10 per element as layers/gelu.h counts them.
double GeluMlp::flops(std::span<const Shape> in) const {
  const double rows = whole_rows(in[0]);
  return 2.0 * rows * static_cast<double>(w_fc_->value.numel() + w_proj_->value.numel()) +
         10.0 * rows * static_cast<double>(hidden());
}

double GeluMlp::stashed_elements(std::span<const Shape> in) const {
  return 2.0 * whole_rows(in[0]) * static_cast<double>(hidden());
}

std::unique_ptr<LayerCtx> GeluMlp::make_ctx() const { return std::make_unique<Ctx>(); }

std::unique_ptr<Layer> GeluMlp::tensor_parallel(TpBuild& build) const {
  return std::make_unique<GeluMlp>(build.param(*w_fc_, 1), build.param(*b_fc_, 0),
                                   build.param(*w_proj_, 0), build.param(*b_proj_, -1), build.group,
                                   sequence_parallel(build));
}

// pre, h = gemm_bias_gelu(x, W_fc, b_fc); y = h W_proj (+ the group's sum) + b_proj
void GeluMlp::forward(LayerCtx& ctx_, Arena& arena, std::span<const Tensor> in,
                      std::span<const Tensor> out) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  const Tensor x = sp_ ? sp_->gather(in[0], SequenceScratch::kWholeA) : in[0];
  const DType dt = x.dtype();
  if (group_ && !sp_) copy_to_tp_forward(*group_, x);
  const Shape hs{x.shape().rows(), hidden()};
  ctx.x = in[0];  // this rank's tokens under sequence parallelism: W gathers them again
  ctx.pre = arena.alloc(hs, dt);
  ctx.h = arena.alloc(hs, dt);
  ops::gemm_bias_gelu(x, false, gemm_operand(*w_fc_, dt), false, gemm_operand(*b_fc_, dt),
                      ctx.pre, ctx.h);
  const Tensor& w = gemm_operand(*w_proj_, dt);
  if (!group_) {
    ops::gemm_bias(ctx.h, false, w, false, gemm_operand(*b_proj_, dt), out[0]);
    return;
  }
  if (sp_) {
    const Tensor partial = sp_->whole(out[0], SequenceScratch::kWholeB);
    ops::gemm(ctx.h, false, w, false, partial);
    sp_->scatter(partial, out[0]);
  } else {
    ops::gemm(ctx.h, false, w, false, out[0]);
    reduce_from_tp_forward(*group_, out[0]);
  }
  ops::add_rows(out[0], b_proj_->value);
}

// dpre = (dy W_proj^T) gelu'(pre), in one GEMM; dx += dpre W_fc^T (summed
// across the group when tensor-parallel)
void GeluMlp::backward_input(LayerCtx& ctx_, Arena& arena, std::span<const Tensor> grad_out,
                             std::span<const Tensor> grad_in) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  ctx.dy = grad_out[0];  // this rank's tokens under sequence parallelism
  const Tensor dy = sp_ ? sp_->gather(ctx.dy, SequenceScratch::kWholeA) : ctx.dy;
  if (group_ && !sp_) reduce_from_tp_backward(*group_, dy);
  ctx.dpre = new_grad(arena, ctx.pre.shape(), ctx.pre.dtype(), ctx.pre.device());
  ops::gemm_dgelu(dy, false, gemm_operand(*w_proj_, dy.dtype()), true, ctx.pre, ctx.dpre);
  if (!grad_in[0].defined()) return;
  const Tensor& w = gemm_operand(*w_fc_, ctx.dpre.dtype());
  if (!group_) {
    const bool fresh = ctx.fresh_grads_in & 1u;  // beta 0: dx is not read
    ops::gemm(ctx.dpre, false, w, true, grad_in[0], 1.0f, fresh ? 0.0f : 1.0f);
    return;
  }
  if (sp_) {
    const Tensor part = sp_->whole(grad_in[0], SequenceScratch::kWholeB);
    ops::gemm(ctx.dpre, false, w, true, part, 1.0f, 0.0f);
    sp_->gather_backward(part, grad_in[0], ctx.fresh_grads_in & 1u);
    return;
  }
  const Tensor part = copy_to_tp_grad_buffer(*group_, arena, grad_in[0]);
  ops::gemm(ctx.dpre, false, w, true, part, 1.0f, 1.0f);
  copy_to_tp_backward(*group_, part, grad_in[0]);
}

// dW_proj += h^T dy, db_proj += sum of dy's rows (whole under tensor
// parallelism: dy is the same on every rank); then dW_fc += x^T dpre,
// db_fc += sum of dpre's rows (the order of the Linear nodes' W actions)
void GeluMlp::backward_weight(LayerCtx& ctx_, Arena&) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  const Tensor dy = sp_ ? sp_->gather(ctx.dy, SequenceScratch::kWholeA) : ctx.dy;
  ops::gemm_bias_grad(ctx.h, true, dy, w_proj_->grad, 1.0f, b_proj_->grad);
  const Tensor x = sp_ ? sp_->gather(ctx.x, SequenceScratch::kWholeB) : ctx.x;
  ops::gemm_bias_grad(x, true, ctx.dpre, w_fc_->grad, 1.0f, b_fc_->grad);
  ctx.dy = ctx.dpre = Tensor();  // W is done with them (weft/layer.h)
}

}  // namespace weft
