// Every CUDA kernel against its CPU twin (weft/cpu_kernels.h, the Embedding
// layer) on the same inputs: fp32 within 1e-5 relative (||gpu - cpu|| /
// ||cpu||), TF32 within 5e-3 (1e-2 through attention's softmax), bf16 and fp16
// GEMMs against the CPU's emulation (cpu::gemm_rounded) within an error model
// (5e-2 and 1e-2 through attention).
// Shapes are deliberately ragged (T = 37, V = 1000, C = 48) so that partial
// warps, blocks and tiles are exercised. Also: the caching allocator on the
// device, stream ordering, pinned copies and error reporting.
// Needs a GPU; exits 77 (SKIP) without one.
#include "weft_config.h"

#if WEFT_CUDA
#include <weft/cpu_kernels.h>
#include <weft/cuda/kernels.h>
#include <weft/cuda/runtime.h>

#include "layers/embedding.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

#include "cuda_test_util.h"
#include "test_util.h"

namespace weft::cuda {
namespace {

using test_util::Dev;

using weft::testing::contains;
using weft::testing::error_message;
using weft::testing::rel_error;
using weft::testing::uniform;

constexpr double kFp32 = 1e-5;
constexpr double kTf32 = 5e-3;

Context& ctx() { return context(0); }

double rel(const std::vector<float>& got, const std::vector<float>& want) {
  EXPECT_EQ(got.size(), want.size());
  return rel_error(got.data(), want.data(), static_cast<int64_t>(want.size()));
}

std::vector<int32_t> random_tokens(int64_t n, int32_t v, uint64_t seed) {
  std::vector<float> u = uniform(n, seed, 0.0f, static_cast<float>(v));
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (size_t i = 0; i < t.size(); ++i) t[i] = std::min(v - 1, static_cast<int32_t>(u[i]));
  return t;
}

// Outputs start as zeros, never as the CPU's answer.
std::vector<float> zeros(int64_t n) { return std::vector<float>(static_cast<size_t>(n), 0.0f); }

// Positions within documents of 1 to 9 tokens, in b sequences of t.
std::vector<int32_t> document_positions(int64_t b, int64_t t, uint64_t seed) {
  const std::vector<int32_t> ends = random_tokens(b * t, 9, seed);
  std::vector<int32_t> pos(static_cast<size_t>(b * t));
  for (int64_t s = 0; s < b; ++s) {
    int32_t p = 0, left = ends[static_cast<size_t>(s * t)] + 1;
    for (int64_t i = s * t; i < (s + 1) * t; ++i) {
      pos[static_cast<size_t>(i)] = p++;
      if (--left == 0) p = 0, left = ends[static_cast<size_t>(i)] + 1;
    }
  }
  return pos;
}

std::vector<float> rounded_to_bf16(std::vector<float> x) {
  for (float& f : x) f = to_float(to_bf16(f));
  return x;
}

// ---------------------------------------------------------------- GEMM

struct GemmCase {
  bool ta, tb;
  int64_t m, n, k, lda, ldb, ldc;
  std::vector<float> a, b, c;
};

// Row-major operands padded beyond their logical width (ld > cols).
GemmCase gemm_case(bool ta, bool tb, int64_t m, int64_t n, int64_t k, uint64_t seed) {
  GemmCase g{ta, tb, m, n, k, (ta ? m : k) + 3, (tb ? k : n) + 5, n + 2, {}, {}, {}};
  g.a = uniform((ta ? k : m) * g.lda, seed);
  g.b = uniform((tb ? n : k) * g.ldb, seed + 1);
  g.c = uniform(m * g.ldc, seed + 2);
  return g;
}

std::vector<float> cpu_gemm(const GemmCase& g, const std::vector<float>& a,
                            const std::vector<float>& b, float alpha, float beta) {
  std::vector<float> c = g.c;
  cpu::gemm(g.ta, g.tb, g.m, g.n, g.k, alpha, a.data(), g.lda, b.data(), g.ldb, beta, c.data(),
            g.ldc);
  return c;
}

TEST(CudaGemm, Fp32MatchesCpuForEveryTranspose) {
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      GemmCase g = gemm_case(ta, tb, 37, 29, 53, 11);
      Dev<float> a(g.a), b(g.b), c(g.c);
      gemm(ctx(), MathMode::FP32, ta, tb, g.m, g.n, g.k, 0.7f, a.p(), g.lda, b.p(), g.ldb, 0.3f,
           c.p(), g.ldc);
      EXPECT_LT(rel(c.host(), cpu_gemm(g, g.a, g.b, 0.7f, 0.3f)), kFp32) << ta << tb;
    }
}

TEST(CudaGemm, Tf32IsCloseButNotExact) {
  // Dense, aligned operands, so that cuBLAS can take its tensor-core kernels.
  GemmCase g = gemm_case(false, true, 256, 192, 320, 12);
  g.lda = g.k, g.ldb = g.k, g.ldc = g.n;
  g.a.resize(static_cast<size_t>(g.m * g.lda));
  g.b.resize(static_cast<size_t>(g.n * g.ldb));
  g.c.resize(static_cast<size_t>(g.m * g.ldc));
  Dev<float> a(g.a), b(g.b), c(g.c);
  gemm(ctx(), MathMode::TF32, g.ta, g.tb, g.m, g.n, g.k, 1.0f, a.p(), g.lda, b.p(), g.ldb, 0.0f,
       c.p(), g.ldc);
  const double err = rel(c.host(), cpu_gemm(g, g.a, g.b, 1.0f, 0.0f));
  EXPECT_LT(err, kTf32);
  EXPECT_GT(err, 1e-6) << "TF32 rounds its inputs to 10 mantissa bits; an exact result means "
                          "the tensor-core path was not taken";
}

// BF16 and FP16 on fp32 operands against the CPU's emulation,
// cpu::gemm_rounded, element by element. Both round every operand to the
// nearest even 16-bit value (the GPU with round_values, into scratch, then
// a TF32 GEMM that holds those values exactly), and products of rounded
// inputs are exact in fp32 (8 + 8 or 11 + 11 bits). So for c = alpha sum_l
// a_l b_l + beta c0 the two differ only in summation order: at most
// 2 k 2^-24 sum |a_l b_l| (fp32 accumulation over k terms, each side), plus
// alpha's and beta's fp32 rounding, 4 ulps of the result. A conversion that
// rounds toward zero, or to nearest with ties away, exceeds that (cuBLAS's
// CUBLAS_COMPUTE_32F_FAST_16BF did on an H200, by ~2e-3 of the norm).
void check_rounded_gemm(MathMode mode, cpu::Rounding rounding, double unit) {
  for (bool ta : {false, true}) {
    GemmCase g = gemm_case(ta, !ta, 64, 48, 96, 13);
    std::vector<float> want = g.c, fp32 = g.c;
    cpu::gemm_rounded(rounding, g.ta, g.tb, g.m, g.n, g.k, 1.5f, g.a.data(), g.lda, g.b.data(),
                      g.ldb, 0.5f, want.data(), g.ldc);
    cpu::gemm(g.ta, g.tb, g.m, g.n, g.k, 1.5f, g.a.data(), g.lda, g.b.data(), g.ldb, 0.5f,
              fp32.data(), g.ldc);
    Dev<float> a(g.a), b(g.b), c(g.c);
    gemm(ctx(), mode, g.ta, g.tb, g.m, g.n, g.k, 1.5f, a.p(), g.lda, b.p(), g.ldb, 0.5f, c.p(),
         g.ldc);
    const std::vector<float> got = c.host();
    const double k = static_cast<double>(g.k), eps = std::ldexp(1.0, -24);
    double worst_tight = 0;
    for (int64_t i = 0; i < g.m; ++i)
      for (int64_t j = 0; j < g.n; ++j) {
        double abs_sum = 0;  // sum_l |a_il b_lj|
        for (int64_t l = 0; l < g.k; ++l) {
          const float av = ta ? g.a[static_cast<size_t>(l * g.lda + i)]
                              : g.a[static_cast<size_t>(i * g.lda + l)];
          const float bv = !ta ? g.b[static_cast<size_t>(j * g.ldb + l)]
                               : g.b[static_cast<size_t>(l * g.ldb + j)];
          abs_sum += std::fabs(static_cast<double>(av) * bv);
        }
        const size_t at = static_cast<size_t>(i * g.ldc + j);
        const double diff = std::fabs(static_cast<double>(got[at]) - want[at]);
        const double tight = 1.5 * 2 * k * eps * abs_sum + 4 * eps * std::fabs(want[at]);
        worst_tight = std::max(worst_tight, diff / tight);
        ASSERT_LE(diff, tight) << math_mode_name(mode) << " at (" << i << ", " << j << ")";
      }
    std::printf("%s: worst element used %.2f of the summation-only bound\n",
                math_mode_name(mode), worst_tight);
    // The rounding happens: the result is not the fp32 GEMM's (relative
    // input noise of u / 2 per element gives ~u / 4 relative over the sum).
    EXPECT_GT(rel(got, fp32), unit / 64) << math_mode_name(mode);
  }
}

TEST(CudaGemm, Bf16AndFp16MatchTheCpuEmulation) {
  check_rounded_gemm(MathMode::BF16, cpu::Rounding::Bf16, std::ldexp(1.0, -7));
  check_rounded_gemm(MathMode::FP16, cpu::Rounding::Fp16, std::ldexp(1.0, -10));
}

// round_values against the CPU's roundings, bit for bit: to_bf16 (the host
// twin of __float2bfloat16_rn) and C++'s _Float16 (round to nearest even,
// +-inf past 65504), which cpu::gemm_rounded uses. The values: every binary
// exponent fp16 and bf16 reach (subnormals, the largest finite values, the
// overflow boundary 65520) at random mantissas, plus ties, signed zeros,
// infinities and NaN.
TEST(CudaGemm, RoundValuesIsTheCpusRounding) {
  std::vector<float> x;
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  for (int e = -150; e <= 127; ++e)
    for (int i = 0; i < 24; ++i) {
      const float v = std::ldexp(mant(rng), e);
      x.push_back(i % 2 ? -v : v);
    }
  for (float v : {0.0f, -0.0f, 1.0f + 0x1p-8f, 1.0f + 0x3p-8f, 1.0f + 0x1p-11f, 1.0f + 0x3p-11f,
                  0x1p-25f, 0x3p-26f, 0x1p-24f, 0x1p-14f, 65504.0f, 65519.99f, 65520.0f, -65520.0f,
                  1e5f, 3.3e38f, std::numeric_limits<float>::infinity(),
                  -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::max()})
    x.push_back(v);
  for (const MathMode mode : {MathMode::BF16, MathMode::FP16}) {
    Dev<float> d(x), y(std::vector<float>(x.size(), 0.0f));
    round_values(ctx(), mode, d.p(), y.p(), static_cast<int64_t>(x.size()));
    const std::vector<float> got = y.host();
    for (size_t i = 0; i < x.size(); ++i) {
      const float want = mode == MathMode::BF16 ? to_float(to_bf16(x[i]))
                                                : static_cast<float>(static_cast<_Float16>(x[i]));
      ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(want))
          << math_mode_name(mode) << ": " << x[i] << " gave " << got[i] << ", want " << want;
    }
  }
  std::vector<float> nan{std::numeric_limits<float>::quiet_NaN()};
  Dev<float> d(nan), y(nan);
  round_values(ctx(), MathMode::FP16, d.p(), y.p(), 1);
  EXPECT_TRUE(std::isnan(y.host()[0]));
  EXPECT_THROW(round_values(ctx(), MathMode::TF32, d.p(), y.p(), 1), Error);
}

// --fp16's loss scaling finds an overflow by the non-finite gradients it
// leaves: an fp16 GEMM operand past 65504 must make the product inf, as the
// CPU's emulation does (cuBLAS's CUBLAS_COMPUTE_32F_FAST_16F did not on an
// H200, so the scale never came down).
TEST(CudaGemm, Fp16OperandsPast65504Overflow) {
  const std::vector<float> a{1e5f, 1.0f, -7e4f, 2.0f}, b{1.0f, 1.0f};  // A (2 x 2), B (2 x 1)
  Dev<float> da(a), db(b), dc(std::vector<float>(2, 0.0f));
  gemm(ctx(), MathMode::FP16, false, false, 2, 1, 2, 1.0f, da.p(), 2, db.p(), 1, 0.0f, dc.p(), 1);
  std::vector<float> want(2, 0.0f);
  cpu::gemm_rounded(cpu::Rounding::Fp16, false, false, 2, 1, 2, 1.0f, a.data(), 2, b.data(), 1,
                    0.0f, want.data(), 1);
  const std::vector<float> got = dc.host();
  EXPECT_EQ(got[0], std::numeric_limits<float>::infinity());
  EXPECT_EQ(got[1], -std::numeric_limits<float>::infinity());
  EXPECT_EQ(got, want);
}

TEST(CudaGemm, Bf16OperandsGiveFp32OnRoundedInputs) {
  // gemm_bf16 takes bf16 storage: products of bf16 values are exact in fp32,
  // so with fp32 accumulation the only difference from the CPU on rounded
  // inputs is the summation order.
  for (bool ta : {false, true}) {
    GemmCase g = gemm_case(ta, !ta, 64, 48, 96, 13);
    const std::vector<float> want = cpu_gemm(g, rounded_to_bf16(g.a), rounded_to_bf16(g.b), 1.5f,
                                             0.5f);
    std::vector<bf16> a16, b16;
    for (float f : g.a) a16.push_back(to_bf16(f));
    for (float f : g.b) b16.push_back(to_bf16(f));
    Dev<bf16> da(a16), db(b16);
    Dev<float> c2(g.c);
    gemm_bf16(ctx(), g.ta, g.tb, g.m, g.n, g.k, 1.5f, da.p(), g.lda, db.p(), g.ldb, 0.5f, c2.p(),
              g.ldc);
    EXPECT_LT(rel(c2.host(), want), kFp32);
  }
}

TEST(CudaGemm, StridedBatchedIsALoopOfGemms) {
  const int64_t m = 17, n = 23, k = 31, batch = 5;
  const int64_t sa = m * k + 7, sb = k * n + 3, sc = m * n + 1;
  std::vector<float> ha = uniform(batch * sa, 14), hb = uniform(batch * sb, 15);
  std::vector<float> hc = uniform(batch * sc, 16), want = hc;
  for (int64_t i = 0; i < batch; ++i)
    cpu::gemm(false, true, m, n, k, 0.5f, ha.data() + i * sa, k, hb.data() + i * sb, k, 1.0f,
              want.data() + i * sc, n);
  Dev<float> a(ha), b(hb), c(hc);
  gemm_strided_batched(ctx(), MathMode::FP32, false, true, m, n, k, 0.5f, a.p(), k, sa, b.p(), k,
                       sb, 1.0f, c.p(), n, sc, batch);
  EXPECT_LT(rel(c.host(), want), kFp32);
}

// ---------------------------------------------------------------- LayerNorm, GELU, helpers

// C 200 and 768 (GPT-2's width) take the 16-byte kernels (1 and 3 groups of 8
// per lane; C 200 fills 25 of a warp's 32), C 77 the scalar ones. Both sum a
// row in another order than the CPU's loop; at these widths that moves the
// results by a few fp32 roundings, far inside kFp32.
TEST(CudaLayerNorm, ForwardAndBothBackwardsMatchCpu) {
  const int64_t n = 45;
  for (int64_t c : {200, 77, 768}) {
    SCOPED_TRACE(::testing::Message() << "c " << c);
    const std::vector<float> x = uniform(n * c, 21, -2.0f, 3.0f), w = uniform(c, 22),
                             b = uniform(c, 23), dy = uniform(n * c, 24);
    std::vector<float> y(n * c), mean(n), rstd(n);
    cpu::layernorm_forward(x.data(), w.data(), b.data(), y.data(), mean.data(), rstd.data(), n, c,
                           1e-5f);
    // Gradients accumulate onto what is already there.
    std::vector<float> dx = uniform(n * c, 25), dw = uniform(c, 26), db = uniform(c, 27);
    Dev<float> gdx(dx), gdw(dw), gdb(db);
    cpu::layernorm_backward_input(dy.data(), x.data(), w.data(), mean.data(), rstd.data(),
                                  dx.data(), n, c);
    cpu::layernorm_backward_weight(dy.data(), x.data(), mean.data(), rstd.data(), dw.data(),
                                   db.data(), n, c);

    Dev<float> gx(x), gw(w), gb(b), gdy(dy), gy(zeros(n * c)), gmean(zeros(n)), grstd(zeros(n));
    layernorm_forward(ctx(), gx.p(), gw.p(), gb.p(), gy.p(), gmean.p(), grstd.p(), n, c, 1e-5f);
    EXPECT_LT(rel(gy.host(), y), kFp32);
    EXPECT_LT(rel(gmean.host(), mean), kFp32);
    EXPECT_LT(rel(grstd.host(), rstd), kFp32);
    layernorm_backward_input(ctx(), gdy.p(), gx.p(), gw.p(), gmean.p(), grstd.p(), gdx.p(), n, c);
    layernorm_backward_weight(ctx(), gdy.p(), gx.p(), gmean.p(), grstd.p(), gdw.p(), gdb.p(), n, c);
    EXPECT_LT(rel(gdx.host(), dx), kFp32);
    EXPECT_LT(rel(gdw.host(), dw), kFp32);
    EXPECT_LT(rel(gdb.host(), db), kFp32);
  }
}

TEST(CudaLayerNorm, WeightGradientOverManyRowsUsesEverySlice) {
  // Enough rows for the two-pass column sum to use many row slices.
  const int64_t n = 8192 + 13, c = 96;
  const std::vector<float> x = uniform(n * c, 31), dy = uniform(n * c, 32), w = uniform(c, 33),
                           b = uniform(c, 34);
  std::vector<float> y(n * c), mean(n), rstd(n), dw(c, 0.0f), db(c, 0.0f);
  cpu::layernorm_forward(x.data(), w.data(), b.data(), y.data(), mean.data(), rstd.data(), n, c,
                         1e-5f);
  cpu::layernorm_backward_weight(dy.data(), x.data(), mean.data(), rstd.data(), dw.data(),
                                 db.data(), n, c);
  Dev<float> gx(x), gdy(dy), gmean(mean), grstd(rstd), gdw(zeros(c)), gdb(zeros(c));
  layernorm_backward_weight(ctx(), gdy.p(), gx.p(), gmean.p(), grstd.p(), gdw.p(), gdb.p(), n, c);
  EXPECT_LT(rel(gdw.host(), dw), kFp32);
  EXPECT_LT(rel(gdb.host(), db), kFp32);
}

TEST(CudaGelu, ForwardAndBackwardMatchCpu) {
  const int64_t n = 100003;
  const std::vector<float> x = uniform(n, 41, -5.0f, 5.0f), dy = uniform(n, 42);
  std::vector<float> y(n), dx = uniform(n, 43);
  Dev<float> gx(x), gdy(dy), gy(y), gdx(dx);
  cpu::gelu_forward(x.data(), y.data(), n);
  cpu::gelu_backward(dy.data(), x.data(), dx.data(), n);
  gelu_forward(ctx(), gx.p(), gy.p(), n);
  gelu_backward(ctx(), gdy.p(), gx.p(), gdx.p(), n);
  EXPECT_LT(rel(gy.host(), y), kFp32);
  EXPECT_LT(rel(gdx.host(), dx), kFp32);
}

// How many of got's floats differ from want's, bit for bit.
size_t differing_bits(const std::vector<float>& got, const std::vector<float>& want) {
  EXPECT_EQ(got.size(), want.size());
  size_t bad = 0;
  for (size_t i = 0; i < std::min(got.size(), want.size()); ++i)
    if (std::bit_cast<uint32_t>(got[i]) != std::bit_cast<uint32_t>(want[i])) ++bad;
  return bad;
}

// The column sums (the LayerNorm weight and bias gradients, sum_rows) take a
// 16-byte kernel on 16-byte aligned rows of a width that is a multiple of 8,
// the scalar one otherwise; both add each column's rows in one order, so the
// sums are the same bits. The same values are given at an aligned address
// and one element past one, fp32 and bf16.
TEST(CudaHelpers, ColumnSumsAreTheSameBitsFromAlignedAndUnalignedRows) {
  const int64_t n = 4096 + 13, c = 776;  // 33 row slices; 4 tiles of 256 columns, the last 8
  const std::vector<float> x = uniform(n * c, 61, -2.0f, 3.0f), dy = uniform(n * c, 62),
                           mean = uniform(n, 63), rstd = uniform(n, 64, 0.5f, 2.0f),
                           dw0 = uniform(c, 65), db0 = uniform(c, 66);
  auto check = [&](const auto& hx, const auto& hdy, const char* what) {
    SCOPED_TRACE(what);
    using T = typename std::decay_t<decltype(hx)>::value_type;
    auto one_in = [](std::vector<T> v) {
      v.insert(v.begin(), T{});
      return v;
    };
    Dev<T> ax(hx), ady(hdy), ux(one_in(hx)), udy(one_in(hdy));
    Dev<float> gmean(mean), grstd(rstd), adw(dw0), adb(db0), udw(dw0), udb(db0), arows(db0),
        urows(db0);
    layernorm_backward_weight(ctx(), ady.p(), ax.p(), gmean.p(), grstd.p(), adw.p(), adb.p(), n,
                              c);
    layernorm_backward_weight(ctx(), udy.p() + 1, ux.p() + 1, gmean.p(), grstd.p(), udw.p(),
                              udb.p(), n, c);
    sum_rows(ctx(), ady.p(), arows.p(), n, c);
    sum_rows(ctx(), udy.p() + 1, urows.p(), n, c);
    EXPECT_EQ(differing_bits(adw.host(), udw.host()), 0u) << "dw";
    EXPECT_EQ(differing_bits(adb.host(), udb.host()), 0u) << "db";
    EXPECT_EQ(differing_bits(arows.host(), urows.host()), 0u) << "sum_rows";
  };
  check(x, dy, "fp32");
  std::vector<bf16> x16, dy16;
  for (float f : x) x16.push_back(to_bf16(f));
  for (float f : dy) dy16.push_back(to_bf16(f));
  check(x16, dy16, "bf16");
}

TEST(CudaHelpers, BiasRowSumsAddAndScaleMatchCpu) {
  const int64_t n = 300, c = 77;
  std::vector<float> y = uniform(n * c, 51), bias = uniform(c, 52), db = uniform(c, 53),
                     x = uniform(n * c, 54);
  Dev<float> gy(y), gbias(bias), gdb(db), gx(x);
  cpu::add_bias(y.data(), bias.data(), n, c);
  add_bias(ctx(), gy.p(), gbias.p(), n, c);
  EXPECT_LT(rel(gy.host(), y), kFp32);
  cpu::sum_rows(y.data(), db.data(), n, c);
  sum_rows(ctx(), gy.p(), gdb.p(), n, c);
  EXPECT_LT(rel(gdb.host(), db), kFp32);
  cpu::add_inplace(y.data(), x.data(), n * c);
  add_inplace(ctx(), gy.p(), gx.p(), n * c);
  cpu::scale_inplace(y.data(), -0.25f, n * c);
  scale_inplace(ctx(), gy.p(), -0.25f, n * c);
  EXPECT_LT(rel(gy.host(), y), kFp32);
}

// ---------------------------------------------------------------- attention

// g key/value heads shared by h query heads (g = h: multi-head), head size d.
// The CPU reference rounds its GEMMs' inputs as `mode` does (the emulation of
// BF16 and FP16; TF32 has none, so its reference is fp32).
cpu::Rounding cpu_rounding(MathMode mode) {
  return mode == MathMode::BF16   ? cpu::Rounding::Bf16
         : mode == MathMode::FP16 ? cpu::Rounding::Fp16
                                  : cpu::Rounding::None;
}

// With `documents`, positions within documents (--reset-attention-mask):
// a query reads its own document's keys only.
void check_attention(int64_t b, int64_t t, int64_t h, int64_t c, MathMode mode, double tol,
                     int64_t g = 0, bool documents = false) {
  g = g > 0 ? g : h;
  const int64_t d = c / h, w = (h + 2 * g) * d;
  const std::vector<float> qkv = uniform(b * t * w, 61, -2.0f, 2.0f), dout = uniform(b * t * c, 62);
  std::vector<float> out(b * t * c), probs(b * h * t * t), scratch(b * h * t * t);
  std::vector<float> dqkv = uniform(b * t * w, 63);
  const std::vector<int32_t> pos =
      documents ? document_positions(b, t, 64) : std::vector<int32_t>(static_cast<size_t>(b * t));
  Dev<float> gqkv(qkv), gout(out), gprobs(probs), gdout(dout), gdqkv(dqkv), gscratch(scratch);
  Dev<int32_t> gpos(pos);
  const int32_t* cpos = documents ? pos.data() : nullptr;
  cpu::attention_forward(qkv.data(), out.data(), probs.data(), b, t, h, g, d, cpu_rounding(mode),
                         cpos);
  cpu::attention_backward(dout.data(), qkv.data(), probs.data(), dqkv.data(), scratch.data(), b, t,
                          h, g, d, cpu_rounding(mode));
  attention_forward(ctx(), mode, gqkv.p(), gout.p(), gprobs.p(), b, t, h, g, d,
                    documents ? gpos.p() : nullptr);
  attention_backward(ctx(), mode, gdout.p(), gqkv.p(), gprobs.p(), gdqkv.p(), gscratch.p(), b, t,
                     h, g, d);
  const std::vector<float> got_probs = gprobs.host();
  EXPECT_LT(rel(gout.host(), out), tol) << "T " << t;
  EXPECT_LT(rel(got_probs, probs), tol) << "T " << t;
  EXPECT_LT(rel(gdqkv.host(), dqkv), tol) << "T " << t;
  // The causal mask: nothing above the diagonal (nor before the row's
  // document), every row sums to 1.
  for (int64_t r = 0; r < b * h * t; r += 7) {
    const int64_t i = r % t;
    const int64_t first = documents ? i - pos[static_cast<size_t>(r / (h * t) * t + i)] : 0;
    double row = 0;
    for (int64_t j = 0; j < t; ++j) {
      const float p = got_probs[static_cast<size_t>(r * t + j)];
      if (j > i || j < first) {
        EXPECT_EQ(p, 0.0f) << "row " << r << " col " << j;
      }
      row += p;
    }
    EXPECT_NEAR(row, 1.0, 1e-5);
  }
}

TEST(CudaAttention, Fp32MatchesCpuOnRaggedShapes) {
  check_attention(2, 37, 3, 48, MathMode::FP32, kFp32);
  check_attention(1, 1, 2, 8, MathMode::FP32, kFp32);  // a single position
  check_attention(2, 128, 4, 256, MathMode::FP32, kFp32);
  check_attention(2, 37, 6, 48, MathMode::FP32, kFp32, 2);  // grouped-query: 3 heads a group
  check_attention(1, 16, 4, 32, MathMode::FP32, kFp32, 1);  // one key/value head
}

// Every T of kSeqLengths up to 1024 (two heads of 16, so that T = 1024
// stays small: 2M probabilities; grouped-query at every other T), fp32: the
// longest reductions are T = 1024 terms, 2^-24 sqrt(1024) = 2e-6 relative,
// inside kFp32.
TEST(CudaAttention, Fp32MatchesCpuAtEverySequenceLength) {
  int k = 0;
  for (const int64_t t : weft::testing::kSeqLengths)
    check_attention(t <= 129 ? 2 : 1, t, 2, 32, MathMode::FP32, kFp32, k++ % 2 == 1 ? 1 : 0);
}

// --reset-attention-mask: documents of 1 to 9 tokens, multi-head and
// grouped-query; the backward reads the masked probabilities as they are.
TEST(CudaAttention, WithinDocumentsMatchesCpu) {
  check_attention(2, 37, 3, 48, MathMode::FP32, kFp32, 0, true);
  check_attention(3, 64, 4, 64, MathMode::FP32, kFp32, 2, true);
}

TEST(CudaAttention, Tf32Bf16AndFp16AreClose) {
  // Scores and probabilities inherit the inputs' rounding (TF32 2^-11, bf16
  // 2^-9, fp16 2^-11), against fp32 for TF32 and against the CPU's emulation
  // for bf16 and fp16 (which bounds them too: cuBLAS may round its inputs
  // differently inside, see check_rounded_gemm).
  check_attention(2, 64, 4, 128, MathMode::TF32, 1e-2);
  check_attention(2, 64, 4, 128, MathMode::BF16, 5e-2);
  check_attention(2, 64, 4, 128, MathMode::FP16, 1e-2);
}

// ---------------------------------------------------------------- cross-entropy

TEST(CudaCrossEntropy, ProbabilitiesLossesAndGradientsMatchCpu) {
  const int64_t n = 13, v = 1000;
  const std::vector<float> logits = uniform(n * v, 71, -8.0f, 8.0f);
  const std::vector<int32_t> targets = random_tokens(n, static_cast<int32_t>(v), 72);
  const float scale = 1.0f / 26.0f;
  std::vector<float> probs = logits, losses(n), dlogits(n * v);
  const double total = cpu::softmax_cross_entropy(probs.data(), targets.data(), losses.data(), n,
                                                  v);
  cpu::cross_entropy_backward(probs.data(), targets.data(), dlogits.data(), scale, n, v);

  Dev<float> gp(logits), glosses(zeros(n)), gd(zeros(n * v));
  Dev<int32_t> gt(targets);
  softmax_cross_entropy(ctx(), gp.p(), gt.p(), glosses.p(), n, v);
  EXPECT_LT(rel(gp.host(), probs), kFp32);
  EXPECT_LT(rel(glosses.host(), losses), kFp32);
  EXPECT_NEAR(sum_to_host(ctx(), glosses.p(), n), total, 1e-5 * std::abs(total));
  cross_entropy_backward(ctx(), gp.p(), gt.p(), gd.p(), scale, n, v);
  EXPECT_LT(rel(gd.host(), dlogits), kFp32);

  // Fused: one pass from logits to losses and dlogits.
  Dev<float> gf(logits), gfl(zeros(n));
  fused_cross_entropy(ctx(), gf.p(), gt.p(), gfl.p(), scale, n, v);
  EXPECT_LT(rel(gf.host(), dlogits), kFp32);
  EXPECT_LT(rel(gfl.host(), losses), kFp32);
}

TEST(CudaCrossEntropy, GptVocabularyRows) {
  const int64_t n = 4, v = 50257;
  const std::vector<float> logits = uniform(n * v, 73, -10.0f, 10.0f);
  const std::vector<int32_t> targets = {0, 50256, 17, 31337};
  std::vector<float> probs = logits, losses(n);
  cpu::softmax_cross_entropy(probs.data(), targets.data(), losses.data(), n, v);
  Dev<float> gp(logits), gl(zeros(n));
  Dev<int32_t> gt(targets);
  softmax_cross_entropy(ctx(), gp.p(), gt.p(), gl.p(), n, v);
  EXPECT_LT(rel(gl.host(), losses), kFp32);
  EXPECT_LT(rel(gp.host(), probs), kFp32);
}

// A padded vocabulary (GPT-2's 50257 padded to 50304): mask_columns sets the
// padding columns to -inf; the softmax, the fused classifier and the
// vocabulary-parallel steps (on a slice with padding, and on one of padding
// only) give them probability and dlogits exactly 0, and the real columns
// match the CPU's softmax over the real columns alone.
TEST(CudaCrossEntropy, MaskedPaddingColumnsAreExactlyZero) {
  const int64_t n = 5, real = 50257, v = 50304;
  const std::vector<float> logits = uniform(n * v, 75, -10.0f, 10.0f);
  const std::vector<int32_t> targets = {0, 50256, 17, 31337, 9};
  const float scale = 0.5f;
  std::vector<float> narrow(n * real), losses(n), dlogits(n * real);
  for (int64_t i = 0; i < n; ++i)
    std::copy(logits.begin() + i * v, logits.begin() + i * v + real, narrow.begin() + i * real);
  cpu::softmax_cross_entropy(narrow.data(), targets.data(), losses.data(), n, real);
  cpu::cross_entropy_backward(narrow.data(), targets.data(), dlogits.data(), scale, n, real);
  auto split = [&](const std::vector<float>& padded, const char* what) {
    std::vector<float> out(n * real);
    for (int64_t i = 0; i < n; ++i) {
      std::copy(padded.begin() + i * v, padded.begin() + i * v + real, out.begin() + i * real);
      for (int64_t j = real; j < v; ++j)
        EXPECT_EQ(padded[static_cast<size_t>(i * v + j)], 0.0f) << what << " row " << i;
    }
    return out;
  };
  Dev<int32_t> gt(targets);
  {
    Dev<float> gp(logits), gl(zeros(n));
    mask_columns(ctx(), gp.p(), n, v, real);
    const std::vector<float> masked = gp.host();
    EXPECT_EQ(masked[static_cast<size_t>(v - 1)], -INFINITY);
    EXPECT_EQ(masked[static_cast<size_t>(real - 1)], logits[static_cast<size_t>(real - 1)]);
    softmax_cross_entropy(ctx(), gp.p(), gt.p(), gl.p(), n, v);
    EXPECT_LT(rel(gl.host(), losses), kFp32);
    cross_entropy_backward(ctx(), gp.p(), gt.p(), gp.p(), scale, n, v);
    EXPECT_LT(rel(split(gp.host(), "softmax + backward"), dlogits), kFp32);
  }
  {
    Dev<float> gf(logits), gl(zeros(n));
    mask_columns(ctx(), gf.p(), n, v, real);
    fused_cross_entropy(ctx(), gf.p(), gt.p(), gl.p(), scale, n, v);
    EXPECT_LT(rel(gl.host(), losses), kFp32);
    EXPECT_LT(rel(split(gf.host(), "fused"), dlogits), kFp32);
  }
  // A tensor-parallel slice of 7 real columns then padding, and one of padding only.
  for (const int64_t keep : {int64_t{7}, int64_t{0}}) {
    const int64_t w = 54;
    Dev<float> gs(uniform(n * w, 76, -3.0f, 3.0f)), gm(zeros(n)), gsum(zeros(n)), gz(zeros(n));
    mask_columns(ctx(), gs.p(), n, w, keep);
    row_max(ctx(), gs.p(), gm.p(), n, w);
    if (keep == 0) {
      EXPECT_EQ(gm.host()[0], -INFINITY);
    }
    Dev<float> group_max(std::vector<float>(static_cast<size_t>(n), 3.0f));
    const int64_t first = real - keep;  // the slice's first token: real ones end at 50257
    exp_and_stats(ctx(), gs.p(), gt.p(), first, group_max.p(), gsum.p(), gz.p(), n, w);
    if (keep == 0) {
      EXPECT_EQ(gsum.host()[0], 0.0f) << "padding adds nothing to S";
    }
    Dev<float> group_sum(std::vector<float>(static_cast<size_t>(n), 2.0f));  // the group's S
    Dev<float> loss(zeros(1));
    normalise_and_loss(ctx(), gs.p(), group_sum.p(), gz.p(), gt.p(), n, w, loss.p());
    cross_entropy_backward(ctx(), gs.p(), gt.p(), gs.p(), scale, n, w, first);
    const std::vector<float> d = gs.host();
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = keep; j < w; ++j)
        EXPECT_EQ(d[static_cast<size_t>(i * w + j)], 0.0f) << "keep " << keep << " row " << i;
  }
}

// --eod-mask-loss: an ignored target's row has loss 0 and dlogits 0 in
// every path (two-step, fused, vocabulary-parallel), as on the CPU.
TEST(CudaCrossEntropy, IgnoredTargetsAddNoLossAndNoGradient) {
  const int64_t n = 9, v = 300;
  const std::vector<float> logits = uniform(n * v, 75, -6.0f, 6.0f);
  std::vector<int32_t> targets = random_tokens(n, static_cast<int32_t>(v), 76);
  targets[1] = targets[4] = targets[8] = kIgnoredTarget;
  const float scale = 0.25f;
  std::vector<float> probs = logits, losses(n), dlogits(n * v);
  cpu::softmax_cross_entropy(probs.data(), targets.data(), losses.data(), n, v);
  cpu::cross_entropy_backward(probs.data(), targets.data(), dlogits.data(), scale, n, v);
  for (int64_t i : {1, 4, 8}) {
    EXPECT_EQ(losses[static_cast<size_t>(i)], 0.0f);
    for (int64_t j = 0; j < v; ++j) EXPECT_EQ(dlogits[static_cast<size_t>(i * v + j)], 0.0f);
  }
  Dev<int32_t> gt(targets);
  Dev<float> gp(logits), gl(zeros(n)), gd(zeros(n * v));
  softmax_cross_entropy(ctx(), gp.p(), gt.p(), gl.p(), n, v);
  cross_entropy_backward(ctx(), gp.p(), gt.p(), gd.p(), scale, n, v);
  EXPECT_LT(rel(gl.host(), losses), kFp32);
  EXPECT_LT(rel(gd.host(), dlogits), kFp32);
  Dev<float> gf(logits), gfl(zeros(n));
  fused_cross_entropy(ctx(), gf.p(), gt.p(), gfl.p(), scale, n, v);
  EXPECT_LT(rel(gf.host(), dlogits), kFp32);
  EXPECT_LT(rel(gfl.host(), losses), kFp32);
  // The vocabulary-parallel steps on one whole slice: the loss of the others.
  double total = 0;
  for (float l : losses) total += l;
  Dev<float> gv(logits), gm(zeros(n)), gsum(zeros(n)), gz(zeros(n)), gloss(zeros(1));
  row_max(ctx(), gv.p(), gm.p(), n, v);
  exp_and_stats(ctx(), gv.p(), gt.p(), 0, gm.p(), gsum.p(), gz.p(), n, v);
  normalise_and_loss(ctx(), gv.p(), gsum.p(), gz.p(), gt.p(), n, v, gloss.p());
  EXPECT_NEAR(gloss.host()[0], total, 1e-5 * total);
}

TEST(CudaCrossEntropy, TargetOutsideTheVocabularyGivesNaNNotAStrayWrite) {
  const int64_t n = 2, v = 10;
  Dev<float> gp(uniform(n * v, 74)), gl(zeros(n));
  Dev<int32_t> gt(std::vector<int32_t>{3, 10});
  softmax_cross_entropy(ctx(), gp.p(), gt.p(), gl.p(), n, v);
  const std::vector<float> l = gl.host();
  EXPECT_TRUE(std::isfinite(l[0]));
  EXPECT_TRUE(std::isnan(l[1]));
}

// ---------------------------------------------------------------- embedding

TEST(CudaEmbedding, ForwardAndScatterAddBackwardMatchTheLayer) {
  const int64_t b = 3, t = 20, c = 40, v = 11, positions = 24;
  ParamStore store;
  Param* wte = store.create("wte.weight", {v, c}, Init::normal(0.02f));
  Param* wpe = store.create("wpe.weight", {positions, c}, Init::normal(0.02f));
  init_param(*wte, 5);
  init_param(*wpe, 5);
  std::vector<float> dwte0 = uniform(v * c, 81), dwpe0 = uniform(positions * c, 82);
  std::copy(dwte0.begin(), dwte0.end(), wte->grad.data<float>());
  std::copy(dwpe0.begin(), dwpe0.end(), wpe->grad.data<float>());
  // Few distinct tokens: many rows scatter into the same wte row.
  const std::vector<int32_t> tokens = random_tokens(b * t, static_cast<int32_t>(v), 83);
  const std::vector<float> dy = uniform(b * t * c, 84);

  Embedding layer(wte, wpe);
  auto lctx = layer.make_ctx();
  Arena arena;
  Tensor tok(const_cast<int32_t*>(tokens.data()), Shape{b, t}, DType::I32);
  Tensor y = Tensor::zeros({b, t, c});
  Tensor dyt(const_cast<float*>(dy.data()), Shape{b, t, c}, DType::F32);
  layer.forward(*lctx, arena, std::span<const Tensor>(&tok, 1), std::span<const Tensor>(&y, 1));
  Tensor none;
  layer.backward_input(*lctx, arena, std::span<const Tensor>(&dyt, 1),
                       std::span<const Tensor>(&none, 1));
  layer.backward_weight(*lctx, arena);

  auto vec = [](const Tensor& x) {
    return std::vector<float>(x.data<float>(), x.data<float>() + x.numel());
  };
  Dev<float> gwte(vec(wte->value)), gwpe(vec(wpe->value)), gy(zeros(b * t * c));
  Dev<float> gdwte(dwte0), gdwpe(dwpe0), gdy(dy);
  Dev<int32_t> gtok(tokens);
  embedding_forward(ctx(), gtok.p(), gwte.p(), gwpe.p(), gy.p(), b, t, c);
  embedding_backward(ctx(), gtok.p(), gdy.p(), gdwte.p(), gdwpe.p(), b, t, c);
  EXPECT_LT(rel(gy.host(), vec(y)), kFp32);
  EXPECT_LT(rel(gdwte.host(), vec(wte->grad)), kFp32);
  EXPECT_LT(rel(gdwpe.host(), vec(wpe->grad)), kFp32);

  // Positions within documents (--reset-position-ids): wpe read, and its
  // gradient scattered, by position.
  const std::vector<int32_t> pos = document_positions(b, t, 85);
  Tensor post(const_cast<int32_t*>(pos.data()), Shape{b, t}, DType::I32);
  const Tensor ins[2] = {tok, post};
  auto dctx = layer.make_ctx();
  wpe->grad.copy_from(Tensor(dwpe0.data(), Shape{positions, c}, DType::F32));
  layer.forward(*dctx, arena, std::span<const Tensor>(ins, 2), std::span<const Tensor>(&y, 1));
  layer.backward_input(*dctx, arena, std::span<const Tensor>(&dyt, 1),
                       std::span<const Tensor>(&none, 1));
  layer.backward_weight(*dctx, arena);
  Dev<float> gdwpe2(dwpe0), gy2(zeros(b * t * c));
  Dev<int32_t> gpos(pos);
  embedding_forward(ctx(), gtok.p(), gwte.p(), gwpe.p(), gy2.p(), b, t, c, INT64_MAX, 0, gpos.p());
  embedding_backward(ctx(), gtok.p(), gdy.p(), gdwte.p(), gdwpe2.p(), b, t, c, INT64_MAX, 0,
                     gpos.p());
  EXPECT_LT(rel(gy2.host(), vec(y)), kFp32);
  EXPECT_LT(rel(gdwpe2.host(), vec(wpe->grad)), kFp32);
}

// Rotary embedding at each token's position within its document
// (--reset-position-ids), and at t, as the CPU's.
TEST(CudaRope, PositionsWithinDocumentsMatchCpu) {
  const int64_t b = 2, t = 19, h = 4, g = 2, d = 16, w = (h + 2 * g) * d;
  const std::vector<float> x = uniform(b * t * w, 91), dy = uniform(b * t * w, 92);
  const std::vector<int32_t> pos = document_positions(b, t, 93);
  for (const bool documents : {false, true}) {
    const int32_t* cpos = documents ? pos.data() : nullptr;
    std::vector<float> y(x.size()), dx = uniform(b * t * w, 94);
    Dev<float> gx(x), gy(zeros(b * t * w)), gdy(dy), gdx(dx);
    Dev<int32_t> gpos(pos);
    cpu::rope_forward(x.data(), y.data(), b, t, h, g, d, 100.0f, cpos);
    cpu::rope_backward(dy.data(), dx.data(), b, t, h, g, d, 100.0f, cpos);
    rope_forward(ctx(), gx.p(), gy.p(), b, t, h, g, d, 100.0f, documents ? gpos.p() : nullptr);
    rope_backward(ctx(), gdy.p(), gdx.p(), b, t, h, g, d, 100.0f, documents ? gpos.p() : nullptr);
    EXPECT_LT(rel(gy.host(), y), kFp32) << documents;
    EXPECT_LT(rel(gdx.host(), dx), kFp32) << documents;
  }
}

// ---------------------------------------------------------------- AdamW, reductions, bf16

TEST(CudaAdamW, ThreeStepsMatchCpu) {
  const int64_t n = 5001;
  std::vector<float> p = uniform(n, 91), m(n, 0.0f), v(n, 0.0f);
  Dev<float> gp(p), gm(m), gv(v);
  for (int64_t step = 1; step <= 3; ++step) {
    const std::vector<float> g = uniform(n, 92 + static_cast<uint64_t>(step));
    Dev<float> gg(g);
    cpu::adamw(p.data(), g.data(), m.data(), v.data(), n, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, step);
    adamw(ctx(), gp.p(), gg.p(), gm.p(), gv.p(), n, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, step);
  }
  EXPECT_LT(rel(gp.host(), p), kFp32);
  EXPECT_LT(rel(gm.host(), m), kFp32);
  EXPECT_LT(rel(gv.host(), v), kFp32);
}

TEST(CudaSgd, ThreeStepsMatchCpu) {
  const int64_t n = 5001;
  std::vector<float> p = uniform(n, 93), buf(n, 0.0f);
  Dev<float> gp(p), gb(buf);
  for (int64_t step = 1; step <= 3; ++step) {
    const std::vector<float> g = uniform(n, 94 + static_cast<uint64_t>(step));
    Dev<float> gg(g);
    cpu::sgd(p.data(), g.data(), buf.data(), n, 0.05f, 0.9f, 0.1f);
    sgd(ctx(), gp.p(), gg.p(), gb.p(), n, 0.05f, 0.9f, 0.1f);
  }
  EXPECT_LT(rel(gp.host(), p), kFp32);
  EXPECT_LT(rel(gb.host(), buf), kFp32);
}

TEST(CudaReduce, SumsInDoubleMatchCpu) {
  for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{3000017}}) {
    const std::vector<float> x = uniform(n, 101);
    Dev<float> gx(x);
    double s = 0;
    for (float f : x) s += f;
    EXPECT_NEAR(sum_to_host(ctx(), gx.p(), n), s, 1e-9 * n) << n;
    const double sq = cpu::sum_squares(x.data(), n);
    EXPECT_NEAR(sum_squares_to_host(ctx(), gx.p(), n), sq, 1e-12 * sq) << n;
  }
}

TEST(CudaBf16, ConversionMatchesTheHostRoundingBitForBit) {
  std::vector<float> x = uniform(100000, 111, -1e4f, 1e4f);
  x.insert(x.end(), {0.0f, -0.0f, 1.0f + 0x01p-8f, 1.0f + 3 * 0x01p-8f, 3.0e38f, -1e-40f});
  Dev<float> gx(x);
  DeviceBuffer<bf16> g16(ctx(), static_cast<int64_t>(x.size()));
  to_bf16(ctx(), gx.p(), g16.data(), static_cast<int64_t>(x.size()));
  std::vector<bf16> h16(x.size());
  download(ctx(), h16.data(), g16.data(), g16.bytes());
  for (size_t i = 0; i < x.size(); ++i)
    ASSERT_EQ(h16[i].bits, to_bf16(x[i]).bits) << "value " << x[i];
  Dev<float> back(zeros(static_cast<int64_t>(x.size())));
  to_float(ctx(), g16.data(), back.p(), static_cast<int64_t>(x.size()));
  const std::vector<float> hb = back.host();
  for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(hb[i], to_float(h16[i]));
}

// ---------------------------------------------------------------- runtime on the device

TEST(CudaRuntime, RepeatedStepAllocatesNothingNew) {
  // A "step": the same sizes every time, freed at its end.
  auto step = [] {
    DeviceBuffer<float> a(ctx(), 1 << 20), b(ctx(), 3000), c(ctx(), 12345);
    zero(ctx(), a.data(), a.bytes());
    gelu_forward(ctx(), a.data(), a.data(), a.size());
    return sum_to_host(ctx(), a.data(), a.size());
  };
  EXPECT_EQ(step(), 0.0);
  const AllocatorStats first = ctx().allocator().stats();
  EXPECT_EQ(step(), 0.0);
  const AllocatorStats second = ctx().allocator().stats();
  EXPECT_EQ(second.device_mallocs, first.device_mallocs);
  EXPECT_GT(second.cache_hits, first.cache_hits);
  // Tensors on the device are served by the same allocator.
  { Tensor t = Tensor::empty({4096}, DType::F32, Device::cuda(0)); }
  const size_t before = ctx().allocator().stats().device_mallocs;
  { Tensor t = Tensor::empty({4096}, DType::F32, Device::cuda(0)); }
  EXPECT_EQ(ctx().allocator().stats().device_mallocs, before);
}

// Queued work long enough on an H200 for a copy that does not wait to run
// first; the GPU emulator runs queued work only when something needs it, so
// there a little is enough.
constexpr bool kEmulated = WEFT_GPU_EMULATOR;

TEST(CudaRuntime, CommStreamWaitsForComputeAndBack) {
  const int64_t n = int64_t{1} << (kEmulated ? 12 : 24);
  std::vector<float> ones(static_cast<size_t>(n), 1.0f);
  Dev<float> src(ones);
  DeviceBuffer<float> dst(ctx(), n), back(ctx(), n);
  zero(ctx(), dst.data(), dst.bytes());
  // Long compute work on src, then a copy on the communication stream.
  const int passes = kEmulated ? 2 : 20;
  for (int i = 0; i < passes; ++i) scale_inplace(ctx(), src.p(), 2.0f, n);
  ctx().comm_waits_for_compute();
  copy_device(ctx(), dst.data(), src.p(), dst.bytes(), StreamKind::Comm);
  ctx().synchronize();
  // Exact: 2^passes per element. A copy that ran early would see smaller values.
  const double want = std::ldexp(1.0, passes) * static_cast<double>(n);
  EXPECT_EQ(sum_to_host(ctx(), dst.data(), n), want);
  // Back: compute work reads what the communication stream wrote.
  zero(ctx(), back.data(), back.bytes());
  ctx().comm_waits_for_compute();
  copy_device(ctx(), back.data(), dst.data(), back.bytes(), StreamKind::Comm);
  ctx().compute_waits_for_comm();
  EXPECT_EQ(sum_to_host(ctx(), back.data(), n), want);
  ctx().synchronize();
}

TEST(CudaRuntime, PinnedCopiesRoundTripAndGrow) {
  const std::vector<float> big = uniform(int64_t{3} << 20, 121);  // 12 MiB
  Dev<float> d(big);
  EXPECT_GE(ctx().staging_bytes(), big.size() * sizeof(float));
  EXPECT_EQ(d.host(), big);
}

// Small uploads rotate through a ring of pinned buffers, each reused only
// once the copy that last read it has run; while it has not, the ring grows
// rather than the host wait. Queued behind long compute work, 25 uploads
// must each land with their own values (a slot refilled too early would
// hand a later upload's values to an earlier copy), and on a GPU, where that
// work is still running, the ring has grown to hold them all (the emulator
// runs queued work when asked whether it is done, so there it need not grow).
TEST(CudaRuntime, SmallUploadsBehindQueuedWorkEachLand) {
  const int64_t n = int64_t{1} << (kEmulated ? 12 : 22);
  Dev<float> busy(uniform(n, 122));
  // Every buffer first (no allocation between the uploads), then some
  // 15 ms of queued work on an H200 (2000 passes reading and writing 16
  // MiB), then the uploads.
  std::vector<std::vector<float>> want;
  std::vector<DeviceBuffer<float>> got;
  for (int k = 0; k < 25; ++k) {
    want.push_back(uniform(1000 + k, 200 + static_cast<uint64_t>(k)));
    got.emplace_back(ctx(), static_cast<int64_t>(want.back().size()));
  }
  for (int i = 0; i < (kEmulated ? 1 : 2000); ++i) scale_inplace(ctx(), busy.p(), 1.0f, n);
  for (size_t k = 0; k < want.size(); ++k)
    upload(ctx(), got[k].data(), want[k].data(), got[k].bytes());
  if (!kEmulated) {
    EXPECT_GE(ctx().small_slots(), want.size());
  }
  for (size_t k = 0; k < want.size(); ++k) {
    std::vector<float> back(want[k].size());
    download(ctx(), back.data(), got[k].data(), got[k].bytes());
    EXPECT_EQ(back, want[k]) << "upload " << k;
  }
}

TEST(CudaRuntime, ErrorsNameTheCallAndTheValues) {
  EXPECT_TRUE(contains(error_message([] { ctx().allocator().allocate(size_t{1} << 50); }),
                       "out of device memory allocating 1125899906842624 bytes"));
  // lda smaller than the row: cuBLAS rejects it, and the message says which call.
  Dev<float> a(std::vector<float>(64, 1.0f)), c(std::vector<float>(64, 0.0f));
  const std::string msg = error_message([&] {
    gemm(ctx(), MathMode::FP32, false, false, 8, 8, 8, 1.0f, a.p(), 2, a.p(), 8, 0.0f, c.p(), 8);
  });
  EXPECT_TRUE(contains(msg, "cublasGemmEx")) << msg;
  EXPECT_TRUE(contains(msg, "CUBLAS_STATUS_INVALID_VALUE")) << msg;
  EXPECT_TRUE(contains(error_message([] { context(1000); }), "cuda:1000 requested"));
}

}  // namespace
}  // namespace weft::cuda
#endif  // WEFT_CUDA
