// The bias GEMMs of weft/cuda/kernels.h (cuBLASLt's bias epilogue) against
// the two steps they replace: C's rows filled with the bias, then the plain
// GEMM with beta 1 (gemm, gemm_bf16_out) onto them; and against an fp64
// reference. Every transpose combination, ragged sizes (m 37, k 48, n 200 and
// 123), packed rows and rows padded beyond their width (the padding must stay
// untouched). Also: aligned shapes take cuBLASLt's epilogue (no fallback
// counted), an unaligned bias takes the two steps (counted, bit for bit),
// k 0 (C = the bias rows), m or n 0 (nothing written), a repeated call
// allocates nothing, and bad input is refused. Last, the GELU epilogues of
// an MLP's GEMMs (gemm_bias_gelu_bf16, gemm_dgelu_bf16) against fp64, and
// their fallback; and the bias-gradient epilogue (gemm_bf16_bias_grad).
// Needs a GPU; exits 77 (SKIP) without one.
#include "weft_config.h"

#if WEFT_CUDA
#include <weft/cuda/kernels.h>
#include <weft/cuda/runtime.h>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "cuda_test_util.h"
#include "test_util.h"

namespace weft::cuda {
namespace {

using test_util::Dev;

using weft::testing::contains;
using weft::testing::error_message;
using weft::testing::uniform;

Context& ctx() { return context(0); }

// One bias GEMM's operands, row-major, host side. With `padded`, every row
// is wider than its logical width (ld > cols), so strides are exercised and
// C's padding columns can be checked to stay untouched.
struct Case {
  bool ta, tb;
  int64_t m, n, k, lda, ldb, ldc;
  std::vector<float> a, b, bias, c;  // c: C before the call (never the answer)
};

Case make_case(bool ta, bool tb, int64_t m, int64_t n, int64_t k, bool padded, uint64_t seed) {
  const int64_t pa = padded ? 3 : 0, pb = padded ? 5 : 0, pc = padded ? 2 : 0;
  Case g{ta, tb, m, n, k, (ta ? m : k) + pa, (tb ? k : n) + pb, n + pc, {}, {}, {}, {}};
  g.a = uniform((ta ? k : m) * g.lda, seed);
  g.b = uniform((tb ? n : k) * g.ldb, seed + 1);
  g.bias = uniform(n, seed + 2);
  g.c = uniform(m * g.ldc, seed + 3, 50.0f, 60.0f);  // far from any answer
  return g;
}

// The same case with A, B, bias and C rounded to bf16 (round to nearest
// even, as cuda::to_bf16), for the bf16 GEMM and the bf16 math mode's
// reference.
Case rounded(Case g) {
  for (std::vector<float>* v : {&g.a, &g.b, &g.bias, &g.c})
    for (float& f : *v) f = to_float(to_bf16(f));
  return g;
}

float a_at(const Case& g, int64_t i, int64_t l) {
  return g.ta ? g.a[static_cast<size_t>(l * g.lda + i)] : g.a[static_cast<size_t>(i * g.lda + l)];
}
float b_at(const Case& g, int64_t l, int64_t j) {
  return g.tb ? g.b[static_cast<size_t>(j * g.ldb + l)] : g.b[static_cast<size_t>(l * g.ldb + j)];
}

// fp64 reference: exact[i][j] = sum_l a_il b_lj + bias_j (exact to 2^-50 or
// so), and abs[i][j] = sum_l |a_il b_lj| + |bias_j|, the scale of its
// rounding errors.
struct Reference {
  std::vector<double> exact, abs;
};
Reference reference(const Case& g) {
  Reference r{std::vector<double>(static_cast<size_t>(g.m * g.n)),
              std::vector<double>(static_cast<size_t>(g.m * g.n))};
  for (int64_t i = 0; i < g.m; ++i)
    for (int64_t j = 0; j < g.n; ++j) {
      double s = g.bias[static_cast<size_t>(j)], sa = std::fabs(s);
      for (int64_t l = 0; l < g.k; ++l) {
        const double p = static_cast<double>(a_at(g, i, l)) * b_at(g, l, j);
        s += p;
        sa += std::fabs(p);
      }
      r.exact[static_cast<size_t>(i * g.n + j)] = s;
      r.abs[static_cast<size_t>(i * g.n + j)] = sa;
    }
  return r;
}

// C before the call with every row's first n columns set to the bias: what
// zero + add_bias (fp32) or fill_rows (bf16, the bias already in bf16)
// leaves for the GEMM with beta 1.
template <typename T>
std::vector<T> bias_rows(const Case& g, const std::vector<T>& c, const std::vector<T>& bias) {
  std::vector<T> r = c;
  for (int64_t i = 0; i < g.m; ++i)
    std::copy(bias.begin(), bias.end(), r.begin() + i * g.ldc);
  return r;
}

std::vector<bf16> to_bf16(const std::vector<float>& x) {
  std::vector<bf16> r;
  for (float f : x) r.push_back(cuda::to_bf16(f));
  return r;
}

// C's padding columns [n, ldc) are what they were before the call.
template <typename T>
void expect_padding_untouched(const Case& g, const std::vector<T>& got,
                              const std::vector<T>& before, const std::string& what) {
  for (int64_t i = 0; i < g.m; ++i)
    for (int64_t j = g.n; j < g.ldc; ++j) {
      const size_t at = static_cast<size_t>(i * g.ldc + j);
      ASSERT_EQ(std::memcmp(&got[at], &before[at], sizeof(T)), 0)
          << what << ": padding column " << j << " of row " << i << " was written";
    }
}

std::string describe(const Case& g) {
  return fmt::format("m {} n {} k {} trans_a {} trans_b {} lda {} ldb {} ldc {}", g.m, g.n, g.k,
                     g.ta, g.tb, g.lda, g.ldb, g.ldc);
}

// ------------------------------------------------------------ fp32 operands

// gemm_bias in `mode` against the bias rows + gemm(mode, beta 1), and FP32
// against fp64. Error model, u = 2^-24 (fp32's unit roundoff):
// - each fp32 result is the k products and the bias summed in some order
//   (cuBLAS's and cuBLASLt's kernels may split k differently), so it is
//   within (k + 1) u (sum |a b| + |bias|) of the sum of those products
//   (gamma_{k+1}, first order; an FMA only tightens it); two such results
//   differ by at most twice that: (k + 1) 2^-23 (sum |a b| + |bias|);
// - TF32, BF16 and FP16 round A and B inside cuBLAS's kernel. Where both
//   kernels round to nearest the products are the same and only the sum's
//   order differs; where one of them truncated instead (a mantissa of
//   `unit`: tf32 and fp16 2^-10, bf16 2^-7, nearest by unit / 2), a product
//   moves by up to 2 (unit + unit / 2) |a b|, i.e. 3 unit |a b|;
// - fp16's subnormals (below 2^-14) lose relative precision: at most 2^-25
//   absolute per input, 2 k 2^-25 more.
// The test prints how much of the summation-only bound the worst element used.
void check_gemm_bias(MathMode mode, double unit, double subnormal) {
  const double u = std::ldexp(1.0, -24);
  uint64_t seed = 100;
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (int64_t n : {200, 123})
        for (bool padded : {false, true}) {
          const Case g = make_case(ta, tb, 37, n, 48, padded, seed += 10);
          Dev<float> a(g.a), b(g.b), bias(g.bias), c(g.c), two_step(bias_rows(g, g.c, g.bias));
          gemm_bias(ctx(), mode, ta, tb, g.m, g.n, g.k, a.p(), g.lda, b.p(), g.ldb, bias.p(),
                    c.p(), g.ldc);
          gemm(ctx(), mode, ta, tb, g.m, g.n, g.k, 1.0f, a.p(), g.lda, b.p(), g.ldb, 1.0f,
               two_step.p(), g.ldc);
          const std::vector<float> got = c.host(), want = two_step.host();
          expect_padding_untouched(g, got, g.c, describe(g));
          const Reference ref = reference(g);
          const double k = static_cast<double>(g.k);
          double worst = 0;
          for (int64_t i = 0; i < g.m; ++i)
            for (int64_t j = 0; j < g.n; ++j) {
              const size_t at = static_cast<size_t>(i * g.ldc + j);
              const double scale = ref.abs[static_cast<size_t>(i * g.n + j)];
              const double sum_only = (k + 1) * 2 * u * scale;
              const double bound = sum_only + 3 * unit * scale + 2 * k * subnormal;
              const double diff = std::fabs(static_cast<double>(got[at]) - want[at]);
              worst = std::max(worst, diff / sum_only);
              ASSERT_LE(diff, bound) << math_mode_name(mode) << ", " << describe(g) << ", at ("
                                     << i << ", " << j << "): gemm_bias " << got[at]
                                     << ", bias rows + gemm " << want[at];
              if (mode == MathMode::FP32) {
                // One fp32 result against the exact sum: half the bound above.
                const double exact = ref.exact[static_cast<size_t>(i * g.n + j)];
                ASSERT_LE(std::fabs(got[at] - exact), (k + 1) * u * scale)
                    << describe(g) << ", at (" << i << ", " << j << "): gemm_bias " << got[at]
                    << ", exact " << exact;
              }
            }
          fmt::print("{}, {}: worst element used {:.3f} of the summation-only bound\n",
                     math_mode_name(mode), describe(g), worst);
        }
}

TEST(CudaGemmBias, Fp32MatchesBiasRowsThenGemmAndTheExactSum) {
  check_gemm_bias(MathMode::FP32, 0, 0);
}

TEST(CudaGemmBias, FastMathModesMatchBiasRowsThenGemm) {
  check_gemm_bias(MathMode::TF32, std::ldexp(1.0, -10), 0);
  check_gemm_bias(MathMode::BF16, std::ldexp(1.0, -7), 0);
  check_gemm_bias(MathMode::FP16, std::ldexp(1.0, -10), std::ldexp(1.0, -25));
}

// ------------------------------------------------------------ bf16 operands

// bf16's spacing at |v|: 2^(e - 7) for |v| in [2^e, 2^(e + 1)).
double bf16_ulp(double v) {
  if (v == 0) return std::ldexp(1.0, -133);  // the smallest subnormal
  int e = 0;
  std::frexp(v, &e);  // |v| in [2^(e - 1), 2^e)
  return std::ldexp(1.0, e - 1 - 7);
}

// gemm_bias_bf16 against fp64, on both of its paths: cuBLASLt's bias
// epilogue where every bf16 operand and row stride is 16-byte aligned, else
// (counted in bias_epilogue_fallbacks) the fp32 product and then
// add_bias_bf16. Both compute y = the fp32 sum of the k exact products
// (bf16 x bf16 fits fp32's mantissa) and the bias, and round y to bf16 once.
// Error model, u = 2^-24, scale = sum |a b| + |bias|:
// - |y - exact| <= (k + 1) u scale (sum_only), and rounding to nearest
//   adds at most half an ulp, 2^-8 |y| <= 2^-8 (|exact| + sum_only);
// - the epilogue may round the product to bf16 before it adds the bias
//   (half a bf16 ulp of the product, prod = exact - bias, more): not seen
//   on an H200 for aligned operands, allowed as cuBLASLt does not say.
//   Unaligned ones were up to 5 ulps of the product off there, which is why
//   they take the separate steps.
// fill_rows + gemm_bf16_out with beta 1, cuBLAS's own accumulation into a
// bf16 C, is printed beside it: on the H200 it rounded the product first
// in 15% of the elements.
// A missing or misplaced bias, or a transposed operand, is off by O(1).
TEST(CudaGemmBias, Bf16MatchesTheExactSumRoundedOnce) {
  const double u = std::ldexp(1.0, -24);
  uint64_t seed = 500;
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (int64_t n : {200, 123})
        for (bool padded : {false, true}) {
          const Case g = rounded(make_case(ta, tb, 37, n, 48, padded, seed += 10));
          const std::vector<bf16> c0 = to_bf16(g.c), bias0 = to_bf16(g.bias);
          Dev<bf16> a(to_bf16(g.a)), b(to_bf16(g.b)), bias(bias0), c(c0),
              two_step(bias_rows(g, c0, bias0));
          const int64_t before = ctx().bias_epilogue_fallbacks();
          gemm_bias_bf16(ctx(), ta, tb, g.m, g.n, g.k, a.p(), g.lda, b.p(), g.ldb, bias.p(), c.p(),
                         g.ldc);
          const bool epilogue = ctx().bias_epilogue_fallbacks() == before;
          gemm_bf16_out(ctx(), ta, tb, g.m, g.n, g.k, 1.0f, a.p(), g.lda, b.p(), g.ldb, 1.0f,
                        two_step.p(), g.ldc);
          const std::vector<bf16> got = c.host(), want = two_step.host();
          expect_padding_untouched(g, got, c0, describe(g));
          const Reference ref = reference(g);
          const double k = static_cast<double>(g.k);
          int64_t mismatches = 0, past_one_rounding[2] = {0, 0};
          for (int64_t i = 0; i < g.m; ++i)
            for (int64_t j = 0; j < g.n; ++j) {
              const size_t at = static_cast<size_t>(i * g.ldc + j);
              const size_t r = static_cast<size_t>(i * g.n + j);
              mismatches += got[at].bits != want[at].bits;
              const double exact = ref.exact[r], sum_only = (k + 1) * u * ref.abs[r];
              const double prod = exact - static_cast<double>(g.bias[static_cast<size_t>(j)]);
              const double one_rounding =
                  std::ldexp(1.0, -8) * (std::fabs(exact) + sum_only) + sum_only;
              const double gv = to_float(got[at]), wv = to_float(want[at]);
              past_one_rounding[0] += std::fabs(gv - exact) > one_rounding;
              past_one_rounding[1] += std::fabs(wv - exact) > one_rounding;
              ASSERT_LE(std::fabs(gv - exact),
                        one_rounding + (epilogue ? bf16_ulp(std::fabs(prod)) / 2 : 0.0))
                  << describe(g) << ", at (" << i << ", " << j << "): gemm_bias_bf16 ("
                  << (epilogue ? "epilogue" : "separate steps") << ") " << gv << ", exact "
                  << exact << ", product " << prod;
            }
          fmt::print("bf16, {}: {}; past one rounding: {} of {} elements; fill_rows + "
                     "gemm_bf16_out differs in {}, past one rounding in {}\n",
                     describe(g), epilogue ? "epilogue" : "separate steps", past_one_rounding[0],
                     g.m * g.n, mismatches, past_one_rounding[1]);
          const bool aligned = g.lda % 8 == 0 && g.ldb % 8 == 0 && g.ldc % 8 == 0;
          if (aligned) {
            EXPECT_TRUE(epilogue) << describe(g) << ": aligned bf16 operands take the epilogue";
          } else {
            EXPECT_FALSE(epilogue) << describe(g) << ": unaligned ones take the separate steps";
          }
        }
}

// ------------------------------------------------------------ the path taken, edges, memory

// With every row stride a multiple of 16 bytes and the buffers from the
// allocator (256-byte aligned), cuBLASLt has a bias-epilogue algorithm on
// Hopper: the fused path runs, with no fallback counted.
TEST(CudaGemmBias, AlignedShapesTakeTheEpilogue) {
  const int64_t before = ctx().bias_epilogue_fallbacks();
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      const Case g = rounded(make_case(ta, tb, 64, 200, 48, false, 900));
      Dev<float> a(g.a), b(g.b), bias(g.bias), c(g.c);
      gemm_bias(ctx(), MathMode::FP32, ta, tb, g.m, g.n, g.k, a.p(), g.lda, b.p(), g.ldb,
                bias.p(), c.p(), g.ldc);
      Dev<bf16> a16(to_bf16(g.a)), b16(to_bf16(g.b)), bias16(to_bf16(g.bias)), c16(to_bf16(g.c));
      gemm_bias_bf16(ctx(), ta, tb, g.m, g.n, g.k, a16.p(), g.lda, b16.p(), g.ldb, bias16.p(),
                     c16.p(), g.ldc);
      ctx().synchronize();
    }
  EXPECT_EQ(ctx().bias_epilogue_fallbacks(), before);
}

// A bias that is not 16-byte aligned (here one element past an allocator
// block) never goes to cuBLASLt: the fallback runs, is counted, and is the
// bias rows then the very GEMM call of the two-step reference, so the result
// is that reference bit for bit (cuBLAS gives the same bits for the same call
// on the same GPU).
TEST(CudaGemmBias, UnalignedBiasTakesTheTwoStepsBitForBit) {
  const Case g = rounded(make_case(false, true, 37, 123, 48, true, 950));
  std::vector<float> shifted = g.bias;
  shifted.insert(shifted.begin(), 0.0f);
  const int64_t before = ctx().bias_epilogue_fallbacks();

  Dev<float> a(g.a), b(g.b), bias(shifted), c(g.c), two_step(bias_rows(g, g.c, g.bias));
  gemm_bias(ctx(), MathMode::FP32, g.ta, g.tb, g.m, g.n, g.k, a.p(), g.lda, b.p(), g.ldb,
            bias.p() + 1, c.p(), g.ldc);
  gemm(ctx(), MathMode::FP32, g.ta, g.tb, g.m, g.n, g.k, 1.0f, a.p(), g.lda, b.p(), g.ldb, 1.0f,
       two_step.p(), g.ldc);
  const std::vector<float> got = c.host(), want = two_step.host();
  EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0);

  const std::vector<bf16> c0 = to_bf16(g.c), bias0 = to_bf16(g.bias);
  Dev<bf16> a16(to_bf16(g.a)), b16(to_bf16(g.b)), bias16(to_bf16(shifted)), c16(c0),
      two_step16(bias_rows(g, c0, bias0));
  gemm_bias_bf16(ctx(), g.ta, g.tb, g.m, g.n, g.k, a16.p(), g.lda, b16.p(), g.ldb,
                 bias16.p() + 1, c16.p(), g.ldc);
  gemm_bf16_out(ctx(), g.ta, g.tb, g.m, g.n, g.k, 1.0f, a16.p(), g.lda, b16.p(), g.ldb, 1.0f,
                two_step16.p(), g.ldc);
  const std::vector<bf16> got16 = c16.host(), want16 = two_step16.host();
  EXPECT_EQ(std::memcmp(got16.data(), want16.data(), got16.size() * sizeof(bf16)), 0);

  EXPECT_EQ(ctx().bias_epilogue_fallbacks(), before + 2);
}

// k 0: every row of C is the bias, exactly (no GEMM to add); m 37 is not a
// power of two, so the last doubling copy is a partial one. m 1 too.
TEST(CudaGemmBias, ZeroDepthGivesTheBiasRows) {
  for (int64_t m : {37, 1}) {
    const Case g = rounded(make_case(false, false, m, 123, 0, true, 1000));
    Dev<float> a(std::vector<float>(8)), b(std::vector<float>(8)), bias(g.bias), c(g.c);
    gemm_bias(ctx(), MathMode::FP32, false, false, g.m, g.n, 0, a.p(), 1, b.p(), g.ldb, bias.p(),
              c.p(), g.ldc);
    const std::vector<float> got = c.host(), want = bias_rows(g, g.c, g.bias);
    EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0) << "m " << m;

    const std::vector<bf16> c0 = to_bf16(g.c), bias0 = to_bf16(g.bias);
    Dev<bf16> a16(std::vector<bf16>(8)), b16(std::vector<bf16>(8)), bias16(bias0), c16(c0);
    gemm_bias_bf16(ctx(), false, false, g.m, g.n, 0, a16.p(), 1, b16.p(), g.ldb, bias16.p(),
                   c16.p(), g.ldc);
    const std::vector<bf16> got16 = c16.host(), want16 = bias_rows(g, c0, bias0);
    EXPECT_EQ(std::memcmp(got16.data(), want16.data(), got16.size() * sizeof(bf16)), 0)
        << "bf16, m " << m;
  }
}

// m or n 0: nothing to compute, and C is not written.
TEST(CudaGemmBias, EmptyOutputWritesNothing) {
  const Case g = make_case(false, false, 4, 8, 8, false, 1100);
  Dev<float> a(g.a), b(g.b), bias(g.bias), c(g.c);
  gemm_bias(ctx(), MathMode::FP32, false, false, 0, g.n, g.k, a.p(), g.lda, b.p(), g.ldb,
            bias.p(), c.p(), g.ldc);
  gemm_bias(ctx(), MathMode::FP32, false, false, g.m, 0, g.k, a.p(), g.lda, b.p(), g.ldb,
            bias.p(), c.p(), g.ldc);
  EXPECT_EQ(c.host(), g.c);
}

// The handle and its workspace are made once per context: a second identical
// call (the next step's) makes no cudaMalloc.
TEST(CudaGemmBias, RepeatedCallAllocatesNothingNew) {
  const Case g = make_case(true, false, 37, 200, 48, false, 1200);
  Dev<float> a(g.a), b(g.b), bias(g.bias), c(g.c);
  auto call = [&] {
    gemm_bias(ctx(), MathMode::BF16, g.ta, g.tb, g.m, g.n, g.k, a.p(), g.lda, b.p(), g.ldb,
              bias.p(), c.p(), g.ldc);
    ctx().synchronize();
  };
  call();
  const size_t mallocs = ctx().allocator().stats().device_mallocs;
  call();
  EXPECT_EQ(ctx().allocator().stats().device_mallocs, mallocs);
}

TEST(CudaGemmBias, BadInputIsRefusedNamingTheValue) {
  const Case g = make_case(false, false, 4, 8, 8, false, 1300);
  Dev<float> a(g.a), b(g.b), bias(g.bias), c(g.c);
  const std::string ldc = error_message([&] {
    gemm_bias(ctx(), MathMode::FP32, false, false, g.m, g.n, g.k, a.p(), g.lda, b.p(), g.ldb,
              bias.p(), c.p(), 5);
  });
  EXPECT_TRUE(contains(ldc, "ldc (5) is less than n (8)")) << ldc;
  const std::string neg = error_message([&] {
    gemm_bias(ctx(), MathMode::FP32, false, false, g.m, g.n, -1, a.p(), g.lda, b.p(), g.ldb,
              bias.p(), c.p(), g.ldc);
  });
  EXPECT_TRUE(contains(neg, "(4, 8, -1) must not be negative")) << neg;
}

// ------------------------------------------------------------ the GELU epilogues

// GELU (tanh-approximated) and its derivative, in double.
double gelu64(double x) {
  return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
}
double gelu_grad64(double x) {
  const double t = std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x));
  return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * std::sqrt(2 / M_PI) * (1 + 3 * 0.044715 * x * x);
}

// gemm_bias_gelu_bf16 and gemm_dgelu_bf16 against fp64. Error model, with
// sum_only the fp32 sum's bound as above ((k + 1) 2^-24 scale):
// - pre (the bias GEMM) as gemm_bias_bf16: half a bf16 ulp plus sum_only;
// - C = gelu(pre) from the fp32 sum: |gelu'| <= 1.13 carries sum_only, the
//   rounding adds half an ulp of C, and cuBLASLt may evaluate tanh with a
//   hardware approximation (absolute error d under 2^-10), which moves GELU
//   by 0.5 |x| d and gelu' = 0.5 (1 + t) + 0.5 x (1 - t^2) u' by
//   |0.5 - x t u'| d (u' = sqrt(2/pi) (1 + 3 0.044715 x^2)), per element;
// - the backward's C = (A B) gelu'(pre), pre read as stored (bf16): the
//   product's sum_only times |gelu'|, |A B| times gelu''s error, and half an
//   ulp of C.
// Where cuBLASLt has no such algorithm, or a bf16 operand or row stride is
// not 16-byte aligned, the two steps run instead (counted in
// gelu_epilogue_fallbacks): the fp32 product (plus the bias, rounded once)
// and the GELU kernel, which reads pre as stored, so its input is
// |pre - exact| off, not sum_only. The backward's product is rounded to
// bf16 before gelu' multiplies it there (half an ulp of it more, times
// |gelu'|), and the epilogue is allowed as much: on an H200 (CUDA 13.0) its
// result was 1.23 bf16 ulps from the exact one, past the model without it.
// Each bound is doubled for margin. A wrong layout of pre, a transposed
// operand or a missing GELU is off by O(1).
// Shapes: n 192 (a multiple of 8), m 64 and 37 (ragged rows), every
// transpose. With m 64 every row stride is a multiple of 16 bytes, where
// the epilogues are expected to run: no fallback counted there (with m 37
// and A transposed, A's rows are 74 bytes apart: the two steps; with m 37
// otherwise either may run, and only the values are checked).
TEST(CudaGeluGemm, EpiloguesMatchTheExactGeluOfTheProduct) {
  const double u = std::ldexp(1.0, -24), tanh_err = std::ldexp(1.0, -10);
  uint64_t seed = 1400;
  for (int64_t rows : {64, 37})
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        const int64_t before = ctx().gelu_epilogue_fallbacks();
        const Case g = rounded(make_case(ta, tb, rows, 192, 48, false, seed += 10));
        Dev<bf16> a(to_bf16(g.a)), b(to_bf16(g.b)), bias(to_bf16(g.bias)),
            pre{std::vector<bf16>(static_cast<size_t>(g.m * g.n))}, c(to_bf16(g.c)),
            dpre(to_bf16(g.c));
        gemm_bias_gelu_bf16(ctx(), ta, tb, g.m, g.n, g.k, a.p(), g.lda, b.p(), g.ldb, bias.p(),
                            pre.p(), c.p());
        // The backward's product reuses A and B (its own shapes do not matter
        // to the epilogue); its aux is the pre just written.
        gemm_dgelu_bf16(ctx(), ta, tb, g.m, g.n, g.k, a.p(), g.lda, b.p(), g.ldb, pre.p(),
                        dpre.p());
        const bool two_steps = ctx().gelu_epilogue_fallbacks() != before;
        const std::vector<bf16> pv = pre.host(), cv = c.host(), dv = dpre.host();
        const Reference ref = reference(g);
        const double k = static_cast<double>(g.k);
        for (int64_t i = 0; i < g.m; ++i)
          for (int64_t j = 0; j < g.n; ++j) {
            const size_t r = static_cast<size_t>(i * g.n + j);
            const double exact = ref.exact[r], sum_only = (k + 1) * u * ref.abs[r];
            const double p = to_float(pv[r]);
            ASSERT_LE(std::fabs(p - exact), 2 * (bf16_ulp(std::fabs(exact)) / 2 + sum_only))
                << describe(g) << ", pre at (" << i << ", " << j << "): " << p << ", exact "
                << exact;
            const double want = gelu64(exact), got = to_float(cv[r]);
            const double input_err = two_steps ? std::fabs(p - exact) : sum_only;
            ASSERT_LE(std::fabs(got - want),
                      2 * (1.13 * input_err + bf16_ulp(std::fabs(want)) / 2 +
                           0.5 * std::fabs(exact) * tanh_err))
                << describe(g) << ", gelu at (" << i << ", " << j << "): " << got << ", exact "
                << want;
            // The backward: the product without the bias, times gelu' of the stored pre.
            const double prod = exact - static_cast<double>(g.bias[static_cast<size_t>(j)]);
            const double dwant = prod * gelu_grad64(p), dgot = to_float(dv[r]);
            const double t = std::tanh(std::sqrt(2 / M_PI) * (p + 0.044715 * p * p * p));
            const double du = std::sqrt(2 / M_PI) * (1 + 3 * 0.044715 * p * p);
            ASSERT_LE(std::fabs(dgot - dwant),
                      2 * (1.13 * sum_only +
                           std::fabs(prod) * std::fabs(0.5 - p * t * du) * tanh_err +
                           bf16_ulp(std::fabs(dwant)) / 2 + 1.13 * bf16_ulp(std::fabs(prod)) / 2))
                << describe(g) << ", dgelu at (" << i << ", " << j << "): " << dgot << ", exact "
                << dwant;
          }
        if (rows == 64) {
          EXPECT_EQ(ctx().gelu_epilogue_fallbacks(), before) << describe(g);
        }
      }
}

// Rows of a width that is not a multiple of 8 (n 36) cannot hold cuBLASLt's
// GELU input: both calls fall back (counted) to the two steps, which are the
// very calls of this reference, so the results are its bits.
TEST(CudaGeluGemm, RowsNotAMultipleOf8TakeTheTwoStepsBitForBit) {
  const Case g = rounded(make_case(false, true, 37, 36, 48, false, 1500));
  const int64_t before = ctx().gelu_epilogue_fallbacks();
  const size_t count = static_cast<size_t>(g.m * g.n);
  Dev<bf16> a(to_bf16(g.a)), b(to_bf16(g.b)), bias(to_bf16(g.bias)),
      pre{std::vector<bf16>(count)}, c{std::vector<bf16>(count)},
      dpre{std::vector<bf16>(count)}, pre2{std::vector<bf16>(count)},
      c2{std::vector<bf16>(count)}, dpre2{std::vector<bf16>(count)};
  gemm_bias_gelu_bf16(ctx(), g.ta, g.tb, g.m, g.n, g.k, a.p(), g.lda, b.p(), g.ldb, bias.p(),
                      pre.p(), c.p());
  gemm_dgelu_bf16(ctx(), g.ta, g.tb, g.m, g.n, g.k, a.p(), g.lda, b.p(), g.ldb, pre.p(), dpre.p());
  gemm_bias_bf16(ctx(), g.ta, g.tb, g.m, g.n, g.k, a.p(), g.lda, b.p(), g.ldb, bias.p(), pre2.p(),
                 g.n);
  gelu_forward(ctx(), pre2.p(), c2.p(), g.m * g.n);
  Dev<float> prod{std::vector<float>(count)};
  gemm_bf16(ctx(), g.ta, g.tb, g.m, g.n, g.k, 1.0f, a.p(), g.lda, b.p(), g.ldb, 0.0f, prod.p(),
            g.n);
  to_bf16(ctx(), prod.p(), dpre2.p(), g.m * g.n);
  gelu_backward(ctx(), dpre2.p(), pre2.p(), dpre2.p(), g.m * g.n, false);
  for (auto [got, want, what] : {std::tuple{&pre, &pre2, "pre"}, std::tuple{&c, &c2, "gelu"},
                                 std::tuple{&dpre, &dpre2, "dgelu"}}) {
    const std::vector<bf16> x = got->host(), y = want->host();
    EXPECT_EQ(std::memcmp(x.data(), y.data(), x.size() * sizeof(bf16)), 0) << what;
  }
  EXPECT_EQ(ctx().gelu_epilogue_fallbacks(), before + 2);
}

// ------------------------------------------------------------ the bias-gradient epilogue

// gemm_bf16_bias_grad as a weight gradient, dW (48, 192) += x^T dy with x
// (74, 48) and dy (74, 192), against fp64: C = C0 + the product, where the
// fp32 sum of k + 1 terms (C0's too) errs by at most (k + 1) 2^-24 times
// the sum of their magnitudes; db = the sums of dy's 74 rows, the same
// bound over |dy|. Doubled for margin; a wrong operand or a sum over the
// other dimension is off by O(1). The epilogue must run (no fallback).
TEST(CudaBiasGradGemm, EpilogueGivesTheWeightAndBiasGradients) {
  const double u = std::ldexp(1.0, -24);
  const int64_t before = ctx().bias_grad_epilogue_fallbacks();
  const Case g = rounded(make_case(true, false, 48, 192, 74, false, 1600));
  Dev<bf16> x(to_bf16(g.a)), dy(to_bf16(g.b));
  Dev<float> c(g.c), db{std::vector<float>(static_cast<size_t>(g.n), 7.0f)};
  const bool ran = gemm_bf16_bias_grad(ctx(), true, g.m, g.n, g.k, x.p(), g.lda, dy.p(), g.ldb,
                                       1.0f, c.p(), g.ldc, db.p());
  ASSERT_TRUE(ran) << "cuBLASLt has no bias-gradient epilogue for this shape";
  EXPECT_EQ(ctx().bias_grad_epilogue_fallbacks(), before);
  const std::vector<float> cv = c.host(), dbv = db.host();
  Case no_bias = g;
  std::fill(no_bias.bias.begin(), no_bias.bias.end(), 0.0f);
  const Reference ref = reference(no_bias);
  const double k = static_cast<double>(g.k);
  for (int64_t i = 0; i < g.m; ++i)
    for (int64_t j = 0; j < g.n; ++j) {
      const size_t at = static_cast<size_t>(i * g.ldc + j), r = static_cast<size_t>(i * g.n + j);
      const double c0 = g.c[at], want = c0 + ref.exact[r];
      ASSERT_LE(std::fabs(cv[at] - want), 2 * (k + 1) * u * (ref.abs[r] + std::fabs(c0)))
          << "dW at (" << i << ", " << j << "): " << cv[at] << ", exact " << want;
    }
  for (int64_t j = 0; j < g.n; ++j) {
    double sum = 0, mag = 0;
    for (int64_t l = 0; l < g.k; ++l) {
      const double v = b_at(g, l, j);
      sum += v, mag += std::fabs(v);
    }
    // Written, not added: the 7 the buffer held is gone.
    ASSERT_LE(std::fabs(dbv[static_cast<size_t>(j)] - sum), 2 * (k + 1) * u * mag)
        << "db " << j << ": " << dbv[static_cast<size_t>(j)] << ", exact " << sum;
  }
}

}  // namespace
}  // namespace weft::cuda
#endif  // WEFT_CUDA
