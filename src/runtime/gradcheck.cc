#include <weft/arena.h>
#include <weft/error.h>
#include <weft/gradcheck.h>
#include <weft/param.h>

#include <fmt/core.h>
#include <fmt/ranges.h>

#include <cmath>
#include <memory>
#include <random>

namespace weft {

namespace {

// One pass of the layer: its arena, ctx and tensors.
struct Pass {
  Arena arena;
  std::unique_ptr<LayerCtx> ctx;
  std::vector<Tensor> in, out;
};

std::unique_ptr<Pass> run_forward(Layer& layer, const std::vector<Tensor>& inputs) {
  auto p = std::make_unique<Pass>();
  std::vector<Shape> shapes;
  for (const Tensor& t : inputs) {
    Tensor a = p->arena.alloc(t.shape(), t.dtype());
    a.copy_from(t);
    p->in.push_back(a);
    shapes.push_back(t.shape());
  }
  const std::vector<Shape> os = layer.output_shapes(shapes);
  const std::vector<DType> od = layer.output_dtypes(shapes);
  for (size_t k = 0; k < os.size(); ++k) p->out.push_back(p->arena.zeros(os[k], od[k]));
  p->ctx = layer.make_ctx();
  layer.forward(*p->ctx, p->arena, p->in, p->out);
  return p;
}

double value_at(const Tensor& t, int64_t i) { return t.data<float>()[i]; }

}  // namespace

std::string GradCheck::describe() const {
  if (worst.empty()) return "nothing to differentiate: no F32 input and no parameter";
  return fmt::format("{}: the worst is {} at {:.2e} relative, {} element{} off ({})",
                     ok() ? "gradients match finite differences"
                          : "gradients do not match finite differences",
                     worst, rel_error, bad, bad == 1 ? "" : "s", compared);
}

GradCheck check_gradients(Layer& layer, const std::vector<Tensor>& inputs, uint64_t seed,
                          double eps) {
  for (const Tensor& t : inputs)
    check(t.device().is_cpu(), "check_gradients: an input is on {}; give host tensors",
          t.device().str());
  // d L / d out: fixed uniform weights.
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  std::vector<Tensor> r;
  {
    auto p = run_forward(layer, inputs);
    for (const Tensor& o : p->out) {
      check(o.dtype() == DType::F32, "check_gradients: {} has an output of dtype {}; F32 only",
            layer.kind(), dtype_name(o.dtype()));
      Tensor w = Tensor::empty(o.shape());
      for (int64_t i = 0; i < w.numel(); ++i) w.data<float>()[i] = uni(rng);
      r.push_back(w);
    }
  }
  auto loss = [&](const std::vector<Tensor>& in) {
    auto p = run_forward(layer, in);
    double l = 0;
    for (size_t k = 0; k < p->out.size(); ++k)
      for (int64_t i = 0; i < p->out[k].numel(); ++i) l += value_at(r[k], i) * value_at(p->out[k], i);
    return l;
  };
  // The analytic gradients.
  for (Param* q : layer.params()) q->grad.zero_();
  auto p = run_forward(layer, inputs);
  std::vector<Tensor> grad_out, grad_in;
  for (const Tensor& w : r) {
    Tensor g = p->arena.alloc(w.shape());
    g.copy_from(w);
    grad_out.push_back(g);
  }
  for (const Tensor& t : p->in)
    grad_in.push_back(t.dtype() == DType::F32 ? p->arena.zeros(t.shape()) : Tensor());
  layer.backward_input(*p->ctx, p->arena, grad_out, grad_in);
  layer.backward_weight(*p->ctx, p->arena);
  // Central differences over every element of `x` (an input or a
  // parameter's value), with the step fp32 can represent.
  std::vector<Tensor> in = inputs;
  auto numeric = [&](const Tensor& x) {
    Tensor g = Tensor::zeros(x.shape());
    float* v = x.data<float>();
    for (int64_t i = 0; i < x.numel(); ++i) {
      const float orig = v[i];
      const float up = orig + static_cast<float>(eps), down = orig - static_cast<float>(eps);
      v[i] = up;
      const double lp = loss(in);
      v[i] = down;
      const double lm = loss(in);
      v[i] = orig;
      g.data<float>()[i] = static_cast<float>((lp - lm) / (double(up) - double(down)));
    }
    return g;
  };
  GradCheck out;
  std::vector<std::string> compared;
  auto compare = [&](const Tensor& analytic, const Tensor& num, const std::string& what) {
    double diff = 0, norm = 0;
    for (int64_t i = 0; i < num.numel(); ++i) {
      const double a = value_at(analytic, i), n = value_at(num, i);
      diff += (a - n) * (a - n);
      norm += n * n;
      if (!(std::abs(n - a) <= 5e-4 + 5e-3 * std::abs(a))) ++out.bad;
    }
    const double rel = norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
    if (out.worst.empty() || rel > out.rel_error) out.worst = what, out.rel_error = rel;
    compared.push_back(fmt::format("{} ({} elements)", what, num.numel()));
  };
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i].dtype() != DType::F32) continue;
    in[i] = inputs[i].clone();  // perturbed in place: the caller's stays as it was
    compare(grad_in[i], numeric(in[i]), fmt::format("input {}", i));
  }
  for (Param* q : layer.params()) {
    const Tensor analytic = q->grad.clone();
    compare(analytic, numeric(q->value), q->name);
  }
  out.compared = fmt::format("{}", fmt::join(compared, ", "));
  return out;
}

}  // namespace weft
