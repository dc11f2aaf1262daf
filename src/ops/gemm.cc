// weft/ops.h: GEMMs (with their fused bias, GELU and bias-gradient epilogues)
// and the row operations of the linear layers.
#include "src/ops/dispatch.h"

namespace weft::ops {

// --- matrices ---

namespace {
// t itself if it is bf16, else its values rounded into a new bf16 tensor
// (what a GEMM with bf16 inputs does to an fp32 operand).
Tensor as_bf16(const Tensor& t) {
  if (is_bf16(t)) return t;
  Tensor h = Tensor::empty(t.shape(), DType::BF16, t.device());
  convert(t, h);
  return h;
}
}  // namespace

void gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c,
          float alpha, float beta) {
  const Device d = common_device("gemm", {&a, &b, &c});
  const int64_t ar = a.shape().rows(), ac = a.shape().last();
  const int64_t br = b.shape().rows(), bc = b.shape().last();
  const int64_t m = trans_a ? ac : ar, k = trans_a ? ar : ac;
  const int64_t kb = trans_b ? bc : br, n = trans_b ? br : bc;
  check(k == kb && c.shape().rows() == m && c.shape().last() == n,
        "gemm: op(a) is ({}, {}), op(b) ({}, {}), c {}: the shapes do not chain", m, k, kb, n,
        c.shape().str());
  if (any_bf16({&a, &b, &c})) {
    // bf16 a and b are cuBLAS's own types (fp32 accumulation, c fp32 or
    // rounded once); any other mix is widened, which is exact.
    // One bf16 operand and one fp32 one on a GPU whose GEMMs round their
    // inputs to bf16 (--bf16): rounding the fp32 one first is what the GEMM
    // would do to it, and halves what the GEMM reads (a weight gradient's
    // dy, with x bf16). Only where it is the smaller one: the LM head's
    // dlogits (N, V) against its x (N, C) is cheaper to leave and widen x.
    if (!d.is_cpu() && matmul_precision(d) == MatmulPrecision::Bf16 &&
        is_bf16(a) != is_bf16(b) && (is_f32(a) || is_f32(b)) &&
        (is_bf16(a) ? b : a).numel() <= (is_bf16(a) ? a : b).numel()) {
      const Tensor& wide = is_bf16(a) ? b : a;
      {
        std::lock_guard lock(widened_mu());
        ++widened_counts()["gemm (an fp32 operand rounded to bf16)"];
      }
      const Tensor narrow = as_bf16(wide);
      return is_bf16(a) ? gemm(a, trans_a, narrow, trans_b, c, alpha, beta)
                        : gemm(narrow, trans_a, b, trans_b, c, alpha, beta);
    }
    if (is_bf16(a) && is_bf16(b) &&
        on_gpu(d, "gemm", [&](auto& cx) {
          if (is_bf16(c))
            cuda::gemm_bf16_out(cx, trans_a, trans_b, m, n, k, alpha, b16(a), ac, b16(b), bc,
                                beta, b16w(c), n);
          else
            cuda::gemm_bf16(cx, trans_a, trans_b, m, n, k, alpha, b16(a), ac, b16(b), bc, beta,
                            fw(c), n);
        }))
      return;
    if (d.is_cpu() && cpu_rounding() == cpu::Rounding::Bf16 &&
        cpu::bf16_gemm() == cpu::Bf16Gemm::OneDnn) {
      // oneDNN's bf16 matmul reads bf16 operands as they are; an fp32 one is
      // rounded first, as the emulation would round it.
      const Tensor ha = as_bf16(a), hb = as_bf16(b);
      Widen wd(__func__);
      const Tensor wc = wd.out(c, beta != 0.0f);
      cpu::gemm_bf16(trans_a, trans_b, m, n, k, alpha, ha.data<uint16_t>(), ac, hb.data<uint16_t>(),
                     bc, beta, fw(wc), n);
      return wd.commit();
    }
    Widen wd(__func__);
    const Tensor wa = wd.in(a), wb = wd.in(b), wc = wd.out(c, beta != 0.0f);
    if (d.is_cpu()) {
      // A widened bf16 operand holds bf16 values already: rounding it to
      // bf16 again would change nothing, so only an fp32 one is rounded.
      const cpu::Rounding r = cpu_rounding();
      auto rounding = [&](const Tensor& t) {
        return is_bf16(t) && r == cpu::Rounding::Bf16 ? cpu::Rounding::None : r;
      };
      cpu::gemm_rounded(rounding(a), rounding(b), trans_a, trans_b, m, n, k, alpha, f(wa), ac,
                        f(wb), bc, beta, fw(wc), n);
    } else {
      gemm(wa, trans_a, wb, trans_b, wc, alpha, beta);
    }
    return wd.commit();
  }
  on_device(
      d, "gemm",
      [&] {
        cpu::gemm_rounded(cpu_rounding(), trans_a, trans_b, m, n, k, alpha, f(a), ac, f(b), bc,
                          beta, fw(c), n);
      },
      [&](auto& cx) {
        cuda::gemm(cx, math_mode(d), trans_a, trans_b, m, n, k, alpha, f(a), ac, f(b), bc, beta,
                   fw(c), n);
      });
}

void gemm_bias(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& bias,
               const Tensor& c) {
  const Device d = common_device("gemm_bias", {&a, &b, &bias, &c});
  const int64_t ar = a.shape().rows(), ac = a.shape().last();
  const int64_t br = b.shape().rows(), bc = b.shape().last();
  const int64_t m = trans_a ? ac : ar, k = trans_a ? ar : ac;
  const int64_t kb = trans_b ? bc : br, n = trans_b ? br : bc;
  check(k == kb && c.shape().rows() == m && c.shape().last() == n,
        "gemm_bias: op(a) is ({}, {}), op(b) ({}, {}), c {}: the shapes do not chain", m, k, kb,
        n, c.shape().str());
  check_numel("gemm_bias", "bias", bias, n);
  const bool fp32 = is_f32(a) && is_f32(b) && is_f32(bias) && is_f32(c);
  const bool bf16 = is_bf16(a) && is_bf16(b) && is_bf16(c);  // the bias either dtype
  if ((fp32 || bf16) && on_gpu(d, "gemm_bias", [&](auto& cx) {
        if (fp32) {
          cuda::gemm_bias(cx, math_mode(d), trans_a, trans_b, m, n, k, f(a), ac, f(b), bc,
                          f(bias), fw(c), n);
          return;
        }
        // An fp32 bias is rounded as fill_rows rounds it into a bf16 c (a
        // training step's biases come rounded already: Param::value16).
        Tensor bias16 = bias;
        if (is_f32(bias)) {
          bias16 = Tensor::empty(bias.shape(), DType::BF16, d);
          convert(bias, bias16);
        }
        cuda::gemm_bias_bf16(cx, trans_a, trans_b, m, n, k, b16(a), ac, b16(b), bc, b16(bias16),
                             b16w(c), n);
      }))
    return;
  fill_rows(c, bias);
  gemm(a, trans_a, b, trans_b, c, 1.0f, 1.0f);
}

namespace {
// The (m, n) of C = op(a) op(b), checked against c's shape.
std::pair<int64_t, int64_t> product_shape(const char* name, const Tensor& a, bool trans_a,
                                          const Tensor& b, bool trans_b, const Tensor& c) {
  const int64_t ar = a.shape().rows(), ac = a.shape().last();
  const int64_t br = b.shape().rows(), bc = b.shape().last();
  const int64_t m = trans_a ? ac : ar, k = trans_a ? ar : ac;
  const int64_t kb = trans_b ? bc : br, n = trans_b ? br : bc;
  check(k == kb && c.shape().rows() == m && c.shape().last() == n,
        "{}: op(a) is ({}, {}), op(b) ({}, {}), the output {}: the shapes do not chain", name, m,
        k, kb, n, c.shape().str());
  return {m, n};
}
}  // namespace

void gemm_bias_gelu(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b,
                    const Tensor& bias, const Tensor& pre, const Tensor& y) {
  const Device d = common_device("gemm_bias_gelu", {&a, &b, &bias, &pre, &y});
  const auto [m, n] = product_shape("gemm_bias_gelu", a, trans_a, b, trans_b, pre);
  check(y.shape() == pre.shape() && y.dtype() == pre.dtype(),
        "gemm_bias_gelu: the GELU's output {} {} must match its input {} {}", dtype_name(y.dtype()),
        y.shape().str(), dtype_name(pre.dtype()), pre.shape().str());
  check_numel("gemm_bias_gelu", "bias", bias, n);
  if (is_bf16(a) && is_bf16(b) && is_bf16(pre) && is_bf16(y) &&
      on_gpu(d, "gemm_bias_gelu", [&](auto& cx) {
        Tensor bias16 = bias;  // rounded as gemm_bias rounds an fp32 bias
        if (is_f32(bias)) {
          bias16 = Tensor::empty(bias.shape(), DType::BF16, d);
          convert(bias, bias16);
        }
        const int64_t k = trans_a ? a.shape().rows() : a.shape().last();
        cuda::gemm_bias_gelu_bf16(cx, trans_a, trans_b, m, n, k, b16(a), a.shape().last(), b16(b),
                                  b.shape().last(), b16(bias16), b16w(pre), b16w(y));
      }))
    return;
  gemm_bias(a, trans_a, b, trans_b, bias, pre);
  gelu_forward(pre, y);
}

void gemm_dgelu(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& pre,
                const Tensor& dx) {
  const Device d = common_device("gemm_dgelu", {&a, &b, &pre, &dx});
  const auto [m, n] = product_shape("gemm_dgelu", a, trans_a, b, trans_b, dx);
  check(pre.shape() == dx.shape(),
        "gemm_dgelu: the GELU's input {} must have its gradient's shape {}",
        pre.shape().str(), dx.shape().str());
  if (is_bf16(a) && is_bf16(b) && is_bf16(pre) && is_bf16(dx) &&
      on_gpu(d, "gemm_dgelu", [&](auto& cx) {
        const int64_t k = trans_a ? a.shape().rows() : a.shape().last();
        cuda::gemm_dgelu_bf16(cx, trans_a, trans_b, m, n, k, b16(a), a.shape().last(), b16(b),
                              b.shape().last(), b16(pre), b16w(dx));
      }))
    return;
  gemm(a, trans_a, b, trans_b, dx, 1.0f, 0.0f);
  gelu_backward(dx, pre, dx, false);
}

void gemm_bias_grad(const Tensor& a, bool trans_a, const Tensor& b, const Tensor& c, float beta,
                    const Tensor& db) {
  const Device d = common_device("gemm_bias_grad", {&a, &b, &c, &db});
  const auto [m, n] = product_shape("gemm_bias_grad", a, trans_a, b, false, c);
  check_numel("gemm_bias_grad", "db", db, n);
  bool fused = false;
  if (is_bf16(a) && is_bf16(b) && is_f32(c) && is_f32(db))
    on_gpu(d, "gemm_bias_grad", [&](auto& cx) {
      const Tensor part = Tensor::empty(db.shape(), DType::F32, d);  // written by the epilogue
      const int64_t k = trans_a ? a.shape().rows() : a.shape().last();
      fused = cuda::gemm_bf16_bias_grad(cx, trans_a, m, n, k, b16(a), a.shape().last(), b16(b),
                                        n, beta, fw(c), n, fw(part));
      if (fused) cuda::add_inplace(cx, fw(db), f(part), n);
    });
  if (fused) return;
  gemm(a, trans_a, b, false, c, 1.0f, beta);
  sum_rows(b, db);
}

void fill_rows(const Tensor& y, const Tensor& row) {
  if (any_bf16({&y, &row})) {
    if (is_bf16(y) && is_f32(row) && y.shape().last() == row.numel() &&
        on_gpu(common_device("fill_rows", {&y, &row}), "fill_rows", [&](auto& cx) {
          cuda::fill_rows(cx, b16w(y), f(row), y.shape().rows(), y.shape().last());
        }))
      return;
    Widen wd(__func__);
    fill_rows(wd.out(y, false), wd.in(row));
    return wd.commit();
  }
  const Device d = common_device("fill_rows", {&y, &row});
  const int64_t n = y.shape().rows(), c = y.shape().last();
  check_numel("fill_rows", "row", row, c);
  on_device(
      d, "fill_rows", [&] { cpu::fill_rows(fw(y), f(row), n, c); },
      [&](auto& cx) {
        cuda::zero(cx, y.raw(), y.nbytes());
        cuda::add_bias(cx, fw(y), f(row), n, c);
      });
}

void add_rows(const Tensor& y, const Tensor& row) {
  if (any_bf16({&y, &row})) {
    Widen wd(__func__);
    add_rows(wd.out(y, true), wd.in(row));
    return wd.commit();
  }
  const Device d = common_device("add_rows", {&y, &row});
  const int64_t n = y.shape().rows(), c = y.shape().last();
  check_numel("add_rows", "row", row, c);
  on_device(
      d, "add_rows", [&] { cpu::add_bias(fw(y), f(row), n, c); },
      [&](auto& cx) { cuda::add_bias(cx, fw(y), f(row), n, c); });
}

void sum_rows(const Tensor& dy, const Tensor& db) {
  if (any_bf16({&dy, &db})) {
    if (is_bf16(dy) && is_f32(db) && db.numel() == dy.shape().last() &&
        on_gpu(common_device("sum_rows", {&dy, &db}), "sum_rows", [&](auto& cx) {
          cuda::sum_rows(cx, b16(dy), fw(db), dy.shape().rows(), dy.shape().last());
        }))
      return;
    Widen wd(__func__);
    sum_rows(wd.in(dy), wd.out(db, true));
    return wd.commit();
  }
  const Device d = common_device("sum_rows", {&dy, &db});
  const int64_t n = dy.shape().rows(), c = dy.shape().last();
  check_numel("sum_rows", "db", db, c);
  on_device(
      d, "sum_rows", [&] { cpu::sum_rows(f(dy), fw(db), n, c); },
      [&](auto& cx) { cuda::sum_rows(cx, f(dy), fw(db), n, c); });
}

}  // namespace weft::ops
