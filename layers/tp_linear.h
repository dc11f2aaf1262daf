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
#pragma once

#include <weft/communicator.h>
#include <weft/layer.h>

#include "layers/linear.h"

namespace weft {

class ColumnParallelLinear final : public Layer {
 public:
  // weight (in, out/tp), bias (out/tp) or null: this rank's pieces.
  ColumnParallelLinear(Communicator& group, Param* weight, Param* bias);
  const char* kind() const override { return "column_parallel_linear"; }
  std::vector<Shape> output_shapes(std::span<const Shape> in) const override {
    return local_.output_shapes(in);
  }
  std::vector<Param*> params() const override { return local_.params(); }
  double flops(std::span<const Shape> in) const override { return local_.flops(in); }
  std::unique_ptr<LayerCtx> make_ctx() const override { return local_.make_ctx(); }

  void forward(LayerCtx& ctx, Arena& arena, std::span<const Tensor> in,
               std::span<const Tensor> out) override;
  void backward_input(LayerCtx& ctx, Arena& arena, std::span<const Tensor> grad_out,
                      std::span<const Tensor> grad_in) override;
  void backward_weight(LayerCtx& ctx, Arena& arena) override;

 private:
  Communicator* group_;
  Linear local_;  // this rank's columns
};

class RowParallelLinear final : public Layer {
 public:
  // weight (in/tp, out): this rank's rows; bias (out) whole, or null.
  RowParallelLinear(Communicator& group, Param* weight, Param* bias);
  const char* kind() const override { return "row_parallel_linear"; }
  std::vector<Shape> output_shapes(std::span<const Shape> in) const override {
    return local_.output_shapes(in);
  }
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
  Param* b_;
};

}  // namespace weft
