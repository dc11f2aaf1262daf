// GeluMlp: a transformer block's MLP as one node, x (..., C) -> y (..., C):
//
//   pre = x W_fc + b_fc        W_fc (C, H), stored (in, out) as Linear's
//   h   = gelu(pre)            tanh-approximated (layers/gelu.h)
//   y   = h W_proj + b_proj    W_proj (H, C)
//
// It is the chain Linear -> Gelu -> Linear in one layer, computing the same
// values in the same order (on the CPU, the same bits). Being one node lets a
// GPU run the GELU in the epilogue of the first GEMM and GELU's gradient in
// the epilogue of the second GEMM's input gradient (ops::gemm_bias_gelu,
// ops::gemm_dgelu): under --bf16 that saves reading pre and writing and
// reading the (N, H) gradient of h, once each per block and step.
//
// The layer keeps x, pre and h for its backward, as the three nodes kept
// their inputs (stashed_elements counts pre and h for the cost model).
//
// Tensor-parallel (Megatron's MLP): rank r keeps its columns of W_fc and
// b_fc and the matching rows of W_proj, so h needs no communication; the
// partial products of the second GEMM are summed across the group, and
// b_proj (whole) is added once after the sum, as ColumnParallelLinear then
// RowParallelLinear (layers/tp_linear.h) do. Under sequence parallelism x
// arrives as this rank's tokens and is gathered, the sum is reduce-scattered
// to this rank's tokens, and W gathers x and dy again.
#pragma once

#include <weft/communicator.h>
#include <weft/layer.h>

#include <optional>

#include "layers/tp_regions.h"

namespace weft {

class GeluMlp final : public Layer {
 public:
  // With `group`, the parameters are this rank's pieces (made by
  // tensor_parallel).
  GeluMlp(Param* w_fc, Param* b_fc, Param* w_proj, Param* b_proj, Communicator* group = nullptr,
          std::optional<SequenceParallel> sp = std::nullopt);
  const char* kind() const override { return group_ ? "parallel_gelu_mlp" : "gelu_mlp"; }
  std::vector<Shape> output_shapes(std::span<const Shape> in) const override;
  std::vector<Param*> params() const override;
  double flops(std::span<const Shape> in) const override;
  double stashed_elements(std::span<const Shape> in) const override;
  std::unique_ptr<LayerCtx> make_ctx() const override;
  // The input gradient is one GEMM (beta 0 when fresh); tensor-parallel, the
  // rank's part is summed across the group and then added (or, under
  // sequence parallelism, reduce-scattered into a fresh buffer).
  bool writes_input_grad(size_t) const override { return group_ == nullptr || sp_.has_value(); }
  std::unique_ptr<Layer> tensor_parallel(TpBuild& build) const override;

  void forward(LayerCtx& ctx, Arena& arena, std::span<const Tensor> in,
               std::span<const Tensor> out) override;
  void backward_input(LayerCtx& ctx, Arena& arena, std::span<const Tensor> grad_out,
                      std::span<const Tensor> grad_in) override;
  void backward_weight(LayerCtx& ctx, Arena& arena) override;

 private:
  int64_t hidden() const { return w_fc_->value.dim(1); }

  // Rows of the whole sequence for an input of shape `in`.
  double whole_rows(const Shape& in) const;

  Param *w_fc_, *b_fc_, *w_proj_, *b_proj_;
  Communicator* group_;
  std::optional<SequenceParallel> sp_;
};

}  // namespace weft
