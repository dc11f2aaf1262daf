// weft/cuda/gpt.h — a whole GPT-2 training step on one GPU, built from the
// kernels of weft/cuda/kernels.h.
//
// The same model as models/gpt.cc (learned positions, pre-LayerNorm with eps
// 1e-5, tanh-GELU, 4x MLP, LM head tied to wte, loss = sum of token
// cross-entropies) with the same parameter names, so it loads a ParamStore
// built by build_gpt and its loss, gradients and AdamW steps can be compared
// with the CPU graph's, tensor by tensor.
//
//   GptModel cpu = build_gpt(cfg, B); init_gpt(cpu, seed);
//   cuda::GptStep gpu(shape, *cpu.params, cuda::MathMode::BF16);
//   double loss_sum = gpu.forward_backward(tokens, targets, 1.0f / (B * T));
//   gpu.adamw_step(lr, adamw_config);
//
// Parameters, gradients and AdamW moments live in four contiguous fp32 device
// buffers (one offset per parameter), so the gradient norm, clipping and
// zeroing are one call each. Activations are allocated per call from the
// context's caching allocator and released at its end: from the second step
// on, a step makes no cudaMalloc.
//
// This stands beside the layer graph rather than inside it: layers/*.cc call
// the CPU kernels directly, so until they dispatch on the tensor's device the
// GPU path is this one fixed GPT (see README, "CUDA backend").
#pragma once

#include <weft/cuda/kernels.h>
#include <weft/optimizer.h>
#include <weft/param.h>

#include <cstdint>
#include <string>
#include <vector>

namespace weft::cuda {

struct GptShape {
  int64_t vocab = 256;
  int64_t positions = 64;  // rows of wpe
  int64_t layers = 2;
  int64_t hidden = 64;
  int64_t heads = 4;
  int64_t seq = 64;
  int64_t batch = 1;  // sequences per micro-batch

  int64_t tokens() const { return batch * seq; }
  // Throws Error naming the value and the rule for an impossible shape.
  void validate() const;
};

class GptStep {
 public:
  // Copies every parameter (models/gpt.cc's names and shapes, checked) from
  // `params` to device `device`; gradients and moments start at zero.
  GptStep(const GptShape& shape, const ParamStore& params, MathMode mode, int device = 0);

  // Forward and backward of one micro-batch; tokens and targets are (B, T) on
  // the host, checked against the vocabulary. Gradients accumulate (+=) with
  // d loss / d (sum of token losses) = grad_scale, as the CPU graph does when
  // seeded with grad_scale. Returns the sum of token losses (waits for it).
  double forward_backward(const int32_t* tokens, const int32_t* targets, float grad_scale);
  // Forward only; returns the sum of token losses.
  double forward(const int32_t* tokens, const int32_t* targets);

  void zero_grads();
  // L2 norm of all gradients, in double (waits for it).
  double grad_norm();
  // Scales the gradients by max_norm / (norm + 1e-6) when that is below 1.
  void clip_grads(double max_norm, double norm);
  // One AdamW update (cpu::adamw's arithmetic); decay on 2-D parameters only.
  void adamw_step(float lr, const AdamWConfig& config);
  int64_t adamw_steps() const { return steps_; }

  // Device values / gradients into `params`' value / grad tensors (same names).
  void copy_params_to(ParamStore& params);
  void copy_grads_to(ParamStore& params);

  Context& context() { return *ctx_; }
  const GptShape& shape() const { return shape_; }
  MathMode mode() const { return mode_; }
  int64_t param_count() const { return total_; }

 private:
  struct Entry {
    std::string name;
    Shape shape;
    int64_t offset = 0;
  };
  // Parameter pointers of one transformer block.
  struct Block {
    int64_t ln1_w, ln1_b, attn_w, attn_b, attn_proj_w, attn_proj_b;
    int64_t ln2_w, ln2_b, fc_w, fc_b, mlp_proj_w, mlp_proj_b;
  };

  int64_t add_entry(const std::string& name, Shape shape);
  double run(const int32_t* tokens, const int32_t* targets, bool backward, float grad_scale);
  float* p(int64_t offset) const { return params_.data() + offset; }
  float* g(int64_t offset) const { return grads_.data() + offset; }

  GptShape shape_;
  MathMode mode_;
  Context* ctx_;
  std::vector<Entry> entries_;
  int64_t total_ = 0;
  int64_t wte_ = 0, wpe_ = 0, lnf_w_ = 0, lnf_b_ = 0;
  std::vector<Block> blocks_;
  DeviceBuffer<float> params_, grads_, m_, v_;
  int64_t steps_ = 0;
};

}  // namespace weft::cuda
