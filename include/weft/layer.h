// weft/layer.h — the Layer interface: forward, backward_input, backward_weight.
//
// Every layer is three calls, written side by side in its own file:
//   forward(ctx, in, out)          out = f(in); saves what backward needs in ctx
//   backward_input(ctx, dout, din) din += d loss / d in       (the "I" action)
//   backward_weight(ctx)           param.grad += d loss / d w  (the "W" action)
// backward_input keeps what backward_weight will need (typically dout) in
// ctx, so the two may run at different times: zero-bubble schedules put W
// actions into the pipeline's idle slots. backward_weight drops what it kept
// of the gradients (ctx.dy = Tensor()): on a GPU that frees them at once
// (weft/runner.h).
//
// One ctx per (node, micro-batch): several micro-batches can be in flight at
// once. Output and gradient tensors are allocated by the caller from the
// micro-batch's Arena; a layer takes any scratch memory from the same arena.
// Gradients accumulate (+=): a value read by two nodes gets both
// contributions. An input whose gradient is not needed arrives as an undefined
// Tensor (tokens, targets) and is skipped.
#pragma once

#include <weft/arena.h>
#include <weft/param.h>
#include <weft/tensor.h>

#include <memory>
#include <optional>
#include <span>
#include <vector>

namespace weft {

class Communicator;
struct TpBuild;  // weft/tensor_parallel.h

// What a layer saves between forward and backward; subclassed per layer.
struct LayerCtx {
  virtual ~LayerCtx() = default;
  // Bit i: the gradient buffer of input i is new to this backward_input and
  // uninitialised, so the layer writes it rather than adding to it. Set by
  // the runner, only for inputs the layer says it writes whole
  // (Layer::writes_input_grad); 0 everywhere else, as when a layer is
  // called directly: then every gradient is accumulated into.
  uint32_t fresh_grads_in = 0;
  // Bit i: the runner made input i's gradient output 0's gradient buffer
  // itself (Layer::may_share_input_grad), so the layer leaves it alone: it
  // holds, or will once the layer has updated output 0's gradient, what the
  // layer would have copied there. 0 when a layer is called directly.
  uint32_t shared_grads_in = 0;
  // The gradient of the layer's one output when the runner seeded it with a
  // scalar the host knows (MicroBatch::seed_grad: the loss's), during
  // backward_input only; empty otherwise. A loss layer reads it here rather
  // than reading its gradient tensor back, which waits for a GPU.
  std::optional<float> seeded_grad_out;
};

class Layer {
 public:
  virtual ~Layer() = default;
  virtual const char* kind() const = 0;

  // Output shapes (and dtypes) for these input shapes; throws Error on a mismatch.
  virtual std::vector<Shape> output_shapes(std::span<const Shape> in) const = 0;
  virtual std::vector<DType> output_dtypes(std::span<const Shape> in) const {
    return std::vector<DType>(output_shapes(in).size(), DType::F32);
  }
  virtual std::vector<Param*> params() const { return {}; }
  // Forward FLOPs (multiply-adds count 2) for these input shapes.
  virtual double flops(std::span<const Shape> /*in*/) const { return 0; }
  // Elements of the activations' dtype that forward keeps for the backward
  // beyond the graph's values, for these input shapes (a fused MLP's hidden
  // pre-activation and activation): the analytic cost model counts them
  // with the node's outputs.
  virtual double stashed_elements(std::span<const Shape> /*in*/) const { return 0; }

  virtual std::unique_ptr<LayerCtx> make_ctx() const { return std::make_unique<LayerCtx>(); }

  virtual void forward(LayerCtx& ctx, Arena& arena, std::span<const Tensor> in,
                       std::span<const Tensor> out) = 0;
  virtual void backward_input(LayerCtx& ctx, Arena& arena, std::span<const Tensor> grad_out,
                              std::span<const Tensor> grad_in) = 0;
  virtual void backward_weight(LayerCtx& /*ctx*/, Arena& /*arena*/) {}
  // Whether backward_input, given a fresh buffer for input i's gradient
  // (LayerCtx::fresh_grads_in), writes all of it. Then the runner need not
  // zero it first: a memset and an extra read of every such gradient saved.
  virtual bool writes_input_grad(size_t /*i*/) const { return false; }
  // Whether input i's gradient is exactly the gradient of the layer's
  // output 0 as backward_input leaves it (a residual add's, left as it is; a
  // residual add fused with a norm adds the norm's part to it in place), so
  // that the runner may hand output 0's gradient buffer over as input i's
  // instead of a copy: it does so where input i's value is read by this
  // layer alone, once, and for at most one input of a node
  // (LayerCtx::shared_grads_in). That saves a copy and a buffer of every
  // residual branch's gradient. Only such a layer may write its output's
  // gradient, and only output 0's.
  virtual bool may_share_input_grad(size_t /*i*/) const { return false; }

  // This layer's form on one rank of a tensor-parallel group: the graph stays
  // logical, and a stage is instantiated per rank from it
  // (weft/tensor_parallel.h). A layer without parameters or splits returns a
  // copy of itself using build.param() for its parameters. The default throws
  // Error naming kind(): the layer cannot run tensor-parallel.
  virtual std::unique_ptr<Layer> tensor_parallel(TpBuild& build) const;
};

}  // namespace weft
