// The public kernels of weft/cuda/kernels.h: argument checks, scratch memory
// from the caching allocator, the launch (src/cuda/kernels/*.cu) and its check.
#include <weft/cuda/kernels.h>

#include "src/cuda/check.h"
#include "src/cuda/launch.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace weft::cuda {

namespace {
cudaStream_t prepare(Context& ctx) {
  ctx.make_current();
  return ctx.compute_stream();
}

// bf16 arrays as the launchers take them (launch.h: uint16_t).
static_assert(sizeof(bf16) == sizeof(uint16_t));
const uint16_t* raw(const bf16* p) { return reinterpret_cast<const uint16_t*>(p); }
uint16_t* raw(bf16* p) { return reinterpret_cast<uint16_t*>(p); }
}  // namespace

void layernorm_forward(Context& ctx, const float* x, const float* w, const float* b, float* y,
                       float* mean, float* rstd, int64_t n, int64_t c, float eps) {
  if (n == 0) return;
  launch::layernorm_forward(prepare(ctx), x, w, b, y, mean, rstd, n, c, eps);
  WEFT_LAUNCH_CHECK("layernorm_forward");
}

void layernorm_forward(Context& ctx, const bf16* x, const float* w, const float* b, bf16* y,
                       float* mean, float* rstd, int64_t n, int64_t c, float eps) {
  if (n == 0) return;
  launch::layernorm_forward(prepare(ctx), raw(x), w, b, raw(y), mean, rstd, n, c, eps);
  WEFT_LAUNCH_CHECK("layernorm_forward (bf16)");
}

void layernorm_backward_input(Context& ctx, const float* dy, const float* x, const float* w,
                              const float* mean, const float* rstd, float* dx, int64_t n,
                              int64_t c) {
  if (n == 0) return;
  launch::layernorm_backward_input(prepare(ctx), dy, x, w, mean, rstd, dx, n, c);
  WEFT_LAUNCH_CHECK("layernorm_backward_input");
}

void layernorm_backward_input(Context& ctx, const bf16* dy, const bf16* x, const float* w,
                              const float* mean, const float* rstd, bf16* dx, int64_t n,
                              int64_t c) {
  if (n == 0) return;
  launch::layernorm_backward_input(prepare(ctx), raw(dy), raw(x), w, mean, rstd, raw(dx), n, c);
  WEFT_LAUNCH_CHECK("layernorm_backward_input (bf16)");
}

bool add_layernorm_forward(Context& ctx, const float* x, const float* a, float* sum,
                           const float* w, const float* b, float* y, float* mean, float* rstd,
                           int64_t n, int64_t c, float eps) {
  if (n == 0) return true;
  if (!launch::add_layernorm_forward(prepare(ctx), x, a, sum, w, b, y, mean, rstd, n, c, eps))
    return false;
  WEFT_LAUNCH_CHECK("add_layernorm_forward");
  return true;
}

bool add_layernorm_forward(Context& ctx, const bf16* x, const bf16* a, bf16* sum, const float* w,
                           const float* b, bf16* y, float* mean, float* rstd, int64_t n,
                           int64_t c, float eps) {
  if (n == 0) return true;
  if (!launch::add_layernorm_forward(prepare(ctx), raw(x), raw(a), raw(sum), w, b, raw(y), mean,
                                     rstd, n, c, eps))
    return false;
  WEFT_LAUNCH_CHECK("add_layernorm_forward (bf16)");
  return true;
}

bool layernorm_backward_input_copy(Context& ctx, const float* dy, const float* x, const float* w,
                                   const float* mean, const float* rstd, float* dx, float* copy,
                                   int64_t n, int64_t c) {
  if (n == 0) return true;
  if (!launch::layernorm_backward_input_copy(prepare(ctx), dy, x, w, mean, rstd, dx, copy, n, c))
    return false;
  WEFT_LAUNCH_CHECK("layernorm_backward_input_copy");
  return true;
}

bool layernorm_backward_input_copy(Context& ctx, const bf16* dy, const bf16* x, const float* w,
                                   const float* mean, const float* rstd, bf16* dx, bf16* copy,
                                   int64_t n, int64_t c) {
  if (n == 0) return true;
  if (!launch::layernorm_backward_input_copy(prepare(ctx), raw(dy), raw(x), w, mean, rstd,
                                             raw(dx), raw(copy), n, c))
    return false;
  WEFT_LAUNCH_CHECK("layernorm_backward_input_copy (bf16)");
  return true;
}

void layernorm_backward_weight(Context& ctx, const float* dy, const float* x, const float* mean,
                               const float* rstd, float* dw, float* db, int64_t n, int64_t c) {
  if (n == 0 || c == 0) return;
  DeviceBuffer<float> partials(ctx, 2 * launch::column_slices(n) * c);
  launch::column_sums(prepare(ctx), dy, x, mean, rstd, dw, db, partials.data(), n, c);
  WEFT_LAUNCH_CHECK("column_sums (layernorm weight)");
}

void layernorm_backward_weight(Context& ctx, const bf16* dy, const bf16* x, const float* mean,
                               const float* rstd, float* dw, float* db, int64_t n, int64_t c) {
  if (n == 0 || c == 0) return;
  DeviceBuffer<float> partials(ctx, 2 * launch::column_slices(n) * c);
  launch::column_sums(prepare(ctx), raw(dy), raw(x), mean, rstd, dw, db, partials.data(), n, c);
  WEFT_LAUNCH_CHECK("column_sums (layernorm weight, bf16)");
}

namespace {
// The Llama layers' launches for activations of T: float, or bf16 bits.
template <class T>
void rmsnorm_forward_of(Context& ctx, const T* x, const float* w, T* y, float* rstd, int64_t n,
                        int64_t c, float eps) {
  if (n == 0) return;
  launch::rmsnorm_forward(prepare(ctx), x, w, y, rstd, n, c, eps);
  WEFT_LAUNCH_CHECK("rmsnorm_forward");
}

template <class T>
void rmsnorm_backward_input_of(Context& ctx, const T* dy, const T* x, const float* w,
                               const float* rstd, T* dx, int64_t n, int64_t c) {
  if (n == 0) return;
  launch::rmsnorm_backward_input(prepare(ctx), dy, x, w, rstd, dx, n, c);
  WEFT_LAUNCH_CHECK("rmsnorm_backward_input");
}

// LayerNorm's column sums with a zero mean: sum_i dy x rstd (its bias sums are dropped).
template <class T>
void rmsnorm_backward_weight_of(Context& ctx, const T* dy, const T* x, const float* rstd,
                                float* dw, int64_t n, int64_t c) {
  if (n == 0 || c == 0) return;
  DeviceBuffer<float> zero_mean(ctx, n), unused_db(ctx, c);
  zero(ctx, zero_mean.data(), zero_mean.bytes());
  zero(ctx, unused_db.data(), unused_db.bytes());
  DeviceBuffer<float> partials(ctx, 2 * launch::column_slices(n) * c);
  launch::column_sums(prepare(ctx), dy, x, zero_mean.data(), rstd, dw, unused_db.data(),
                      partials.data(), n, c);
  WEFT_LAUNCH_CHECK("column_sums (rmsnorm weight)");
}

template <class T>
void swiglu_forward_of(Context& ctx, const T* x, T* y, int64_t n, int64_t h) {
  if (n * h == 0) return;
  launch::swiglu_forward(prepare(ctx), x, y, n, h);
  WEFT_LAUNCH_CHECK("swiglu_forward");
}

template <class T>
void swiglu_backward_of(Context& ctx, const T* dy, const T* x, T* dx, int64_t n, int64_t h) {
  if (n * h == 0) return;
  launch::swiglu_backward(prepare(ctx), dy, x, dx, n, h);
  WEFT_LAUNCH_CHECK("swiglu_backward");
}

template <class T>
void rope_of(Context& ctx, bool backward, const T* src, T* dst, int64_t b, int64_t t, int64_t h,
             int64_t g, int64_t d, float base, const int32_t* positions) {
  if (b * t * d == 0) return;
  launch::rope(prepare(ctx), backward, src, dst, b, t, h, g, d, base, positions);
  if (backward)
    WEFT_LAUNCH_CHECK("rope_backward");
  else
    WEFT_LAUNCH_CHECK("rope_forward");
}
}  // namespace

void rmsnorm_forward(Context& ctx, const float* x, const float* w, float* y, float* rstd,
                     int64_t n, int64_t c, float eps) {
  rmsnorm_forward_of(ctx, x, w, y, rstd, n, c, eps);
}
void rmsnorm_forward(Context& ctx, const bf16* x, const float* w, bf16* y, float* rstd, int64_t n,
                     int64_t c, float eps) {
  rmsnorm_forward_of(ctx, raw(x), w, raw(y), rstd, n, c, eps);
}

void rmsnorm_backward_input(Context& ctx, const float* dy, const float* x, const float* w,
                            const float* rstd, float* dx, int64_t n, int64_t c) {
  rmsnorm_backward_input_of(ctx, dy, x, w, rstd, dx, n, c);
}
void rmsnorm_backward_input(Context& ctx, const bf16* dy, const bf16* x, const float* w,
                            const float* rstd, bf16* dx, int64_t n, int64_t c) {
  rmsnorm_backward_input_of(ctx, raw(dy), raw(x), w, rstd, raw(dx), n, c);
}

void rmsnorm_backward_weight(Context& ctx, const float* dy, const float* x, const float* rstd,
                             float* dw, int64_t n, int64_t c) {
  rmsnorm_backward_weight_of(ctx, dy, x, rstd, dw, n, c);
}
void rmsnorm_backward_weight(Context& ctx, const bf16* dy, const bf16* x, const float* rstd,
                             float* dw, int64_t n, int64_t c) {
  rmsnorm_backward_weight_of(ctx, raw(dy), raw(x), rstd, dw, n, c);
}

void swiglu_forward(Context& ctx, const float* x, float* y, int64_t n, int64_t h) {
  swiglu_forward_of(ctx, x, y, n, h);
}
void swiglu_forward(Context& ctx, const bf16* x, bf16* y, int64_t n, int64_t h) {
  swiglu_forward_of(ctx, raw(x), raw(y), n, h);
}

void swiglu_backward(Context& ctx, const float* dy, const float* x, float* dx, int64_t n,
                     int64_t h) {
  swiglu_backward_of(ctx, dy, x, dx, n, h);
}
void swiglu_backward(Context& ctx, const bf16* dy, const bf16* x, bf16* dx, int64_t n,
                     int64_t h) {
  swiglu_backward_of(ctx, raw(dy), raw(x), raw(dx), n, h);
}

void rope_forward(Context& ctx, const float* x, float* y, int64_t b, int64_t t, int64_t h,
                  int64_t g, int64_t d, float base, const int32_t* positions) {
  rope_of(ctx, false, x, y, b, t, h, g, d, base, positions);
}
void rope_forward(Context& ctx, const bf16* x, bf16* y, int64_t b, int64_t t, int64_t h, int64_t g,
                  int64_t d, float base, const int32_t* positions) {
  rope_of(ctx, false, raw(x), raw(y), b, t, h, g, d, base, positions);
}

void rope_backward(Context& ctx, const float* dy, float* dx, int64_t b, int64_t t, int64_t h,
                   int64_t g, int64_t d, float base, const int32_t* positions) {
  rope_of(ctx, true, dy, dx, b, t, h, g, d, base, positions);
}
void rope_backward(Context& ctx, const bf16* dy, bf16* dx, int64_t b, int64_t t, int64_t h,
                   int64_t g, int64_t d, float base, const int32_t* positions) {
  rope_of(ctx, true, raw(dy), raw(dx), b, t, h, g, d, base, positions);
}

void gelu_forward(Context& ctx, const float* x, float* y, int64_t n) {
  if (n == 0) return;
  launch::gelu_forward(prepare(ctx), x, y, n);
  WEFT_LAUNCH_CHECK("gelu_forward");
}

void gelu_forward(Context& ctx, const bf16* x, bf16* y, int64_t n) {
  if (n == 0) return;
  launch::gelu_forward(prepare(ctx), raw(x), raw(y), n);
  WEFT_LAUNCH_CHECK("gelu_forward (bf16)");
}

void gelu_backward(Context& ctx, const float* dy, const float* x, float* dx, int64_t n,
                   bool accumulate) {
  if (n == 0) return;
  launch::gelu_backward(prepare(ctx), dy, x, dx, n, accumulate);
  WEFT_LAUNCH_CHECK("gelu_backward");
}

void gelu_backward(Context& ctx, const bf16* dy, const bf16* x, bf16* dx, int64_t n,
                   bool accumulate) {
  if (n == 0) return;
  launch::gelu_backward(prepare(ctx), raw(dy), raw(x), raw(dx), n, accumulate);
  WEFT_LAUNCH_CHECK("gelu_backward (bf16)");
}

void add_bias(Context& ctx, float* y, const float* bias, int64_t n, int64_t c) {
  if (n == 0 || c == 0) return;
  launch::add_bias(prepare(ctx), y, bias, n, c);
  WEFT_LAUNCH_CHECK("add_bias");
}

void sum_rows(Context& ctx, const float* dy, float* db, int64_t n, int64_t c) {
  if (n == 0 || c == 0) return;
  DeviceBuffer<float> partials(ctx, launch::column_slices(n) * c);
  launch::column_sums(prepare(ctx), dy, static_cast<const float*>(nullptr), nullptr, nullptr,
                      nullptr, db, partials.data(), n, c);
  WEFT_LAUNCH_CHECK("column_sums (sum_rows)");
}

void sum_rows(Context& ctx, const bf16* dy, float* db, int64_t n, int64_t c) {
  if (n == 0 || c == 0) return;
  DeviceBuffer<float> partials(ctx, launch::column_slices(n) * c);
  launch::column_sums(prepare(ctx), raw(dy), static_cast<const uint16_t*>(nullptr), nullptr,
                      nullptr, nullptr, db, partials.data(), n, c);
  WEFT_LAUNCH_CHECK("column_sums (sum_rows, bf16)");
}

void add_inplace(Context& ctx, float* y, const float* x, int64_t n) {
  if (n == 0) return;
  launch::add_inplace(prepare(ctx), y, x, n);
  WEFT_LAUNCH_CHECK("add_inplace");
}

void add_inplace(Context& ctx, bf16* y, const bf16* x, int64_t n) {
  if (n == 0) return;
  launch::add_inplace(prepare(ctx), raw(y), raw(x), n);
  WEFT_LAUNCH_CHECK("add_inplace (bf16)");
}

void add(Context& ctx, const float* a, const float* b, float* y, int64_t n) {
  if (n == 0) return;
  launch::add(prepare(ctx), a, b, y, n);
  WEFT_LAUNCH_CHECK("add");
}

void add(Context& ctx, const bf16* a, const bf16* b, bf16* y, int64_t n) {
  if (n == 0) return;
  launch::add(prepare(ctx), raw(a), raw(b), raw(y), n);
  WEFT_LAUNCH_CHECK("add (bf16)");
}

void add_inplace(Context& ctx, bf16* y, const float* x, int64_t n) {
  if (n == 0) return;
  launch::add_inplace(prepare(ctx), raw(y), x, n);
  WEFT_LAUNCH_CHECK("add_inplace (bf16 += fp32)");
}

void add_bias_bf16(Context& ctx, const float* x, const bf16* bias, bf16* y, int64_t n, int64_t c,
                   int64_t ldy) {
  check(ldy >= c, "add_bias_bf16: ldy ({}) is less than c ({})", ldy, c);
  if (n == 0 || c == 0) return;
  launch::add_bias_bf16(prepare(ctx), x, raw(bias), raw(y), n, c, ldy);
  WEFT_LAUNCH_CHECK("add_bias_bf16");
}

void fill_rows(Context& ctx, bf16* y, const float* row, int64_t n, int64_t c) {
  if (n == 0 || c == 0) return;
  launch::fill_rows(prepare(ctx), raw(y), row, n, c);
  WEFT_LAUNCH_CHECK("fill_rows");
}

void add_scaled(Context& ctx, float* y, const float* x, float s, int64_t n) {
  if (n == 0) return;
  launch::add_scaled(prepare(ctx), y, x, s, n);
  WEFT_LAUNCH_CHECK("add_scaled");
}

void add_scaled(Context& ctx, bf16* y, const float* x, float s, int64_t n) {
  if (n == 0) return;
  launch::add_scaled(prepare(ctx), raw(y), x, s, n);
  WEFT_LAUNCH_CHECK("add_scaled (bf16 += fp32)");
}

void scale_inplace(Context& ctx, float* y, float s, int64_t n) {
  if (n == 0) return;
  launch::scale_inplace(prepare(ctx), y, s, n);
  WEFT_LAUNCH_CHECK("scale_inplace");
}

void fill32(Context& ctx, uint32_t* y, uint32_t bits, int64_t n) {
  if (n == 0) return;
  launch::fill32(prepare(ctx), y, bits, n);
  WEFT_LAUNCH_CHECK("fill32");
}

void fill16(Context& ctx, uint16_t* y, uint16_t bits, int64_t n) {
  if (n == 0) return;
  launch::fill16(prepare(ctx), y, bits, n);
  WEFT_LAUNCH_CHECK("fill16");
}

namespace {
void check_rows(int64_t n, const char* what) {
  check(n <= 0x7fffffff, "{}: {} rows exceed the grid's limit of 2^31 - 1 blocks", what, n);
}
}  // namespace

void mask_columns(Context& ctx, float* logits, int64_t n, int64_t v, int64_t from) {
  if (n == 0 || from >= v) return;
  launch::mask_columns(prepare(ctx), logits, n, v, from);
  WEFT_LAUNCH_CHECK("mask_columns");
}

void mask_columns(Context& ctx, bf16* logits, int64_t n, int64_t v, int64_t from) {
  if (n == 0 || from >= v) return;
  launch::mask_columns_bf16(prepare(ctx), raw(logits), n, v, from);
  WEFT_LAUNCH_CHECK("mask_columns (bf16)");
}

void softmax_cross_entropy(Context& ctx, float* logits, const int32_t* targets, float* losses,
                           int64_t n, int64_t v) {
  if (n == 0) return;
  check_rows(n, "softmax_cross_entropy");
  launch::cross_entropy(prepare(ctx), logits, targets, losses, 1.0f, false, n, v);
  WEFT_LAUNCH_CHECK("softmax_cross_entropy");
}

void cross_entropy_backward(Context& ctx, const float* probs, const int32_t* targets,
                            float* dlogits, float scale, int64_t n, int64_t v, int64_t first) {
  if (n == 0 || v == 0) return;
  launch::cross_entropy_backward(prepare(ctx), probs, targets, dlogits, scale, n, v, first);
  WEFT_LAUNCH_CHECK("cross_entropy_backward");
}

void fused_cross_entropy(Context& ctx, float* logits, const int32_t* targets, float* losses,
                         float scale, int64_t n, int64_t v) {
  if (n == 0) return;
  check_rows(n, "fused_cross_entropy");
  launch::cross_entropy(prepare(ctx), logits, targets, losses, scale, true, n, v);
  WEFT_LAUNCH_CHECK("fused_cross_entropy");
}

void fused_cross_entropy(Context& ctx, const float* logits, bf16* dlogits, const int32_t* targets,
                         float* losses, float scale, int64_t n, int64_t v) {
  if (n == 0) return;
  check_rows(n, "fused_cross_entropy");
  launch::cross_entropy_bf16(prepare(ctx), logits, raw(dlogits), targets, losses, scale, n, v);
  WEFT_LAUNCH_CHECK("fused_cross_entropy (bf16 dlogits)");
}

void fused_cross_entropy(Context& ctx, const bf16* logits, bf16* dlogits, const int32_t* targets,
                         float* losses, float scale, int64_t n, int64_t v) {
  if (n == 0) return;
  check_rows(n, "fused_cross_entropy");
  launch::cross_entropy_bf16_logits(prepare(ctx), raw(logits), raw(dlogits), targets, losses,
                                    scale, n, v);
  WEFT_LAUNCH_CHECK("fused_cross_entropy (bf16 logits)");
}

void row_max(Context& ctx, const float* logits, float* m, int64_t n, int64_t v) {
  if (n == 0) return;
  check_rows(n, "row_max");
  launch::row_max(prepare(ctx), logits, m, n, v);
  WEFT_LAUNCH_CHECK("row_max");
}

void exp_and_stats(Context& ctx, float* logits, const int32_t* targets, int64_t first,
                   const float* m, float* sum, float* z, int64_t n, int64_t v) {
  if (n == 0) return;
  check_rows(n, "exp_and_stats");
  launch::exp_and_stats(prepare(ctx), logits, targets, first, m, sum, z, n, v);
  WEFT_LAUNCH_CHECK("exp_and_stats");
}

void normalise_and_loss(Context& ctx, float* p, const float* sum, const float* z,
                        const int32_t* targets, int64_t n, int64_t v, float* loss) {
  if (n == 0) return zero(ctx, loss, sizeof(float));
  check_rows(n, "normalise_and_loss");
  DeviceBuffer<float> losses(ctx, n);
  launch::normalise(prepare(ctx), p, sum, z, targets, losses.data(), n, v);
  WEFT_LAUNCH_CHECK("normalise_and_loss");
  weft::cuda::sum(ctx, losses.data(), n, loss);
}

void embedding_forward(Context& ctx, const int32_t* tokens, const float* wte, const float* wpe,
                       float* y, int64_t b, int64_t t, int64_t c, int64_t rows, int64_t first,
                       const int32_t* positions) {
  if (b * t * c == 0) return;
  launch::embedding_forward(prepare(ctx), tokens, wte, rows, first, wpe, y, b, t, c, positions);
  WEFT_LAUNCH_CHECK("embedding_forward");
}

void embedding_forward(Context& ctx, const int32_t* tokens, const float* wte, const float* wpe,
                       bf16* y, int64_t b, int64_t t, int64_t c, int64_t rows, int64_t first,
                       const int32_t* positions) {
  if (b * t * c == 0) return;
  launch::embedding_forward(prepare(ctx), tokens, wte, rows, first, wpe, raw(y), b, t, c,
                            positions);
  WEFT_LAUNCH_CHECK("embedding_forward (bf16)");
}

void embedding_backward(Context& ctx, const int32_t* tokens, const float* dy, float* dwte,
                        float* dwpe, int64_t b, int64_t t, int64_t c, int64_t rows, int64_t first,
                        const int32_t* positions) {
  if (b * t * c == 0) return;
  launch::embedding_backward(prepare(ctx), tokens, dy, dwte, rows, first, dwpe, b, t, c, positions);
  WEFT_LAUNCH_CHECK("embedding_backward");
}

void embedding_backward(Context& ctx, const int32_t* tokens, const bf16* dy, float* dwte,
                        float* dwpe, int64_t b, int64_t t, int64_t c, int64_t rows, int64_t first,
                        const int32_t* positions) {
  if (b * t * c == 0) return;
  launch::embedding_backward(prepare(ctx), tokens, raw(dy), dwte, rows, first, dwpe, b, t, c,
                             positions);
  WEFT_LAUNCH_CHECK("embedding_backward (bf16)");
}

void lion(Context& ctx, float* p, const float* g, float* m, int64_t n, float lr, float beta1,
          float beta2, float weight_decay, float grad_scale, const float* grad_scale_at) {
  if (n == 0) return;
  launch::lion(prepare(ctx), p, g, m, n, lr, beta1, beta2, 1.0f - lr * weight_decay, grad_scale,
               grad_scale_at);
  WEFT_LAUNCH_CHECK("lion");
}

void sgd(Context& ctx, float* p, const float* g, float* buf, int64_t n, float lr, float momentum,
         float weight_decay) {
  if (n == 0) return;
  launch::sgd(prepare(ctx), p, g, buf, n, lr, momentum, weight_decay);
  WEFT_LAUNCH_CHECK("sgd");
}

namespace {
// AdamW's per-step scalars exactly as cpu::adamw computes them, the one
// place both CUDA updates take them from.
struct AdamWScalars {
  float step_size, bc2_sqrt;
  AdamWScalars(float lr, float beta1, float beta2, int64_t step) {
    check(step >= 1, "adamw: step ({}) is 1-based", step);
    const float bc1 = 1.0f - static_cast<float>(std::pow(static_cast<double>(beta1), step));
    const float bc2 = 1.0f - static_cast<float>(std::pow(static_cast<double>(beta2), step));
    step_size = lr / bc1;
    bc2_sqrt = std::sqrt(bc2);
  }
  static float decay(float lr, float weight_decay) { return 1.0f - lr * weight_decay; }
};
}  // namespace

void adamw(Context& ctx, float* p, const float* g, float* m, float* v, int64_t n, float lr,
           float beta1, float beta2, float eps, float weight_decay, int64_t step,
           float grad_scale, const float* grad_scale_at) {
  if (n == 0) return;
  const AdamWScalars k(lr, beta1, beta2, step);
  launch::adamw(prepare(ctx), p, g, m, v, n, beta1, beta2, eps, k.step_size, k.bc2_sqrt,
                AdamWScalars::decay(lr, weight_decay), grad_scale, grad_scale_at);
  WEFT_LAUNCH_CHECK("adamw");
}

void adamw_multi(Context& ctx, const std::vector<AdamWTensor>& tensors, AdamWTable& table,
                 float lr, float beta1, float beta2, float eps, float weight_decay, int64_t step,
                 float grad_scale, const float* grad_scale_at) {
  const AdamWScalars k(lr, beta1, beta2, step);
  if (tensors != table.key_) {  // a new parameter set: chunk it and upload the table
    std::vector<launch::AdamWChunk> chunks;
    for (const AdamWTensor& t : tensors) {
      check(t.n >= 0, "adamw_multi: a tensor of {} elements", t.n);
      for (int64_t at = 0; at < t.n; at += launch::kAdamWChunk)
        chunks.push_back({t.p + at, t.g + at, t.m + at, t.v + at,
                          std::min(launch::kAdamWChunk, t.n - at), t.decay ? 1 : 0});
    }
    const int64_t words = static_cast<int64_t>(chunks.size() * sizeof(launch::AdamWChunk) /
                                               sizeof(int64_t));
    if (table.words_.size() < words) table.words_ = DeviceBuffer<int64_t>(ctx, words);
    if (words > 0) upload(ctx, table.words_.data(), chunks.data(), chunks.size() * sizeof chunks[0]);
    table.key_ = tensors;
    table.chunks_ = static_cast<int64_t>(chunks.size());
    ++table.builds_;
  }
  if (table.chunks_ == 0) return;
  // The no-decay group's factor as adamw computes it for weight decay 0.
  launch::adamw_multi(prepare(ctx), reinterpret_cast<const launch::AdamWChunk*>(table.words_.data()),
                      table.chunks_, beta1, beta2, eps, k.step_size, k.bc2_sqrt,
                      AdamWScalars::decay(lr, weight_decay), AdamWScalars::decay(lr, 0.0f),
                      grad_scale, grad_scale_at);
  WEFT_LAUNCH_CHECK("adamw_multi");
}

void MultiTensorTable::update(Context& ctx, const std::vector<MultiTensor>& tensors) {
  if (tensors == key_) return;
  std::vector<launch::MultiChunk> chunks;
  for (const MultiTensor& t : tensors) {
    check(t.n >= 0, "a multi-tensor table: a tensor of {} elements", t.n);
    for (int64_t at = 0; at < t.n; at += launch::kMultiChunk)
      chunks.push_back({t.x + at, std::min(launch::kMultiChunk, t.n - at)});
  }
  const int64_t words = static_cast<int64_t>(chunks.size() * sizeof(launch::MultiChunk) /
                                             sizeof(int64_t));
  if (words_.size() < words) words_ = DeviceBuffer<int64_t>(ctx, words);
  if (words > 0) upload(ctx, words_.data(), chunks.data(), chunks.size() * sizeof chunks[0]);
  key_ = tensors;
  chunks_ = static_cast<int64_t>(chunks.size());
  ++builds_;
}

double sum_squares_multi(Context& ctx, const std::vector<MultiTensor>& tensors,
                         MultiTensorTable& table) {
  table.update(ctx, tensors);
  if (table.chunks_ == 0) return 0.0;
  if (table.sums_.size() < table.chunks_ + 1)
    table.sums_ = DeviceBuffer<double>(ctx, table.chunks_ + 1);
  launch::sum_squares_multi(prepare(ctx),
                            reinterpret_cast<const launch::MultiChunk*>(table.words_.data()),
                            table.chunks_, table.sums_.data());
  WEFT_LAUNCH_CHECK("sum_squares_multi");
  double r = 0;
  download(ctx, &r, table.sums_.data() + table.chunks_, sizeof r);  // the one wait
  return r;
}

void sum_squares_multi(Context& ctx, const std::vector<MultiTensor>& tensors,
                       MultiTensorTable& table, float* total) {
  table.update(ctx, tensors);
  if (table.chunks_ == 0) {
    zero(ctx, total, sizeof(float));
    return;
  }
  if (table.sums_.size() < table.chunks_ + 1)
    table.sums_ = DeviceBuffer<double>(ctx, table.chunks_ + 1);
  launch::sum_squares_multi(prepare(ctx),
                            reinterpret_cast<const launch::MultiChunk*>(table.words_.data()),
                            table.chunks_, table.sums_.data(), total);
  WEFT_LAUNCH_CHECK("sum_squares_multi (to the device)");
}

void scale_multi(Context& ctx, const std::vector<MultiTensor>& tensors, float s,
                 MultiTensorTable& table, const float* s_at) {
  table.update(ctx, tensors);
  if (table.chunks_ == 0) return;
  launch::scale_multi(prepare(ctx),
                      reinterpret_cast<const launch::MultiChunk*>(table.words_.data()),
                      table.chunks_, s, s_at);
  WEFT_LAUNCH_CHECK("scale_multi");
}

void clip_coefficient(Context& ctx, const float* sum_squares, double max_norm, float* coef) {
  launch::clip_coefficient(prepare(ctx), sum_squares, max_norm, coef);
  WEFT_LAUNCH_CHECK("clip_coefficient");
}

void to_bf16_multi(Context& ctx, const std::vector<ConvertTensor>& tensors, ConvertTable& table) {
  if (tensors != table.key_) {  // a new list: chunk it and upload the table
    std::vector<launch::ConvertChunk> chunks;
    for (const ConvertTensor& t : tensors) {
      check(t.n >= 0, "to_bf16_multi: a tensor of {} elements", t.n);
      for (int64_t at = 0; at < t.n; at += launch::kMultiChunk)
        chunks.push_back({t.x + at, raw(t.y + at), std::min(launch::kMultiChunk, t.n - at)});
    }
    const int64_t words = static_cast<int64_t>(chunks.size() * sizeof(launch::ConvertChunk) /
                                               sizeof(int64_t));
    if (table.words_.size() < words) table.words_ = DeviceBuffer<int64_t>(ctx, words);
    if (words > 0) upload(ctx, table.words_.data(), chunks.data(), chunks.size() * sizeof chunks[0]);
    table.key_ = tensors;
    table.chunks_ = static_cast<int64_t>(chunks.size());
    ++table.builds_;
  }
  if (table.chunks_ == 0) return;
  launch::to_bf16_multi(prepare(ctx),
                        reinterpret_cast<const launch::ConvertChunk*>(table.words_.data()),
                        table.chunks_);
  WEFT_LAUNCH_CHECK("to_bf16_multi");
}

namespace {
void reduce(Context& ctx, const float* x, int64_t n, bool square, double* out) {
  DeviceBuffer<double> partials(ctx, launch::reduce_blocks(n));
  launch::reduce(prepare(ctx), x, n, square, partials.data(), out);
  WEFT_LAUNCH_CHECK("reduce");
}
}  // namespace

void sum(Context& ctx, const float* x, int64_t n, double* out) { reduce(ctx, x, n, false, out); }

void sum(Context& ctx, const float* x, int64_t n, float* out) {
  DeviceBuffer<double> partials(ctx, launch::reduce_blocks(n));
  launch::reduce(prepare(ctx), x, n, false, partials.data(), out);
  WEFT_LAUNCH_CHECK("reduce (to a float)");
}

void sum_squares(Context& ctx, const float* x, int64_t n, double* out) {
  reduce(ctx, x, n, true, out);
}

double sum_to_host(Context& ctx, const float* x, int64_t n) {
  DeviceBuffer<double> d(ctx, 1);
  sum(ctx, x, n, d.data());
  double r = 0;
  download(ctx, &r, d.data(), sizeof r);
  return r;
}

double sum_squares_to_host(Context& ctx, const float* x, int64_t n) {
  DeviceBuffer<double> d(ctx, 1);
  sum_squares(ctx, x, n, d.data());
  double r = 0;
  download(ctx, &r, d.data(), sizeof r);
  return r;
}

void to_bf16(Context& ctx, const float* x, bf16* y, int64_t n) {
  if (n == 0) return;
  launch::to_bf16(prepare(ctx), x, raw(y), n);
  WEFT_LAUNCH_CHECK("to_bf16");
}

void round_values(Context& ctx, MathMode mode, const float* x, float* y, int64_t n) {
  check(mode == MathMode::BF16 || mode == MathMode::FP16,
        "round_values: math mode {} has no 16-bit values (bf16 or fp16)", math_mode_name(mode));
  if (n == 0) return;
  launch::round_values(prepare(ctx), x, y, n, mode == MathMode::BF16);
  WEFT_LAUNCH_CHECK("round_values");
}

void to_float(Context& ctx, const bf16* x, float* y, int64_t n) {
  if (n == 0) return;
  launch::to_float(prepare(ctx), raw(x), y, n);
  WEFT_LAUNCH_CHECK("to_float");
}

void add_bf16(Context& ctx, const bf16* x, float* y, int64_t n) {
  if (n == 0) return;
  launch::add_bf16(prepare(ctx), raw(x), y, n);
  WEFT_LAUNCH_CHECK("add_bf16");
}

}  // namespace weft::cuda
