// Element-wise and reduction kernels. Loops over rows run in parallel with a
// static OpenMP schedule; reductions over rows (weight gradients) split the
// columns instead, so their results do not depend on the thread count.
#include <weft/cpu_kernels.h>
#include <weft/error.h>

#include "src/cpu/eigen.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace weft::cpu {

namespace {
using ArrayF = Eigen::Array<float, Eigen::Dynamic, 1>;
using MapF = Eigen::Map<ArrayF>;
using CMapF = Eigen::Map<const ArrayF>;
constexpr int64_t kColBlock = 64;
constexpr int64_t kChunk = 16384;  // element-wise work per OpenMP task
}  // namespace

void layernorm_forward(const float* x, const float* w, const float* b, float* y, float* mean,
                       float* rstd, int64_t n, int64_t c, float eps) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float* xi = x + i * c;
    float* yi = y + i * c;
    float m = 0;
    for (int64_t j = 0; j < c; ++j) m += xi[j];
    m /= static_cast<float>(c);
    float var = 0;
    for (int64_t j = 0; j < c; ++j) {
      float d = xi[j] - m;
      var += d * d;
    }
    var /= static_cast<float>(c);
    float r = 1.0f / std::sqrt(var + eps);
    for (int64_t j = 0; j < c; ++j) yi[j] = (xi[j] - m) * r * w[j] + b[j];
    mean[i] = m;
    rstd[i] = r;
  }
}

void layernorm_backward_input(const float* dy, const float* x, const float* w, const float* mean,
                              const float* rstd, float* dx, int64_t n, int64_t c) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float* dyi = dy + i * c;
    const float* xi = x + i * c;
    float* dxi = dx + i * c;
    float m = mean[i], r = rstd[i];
    float dnorm_mean = 0, dnorm_xhat_mean = 0;
    for (int64_t j = 0; j < c; ++j) {
      float dnorm = dyi[j] * w[j];
      dnorm_mean += dnorm;
      dnorm_xhat_mean += dnorm * (xi[j] - m) * r;
    }
    dnorm_mean /= static_cast<float>(c);
    dnorm_xhat_mean /= static_cast<float>(c);
    for (int64_t j = 0; j < c; ++j) {
      float xhat = (xi[j] - m) * r;
      dxi[j] += (dyi[j] * w[j] - dnorm_mean - xhat * dnorm_xhat_mean) * r;
    }
  }
}

void layernorm_backward_weight(const float* dy, const float* x, const float* mean,
                               const float* rstd, float* dw, float* db, int64_t n, int64_t c) {
  int64_t blocks = (c + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(static)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    int64_t j0 = blk * kColBlock, j1 = std::min(c, j0 + kColBlock);
    float sw[kColBlock] = {}, sb[kColBlock] = {};
    for (int64_t i = 0; i < n; ++i) {
      const float* dyi = dy + i * c;
      const float* xi = x + i * c;
      float m = mean[i], r = rstd[i];
      for (int64_t j = j0; j < j1; ++j) {
        sw[j - j0] += dyi[j] * (xi[j] - m) * r;
        sb[j - j0] += dyi[j];
      }
    }
    for (int64_t j = j0; j < j1; ++j) {
      dw[j] += sw[j - j0];
      db[j] += sb[j - j0];
    }
  }
}

void rmsnorm_forward(const float* x, const float* w, float* y, float* rstd, int64_t n, int64_t c,
                     float eps) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float* xi = x + i * c;
    float* yi = y + i * c;
    float ss = 0;
    for (int64_t j = 0; j < c; ++j) ss += xi[j] * xi[j];
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(c) + eps);
    for (int64_t j = 0; j < c; ++j) yi[j] = xi[j] * r * w[j];
    rstd[i] = r;
  }
}

// y_j = w_j x_j r with r = (mean(x^2) + eps)^(-1/2), dr/dx_k = -r^3 x_k / C:
// dx_k = r w_k dy_k - x_k r^3 / C * sum_j w_j dy_j x_j
void rmsnorm_backward_input(const float* dy, const float* x, const float* w, const float* rstd,
                            float* dx, int64_t n, int64_t c) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float* dyi = dy + i * c;
    const float* xi = x + i * c;
    float* dxi = dx + i * c;
    const float r = rstd[i];
    float dot = 0;
    for (int64_t j = 0; j < c; ++j) dot += w[j] * dyi[j] * xi[j];
    const float k = r * r * r * dot / static_cast<float>(c);
    for (int64_t j = 0; j < c; ++j) dxi[j] += r * w[j] * dyi[j] - xi[j] * k;
  }
}

void rmsnorm_backward_weight(const float* dy, const float* x, const float* rstd, float* dw,
                             int64_t n, int64_t c) {
  const int64_t blocks = (c + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(static)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t j0 = blk * kColBlock, j1 = std::min(c, j0 + kColBlock);
    float sw[kColBlock] = {};
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = j0; j < j1; ++j) sw[j - j0] += dy[i * c + j] * x[i * c + j] * rstd[i];
    for (int64_t j = j0; j < j1; ++j) dw[j] += sw[j - j0];
  }
}

void swiglu_forward(const float* x, float* y, int64_t n, int64_t h) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float* g = x + i * 2 * h;
    const float* u = g + h;
    for (int64_t j = 0; j < h; ++j) y[i * h + j] = g[j] / (1.0f + std::exp(-g[j])) * u[j];
  }
}

// silu(g) = g s, s = sigmoid(g); silu'(g) = s (1 + g (1 - s))
void swiglu_backward(const float* dy, const float* x, float* dx, int64_t n, int64_t h) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float* g = x + i * 2 * h;
    const float* u = g + h;
    float* dg = dx + i * 2 * h;
    float* du = dg + h;
    for (int64_t j = 0; j < h; ++j) {
      const float s = 1.0f / (1.0f + std::exp(-g[j]));
      const float d = dy[i * h + j];
      dg[j] += d * u[j] * s * (1.0f + g[j] * (1.0f - s));
      du[j] += d * g[j] * s;
    }
  }
}

namespace {
// The angle of pair i at position t, computed in double as the reference does.
float rope_angle(int64_t t, int64_t i, int64_t d, float base) {
  return static_cast<float>(static_cast<double>(t) *
                            std::pow(static_cast<double>(base), -2.0 * static_cast<double>(i) /
                                                                    static_cast<double>(d)));
}
}  // namespace

void rope_forward(const float* x, float* y, int64_t b, int64_t t, int64_t h, int64_t g, int64_t d,
                  float base, const int32_t* positions) {
  const int64_t half = d / 2, w = (h + 2 * g) * d, rotated = (h + g) * d;
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < b * t; ++row) {
    const int64_t pos = positions ? positions[row] : row % t;
    const float* xr = x + row * w;
    float* yr = y + row * w;
    std::copy_n(xr + rotated, g * d, yr + rotated);  // v
    for (int64_t hi = 0; hi < h + g; ++hi) {  // q heads, then k heads
      const float* xs = xr + hi * d;
      float* ys = yr + hi * d;
      for (int64_t i = 0; i < half; ++i) {
        const float a = rope_angle(pos, i, d, base), cs = std::cos(a), sn = std::sin(a);
        ys[i] = xs[i] * cs - xs[i + half] * sn;
        ys[i + half] = xs[i + half] * cs + xs[i] * sn;
      }
    }
  }
}

void rope_backward(const float* dy, float* dx, int64_t b, int64_t t, int64_t h, int64_t g,
                   int64_t d, float base, const int32_t* positions) {
  const int64_t half = d / 2, w = (h + 2 * g) * d, rotated = (h + g) * d;
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < b * t; ++row) {
    const int64_t pos = positions ? positions[row] : row % t;
    const float* gr = dy + row * w;
    float* dr = dx + row * w;
    for (int64_t j = rotated; j < w; ++j) dr[j] += gr[j];  // v
    for (int64_t hi = 0; hi < h + g; ++hi) {
      const float* gs = gr + hi * d;
      float* ds = dr + hi * d;
      for (int64_t i = 0; i < half; ++i) {
        const float a = rope_angle(pos, i, d, base), cs = std::cos(a), sn = std::sin(a);
        ds[i] += gs[i] * cs + gs[i + half] * sn;
        ds[i + half] += gs[i + half] * cs - gs[i] * sn;
      }
    }
  }
}

namespace {
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;
}  // namespace

void gelu_forward(const float* x, float* y, int64_t n) {
  int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static)
  for (int64_t ch = 0; ch < chunks; ++ch) {
    int64_t b = ch * kChunk, len = std::min(kChunk, n - b);
    CMapF xv(x + b, len);
    ArrayF u = kGeluScale * (xv + kGeluCubic * xv.cube());
    MapF(y + b, len) = 0.5f * xv * (1.0f + u.tanh());
  }
}

void gelu_backward(const float* dy, const float* x, float* dx, int64_t n, bool accumulate) {
  int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static)
  for (int64_t ch = 0; ch < chunks; ++ch) {
    int64_t b = ch * kChunk, len = std::min(kChunk, n - b);
    CMapF xv(x + b, len);
    ArrayF x2 = xv.square();
    ArrayF t = (kGeluScale * xv * (1.0f + kGeluCubic * x2)).tanh();
    ArrayF dudx = kGeluScale * (1.0f + 3.0f * kGeluCubic * x2);
    ArrayF grad = 0.5f * (1.0f + t) + 0.5f * xv * (1.0f - t.square()) * dudx;
    if (accumulate)
      MapF(dx + b, len) += CMapF(dy + b, len) * grad;
    else
      MapF(dx + b, len) = CMapF(dy + b, len) * grad;
  }
}

void fill_rows(float* y, const float* row, int64_t n, int64_t c) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) std::copy_n(row, c, y + i * c);
}

void add_bias(float* y, const float* bias, int64_t n, int64_t c) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < c; ++j) y[i * c + j] += bias[j];
}

void sum_rows(const float* dy, float* db, int64_t n, int64_t c) {
  int64_t blocks = (c + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(static)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    int64_t j0 = blk * kColBlock, j1 = std::min(c, j0 + kColBlock);
    float s[kColBlock] = {};
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = j0; j < j1; ++j) s[j - j0] += dy[i * c + j];
    for (int64_t j = j0; j < j1; ++j) db[j] += s[j - j0];
  }
}

void add_inplace(float* y, const float* x, int64_t n) {
  int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static)
  for (int64_t ch = 0; ch < chunks; ++ch) {
    int64_t b = ch * kChunk, len = std::min(kChunk, n - b);
    MapF(y + b, len) += CMapF(x + b, len);
  }
}

// Each chunk's products into a buffer, then summed in a second loop: one
// expression y + x s would be contracted into FMAs where the target has them.
void add_scaled(float* y, const float* x, float s, int64_t n) {
  constexpr int64_t kPiece = 1024;
  int64_t chunks = (n + kPiece - 1) / kPiece;
#pragma omp parallel for schedule(static)
  for (int64_t ch = 0; ch < chunks; ++ch) {
    float t[kPiece];
    int64_t b = ch * kPiece, len = std::min(kPiece, n - b);
    MapF(t, len) = CMapF(x + b, len) * s;
    MapF(y + b, len) += MapF(t, len);
  }
}

void scale_inplace(float* y, float s, int64_t n) {
  int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static)
  for (int64_t ch = 0; ch < chunks; ++ch) {
    int64_t b = ch * kChunk, len = std::min(kChunk, n - b);
    MapF(y + b, len) *= s;
  }
}

void mask_columns(float* logits, int64_t n, int64_t v, int64_t from) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i)
    std::fill(logits + i * v + from, logits + i * v + v, -std::numeric_limits<float>::infinity());
}

double softmax_cross_entropy(float* logits, const int32_t* targets, float* losses, int64_t n,
                             int64_t v) {
  for (int64_t i = 0; i < n; ++i)
    check(targets[i] >= kIgnoredTarget && targets[i] < v,
          "target token {} at position {} is outside the vocabulary [0, {})", targets[i], i, v);
  double total = 0;
#pragma omp parallel for schedule(static) reduction(+ : total)
  for (int64_t i = 0; i < n; ++i) {
    // Masked columns (a padded vocabulary's, -inf) end the row. Eigen's
    // vectorised exp clamps its argument, so exp(-inf) would be a denormal,
    // not 0: they are set to 0 and the softmax runs over the columns before.
    float* r = logits + i * v;
    int64_t live = v;
    while (live > 1 && r[live - 1] == -std::numeric_limits<float>::infinity()) --live;
    MapF row(r, live);
    const float mx = row.maxCoeff();
    const bool ignored = targets[i] == kIgnoredTarget;
    const float target_logit = ignored ? 0.0f : r[targets[i]] - mx;
    std::fill(r + live, r + v, 0.0f);
    row = (row - mx).exp();
    const float sum = row.sum();
    row *= 1.0f / sum;
    losses[i] = ignored ? 0.0f : std::log(sum) - target_logit;
    total += static_cast<double>(losses[i]);
  }
  return total;
}

void cross_entropy_backward(const float* probs, const int32_t* targets, float* dlogits,
                            float scale, int64_t n, int64_t v, int64_t first) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float* p = probs + i * v;
    float* d = dlogits + i * v;
    if (targets[i] == kIgnoredTarget) {  // no loss term, no gradient
      std::fill(d, d + v, 0.0f);
      continue;
    }
    for (int64_t j = 0; j < v; ++j) d[j] = p[j] * scale;
    const int64_t col = targets[i] - first;
    if (col >= 0 && col < v) d[col] -= scale;
  }
}

void row_max(const float* logits, float* m, int64_t n, int64_t v) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) m[i] = *std::max_element(logits + i * v, logits + i * v + v);
}

void exp_and_stats(float* logits, const int32_t* targets, int64_t first, const float* m,
                   float* sum, float* z, int64_t n, int64_t v) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    float* row = logits + i * v;
    const int64_t col = targets[i] - first;
    z[i] = col >= 0 && col < v ? row[col] - m[i] : 0.0f;
    float s = 0.0f;
    for (int64_t j = 0; j < v; ++j) s += (row[j] = std::exp(row[j] - m[i]));
    sum[i] = s;
  }
}

double normalise_and_loss(float* p, const float* sum, const float* z, const int32_t* targets,
                          int64_t n, int64_t v) {
  double total = 0;
#pragma omp parallel for schedule(static) reduction(+ : total)
  for (int64_t i = 0; i < n; ++i) {
    float* row = p + i * v;
    const float inv = 1.0f / sum[i];
    for (int64_t j = 0; j < v; ++j) row[j] *= inv;
    if (targets[i] != kIgnoredTarget) total += static_cast<double>(std::log(sum[i]) - z[i]);
  }
  return total;
}

void embedding_forward(const int32_t* tokens, const float* wte, int64_t rows, int64_t first,
                       const float* wpe, float* y, int64_t b, int64_t t, int64_t c,
                       const int32_t* positions) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < b * t; ++i) {
    const int64_t row = tokens[i] - first, at = positions ? positions[i] : i % t;
    float* yi = y + i * c;
    if (row >= 0 && row < rows) {
      const float* e = wte + row * c;
      if (wpe == nullptr) {
        std::copy_n(e, c, yi);
      } else {
        const float* p = wpe + at * c;
        for (int64_t j = 0; j < c; ++j) yi[j] = e[j] + p[j];
      }
    } else if (wpe == nullptr) {
      std::fill_n(yi, c, 0.0f);
    } else {
      std::copy_n(wpe + at * c, c, yi);
    }
  }
}

void embedding_backward(const int32_t* tokens, const float* dy, float* dwte, int64_t rows,
                        int64_t first, float* dwpe, int64_t b, int64_t t, int64_t c,
                        const int32_t* positions) {
  const int64_t blocks = (c + kColBlock - 1) / kColBlock;
  // Column blocks: no two threads touch the same element, and the summation
  // order is the token order whatever the thread count.
#pragma omp parallel for schedule(static)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t j0 = blk * kColBlock, j1 = std::min(c, j0 + kColBlock);
    for (int64_t i = 0; i < b * t; ++i) {
      const float* d = dy + i * c;
      if (dwpe != nullptr) {
        float* p = dwpe + (positions ? positions[i] : i % t) * c;
        for (int64_t j = j0; j < j1; ++j) p[j] += d[j];
      }
      const int64_t row = tokens[i] - first;
      if (row < 0 || row >= rows) continue;
      float* e = dwte + row * c;
      for (int64_t j = j0; j < j1; ++j) e[j] += d[j];
    }
  }
}

void adamw(float* p, const float* g, float* m, float* v, int64_t n, float lr, float beta1,
           float beta2, float eps, float weight_decay, int64_t step, float grad_scale) {
  const float bc1 = 1.0f - static_cast<float>(std::pow(static_cast<double>(beta1), step));
  const float bc2 = 1.0f - static_cast<float>(std::pow(static_cast<double>(beta2), step));
  const float step_size = lr / bc1;
  const float bc2_sqrt = std::sqrt(bc2);
  const float decay = 1.0f - lr * weight_decay;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i] * grad_scale;
    float pi = p[i] * decay;
    float mi = m[i] * beta1 + (1.0f - beta1) * gi;
    float vi = v[i] * beta2 + (1.0f - beta2) * gi * gi;
    float denom = std::sqrt(vi) / bc2_sqrt + eps;
    p[i] = pi - step_size * (mi / denom);
    m[i] = mi;
    v[i] = vi;
  }
}

void lion(float* p, const float* g, float* m, int64_t n, float lr, float beta1, float beta2,
          float weight_decay, float grad_scale) {
  const float decay = 1.0f - lr * weight_decay;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i] * grad_scale;
    const float c = beta1 * m[i] + (1.0f - beta1) * gi;
    const float sign = c > 0.0f ? 1.0f : c < 0.0f ? -1.0f : 0.0f;
    p[i] = p[i] * decay - lr * sign;
    m[i] = beta2 * m[i] + (1.0f - beta2) * gi;
  }
}

void sgd(float* p, const float* g, float* buf, int64_t n, float lr, float momentum,
         float weight_decay) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float d = g[i] + weight_decay * p[i];
    const float b = momentum * buf[i] + d;
    buf[i] = b;
    p[i] -= lr * (momentum > 0.0f ? b : d);
  }
}

double mse_loss(const float* p, const float* t, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += 0.5 * double(p[i] - t[i]) * double(p[i] - t[i]);
  return s;
}

void mse_backward(const float* p, const float* t, float g, float* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] += g * (p[i] - t[i]);
}

double sum_squares(const float* x, int64_t n) {
  double s = 0;
#pragma omp parallel for schedule(static) reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += static_cast<double>(x[i]) * x[i];
  return s;
}

}  // namespace weft::cpu
