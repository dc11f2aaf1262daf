// Causal attention on packed qkv (multi-head, or grouped-query when several
// query heads share a key/value head), one (batch, head) pair per OpenMP
// iteration. Inside the parallel region OpenBLAS (OpenMP build) runs
// each small GEMM on the calling thread, so the heads themselves are the
// parallelism.
#include <weft/cpu_kernels.h>

#include "src/cpu/eigen.h"

#include <algorithm>
#include <cmath>

namespace weft::cpu {

namespace {
using RowMap = Eigen::Map<Eigen::ArrayXf>;
using CRowMap = Eigen::Map<const Eigen::ArrayXf>;

// Row i of a causal score matrix: softmax over columns 0..i, zero after;
// with `positions` (one sequence's), over columns i - positions[i] .. i, the
// row's document, zero elsewhere.
void causal_softmax_rows(float* p, int64_t t, const int32_t* positions) {
  for (int64_t i = 0; i < t; ++i) {
    const int64_t start = positions ? i - positions[i] : 0;
    RowMap row(p + i * t + start, i + 1 - start);
    const float mx = row.maxCoeff();
    row = (row - mx).exp();
    row *= 1.0f / row.sum();
    std::fill(p + i * t, p + i * t + start, 0.0f);
    std::fill(p + i * t + i + 1, p + (i + 1) * t, 0.0f);
  }
}
}  // namespace

// qkv (B, T, (H + 2G) D): H query heads, G key heads, G value heads, each D
// columns; query head i reads key/value head i / (H / G). out (B, T, H D).
// probs (B, H, T, T).
void attention_forward(const float* qkv, float* out, float* probs, int64_t b, int64_t t, int64_t h,
                       int64_t g, int64_t d, Rounding r, const int32_t* positions) {
  const int64_t c = h * d, ld = (h + 2 * g) * d, per_group = h / g;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
#pragma omp parallel for schedule(static)
  for (int64_t bh = 0; bh < b * h; ++bh) {
    const int64_t bi = bh / h, hi = bh % h, gi = hi / per_group;
    const float* q = qkv + bi * t * ld + hi * d;
    const float* k = qkv + bi * t * ld + c + gi * d;
    const float* v = k + g * d;
    float* p = probs + bh * t * t;
    gemm_rounded(r, false, true, t, t, d, scale, q, ld, k, ld, 0.0f, p, t);
    causal_softmax_rows(p, t, positions ? positions + bi * t : nullptr);
    gemm_rounded(r, false, false, t, d, t, 1.0f, p, t, v, ld, 0.0f, out + bi * t * c + hi * d, c);
  }
}

// One (batch, key/value head) pair per iteration: its query heads run in
// order, so their dK and dV sums need no atomics and do not depend on the
// thread count.
void attention_backward(const float* dout, const float* qkv, const float* probs, float* dqkv,
                        float* scratch, int64_t b, int64_t t, int64_t h, int64_t g, int64_t d,
                        Rounding r) {
  const int64_t c = h * d, ld = (h + 2 * g) * d, per_group = h / g;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
#pragma omp parallel for schedule(static)
  for (int64_t bg = 0; bg < b * g; ++bg) {
    const int64_t bi = bg / g, gi = bg % g;
    const float* k = qkv + bi * t * ld + c + gi * d;
    const float* v = k + g * d;
    float* dk = dqkv + bi * t * ld + c + gi * d;
    float* dv = dk + g * d;
    for (int64_t hi = gi * per_group; hi < (gi + 1) * per_group; ++hi) {
      const int64_t bh = bi * h + hi;
      const float* q = qkv + bi * t * ld + hi * d;
      float* dq = dqkv + bi * t * ld + hi * d;
      const float* p = probs + bh * t * t;
      const float* dO = dout + bi * t * c + hi * d;
      float* ds = scratch + bh * t * t;
      gemm_rounded(r, false, true, t, t, d, 1.0f, dO, c, v, ld, 0.0f, ds, t);  // dP = dO V^T
      gemm_rounded(r, true, false, t, d, t, 1.0f, p, t, dO, c, 1.0f, dv, ld);  // dV += P^T dO
      for (int64_t i = 0; i < t; ++i) {  // dS = P * (dP - sum_j P dP), causal part only
        CRowMap pr(p + i * t, i + 1);
        RowMap sr(ds + i * t, i + 1);
        const float dot = (pr * sr).sum();
        sr = pr * (sr - dot);
        std::fill(ds + i * t + i + 1, ds + (i + 1) * t, 0.0f);
      }
      gemm_rounded(r, false, false, t, d, t, scale, ds, t, k, ld, 1.0f, dq, ld);  // dQ += s dS K
      gemm_rounded(r, true, false, t, d, t, scale, ds, t, q, ld, 1.0f, dk, ld);   // dK += s dS^T Q
    }
  }
}

}  // namespace weft::cpu
