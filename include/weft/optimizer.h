// weft/optimizer.h — optimizers (AdamW and SGD with PyTorch's semantics,
// Lion), gradient norm and clipping, and the learning-rate schedule.
//
// An optimizer is an UpdateRule: the names of its state tensors (each shaped
// like its parameter) and an element-wise update of pieces of parameters.
// The plain optimizer gives it whole tensors, ZeRO-1 the slices each replica
// owns, a parameter server the tensors it holds: one implementation of the
// update for all three, and checkpoints name the state by the rule's
// suffixes. Adding one is a file with its rule (src/runtime/lion.cc is one)
// plus its kernels and a line in make_update_rule.
#pragma once

#include <weft/ops.h>
#include <weft/param.h>

#include <array>
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

// Megatron's --optimizer adam|sgd (weft's adam is AdamW), and lion.
enum class OptimizerKind : uint8_t { Adam, Sgd, Lion };
// "adam" -> Adam, "sgd" -> Sgd, "lion" -> Lion; throws Error naming the value.
OptimizerKind parse_optimizer(const std::string& name);
const char* optimizer_name(OptimizerKind kind);  // "adamw", "sgd", "lion": as checkpoints record it
// The suffixes of a kind's state tensors per parameter ("<param><suffix>").
std::vector<std::string> optimizer_state_suffixes(OptimizerKind kind);

struct SgdConfig {
  float momentum = 0.0f;      // --sgd-momentum
  float weight_decay = 0.0f;  // L2, on parameters of rank >= 2 only
};

// Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"):
// c = b1 m + (1 - b1) g; p = p (1 - lr wd) - lr sign(c); m = b2 m + (1 - b2) g.
struct LionConfig {
  float beta1 = 0.9f;
  float beta2 = 0.99f;
  float weight_decay = 0.0f;  // decoupled, on parameters of rank >= 2 only
};

// Every optimizer's settings; the kind picks which apply.
struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::Adam;
  AdamWConfig adam;
  SgdConfig sgd;
  LionConfig lion;
};

// The most state tensors an update rule keeps per parameter.
inline constexpr size_t kMaxOptimizerState = 2;

// A piece of one parameter to update: all of it, or a slice (ZeRO-1), with
// the same piece of its gradient and of each state tensor (in the order of
// the rule's state_suffixes()).
struct UpdatePiece {
  Tensor value, grad;
  std::array<Tensor, kMaxOptimizerState> state;
  bool decay = true;  // the parameter takes weight decay (rank >= 2)
};

// What one step tells the rule: the learning rate, the 1-based step, and the
// factor each gradient element is read with: grad_scale, or where defined
// grad_scale_at (one F32 element on the pieces' device, which the host
// need not wait for; ops::clip_coefficient).
struct UpdateStep {
  float lr = 0;
  int64_t step = 1;
  float grad_scale = 1.0f;
  Tensor grad_scale_at;
};

class UpdateRule {
 public:
  virtual ~UpdateRule() = default;
  virtual const char* name() const = 0;  // as checkpoints record it
  // The state tensors' suffixes ("<param><suffix>"), at most kMaxOptimizerState.
  virtual std::vector<std::string> state_suffixes() const = 0;
  // Updates every piece; on a GPU one launch where the rule has a
  // multi-tensor kernel, from a device table kept in `cache` (a steady step
  // allocates nothing). A piece's update depends on that piece alone, so
  // slices update as their whole tensor would, bit for bit.
  virtual void update(const std::vector<UpdatePiece>& pieces, const UpdateStep& s,
                      std::shared_ptr<void>& cache) const = 0;
  // Whether an update's size is set by the learning rate rather than the
  // gradient's (AdamW's, Lion's): a parameter server applying each of n
  // workers' pushes as its own update divides the learning rate by n.
  virtual bool normalised() const = 0;
};

std::unique_ptr<UpdateRule> make_update_rule(const OptimizerConfig& config);
std::unique_ptr<UpdateRule> make_adamw_rule(const AdamWConfig& config);
std::unique_ptr<UpdateRule> make_sgd_rule(const SgdConfig& config);
std::unique_ptr<UpdateRule> make_lion_rule(const LionConfig& config);

// One update per step of every parameter from its gradient, by a rule, on
// whole tensors; the state tensors start at zero.
class Optimizer {
 public:
  Optimizer(std::vector<Param*> params, std::unique_ptr<UpdateRule> rule);
  virtual ~Optimizer() = default;
  // One update, from each gradient times grad_scale (clip_coefficient's):
  // the bits of clip_grads and then step(lr). AdamW and Lion leave the
  // gradients unscaled; SGD scales them first.
  void step(float lr, float grad_scale);
  void step(float lr) { step(lr, 1.0f); }
  // The same with grad_scale where the device worked it out (one F32
  // element on the parameters' device; ops::clip_coefficient), so the host
  // never waits for it.
  void step(float lr, const Tensor& grad_scale);
  // State tensors, named "<param><suffix>" (the rule's state_suffixes).
  std::vector<std::pair<std::string, Tensor>> state();
  int64_t steps() const { return steps_; }
  void set_steps(int64_t s) { steps_ = s; }
  const std::vector<Param*>& params() const { return params_; }
  const UpdateRule& rule() const { return *rule_; }

 private:
  void update(float lr, float grad_scale, const Tensor& grad_scale_at);
  std::vector<Param*> params_;
  std::unique_ptr<UpdateRule> rule_;
  std::vector<std::array<Tensor, kMaxOptimizerState>> state_;
  std::vector<UpdatePiece> pieces_;  // this step's, reused: a steady step allocates nothing
  UpdateStep step_;
  std::shared_ptr<void> cache_;      // the rule's device table
  int64_t steps_ = 0;
};

// AdamW, PyTorch semantics: decoupled decay p *= 1 - lr*wd, moments, bias
// correction, p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps); state
// "<param>.exp_avg" and "<param>.exp_avg_sq".
class AdamW final : public Optimizer {
 public:
  AdamW(std::vector<Param*> params, AdamWConfig config)
      : Optimizer(std::move(params), make_adamw_rule(config)) {}
};

// torch.optim.SGD: d = g + wd p; buf = momentum buf + d; p -= lr buf (or d
// without momentum); state "<param>.momentum_buffer".
class Sgd final : public Optimizer {
 public:
  Sgd(std::vector<Param*> params, SgdConfig config)
      : Optimizer(std::move(params), make_sgd_rule(config)) {}
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
