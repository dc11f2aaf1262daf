// weft/ops.h: LayerNorm (with the residual add fused) and RMSNorm.
#include "src/ops/dispatch.h"

namespace weft::ops {

// --- LayerNorm ---

void layernorm_forward(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& y,
                       const Tensor& mean, const Tensor& rstd, float eps) {
  if (any_bf16({&x, &w, &b, &y, &mean, &rstd})) {
    if (is_bf16(x) && is_bf16(y) && is_f32(w) && is_f32(b) && is_f32(mean) && is_f32(rstd) &&
        y.numel() == x.numel() &&
        on_gpu(common_device("layernorm_forward", {&x, &w, &b, &y, &mean, &rstd}),
               "layernorm_forward", [&](auto& cx) {
                 cuda::layernorm_forward(cx, b16(x), f(w), f(b), b16w(y), fw(mean), fw(rstd),
                                         x.shape().rows(), x.shape().last(), eps);
               }))
      return;
    Widen wd(__func__);
    layernorm_forward(wd.in(x), wd.in(w), wd.in(b), wd.out(y, false), wd.out(mean, false),
                      wd.out(rstd, false), eps);
    return wd.commit();
  }
  const Device d = common_device("layernorm_forward", {&x, &w, &b, &y, &mean, &rstd});
  const int64_t n = x.shape().rows(), c = x.shape().last();
  check_numel("layernorm_forward", "y", y, n * c);
  on_device(
      d, "layernorm_forward",
      [&] { cpu::layernorm_forward(f(x), f(w), f(b), fw(y), fw(mean), fw(rstd), n, c, eps); },
      [&](auto& cx) {
        cuda::layernorm_forward(cx, f(x), f(w), f(b), fw(y), fw(mean), fw(rstd), n, c, eps);
      });
}

void layernorm_backward_input(const Tensor& dy, const Tensor& x, const Tensor& w,
                              const Tensor& mean, const Tensor& rstd, const Tensor& dx) {
  if (any_bf16({&dy, &x, &w, &mean, &rstd, &dx})) {
    if (is_bf16(x) && is_bf16(dy) && is_f32(w) && is_bf16(dx) && is_f32(mean) && is_f32(rstd) &&
        dy.numel() == x.numel() && dx.numel() == x.numel() &&
        on_gpu(common_device("layernorm_backward_input", {&dy, &x, &w, &mean, &rstd, &dx}),
               "layernorm_backward_input", [&](auto& cx) {
                 cuda::layernorm_backward_input(cx, b16(dy), b16(x), f(w), f(mean), f(rstd),
                                                b16w(dx), x.shape().rows(), x.shape().last());
               }))
      return;
    Widen wd(__func__);
    layernorm_backward_input(wd.in(dy), wd.in(x), wd.in(w), wd.in(mean), wd.in(rstd),
                             wd.out(dx, true));
    return wd.commit();
  }
  const Device d = common_device("layernorm_backward_input", {&dy, &x, &w, &mean, &rstd, &dx});
  const int64_t n = x.shape().rows(), c = x.shape().last();
  on_device(
      d, "layernorm_backward_input",
      [&] {
        cpu::layernorm_backward_input(f(dy), f(x), f(w), f(mean), f(rstd), fw(dx), n, c);
      },
      [&](auto& cx) {
        cuda::layernorm_backward_input(cx, f(dy), f(x), f(w), f(mean), f(rstd), fw(dx), n, c);
      });
}

void layernorm_backward_weight(const Tensor& dy, const Tensor& x, const Tensor& mean,
                               const Tensor& rstd, const Tensor& dw, const Tensor& db) {
  if (any_bf16({&dy, &x, &mean, &rstd, &dw, &db})) {
    if (is_bf16(x) && is_bf16(dy) && is_f32(dw) && is_f32(db) && is_f32(mean) &&
        is_f32(rstd) && dy.numel() == x.numel() &&
        on_gpu(common_device("layernorm_backward_weight", {&dy, &x, &mean, &rstd, &dw, &db}),
               "layernorm_backward_weight", [&](auto& cx) {
                 cuda::layernorm_backward_weight(cx, b16(dy), b16(x), f(mean), f(rstd), fw(dw),
                                                 fw(db), x.shape().rows(), x.shape().last());
               }))
      return;
    Widen wd(__func__);
    layernorm_backward_weight(wd.in(dy), wd.in(x), wd.in(mean), wd.in(rstd), wd.out(dw, true),
                              wd.out(db, true));
    return wd.commit();
  }
  const Device d = common_device("layernorm_backward_weight", {&dy, &x, &mean, &rstd, &dw, &db});
  const int64_t n = x.shape().rows(), c = x.shape().last();
  on_device(
      d, "layernorm_backward_weight",
      [&] {
        cpu::layernorm_backward_weight(f(dy), f(x), f(mean), f(rstd), fw(dw), fw(db), n, c);
      },
      [&](auto& cx) {
        cuda::layernorm_backward_weight(cx, f(dy), f(x), f(mean), f(rstd), fw(dw), fw(db), n, c);
      });
}

void add_layernorm_forward(const Tensor& x, const Tensor& a, const Tensor& w, const Tensor& b,
                           const Tensor& sum, const Tensor& y, const Tensor& mean,
                           const Tensor& rstd, float eps) {
  const Device d =
      common_device("add_layernorm_forward", {&x, &a, &w, &b, &sum, &y, &mean, &rstd});
  const int64_t n = x.shape().rows(), c = x.shape().last();
  const DType dt = x.dtype();
  const bool one_kernel = !d.is_cpu() && (dt == DType::F32 || dt == DType::BF16) &&
                          a.dtype() == dt && sum.dtype() == dt && y.dtype() == dt && is_f32(w) &&
                          is_f32(b) && is_f32(mean) && is_f32(rstd) && a.numel() == n * c &&
                          sum.numel() == n * c && y.numel() == n * c && w.numel() == c &&
                          b.numel() == c && mean.numel() == n && rstd.numel() == n;
  if (one_kernel && on_device(
                        d, "add_layernorm_forward", [] { return false; },
                        [&](auto& cx) {
                          if (dt == DType::F32)
                            return cuda::add_layernorm_forward(cx, f(x), f(a), fw(sum), f(w),
                                                               f(b), fw(y), fw(mean), fw(rstd), n,
                                                               c, eps);
                          return cuda::add_layernorm_forward(cx, b16(x), b16(a), b16w(sum), f(w),
                                                             f(b), b16w(y), fw(mean), fw(rstd), n,
                                                             c, eps);
                        }))
    return;
  add(x, a, sum);
  layernorm_forward(sum, w, b, y, mean, rstd, eps);
}

void layernorm_backward_input_copy(const Tensor& dy, const Tensor& x, const Tensor& w,
                                   const Tensor& mean, const Tensor& rstd, const Tensor& dx,
                                   const Tensor& copy) {
  const Device d =
      common_device("layernorm_backward_input_copy", {&dy, &x, &w, &mean, &rstd, &dx, &copy});
  const int64_t n = x.shape().rows(), c = x.shape().last();
  const DType dt = x.dtype();
  const bool one_kernel = !d.is_cpu() && (dt == DType::F32 || dt == DType::BF16) &&
                          dy.dtype() == dt && dx.dtype() == dt && copy.dtype() == dt &&
                          is_f32(w) && is_f32(mean) && is_f32(rstd) && dy.numel() == n * c &&
                          dx.numel() == n * c && copy.numel() == n * c && w.numel() == c &&
                          mean.numel() == n && rstd.numel() == n;
  if (one_kernel && on_device(
                        d, "layernorm_backward_input_copy", [] { return false; },
                        [&](auto& cx) {
                          if (dt == DType::F32)
                            return cuda::layernorm_backward_input_copy(
                                cx, f(dy), f(x), f(w), f(mean), f(rstd), fw(dx), fw(copy), n, c);
                          return cuda::layernorm_backward_input_copy(cx, b16(dy), b16(x), f(w),
                                                                     f(mean), f(rstd), b16w(dx),
                                                                     b16w(copy), n, c);
                        }))
    return;
  layernorm_backward_input(dy, x, w, mean, rstd, dx);
  copy.copy_from(dx);
}

// --- RMSNorm, SwiGLU, rotary embedding ---

void rmsnorm_forward(const Tensor& x, const Tensor& w, const Tensor& y, const Tensor& rstd,
                     float eps) {
  if (any_bf16({&x, &w, &y, &rstd})) {
    if (is_bf16(x) && is_bf16(y) && is_f32(w) && is_f32(rstd) && y.numel() == x.numel() &&
        w.numel() == x.shape().last() && rstd.numel() == x.shape().rows() &&
        on_gpu(common_device("rmsnorm_forward", {&x, &w, &y, &rstd}), "rmsnorm_forward",
               [&](auto& cx) {
                 cuda::rmsnorm_forward(cx, b16(x), f(w), b16w(y), fw(rstd), x.shape().rows(),
                                       x.shape().last(), eps);
               }))
      return;
    Widen wd(__func__);
    rmsnorm_forward(wd.in(x), wd.in(w), wd.out(y, false), wd.out(rstd, false), eps);
    return wd.commit();
  }
  const Device d = common_device("rmsnorm_forward", {&x, &w, &y, &rstd});
  const int64_t n = x.shape().rows(), c = x.shape().last();
  check_numel("rmsnorm_forward", "y", y, n * c);
  check_numel("rmsnorm_forward", "the weight", w, c);
  on_device(
      d, "rmsnorm_forward", [&] { cpu::rmsnorm_forward(f(x), f(w), fw(y), fw(rstd), n, c, eps); },
      [&](auto& cx) { cuda::rmsnorm_forward(cx, f(x), f(w), fw(y), fw(rstd), n, c, eps); });
}

void rmsnorm_backward_input(const Tensor& dy, const Tensor& x, const Tensor& w,
                            const Tensor& rstd, const Tensor& dx) {
  if (any_bf16({&dy, &x, &w, &rstd, &dx})) {
    if (is_bf16(dy) && is_bf16(x) && is_bf16(dx) && is_f32(w) && is_f32(rstd) &&
        dy.numel() == x.numel() && dx.numel() == x.numel() && w.numel() == x.shape().last() &&
        rstd.numel() == x.shape().rows() &&
        on_gpu(common_device("rmsnorm_backward_input", {&dy, &x, &w, &rstd, &dx}),
               "rmsnorm_backward_input", [&](auto& cx) {
                 cuda::rmsnorm_backward_input(cx, b16(dy), b16(x), f(w), f(rstd), b16w(dx),
                                              x.shape().rows(), x.shape().last());
               }))
      return;
    Widen wd(__func__);
    rmsnorm_backward_input(wd.in(dy), wd.in(x), wd.in(w), wd.in(rstd), wd.out(dx, true));
    return wd.commit();
  }
  const Device d = common_device("rmsnorm_backward_input", {&dy, &x, &w, &rstd, &dx});
  const int64_t n = x.shape().rows(), c = x.shape().last();
  on_device(
      d, "rmsnorm_backward_input",
      [&] { cpu::rmsnorm_backward_input(f(dy), f(x), f(w), f(rstd), fw(dx), n, c); },
      [&](auto& cx) {
        cuda::rmsnorm_backward_input(cx, f(dy), f(x), f(w), f(rstd), fw(dx), n, c);
      });
}

void rmsnorm_backward_weight(const Tensor& dy, const Tensor& x, const Tensor& rstd,
                             const Tensor& dw) {
  if (any_bf16({&dy, &x, &rstd, &dw})) {
    if (is_bf16(dy) && is_bf16(x) && is_f32(rstd) && is_f32(dw) && dy.numel() == x.numel() &&
        dw.numel() == x.shape().last() && rstd.numel() == x.shape().rows() &&
        on_gpu(common_device("rmsnorm_backward_weight", {&dy, &x, &rstd, &dw}),
               "rmsnorm_backward_weight", [&](auto& cx) {
                 cuda::rmsnorm_backward_weight(cx, b16(dy), b16(x), f(rstd), fw(dw),
                                               x.shape().rows(), x.shape().last());
               }))
      return;
    Widen wd(__func__);
    rmsnorm_backward_weight(wd.in(dy), wd.in(x), wd.in(rstd), wd.out(dw, true));
    return wd.commit();
  }
  const Device d = common_device("rmsnorm_backward_weight", {&dy, &x, &rstd, &dw});
  const int64_t n = x.shape().rows(), c = x.shape().last();
  on_device(
      d, "rmsnorm_backward_weight",
      [&] { cpu::rmsnorm_backward_weight(f(dy), f(x), f(rstd), fw(dw), n, c); },
      [&](auto& cx) { cuda::rmsnorm_backward_weight(cx, f(dy), f(x), f(rstd), fw(dw), n, c); });
}

}  // namespace weft::ops
