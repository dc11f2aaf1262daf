#include "layers/lm_head.h"

#include <weft/ops.h>
#include <weft/tensor_parallel.h>

#include "layers/tp_regions.h"

#include <algorithm>

namespace weft {

namespace {
struct Ctx : LayerCtx {
  Tensor x;        // (N, C)
  Tensor targets;  // (N)
  Tensor probs;    // (N, V or V/tp); turned into dlogits in place by backward_input, or
                   // by the forward (unit_dlogits); bf16 with bf16 activations (the
                   // logits, then the dlogits in their place)
  Tensor logits;   // (N, V or V/tp), only with keep_logits
  // On a GPU without vocabulary parallelism the forward leaves probs as
  // dlogits for a loss gradient of 1 (the fused classifier), and the
  // backward's GEMMs scale by g, the loss gradient, in their alpha.
  bool unit_dlogits = false;
  float g = 1.0f;
  // Chunked (see lm_head.h): dx and dwte for a loss gradient of 1.
  bool chunked = false;
  Tensor dx_unit, dw_unit;  // (N, C), (V or V/tp, C); fp32
};
}  // namespace

TiedLmHeadLoss::TiedLmHeadLoss(Param* wte, Communicator* group, std::optional<SequenceParallel> sp)
    : group_(group), wte_(wte), sp_(std::move(sp)) {
  check(wte->value.rank() == 2, "{}: the lm head's table must be 2-D (V, C), got {}", wte->name,
        wte->value.shape().str());
  check(wte->shard.dim == 0 || !wte->shard.split(),
        "{}: a vocabulary-parallel table is split by rows, not along dimension {}", wte->name,
        wte->shard.dim);
  vocab_ = real_rows(*wte);
  first_ = wte->shard.split() ? wte->shard.index * wte->value.dim(0) : 0;
}

std::vector<Shape> TiedLmHeadLoss::output_shapes(std::span<const Shape> in) const {
  check(in.size() == 2, "lm head takes (x, targets), got {} inputs", in.size());
  check(in[0].last() == wte_->value.dim(1),
        "lm head: input width {} does not match the embedding width {}", in[0].last(),
        wte_->value.dim(1));
  const int64_t rows = sp_ ? sp_->whole_shape(in[0]).rows() : in[0].rows();
  check(in[1].numel() == rows, "lm head: {} targets for {} positions", in[1].numel(), rows);
  return {Shape{1}};
}

double TiedLmHeadLoss::flops(std::span<const Shape> in) const {
  const int64_t rows = sp_ ? sp_->whole_shape(in[0]).rows() : in[0].rows();
  return 2.0 * static_cast<double>(rows) * static_cast<double>(wte_->value.numel());
}

std::unique_ptr<Layer> TiedLmHeadLoss::tensor_parallel(TpBuild& build) const {
  const int tp = build.group->size();
  check(wte_->value.dim(0) % tp == 0,
        "vocabulary ({}) must be divisible by tensor-parallel size ({}): pad it with "
        "--make-vocab-size-divisible-by",
        wte_->value.dim(0), tp);
  auto head = std::make_unique<TiedLmHeadLoss>(build.param(*wte_, 0), build.group,
                                               sequence_parallel(build));
  head->set_keep_logits(keep_logits_);
  return head;
}

int64_t TiedLmHeadLoss::chunk_rows(int64_t n, int64_t v, const Device& d, int64_t elem_bytes) {
  check(elem_bytes > 0, "lm head: a logit of {} bytes", elem_bytes);
  const int64_t most =
      std::max<int64_t>(1, chunk_bytes(d) / (elem_bytes * std::max<int64_t>(1, v)));
  if (n <= most) return std::max<int64_t>(1, n);
  const int64_t chunks = (n + most - 1) / most;
  return (n + chunks - 1) / chunks;  // even chunks: the last is not a sliver
}

std::unique_ptr<LayerCtx> TiedLmHeadLoss::make_ctx() const { return std::make_unique<Ctx>(); }

const Tensor& TiedLmHeadLoss::logits(LayerCtx& ctx) { return static_cast<Ctx&>(ctx).logits; }

// logits_r (N, V/tp) = x (N, C) wte_r^T; loss = sum over tokens of log S - z_t
void TiedLmHeadLoss::forward(LayerCtx& ctx_, Arena& arena, std::span<const Tensor> in,
                             std::span<const Tensor> out) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  // Under sequence parallelism: the group's tokens, whole for this call.
  const Tensor x = sp_ ? sp_->gather(in[0], SequenceScratch::kWholeA) : in[0];
  const int64_t n = x.shape().rows(), v = wte_->value.dim(0);
  ops::check_token_range(in[1], vocab_, "target token", /*targets=*/true);
  if (group_ && !sp_) copy_to_tp_forward(*group_, x);
  ctx.x = in[0];
  ctx.targets = in[1];
  ctx.unit_dlogits = ctx.chunked = false;
  // bf16 logits (see lm_head.h); the chunked head has neither a group nor kept logits.
  // A chunk's budget counts 2 bytes a logit on a GPU, 4 on the CPU, which
  // widens a chunk's bf16 logits to fp32 for the mask and the classifier.
  const bool narrow = x.dtype() == DType::BF16 && !keep_logits_ && !split();
  const Device& dev = x.device();
  const int64_t rows =
      chunk_rows_ > 0 ? chunk_rows_ : chunk_rows(n, v, dev, narrow && !dev.is_cpu() ? 2 : 4);
  if (group_ == nullptr && !keep_logits_ && n > rows) {
    forward_chunked(ctx, arena, in, out, rows);
    return;
  }
  // Padding rows of wte (tokens vocab_.. of a padded table): their logits are
  // -inf, so their probabilities, dlogits and gradients are exactly zero.
  const int64_t real = std::clamp<int64_t>(vocab_ - first_, 0, v);
  if (narrow) {  // bf16 logits, then bf16 dlogits in their place, on every device
    ctx.probs = arena.alloc({n, v}, DType::BF16);
    ops::gemm(x, false, gemm_operand(*wte_, DType::BF16), true, ctx.probs);
    if (real < v) ops::mask_columns(ctx.probs, real);
    const Tensor losses = arena.alloc({n});
    ops::fused_cross_entropy_rows(ctx.probs, in[1], losses, 1.0f, ctx.probs);
    ctx.unit_dlogits = true;
    ops::sum(losses, out[0]);  // on the device: nothing waits for a GPU here
    return;
  }
  ctx.probs = arena.alloc({n, v});
  ops::gemm(x, false, gemm_operand(*wte_, x.dtype()), true, ctx.probs);
  if (real < v) ops::mask_columns(ctx.probs, real);
  if (keep_logits_) {
    ctx.logits = arena.alloc({n, v});
    ctx.logits.copy_from(ctx.probs);
  }
  if (!split()) {  // the whole vocabulary here: softmax and loss in one pass
    Tensor losses = arena.alloc({n});
    if (!ctx.probs.device().is_cpu()) {
      // One kernel from logits to the losses and dlogits (p - onehot): no
      // elementwise pass over (N, V) is left for the backward. The loss is
      // summed on the GPU: nothing waits for it here.
      ctx.unit_dlogits = true;
      if (x.dtype() == DType::BF16) {
        // bf16 activations with the logits kept (fp32): the dlogits in bf16
        // (one rounding, which the backward GEMMs would make anyway), so
        // that those GEMMs read bf16 operands with the table's bf16 copy.
        const Tensor dlogits = arena.alloc({n, v}, DType::BF16);
        ops::fused_cross_entropy_rows(ctx.probs, in[1], losses, 1.0f, dlogits);
        ctx.probs = dlogits;
      } else {
        ops::fused_cross_entropy_rows(ctx.probs, in[1], losses, 1.0f);
      }
      ops::sum(losses, out[0]);
      return;
    }
    ops::set_item(out[0], static_cast<float>(ops::softmax_cross_entropy(ctx.probs, in[1], losses)));
    return;
  }
  // m (N): the row max over the whole vocabulary.
  Tensor max = arena.alloc({n});
  ops::row_max(ctx.probs, max);
  group_->all_reduce(max, ReduceOp::Max);
  // stats (2, N): S's local terms, then z_t where this rank holds the target (0 elsewhere).
  Tensor stats = arena.alloc({2, n});
  ops::exp_and_stats(ctx.probs, in[1], first_, max, stats);
  group_->all_reduce(stats, ReduceOp::Sum);
  // probs_r = exp(logit - m) / S; every rank sums the same losses in the
  // same order, on the device (nothing waits for it here).
  ops::normalise_and_loss(ctx.probs, stats, in[1], out[0]);
}

// Rows [r0, r0 + rows) at a time: logits (rows, V) = x_c wte^T, their losses
// and unit dlogits in place, then dx_unit_c = dlogits_c wte and
// dw_unit += dlogits_c^T x_c.
void TiedLmHeadLoss::forward_chunked(LayerCtx& ctx_, Arena& arena, std::span<const Tensor> in,
                                     std::span<const Tensor> out, int64_t rows) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  const int64_t n = in[0].shape().rows(), c = in[0].shape().last(), v = wte_->value.dim(0);
  const int64_t real = std::clamp<int64_t>(vocab_ - first_, 0, v);
  ctx.chunked = true;
  ctx.dx_unit = arena.alloc({n, c});  // every row written by its chunk's GEMM (beta 0)
  ctx.dw_unit = arena.alloc({v, c});  // written by the first chunk's GEMM (beta 0), then added to
  // bf16 activations: bf16 logits, replaced by bf16 dlogits that both
  // backward GEMMs read with the weight's bf16 copy; otherwise fp32 logits
  // replaced by fp32 dlogits. Either way, in place.
  const bool narrow = in[0].dtype() == DType::BF16;
  const Tensor buf = arena.alloc({rows, v}, narrow ? DType::BF16 : DType::F32);
  const Tensor losses = arena.alloc({n});
  const Tensor x = in[0].view({n, c}), targets = in[1].view({n});
  const Tensor& w = gemm_operand(*wte_, in[0].dtype());
  for (int64_t r0 = 0; r0 < n; r0 += rows) {
    const int64_t r1 = std::min(n, r0 + rows);
    const Tensor xc = x.slice0(r0, r1), logits = buf.slice0(0, r1 - r0);
    ops::gemm(xc, false, w, true, logits);
    if (real < v) ops::mask_columns(logits, real);
    ops::fused_cross_entropy_rows(logits, targets.slice0(r0, r1), losses.slice0(r0, r1), 1.0f,
                                  logits);
    ops::gemm(logits, false, w, false, ctx.dx_unit.slice0(r0, r1));
    ops::gemm(logits, true, xc, false, ctx.dw_unit, 1.0f, r0 == 0 ? 0.0f : 1.0f);
  }
  ops::sum(losses, out[0]);  // on the device: nothing waits for a GPU here
}

// dlogits_r = (p_r - onehot_r(target)) * g, where g = d loss_total / d (this
// sum); dx += sum over ranks of dlogits_r wte_r
void TiedLmHeadLoss::backward_input(LayerCtx& ctx_, Arena& arena,
                                    std::span<const Tensor> grad_out,
                                    std::span<const Tensor> grad_in) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  const float g = ctx.seeded_grad_out ? *ctx.seeded_grad_out : ops::item(grad_out[0]);
  if (ctx.chunked) {
    ctx.g = g;
    if (!grad_in[0].defined()) return;
    ops::add_scaled(grad_in[0], ctx.dx_unit.view(grad_in[0].shape()), g);
    return;
  }
  if (ctx.unit_dlogits)
    ctx.g = g;  // probs already holds dlogits / g
  else
    ops::cross_entropy_backward(ctx.probs, ctx.targets, first_, ctx.probs, g);  // in place
  const float alpha = ctx.unit_dlogits ? ctx.g : 1.0f;
  if (!grad_in[0].defined()) return;
  if (!group_) {
    ops::gemm(ctx.probs, false, gemm_operand(*wte_, ctx.probs.dtype()), false, grad_in[0], alpha,
              1.0f);
    return;
  }
  if (sp_) {
    const Tensor part = sp_->whole(grad_in[0], SequenceScratch::kWholeA);
    ops::gemm(ctx.probs, false, wte_->value, false, part, alpha, 0.0f);
    sp_->gather_backward(part, grad_in[0], false);
    return;
  }
  const Tensor part = copy_to_tp_grad_buffer(*group_, arena, grad_in[0]);
  ops::gemm(ctx.probs, false, wte_->value, false, part, alpha, 1.0f);
  copy_to_tp_backward(*group_, part, grad_in[0]);
}

// dwte_r (V/tp, C) += dlogits_r^T x
void TiedLmHeadLoss::backward_weight(LayerCtx& ctx_, Arena&) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  if (ctx.chunked) {
    ops::add_scaled(wte_->grad, ctx.dw_unit, ctx.g);
    return;
  }
  const Tensor x = sp_ ? sp_->gather(ctx.x, SequenceScratch::kWholeA) : ctx.x;
  ops::gemm(ctx.probs, true, x, false, wte_->grad, ctx.unit_dlogits ? ctx.g : 1.0f, 1.0f);
}

}  // namespace weft
