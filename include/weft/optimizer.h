// weft/optimizer.h — AdamW and SGD (PyTorch semantics), gradient norm and
// clipping, and the learning-rate schedule.
#pragma once

#include <weft/ops.h>
#include <weft/param.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace weft {

struct AdamWConfig {
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;  // applied to parameters of rank >= 2 only
};

// Megatron's --optimizer adam|sgd (weft's adam is AdamW).
enum class OptimizerKind : uint8_t { Adam, Sgd };
// "adam" -> Adam, "sgd" -> Sgd; throws Error naming the value.
OptimizerKind parse_optimizer(const std::string& name);
const char* optimizer_name(OptimizerKind kind);  // "adamw", "sgd": as checkpoints record it
// The suffixes of a kind's state tensors per parameter ("<param><suffix>").
std::vector<std::string> optimizer_state_suffixes(OptimizerKind kind);

struct SgdConfig {
  float momentum = 0.0f;      // --sgd-momentum
  float weight_decay = 0.0f;  // L2, on parameters of rank >= 2 only
};

// One update per step of every parameter from its gradient.
class Optimizer {
 public:
  explicit Optimizer(std::vector<Param*> params) : params_(std::move(params)) {}
  virtual ~Optimizer() = default;
  // One update, from each gradient times grad_scale (clip_coefficient's):
  // the bits of clip_grads and then step(lr), the gradients left unscaled.
  virtual void step(float lr, float grad_scale) = 0;
  void step(float lr) { step(lr, 1.0f); }
  // The same with grad_scale where the device worked it out (one F32
  // element on the parameters' device; ops::clip_coefficient): AdamW and SGD
  // read it there, so the host never waits for it. By default it is read
  // back to the host (a wait on a GPU) and given to step(lr, float).
  virtual void step(float lr, const Tensor& grad_scale) { step(lr, ops::item(grad_scale)); }
  // State tensors, named "<param><suffix>" (optimizer_state_suffixes).
  virtual std::vector<std::pair<std::string, Tensor>> state() = 0;
  int64_t steps() const { return steps_; }
  void set_steps(int64_t s) { steps_ = s; }
  const std::vector<Param*>& params() const { return params_; }

 protected:
  std::vector<Param*> params_;
  int64_t steps_ = 0;
};

class AdamW final : public Optimizer {
 public:
  AdamW(std::vector<Param*> params, AdamWConfig config);
  // One update from each parameter's grad: decoupled decay p *= 1 - lr*wd,
  // moments, bias correction, p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps).
  // grad_scale is read with each gradient element (ops::AdamWStep).
  using Optimizer::step;
  void step(float lr, float grad_scale) override;
  void step(float lr, const Tensor& grad_scale) override;
  // "<param>.exp_avg" and "<param>.exp_avg_sq".
  std::vector<std::pair<std::string, Tensor>> state() override;

 private:
  void update(float lr, float grad_scale, const Tensor& grad_scale_at);
  AdamWConfig config_;
  std::vector<Tensor> m_, v_;
  std::vector<ops::AdamWTensors> multi_tensors_;  // this step's, for ops::adamw_multi
  std::shared_ptr<void> multi_;                   // ops::adamw_multi's device table
};

// torch.optim.SGD: d = g + wd p; buf = momentum buf + d; p -= lr buf (or d
// without momentum).
class Sgd final : public Optimizer {
 public:
  Sgd(std::vector<Param*> params, SgdConfig config);
  using Optimizer::step;
  // A grad_scale other than 1 scales the gradients first (one on the
  // device always does).
  void step(float lr, float grad_scale) override;
  void step(float lr, const Tensor& grad_scale) override;
  // "<param>.momentum_buffer".
  std::vector<std::pair<std::string, Tensor>> state() override;

 private:
  void update(float lr);
  SgdConfig config_;
  std::vector<Tensor> buf_;
  std::vector<Tensor> grads_;    // this step's, for ops::scale_multi
  std::shared_ptr<void> scale_;  // ops::scale_multi's device table
};

// What grad_norm and clip_grads keep from one step to the next: the list of
// gradients they hand to ops::sum_squares_multi and ops::scale_multi, and a
// device table for each of those (on a GPU: one launch over every gradient,
// and for the norm one wait). One per parameter list, held by the caller, so
// a steady step allocates nothing; the norm's and the clip's tables are
// apart, so they may serve two different lists.
struct GradTables {
  std::vector<Tensor> grads;
  std::shared_ptr<void> norm, clip;
};
// Total L2 norm of all gradients (each parameter once), in double: the sum of
// their sums of squares, in the order of `params`.
double grad_norm(const std::vector<Param*>& params, GradTables& tables);
// The factor clipping at max_norm gives gradients of norm `norm`: max_norm /
// (norm + 1e-6) where that is below 1, as torch.nn.utils.clip_grad_norm_'s,
// else 1 (and 1 for max_norm <= 0, which disables clipping).
float clip_coefficient(double max_norm, double norm);
// Scales gradients by clip_coefficient(max_norm, norm) where it is not 1.
void clip_grads(const std::vector<Param*>& params, double max_norm, double norm,
                GradTables& tables);
void zero_grads(const std::vector<Param*>& params);

enum class LrDecay { Constant, Cosine };

struct LrSchedule {
  float lr = 3e-4f;
  float min_lr = 0.0f;
  LrDecay decay = LrDecay::Constant;
  int64_t warmup_iters = 0;
  int64_t decay_iters = 0;  // cosine reaches min_lr here (usually train_iters)

  // 0-based step: linear warmup lr*(step+1)/warmup, then constant, or cosine
  // from lr down to min_lr at decay_iters, min_lr after.
  float at(int64_t step) const;
};

}  // namespace weft
