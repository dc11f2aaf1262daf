#include <weft/ops.h>
#include <weft/optimizer.h>

#include <algorithm>
#include <cmath>

namespace weft {

OptimizerKind parse_optimizer(const std::string& name) {
  if (name == "adam") return OptimizerKind::Adam;
  if (name == "sgd") return OptimizerKind::Sgd;
  if (name == "lion") return OptimizerKind::Lion;
  throw Error("--optimizer '{}' must be adam, sgd or lion", name);
}

const char* optimizer_name(OptimizerKind kind) {
  return kind == OptimizerKind::Sgd ? "sgd" : kind == OptimizerKind::Lion ? "lion" : "adamw";
}

std::vector<std::string> optimizer_state_suffixes(OptimizerKind kind) {
  OptimizerConfig c;
  c.kind = kind;
  return make_update_rule(c)->state_suffixes();
}

std::unique_ptr<UpdateRule> make_update_rule(const OptimizerConfig& config) {
  switch (config.kind) {
    case OptimizerKind::Sgd: return make_sgd_rule(config.sgd);
    case OptimizerKind::Lion: return make_lion_rule(config.lion);
    case OptimizerKind::Adam: break;
  }
  return make_adamw_rule(config.adam);
}

namespace {

// Every piece in one ops::adamw_multi call: on a GPU one launch.
class AdamWRule final : public UpdateRule {
 public:
  explicit AdamWRule(const AdamWConfig& c) : c_(c) {}
  const char* name() const override { return "adamw"; }
  std::vector<std::string> state_suffixes() const override { return {".exp_avg", ".exp_avg_sq"}; }
  bool normalised() const override { return true; }
  void update(const std::vector<UpdatePiece>& pieces, const UpdateStep& s,
              std::shared_ptr<void>& cache) const override {
    auto& table = table_of(cache);
    table.tensors.clear();  // keeps its capacity
    for (const UpdatePiece& p : pieces)
      table.tensors.push_back({p.value, p.grad, p.state[0], p.state[1], p.decay});
    ops::adamw_multi(table.tensors,
                     {s.lr, c_.beta1, c_.beta2, c_.eps, c_.weight_decay, s.step, s.grad_scale},
                     table.device, s.grad_scale_at);
  }

 private:
  struct Table {
    std::vector<ops::AdamWTensors> tensors;
    std::shared_ptr<void> device;  // ops::adamw_multi's
  };
  static Table& table_of(std::shared_ptr<void>& cache) {
    if (!cache) cache = std::make_shared<Table>();
    return *static_cast<Table*>(cache.get());
  }
  AdamWConfig c_;
};

// A grad_scale other than 1 scales the gradients first (one on the device
// always does: x 1 is the same bits), in one launch on a GPU.
class SgdRule final : public UpdateRule {
 public:
  explicit SgdRule(const SgdConfig& c) : c_(c) {}
  const char* name() const override { return "sgd"; }
  std::vector<std::string> state_suffixes() const override { return {".momentum_buffer"}; }
  bool normalised() const override { return false; }
  void update(const std::vector<UpdatePiece>& pieces, const UpdateStep& s,
              std::shared_ptr<void>& cache) const override {
    if (s.grad_scale_at.defined() || s.grad_scale != 1.0f) {
      if (!cache) cache = std::make_shared<Table>();
      auto& table = *static_cast<Table*>(cache.get());
      table.grads.clear();  // keeps its capacity
      for (const UpdatePiece& p : pieces) table.grads.push_back(p.grad);
      if (s.grad_scale_at.defined())
        ops::scale_multi(table.grads, s.grad_scale_at, table.device);
      else
        ops::scale_multi(table.grads, s.grad_scale, table.device);
    }
    for (const UpdatePiece& p : pieces)
      ops::sgd(p.value, p.grad, p.state[0], s.lr, c_.momentum, p.decay ? c_.weight_decay : 0.0f);
  }

 private:
  struct Table {
    std::vector<Tensor> grads;
    std::shared_ptr<void> device;  // ops::scale_multi's
  };
  SgdConfig c_;
};

}  // namespace

std::unique_ptr<UpdateRule> make_adamw_rule(const AdamWConfig& config) {
  return std::make_unique<AdamWRule>(config);
}

std::unique_ptr<UpdateRule> make_sgd_rule(const SgdConfig& config) {
  return std::make_unique<SgdRule>(config);
}

Optimizer::Optimizer(std::vector<Param*> params, std::unique_ptr<UpdateRule> rule)
    : params_(std::move(params)), rule_(std::move(rule)) {
  const size_t n = rule_->state_suffixes().size();
  check(n <= kMaxOptimizerState, "the {} optimizer keeps {} state tensors per parameter; at most "
        "{} fit", rule_->name(), n, kMaxOptimizerState);
  for (Param* p : params_) {
    std::array<Tensor, kMaxOptimizerState> st;
    for (size_t k = 0; k < n; ++k)
      st[k] = Tensor::zeros(p->value.shape(), DType::F32, p->value.device());
    state_.push_back(st);
  }
}

void Optimizer::step(float lr, float grad_scale) { update(lr, grad_scale, Tensor()); }

void Optimizer::step(float lr, const Tensor& grad_scale) { update(lr, 1.0f, grad_scale); }

void Optimizer::update(float lr, float grad_scale, const Tensor& grad_scale_at) {
  step_.lr = lr;
  step_.step = ++steps_;
  step_.grad_scale = grad_scale;
  step_.grad_scale_at = grad_scale_at;
  pieces_.clear();  // keeps its capacity
  for (size_t i = 0; i < params_.size(); ++i)
    pieces_.push_back({params_[i]->value, params_[i]->grad, state_[i], params_[i]->weight_decay()});
  rule_->update(pieces_, step_, cache_);
  step_.grad_scale_at = Tensor();  // holds no reference between steps
}

std::vector<std::pair<std::string, Tensor>> Optimizer::state() {
  const std::vector<std::string> suffixes = rule_->state_suffixes();
  std::vector<std::pair<std::string, Tensor>> s;
  for (size_t i = 0; i < params_.size(); ++i)
    for (size_t k = 0; k < suffixes.size(); ++k)
      s.emplace_back(params_[i]->name + suffixes[k], state_[i][k]);
  return s;
}

namespace {
const std::vector<Tensor>& grads_of(const std::vector<Param*>& params, GradTables& tables) {
  tables.grads.clear();  // keeps its capacity
  for (Param* p : params) tables.grads.push_back(p->grad);
  return tables.grads;
}
}  // namespace

double grad_norm(const std::vector<Param*>& params, GradTables& tables) {
  return std::sqrt(ops::sum_squares_multi(grads_of(params, tables), tables.norm));
}

float clip_coefficient(double max_norm, double norm) {
  if (max_norm <= 0) return 1.0f;
  const double coef = max_norm / (norm + 1e-6);
  return coef >= 1.0 ? 1.0f : static_cast<float>(coef);
}

void clip_grads(const std::vector<Param*>& params, double max_norm, double norm,
                GradTables& tables) {
  const float coef = clip_coefficient(max_norm, norm);
  if (coef != 1.0f) ops::scale_multi(grads_of(params, tables), coef, tables.clip);
}

void zero_grads(const std::vector<Param*>& params) {
  for (Param* p : params) p->grad.zero_();
}

float LrSchedule::at(int64_t step) const {
  if (warmup_iters > 0 && step < warmup_iters)
    return lr * static_cast<float>(step + 1) / static_cast<float>(warmup_iters);
  if (decay == LrDecay::Constant) return lr;
  const int64_t span = std::max<int64_t>(1, decay_iters - warmup_iters);
  const double progress =
      std::clamp(static_cast<double>(step - warmup_iters) / static_cast<double>(span), 0.0, 1.0);
  return min_lr + static_cast<float>((lr - min_lr) * 0.5 * (1.0 + std::cos(M_PI * progress)));
}

}  // namespace weft
