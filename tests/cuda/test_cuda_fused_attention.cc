// cuDNN's fused (flash) attention against the CPU's unfused attention on the
// same fp32 inputs, through weft/ops.h: forward, the saved log-sum-exp,
// backward (multi-head and grouped-query, ragged T), the causal mask, graphs
// and scratch reused on a repeated call (no cudaMalloc), the layer's smaller
// stash, and the refusals. Needs a GPU and a build with cuDNN fused attention;
// exits 77 (SKIP) otherwise.
//
// The error model. cuDNN rounds q, k, v, dO (and the forward's O, exactly:
// out is O widened) to bf16, u = 2^-8 relative each; it keeps the softmax
// statistics in fp32 but rounds P and dS to bf16 before the GEMMs that use
// them, and rounds its outputs (O, dQ, dK, dV) to bf16. fp32 accumulation
// (1e-7 relative per term) is negligible beside these. First order, per
// element, with scale = 1/sqrt(D), S = max over (i, j <= i) of
// scale sum_d |q_id| |k_jd| and e_s = 2 u S the largest error of a score:
//   p_ij relative:  e_p = 2 e_s + u (the score, the row's log-sum-exp, bf16 P)
//   lse_i:          e_s
//   out_id:         (e_p + 2 u) max|v|   (out is a convex combination of v;
//                                         v rounded, out rounded)
//   dP_ij - D_i, with D_i = dO_i . O_i: at most |dO_i|_1 max|v| (e_p + 5 u)
//                   (dO and v rounded: 2 u; O's error and rounding: e_p + 3 u)
//   dS_ij = p_ij (dP_ij - D_i): p_ij |dO_i|_1 max|v| (3 e_p + 7 u)
//                   (|dP_ij - D_i| <= 2 |dO_i|_1 max|v|; bf16 dS: 2 u of that)
//   dq_id:          scale max|k| max|v| |dO_i|_1 (3 e_p + 9 u) + u |dq_id|
//                   (sum_j p_ij = 1; k rounded; dq rounded)
//   dk_jd:          scale max|q| max|v| (3 e_p + 9 u) sum_i p_ij |dO_i|_1 + u |dk_jd|
//   dv_jd:          (e_p + 3 u) sum_i p_ij |dO_i|_1 + u |dv_jd|
// summed over the query heads of a key/value head's group, plus 1e-6 |x| for
// the fp32 "+=" into dqkv. The bounds are computed from the fp64 reference
// quantities of each case. Second-order terms (products of two u's, ~2^-16
// relative) are covered by a factor 1.25 on the first-order bound.
#include "weft_config.h"

// Without cuDNN nothing here is compiled (cuda::fused_attention_* are not
// linked), and main() SKIPs.
#if WEFT_CUDA && WEFT_CUDNN
#include <weft/cuda/kernels.h>
#include <weft/cuda/runtime.h>
#include <weft/ops.h>
#include <weft/tensor.h>

#include "layers/attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cuda_test_util.h"
#include "test_util.h"

namespace weft {
namespace {

using cuda::test_util::expect_within;

using weft::testing::contains;
using weft::testing::error_message;
using weft::testing::uniform;

constexpr double kU = 1.0 / 256;      // bf16 rounding, relative
constexpr double kSecondOrder = 1.25;  // room for the second-order terms

const Device kGpu = Device::cuda(0);

Tensor on_gpu(const std::vector<float>& host, Shape shape) {
  Tensor t = Tensor::empty(shape, DType::F32, kGpu);
  t.copy_from(Tensor(const_cast<float*>(host.data()), shape, DType::F32));
  return t;
}

std::vector<float> to_host(const Tensor& t) {
  std::vector<float> h(static_cast<size_t>(t.numel()));
  Tensor(h.data(), t.shape(), DType::F32).copy_from(t);
  return h;
}

struct Case {
  int64_t b, t, h, g, d;
  int64_t w() const { return (h + 2 * g) * d; }
  int64_t c() const { return h * d; }
};

// The CPU's attention (forward, backward into dqkv0) and the error bounds of
// the model above, element by element.
struct Reference {
  std::vector<float> out, probs, dqkv;
  std::vector<double> lse;                   // (B, H, T), fp64 from the scores
  double lse_bound = 0;                       // e_s
  std::vector<double> out_bound, dqkv_bound;  // per element of out and dqkv
};

Reference reference(const Case& k, const std::vector<float>& qkv, const std::vector<float>& dout,
                    const std::vector<float>& dqkv0) {
  const int64_t w = k.w(), c = k.c(), per = k.h / k.g;
  Reference r;
  r.out.resize(static_cast<size_t>(k.b * k.t * c));
  r.probs.resize(static_cast<size_t>(k.b * k.h * k.t * k.t));
  r.dqkv = dqkv0;
  Tensor tq(const_cast<float*>(qkv.data()), {k.b, k.t, w}, DType::F32);
  Tensor tout(r.out.data(), {k.b, k.t, c}, DType::F32);
  Tensor tp(r.probs.data(), {k.b, k.h, k.t, k.t}, DType::F32);
  Tensor tdo(const_cast<float*>(dout.data()), {k.b, k.t, c}, DType::F32);
  Tensor tdq(r.dqkv.data(), {k.b, k.t, w}, DType::F32);
  Tensor scratch = Tensor::empty({k.b, k.h, k.t, k.t});
  ops::attention_forward(tq, tout, tp, k.h, k.g);
  ops::attention_backward(tdo, tq, tp, tdq, scratch, k.h, k.g);

  auto at = [&](int64_t bi, int64_t ti, int64_t col) {
    return static_cast<double>(qkv[static_cast<size_t>((bi * k.t + ti) * w + col)]);
  };
  const double scale = 1.0 / std::sqrt(static_cast<double>(k.d));
  double s_abs = 0, qmax = 0, kmax = 0, vmax = 0;
  for (int64_t i = 0; i < k.b * k.t * w; ++i) {
    const int64_t col = i % w;
    const double x = std::abs(static_cast<double>(qkv[static_cast<size_t>(i)]));
    double& m = col < k.h * k.d ? qmax : col < (k.h + k.g) * k.d ? kmax : vmax;
    m = std::max(m, x);
  }
  r.lse.resize(static_cast<size_t>(k.b * k.h * k.t));
  std::vector<double> do_l1(static_cast<size_t>(k.b * k.h * k.t));  // |dO_i|_1 per head
  for (int64_t bi = 0; bi < k.b; ++bi)
    for (int64_t hi = 0; hi < k.h; ++hi) {
      const int64_t kq = (k.h + hi / per) * k.d;
      for (int64_t i = 0; i < k.t; ++i) {
        double mx = -1e300;
        std::vector<double> s(static_cast<size_t>(i + 1));
        for (int64_t j = 0; j <= i; ++j) {
          double dot = 0, abs_dot = 0;
          for (int64_t dd = 0; dd < k.d; ++dd) {
            const double a = at(bi, i, hi * k.d + dd), bk = at(bi, j, kq + dd);
            dot += a * bk;
            abs_dot += std::abs(a * bk);
          }
          s[static_cast<size_t>(j)] = dot * scale;
          mx = std::max(mx, dot * scale);
          s_abs = std::max(s_abs, abs_dot * scale);
        }
        double sum = 0;
        for (double x : s) sum += std::exp(x - mx);
        const size_t row = static_cast<size_t>((bi * k.h + hi) * k.t + i);
        r.lse[row] = mx + std::log(sum);
        double l1 = 0;
        for (int64_t dd = 0; dd < k.d; ++dd)
          l1 += std::abs(static_cast<double>(dout[static_cast<size_t>((bi * k.t + i) * c + hi * k.d + dd)]));
        do_l1[row] = l1;
      }
    }
  const double e_s = 2 * kU * s_abs, e_p = 2 * e_s + kU;
  r.lse_bound = kSecondOrder * e_s;
  r.out_bound.assign(r.out.size(), kSecondOrder * (e_p + 2 * kU) * vmax);
  // sum_i p_ij |dO_i|_1 per (b, query head, key j)
  r.dqkv_bound.assign(r.dqkv.size(), 0.0);
  for (int64_t bi = 0; bi < k.b; ++bi)
    for (int64_t hi = 0; hi < k.h; ++hi) {
      const int64_t gi = hi / per;
      for (int64_t j = 0; j < k.t; ++j) {
        double col = 0;
        for (int64_t i = j; i < k.t; ++i)
          col += static_cast<double>(
                     r.probs[static_cast<size_t>(((bi * k.h + hi) * k.t + i) * k.t + j)]) *
                 do_l1[static_cast<size_t>((bi * k.h + hi) * k.t + i)];
        const double bq = scale * kmax * vmax * do_l1[static_cast<size_t>((bi * k.h + hi) * k.t + j)] *
                          (3 * e_p + 9 * kU);
        const double bk = scale * qmax * vmax * (3 * e_p + 9 * kU) * col;
        const double bv = (e_p + 3 * kU) * col;
        for (int64_t dd = 0; dd < k.d; ++dd) {
          const int64_t row = (bi * k.t + j) * w;
          r.dqkv_bound[static_cast<size_t>(row + hi * k.d + dd)] += bq;
          r.dqkv_bound[static_cast<size_t>(row + (k.h + gi) * k.d + dd)] += bk;
          r.dqkv_bound[static_cast<size_t>(row + (k.h + k.g + gi) * k.d + dd)] += bv;
        }
      }
    }
  for (size_t i = 0; i < r.dqkv.size(); ++i) {
    const double x = std::abs(static_cast<double>(r.dqkv[i]));
    const double init = std::abs(static_cast<double>(dqkv0[i]));
    r.dqkv_bound[i] = kSecondOrder * (r.dqkv_bound[i] + kU * std::abs(x - init)) + 1e-6 * (x + init);
  }
  return r;
}

void check_case(const Case& k) {
  SCOPED_TRACE(::testing::Message() << "B " << k.b << " T " << k.t << " H " << k.h << " G " << k.g
                                    << " D " << k.d);
  const std::vector<float> qkv = uniform(k.b * k.t * k.w(), 91), dout = uniform(k.b * k.t * k.c(), 92);
  const std::vector<float> dqkv0 = uniform(k.b * k.t * k.w(), 93);
  const Reference r = reference(k, qkv, dout, dqkv0);

  Tensor gq = on_gpu(qkv, {k.b, k.t, k.w()}), gdo = on_gpu(dout, {k.b, k.t, k.c()});
  Tensor gdq = on_gpu(dqkv0, {k.b, k.t, k.w()});
  Tensor gout = Tensor::zeros({k.b, k.t, k.c()}, DType::F32, kGpu);
  Tensor glse = Tensor::zeros({k.b, k.h, k.t}, DType::F32, kGpu);
  ops::attention_forward_fused(gq, gout, glse, k.h, k.g);
  ops::attention_backward_fused(gdo, gq, gout, glse, gdq, k.h, k.g);

  expect_within(to_host(gout), r.out, r.out_bound, "out");
  expect_within(to_host(gdq), r.dqkv, r.dqkv_bound, "dqkv");
  // lse moves by at most the largest score error e_s (plus fp32 rounding of
  // a value of a few units): if this fails alone, cuDNN's statistics are not
  // the natural-log log-sum-exp that the layer's comments promise.
  const std::vector<float> lse = to_host(glse);
  size_t bad = 0;
  for (size_t i = 0; i < lse.size(); ++i) {
    const double err = std::abs(static_cast<double>(lse[i]) - r.lse[i]);
    bad += !(err <= r.lse_bound + 1e-6 * (1 + std::abs(r.lse[i])));
  }
  EXPECT_EQ(bad, 0u) << "lse: " << bad << " of " << lse.size()
                     << " rows outside the bound; row 0: got " << lse[0] << ", want " << r.lse[0];
}

class FusedAttention : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!ops::fused_attention_built()) GTEST_SKIP() << "built without cuDNN fused attention";
  }
};

TEST_F(FusedAttention, MatchesCpuWithinTheBf16Model) {
  check_case({2, 64, 4, 4, 64});   // multi-head, GPT-2's head size
  check_case({2, 37, 3, 3, 32});   // ragged T
  check_case({1, 1, 2, 2, 16});    // a single position (no cuDNN backward: see the source)
  check_case({2, 1, 6, 2, 16});    // a single position, grouped-query: dv sums 3 heads
  check_case({2, 48, 6, 2, 16});   // grouped-query: 3 query heads a group
  check_case({1, 40, 4, 1, 128});  // one key/value head, the largest head size
}

// Every T of kSeqLengths up to 1024: two heads of 16 (one shared key/value
// head at every other T), so that the fp64 reference stays small.
TEST_F(FusedAttention, MatchesCpuAtEverySequenceLength) {
  int k = 0;
  for (const int64_t t : weft::testing::kSeqLengths)
    check_case({t <= 129 ? 2 : 1, t, 2, k++ % 2 == 1 ? 1 : 2, 16});
}

// Changing the last positions' q, k, v leaves every earlier output as it was;
// a gradient only at earlier outputs gives later positions no gradient at all.
TEST_F(FusedAttention, IsCausal) {
  const Case k{2, 40, 4, 2, 32};
  const int64_t from = 25;  // positions from..T-1 change
  std::vector<float> qkv = uniform(k.b * k.t * k.w(), 101);
  Tensor out1 = Tensor::zeros({k.b, k.t, k.c()}, DType::F32, kGpu);
  Tensor out2 = Tensor::zeros({k.b, k.t, k.c()}, DType::F32, kGpu);
  Tensor lse = Tensor::zeros({k.b, k.h, k.t}, DType::F32, kGpu);
  ops::attention_forward_fused(on_gpu(qkv, {k.b, k.t, k.w()}), out1, lse, k.h, k.g);
  std::vector<float> changed = qkv;
  for (int64_t bi = 0; bi < k.b; ++bi)
    for (int64_t ti = from; ti < k.t; ++ti)
      for (int64_t col = 0; col < k.w(); ++col) changed[static_cast<size_t>((bi * k.t + ti) * k.w() + col)] += 0.5f;
  Tensor gchanged = on_gpu(changed, {k.b, k.t, k.w()});
  ops::attention_forward_fused(gchanged, out2, lse, k.h, k.g);
  const std::vector<float> a = to_host(out1), b = to_host(out2);
  size_t moved_before = 0, moved_after = 0;
  for (int64_t bi = 0; bi < k.b; ++bi)
    for (int64_t ti = 0; ti < k.t; ++ti)
      for (int64_t col = 0; col < k.c(); ++col) {
        const size_t i = static_cast<size_t>((bi * k.t + ti) * k.c() + col);
        // Row ti reads keys 0..ti only: the same inputs give the same bits
        // (the forward has no atomics; a masked score adds exactly 0).
        if (ti < from) moved_before += a[i] != b[i];
        else moved_after += a[i] != b[i];
      }
  EXPECT_EQ(moved_before, 0u) << "outputs before position " << from << " saw later tokens";
  EXPECT_GT(moved_after, 0u) << "the change did not reach the positions it was made at";

  // dO zero from `from` on: no gradient reaches positions from..T-1.
  std::vector<float> dout = uniform(k.b * k.t * k.c(), 102);
  for (int64_t bi = 0; bi < k.b; ++bi)
    for (int64_t ti = from; ti < k.t; ++ti)
      for (int64_t col = 0; col < k.c(); ++col) dout[static_cast<size_t>((bi * k.t + ti) * k.c() + col)] = 0;
  Tensor dqkv = Tensor::zeros({k.b, k.t, k.w()}, DType::F32, kGpu);
  ops::attention_backward_fused(on_gpu(dout, {k.b, k.t, k.c()}), gchanged, out2, lse, dqkv, k.h,
                                k.g);
  const std::vector<float> g = to_host(dqkv);
  size_t late = 0, early = 0;
  for (int64_t bi = 0; bi < k.b; ++bi)
    for (int64_t ti = 0; ti < k.t; ++ti)
      for (int64_t col = 0; col < k.w(); ++col) {
        const float x = g[static_cast<size_t>((bi * k.t + ti) * k.w() + col)];
        if (ti >= from) late += x != 0.0f;
        else early += x != 0.0f;
      }
  EXPECT_EQ(late, 0u) << "positions from " << from << " on got gradient from earlier outputs";
  EXPECT_GT(early, 0u);
}

// A second call of a shape builds no graph and takes every buffer (bf16
// copies, cuDNN's workspace) from the caching allocator's free lists.
TEST_F(FusedAttention, SecondCallAllocatesNothing) {
  const Case k{2, 64, 4, 4, 64};
  Tensor qkv = on_gpu(uniform(k.b * k.t * k.w(), 111), {k.b, k.t, k.w()});
  Tensor dout = on_gpu(uniform(k.b * k.t * k.c(), 112), {k.b, k.t, k.c()});
  Tensor out = Tensor::zeros({k.b, k.t, k.c()}, DType::F32, kGpu);
  Tensor lse = Tensor::zeros({k.b, k.h, k.t}, DType::F32, kGpu);
  Tensor dqkv = Tensor::zeros({k.b, k.t, k.w()}, DType::F32, kGpu);
  cuda::Context& cx = cuda::context(0);
  ops::attention_forward_fused(qkv, out, lse, k.h, k.g);
  ops::attention_backward_fused(dout, qkv, out, lse, dqkv, k.h, k.g);
  cx.synchronize();
  const size_t mallocs = cx.allocator().stats().device_mallocs;
  const size_t graphs = cuda::fused_attention_graphs(cx);
  ops::attention_forward_fused(qkv, out, lse, k.h, k.g);
  ops::attention_backward_fused(dout, qkv, out, lse, dqkv, k.h, k.g);
  cx.synchronize();
  EXPECT_EQ(cx.allocator().stats().device_mallocs, mallocs);
  EXPECT_EQ(cuda::fused_attention_graphs(cx), graphs);
}

// The layer's stash: the lse (B, H, T) with the fused backend, where the
// unfused one keeps probs (B, H, T, T) (what the memory model measures).
TEST_F(FusedAttention, LayerKeepsOnlyTheLogSumExp) {
  const Case k{2, 64, 4, 4, 32};
  CausalSelfAttention layer(k.h, k.g);
  Tensor qkv = on_gpu(uniform(k.b * k.t * k.w(), 121), {k.b, k.t, k.w()});
  size_t stash[2] = {0, 0};
  for (int fused = 0; fused < 2; ++fused) {
    ops::set_attention_backend(kGpu, fused ? ops::AttentionBackend::Fused
                                           : ops::AttentionBackend::Unfused);
    Arena arena(kGpu);
    auto ctx = layer.make_ctx();
    Tensor out = Tensor::zeros({k.b, k.t, k.c()}, DType::F32, kGpu);
    Tensor in[1] = {qkv}, outs[1] = {out};
    layer.forward(*ctx, arena, in, outs);
    stash[fused] = arena.used();
  }
  ops::set_attention_backend(kGpu, ops::AttentionBackend::Auto);
  EXPECT_EQ(stash[0], Arena::bytes_for({k.b, k.h, k.t, k.t}));
  EXPECT_EQ(stash[1], Arena::bytes_for({k.b, k.h, k.t}));
}

TEST_F(FusedAttention, RefusesWhatCudnnDoesNotTake) {
  // Head size 12: not a multiple of 8.
  const Case k{1, 8, 2, 2, 12};
  Tensor qkv = Tensor::zeros({k.b, k.t, k.w()}, DType::F32, kGpu);
  Tensor out = Tensor::zeros({k.b, k.t, k.c()}, DType::F32, kGpu);
  Tensor lse = Tensor::zeros({k.b, k.h, k.t}, DType::F32, kGpu);
  EXPECT_TRUE(contains(error_message([&] { ops::attention_forward_fused(qkv, out, lse, k.h, k.g); }),
                       "head size 12 must be a multiple of 8"));
  // Auto leaves such a head size to the unfused path even with bf16 GEMMs.
  ops::set_matmul_precision(kGpu, ops::MatmulPrecision::Bf16);
  EXPECT_FALSE(ops::attention_uses_fused(kGpu, 12));
  EXPECT_TRUE(ops::attention_uses_fused(kGpu, 64));
  ops::set_matmul_precision(kGpu, ops::MatmulPrecision::Fp32);
  EXPECT_FALSE(ops::attention_uses_fused(kGpu, 64));
}

}  // namespace
}  // namespace weft

#endif  // WEFT_CUDA && WEFT_CUDNN
