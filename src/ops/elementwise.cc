// weft/ops.h: element-wise operations, reductions, the multi-tensor norm
// and scale of the gradients, GELU and SwiGLU.
#include "src/ops/dispatch.h"

namespace weft::ops {

// --- element-wise ---

void add(const Tensor& y, const Tensor& x) {
  if (any_bf16({&y, &x})) {
    if (is_bf16(y) && x.numel() == y.numel() &&
        on_gpu(common_device("add", {&y, &x}), "add", [&](auto& cx) {
          if (is_bf16(x))
            cuda::add_inplace(cx, b16w(y), b16(x), y.numel());
          else
            cuda::add_inplace(cx, b16w(y), f(x), y.numel());
        }))
      return;
    Widen wd(__func__);
    add(wd.out(y, true), wd.in(x));
    return wd.commit();
  }
  const Device d = common_device("add", {&y, &x});
  check_numel("add", "x", x, y.numel());
  on_device(
      d, "add", [&] { cpu::add_inplace(fw(y), f(x), y.numel()); },
      [&](auto& cx) { cuda::add_inplace(cx, fw(y), f(x), y.numel()); });
}

void add(const Tensor& a, const Tensor& b, const Tensor& y) {
  const Device d = common_device("add", {&a, &b, &y});
  check_numel("add", "a", a, y.numel());
  check_numel("add", "b", b, y.numel());
  const bool same = a.dtype() == y.dtype() && b.dtype() == y.dtype();
  if (same && (is_f32(y) || is_bf16(y)) && on_gpu(d, "add", [&](auto& cx) {
        if (is_f32(y))
          cuda::add(cx, f(a), f(b), fw(y), y.numel());
        else
          cuda::add(cx, b16(a), b16(b), b16w(y), y.numel());
      }))
    return;
  if (y.raw() == b.raw()) return add(y, a);  // fp32 addition commutes, bit for bit
  y.copy_from(a);
  add(y, b);
}

void scale(const Tensor& y, float s) {
  if (any_bf16({&y})) {
    Widen wd(__func__);
    scale(wd.out(y, true), s);
    return wd.commit();
  }
  const Device d = common_device("scale", {&y});
  on_device(
      d, "scale", [&] { cpu::scale_inplace(fw(y), s, y.numel()); },
      [&](auto& cx) { cuda::scale_inplace(cx, fw(y), s, y.numel()); });
}

void add_scaled(const Tensor& y, const Tensor& x, float s) {
  check_dtype("add_scaled", "x", x, DType::F32);
  check_numel("add_scaled", "x", x, y.numel());
  if (any_bf16({&y})) {
    if (on_gpu(common_device("add_scaled", {&y, &x}), "add_scaled",
               [&](auto& cx) { cuda::add_scaled(cx, b16w(y), f(x), s, y.numel()); }))
      return;
    Widen wd(__func__);
    add_scaled(wd.out(y, true), x, s);
    return wd.commit();
  }
  const Device d = common_device("add_scaled", {&y, &x});
  on_device(
      d, "add_scaled", [&] { cpu::add_scaled(fw(y), f(x), s, y.numel()); },
      [&](auto& cx) { cuda::add_scaled(cx, fw(y), f(x), s, y.numel()); });
}

double sum_squares(const Tensor& x) {
  if (any_bf16({&x})) {
    Widen wd(__func__);
    const double r = sum_squares(wd.in(x));
    wd.commit();
    return r;
  }
  const Device d = common_device("sum_squares", {&x});
  return on_device(
      d, "sum_squares", [&] { return cpu::sum_squares(f(x), x.numel()); },
      [&](auto& cx) { return cuda::sum_squares_to_host(cx, f(x), x.numel()); });
}

double sum(const Tensor& x) {
  if (any_bf16({&x})) {
    Widen wd(__func__);
    return sum(wd.in(x));
  }
  const Device d = common_device("sum", {&x});
  return on_device(
      d, "sum",
      [&] {
        double s = 0;
        const float* p = f(x);
        for (int64_t i = 0; i < x.numel(); ++i) s += p[i];
        return s;
      },
      [&](auto& cx) { return cuda::sum_to_host(cx, f(x), x.numel()); });
}

namespace {
// The device of a multi-tensor call, once every tensor is checked: fp32 (a
// bf16 one has no caller: gradients are fp32), defined, and on the device of
// the others that hold elements. No elements at all: the CPU.
Device multi_device(const char* op, const std::vector<Tensor>& xs) {
  const Tensor* first = nullptr;
  for (size_t i = 0; i < xs.size(); ++i) {
    const Tensor& x = xs[i];
    check(x.defined(), "{}: tensor {} of {} {} has no storage", op, i, xs.size(),
          x.shape().str());
    check(x.dtype() == DType::F32, "{}: tensor {} of {} {} is {}; every tensor must be F32", op,
          i, xs.size(), x.shape().str(), dtype_name(x.dtype()));
    if (x.raw() == nullptr) continue;
    if (first == nullptr) first = &x;
    check(x.device() == first->device(),
          "{}: tensors on {} and {}; every operand must be on one device", op,
          first->device().str(), x.device().str());
  }
  return first != nullptr ? first->device() : Device::cpu();
}

// The device table of sum_squares_multi and scale_multi, made on the first
// call, with this call's tensors in its scratch list. A template, as the CUDA
// branches are, so that a build without CUDA never instantiates it.
template <typename Table = cuda::MultiTensorTable>
Table& multi_table(std::shared_ptr<void>& cache, const std::vector<Tensor>& xs) {
  if (!cache) cache = std::make_shared<Table>();
  auto& table = *static_cast<Table*>(cache.get());
  table.scratch.clear();  // keeps its capacity
  for (const Tensor& x : xs) table.scratch.push_back({fw(x), x.numel()});
  return table;
}
}  // namespace

double sum_squares_multi(const std::vector<Tensor>& xs, std::shared_ptr<void>& cache) {
  const Device d = multi_device("sum_squares_multi", xs);
  return on_device(
      d, "sum_squares_multi",
      [&] {
        double s = 0;  // in order, as a loop over sum_squares adds them
        for (const Tensor& x : xs) s += cpu::sum_squares(f(x), x.numel());
        return s;
      },
      [&](auto& cx) {
        cuda::MultiTensorTable& table = multi_table(cache, xs);
        return cuda::sum_squares_multi(cx, table.scratch, table);
      });
}

void sum_squares_multi(const std::vector<Tensor>& xs, std::shared_ptr<void>& cache,
                       const Tensor& out) {
  check_numel("sum_squares_multi", "out", out, 1);
  check_dtype("sum_squares_multi", "out", out, DType::F32);
  const Device d = xs.empty() ? out.device() : multi_device("sum_squares_multi", xs);
  check(xs.empty() || out.device() == d,
        "sum_squares_multi: the tensors are on {}, out on {}; every operand must be on one device",
        d.str(), out.device().str());
  on_device(
      d, "sum_squares_multi",
      [&] { fw(out)[0] = static_cast<float>(sum_squares_multi(xs, cache)); },
      [&](auto& cx) {
        cuda::MultiTensorTable& table = multi_table(cache, xs);
        cuda::sum_squares_multi(cx, table.scratch, table, fw(out));
      });
}

void scale_multi(const std::vector<Tensor>& xs, const Tensor& s, std::shared_ptr<void>& cache) {
  check_numel("scale_multi", "the scale", s, 1);
  check_dtype("scale_multi", "the scale", s, DType::F32);
  const Device d = multi_device("scale_multi", xs);
  if (xs.empty() || d != s.device()) {
    check(xs.empty(), "scale_multi: the tensors are on {}, the scale on {}; every operand must be "
                      "on one device", d.str(), s.device().str());
    return;
  }
  on_device(
      d, "scale_multi", [&] { scale_multi(xs, f(s)[0], cache); },
      [&](auto& cx) {
        cuda::MultiTensorTable& table = multi_table(cache, xs);
        cuda::scale_multi(cx, table.scratch, 1.0f, table, f(s));
      });
}

void clip_coefficient(const Tensor& sum_squares, double max_norm, const Tensor& coef) {
  check_numel("clip_coefficient", "the sum of squares", sum_squares, 1);
  check_numel("clip_coefficient", "the coefficient", coef, 1);
  check_dtype("clip_coefficient", "the sum of squares", sum_squares, DType::F32);
  check_dtype("clip_coefficient", "the coefficient", coef, DType::F32);
  const Device d = common_device("clip_coefficient", {&sum_squares, &coef});
  on_device(
      d, "clip_coefficient",
      [&] {
        fw(coef)[0] = weft::clip_coefficient(
            max_norm, std::sqrt(static_cast<double>(f(sum_squares)[0])));
      },
      [&](auto& cx) { cuda::clip_coefficient(cx, f(sum_squares), max_norm, fw(coef)); });
}

void scale_multi(const std::vector<Tensor>& xs, float s, std::shared_ptr<void>& cache) {
  const Device d = multi_device("scale_multi", xs);
  on_device(
      d, "scale_multi",
      [&] {
        for (const Tensor& x : xs) cpu::scale_inplace(fw(x), s, x.numel());
      },
      [&](auto& cx) {
        cuda::MultiTensorTable& table = multi_table(cache, xs);
        cuda::scale_multi(cx, table.scratch, s, table);
      });
}

void sum(const Tensor& x, const Tensor& out) {
  check_numel("sum", "out", out, 1);
  check_dtype("sum", "out", out, DType::F32);
  if (any_bf16({&x})) {
    Widen wd(__func__);
    return sum(wd.in(x), out);
  }
  const Device d = common_device("sum", {&x, &out});
  on_device(
      d, "sum", [&] { fw(out)[0] = static_cast<float>(sum(x)); },
      [&](auto& cx) { cuda::sum(cx, f(x), x.numel(), fw(out)); });
}

float item(const Tensor& t) {
  check_numel("item", "the tensor", t, 1);
  check_dtype("item", "the tensor", t, DType::F32);
  return on_device(
      t.device(), "item", [&] { return f(t)[0]; },
      [&](auto& cx) {
        float v = 0;
        cuda::download(cx, &v, t.raw(), sizeof v);
        return v;
      });
}

void set_item(const Tensor& t, float value) {
  check_numel("set_item", "the tensor", t, 1);
  check_dtype("set_item", "the tensor", t, DType::F32);
  on_device(
      t.device(), "set_item", [&] { fw(t)[0] = value; },
      [&](auto& cx) { cuda::upload(cx, t.raw(), &value, sizeof value); });
}

void fill(const Tensor& t, float value) {
  check(t.dtype() == DType::F32 || t.dtype() == DType::BF16,
        "fill: the tensor must be F32 or BF16, got {}", dtype_name(t.dtype()));
  if (t.dtype() == DType::BF16) {  // the value rounded once
    const uint16_t bits = to_bf16(value);
    on_device(
        t.device(), "fill", [&] { std::fill_n(t.data<uint16_t>(), t.numel(), bits); },
        [&](auto& cx) { cuda::fill16(cx, t.data<uint16_t>(), bits, t.numel()); });
    return;
  }
  on_device(
      t.device(), "fill", [&] { std::fill_n(fw(t), t.numel(), value); },
      [&](auto& cx) {
        if (value == 0.0f) {
          cuda::zero(cx, t.raw(), t.nbytes());
        } else {
          uint32_t bits;
          std::memcpy(&bits, &value, sizeof bits);
          cuda::fill32(cx, static_cast<uint32_t*>(t.raw()), bits, t.numel());
        }
      });
}

void swiglu_forward(const Tensor& x, const Tensor& y) {
  if (any_bf16({&x, &y})) {
    if (is_bf16(x) && is_bf16(y) && x.shape().last() % 2 == 0 && 2 * y.numel() == x.numel() &&
        on_gpu(common_device("swiglu_forward", {&x, &y}), "swiglu_forward", [&](auto& cx) {
          cuda::swiglu_forward(cx, b16(x), b16w(y), x.shape().rows(), x.shape().last() / 2);
        }))
      return;
    Widen wd(__func__);
    swiglu_forward(wd.in(x), wd.out(y, false));
    return wd.commit();
  }
  const Device d = common_device("swiglu_forward", {&x, &y});
  const int64_t n = x.shape().rows(), h = x.shape().last() / 2;
  check(x.shape().last() % 2 == 0, "swiglu_forward: the input width {} must be even (gate | up)",
        x.shape().last());
  check_numel("swiglu_forward", "y", y, n * h);
  on_device(
      d, "swiglu_forward", [&] { cpu::swiglu_forward(f(x), fw(y), n, h); },
      [&](auto& cx) { cuda::swiglu_forward(cx, f(x), fw(y), n, h); });
}

void swiglu_backward(const Tensor& dy, const Tensor& x, const Tensor& dx) {
  if (any_bf16({&dy, &x, &dx})) {
    if (is_bf16(dy) && is_bf16(x) && is_bf16(dx) && x.shape().last() % 2 == 0 &&
        2 * dy.numel() == x.numel() && dx.numel() == x.numel() &&
        on_gpu(common_device("swiglu_backward", {&dy, &x, &dx}), "swiglu_backward",
               [&](auto& cx) {
                 cuda::swiglu_backward(cx, b16(dy), b16(x), b16w(dx), x.shape().rows(),
                                       x.shape().last() / 2);
               }))
      return;
    Widen wd(__func__);
    swiglu_backward(wd.in(dy), wd.in(x), wd.out(dx, true));
    return wd.commit();
  }
  const Device d = common_device("swiglu_backward", {&dy, &x, &dx});
  const int64_t n = x.shape().rows(), h = x.shape().last() / 2;
  check_numel("swiglu_backward", "dx", dx, x.numel());
  on_device(
      d, "swiglu_backward", [&] { cpu::swiglu_backward(f(dy), f(x), fw(dx), n, h); },
      [&](auto& cx) { cuda::swiglu_backward(cx, f(dy), f(x), fw(dx), n, h); });
}

// --- GELU ---

void gelu_forward(const Tensor& x, const Tensor& y) {
  if (any_bf16({&x, &y})) {
    if (is_bf16(x) && is_bf16(y) && y.numel() == x.numel() &&
        on_gpu(common_device("gelu_forward", {&x, &y}), "gelu_forward",
               [&](auto& cx) { cuda::gelu_forward(cx, b16(x), b16w(y), x.numel()); }))
      return;
    Widen wd(__func__);
    gelu_forward(wd.in(x), wd.out(y, false));
    return wd.commit();
  }
  const Device d = common_device("gelu_forward", {&x, &y});
  check_numel("gelu_forward", "y", y, x.numel());
  on_device(
      d, "gelu_forward", [&] { cpu::gelu_forward(f(x), fw(y), x.numel()); },
      [&](auto& cx) { cuda::gelu_forward(cx, f(x), fw(y), x.numel()); });
}

void gelu_backward(const Tensor& dy, const Tensor& x, const Tensor& dx, bool accumulate) {
  if (any_bf16({&dy, &x, &dx})) {
    if (is_bf16(x) && is_bf16(dy) && is_bf16(dx) && dx.numel() == x.numel() &&
        dy.numel() == x.numel() &&
        on_gpu(common_device("gelu_backward", {&dy, &x, &dx}), "gelu_backward",
               [&](auto& cx) {
                 cuda::gelu_backward(cx, b16(dy), b16(x), b16w(dx), x.numel(), accumulate);
               }))
      return;
    Widen wd(__func__);
    gelu_backward(wd.in(dy), wd.in(x), wd.out(dx, accumulate), accumulate);
    return wd.commit();
  }
  const Device d = common_device("gelu_backward", {&dy, &x, &dx});
  check_numel("gelu_backward", "dx", dx, x.numel());
  on_device(
      d, "gelu_backward", [&] { cpu::gelu_backward(f(dy), f(x), fw(dx), x.numel(), accumulate); },
      [&](auto& cx) { cuda::gelu_backward(cx, f(dy), f(x), fw(dx), x.numel(), accumulate); });
}

}  // namespace weft::ops
