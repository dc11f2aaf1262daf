// The training step's fused kernels on cuda:0 against the CPU through
// weft/ops.h:
// - the fused classifier (ops::fused_cross_entropy: losses and dlogits from
//   logits in one kernel) and the softmax it shares its kernel with
//   (ops::softmax_cross_entropy), against the CPU's two steps, for GPT-2's
//   padded vocabulary (50257 of 50304), V = 1000 and V = 37, at every T of
//   kSeqLengths (B = 2 up to T = 129, then 1);
// - the multi-tensor AdamW (ops::adamw_multi: one launch over every tensor)
//   against the per-tensor one, bit for bit, over several steps, with no
//   cudaMalloc once its table is built;
// - the gradient norm's and clipping's multi-tensor calls
//   (ops::sum_squares_multi: one wait for every tensor; ops::scale_multi)
//   against the CPU, the table built once and no cudaMalloc after;
// - a --bf16 step's weight copies (ops::convert_multi: one launch for every
//   tensor) against convert on each, bit for bit, the table built once.
// Needs a GPU; exits 77 (SKIP) without one.
#include "weft_config.h"

#if WEFT_CUDA
#include <weft/cuda/kernels.h>
#include <weft/cuda/runtime.h>
#include <weft/ops.h>
#include <weft/optimizer.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <tuple>
#include <vector>

#include "test_util.h"

namespace weft {
namespace {

using testing::kSeqLengths;
using testing::uniform;

const Device kGpu = Device::cuda(0);
const double kU = std::ldexp(1.0, -24);  // fp32's unit roundoff

Tensor host_tensor(const std::vector<float>& v, Shape shape) {
  Tensor t = Tensor::empty(shape);
  std::copy(v.begin(), v.end(), t.data<float>());
  return t;
}

Tensor on(const Tensor& t, Device d) {
  Tensor out = Tensor::empty(t.shape(), t.dtype(), d);
  out.copy_from(t);
  return out;
}

// ---------------------------------------------------------------- the fused classifier

// Error model. Logits are uniform in [-a, a), so every live column has
// |x - M| <= R = 2a below its row's max M. Each side computes
// p_j = fl(fl(exp(x_j - M)) * fl(1 / S)), S the sum of the exps:
// - an exp's argument is rounded (absolute R u, so R u relative after exp),
//   and expf is within 2 ulps (CUDA's documented bound; Eigen's vectorised exp
//   likewise): (R + 4) u per term. The GPU forms S's terms as
//   exp(x - m_t) exp(m_t - M) (m_t a thread's running max): (2R + 9) u;
// - S sums V terms: the CPU's order is Eigen's, so only the worst case for
//   any order, (V - 1) u, bounds it; the GPU's chain is known: per thread
//   ceil(V / 512) elements (at most one rescale each, 2 roundings), then 5
//   shuffle levels and 15 warp partials: D = 2 ceil(V / 512) + 20, or, with
//   float4 loads, 5 ceil(V / 2048) + 20 (a chunk of 4 adds and one rescale);
//   D = 5 ceil(V / 512) + 20 covers both;
// - 1 / S and the product: 2 u each side.
// So |p_gpu - p_cpu| <= p (V + 2D + 5R + 24) u, and dlogits = (p - onehot)
// scale add the product's rounding, u p scale a side, and at the target the
// subtraction's, u scale a side (|dlogit| <= scale).
// A loss, log S - (x_t - M), differs by S's part, (V + 2D + 3R + 16) u (both
// sides take the same x_t - M: M is an exact max), plus logf's and
// std::log's ulp of log S <= |loss| + R (2 u of it a side) and the
// difference's rounding (u |loss| a side): (6 |loss| + 4R) u.
// For V = 50304 the CPU's worst-case summation dominates (3e-3 relative), so
// the GPU's own sum of probabilities is held to its tight bound as well:
// |sum_j p_j - 1| <= (D + 3R + 12) u (S's terms against the output pass's
// exps, D's chain, 1 / S and the product), which an index that skips or
// repeats columns breaks.
struct ClassifierCase {
  int64_t b, t, v, real;  // real: columns of the vocabulary, the rest padding
};

int64_t gpu_chain(int64_t v) { return 5 * ((v + 511) / 512) + 20; }

void check_classifier(const ClassifierCase& c, uint64_t seed) {
  const int64_t n = c.b * c.t, v = c.v;
  const float a = 8.0f, scale = 1.0f / static_cast<float>(n);
  const double r = 2.0 * a, d = static_cast<double>(gpu_chain(v));
  const double p_rel = (static_cast<double>(v) + 2 * d + 5 * r + 24) * kU;
  const double s_abs = (static_cast<double>(v) + 2 * d + 3 * r + 16) * kU;
  const double sum_tol = (d + 3 * r + 12) * kU;

  Tensor logits = host_tensor(uniform(n * v, seed, -a, a), {n, v});
  Tensor targets = Tensor::empty({n}, DType::I32);
  const std::vector<float> u = uniform(n, seed + 1, 0.0f, static_cast<float>(c.real));
  for (int64_t i = 0; i < n; ++i)
    targets.data<int32_t>()[i] =
        std::min<int32_t>(static_cast<int32_t>(c.real - 1), static_cast<int32_t>(u[size_t(i)]));
  // One row's target at the last real column, one at the first.
  targets.data<int32_t>()[0] = static_cast<int32_t>(c.real - 1);
  if (n > 1) targets.data<int32_t>()[n - 1] = 0;

  // The CPU: mask, softmax and losses, then dlogits in place.
  Tensor probs = Tensor::empty({n, v});
  probs.copy_from(logits);
  ops::mask_columns(probs, c.real);
  Tensor losses = Tensor::zeros({n});
  const double total = ops::softmax_cross_entropy(probs, targets, losses);
  Tensor dlogits = Tensor::empty({n, v});
  dlogits.copy_from(probs);
  ops::cross_entropy_backward(dlogits, targets, 0, dlogits, scale);

  // The GPU: the fused classifier, and the softmax alone.
  const Tensor gt = on(targets, kGpu);
  Tensor gf = on(logits, kGpu), gfl = Tensor::zeros({n}, DType::F32, kGpu);
  ops::mask_columns(gf, c.real);
  const double gpu_total = ops::fused_cross_entropy(gf, gt, gfl, scale);
  Tensor gp = on(logits, kGpu), gpl = Tensor::zeros({n}, DType::F32, kGpu);
  ops::mask_columns(gp, c.real);
  const double gpu_total2 = ops::softmax_cross_entropy(gp, gt, gpl);
  const Tensor got_d = on(gf, Device::cpu()), got_l = on(gfl, Device::cpu());
  const Tensor got_p = on(gp, Device::cpu()), got_l2 = on(gpl, Device::cpu());

  const float* pw = probs.data<float>();
  const float* dw = dlogits.data<float>();
  const float* dg = got_d.data<float>();
  const float* pg = got_p.data<float>();
  int bad = 0;  // report the first few elements out of bounds, not all of them
  double loss_bound = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float lw = losses.data<float>()[i];
    const double lb = s_abs + (6 * std::fabs(static_cast<double>(lw)) + 4 * r) * kU;
    loss_bound += lb;
    EXPECT_LE(std::fabs(static_cast<double>(got_l.data<float>()[i]) - lw), lb)
        << "fused loss, row " << i << " of B " << c.b << " T " << c.t << " V " << v;
    EXPECT_LE(std::fabs(static_cast<double>(got_l2.data<float>()[i]) - lw), lb)
        << "softmax loss, row " << i << " of B " << c.b << " T " << c.t << " V " << v;
    double sum = 0;
    for (int64_t j = 0; j < v && bad < 10; ++j) {
      const size_t at = static_cast<size_t>(i * v + j);
      if (j >= c.real) {  // padding: exactly 0 on the GPU too
        if (dg[at] != 0.0f || pg[at] != 0.0f) {
          ++bad;
          ADD_FAILURE() << "padding column " << j << " of row " << i << ": dlogit " << dg[at]
                        << ", probability " << pg[at] << " (V " << v << " T " << c.t << ")";
        }
        continue;
      }
      const double p = pw[at];
      sum += pg[at];
      const double p_tol = p * p_rel * (1 + p_rel);
      const bool target = j == targets.data<int32_t>()[i];
      const double d_tol = scale * (p_tol + 2 * kU * p + (target ? 2 * kU : 0.0));
      if (std::fabs(pg[at] - p) > p_tol || std::fabs(static_cast<double>(dg[at]) - dw[at]) > d_tol) {
        ++bad;
        ADD_FAILURE() << "row " << i << " column " << j << " (target " << targets.data<int32_t>()[i]
                      << "): probability " << pg[at] << " vs " << p << " (bound " << p_tol
                      << "), dlogit " << dg[at] << " vs " << dw[at] << " (bound " << d_tol
                      << "); V " << v << " T " << c.t << " B " << c.b;
      }
    }
    if (bad < 10) {
      EXPECT_LE(std::fabs(sum - 1.0), sum_tol) << "row " << i << " V " << v << " T " << c.t;
    }
  }
  // The losses' sums: each in double over the same fp32 losses.
  EXPECT_LE(std::fabs(gpu_total - total), loss_bound + 1e-12 * std::fabs(total))
      << "V " << v << " T " << c.t;
  EXPECT_LE(std::fabs(gpu_total2 - total), loss_bound + 1e-12 * std::fabs(total))
      << "V " << v << " T " << c.t;

  // The same kernel writing bf16 dlogits to a separate buffer (bf16
  // activations' chunked LM head): the in-place fp32 dlogits rounded, bit
  // for bit (one arithmetic, another store), the same losses, the logits
  // unchanged. And the loss summed on the device (ops::sum into a tensor)
  // is the host's sum of the same losses rounded to float: the same
  // reduction kernels.
  Tensor gl = on(logits, kGpu), gbl = Tensor::zeros({n}, DType::F32, kGpu);
  ops::mask_columns(gl, c.real);
  const Tensor masked = on(gl, Device::cpu());
  Tensor gd16 = Tensor::empty({n, v}, DType::BF16, kGpu);
  ops::fused_cross_entropy_rows(gl, gt, gbl, scale, gd16);
  Tensor d16 = Tensor::empty({n, v});
  ops::convert(on(gd16, Device::cpu()), d16);
  const Tensor got_bl = on(gbl, Device::cpu()), after = on(gl, Device::cpu());
  int off = 0;
  for (int64_t i = 0; i < n * v && off < 10; ++i) {
    const float want = cuda::to_float(cuda::to_bf16(dg[i]));
    if (std::memcmp(&want, d16.data<float>() + i, sizeof(float)) != 0 ||
        std::memcmp(after.data<float>() + i, masked.data<float>() + i, sizeof(float)) != 0) {
      ++off;
      ADD_FAILURE() << "bf16 dlogits at " << i << ": " << d16.data<float>()[i] << ", want "
                    << want << "; logit after " << after.data<float>()[i]
                    << " (before " << masked.data<float>()[i] << "); V " << v << " T " << c.t;
    }
  }
  EXPECT_EQ(std::memcmp(got_bl.data<float>(), got_l.data<float>(), sizeof(float) * n), 0)
      << "bf16-dlogits losses; V " << v << " T " << c.t;
  Tensor on_device = Tensor::zeros({1}, DType::F32, kGpu);
  ops::sum(gfl, on_device);
  EXPECT_EQ(ops::item(on_device), static_cast<float>(gpu_total)) << "V " << v << " T " << c.t;

  // bf16 logits (bf16 activations' LM head), masked by the bf16 kernel and
  // replaced in place by bf16 dlogits: the kernel loads each logit widened
  // exactly and groups the row as the fp32 kernel does (four at a time where
  // v % 4 == 0, else one), so it gives, bit for bit, the fp32 classifier on
  // the widened logits, its dlogits rounded once. The same into a separate
  // bf16 buffer, the logits left as they were.
  Tensor g16 = Tensor::empty({n, v}, DType::BF16, kGpu);
  ops::convert(on(logits, kGpu), g16);
  ops::mask_columns(g16, c.real);
  Tensor wide = Tensor::empty({n, v}, DType::F32, kGpu);
  ops::convert(g16, wide);
  const Tensor logits16 = on(g16, Device::cpu());
  Tensor wl = Tensor::zeros({n}, DType::F32, kGpu), l16 = Tensor::zeros({n}, DType::F32, kGpu);
  Tensor l16b = Tensor::zeros({n}, DType::F32, kGpu);
  ops::fused_cross_entropy_rows(wide, gt, wl, scale);
  Tensor apart = Tensor::empty({n, v}, DType::BF16, kGpu);
  ops::fused_cross_entropy_rows(g16, gt, l16b, scale, apart);
  const Tensor unchanged = on(g16, Device::cpu());
  ops::fused_cross_entropy_rows(g16, gt, l16, scale, g16);
  const Tensor want_d = on(wide, Device::cpu());
  const Tensor got_in = on(g16, Device::cpu()), got_apart = on(apart, Device::cpu());
  const uint16_t* in_place = got_in.data<uint16_t>();
  const uint16_t* separate = got_apart.data<uint16_t>();
  off = 0;
  for (int64_t i = 0; i < n * v && off < 10; ++i) {
    const uint16_t want = cuda::to_bf16(want_d.data<float>()[i]).bits;
    if (in_place[i] != want || separate[i] != want ||
        unchanged.data<uint16_t>()[i] != logits16.data<uint16_t>()[i]) {
      ++off;
      ADD_FAILURE() << "bf16-logit dlogits at " << i << ": in place " << in_place[i]
                    << ", separate " << separate[i] << ", want " << want << "; V " << v << " T "
                    << c.t;
    }
  }
  for (int64_t j = c.real; j < v; ++j)  // the bf16 mask: -inf exactly
    EXPECT_EQ(logits16.data<uint16_t>()[j], 0xff80) << "column " << j << " V " << v;
  const Tensor want_l = on(wl, Device::cpu());
  const Tensor got_l16 = on(l16, Device::cpu()), got_l16b = on(l16b, Device::cpu());
  const size_t loss_bytes = sizeof(float) * static_cast<size_t>(n);
  EXPECT_EQ(std::memcmp(got_l16.data<float>(), want_l.data<float>(), loss_bytes), 0)
      << "bf16-logit losses (in place); V " << v << " T " << c.t;
  EXPECT_EQ(std::memcmp(got_l16b.data<float>(), want_l.data<float>(), loss_bytes), 0)
      << "bf16-logit losses (separate); V " << v << " T " << c.t;
}

TEST(CudaFusedClassifier, MatchesCpuAtEverySequenceLength) {
  uint64_t seed = 1000;
  for (const ClassifierCase vocab : {ClassifierCase{0, 0, 50304, 50257},
                                     ClassifierCase{0, 0, 1000, 1000}, ClassifierCase{0, 0, 37, 37}})
    for (const int64_t t : kSeqLengths) {
      ClassifierCase c = vocab;
      c.t = t;
      c.b = t <= 129 ? 2 : 1;  // the largest: 1024 x 50304 floats, 206 MB a copy
      check_classifier(c, seed += 7);
    }
}

// A target outside the vocabulary (the data reader refuses such tokens on
// the host; the kernel must not write out of bounds): a NaN loss, and
// dlogits p * scale with nothing subtracted.
TEST(CudaFusedClassifier, TargetOutsideTheRowGivesNaNAndNoStrayWrite) {
  const int64_t n = 2, v = 37;
  Tensor logits = host_tensor(uniform(n * v, 5, -4.0f, 4.0f), {n, v});
  Tensor targets = Tensor::empty({n}, DType::I32);
  targets.data<int32_t>()[0] = 3;
  targets.data<int32_t>()[1] = static_cast<int32_t>(v);
  Tensor g = on(logits, kGpu), gl = Tensor::zeros({n}, DType::F32, kGpu);
  ops::fused_cross_entropy(g, on(targets, kGpu), gl, 1.0f);
  const Tensor d = on(g, Device::cpu()), l = on(gl, Device::cpu());
  EXPECT_FALSE(std::isnan(l.data<float>()[0]));
  EXPECT_TRUE(std::isnan(l.data<float>()[1]));
  double sum = 0;
  for (int64_t j = 0; j < v; ++j) {
    EXPECT_GE(d.data<float>()[v + j], 0.0f) << j;
    sum += d.data<float>()[v + j];
  }
  EXPECT_NEAR(sum, 1.0, 1e-5);  // a probability row: nothing subtracted
}

// A NaN or +inf logit gives its row a NaN loss (so that the trainer sees a
// non-finite loss), wherever it falls: alone in a thread's share, with
// finite values, in a masked row's live part; the other rows stay finite.
TEST(CudaFusedClassifier, NonFiniteLogitsGiveANaNLoss) {
  for (const int64_t v : {int64_t{37}, int64_t{1000}, int64_t{50304}}) {
    const int64_t n = 6;
    Tensor logits = host_tensor(uniform(n * v, 7, -4.0f, 4.0f), {n, v});
    float* x = logits.data<float>();
    x[0 * v + 0] = NAN;                                   // the first column
    x[1 * v + v - 1] = NAN;                               // the last
    for (int64_t j = 0; j < v; ++j) x[2 * v + j] = NAN;   // every column
    x[3 * v + v / 2] = INFINITY;
    for (int64_t j = 1; j < v; ++j) x[4 * v + j] = -INFINITY;  // one live column: finite
    x[4 * v] = 1.0f;
    Tensor targets = Tensor::zeros({n}, DType::I32);
    for (const bool fused : {false, true}) {
      Tensor g = on(logits, kGpu), gl = Tensor::zeros({n}, DType::F32, kGpu);
      const double total = fused ? ops::fused_cross_entropy(g, on(targets, kGpu), gl, 0.5f)
                                 : ops::softmax_cross_entropy(g, on(targets, kGpu), gl);
      const Tensor l = on(gl, Device::cpu());
      for (int64_t i = 0; i < 4; ++i)
        EXPECT_TRUE(std::isnan(l.data<float>()[i])) << "row " << i << " V " << v << " fused " << fused;
      EXPECT_EQ(l.data<float>()[4], 0.0f) << "V " << v;  // p = 1 at the one live column
      EXPECT_FALSE(std::isnan(l.data<float>()[5])) << "V " << v;
      EXPECT_TRUE(std::isnan(total));
    }
  }
}

// ---------------------------------------------------------------- multi-tensor AdamW

// Odd sizes (a chunk is 16384 elements: 65537 spans five, the last of one
// element), both decay groups, moments and parameters updated over steps
// with a changing learning rate. Chunks of a multiple of 4 elements on
// 16-byte aligned arrays take the kernel's 16-byte path; the last tensor's
// arrays are views one element into larger ones (4-byte aligned), so its
// chunks take the scalar one. The per-element arithmetic is the same
// function everywhere and the scalars are computed the same way on the
// host, so the results are equal bit for bit, not within a tolerance.
TEST(CudaAdamWMulti, EqualsThePerTensorUpdateBitForBit) {
  const std::vector<int64_t> sizes = {1, 3, 1000, 65537, 16384, 7, 50304 * 4 + 1, 4096};
  const size_t offset_one = sizes.size() - 1;  // its arrays start one element in
  struct Set {
    std::vector<Tensor> p, g, m, v;
  };
  auto make = [&]() {
    Set s;
    uint64_t seed = 40;
    for (size_t i = 0; i < sizes.size(); ++i) {
      const int64_t n = sizes[i], k = i == offset_one ? 1 : 0;
      auto in = [&](const Tensor& t) { return k ? t.slice0(k, k + n) : t; };
      s.p.push_back(in(on(host_tensor(uniform(n + k, seed++), {n + k}), kGpu)));
      s.g.push_back(in(on(host_tensor(uniform(n + k, seed++, -0.1f, 0.1f), {n + k}), kGpu)));
      s.m.push_back(in(Tensor::zeros({n + k}, DType::F32, kGpu)));
      s.v.push_back(in(Tensor::zeros({n + k}, DType::F32, kGpu)));
    }
    return s;
  };
  Set one = make(), all = make();
  std::shared_ptr<void> cache;
  const float wd = 0.1f;
  size_t mallocs = 0;
  for (int64_t step = 1; step <= 5; ++step) {
    const float lr = 1e-3f * static_cast<float>(step) / 3.0f;  // warmup-like, not a constant
    std::vector<ops::AdamWTensors> ts;
    for (size_t i = 0; i < sizes.size(); ++i) {
      const bool decay = i % 2 == 0;
      ops::adamw(one.p[i], one.g[i], one.m[i], one.v[i],
                 {lr, 0.9f, 0.95f, 1e-8f, decay ? wd : 0.0f, step});
      ts.push_back({all.p[i], all.g[i], all.m[i], all.v[i], decay});
    }
    if (step == 3) mallocs = cuda::context(0).allocator().stats().device_mallocs;
    ops::adamw_multi(ts, {lr, 0.9f, 0.95f, 1e-8f, wd, step}, cache);
    // New gradients for the next step (the same in both sets).
    for (size_t i = 0; i < sizes.size(); ++i) {
      const Tensor g = on(host_tensor(uniform(sizes[i], 100 + 10 * step + i, -0.1f, 0.1f),
                                      {sizes[i]}),
                          kGpu);
      one.g[i].copy_from(g);
      all.g[i].copy_from(g);
    }
  }
  // Steps 3 to 5 reused the table: no cudaMalloc.
  EXPECT_EQ(cuda::context(0).allocator().stats().device_mallocs, mallocs);
  for (size_t i = 0; i < sizes.size(); ++i)
    for (const auto& [a, b, what] : {std::tuple{one.p[i], all.p[i], "parameter"},
                                     std::tuple{one.m[i], all.m[i], "exp_avg"},
                                     std::tuple{one.v[i], all.v[i], "exp_avg_sq"}}) {
      const Tensor ha = on(a, Device::cpu()), hb = on(b, Device::cpu());
      EXPECT_EQ(std::memcmp(ha.data<float>(), hb.data<float>(),
                            static_cast<size_t>(sizes[i]) * sizeof(float)),
                0)
          << what << " of tensor " << i << " (" << sizes[i] << " elements)";
    }
}

// A clip folded into the update: adamw_multi and adamw reading each gradient
// times a scale give the bits of scale_multi first, then the update with no
// scale (both kernel paths: the last tensor's arrays start one element in),
// and leave the gradients as they were.
TEST(CudaAdamWMulti, AGradScaleGivesTheBitsOfScalingTheGradientsFirst) {
  const std::vector<int64_t> sizes = {3, 65537, 16384, 50304 * 4 + 1, 4096};
  const float scale = 0.37f;
  auto tensor = [](int64_t n, uint64_t seed, bool offset, float lo = -0.5f) {
    const int64_t k = offset ? 1 : 0;
    const Tensor t = on(host_tensor(uniform(n + k, seed, lo, 0.5f), {n + k}), kGpu);
    return offset ? t.slice0(k, k + n) : t;
  };
  // Sets 0 (scaled first), 1 (adamw_multi with the scale), 2 (adamw with
  // it), 3 and 4 (the same, reading the scale from the device).
  std::vector<std::vector<ops::AdamWTensors>> sets(5);
  for (auto& set : sets)
    for (size_t i = 0; i < sizes.size(); ++i) {
      const bool offset = i + 1 == sizes.size();
      set.push_back({tensor(sizes[i], 60 + i, offset), tensor(sizes[i], 70 + i, offset),
                     tensor(sizes[i], 80 + i, offset), tensor(sizes[i], 90 + i, offset, 0.0f),
                     i % 2 == 0});  // second moments are not negative
    }
  const Tensor g_before = on(sets[1][1].g, Device::cpu());
  std::shared_ptr<void> scale_cache, cache0, cache1;
  std::vector<Tensor> grads0;
  for (const auto& t : sets[0]) grads0.push_back(t.g);
  ops::scale_multi(grads0, scale, scale_cache);
  ops::adamw_multi(sets[0], {1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 7}, cache0);
  ops::adamw_multi(sets[1], {1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 7, scale}, cache1);
  for (const auto& t : sets[2])
    ops::adamw(t.p, t.g, t.m, t.v, {1e-3f, 0.9f, 0.95f, 1e-8f, t.decay ? 0.1f : 0.0f, 7, scale});
  // The host's scale argument is ignored where the device's is given.
  const Tensor scale_at = on(host_tensor({scale}, {1}), kGpu);
  std::shared_ptr<void> cache3;
  ops::adamw_multi(sets[3], {1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 7, 5.0f}, cache3, scale_at);
  for (const auto& t : sets[4])
    ops::adamw(t.p, t.g, t.m, t.v, {1e-3f, 0.9f, 0.95f, 1e-8f, t.decay ? 0.1f : 0.0f, 7, 5.0f},
               scale_at);
  auto same = [](const Tensor& a, const Tensor& b) {
    const Tensor ha = on(a, Device::cpu()), hb = on(b, Device::cpu());
    return std::memcmp(ha.raw(), hb.raw(), ha.nbytes()) == 0;
  };
  for (size_t i = 0; i < sizes.size(); ++i)
    for (size_t k = 1; k < sets.size(); ++k) {
      EXPECT_TRUE(same(sets[k][i].p, sets[0][i].p)) << "parameter " << i << ", set " << k;
      EXPECT_TRUE(same(sets[k][i].m, sets[0][i].m)) << "exp_avg " << i << ", set " << k;
      EXPECT_TRUE(same(sets[k][i].v, sets[0][i].v)) << "exp_avg_sq " << i << ", set " << k;
    }
  EXPECT_TRUE(same(sets[1][1].g, g_before)) << "the gradient was changed";
  EXPECT_FALSE(same(sets[0][1].g, g_before)) << "scale_multi did nothing";
}

// Lion on the GPU against the CPU's (src/runtime/lion.cc): the same
// per-element formula, each side free to fuse a multiply and an add, so a
// sum of two products differs by up to 2u of its terms' magnitudes (not of
// the result: b2 m and (1 - b2) g may cancel). Over two steps, with the
// first step's error carried into the second: 8u (|m| + |m0| + |g s|) for the
// momentum, 8u (|p| + lr) for the weight. The step is lr times the sign of
// c = b1 m + (1 - b1) g s, which agrees wherever c is not within that
// rounding of 0 (uniform data: nowhere but where it is exactly 0); a sign
// that differed would move the weight by 2 lr, far outside the bound. An
// element with no gradient and no momentum moves by its decay alone. The
// scale is read from the device where given (the host's 5 is ignored).
TEST(CudaLion, MatchesTheCpuAndReadsTheScaleOnTheDevice) {
  const int64_t n = 4099;
  Tensor p = host_tensor(uniform(n, 31, -1.0f, 1.0f), {n});
  Tensor g = host_tensor(uniform(n, 32, -1.0f, 1.0f), {n});
  Tensor m = host_tensor(uniform(n, 33, -0.1f, 0.1f), {n});
  for (int64_t i = 0; i < 8; ++i) g.data<float>()[i] = 0.0f, m.data<float>()[i] = 0.0f;
  Tensor pg = on(p, kGpu), gg = on(g, kGpu), mg = on(m, kGpu);
  const std::vector<float> m0(m.data<float>(), m.data<float>() + n);
  const Tensor scale_at = on(host_tensor({0.5f}, {1}), kGpu);
  const std::vector<float> p_before(p.data<float>(), p.data<float>() + n);
  for (int step = 0; step < 2; ++step) {
    ops::lion(p, g, m, 1e-3f, 0.9f, 0.99f, 0.1f, 0.5f);
    ops::lion(pg, gg, mg, 1e-3f, 0.9f, 0.99f, 0.1f, 5.0f, scale_at);
  }
  const Tensor hp = on(pg, Device::cpu()), hm = on(mg, Device::cpu());
  for (int64_t i = 0; i < n; ++i) {
    const double mi = m.data<float>()[i], pi = p.data<float>()[i];
    const double gs = 0.5 * std::abs(g.data<float>()[i]);
    const size_t u = static_cast<size_t>(i);
    EXPECT_NEAR(hm.data<float>()[i], mi, 8 * kU * (std::abs(mi) + std::abs(m0[u]) + gs)) << i;
    EXPECT_NEAR(hp.data<float>()[i], pi, 8 * kU * (std::abs(pi) + 1e-3)) << i;
  }
  const float decayed = (1.0f - 1e-3f * 0.1f) * ((1.0f - 1e-3f * 0.1f) * p_before[3]);
  EXPECT_EQ(hp.data<float>()[3], decayed) << "no gradient, no momentum: decay alone";
}

// The same parameter set reuses the table; another one rebuilds it, and
// only its tensors are updated.
TEST(CudaAdamWMulti, RebuildsOnlyWhenTheTensorsChange) {
  std::vector<Tensor> p, g, m, v;
  for (const int64_t n : {int64_t{5}, int64_t{70000}}) {
    p.push_back(Tensor::zeros({n}, DType::F32, kGpu));
    g.push_back(on(host_tensor(std::vector<float>(static_cast<size_t>(n), 1.0f), {n}), kGpu));
    m.push_back(Tensor::zeros({n}, DType::F32, kGpu));
    v.push_back(Tensor::zeros({n}, DType::F32, kGpu));
  }
  std::shared_ptr<void> cache;
  const std::vector<ops::AdamWTensors> both = {{p[0], g[0], m[0], v[0], true},
                                               {p[1], g[1], m[1], v[1], false}};
  auto builds = [&] { return static_cast<cuda::AdamWTable*>(cache.get())->builds(); };
  ops::adamw_multi(both, {1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 1}, cache);
  EXPECT_EQ(builds(), 1);
  EXPECT_EQ(static_cast<cuda::AdamWTable*>(cache.get())->chunks(), 1 + 5);  // 70000 = 4 x 16384 + 4464
  const size_t mallocs = cuda::context(0).allocator().stats().device_mallocs;
  ops::adamw_multi(both, {1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 2}, cache);
  EXPECT_EQ(builds(), 1);
  EXPECT_EQ(cuda::context(0).allocator().stats().device_mallocs, mallocs);
  // The first tensor alone: the second, with a gradient of 1, must not move.
  const Tensor before = on(p[1], Device::cpu());
  ops::adamw_multi({both[0]}, {1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 3}, cache);
  EXPECT_EQ(builds(), 2);
  const Tensor after = on(p[1], Device::cpu());
  EXPECT_EQ(std::memcmp(before.data<float>(), after.data<float>(), 70000 * sizeof(float)), 0);
  EXPECT_NE(on(p[0], Device::cpu()).data<float>()[0], 0.0f);  // and the first did
}

// ---------------------------------------------------------------- the gradient norm and clipping

// Sizes around a chunk (16384 elements): empty, under one, one and a bit,
// several and a remainder, one of 74 chunks (1.2 million elements), with
// small ones between.
const std::vector<int64_t> kNormSizes = {0, 1, 16383, 16385, 3 * 16384 + 5, 7, 50304 * 24 + 1, 0,
                                         100003};

int64_t chunks_of(const std::vector<int64_t>& sizes) {
  int64_t c = 0;
  for (const int64_t n : sizes) c += (n + 16383) / 16384;
  return c;
}

struct NormSet {
  std::vector<Tensor> host, gpu;
};
NormSet norm_set(const std::vector<int64_t>& sizes, uint64_t seed) {
  NormSet s;
  for (const int64_t n : sizes) {
    s.host.push_back(host_tensor(uniform(n, seed++, -3.0f, 2.0f), {n}));
    s.gpu.push_back(on(s.host.back(), kGpu));
  }
  return s;
}

// Error model: both sides add exact terms (a float's square is exact in
// double), non-negative, in double: the CPU tensor by tensor, the GPU by
// chunk partials and a fixed tree. Any order of m such terms is within
// (m - 1) 2^-53 of the exact sum, relative, so the two differ by at most
// 2 m 2^-53 = m 2^-52 of it. The GPU's order is fixed by the chunks alone,
// so every call gives the same bits; the table is built once for the set,
// and a steady call takes no memory from cudaMalloc.
TEST(CudaMultiTensor, SumSquaresMatchesTheCpuOnceBuiltAndDeterministic) {
  const NormSet s = norm_set(kNormSizes, 70);
  int64_t m = 0;
  for (const int64_t n : kNormSizes) m += n;
  std::shared_ptr<void> host_cache, cache;
  const double want = ops::sum_squares_multi(s.host, host_cache);
  const double got = ops::sum_squares_multi(s.gpu, cache);
  EXPECT_NEAR(got, want, static_cast<double>(m) * std::ldexp(1.0, -52) * want);
  auto& table = *static_cast<cuda::MultiTensorTable*>(cache.get());
  EXPECT_EQ(table.builds(), 1);
  EXPECT_EQ(table.chunks(), chunks_of(kNormSizes));
  const size_t mallocs = cuda::context(0).allocator().stats().device_mallocs;
  for (int k = 0; k < 3; ++k) {
    const double again = ops::sum_squares_multi(s.gpu, cache);
    EXPECT_EQ(std::memcmp(&again, &got, sizeof got), 0) << "call " << k + 2 << ": " << again
                                                        << " after " << got;
  }
  EXPECT_EQ(table.builds(), 1);
  EXPECT_EQ(cuda::context(0).allocator().stats().device_mallocs, mallocs);

  // Another set (a subset: two tensors) rebuilds the table and sums only its tensors.
  const std::vector<Tensor> two = {s.gpu[3], s.gpu[6]}, two_host = {s.host[3], s.host[6]};
  const double want_two = ops::sum_squares_multi(two_host, host_cache);
  EXPECT_NEAR(ops::sum_squares_multi(two, cache), want_two,
              static_cast<double>(kNormSizes[3] + kNormSizes[6]) * std::ldexp(1.0, -52) * want_two);
  EXPECT_EQ(table.builds(), 2);
  EXPECT_EQ(table.chunks(), chunks_of({kNormSizes[3], kNormSizes[6]}));

  // Accumulated in double on the GPU too: 1e20 squared overflows float.
  std::vector<float> big(20000, 1e20f);
  const std::vector<Tensor> big_gpu = {on(host_tensor(big, {20000}), kGpu)};
  std::shared_ptr<void> big_cache;
  const double b = ops::sum_squares_multi(big_gpu, big_cache);
  const double b_want = 20000.0 * static_cast<double>(1e20f) * static_cast<double>(1e20f);
  EXPECT_NEAR(b, b_want, 20000.0 * std::ldexp(1.0, -52) * b_want);

  // No tensors, or none with an element: 0, and no table to build.
  std::shared_ptr<void> none;
  EXPECT_EQ(ops::sum_squares_multi({}, none), 0.0);
  EXPECT_EQ(ops::sum_squares_multi({Tensor::zeros({0}, DType::F32, kGpu)}, none), 0.0);
}

// The gradient norm and the clip's coefficient left on the device (a step
// whose host never reads them): the float total is the host total rounded,
// bit for bit; the coefficient is weft::clip_coefficient's bits, for
// coefficients that round (the double quotient is not a float), for 1 (a
// norm under the bound, and clipping off), and for a norm of 0; scale_multi
// reading its factor on the device is the host factor's scale_multi.
TEST(CudaMultiTensor, NormAndClipCoefficientStayOnTheDeviceWithTheHostsBits) {
  const NormSet s = norm_set(kNormSizes, 71);
  std::shared_ptr<void> cache, device_cache;
  const double total = ops::sum_squares_multi(s.gpu, cache);
  const Tensor sum = Tensor::zeros({1}, DType::F32, kGpu);
  ops::sum_squares_multi(s.gpu, device_cache, sum);
  const float want_sum = static_cast<float>(total);
  EXPECT_EQ(std::bit_cast<uint32_t>(ops::item(sum)), std::bit_cast<uint32_t>(want_sum));
  std::shared_ptr<void> none;
  ops::sum_squares_multi({}, none, sum);
  EXPECT_EQ(ops::item(sum), 0.0f) << "no tensors: 0";

  const Tensor sq = Tensor::zeros({1}, DType::F32, kGpu), coef = Tensor::zeros({1}, DType::F32, kGpu);
  for (const float sumsq : {want_sum, 3.0f, 0.7f, 1e-30f, 0.0f, 1.0f, 123456.79f})
    for (const double max_norm : {1.0, 0.3, 0.0, 7.5}) {
      ops::set_item(sq, sumsq);
      ops::clip_coefficient(sq, max_norm, coef);
      const float want = clip_coefficient(max_norm, std::sqrt(static_cast<double>(sumsq)));
      EXPECT_EQ(std::bit_cast<uint32_t>(ops::item(coef)), std::bit_cast<uint32_t>(want))
          << "sum of squares " << sumsq << ", max norm " << max_norm;
    }

  const NormSet a = norm_set(kNormSizes, 72), b = norm_set(kNormSizes, 72);
  std::shared_ptr<void> ca, cb;
  ops::set_item(coef, 0.37f);
  ops::scale_multi(a.gpu, 0.37f, ca);
  ops::scale_multi(b.gpu, coef, cb);
  for (size_t t = 0; t < kNormSizes.size(); ++t) {
    const size_t bytes = static_cast<size_t>(kNormSizes[t]) * sizeof(float);
    if (bytes == 0) continue;
    const Tensor ha = on(a.gpu[t], Device::cpu()), hb = on(b.gpu[t], Device::cpu());
    EXPECT_EQ(std::memcmp(ha.raw(), hb.raw(), bytes), 0) << "tensor " << t;
  }
}

// scale_multi on the GPU is the CPU's scale, bit for bit (one correctly
// rounded float product per element on both), and the GPU's per-tensor
// scale; a steady call reuses its table and allocates nothing.
TEST(CudaMultiTensor, ScaleEqualsTheCpuBitForBit) {
  const float f = 0.7f;  // no power of two: most products round
  const NormSet s = norm_set(kNormSizes, 90);
  const NormSet one = norm_set(kNormSizes, 90);
  const Tensor outside = on(host_tensor(uniform(5, 9), {5}), kGpu);
  std::shared_ptr<void> host_cache, cache;
  ops::scale_multi(s.gpu, f, cache);
  ops::scale_multi(s.host, f, host_cache);
  for (size_t t = 0; t < kNormSizes.size(); ++t) {
    ops::scale(one.gpu[t], f);
    const Tensor got = on(s.gpu[t], Device::cpu()), per_tensor = on(one.gpu[t], Device::cpu());
    const size_t bytes = static_cast<size_t>(kNormSizes[t]) * sizeof(float);
    if (bytes == 0) continue;  // (an empty tensor's data may be null: nothing to compare)
    EXPECT_EQ(std::memcmp(got.data<float>(), s.host[t].data<float>(), bytes), 0)
        << "tensor " << t << " (" << kNormSizes[t] << " elements) against the CPU";
    EXPECT_EQ(std::memcmp(got.data<float>(), per_tensor.data<float>(), bytes), 0)
        << "tensor " << t << " against ops::scale";
  }
  const Tensor outside_after = on(outside, Device::cpu());
  const std::vector<float> outside_want = uniform(5, 9);
  EXPECT_EQ(std::memcmp(outside_after.data<float>(), outside_want.data(), 5 * sizeof(float)), 0);
  auto& table = *static_cast<cuda::MultiTensorTable*>(cache.get());
  const size_t mallocs = cuda::context(0).allocator().stats().device_mallocs;
  ops::scale_multi(s.gpu, 1.0f / f, cache);
  EXPECT_EQ(table.builds(), 1);
  EXPECT_EQ(cuda::context(0).allocator().stats().device_mallocs, mallocs);
}

// ---------------------------------------------------------------- the weights' bf16 copies

// Sizes around a chunk (16384 elements): empty ones, under one, exactly
// one, one and a bit, several and a remainder, a LayerNorm's 768, and one of
// 74 chunks (GPT-2's tied embedding's rows, a slice of them).
const std::vector<int64_t> kConvertSizes = {0,   1, 16383, 16384, 16385, 3 * 16384 + 5, 768, 0,
                                            50304 * 24 + 1, 7};

// Rounding to bf16 is exact arithmetic (no accumulation, one rounding per
// element), and convert_multi's kernel rounds with the per-tensor kernel's
// intrinsic, so the copies are equal bit for bit: to GPU convert on each
// tensor, and to the CPU's to_bf16 (round to nearest even; NaN checked as a
// NaN only). Ties, an overflow to infinity, infinities, a subnormal and a NaN
// sit at a chunk's edge. A second call with the same tensors reuses the
// table (no rebuild, no cudaMalloc) and copies the values as they are then;
// another list rebuilds it and writes only its own tensors.
TEST(CudaMultiTensor, ConvertEqualsThePerTensorConvertBitForBit) {
  std::vector<Tensor> host, srcs, dsts, want;
  uint64_t seed = 300;
  for (const int64_t n : kConvertSizes) {
    host.push_back(host_tensor(uniform(n, seed++, -4.0f, 4.0f), {n}));
    if (n == 16385) {  // the last 8 elements: across the first chunk's end (16384)
      const std::vector<float> special = {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, 3.4e38f, INFINITY,
                                          -INFINITY,      0x1p-140f,          -0.0f,   NAN};
      std::copy(special.begin(), special.end(), host.back().data<float>() + n - 8);
    }
    srcs.push_back(on(host.back(), kGpu));
    dsts.push_back(Tensor::zeros({n}, DType::BF16, kGpu));
    want.push_back(Tensor::zeros({n}, DType::BF16, kGpu));
  }
  // Bits of the GPU's copies against GPU convert on each tensor and the CPU's.
  auto expect_same = [&](const char* when) {
    for (size_t t = 0; t < kConvertSizes.size(); ++t) {
      const int64_t n = kConvertSizes[t];
      if (n == 0) continue;  // (an empty tensor's data may be null: nothing to compare)
      ops::convert(srcs[t], want[t]);
      const Tensor got = on(dsts[t], Device::cpu()), per_tensor = on(want[t], Device::cpu());
      const Tensor src = on(srcs[t], Device::cpu());
      EXPECT_EQ(std::memcmp(got.raw(), per_tensor.raw(), static_cast<size_t>(n) * 2), 0)
          << when << ": tensor " << t << " (" << n << " elements) against ops::convert";
      int64_t bad = 0;
      for (int64_t i = 0; i < n; ++i) {
        const float x = src.data<float>()[i];
        const uint16_t g = got.data<uint16_t>()[i];
        bad += std::isnan(x) ? !std::isnan(cuda::to_float(cuda::bf16{g})) : g != cuda::to_bf16(x).bits;
      }
      EXPECT_EQ(bad, 0) << when << ": tensor " << t << " against the CPU's rounding";
    }
  };
  std::shared_ptr<void> cache;
  ops::convert_multi(srcs, dsts, cache);
  expect_same("first call");
  auto& table = *static_cast<cuda::ConvertTable*>(cache.get());
  EXPECT_EQ(table.builds(), 1);
  EXPECT_EQ(table.chunks(), chunks_of(kConvertSizes));

  // New values in the same tensors (an optimizer step): the same table.
  for (const Tensor& x : srcs) ops::scale(x, 0.3f);
  const size_t mallocs = cuda::context(0).allocator().stats().device_mallocs;
  ops::convert_multi(srcs, dsts, cache);
  EXPECT_EQ(table.builds(), 1);
  EXPECT_EQ(cuda::context(0).allocator().stats().device_mallocs, mallocs);
  expect_same("second call, new values");

  // Another list (two of the tensors) rebuilds the table; the others keep
  // the second call's copies.
  const Tensor kept = on(dsts[4], Device::cpu());
  for (const Tensor& x : srcs) ops::scale(x, 2.0f);
  ops::convert_multi({srcs[3], srcs[8]}, {dsts[3], dsts[8]}, cache);
  EXPECT_EQ(table.builds(), 2);
  EXPECT_EQ(table.chunks(), chunks_of({kConvertSizes[3], kConvertSizes[8]}));
  const Tensor kept_after = on(dsts[4], Device::cpu());
  EXPECT_EQ(std::memcmp(kept.raw(), kept_after.raw(), static_cast<size_t>(kConvertSizes[4]) * 2),
            0);
  ops::convert(srcs[3], want[3]);
  const Tensor got3 = on(dsts[3], Device::cpu()), want3 = on(want[3], Device::cpu());
  EXPECT_EQ(std::memcmp(got3.raw(), want3.raw(), static_cast<size_t>(kConvertSizes[3]) * 2), 0);

  // No tensors, or none with an element: nothing launched, no error.
  std::shared_ptr<void> none;
  ops::convert_multi({}, {}, none);
  ops::convert_multi({Tensor::zeros({0}, DType::F32, kGpu)},
                     {Tensor::zeros({0}, DType::BF16, kGpu)}, none);
}

}  // namespace
}  // namespace weft

#endif  // WEFT_CUDA
