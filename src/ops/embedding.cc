// weft/ops.h: the token and position embedding, and its token checks.
#include "src/ops/dispatch.h"

namespace weft::ops {

// --- embedding ---

void check_token_range(const Tensor& tokens, int64_t vocab, const char* what, bool targets) {
  check_dtype("check_token_range", "tokens", tokens, DType::I32);
  if (!tokens.device().is_cpu()) return;
  const int32_t* tp = i32(tokens);
  for (int64_t i = 0; i < tokens.numel(); ++i)
    check(tp[i] < vocab && (tp[i] >= 0 || (targets && tp[i] == kIgnoredTarget)),
          "{} {} at position {} is outside the vocabulary [0, {})", what, tp[i], i, vocab);
}

void embedding_forward(const Tensor& tokens, const Tensor& wte, int64_t first, const Tensor& wpe,
                       const Tensor& y, const Tensor& positions) {
  if (positions.defined()) {
    check(positions.dtype() == DType::I32 && positions.shape() == tokens.shape(),
          "embedding_forward: positions must be int32 of the tokens' shape {}, got {} {}",
          tokens.shape().str(), dtype_name(positions.dtype()), positions.shape().str());
    check_positions(positions, wpe.defined() && wpe.numel() > 0 ? wpe.dim(0) : 0);
  }
  const int32_t* at = opt_i32(positions);
  if (any_bf16({&wte, &wpe, &y})) {
    if (is_bf16(y) && is_f32(wte) && is_f32(wpe) && tokens.dtype() == DType::I32 &&
        y.numel() == tokens.numel() * wte.dim(1) &&
        on_gpu(common_device("embedding_forward", {&tokens, &wte, &wpe, &y}), "embedding_forward",
               [&](auto& cx) {
                 cuda::embedding_forward(
                     cx, i32(tokens), f(wte), wpe.defined() && wpe.numel() > 0 ? f(wpe) : nullptr,
                     b16w(y), tokens.dim(0), tokens.dim(1), wte.dim(1), wte.dim(0), first, at);
               }))
      return;
    Widen wd(__func__);
    embedding_forward(tokens, wd.in(wte), first, wd.in(wpe), wd.out(y, false), positions);
    return wd.commit();
  }
  const Device d = common_device("embedding_forward", {&tokens, &wte, &wpe, &y});
  check_dtype("embedding_forward", "tokens", tokens, DType::I32);
  const int64_t b = tokens.dim(0), t = tokens.dim(1), c = wte.dim(1), rows = wte.dim(0);
  const float* pos = wpe.defined() && wpe.numel() > 0 ? f(wpe) : nullptr;
  check_numel("embedding_forward", "y", y, b * t * c);
  on_device(
      d, "embedding_forward",
      [&] { cpu::embedding_forward(i32(tokens), f(wte), rows, first, pos, fw(y), b, t, c, at); },
      [&](auto& cx) {
        cuda::embedding_forward(cx, i32(tokens), f(wte), pos, fw(y), b, t, c, rows, first, at);
      });
}

void embedding_backward(const Tensor& tokens, const Tensor& dy, const Tensor& dwte, int64_t first,
                        const Tensor& dwpe, const Tensor& positions) {
  const int32_t* at = opt_i32(positions);  // checked by the forward
  if (any_bf16({&dy, &dwte, &dwpe})) {
    if (is_bf16(dy) && is_f32(dwte) && (!dwpe.defined() || is_f32(dwpe)) &&
        is_i32(tokens) && dy.numel() == tokens.numel() * dwte.dim(1) &&
        on_gpu(common_device("embedding_backward", {&tokens, &dy, &dwte, &dwpe}),
               "embedding_backward", [&](auto& cx) {
                 float* pos = dwpe.defined() && dwpe.numel() > 0 ? fw(dwpe) : nullptr;
                 cuda::embedding_backward(cx, i32(tokens), b16(dy), fw(dwte), pos, tokens.dim(0),
                                          tokens.dim(1), dwte.dim(1), dwte.dim(0), first, at);
               }))
      return;
    Widen wd(__func__);
    embedding_backward(tokens, wd.in(dy), wd.out(dwte, true), first, wd.out(dwpe, true), positions);
    return wd.commit();
  }
  const Device d = common_device("embedding_backward", {&tokens, &dy, &dwte, &dwpe});
  check_dtype("embedding_backward", "tokens", tokens, DType::I32);
  const int64_t b = tokens.dim(0), t = tokens.dim(1), c = dwte.dim(1), rows = dwte.dim(0);
  float* pos = dwpe.defined() && dwpe.numel() > 0 ? fw(dwpe) : nullptr;  // none: no positions
  on_device(
      d, "embedding_backward",
      [&] { cpu::embedding_backward(i32(tokens), f(dy), fw(dwte), rows, first, pos, b, t, c, at); },
      [&](auto& cx) {
        cuda::embedding_backward(cx, i32(tokens), f(dy), fw(dwte), pos, b, t, c, rows, first, at);
      });
}

}  // namespace weft::ops
