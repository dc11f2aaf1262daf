#include "layers/embedding.h"

#include <weft/ops.h>
#include <weft/tensor_parallel.h>

#include "layers/tp_regions.h"

namespace weft {

namespace {
struct Ctx : LayerCtx {
  Tensor tokens;     // (B, T) int32
  Tensor positions;  // (B, T) int32, or undefined: t
  Tensor dy;         // (B, T, C), kept by I for W
};
}  // namespace

Embedding::Embedding(Param* wte, Param* wpe, Communicator* group,
                     std::optional<SequenceParallel> sp)
    : group_(group), wte_(wte), wpe_(wpe), sp_(std::move(sp)) {
  check(wte->value.rank() == 2 &&
            (wpe == nullptr || (wpe->value.rank() == 2 && wte->value.dim(1) == wpe->value.dim(1))),
        "embedding tables {} {} and {} {} must be 2-D with the same width", wte->name,
        wte->value.shape().str(), wpe ? wpe->name : "(none)",
        wpe ? wpe->value.shape().str() : "");
  check(wte->shard.dim == 0 || !wte->shard.split(),
        "{}: a vocabulary-parallel table is split by rows, not along dimension {}", wte->name,
        wte->shard.dim);
  vocab_ = real_rows(*wte);
  first_ = wte->shard.split() ? wte->shard.index * wte->value.dim(0) : 0;
}

std::vector<Shape> Embedding::output_shapes(std::span<const Shape> in) const {
  check((in.size() == 1 || in.size() == 2) && in[0].rank == 2,
        "embedding takes tokens (B, T), and optionally their positions, got {} inputs", in.size());
  check(in.size() == 1 || in[1] == in[0], "embedding: positions {} must have the tokens' shape {}",
        in.size() > 1 ? in[1].str() : "", in[0].str());
  check(wpe_ == nullptr || in[0][1] <= wpe_->value.dim(0),
        "sequence length ({}) must not exceed the position table ({} positions)", in[0][1],
        wpe_ ? wpe_->value.dim(0) : 0);
  const Shape whole{in[0][0], in[0][1], wte_->value.dim(1)};
  return {sp_ ? sp_->slice_shape(whole) : whole};
}

std::unique_ptr<Layer> Embedding::tensor_parallel(TpBuild& build) const {
  const int tp = build.group->size();
  check(wte_->value.dim(0) % tp == 0,
        "vocabulary ({}) must be divisible by tensor-parallel size ({}): pad it with "
        "--make-vocab-size-divisible-by",
        wte_->value.dim(0), tp);
  return std::make_unique<Embedding>(build.param(*wte_, 0), wpe_ ? build.param(*wpe_, -1) : nullptr,
                                     build.group, sequence_parallel(build));
}

std::unique_ptr<LayerCtx> Embedding::make_ctx() const { return std::make_unique<Ctx>(); }

// tokens (B, T) -> y (B, T, C) = sum over ranks of (wte_r row, or 0) + wpe[t]
void Embedding::forward(LayerCtx& ctx_, Arena&, std::span<const Tensor> in,
                        std::span<const Tensor> out) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  ops::check_token_range(in[0], vocab_, "token");
  const bool positions = wpe_ != nullptr && (group_ == nullptr || group_->rank() == 0);
  const Tensor y = sp_ ? sp_->whole(out[0], SequenceScratch::kWholeA) : out[0];
  ctx.positions = in.size() > 1 ? in[1] : Tensor();
  ops::embedding_forward(in[0], wte_->value, first_, positions ? wpe_->value : Tensor(), y,
                         ctx.positions);
  if (sp_)
    sp_->scatter(y, out[0]);
  else if (group_)
    reduce_from_tp_forward(*group_, out[0]);
  ctx.tokens = in[0];
}

void Embedding::backward_input(LayerCtx& ctx_, Arena&, std::span<const Tensor> grad_out,
                               std::span<const Tensor>) {
  if (group_ && !sp_) reduce_from_tp_backward(*group_, grad_out[0]);
  static_cast<Ctx&>(ctx_).dy = grad_out[0];  // tokens have no gradient
}

// dwte_r[tokens[i] - first] += dy[i] for this rank's tokens; dwpe[t] += sum_b dy[b, t]
void Embedding::backward_weight(LayerCtx& ctx_, Arena&) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  const Tensor dy = sp_ ? sp_->gather(ctx.dy, SequenceScratch::kWholeA) : ctx.dy;
  ops::embedding_backward(ctx.tokens, dy, wte_->grad, first_, wpe_ ? wpe_->grad : Tensor(),
                          ctx.positions);
  ctx.dy = Tensor();  // W is done with it (weft/layer.h)
}

}  // namespace weft
