// The two halves of a Megatron MLP (and of attention's projections), on one
// rank of a tensor-parallel group of size tp:
//
//   ColumnParallelLinear  x (..., in) whole -> y (..., out/tp), this rank's columns
//                         = copy_to_tp, then x W_r + b_r      (W_r (in, out/tp))
//   RowParallelLinear     x (..., in/tp), this rank's slice -> y (..., out) whole
//                         = x W_r, then reduce_from_tp, + b   (W_r (in/tp, out))
//
// A column-parallel layer followed by a row-parallel one (c_fc -> gelu ->
// c_proj) needs no communication in between: each rank's slice of the hidden
// activation is exactly what its rows of the second weight consume. The row
// layer's bias is whole and added once, after the sum, so its gradient is the
// same on every rank. Both are built by Linear::tensor_parallel.
//
// Under sequence parallelism (layers/tp_regions.h) x enters a column-parallel
// layer as this rank's tokens and is all-gathered, and a row-parallel
// layer's sum is reduce-scattered to this rank's tokens. Neither keeps a
// whole activation between its actions: the weight gradient's W gathers its
// whole operand again (x for the column layer, dy for the row layer).
#pragma once

#include <weft/communicator.h>
#include <weft/layer.h>

#include <optional>

#include "layers/linear.h"
#include "layers/tp_regions.h"

namespace weft {

class ColumnParallelLinear final : public Layer {
 public:
  // weight (in, out/tp), bias (out/tp) or null: this rank's pieces. `sp`:
  // x arrives as this rank's tokens (sequence parallelism).
  ColumnParallelLinear(Communicator& group, Param* weight, Param* bias,
                       std::optional<SequenceParallel> sp = std::nullopt);
  const char* kind() const override { return "column_parallel_linear"; }
  std::vector<Shape> output_shapes(std::span<const Shape> in) const override;
  std::vector<Param*> params() const override { return local_.params(); }
  double flops(std::span<const Shape> in) const override;
  std::unique_ptr<LayerCtx> make_ctx() const override;
  // Under sequence parallelism the input gradient is a reduce-scatter, which
  // writes a fresh buffer whole.
  bool writes_input_grad(size_t) const override { return sp_.has_value(); }

  void forward(LayerCtx& ctx, Arena& arena, std::span<const Tensor> in,
               std::span<const Tensor> out) override;
  void backward_input(LayerCtx& ctx, Arena& arena, std::span<const Tensor> grad_out,
                      std::span<const Tensor> grad_in) override;
  void backward_weight(LayerCtx& ctx, Arena& arena) override;

 private:
  Communicator* group_;
  Linear local_;  // this rank's columns
  Param *w_, *b_;  // local_'s, for the sequence-parallel form (b_ may be null)
  std::optional<SequenceParallel> sp_;
};

class RowParallelLinear final : public Layer {
 public:
  // weight (in/tp, out): this rank's rows; bias (out) whole, or null. `sp`:
  // y leaves as this rank's tokens (sequence parallelism).
  RowParallelLinear(Communicator& group, Param* weight, Param* bias,
                    std::optional<SequenceParallel> sp = std::nullopt);
  const char* kind() const override { return "row_parallel_linear"; }
  std::vector<Shape> output_shapes(std::span<const Shape> in) const override;
  std::vector<Param*> params() const override;
  double flops(std::span<const Shape> in) const override { return local_.flops(in); }
  std::unique_ptr<LayerCtx> make_ctx() const override;

  void forward(LayerCtx& ctx, Arena& arena, std::span<const Tensor> in,
               std::span<const Tensor> out) override;
  void backward_input(LayerCtx& ctx, Arena& arena, std::span<const Tensor> grad_out,
                      std::span<const Tensor> grad_in) override;
  void backward_weight(LayerCtx& ctx, Arena& arena) override;

 private:
  Communicator* group_;
  Linear local_;  // this rank's rows, without the bias
  Param* w_;      // local_'s
  Param* b_;
  std::optional<SequenceParallel> sp_;
};

}  // namespace weft
