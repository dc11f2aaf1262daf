#include <weft/ops.h>
#include <weft/optimizer.h>

#include <algorithm>
#include <cmath>

namespace weft {

OptimizerKind parse_optimizer(const std::string& name) {
  if (name == "adam") return OptimizerKind::Adam;
  if (name == "sgd") return OptimizerKind::Sgd;
  throw Error("--optimizer '{}' must be adam or sgd", name);
}

const char* optimizer_name(OptimizerKind kind) {
  return kind == OptimizerKind::Sgd ? "sgd" : "adamw";
}

std::vector<std::string> optimizer_state_suffixes(OptimizerKind kind) {
  if (kind == OptimizerKind::Sgd) return {".momentum_buffer"};
  return {".exp_avg", ".exp_avg_sq"};
}

Sgd::Sgd(std::vector<Param*> params, SgdConfig config)
    : Optimizer(std::move(params)), config_(config) {
  for (Param* p : params_) buf_.push_back(Tensor::zeros(p->value.shape(), DType::F32, p->value.device()));
}

void Sgd::step(float lr, float grad_scale) {
  if (grad_scale != 1.0f) {  // one launch on a GPU, as clip_grads
    grads_.clear();          // keeps its capacity
    for (Param* p : params_) grads_.push_back(p->grad);
    ops::scale_multi(grads_, grad_scale, scale_);
  }
  update(lr);
}

void Sgd::step(float lr, const Tensor& grad_scale) {
  grads_.clear();
  for (Param* p : params_) grads_.push_back(p->grad);
  ops::scale_multi(grads_, grad_scale, scale_);  // x 1 where it is 1: the same bits
  update(lr);
}

void Sgd::update(float lr) {
  ++steps_;
  for (size_t i = 0; i < params_.size(); ++i) {
    Param* p = params_[i];
    ops::sgd(p->value, p->grad, buf_[i], lr, config_.momentum,
             p->weight_decay() ? config_.weight_decay : 0.0f);
  }
}

std::vector<std::pair<std::string, Tensor>> Sgd::state() {
  std::vector<std::pair<std::string, Tensor>> s;
  for (size_t i = 0; i < params_.size(); ++i)
    s.emplace_back(params_[i]->name + ".momentum_buffer", buf_[i]);
  return s;
}

AdamW::AdamW(std::vector<Param*> params, AdamWConfig config)
    : Optimizer(std::move(params)), config_(config) {
  for (Param* p : params_) {
    m_.push_back(Tensor::zeros(p->value.shape(), DType::F32, p->value.device()));
    v_.push_back(Tensor::zeros(p->value.shape(), DType::F32, p->value.device()));
  }
}

// Every parameter in one ops::adamw_multi call: on a GPU one launch, from a
// device table built on the first step and kept while the parameters stay.
void AdamW::step(float lr, float grad_scale) { update(lr, grad_scale, Tensor()); }

void AdamW::step(float lr, const Tensor& grad_scale) { update(lr, 1.0f, grad_scale); }

void AdamW::update(float lr, float grad_scale, const Tensor& grad_scale_at) {
  ++steps_;
  multi_tensors_.clear();  // keeps its capacity: a steady step allocates nothing
  for (size_t i = 0; i < params_.size(); ++i) {
    Param* p = params_[i];
    multi_tensors_.push_back({p->value, p->grad, m_[i], v_[i], p->weight_decay()});
  }
  ops::adamw_multi(
      multi_tensors_,
      {lr, config_.beta1, config_.beta2, config_.eps, config_.weight_decay, steps_, grad_scale},
      multi_, grad_scale_at);
}

std::vector<std::pair<std::string, Tensor>> AdamW::state() {
  std::vector<std::pair<std::string, Tensor>> s;
  for (size_t i = 0; i < params_.size(); ++i) {
    s.emplace_back(params_[i]->name + ".exp_avg", m_[i]);
    s.emplace_back(params_[i]->name + ".exp_avg_sq", v_[i]);
  }
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
