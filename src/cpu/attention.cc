// Causal multi-head attention on packed qkv, one (batch, head) pair per
// OpenMP iteration. Inside the parallel region OpenBLAS (OpenMP build) runs
// each small GEMM on the calling thread, so the heads themselves are the
// parallelism.
#include <weft/cpu_kernels.h>

#include <algorithm>
#include <cmath>

namespace weft::cpu {

// qkv (B, T, 3C): q, k, v blocks of C columns; head h owns columns h*D..h*D+D-1
// of each block. out (B, T, C). probs (B, H, T, T).
void attention_forward(const float* qkv, float* out, float* probs, int64_t b, int64_t t,
                       int64_t h, int64_t c) {
  const int64_t d = c / h, ld = 3 * c;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
#pragma omp parallel for schedule(static)
  for (int64_t bh = 0; bh < b * h; ++bh) {
    const int64_t bi = bh / h, hi = bh % h;
    const float* q = qkv + bi * t * ld + hi * d;
    const float* k = q + c;
    const float* v = q + 2 * c;
    float* p = probs + bh * t * t;
    gemm(false, true, t, t, d, scale, q, ld, k, ld, 0.0f, p, t);
    for (int64_t i = 0; i < t; ++i) {
      float* row = p + i * t;
      float mx = row[0];
      for (int64_t j = 1; j <= i; ++j) mx = std::max(mx, row[j]);
      float sum = 0;
      for (int64_t j = 0; j <= i; ++j) {
        row[j] = std::exp(row[j] - mx);
        sum += row[j];
      }
      float inv = 1.0f / sum;
      for (int64_t j = 0; j <= i; ++j) row[j] *= inv;
      for (int64_t j = i + 1; j < t; ++j) row[j] = 0.0f;
    }
    gemm(false, false, t, d, t, 1.0f, p, t, v, ld, 0.0f, out + bi * t * c + hi * d, c);
  }
}

void attention_backward(const float* dout, const float* qkv, const float* probs, float* dqkv,
                        float* scratch, int64_t b, int64_t t, int64_t h, int64_t c) {
  const int64_t d = c / h, ld = 3 * c;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
#pragma omp parallel for schedule(static)
  for (int64_t bh = 0; bh < b * h; ++bh) {
    const int64_t bi = bh / h, hi = bh % h;
    const float* q = qkv + bi * t * ld + hi * d;
    const float* k = q + c;
    const float* v = q + 2 * c;
    float* dq = dqkv + bi * t * ld + hi * d;
    float* dk = dq + c;
    float* dv = dq + 2 * c;
    const float* p = probs + bh * t * t;
    const float* dO = dout + bi * t * c + hi * d;
    float* ds = scratch + bh * t * t;
    gemm(false, true, t, t, d, 1.0f, dO, c, v, ld, 0.0f, ds, t);  // dP = dO V^T
    gemm(true, false, t, d, t, 1.0f, p, t, dO, c, 1.0f, dv, ld);  // dV += P^T dO
    for (int64_t i = 0; i < t; ++i) {  // dS = P * (dP - sum_j P dP), causal part only
      const float* pr = p + i * t;
      float* sr = ds + i * t;
      float dot = 0;
      for (int64_t j = 0; j <= i; ++j) dot += pr[j] * sr[j];
      for (int64_t j = 0; j <= i; ++j) sr[j] = pr[j] * (sr[j] - dot);
      for (int64_t j = i + 1; j < t; ++j) sr[j] = 0.0f;
    }
    gemm(false, false, t, d, t, scale, ds, t, k, ld, 1.0f, dq, ld);  // dQ += s dS K
    gemm(true, false, t, d, t, scale, ds, t, q, ld, 1.0f, dk, ld);   // dK += s dS^T Q
  }
}

}  // namespace weft::cpu
