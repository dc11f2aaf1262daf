// The bf16-activation overloads of weft/cuda/kernels.h against their fp32
// twins on the device. Inputs are random values already representable in
// bf16, so that the fp32 kernel sees exactly the values the bf16 kernel
// widens. Each templated kernel does the fp32 arithmetic of its twin and
// rounds once on the store, so:
//   - a bf16 output equals, bit for bit, the host's round-to-nearest-even of
//     the fp32 kernel's output (cuda::to_bf16, __float2bfloat16_rn's twin);
//   - an fp32 output (mean, rstd, dw, db) equals the fp32 kernel's bit for
//     bit.
// Gradients of bf16 activations are bf16 too (dy, dx); a gradient that is
// accumulated into is read widened, so the fp32 kernel, given the widened
// starting values, computes exactly what the bf16 one rounds.
// The GEMM (cuBLAS may pick another algorithm for bf16 C) and cuDNN's fused
// attention (its backward accumulates in an order that varies from run to
// run) are held to error models written beside them instead. Shapes are
// ragged (C = 200, 77; T = 37) so that partial warps and tiles are exercised.
// Needs a GPU; exits 77 (SKIP) without one.
#include "weft_config.h"

#if WEFT_CUDA
#include <weft/cuda/kernels.h>
#include <weft/cuda/runtime.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cuda_test_util.h"
#include "test_util.h"

namespace weft::cuda {
namespace {

using test_util::Dev;
using test_util::expect_within;

using weft::testing::uniform;

Context& ctx() { return context(0); }

// Uniform values in [lo, hi) rounded to bf16.
std::vector<bf16> bf16_uniform(int64_t n, uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::vector<bf16> r;
  for (float f : uniform(n, seed, lo, hi)) r.push_back(to_bf16(f));
  return r;
}

std::vector<float> widened(const std::vector<bf16>& x) {
  std::vector<float> r;
  for (bf16 h : x) r.push_back(to_float(h));
  return r;
}

// got[i] is the bf16 rounding of want[i], bit for bit, for every i.
void expect_rounded(const std::vector<bf16>& got, const std::vector<float>& want,
                    const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i].bits != to_bf16(want[i]).bits && bad++ == 0) first = i;
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size()
                     << " elements are not the fp32 kernel's output rounded; first at " << first
                     << ": got " << to_float(got[first]) << " (bits " << got[first].bits
                     << "), fp32 kernel " << want[first] << " rounds to bits "
                     << to_bf16(want[first]).bits;
}

// got[i] == want[i] bit for bit.
void expect_same_bits(const std::vector<float>& got, const std::vector<float>& want,
                      const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (std::bit_cast<uint32_t>(got[i]) != std::bit_cast<uint32_t>(want[i]) && bad++ == 0)
      first = i;
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size()
                     << " elements differ from the fp32 kernel's; first at " << first << ": got "
                     << got[first] << ", fp32 kernel " << want[first];
}

// ---------------------------------------------------------------- LayerNorm

// Forward, both backwards, on ragged shapes and on enough rows for the
// weight gradient's column sums to use many row slices. Widths that are
// multiples of 8 take the 16-byte kernels, each lane owning 1 (C 200: 25 of a
// warp's 32 groups; C 96), 2 (C 392), 3 (C 768), 4 (C 1024), 6 (C 1288) or 8
// (C 1800, the last partial) groups of 8; C 77 (not a multiple of 8) and
// C 2056 (past 2048) take the scalar ones.
TEST(CudaBf16LayerNorm, EveryOutputIsTheFp32KernelsOutputRounded) {
  for (auto [n, c] : {std::pair<int64_t, int64_t>{45, 200},
                      {8192 + 13, 96},
                      {9, 77},
                      {6, 392},
                      {33, 768},
                      {11, 1024},
                      {5, 1288},
                      {7, 1800},
                      {3, 2056}}) {
    SCOPED_TRACE(::testing::Message() << "n " << n << " c " << c);
    const std::vector<bf16> x16 = bf16_uniform(n * c, 1, -2.0f, 3.0f),
                            dy16 = bf16_uniform(n * c, 4), dx16 = bf16_uniform(n * c, 5);
    const std::vector<float> x = widened(x16), w = uniform(c, 2), b = uniform(c, 3),
                             dy = widened(dy16), dx0 = widened(dx16), dw0 = uniform(c, 6),
                             db0 = uniform(c, 7), junk = uniform(n * c, 8);
    // fp32 kernels on the widened input
    Dev<float> fx(x), fw(w), fb(b), fdy(dy), fy(junk), fmean(uniform(n, 9)), frstd(uniform(n, 10));
    Dev<float> fdx(dx0), fdw(dw0), fdb(db0);
    layernorm_forward(ctx(), fx.p(), fw.p(), fb.p(), fy.p(), fmean.p(), frstd.p(), n, c, 1e-5f);
    layernorm_backward_input(ctx(), fdy.p(), fx.p(), fw.p(), fmean.p(), frstd.p(), fdx.p(), n, c);
    layernorm_backward_weight(ctx(), fdy.p(), fx.p(), fmean.p(), frstd.p(), fdw.p(), fdb.p(), n,
                              c);
    // bf16 overloads; outputs start as other values than the fp32 run's
    Dev<bf16> hx(x16), hy(bf16_uniform(n * c, 11)), hdy(dy16), hdx(dx16);
    Dev<float> hmean(uniform(n, 12)), hrstd(uniform(n, 13)), hdw(dw0), hdb(db0);
    layernorm_forward(ctx(), hx.p(), fw.p(), fb.p(), hy.p(), hmean.p(), hrstd.p(), n, c, 1e-5f);
    layernorm_backward_input(ctx(), hdy.p(), hx.p(), fw.p(), hmean.p(), hrstd.p(), hdx.p(), n, c);
    layernorm_backward_weight(ctx(), hdy.p(), hx.p(), hmean.p(), hrstd.p(), hdw.p(), hdb.p(), n,
                              c);
    expect_rounded(hy.host(), fy.host(), "y");
    expect_same_bits(hmean.host(), fmean.host(), "mean");
    expect_same_bits(hrstd.host(), frstd.host(), "rstd");
    expect_rounded(hdx.host(), fdx.host(), "dx");
    expect_same_bits(hdw.host(), fdw.host(), "dw");
    expect_same_bits(hdb.host(), fdb.host(), "db");
  }
}

// The residual add fused with LayerNorm, in fp32 and bf16: one kernel each
// way gives the bits of the add, then LayerNorm on its output (forward), and
// of LayerNorm's input gradient added to the sum's, then copied (backward).
// Widths the 16-byte kernel does not take say so and launch nothing.
template <class T>
void expect_fused_residual_layernorm_bits(int64_t n, int64_t c, std::vector<T> x,
                                          std::vector<T> a, std::vector<T> dy,
                                          std::vector<T> ds0, const char* what) {
  SCOPED_TRACE(what);
  const std::vector<float> w = uniform(c, 22, 0.5f, 1.5f), b = uniform(c, 23);
  const std::vector<T> junk(static_cast<size_t>(n * c), x[0]);
  Dev<T> dx(x), da(a), ddy(dy), s1(junk), y1(junk), s2(junk), y2(junk), ds1(ds0), ds2(ds0),
      copy1(junk), copy2(junk);
  Dev<float> dw(w), db(b), m1(uniform(n, 24)), r1(uniform(n, 25)), m2(uniform(n, 26)),
      r2(uniform(n, 27));
  const bool one_kernel = c % 8 == 0 && c <= 2048;
  // apart
  add(ctx(), dx.p(), da.p(), s1.p(), n * c);
  layernorm_forward(ctx(), s1.p(), dw.p(), db.p(), y1.p(), m1.p(), r1.p(), n, c, 1e-5f);
  layernorm_backward_input(ctx(), ddy.p(), s1.p(), dw.p(), m1.p(), r1.p(), ds1.p(), n, c);
  // fused
  ASSERT_EQ(add_layernorm_forward(ctx(), dx.p(), da.p(), s2.p(), dw.p(), db.p(), y2.p(), m2.p(),
                                  r2.p(), n, c, 1e-5f),
            one_kernel);
  ASSERT_EQ(layernorm_backward_input_copy(ctx(), ddy.p(), s1.p(), dw.p(), m1.p(), r1.p(), ds2.p(),
                                          copy2.p(), n, c),
            one_kernel);
  if (!one_kernel) return;
  // Elements whose bits differ.
  auto differ = [](const std::vector<T>& got, const std::vector<T>& want) {
    size_t d = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      if constexpr (sizeof(T) == 4)
        d += std::bit_cast<uint32_t>(got[i]) != std::bit_cast<uint32_t>(want[i]);
      else
        d += got[i].bits != want[i].bits;
    }
    return d;
  };
  EXPECT_EQ(differ(s2.host(), s1.host()), 0u) << "sum";
  EXPECT_EQ(differ(y2.host(), y1.host()), 0u) << "y";
  expect_same_bits(m2.host(), m1.host(), "mean");
  expect_same_bits(r2.host(), r1.host(), "rstd");
  EXPECT_EQ(differ(ds2.host(), ds1.host()), 0u) << "the sum's gradient, added to";
  EXPECT_EQ(differ(copy2.host(), ds1.host()), 0u) << "its copy";
  EXPECT_GT(differ(ds1.host(), ds0), 0u) << "LayerNorm's gradient was not added";
}

TEST(CudaResidualLayerNorm, OneKernelEachWayGivesTheBitsOfTheKernelsApart) {
  for (auto [n, c] : {std::pair<int64_t, int64_t>{45, 200}, {33, 768}, {7, 1800}, {9, 77},
                      {3, 2056}}) {
    SCOPED_TRACE(::testing::Message() << "n " << n << " c " << c);
    expect_fused_residual_layernorm_bits<float>(n, c, uniform(n * c, 30, -2.0f, 3.0f),
                                                uniform(n * c, 31), uniform(n * c, 32),
                                                uniform(n * c, 33), "fp32");
    expect_fused_residual_layernorm_bits<bf16>(n, c, bf16_uniform(n * c, 30, -2.0f, 3.0f),
                                               bf16_uniform(n * c, 31), bf16_uniform(n * c, 32),
                                               bf16_uniform(n * c, 33), "bf16");
  }
}

// ---------------------------------------------------------------- GELU

// Both backwards: accumulating into dx, and writing a fresh one.
TEST(CudaBf16Gelu, EveryOutputIsTheFp32KernelsOutputRounded) {
  const int64_t n = 100003;
  const std::vector<bf16> x16 = bf16_uniform(n, 21, -5.0f, 5.0f), dy16 = bf16_uniform(n, 22),
                          dx16 = bf16_uniform(n, 23);
  Dev<float> fx(widened(x16)), fy(uniform(n, 24)), fdy(widened(dy16)), fdx(widened(dx16)),
      ffresh(uniform(n, 26));
  gelu_forward(ctx(), fx.p(), fy.p(), n);
  gelu_backward(ctx(), fdy.p(), fx.p(), fdx.p(), n);
  gelu_backward(ctx(), fdy.p(), fx.p(), ffresh.p(), n, false);
  Dev<bf16> hx(x16), hy(bf16_uniform(n, 25)), hdy(dy16), hdx(dx16), hfresh(bf16_uniform(n, 27));
  gelu_forward(ctx(), hx.p(), hy.p(), n);
  gelu_backward(ctx(), hdy.p(), hx.p(), hdx.p(), n);
  gelu_backward(ctx(), hdy.p(), hx.p(), hfresh.p(), n, false);
  expect_rounded(hy.host(), fy.host(), "gelu y");
  expect_rounded(hdx.host(), fdx.host(), "gelu dx, accumulated");
  expect_rounded(hfresh.host(), ffresh.host(), "gelu dx, fresh");
}

// ---------------------------------------------------------------- the Llama layers

// RMSNorm (forward, both backwards), SwiGLU and the rotary embedding (with
// grouped key/value heads), ragged shapes, the input gradients accumulated
// into.
TEST(CudaBf16Llama, EveryOutputIsTheFp32KernelsOutputRounded) {
  for (auto [n, c] : {std::pair<int64_t, int64_t>{45, 200}, {8192 + 13, 96}, {9, 77}}) {
    SCOPED_TRACE(::testing::Message() << "rmsnorm n " << n << " c " << c);
    const std::vector<bf16> x16 = bf16_uniform(n * c, 31, -2.0f, 3.0f),
                            dy16 = bf16_uniform(n * c, 32), dx16 = bf16_uniform(n * c, 33);
    const std::vector<float> w = uniform(c, 34), dw0 = uniform(c, 35);
    Dev<float> fx(widened(x16)), fw(w), fy(uniform(n * c, 36)), frstd(uniform(n, 37)),
        fdy(widened(dy16)), fdx(widened(dx16)), fdw(dw0);
    rmsnorm_forward(ctx(), fx.p(), fw.p(), fy.p(), frstd.p(), n, c, 1e-5f);
    rmsnorm_backward_input(ctx(), fdy.p(), fx.p(), fw.p(), frstd.p(), fdx.p(), n, c);
    rmsnorm_backward_weight(ctx(), fdy.p(), fx.p(), frstd.p(), fdw.p(), n, c);
    Dev<bf16> hx(x16), hy(bf16_uniform(n * c, 38)), hdy(dy16), hdx(dx16);
    Dev<float> hrstd(uniform(n, 39)), hdw(dw0);
    rmsnorm_forward(ctx(), hx.p(), fw.p(), hy.p(), hrstd.p(), n, c, 1e-5f);
    rmsnorm_backward_input(ctx(), hdy.p(), hx.p(), fw.p(), hrstd.p(), hdx.p(), n, c);
    rmsnorm_backward_weight(ctx(), hdy.p(), hx.p(), hrstd.p(), hdw.p(), n, c);
    expect_rounded(hy.host(), fy.host(), "rmsnorm y");
    expect_same_bits(hrstd.host(), frstd.host(), "rmsnorm rstd");
    expect_rounded(hdx.host(), fdx.host(), "rmsnorm dx");
    expect_same_bits(hdw.host(), fdw.host(), "rmsnorm dw");
  }
  {
    const int64_t n = 333, h = 301;  // x (n, 2h) = [gate | up]
    const std::vector<bf16> x16 = bf16_uniform(n * 2 * h, 41, -6.0f, 6.0f),
                            dy16 = bf16_uniform(n * h, 42), dx16 = bf16_uniform(n * 2 * h, 43);
    Dev<float> fx(widened(x16)), fy(uniform(n * h, 44)), fdy(widened(dy16)), fdx(widened(dx16));
    swiglu_forward(ctx(), fx.p(), fy.p(), n, h);
    swiglu_backward(ctx(), fdy.p(), fx.p(), fdx.p(), n, h);
    Dev<bf16> hx(x16), hy(bf16_uniform(n * h, 45)), hdy(dy16), hdx(dx16);
    swiglu_forward(ctx(), hx.p(), hy.p(), n, h);
    swiglu_backward(ctx(), hdy.p(), hx.p(), hdx.p(), n, h);
    expect_rounded(hy.host(), fy.host(), "swiglu y");
    expect_rounded(hdx.host(), fdx.host(), "swiglu dx");
  }
  {
    const int64_t b = 2, t = 37, heads = 4, groups = 2, d = 10;  // (H + 2G) D = 80 wide
    const int64_t numel = b * t * (heads + 2 * groups) * d;
    const std::vector<bf16> x16 = bf16_uniform(numel, 51, -3.0f, 3.0f),
                            dy16 = bf16_uniform(numel, 52), dx16 = bf16_uniform(numel, 53);
    Dev<float> fx(widened(x16)), fy(uniform(numel, 54)), fdy(widened(dy16)), fdx(widened(dx16));
    rope_forward(ctx(), fx.p(), fy.p(), b, t, heads, groups, d, 10000.0f);
    rope_backward(ctx(), fdy.p(), fdx.p(), b, t, heads, groups, d, 10000.0f);
    Dev<bf16> hx(x16), hy(bf16_uniform(numel, 55)), hdy(dy16), hdx(dx16);
    rope_forward(ctx(), hx.p(), hy.p(), b, t, heads, groups, d, 10000.0f);
    rope_backward(ctx(), hdy.p(), hdx.p(), b, t, heads, groups, d, 10000.0f);
    expect_rounded(hy.host(), fy.host(), "rope y");
    expect_rounded(hdx.host(), fdx.host(), "rope dx");
  }
}

// ---------------------------------------------------------------- element-wise

TEST(CudaBf16Helpers, AddInPlaceRoundsTheFp32Sum) {
  const int64_t n = 70001;
  // y up to 16 in magnitude, x up to 1: most sums are inexact in bf16.
  const std::vector<bf16> y16 = bf16_uniform(n, 31, -16.0f, 16.0f), x16 = bf16_uniform(n, 32);
  Dev<float> fy(widened(y16)), fx(widened(x16));
  add_inplace(ctx(), fy.p(), fx.p(), n);
  Dev<bf16> hy(y16), hx(x16);
  add_inplace(ctx(), hy.p(), hx.p(), n);
  expect_rounded(hy.host(), fy.host(), "y + x");
}

// y = a + b: fp32 sums bit for bit as the host adds them; bf16 ones the
// fp32 sums of the widened a and b, rounded once.
TEST(CudaBf16Helpers, AddOfTwoRoundsTheFp32Sum) {
  const int64_t n = 70001;
  const std::vector<bf16> a16 = bf16_uniform(n, 103), b16 = bf16_uniform(n, 104);
  const std::vector<float> a = widened(a16), b = widened(b16);
  Dev<float> fa(a), fb(b), fy(uniform(n, 105));
  add(ctx(), fa.p(), fb.p(), fy.p(), n);
  std::vector<float> want;
  for (size_t i = 0; i < a.size(); ++i) want.push_back(a[i] + b[i]);
  expect_same_bits(fy.host(), want, "fp32 a + b");
  Dev<bf16> ha(a16), hb(b16), hy(bf16_uniform(n, 106));
  add(ctx(), ha.p(), hb.p(), hy.p(), n);
  expect_rounded(hy.host(), want, "bf16 a + b");
}

// y (bf16) += x (fp32): the fp32 sum of the widened y and x, rounded once.
TEST(CudaBf16Helpers, AddingFp32IntoBf16RoundsTheFp32Sum) {
  const int64_t n = 70001;
  const std::vector<bf16> y16 = bf16_uniform(n, 101);
  const std::vector<float> x = uniform(n, 102);
  Dev<float> fy(widened(y16)), fx(x);
  add_inplace(ctx(), fy.p(), fx.p(), n);
  Dev<bf16> hy(y16);
  add_inplace(ctx(), hy.p(), fx.p(), n);
  expect_rounded(hy.host(), fy.host(), "y += x");
}

// y += s x (the LM head's unit gradients scaled by the loss's) in one
// pass: the bits of scale_inplace then add_inplace, into fp32 and bf16 y.
TEST(CudaBf16Helpers, AddScaledIsScaleThenAdd) {
  const int64_t n = 70001;
  const std::vector<bf16> y16 = bf16_uniform(n, 103, -4.0f, 4.0f);
  const std::vector<float> y = uniform(n, 104, -4.0f, 4.0f), x = uniform(n, 105);
  Dev<float> x1(x), x2(x), fy1(y), fy2(y);
  Dev<bf16> hy1(y16), hy2(y16);
  scale_inplace(ctx(), x1.p(), 0.37f, n);
  add_inplace(ctx(), fy1.p(), x1.p(), n);
  add_inplace(ctx(), hy1.p(), x1.p(), n);
  add_scaled(ctx(), fy2.p(), x2.p(), 0.37f, n);
  add_scaled(ctx(), hy2.p(), x2.p(), 0.37f, n);
  expect_same_bits(fy2.host(), fy1.host(), "fp32 y += s x");
  std::vector<float> h1, h2;
  for (const bf16 v : hy1.host()) h1.push_back(to_float(v));
  for (const bf16 v : hy2.host()) h2.push_back(to_float(v));
  expect_same_bits(h2, h1, "bf16 y += s x");
  expect_same_bits(x2.host(), x, "x");
}

// The bias gradient (column sums) and the embedding's gradients from a bf16
// dy: each element widened, then the fp32 kernels' sums in their order, so
// the fp32 results bit for bit. The tokens are distinct, so that no two
// atomic adds meet on one dwte element (their order would vary).
TEST(CudaBf16Helpers, GradientSumsFromBf16DyAreTheFp32Sums) {
  const int64_t b = 3, t = 37, c = 77, rows = 200;
  const std::vector<bf16> dy16 = bf16_uniform(b * t * c, 111);
  const std::vector<float> db0 = uniform(c, 112), dwte0 = uniform(rows * c, 113),
                           dwpe0 = uniform(t * c, 114);
  std::vector<int32_t> ids;
  for (int64_t i = 0; i < b * t; ++i) ids.push_back(static_cast<int32_t>(i + 50));
  Dev<int32_t> tokens(ids);
  Dev<float> fdy(widened(dy16)), fdb(db0), fdwte(dwte0), fdwpe(dwpe0);
  sum_rows(ctx(), fdy.p(), fdb.p(), b * t, c);
  embedding_backward(ctx(), tokens.p(), fdy.p(), fdwte.p(), fdwpe.p(), b, t, c, rows, 20);
  Dev<bf16> hdy(dy16);
  Dev<float> hdb(db0), hdwte(dwte0), hdwpe(dwpe0);
  sum_rows(ctx(), hdy.p(), hdb.p(), b * t, c);
  embedding_backward(ctx(), tokens.p(), hdy.p(), hdwte.p(), hdwpe.p(), b, t, c, rows, 20);
  expect_same_bits(hdb.host(), fdb.host(), "db");
  expect_same_bits(hdwte.host(), fdwte.host(), "dwte");
  expect_same_bits(hdwpe.host(), fdwpe.host(), "dwpe");
}

TEST(CudaBf16Helpers, FillRowsRoundsTheRowIntoEveryRow) {
  const int64_t n = 300, c = 77;
  // The row is fp32 (a bias), not representable in bf16: its rounding is tested.
  const std::vector<float> row = uniform(c, 41);
  Dev<float> drow(row);
  Dev<bf16> hy(bf16_uniform(n * c, 42));  // overwritten, not accumulated into
  fill_rows(ctx(), hy.p(), drow.p(), n, c);
  std::vector<float> want(static_cast<size_t>(n * c));
  for (int64_t i = 0; i < n * c; ++i)
    want[static_cast<size_t>(i)] = row[static_cast<size_t>(i % c)];
  expect_rounded(hy.host(), want, "filled rows");
}

// ---------------------------------------------------------------- embedding

TEST(CudaBf16Embedding, ForwardRoundsTheFp32Sum) {
  const int64_t b = 3, t = 20, c = 40, v = 11;
  // fp32 (master) weights, not rounded: the sum is rounded once.
  const std::vector<float> wte = uniform(v * c, 51), wpe = uniform(t * c, 52);
  std::vector<int32_t> tokens(static_cast<size_t>(b * t));
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>((i * 7 + 3) % v);
  Dev<float> dwte(wte), dwpe(wpe);
  Dev<int32_t> dtok(tokens);
  // The whole vocabulary with positions; a slice [4, 10) (other tokens read
  // zeros) without positions.
  struct Slice {
    const float* wpe;
    int64_t rows, first;
  };
  for (const Slice s : {Slice{dwpe.p(), INT64_MAX, 0}, Slice{nullptr, 6, 4}}) {
    SCOPED_TRACE(::testing::Message() << "rows " << s.rows << " first " << s.first);
    const float* wte_at = dwte.p() + (s.rows == INT64_MAX ? 0 : s.first * c);
    Dev<float> fy(uniform(b * t * c, 53));
    embedding_forward(ctx(), dtok.p(), wte_at, s.wpe, fy.p(), b, t, c, s.rows, s.first);
    Dev<bf16> hy(bf16_uniform(b * t * c, 54));
    embedding_forward(ctx(), dtok.p(), wte_at, s.wpe, hy.p(), b, t, c, s.rows, s.first);
    expect_rounded(hy.host(), fy.host(), "embedding y");
  }
}

// ---------------------------------------------------------------- GEMM

// gemm_bf16_out against fp64 on the same bf16 operands. The error model:
// products of two bf16 values (8-bit significands) are exact in fp32; their
// sum over k terms in fp32, in any order, tensor cores included (whose
// accumulation may truncate rather than round: 2^-23 per addition rather
// than 2^-24), is within k 2^-23 sum_l |a_il b_lj|; alpha * acc + beta * c
// adds at most 3 roundings of 2^-24 of |alpha| sum|a||b| + |beta c|; the one
// bf16 rounding of the result adds 2^-8 of it (bf16's unit roundoff):
//   |got - exact| <= 2^-8 |exact| + 2^-23 ((k + 3) |alpha| sum|a||b| + 3 |beta c|)
// (the bf16 rounding of the fp32 error terms, 2^-8 of them, is inside the
// factor 2 between 2^-24 and 2^-23 of the last two roundings' terms).
// C's padding columns (ldc > n) must keep their bits.
TEST(CudaBf16Gemm, OutputWithinOneBf16RoundingOfTheExactProduct) {
  const int64_t m = 37, n = 29, k = 53;
  const float alpha = 0.7f, beta = 0.3f;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "trans_a " << ta << " trans_b " << tb);
      const int64_t lda = (ta ? m : k) + 3, ldb = (tb ? k : n) + 5, ldc = n + 2;
      const std::vector<bf16> a16 = bf16_uniform((ta ? k : m) * lda, 61),
                              b16 = bf16_uniform((tb ? n : k) * ldb, 62),
                              c16 = bf16_uniform(m * ldc, 63);
      const std::vector<float> a = widened(a16), b = widened(b16), c = widened(c16);
      Dev<bf16> da(a16), db(b16), dc(c16);
      gemm_bf16_out(ctx(), ta, tb, m, n, k, alpha, da.p(), lda, db.p(), ldb, beta, dc.p(), ldc);
      const std::vector<bf16> got16 = dc.host();
      std::vector<float> got, want;
      std::vector<double> bound;
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) {
          double exact = 0, abs_sum = 0;
          for (int64_t l = 0; l < k; ++l) {
            const double x = a[static_cast<size_t>(ta ? l * lda + i : i * lda + l)];
            const double y = b[static_cast<size_t>(tb ? j * ldb + l : l * ldb + j)];
            exact += x * y;
            abs_sum += std::abs(x * y);
          }
          const double c0 = c[static_cast<size_t>(i * ldc + j)];
          exact = alpha * exact + beta * c0;
          got.push_back(to_float(got16[static_cast<size_t>(i * ldc + j)]));
          want.push_back(static_cast<float>(exact));
          bound.push_back(std::ldexp(std::abs(exact), -8) +
                          std::ldexp((k + 3) * alpha * abs_sum + 3 * beta * std::abs(c0), -23) +
                          std::ldexp(std::abs(exact), -24));  // want's own rounding to float
        }
      expect_within(got, want, bound, "C");
      size_t touched = 0;
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = n; j < ldc; ++j)
          touched += got16[static_cast<size_t>(i * ldc + j)].bits !=
                     c16[static_cast<size_t>(i * ldc + j)].bits;
      EXPECT_EQ(touched, 0u) << "padding columns of C were written";
    }
}

// ---------------------------------------------------------------- no allocation on a repeat

// The bf16 kernels' scratch (the weight gradient's partials) comes from the
// caching allocator: a repeated step makes no cudaMalloc.
TEST(CudaBf16Runtime, RepeatedCallsAllocateNothingNew) {
  const int64_t n = 45, c = 200;
  Dev<bf16> x(bf16_uniform(n * c, 71)), y(bf16_uniform(n * c, 72)), h(bf16_uniform(n * c, 73));
  Dev<bf16> dy(bf16_uniform(n * c, 76)), dx(bf16_uniform(n * c, 77));
  Dev<float> w(uniform(c, 74)), b(uniform(c, 75));
  Dev<float> mean(uniform(n, 78)), rstd(uniform(n, 79)), dw(uniform(c, 80)), db(uniform(c, 81));
  std::vector<int32_t> ids;
  for (int64_t i = 0; i < n; ++i) ids.push_back(static_cast<int32_t>(i * 7 % 50));
  Dev<int32_t> tokens(ids);
  Dev<float> dwte(uniform(50 * c, 82));
  auto step = [&] {
    fill_rows(ctx(), y.p(), b.p(), n, c);
    layernorm_forward(ctx(), x.p(), w.p(), b.p(), y.p(), mean.p(), rstd.p(), n, c, 1e-5f);
    gelu_forward(ctx(), y.p(), h.p(), n * c);
    add_inplace(ctx(), h.p(), x.p(), n * c);
    gelu_backward(ctx(), dy.p(), y.p(), dx.p(), n * c);
    layernorm_backward_input(ctx(), dy.p(), x.p(), w.p(), mean.p(), rstd.p(), dx.p(), n, c);
    layernorm_backward_weight(ctx(), dy.p(), x.p(), mean.p(), rstd.p(), dw.p(), db.p(), n, c);
    sum_rows(ctx(), dy.p(), db.p(), n, c);
    embedding_backward(ctx(), tokens.p(), dy.p(), dwte.p(), nullptr, 1, n, c, 50);
    gemm_bf16_out(ctx(), false, true, n, n, c, 1.0f, x.p(), c, h.p(), c, 0.0f, y.p(), n);
    ctx().synchronize();
  };
  step();
  const size_t mallocs = ctx().allocator().stats().device_mallocs;
  step();
  EXPECT_EQ(ctx().allocator().stats().device_mallocs, mallocs);
}

}  // namespace
}  // namespace weft::cuda

#if WEFT_CUDNN
namespace weft::cuda {
namespace {

using weft::testing::contains;
using weft::testing::error_message;

// ---------------------------------------------------------------- fused attention

struct Case {
  int64_t b, t, h, g, d;
  int64_t w() const { return (h + 2 * g) * d; }
  int64_t c() const { return h * d; }
};

// The bf16 interface runs the graphs the fp32 interface built (no new graph)
// on the same bf16 bits: the fp32 interface rounds qkv and dout to bf16
// (exact here: they are bf16 values), and for the backward rounds its
// widened out back to the same bf16 O.
//
// Forward: cuDNN rounds its fp32 O once to bf16. The fp32 interface widens
// that bf16 O, exactly. Two runs of one plan on the same bits give fp32
// values that can differ at most by the order of their fp32 sums, so the two
// outputs are the roundings of (nearly) the same value: at most one bf16 unit
// apart, |got - want| <= 2^-8 (|got| + |want|) (bf16's unit roundoff, each);
// lse (fp32, natural log of a sum of at most T terms <= 1 after the max is
// taken out): a reordered sum moves it by at most 2 T 2^-24 (absolute, as
// log(s (1 + e)) = log s + e) plus 2 2^-24 |lse| for its own rounding.
//
// Backward: cuDNN's (non-deterministic) backward may sum partial gradients
// in a different order in each run: for two runs of the same fp32 terms,
// summed in fp32 (at most T terms per query head, T H / G for a key/value
// head), the values before rounding differ by at most 2 T (H / G) 2^-24 A, A
// the sum of the terms' magnitudes; each is then
// rounded to bf16 (2^-8 of it) and added to dqkv0: in fp32 by the fp32
// interface (2^-24 of the sum), rounded to bf16 by the bf16 one (2^-8 of the
// sum). A fresh dqkv (accumulate false) is cuDNN's bf16 result itself in the
// bf16 interface, that result widened in the fp32 one.
// With scale = 1/sqrt(D), p_ij <= 1, sum_j p_ij = 1 and |dS_ij| <= 2 p_ij
// |dO_i|_1 max|v| (|dP_ij - D_i| <= 2 |dO_i|_1 max|v|), per query head:
//   dq_i: A <= 2 scale max|k| max|v| |dO_i|_1
//   dk_j: A <= 2 scale max|q| max|v| sum_{i >= j} |dO_i|_1
//   dv_j: A <= sum_{i >= j} |dO_i|_1
// summed over the query heads of a key/value head's group.
class Bf16FusedAttention : public ::testing::Test {
 protected:
  static void check_case(const Case& k, uint64_t seed);
};

void Bf16FusedAttention::check_case(const Case& k, uint64_t seed) {
  const int64_t n_qkv = k.b * k.t * k.w(), n_out = k.b * k.t * k.c(), n_lse = k.b * k.h * k.t;
  const std::vector<bf16> qkv16 = bf16_uniform(n_qkv, seed), dout16 = bf16_uniform(n_out, seed + 1),
                          dqkv16 = bf16_uniform(n_qkv, seed + 2);
  const std::vector<float> qkv = widened(qkv16), dout = widened(dout16), dqkv0 = widened(dqkv16);
  Context& cx = ctx();

  // The fp32 interface.
  Dev<float> fqkv(qkv), fout(uniform(n_out, seed + 3)), flse(uniform(n_lse, seed + 4));
  Dev<float> fdout(dout), fdqkv(dqkv0), ffresh(uniform(n_qkv, seed + 7));
  fused_attention_forward(cx, fqkv.p(), fout.p(), flse.p(), k.b, k.t, k.h, k.g, k.d);
  fused_attention_backward(cx, fdout.p(), fqkv.p(), fout.p(), flse.p(), fdqkv.p(), k.b, k.t, k.h,
                           k.g, k.d);
  fused_attention_backward(cx, fdout.p(), fqkv.p(), fout.p(), flse.p(), ffresh.p(), k.b, k.t, k.h,
                           k.g, k.d, false);
  const size_t graphs = fused_attention_graphs(cx);

  // The bf16 interface, its outputs starting elsewhere.
  Dev<bf16> hqkv(qkv16), hout(bf16_uniform(n_out, seed + 5)), hdout(dout16), hdqkv(dqkv16),
      hfresh(bf16_uniform(n_qkv, seed + 8));
  Dev<float> hlse(uniform(n_lse, seed + 6));
  fused_attention_forward(cx, hqkv.p(), hout.p(), hlse.p(), k.b, k.t, k.h, k.g, k.d);
  fused_attention_backward(cx, hdout.p(), hqkv.p(), hout.p(), hlse.p(), hdqkv.p(), k.b, k.t, k.h,
                           k.g, k.d);
  fused_attention_backward(cx, hdout.p(), hqkv.p(), hout.p(), hlse.p(), hfresh.p(), k.b, k.t, k.h,
                           k.g, k.d, false);
  EXPECT_EQ(fused_attention_graphs(cx), graphs) << "the bf16 interface built its own graphs";

  const double u = std::ldexp(1.0, -8), u32 = std::ldexp(1.0, -24);
  // Forward
  const std::vector<float> out_got = widened(hout.host()), out_want = fout.host();
  std::vector<double> out_bound;
  for (size_t i = 0; i < out_want.size(); ++i)
    out_bound.push_back(u * (std::abs(out_got[i]) + std::abs(out_want[i])));
  expect_within(out_got, out_want, out_bound, "out");
  const std::vector<float> lse_got = hlse.host(), lse_want = flse.host();
  std::vector<double> lse_bound;
  for (float l : lse_want) lse_bound.push_back(2 * k.t * u32 + 2 * u32 * std::abs(l));
  expect_within(lse_got, lse_want, lse_bound, "lse");

  // Backward: A per element of dqkv.
  const int64_t w = k.w(), per = k.h / k.g;
  const double scale = 1.0 / std::sqrt(static_cast<double>(k.d));
  double qmax = 0, kmax = 0, vmax = 0;
  for (int64_t i = 0; i < n_qkv; ++i) {
    const int64_t col = i % w;
    double& m = col < k.h * k.d ? qmax : col < (k.h + k.g) * k.d ? kmax : vmax;
    m = std::max(m, std::abs(static_cast<double>(qkv[static_cast<size_t>(i)])));
  }
  std::vector<double> a(static_cast<size_t>(n_qkv), 0.0);
  for (int64_t bi = 0; bi < k.b; ++bi)
    for (int64_t hi = 0; hi < k.h; ++hi) {
      const int64_t gi = hi / per;
      double suffix = 0;  // sum_{i >= j} |dO_i|_1, j running down from T - 1
      for (int64_t j = k.t - 1; j >= 0; --j) {
        double l1 = 0;
        for (int64_t dd = 0; dd < k.d; ++dd)
          l1 += std::abs(static_cast<double>(dout[static_cast<size_t>((bi * k.t + j) * k.c() +
                                                                      hi * k.d + dd)]));
        suffix += l1;
        const int64_t row = (bi * k.t + j) * w;
        for (int64_t dd = 0; dd < k.d; ++dd) {
          a[static_cast<size_t>(row + hi * k.d + dd)] += 2 * scale * kmax * vmax * l1;
          a[static_cast<size_t>(row + (k.h + gi) * k.d + dd)] += 2 * scale * qmax * vmax * suffix;
          a[static_cast<size_t>(row + (k.h + k.g + gi) * k.d + dd)] += suffix;
        }
      }
    }
  const std::vector<float> dq_got = widened(hdqkv.host()), dq_want = fdqkv.host();
  std::vector<double> dq_bound;
  for (size_t i = 0; i < dq_want.size(); ++i) {
    const double x0 = dqkv0[i], g1 = std::abs(dq_got[i] - x0), g2 = std::abs(dq_want[i] - x0);
    dq_bound.push_back(2 * k.t * per * u32 * a[i] + u * (1 + 2 * u) * (g1 + g2) +
                       u * (std::abs(dq_got[i]) + std::abs(dq_want[i])));
  }
  expect_within(dq_got, dq_want, dq_bound, "dqkv");
  const std::vector<float> fresh_got = widened(hfresh.host()), fresh_want = ffresh.host();
  std::vector<double> fresh_bound;
  for (size_t i = 0; i < fresh_want.size(); ++i)
    fresh_bound.push_back(2 * k.t * per * u32 * a[i] +
                          u * (1 + 2 * u) * (std::abs(fresh_got[i]) + std::abs(fresh_want[i])));
  expect_within(fresh_got, fresh_want, fresh_bound, "dqkv, fresh");

  // A repeat allocates nothing: graphs and scratch are reused.
  cx.synchronize();
  const size_t mallocs = cx.allocator().stats().device_mallocs;
  fused_attention_forward(cx, hqkv.p(), hout.p(), hlse.p(), k.b, k.t, k.h, k.g, k.d);
  fused_attention_backward(cx, hdout.p(), hqkv.p(), hout.p(), hlse.p(), hdqkv.p(), k.b, k.t, k.h,
                           k.g, k.d);
  fused_attention_backward(cx, hdout.p(), hqkv.p(), hout.p(), hlse.p(), hfresh.p(), k.b, k.t, k.h,
                           k.g, k.d, false);
  cx.synchronize();
  EXPECT_EQ(cx.allocator().stats().device_mallocs, mallocs);
}

TEST_F(Bf16FusedAttention, MatchesTheFp32InterfaceWithinBf16Rounding) {
  check_case({2, 64, 4, 4, 64}, 91);  // multi-head
  check_case({1, 37, 4, 2, 32}, 95);  // grouped-query, ragged T
}

TEST_F(Bf16FusedAttention, RefusesAMisalignedPointer) {
  const Case k{1, 8, 2, 2, 16};
  DeviceBuffer<bf16> qkv(ctx(), k.b * k.t * k.w() + 8), out(ctx(), k.b * k.t * k.c() + 8);
  DeviceBuffer<float> lse(ctx(), k.b * k.h * k.t);
  const std::string msg = error_message([&] {
    fused_attention_forward(ctx(), qkv.data() + 1, out.data(), lse.data(), k.b, k.t, k.h, k.g,
                            k.d);
  });
  EXPECT_TRUE(contains(msg, "qkv")) << msg;
  EXPECT_TRUE(contains(msg, "not 16-byte aligned")) << msg;
}

}  // namespace
}  // namespace weft::cuda
#endif  // WEFT_CUDNN

#endif  // WEFT_CUDA
