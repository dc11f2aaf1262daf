// weft/ops.h: cross-entropy (whole, fused, and the LM head's chunked
// classifier) and mean-squared error.
#include "src/ops/dispatch.h"

namespace weft::ops {

// --- cross-entropy ---

void mask_columns(const Tensor& logits, int64_t from) {
  const Device d = common_device("mask_columns", {&logits});
  const int64_t n = logits.shape().rows(), v = logits.shape().last();
  check(from >= 0 && from <= v, "mask_columns: column {} is outside the {} columns of {}", from, v,
        logits.shape().str());
  if (from == v) return;
  if (is_bf16(logits)) {  // -inf is exact in bf16: the widened path gives the same bits
    if (on_gpu(d, "mask_columns",
               [&](auto& cx) { cuda::mask_columns(cx, b16w(logits), n, v, from); }))
      return;
    Widen wd(__func__);
    mask_columns(wd.out(logits, true), from);
    return wd.commit();
  }
  check_dtype("mask_columns", "logits", logits, DType::F32);
  on_device(
      d, "mask_columns", [&] { cpu::mask_columns(fw(logits), n, v, from); },
      [&](auto& cx) { cuda::mask_columns(cx, fw(logits), n, v, from); });
}

double softmax_cross_entropy(const Tensor& logits, const Tensor& targets, const Tensor& losses) {
  if (any_bf16({&logits, &losses})) {
    Widen wd(__func__);
    const double r = softmax_cross_entropy(wd.out(logits, true), targets, wd.out(losses, false));
    wd.commit();
    return r;
  }
  const Device d = common_device("softmax_cross_entropy", {&logits, &targets, &losses});
  check_dtype("softmax_cross_entropy", "targets", targets, DType::I32);
  const int64_t n = logits.shape().rows(), v = logits.shape().last();
  check_numel("softmax_cross_entropy", "targets", targets, n);
  check_numel("softmax_cross_entropy", "losses", losses, n);
  return on_device(
      d, "softmax_cross_entropy",
      [&] { return cpu::softmax_cross_entropy(fw(logits), i32(targets), fw(losses), n, v); },
      [&](auto& cx) {
        cuda::softmax_cross_entropy(cx, fw(logits), i32(targets), fw(losses), n, v);
        return cuda::sum_to_host(cx, f(losses), n);
      });
}

namespace {
// The fused classifier's checks: logits (N, V), fp32 (or bf16 with bf16
// dlogits), N int32 targets, N losses, all on one device (and dlogits, when
// given, of the logits' shape). Returns that device.
Device check_classifier(const char* op, const Tensor& logits, const Tensor& targets,
                        const Tensor& losses, const Tensor& dlogits = Tensor()) {
  const Device d = dlogits.defined() ? common_device(op, {&logits, &targets, &losses, &dlogits})
                                     : common_device(op, {&logits, &targets, &losses});
  if (is_bf16(logits) && dlogits.defined())
    check_dtype(op, "dlogits (for bf16 logits)", dlogits, DType::BF16);
  else
    check_dtype(op, "logits", logits, DType::F32);
  check_dtype(op, "targets", targets, DType::I32);
  check_numel(op, "targets", targets, logits.shape().rows());
  check_numel(op, "losses", losses, logits.shape().rows());
  check(!dlogits.defined() || dlogits.shape() == logits.shape(),
        "{}: dlogits {} for logits {}: the shapes must match", op, dlogits.shape().str(),
        logits.shape().str());
  return d;
}
}  // namespace

double fused_cross_entropy(const Tensor& logits, const Tensor& targets, const Tensor& losses,
                           float scale) {
  fused_cross_entropy_rows(logits, targets, losses, scale);
  return sum(losses);
}

void fused_cross_entropy_rows(const Tensor& logits, const Tensor& targets, const Tensor& losses,
                              float scale) {
  const Device d = check_classifier("fused_cross_entropy_rows", logits, targets, losses);
  const int64_t n = logits.shape().rows(), v = logits.shape().last();
  on_device(
      d, "fused_cross_entropy_rows",
      [&] {
        cpu::softmax_cross_entropy(fw(logits), i32(targets), fw(losses), n, v);
        cpu::cross_entropy_backward(f(logits), i32(targets), fw(logits), scale, n, v, 0);
      },
      [&](auto& cx) {
        cuda::fused_cross_entropy(cx, fw(logits), i32(targets), fw(losses), scale, n, v);
      });
}

void fused_cross_entropy_rows(const Tensor& logits, const Tensor& targets, const Tensor& losses,
                              float scale, const Tensor& dlogits) {
  const Device d = check_classifier("fused_cross_entropy_rows", logits, targets, losses, dlogits);
  if (is_bf16(logits)) {  // bf16 dlogits too; they may be the logits themselves
    if (on_gpu(d, "fused_cross_entropy_rows", [&](auto& cx) {
          cuda::fused_cross_entropy(cx, b16(logits), b16w(dlogits), i32(targets), fw(losses),
                                    scale, logits.shape().rows(), logits.shape().last());
        }))
      return;
    Widen wd(__func__);  // the CPU: the fp32 classifier on the exact widened logits, rounded once
    const Tensor wide = wd.in(logits);
    fused_cross_entropy_rows(wide, targets, losses, scale);
    convert(wide, dlogits);
    return;
  }
  if (dlogits.raw() == logits.raw()) return fused_cross_entropy_rows(logits, targets, losses, scale);
  if (is_bf16(dlogits)) {
    if (on_gpu(d, "fused_cross_entropy_rows", [&](auto& cx) {
          cuda::fused_cross_entropy(cx, f(logits), b16w(dlogits), i32(targets), fw(losses), scale,
                                    logits.shape().rows(), logits.shape().last());
        }))
      return;
    fused_cross_entropy_rows(logits, targets, losses, scale);  // the CPU: in place, then rounded
    convert(logits, dlogits);
    return;
  }
  check_dtype("fused_cross_entropy_rows", "dlogits", dlogits, DType::F32);
  dlogits.copy_from(logits);
  fused_cross_entropy_rows(dlogits, targets, losses, scale);
}

void cross_entropy_backward(const Tensor& probs, const Tensor& targets, int64_t first,
                            const Tensor& dlogits, float scale) {
  if (any_bf16({&probs, &dlogits})) {
    Widen wd(__func__);
    cross_entropy_backward(wd.in(probs), targets, first, wd.out(dlogits, false), scale);
    return wd.commit();
  }
  const Device d = common_device("cross_entropy_backward", {&probs, &targets, &dlogits});
  const int64_t n = probs.shape().rows(), v = probs.shape().last();
  check_numel("cross_entropy_backward", "dlogits", dlogits, n * v);
  on_device(
      d, "cross_entropy_backward",
      [&] { cpu::cross_entropy_backward(f(probs), i32(targets), fw(dlogits), scale, n, v, first); },
      [&](auto& cx) {
        cuda::cross_entropy_backward(cx, f(probs), i32(targets), fw(dlogits), scale, n, v, first);
      });
}

void row_max(const Tensor& logits, const Tensor& max) {
  if (any_bf16({&logits, &max})) {
    Widen wd(__func__);
    row_max(wd.in(logits), wd.out(max, false));
    return wd.commit();
  }
  const Device d = common_device("row_max", {&logits, &max});
  const int64_t n = logits.shape().rows(), v = logits.shape().last();
  check_numel("row_max", "max", max, n);
  on_device(
      d, "row_max", [&] { cpu::row_max(f(logits), fw(max), n, v); },
      [&](auto& cx) { cuda::row_max(cx, f(logits), fw(max), n, v); });
}

void exp_and_stats(const Tensor& logits, const Tensor& targets, int64_t first, const Tensor& max,
                   const Tensor& stats) {
  if (any_bf16({&logits, &max, &stats})) {
    Widen wd(__func__);
    exp_and_stats(wd.out(logits, true), targets, first, wd.in(max), wd.out(stats, false));
    return wd.commit();
  }
  const Device d = common_device("exp_and_stats", {&logits, &targets, &max, &stats});
  const int64_t n = logits.shape().rows(), v = logits.shape().last();
  check_numel("exp_and_stats", "stats", stats, 2 * n);
  on_device(
      d, "exp_and_stats",
      [&] {
        cpu::exp_and_stats(fw(logits), i32(targets), first, f(max), fw(stats), fw(stats) + n, n,
                           v);
      },
      [&](auto& cx) {
        cuda::exp_and_stats(cx, fw(logits), i32(targets), first, f(max), fw(stats), fw(stats) + n,
                            n, v);
      });
}

void normalise_and_loss(const Tensor& exps, const Tensor& stats, const Tensor& targets,
                        const Tensor& loss) {
  check_numel("normalise_and_loss", "loss", loss, 1);
  check_dtype("normalise_and_loss", "loss", loss, DType::F32);
  if (any_bf16({&exps, &stats})) {
    Widen wd(__func__);
    normalise_and_loss(wd.out(exps, true), wd.in(stats), targets, loss);
    return wd.commit();
  }
  const Device d = common_device("normalise_and_loss", {&exps, &stats, &targets, &loss});
  const int64_t n = exps.shape().rows(), v = exps.shape().last();
  check_numel("normalise_and_loss", "stats", stats, 2 * n);
  check_dtype("normalise_and_loss", "targets", targets, DType::I32);
  check_numel("normalise_and_loss", "targets", targets, n);
  on_device(
      d, "normalise_and_loss",
      [&] {
        fw(loss)[0] = static_cast<float>(
            cpu::normalise_and_loss(fw(exps), f(stats), f(stats) + n, i32(targets), n, v));
      },
      [&](auto& cx) {
        cuda::normalise_and_loss(cx, fw(exps), f(stats), f(stats) + n, i32(targets), n, v,
                                 fw(loss));
      });
}

// --- mean-squared error ---

double mse_loss(const Tensor& pred, const Tensor& target) {
  if (any_bf16({&pred, &target})) {
    Widen wd(__func__);
    const double r = mse_loss(wd.in(pred), wd.in(target));
    wd.commit();
    return r;
  }
  const Device d = common_device("mse_loss", {&pred, &target});
  check_numel("mse_loss", "target", target, pred.numel());
  return on_device(
      d, "mse_loss", [&] { return cpu::mse_loss(f(pred), f(target), pred.numel()); },
      [&](auto&) -> double { no_cuda_kernel("mse_loss", d); });
}

void mse_backward(const Tensor& pred, const Tensor& target, float g, const Tensor& dx) {
  if (any_bf16({&pred, &target, &dx})) {
    Widen wd(__func__);
    mse_backward(wd.in(pred), wd.in(target), g, wd.out(dx, true));
    return wd.commit();
  }
  const Device d = common_device("mse_backward", {&pred, &target, &dx});
  check_numel("mse_backward", "the gradient", dx, pred.numel());
  on_device(
      d, "mse_backward", [&] { cpu::mse_backward(f(pred), f(target), g, fw(dx), pred.numel()); },
      [&](auto&) { no_cuda_kernel("mse_backward", d); });
}

}  // namespace weft::ops
