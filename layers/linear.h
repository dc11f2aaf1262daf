// Linear: x (..., in) -> y (..., out) = x W + b, with W stored (in, out) as in
// Hugging Face GPT-2's Conv1D.
//
// The graph stays logical: `role` records which half of a Megatron pair this
// is (Column splits W's columns across the tensor-parallel group, Row splits
// its rows), so a stage can instantiate the right parallel form per rank
// (layers/tp_linear.h). `out_blocks` says that the output is packed blocks:
// a count of equal ones (3 for GPT's q|k|v projection), or their widths
// ({H D, G D, G D} for grouped-query attention's). A column split then gives
// each rank its piece of every block, so its slice keeps the packed layout.
#pragma once

#include <weft/layer.h>

namespace weft {

enum class ParallelRole : uint8_t { None, Column, Row };

class Linear final : public Layer {
 public:
  // bias may be null
  Linear(Param* weight, Param* bias, ParallelRole role = ParallelRole::None, int out_blocks = 1);
  Linear(Param* weight, Param* bias, ParallelRole role, std::vector<int64_t> out_blocks);
  const char* kind() const override { return "linear"; }
  std::vector<Shape> output_shapes(std::span<const Shape> in) const override;
  std::vector<Param*> params() const override;
  double flops(std::span<const Shape> in) const override;
  std::unique_ptr<LayerCtx> make_ctx() const override;
  bool writes_input_grad(size_t) const override { return true; }
  ParallelRole role() const { return role_; }
  // The widths of the output's packed blocks.
  const std::vector<int64_t>& out_blocks() const { return out_blocks_; }
  std::unique_ptr<Layer> tensor_parallel(TpBuild& build) const override;

  void forward(LayerCtx& ctx, Arena& arena, std::span<const Tensor> in,
               std::span<const Tensor> out) override;
  void backward_input(LayerCtx& ctx, Arena& arena, std::span<const Tensor> grad_out,
                      std::span<const Tensor> grad_in) override;
  void backward_weight(LayerCtx& ctx, Arena& arena) override;

 private:
  Param* w_;
  Param* b_;
  ParallelRole role_;
  std::vector<int64_t> out_blocks_;
};

}  // namespace weft
