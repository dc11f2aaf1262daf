// weft/ops.h: the optimizers' update kernels (AdamW, SGD, Lion).
#include "src/ops/dispatch.h"

namespace weft::ops {

// --- AdamW ---

void sgd(const Tensor& p, const Tensor& g, const Tensor& buf, float lr, float momentum,
         float weight_decay) {
  const Device d = common_device("sgd", {&p, &g, &buf});
  const int64_t n = p.numel();
  check_numel("sgd", "the gradient", g, n);
  check_numel("sgd", "the momentum buffer", buf, n);
  on_device(
      d, "sgd", [&] { cpu::sgd(fw(p), f(g), fw(buf), n, lr, momentum, weight_decay); },
      [&](auto& cx) { cuda::sgd(cx, fw(p), f(g), fw(buf), n, lr, momentum, weight_decay); });
}

namespace {
void check_grad_scale_at(const char* op, const Tensor& at, Device d) {
  if (!at.defined()) return;
  check_numel(op, "grad_scale_at", at, 1);
  check_dtype(op, "grad_scale_at", at, DType::F32);
  check(at.device() == d,
        "{}: grad_scale_at is on {}, the update on {}; every operand must be on one device", op,
        at.device().str(), d.str());
}
const float* scale_at(const Tensor& at) { return at.defined() ? f(at) : nullptr; }
}  // namespace

void lion(const Tensor& p, const Tensor& g, const Tensor& m, float lr, float beta1, float beta2,
          float weight_decay, float grad_scale, const Tensor& grad_scale_at) {
  const Device d = common_device("lion", {&p, &g, &m});
  const int64_t n = p.numel();
  check_numel("lion", "the gradient", g, n);
  check_numel("lion", "the momentum", m, n);
  check_grad_scale_at("lion", grad_scale_at, d);
  on_device(
      d, "lion",
      [&] {
        cpu::lion(fw(p), f(g), fw(m), n, lr, beta1, beta2, weight_decay,
                  grad_scale_at.defined() ? f(grad_scale_at)[0] : grad_scale);
      },
      [&](auto& cx) {
        cuda::lion(cx, fw(p), f(g), fw(m), n, lr, beta1, beta2, weight_decay, grad_scale,
                   scale_at(grad_scale_at));
      });
}

void adamw(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v,
           const AdamWStep& s, const Tensor& grad_scale_at) {
  const Device d = common_device("adamw", {&p, &g, &m, &v});
  const int64_t n = p.numel();
  check_numel("adamw", "the gradient", g, n);
  check_numel("adamw", "exp_avg", m, n);
  check_numel("adamw", "exp_avg_sq", v, n);
  check_grad_scale_at("adamw", grad_scale_at, d);
  on_device(
      d, "adamw",
      [&] {
        cpu::adamw(fw(p), f(g), fw(m), fw(v), n, s.lr, s.beta1, s.beta2, s.eps, s.weight_decay,
                   s.step, grad_scale_at.defined() ? f(grad_scale_at)[0] : s.grad_scale);
      },
      [&](auto& cx) {
        cuda::adamw(cx, fw(p), f(g), fw(m), fw(v), n, s.lr, s.beta1, s.beta2, s.eps,
                    s.weight_decay, s.step, s.grad_scale, scale_at(grad_scale_at));
      });
}

void adamw_multi(const std::vector<AdamWTensors>& ts, const AdamWStep& s,
                 std::shared_ptr<void>& cache, const Tensor& grad_scale_at) {
  if (ts.empty()) return;
  const Device d = common_device("adamw_multi", {&ts[0].p});
  for (const AdamWTensors& t : ts) {
    const int64_t n = t.p.numel();
    check(t.p.device() == d && t.g.device() == d && t.m.device() == d && t.v.device() == d,
          "adamw_multi: tensors on {} and {}; every operand must be on one device", d.str(),
          t.p.device().str());
    check_numel("adamw_multi", "the gradient", t.g, n);
    check_numel("adamw_multi", "exp_avg", t.m, n);
    check_numel("adamw_multi", "exp_avg_sq", t.v, n);
  }
  check_grad_scale_at("adamw_multi", grad_scale_at, d);
  on_device(
      d, "adamw_multi",
      [&] {
        for (const AdamWTensors& t : ts) {
          AdamWStep one = s;
          one.weight_decay = t.decay ? s.weight_decay : 0.0f;
          adamw(t.p, t.g, t.m, t.v, one, grad_scale_at);
        }
      },
      [&](auto& cx) {
        if (!cache) cache = std::make_shared<cuda::AdamWTable>();
        auto& table = *static_cast<cuda::AdamWTable*>(cache.get());
        table.scratch.clear();  // keeps its capacity
        for (const AdamWTensors& t : ts)
          table.scratch.push_back({fw(t.p), f(t.g), fw(t.m), fw(t.v), t.p.numel(), t.decay});
        cuda::adamw_multi(cx, table.scratch, table, s.lr, s.beta1, s.beta2, s.eps,
                          s.weight_decay, s.step, s.grad_scale, scale_at(grad_scale_at));
      });
}

}  // namespace weft::ops
