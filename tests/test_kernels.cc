// CPU kernels against naive double-precision references written out in the test.
#include <gtest/gtest.h>
#include <weft/bf16.h>
#include <weft/cpu_kernels.h>
#include <weft/error.h>
#include <weft/ops.h>
#include <weft/threads.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "test_util.h"

namespace weft {
namespace {

using testing::contains;
using testing::error_message;

using Vec = std::vector<float>;
using DVec = std::vector<double>;

size_t z(int64_t i) { return static_cast<size_t>(i); }



// Element-wise |got - want| <= atol + rtol |want|, reporting the first few misses.
void expect_close(const float* got, const double* want, int64_t n, double atol, double rtol,
                  const std::string& what) {
  int bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double err = std::abs(static_cast<double>(got[i]) - want[i]);
    if (!(err <= atol + rtol * std::abs(want[i])) && ++bad <= 5)
      ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << ", want " << want[i];
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << n << " elements off";
}

void expect_close(const Vec& got, const DVec& want, double atol, double rtol,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  expect_close(got.data(), want.data(), static_cast<int64_t>(got.size()), atol, rtol, what);
}

// Restores the OpenMP thread count a test changed, whatever way the test exits.
struct ThreadGuard {
  int saved = get_threads();
  ~ThreadGuard() { set_threads(saved); }
};

// --- gemm ---

struct GemmCase {
  bool ta, tb;
  cpu::GemmLibrary library;
};

// Each case runs on its GEMM library (oneDNN's only where weft was built with
// it), and puts back the one in use.
class Gemm : public ::testing::TestWithParam<GemmCase> {
 protected:
  void SetUp() override {
    if (GetParam().library == cpu::GemmLibrary::OneDnn && !cpu::onednn_built())
      GTEST_SKIP() << "weft was built without oneDNN";
    cpu::set_gemm_library(GetParam().library);
  }
  void TearDown() override { cpu::set_gemm_library(saved_); }
  cpu::GemmLibrary saved_ = cpu::gemm_library();
};

// Strided operands: the padding of A and B holds NaN, so reading it poisons the result, and
// the padding of C holds a sentinel that must survive.
void check_gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, float beta) {
  const int64_t a_rows = ta ? k : m, a_cols = ta ? m : k;
  const int64_t b_rows = tb ? n : k, b_cols = tb ? k : n;
  const int64_t lda = a_cols + 3, ldb = b_cols + 5, ldc = n + 2;
  const float nan = std::nanf("");
  Vec a(z(std::max<int64_t>(1, a_rows * lda)), nan), b(z(std::max<int64_t>(1, b_rows * ldb)), nan);
  Vec c(z(m * ldc), 12345.0f);
  const Vec ra = testing::uniform(a_rows * a_cols, 11 + m);
  const Vec rb = testing::uniform(b_rows * b_cols, 13 + n);
  const Vec rc = testing::uniform(m * n, 17 + k);
  for (int64_t i = 0; i < a_rows; ++i)
    for (int64_t j = 0; j < a_cols; ++j) a[z(i * lda + j)] = ra[z(i * a_cols + j)];
  for (int64_t i = 0; i < b_rows; ++i)
    for (int64_t j = 0; j < b_cols; ++j) b[z(i * ldb + j)] = rb[z(i * b_cols + j)];
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) c[z(i * ldc + j)] = rc[z(i * n + j)];

  auto op_a = [&](int64_t i, int64_t l) { return ta ? a[z(l * lda + i)] : a[z(i * lda + l)]; };
  auto op_b = [&](int64_t l, int64_t j) { return tb ? b[z(j * ldb + l)] : b[z(l * ldb + j)]; };
  DVec want(z(m * n)), scale(z(m * n));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0, mag = 0;
      for (int64_t l = 0; l < k; ++l) {
        s += static_cast<double>(op_a(i, l)) * op_b(l, j);
        mag += std::abs(static_cast<double>(op_a(i, l)) * op_b(l, j));
      }
      want[z(i * n + j)] = alpha * s + beta * static_cast<double>(c[z(i * ldc + j)]);
      scale[z(i * n + j)] = std::abs(alpha) * mag + std::abs(beta * c[z(i * ldc + j)]);
    }

  cpu::gemm(ta, tb, m, n, k, alpha, a.data(), lda, b.data(), ldb, beta, c.data(), ldc);

  int bad = 0;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      const double got = c[z(i * ldc + j)];
      const double w = want[z(i * n + j)];
      // Recursive summation in any order, with or without FMA, and the
      // products by alpha and beta: at most (k + 2) roundings of u = 2^-24
      // relative to the sum of magnitudes (Higham's gamma_{k+2}).
      const double bound = (static_cast<double>(k) + 2) * 0x1p-24 * scale[z(i * n + j)];
      if (!(std::abs(got - w) <= 1e-30 + bound) && ++bad <= 5)
        ADD_FAILURE() << "C[" << i << "," << j << "] = " << got << ", want " << w;
    }
    for (int64_t j = n; j < ldc; ++j) EXPECT_EQ(c[z(i * ldc + j)], 12345.0f) << "padding " << i;
  }
  EXPECT_EQ(bad, 0) << "ta=" << ta << " tb=" << tb << " m=" << m << " n=" << n << " k=" << k;
}

TEST_P(Gemm, StridedWithAlphaBeta) {
  const auto [ta, tb, library] = GetParam();
  check_gemm(ta, tb, 5, 7, 4, 0.75f, -0.5f);
  // Sizes off the BLAS micro-kernel's tile multiples, so edge handling is exercised.
  check_gemm(ta, tb, 33, 65, 17, -1.25f, 0.3f);
  check_gemm(ta, tb, 1, 9, 70, 2.0f, 1.0f);
  // A long reduction into a small C (a weight gradient's shape), which a
  // library may split over threads along k; and an empty one, C = beta C.
  check_gemm(ta, tb, 6, 10, 3000, 1.0f, 0.5f);
  check_gemm(ta, tb, 3, 4, 0, 1.0f, 0.5f);
}

TEST_P(Gemm, BetaZeroIgnoresWhatCHeld) {
  // beta = 0 means "overwrite": NaN in C must not leak into the result.
  const auto [ta, tb, library] = GetParam();
  const int64_t m = 4, n = 3, k = 5;
  const Vec a = testing::uniform(m * k, 1), b = testing::uniform(k * n, 2);
  Vec c(z(m * n), std::nanf(""));
  cpu::gemm(ta, tb, m, n, k, 1.0f, a.data(), ta ? m : k, b.data(), tb ? k : n, 0.0f, c.data(), n);
  for (float v : c) EXPECT_TRUE(std::isfinite(v));
}

std::vector<GemmCase> gemm_cases() {
  std::vector<GemmCase> cases;
  for (cpu::GemmLibrary library : {cpu::GemmLibrary::OpenBlas, cpu::GemmLibrary::OneDnn})
    for (bool ta : {false, true})
      for (bool tb : {false, true}) cases.push_back({ta, tb, library});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllTransposes, Gemm, ::testing::ValuesIn(gemm_cases()),
                         [](const ::testing::TestParamInfo<GemmCase>& p) {
                           return std::string(p.param.ta ? "T" : "N") + (p.param.tb ? "T" : "N") +
                                  (p.param.library == cpu::GemmLibrary::OneDnn ? "_onednn"
                                                                               : "_openblas");
                         });

// The library is chosen once, by name, and a bad name is refused naming it.
TEST(GemmLibrary, NamesParseAndABadOneIsRefused) {
  EXPECT_EQ(cpu::parse_gemm_library("openblas", "--cpu-gemm"), cpu::GemmLibrary::OpenBlas);
  EXPECT_EQ(cpu::parse_gemm_library("auto", "--cpu-gemm"), cpu::default_gemm_library());
  EXPECT_EQ(cpu::default_gemm_library(),
            cpu::onednn_built() ? cpu::GemmLibrary::OneDnn : cpu::GemmLibrary::OpenBlas);
  try {
    cpu::parse_gemm_library("mkl", "WEFT_CPU_GEMM");
    ADD_FAILURE() << "mkl was accepted";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "WEFT_CPU_GEMM 'mkl' must be auto, openblas or onednn");
  }
  if (cpu::onednn_built()) {
    EXPECT_EQ(cpu::parse_gemm_library("onednn", "--cpu-gemm"), cpu::GemmLibrary::OneDnn);
    EXPECT_TRUE(testing::contains(cpu::describe_gemm_library(cpu::GemmLibrary::OneDnn), "oneDNN "));
  } else {
    EXPECT_THROW(cpu::parse_gemm_library("onednn", "--cpu-gemm"), Error);
    EXPECT_THROW(cpu::set_gemm_library(cpu::GemmLibrary::OneDnn), Error);
  }
  EXPECT_TRUE(
      testing::contains(cpu::describe_gemm_library(cpu::GemmLibrary::OpenBlas), "OpenBLAS 0."));
}

// --- mixed-precision GEMM inputs ---

TEST(Rounding, NearestEvenAndFp16Overflow) {
  using cpu::Rounding;
  const float one = 1.0f;
  // bf16 keeps 8 significant bits: 1 + 2^-8 is halfway, ties go to the even 1;
  // 1 + 3 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6, ties go to 1 + 2^-6.
  EXPECT_EQ(cpu::round_to(Rounding::Bf16, one + std::ldexp(1.0f, -8)), one);
  EXPECT_EQ(cpu::round_to(Rounding::Bf16, one + 3 * std::ldexp(1.0f, -8)),
            one + std::ldexp(1.0f, -6));
  EXPECT_EQ(cpu::round_to(Rounding::Bf16, 1e30f), round_to_bf16(1e30f));  // fp32's range
  // fp16 keeps 11: the same ties one format lower.
  EXPECT_EQ(cpu::round_to(Rounding::Fp16, one + std::ldexp(1.0f, -11)), one);
  EXPECT_EQ(cpu::round_to(Rounding::Fp16, one + 3 * std::ldexp(1.0f, -11)),
            one + std::ldexp(1.0f, -9));
  EXPECT_EQ(cpu::round_to(Rounding::Fp16, one + std::ldexp(1.0f, -11) + std::ldexp(1.0f, -20)),
            one + std::ldexp(1.0f, -10));  // above half: up
  // The largest half is 65504; from halfway to the next step (65520) on, +-inf.
  EXPECT_EQ(cpu::round_to(Rounding::Fp16, 65519.0f), 65504.0f);
  EXPECT_EQ(cpu::round_to(Rounding::Fp16, 65520.0f), INFINITY);
  EXPECT_EQ(cpu::round_to(Rounding::Fp16, -1e6f), -INFINITY);
  // Subnormal halves: steps of 2^-24; 2^-25 is a tie with 0, 3 2^-25 rounds to 2^-23.
  EXPECT_EQ(cpu::round_to(Rounding::Fp16, std::ldexp(1.0f, -24)), std::ldexp(1.0f, -24));
  EXPECT_EQ(cpu::round_to(Rounding::Fp16, std::ldexp(1.0f, -25)), 0.0f);
  EXPECT_EQ(cpu::round_to(Rounding::Fp16, 3 * std::ldexp(1.0f, -25)), std::ldexp(1.0f, -23));
  EXPECT_EQ(cpu::round_to(Rounding::None, 0.1f), 0.1f);
}

// Sets the CPU's matmul precision for one scope.
struct CpuPrecision {
  explicit CpuPrecision(ops::MatmulPrecision p) { ops::set_matmul_precision(Device::cpu(), p); }
  ~CpuPrecision() { ops::set_matmul_precision(Device::cpu(), ops::MatmulPrecision::Fp32); }
};

// Chooses how the CPU runs bf16 GEMMs for one scope (the emulation, whose
// bits the rounding tests pin, or oneDNN's bf16 matmul).
struct Bf16GemmScope {
  explicit Bf16GemmScope(cpu::Bf16Gemm how) { cpu::set_bf16_gemm(how); }
  ~Bf16GemmScope() { cpu::set_bf16_gemm(saved); }
  cpu::Bf16Gemm saved = cpu::bf16_gemm();
};

TEST(Rounding, Bf16AndFp16GemmsAreSgemmOnRoundedInputs) {
  Bf16GemmScope emulated(cpu::Bf16Gemm::Emulated);
  for (auto [precision, rounding] :
       {std::pair{ops::MatmulPrecision::Bf16, cpu::Rounding::Bf16},
        std::pair{ops::MatmulPrecision::Fp16, cpu::Rounding::Fp16}}) {
    for (bool ta : {false, true}) {
      const int64_t m = 13, n = 21, k = 37;
      const Tensor a = testing::uniform_tensor(ta ? Shape{k, m} : Shape{m, k}, 3);
      const Tensor b = testing::uniform_tensor(Shape{n, k}, 4);  // used transposed
      Tensor c = testing::uniform_tensor(Shape{m, n}, 5), fp32 = Tensor::zeros({m, n});
      fp32.copy_from(c);
      Vec ra(a.data<float>(), a.data<float>() + a.numel());
      Vec rb(b.data<float>(), b.data<float>() + b.numel());
      for (float& x : ra) x = cpu::round_to(rounding, x);
      for (float& x : rb) x = cpu::round_to(rounding, x);
      Vec want(c.data<float>(), c.data<float>() + c.numel());
      cpu::gemm(ta, true, m, n, k, 0.5f, ra.data(), ta ? m : k, rb.data(), k, 2.0f, want.data(), n);
      {
        CpuPrecision scope(precision);
        EXPECT_EQ(ops::matmul_precision(Device::cpu()), precision);
        ops::gemm(a, ta, b, true, c, 0.5f, 2.0f);
      }
      ops::gemm(a, ta, b, true, fp32, 0.5f, 2.0f);
      // The same sgemm on the same rounded values: bit for bit.
      EXPECT_EQ(std::memcmp(c.data<float>(), want.data(), want.size() * sizeof(float)), 0)
          << ops::matmul_precision_name(precision) << " ta=" << ta;
      // And the rounding really happens: uniform inputs move by ~2^-9 (bf16)
      // or ~2^-12 (fp16) relative, so many of the outputs differ from fp32's.
      int differ = 0;
      for (int64_t i = 0; i < m * n; ++i) differ += c.data<float>()[i] != fp32.data<float>()[i];
      EXPECT_GT(differ, m * n / 2) << ops::matmul_precision_name(precision);
    }
  }
  EXPECT_EQ(ops::matmul_precision(Device::cpu()), ops::MatmulPrecision::Fp32);
  EXPECT_TRUE(contains(error_message([] {
                         ops::set_matmul_precision(Device::cpu(), ops::MatmulPrecision::Tf32);
                       }),
                       "tf32 needs a CUDA device"));
}

TEST(Rounding, AttentionRoundsItsGemmInputs) {
  // With inputs already bf16, the score GEMM is exact in both; the softmax's
  // probabilities are not bf16, so P V differs from fp32 unless P is rounded.
  const int64_t b = 1, t = 9, h = 2, d = 8, w = 3 * h * d;
  Vec qkv = testing::uniform(b * t * w, 7);
  for (float& x : qkv) x = round_to_bf16(x);
  Vec out(z(b * t * h * d)), probs(z(b * h * t * t)), out16 = out, probs16 = probs;
  cpu::attention_forward(qkv.data(), out.data(), probs.data(), b, t, h, h, d);
  cpu::attention_forward(qkv.data(), out16.data(), probs16.data(), b, t, h, h, d,
                         cpu::Rounding::Bf16);
  // out = P V with P rounded: each probability moves by at most 2^-9 of
  // itself, so |out16 - out| <= 2^-9 sum_j P |v| <= 2^-9 max |v| (plus fp32 sums).
  double worst = 0;
  int differ = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    worst = std::max(worst, std::abs(static_cast<double>(out16[i]) - out[i]));
    differ += out16[i] != out[i];
  }
  EXPECT_LE(worst, std::ldexp(1.0, -9) + 1e-6);
  EXPECT_GT(differ, 0);
}

// --- LayerNorm ---

struct LnRef {
  DVec mean, rstd, y;
};

LnRef layernorm_ref(const Vec& x, const Vec& w, const Vec& b, int64_t n, int64_t c, double eps) {
  LnRef r{DVec(z(n)), DVec(z(n)), DVec(z(n * c))};
  for (int64_t i = 0; i < n; ++i) {
    double m = 0, var = 0;
    for (int64_t j = 0; j < c; ++j) m += x[z(i * c + j)];
    m /= static_cast<double>(c);
    for (int64_t j = 0; j < c; ++j) var += std::pow(x[z(i * c + j)] - m, 2);
    var /= static_cast<double>(c);  // biased, as PyTorch's LayerNorm
    const double rs = 1.0 / std::sqrt(var + eps);
    r.mean[z(i)] = m;
    r.rstd[z(i)] = rs;
    for (int64_t j = 0; j < c; ++j)
      r.y[z(i * c + j)] = (x[z(i * c + j)] - m) * rs * w[z(j)] + b[z(j)];
  }
  return r;
}

TEST(LayerNorm, ForwardMatchesDoubleReference) {
  const int64_t n = 6, c = 37;
  Vec x = testing::uniform(n * c, 1);
  for (int64_t i = 0; i < n; ++i)  // Row offsets and scales: the mean really is subtracted.
    for (int64_t j = 0; j < c; ++j)
      x[z(i * c + j)] =
          3.0f * static_cast<float>(i) - 4.0f + x[z(i * c + j)] * (0.5f + static_cast<float>(i));
  Vec w = testing::uniform(c, 2, 0.5f, 1.5f), b = testing::uniform(c, 3);
  // A constant row: variance 0, so eps alone sets rstd.
  for (int64_t j = 0; j < c; ++j) x[z(5 * c + j)] = 2.5f;
  const float eps = 1e-5f;
  Vec y(z(n * c)), mean(z(n)), rstd(z(n));
  cpu::layernorm_forward(x.data(), w.data(), b.data(), y.data(), mean.data(), rstd.data(), n, c,
                         eps);
  LnRef r = layernorm_ref(x, w, b, n, c, eps);
  expect_close(mean, r.mean, 1e-6, 1e-6, "mean");
  expect_close(rstd, r.rstd, 0, 1e-5, "rstd");
  expect_close(y, r.y, 1e-5, 1e-5, "y");
  EXPECT_NEAR(rstd[5], 1.0 / std::sqrt(1e-5), 1.0);
}

TEST(LayerNorm, BackwardMatchesDoubleReferenceAndAccumulates) {
  const int64_t n = 5, c = 70;  // two column blocks in the weight gradient
  const Vec x = testing::uniform(n * c, 4, -2.0f, 3.0f), w = testing::uniform(c, 5, 0.5f, 1.5f);
  const Vec b = testing::uniform(c, 6), dy = testing::uniform(n * c, 7);
  Vec y(z(n * c)), mean(z(n)), rstd(z(n));
  cpu::layernorm_forward(x.data(), w.data(), b.data(), y.data(), mean.data(), rstd.data(), n, c,
                         1e-5f);
  const LnRef r = layernorm_ref(x, w, b, n, c, 1e-5);
  DVec dx_ref(z(n * c)), dw_ref(z(c)), db_ref(z(c));
  const Vec dx0 = testing::uniform(n * c, 8), dw0 = testing::uniform(c, 9),
            db0 = testing::uniform(c, 10);
  for (int64_t i = 0; i < n; ++i) {
    double g_mean = 0, gx_mean = 0;
    for (int64_t j = 0; j < c; ++j) {
      const double xhat = (x[z(i * c + j)] - r.mean[z(i)]) * r.rstd[z(i)];
      const double g = static_cast<double>(dy[z(i * c + j)]) * w[z(j)];
      g_mean += g / static_cast<double>(c);
      gx_mean += g * xhat / static_cast<double>(c);
      dw_ref[z(j)] += dy[z(i * c + j)] * xhat;
      db_ref[z(j)] += dy[z(i * c + j)];
    }
    for (int64_t j = 0; j < c; ++j) {
      const double xhat = (x[z(i * c + j)] - r.mean[z(i)]) * r.rstd[z(i)];
      const double g = static_cast<double>(dy[z(i * c + j)]) * w[z(j)];
      dx_ref[z(i * c + j)] = dx0[z(i * c + j)] + r.rstd[z(i)] * (g - g_mean - xhat * gx_mean);
    }
  }
  for (int64_t j = 0; j < c; ++j) {
    dw_ref[z(j)] += dw0[z(j)];
    db_ref[z(j)] += db0[z(j)];
  }
  Vec dx = dx0, dw = dw0, db = db0;
  cpu::layernorm_backward_input(dy.data(), x.data(), w.data(), mean.data(), rstd.data(), dx.data(),
                                n, c);
  cpu::layernorm_backward_weight(dy.data(), x.data(), mean.data(), rstd.data(), dw.data(),
                                 db.data(), n, c);
  expect_close(dx, dx_ref, 1e-5, 1e-4, "dx");
  expect_close(dw, dw_ref, 1e-5, 1e-4, "dw");
  expect_close(db, db_ref, 1e-5, 1e-5, "db");
}

// --- GELU ---

double gelu_ref(double x) {
  const double k = std::sqrt(2.0 / M_PI);
  return 0.5 * x * (1.0 + std::tanh(k * (x + 0.044715 * x * x * x)));
}

double gelu_grad_ref(double x) {
  const double k = std::sqrt(2.0 / M_PI);
  const double t = std::tanh(k * (x + 0.044715 * x * x * x));
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * x * x);
}

Vec gelu_inputs() {
  // More than one OpenMP chunk (16384), plus the tails and zero.
  Vec x = testing::uniform(40000, 21, -6.0f, 6.0f);
  for (float v : {0.0f, -0.0f, 1e-6f, -1e-6f, 10.0f, -10.0f, 20.0f, -20.0f, 50.0f, -50.0f})
    x.push_back(v);
  return x;
}

TEST(Gelu, ForwardMatchesTanhFormula) {
  const Vec x = gelu_inputs();
  const auto n = static_cast<int64_t>(x.size());
  Vec y(x.size());
  cpu::gelu_forward(x.data(), y.data(), n);
  DVec want(x.size());
  for (size_t i = 0; i < x.size(); ++i) want[i] = gelu_ref(x[i]);
  expect_close(y, want, 2e-6, 2e-6, "gelu");
  // The tanh form, not the erf form: they differ by 4.7e-4 at x = 2.7.
  const float x0 = 2.7f;
  float y0 = 0;
  cpu::gelu_forward(&x0, &y0, 1);
  EXPECT_NEAR(y0, gelu_ref(x0), 1e-6);
  EXPECT_GT(std::abs(y0 - 0.5 * x0 * (1.0 + std::erf(x0 / std::sqrt(2.0)))), 4e-4);
}

TEST(Gelu, BackwardMatchesDerivativeAndAccumulates) {
  const Vec x = gelu_inputs();
  const auto n = static_cast<int64_t>(x.size());
  const Vec dy = testing::uniform(n, 22), dx0 = testing::uniform(n, 23);
  Vec dx = dx0;
  cpu::gelu_backward(dy.data(), x.data(), dx.data(), n);
  DVec want(x.size());
  for (size_t i = 0; i < x.size(); ++i) want[i] = dx0[i] + dy[i] * gelu_grad_ref(x[i]);
  expect_close(dx, want, 5e-6, 5e-6, "gelu'");
}

// --- bias and element-wise helpers ---

TEST(Elementwise, AddBiasAddInplaceScaleInplace) {
  const int64_t n = 9, c = 70;
  const Vec y0 = testing::uniform(n * c, 31), bias = testing::uniform(c, 32);
  Vec y = y0;
  cpu::add_bias(y.data(), bias.data(), n, c);
  for (int64_t i = 0; i < n * c; ++i) ASSERT_EQ(y[z(i)], y0[z(i)] + bias[z(i % c)]) << i;

  const int64_t m = 40000;  // several chunks
  const Vec a0 = testing::uniform(m, 33), b = testing::uniform(m, 34);
  Vec a = a0;
  cpu::add_inplace(a.data(), b.data(), m);
  for (int64_t i = 0; i < m; ++i) ASSERT_EQ(a[z(i)], a0[z(i)] + b[z(i)]) << i;
  a = a0;
  cpu::scale_inplace(a.data(), -0.375f, m);
  for (int64_t i = 0; i < m; ++i) ASSERT_EQ(a[z(i)], a0[z(i)] * -0.375f) << i;
}

// y += s x in one pass gives the bits of x *= s, then y += x: each product
// rounded before its sum (an FMA would not round it, and differ).
TEST(Elementwise, AddScaledIsScaleThenAdd) {
  const int64_t m = 40001;  // several pieces, the last partial
  const Vec y0 = testing::uniform(m, 35, -4.0f, 4.0f), x0 = testing::uniform(m, 36);
  Vec y1 = y0, x1 = x0, y2 = y0, x2 = x0;
  cpu::scale_inplace(x1.data(), 0.37f, m);
  cpu::add_inplace(y1.data(), x1.data(), m);
  cpu::add_scaled(y2.data(), x2.data(), 0.37f, m);
  EXPECT_EQ(0, std::memcmp(y1.data(), y2.data(), sizeof(float) * z(m)));
  EXPECT_EQ(x2, x0);
}

TEST(SumRows, MatchesDoubleReferenceAndAccumulates) {
  const int64_t n = 33, c = 150;  // three column blocks, the last one partial
  const Vec dy = testing::uniform(n * c, 41), db0 = testing::uniform(c, 42);
  Vec db = db0;
  cpu::sum_rows(dy.data(), db.data(), n, c);
  DVec want(z(c));
  for (int64_t j = 0; j < c; ++j) {
    want[z(j)] = db0[z(j)];
    for (int64_t i = 0; i < n; ++i) want[z(j)] += dy[z(i * c + j)];
  }
  expect_close(db, want, 1e-5, 1e-5, "db");
}

TEST(SumSquares, MatchesDouble) {
  const int64_t n = 100003;
  const Vec x = testing::uniform(n, 43, -3.0f, 2.0f);
  double want = 0;
  for (float v : x) want += static_cast<double>(v) * v;
  EXPECT_NEAR(cpu::sum_squares(x.data(), n), want, 1e-12 * want);
  EXPECT_EQ(cpu::sum_squares(x.data(), 0), 0.0);
  // Accumulated in double: 1e20 squared overflows float but not the result.
  const Vec big = {1e20f, -1e20f};
  EXPECT_NEAR(cpu::sum_squares(big.data(), 2), 2.0 * 1e20f * 1e20f, 1e28);
}

// An operation that widens bf16 tensors to fp32 (every one on the CPU) is
// counted once per call, under its own name; an fp32 call is not.
TEST(Ops, WideningIsCountedPerOperation) {
  ops::reset_widened_ops();
  Tensor x = Tensor::zeros({4, 8}), y = Tensor::zeros({4, 8});
  ops::gelu_forward(x, y);
  EXPECT_TRUE(ops::widened_ops().empty());
  Tensor x16 = Tensor::zeros({4, 8}, DType::BF16), y16 = Tensor::zeros({4, 8}, DType::BF16);
  ops::gelu_forward(x16, y16);
  ops::gelu_forward(x16, y16);
  ops::add(y16, x16);
  const std::map<std::string, int64_t> got = ops::widened_ops();
  EXPECT_EQ(got, (std::map<std::string, int64_t>{{"add", 1}, {"gelu_forward", 2}}));
  ops::reset_widened_ops();
  EXPECT_TRUE(ops::widened_ops().empty());
}

// sum(x, out): the double sum rounded to float, into a tensor (and from
// bf16 values, widened), exactly what float(sum(x)) gives.
TEST(Sum, IntoATensorIsTheDoubleSumRounded) {
  const Vec x = testing::uniform(100003, 44, -3.0f, 2.0f);
  Tensor t = Tensor::empty({static_cast<int64_t>(x.size())}), out = Tensor::zeros({1});
  std::copy(x.begin(), x.end(), t.data<float>());
  ops::sum(t, out);
  EXPECT_EQ(ops::item(out), static_cast<float>(ops::sum(t)));
  double want = 0;
  for (float v : x) want += v;
  EXPECT_NEAR(ops::item(out), want, 1e-6 * std::abs(want) + 1e-3);
  Tensor narrow = Tensor::empty(t.shape(), DType::BF16);
  ops::convert(t, narrow);
  ops::sum(narrow, out);
  EXPECT_EQ(ops::item(out), static_cast<float>(ops::sum(narrow)));
  EXPECT_THROW(ops::sum(t, Tensor::zeros({2})), Error);
}

// --- attention ---

struct AttnRef {
  DVec out, probs;
};

// Naive causal attention, one query head at a time, in double: qkv (B, T, (H + 2G) D),
// query head hi reading key/value head hi / (H / G).
AttnRef attention_ref(const Vec& qkv, int64_t b, int64_t t, int64_t h, int64_t g, int64_t d) {
  const int64_t c = h * d, w = (h + 2 * g) * d;
  AttnRef r{DVec(z(b * t * c)), DVec(z(b * h * t * t))};
  auto at = [&](int64_t bi, int64_t ti, int64_t col) -> double {
    return qkv[z((bi * t + ti) * w + col)];
  };
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t hi = 0; hi < h; ++hi) {
      const int64_t k0 = c + hi / (h / g) * d, v0 = k0 + g * d;
      for (int64_t i = 0; i < t; ++i) {
        DVec s(z(i + 1));
        double mx = -1e300;
        for (int64_t j = 0; j <= i; ++j) {
          double dot = 0;
          for (int64_t e = 0; e < d; ++e) dot += at(bi, i, hi * d + e) * at(bi, j, k0 + e);
          s[z(j)] = dot / std::sqrt(static_cast<double>(d));
          mx = std::max(mx, s[z(j)]);
        }
        double sum = 0;
        for (double& v : s) sum += (v = std::exp(v - mx));
        for (int64_t j = 0; j <= i; ++j) {
          const double p = s[z(j)] / sum;
          r.probs[z(((bi * h + hi) * t + i) * t + j)] = p;
          for (int64_t e = 0; e < d; ++e)
            r.out[z((bi * t + i) * c + hi * d + e)] += p * at(bi, j, v0 + e);
        }
      }
    }
  return r;
}

// Multi-head (G = H) and grouped-query (G < H) attention.
struct AttnShape {
  int64_t b, t, h, g, d;
};

TEST(Attention, ForwardMatchesNaiveCausalSoftmax) {
  for (const AttnShape& sh : {AttnShape{2, 7, 3, 3, 4}, AttnShape{2, 7, 4, 2, 4},
                              AttnShape{1, 5, 3, 1, 6}}) {
    const int64_t b = sh.b, t = sh.t, h = sh.h, g = sh.g, d = sh.d, c = h * d;
    SCOPED_TRACE(::testing::Message() << "H " << h << " G " << g);
    const Vec qkv = testing::uniform(b * t * (h + 2 * g) * d, 51, -2.0f, 2.0f);
    Vec out(z(b * t * c), std::nanf("")), probs(z(b * h * t * t), std::nanf(""));
    cpu::attention_forward(qkv.data(), out.data(), probs.data(), b, t, h, g, d);
    const AttnRef r = attention_ref(qkv, b, t, h, g, d);
    expect_close(out, r.out, 1e-5, 1e-5, "out");
    expect_close(probs, r.probs, 1e-6, 1e-5, "probs");
    // The masked upper triangle is exactly zero and every row is a distribution.
    for (int64_t bh = 0; bh < b * h; ++bh)
      for (int64_t i = 0; i < t; ++i) {
        double sum = 0;
        for (int64_t j = 0; j < t; ++j) {
          const float p = probs[z((bh * t + i) * t + j)];
          if (j > i) {
            EXPECT_EQ(p, 0.0f);
          }
          sum += p;
        }
        EXPECT_NEAR(sum, 1.0, 1e-6);
      }
  }
}

TEST(Attention, BackwardMatchesFiniteDifferencesOfReference) {
  // dqkv from the kernel against central differences of the double reference: an
  // independent check of the kernel's algebra (the layer tests check it in fp32).
  // With G < H, a key/value head's gradient sums over its group's query heads.
  for (const AttnShape& sh : {AttnShape{1, 4, 2, 2, 2}, AttnShape{2, 4, 4, 2, 2}}) {
    const int64_t b = sh.b, t = sh.t, h = sh.h, g = sh.g, d = sh.d, c = h * d;
    const int64_t w = (h + 2 * g) * d;
    SCOPED_TRACE(::testing::Message() << "H " << h << " G " << g);
    const Vec qkv = testing::uniform(b * t * w, 52, -1.5f, 1.5f);
    const Vec dout = testing::uniform(b * t * c, 53);
    Vec out(z(b * t * c)), probs(z(b * h * t * t)), scratch(z(b * h * t * t));
    cpu::attention_forward(qkv.data(), out.data(), probs.data(), b, t, h, g, d);
    const Vec dqkv0 = testing::uniform(b * t * w, 54);
    Vec dqkv = dqkv0;
    cpu::attention_backward(dout.data(), qkv.data(), probs.data(), dqkv.data(), scratch.data(), b,
                            t, h, g, d);
    DVec want(qkv.size());
    for (size_t i = 0; i < qkv.size(); ++i) {
      // The reference is double, so a small step is both accurate and unaffected by rounding.
      const double eps = 1e-3;
      Vec xp = qkv, xm = qkv;
      xp[i] += static_cast<float>(eps);
      xm[i] -= static_cast<float>(eps);
      const double hstep = static_cast<double>(xp[i]) - xm[i];
      const AttnRef rp = attention_ref(xp, b, t, h, g, d), rm = attention_ref(xm, b, t, h, g, d);
      double lp = 0, lm = 0;
      for (size_t k = 0; k < dout.size(); ++k) {
        lp += dout[k] * rp.out[k];
        lm += dout[k] * rm.out[k];
      }
      want[i] = dqkv0[i] + (lp - lm) / hstep;
    }
    expect_close(dqkv, want, 1e-4, 1e-3, "dqkv");
  }
}

// --- softmax cross-entropy ---

TEST(CrossEntropy, LossesSumAndProbs) {
  const int64_t n = 6, v = 13;
  Vec logits = testing::uniform(n * v, 61, -3.0f, 3.0f);
  // Large logits: only a max-subtracted softmax stays finite here.
  for (int64_t j = 0; j < v; ++j) logits[z(4 * v + j)] += 1000.0f;
  for (int64_t j = 0; j < v; ++j) logits[z(5 * v + j)] -= 1000.0f;
  const std::vector<int32_t> targets = {0, 12, 5, 5, 7, 3};
  const Vec orig = logits;
  Vec losses(z(n), std::nanf(""));
  const double total =
      cpu::softmax_cross_entropy(logits.data(), targets.data(), losses.data(), n, v);
  DVec want_loss(z(n)), want_p(z(n * v));
  double want_total = 0;
  for (int64_t i = 0; i < n; ++i) {
    double mx = -1e300, s = 0;
    for (int64_t j = 0; j < v; ++j) mx = std::max(mx, static_cast<double>(orig[z(i * v + j)]));
    for (int64_t j = 0; j < v; ++j) s += std::exp(orig[z(i * v + j)] - mx);
    for (int64_t j = 0; j < v; ++j) want_p[z(i * v + j)] = std::exp(orig[z(i * v + j)] - mx) / s;
    want_loss[z(i)] = std::log(s) - (orig[z(i * v + targets[z(i)])] - mx);
    want_total += want_loss[z(i)];
  }
  expect_close(losses, want_loss, 1e-5, 1e-5, "losses");
  expect_close(logits, want_p, 1e-6, 1e-5, "probs");
  EXPECT_NEAR(total, want_total, 1e-5 * want_total);
  double sum_losses = 0;
  for (float l : losses) sum_losses += l;
  EXPECT_NEAR(total, sum_losses, 1e-9 * sum_losses);
}

TEST(CrossEntropy, TargetOutsideVocabularyThrowsNamingIt) {
  const int64_t n = 3, v = 5;
  Vec logits = testing::uniform(n * v, 62);
  Vec losses(z(n));
  auto run = [&](std::vector<int32_t> targets) {
    return error_message(
        [&] { cpu::softmax_cross_entropy(logits.data(), targets.data(), losses.data(), n, v); });
  };
  EXPECT_PRED2(contains, run({0, 1234, 2}), "1234");
  EXPECT_PRED2(contains, run({-7, 1, 2}), "-7");
  EXPECT_NE(run({0, 1, 5}), "");  // v itself is one past the end
  EXPECT_EQ(run({0, 4, 2}), "");
}

// PyTorch returns 200 here. Forming log(p[target]) from the fp32 probability would give
// log(0) = inf once exp(-200) underflows: the loss must come from log(sum) - (logit - max).
TEST(CrossEntropy, LossStaysFiniteForAVeryUnlikelyTarget) {
  Vec logits = {0.0f, -200.0f};
  const std::vector<int32_t> target = {1};
  Vec loss(1);
  const double total = cpu::softmax_cross_entropy(logits.data(), target.data(), loss.data(), 1, 2);
  EXPECT_NEAR(loss[0], 200.0f, 1e-3f);
  EXPECT_NEAR(total, 200.0, 1e-3);
}

TEST(CrossEntropy, BackwardIsScaledProbsMinusOneHot) {
  const int64_t n = 4, v = 9;
  Vec probs = testing::uniform(n * v, 63, 0.0f, 1.0f);
  const std::vector<int32_t> targets = {8, 0, 3, 3};
  const float scale = 0.125f;
  DVec want(z(n * v));
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < v; ++j)
      want[z(i * v + j)] =
          (static_cast<double>(probs[z(i * v + j)]) - (j == targets[z(i)] ? 1.0 : 0.0)) * scale;
  // It overwrites (it is not an accumulation): start from garbage.
  Vec d(z(n * v), std::nanf(""));
  cpu::cross_entropy_backward(probs.data(), targets.data(), d.data(), scale, n, v);
  expect_close(d, want, 1e-7, 1e-6, "dlogits");
  // In place, as the LM head uses it.
  cpu::cross_entropy_backward(probs.data(), targets.data(), probs.data(), scale, n, v);
  expect_close(probs, want, 1e-7, 1e-6, "dlogits in place");
}

// --- AdamW ---

// torch.optim.AdamW's update for one scalar, step t (1-based), in double.
void adamw_ref(double& p, double g, double& m, double& v, double lr, double b1, double b2,
               double eps, double wd, int t) {
  p *= 1.0 - lr * wd;
  m = b1 * m + (1.0 - b1) * g;
  v = b2 * v + (1.0 - b2) * g * g;
  const double bc1 = 1.0 - std::pow(b1, t), bc2 = 1.0 - std::pow(b2, t);
  p -= lr / bc1 * m / (std::sqrt(v) / std::sqrt(bc2) + eps);
}

TEST(AdamW, ThreeStepsMatchTorchSemantics) {
  const int64_t n = 41;
  const float lr = 0.01f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f;
  Vec p = testing::uniform(n, 71, -2.0f, 2.0f), m(z(n), 0.0f), v(z(n), 0.0f);
  DVec rp(p.begin(), p.end()), rm(z(n), 0.0), rv(z(n), 0.0);
  for (int step = 1; step <= 3; ++step) {
    Vec g = testing::uniform(n, 72 + static_cast<uint64_t>(step));
    g[0] = 0.0f;   // decay alone moves it
    g[1] = 1e-6f;  // eps matters
    g[2] = step == 2 ? -50.0f : 0.5f;
    for (int64_t i = 0; i < n; ++i)
      adamw_ref(rp[z(i)], g[z(i)], rm[z(i)], rv[z(i)], lr, b1, b2, eps, wd, step);
    cpu::adamw(p.data(), g.data(), m.data(), v.data(), n, lr, b1, b2, eps, wd, step);
    expect_close(p, rp, 1e-6, 1e-6, "p after step " + std::to_string(step));
    expect_close(m, rm, 1e-7, 1e-5, "m after step " + std::to_string(step));
    expect_close(v, rv, 1e-9, 1e-5, "v after step " + std::to_string(step));
  }
}

// A clip folded into the update: AdamW reading each gradient times a scale
// gives the bits of scaling the gradients first, and leaves them as they were.
TEST(AdamW, AGradScaleGivesTheBitsOfScalingTheGradientsFirst) {
  const int64_t n = 203;
  for (const float scale : {0.37f, 1.0f, 3e-3f}) {
    Vec p1 = testing::uniform(n, 81, -2.0f, 2.0f), m1 = testing::uniform(n, 82, -0.1f, 0.1f),
        v1 = testing::uniform(n, 83, 0.0f, 0.01f);
    Vec p2 = p1, m2 = m1, v2 = v1;
    const Vec g = testing::uniform(n, 84, -5.0f, 5.0f);
    Vec scaled = g;
    cpu::scale_inplace(scaled.data(), scale, n);
    cpu::adamw(p1.data(), scaled.data(), m1.data(), v1.data(), n, 0.01f, 0.9f, 0.95f, 1e-8f, 0.1f,
               4);
    Vec g2 = g;
    cpu::adamw(p2.data(), g2.data(), m2.data(), v2.data(), n, 0.01f, 0.9f, 0.95f, 1e-8f, 0.1f, 4,
               scale);
    EXPECT_EQ(0, std::memcmp(p1.data(), p2.data(), sizeof(float) * z(n))) << scale;
    EXPECT_EQ(0, std::memcmp(m1.data(), m2.data(), sizeof(float) * z(n))) << scale;
    EXPECT_EQ(0, std::memcmp(v1.data(), v2.data(), sizeof(float) * z(n))) << scale;
    EXPECT_EQ(0, std::memcmp(g.data(), g2.data(), sizeof(float) * z(n))) << scale;
    if (scale != 1.0f) {
      EXPECT_NE(scaled, g);
    }
  }
}

// torch.optim.SGD(momentum, weight_decay), step by step in double:
// d = g + wd p; buf = momentum buf + d (buf = d at the first step); p -= lr buf.
TEST(Sgd, ThreeStepsMatchTorchSemantics) {
  const int64_t n = 41;
  const float lr = 0.05f, wd = 0.1f;
  for (const float mu : {0.0f, 0.9f}) {
    Vec p = testing::uniform(n, 73, -2.0f, 2.0f), buf(z(n), 0.0f);
    DVec rp(p.begin(), p.end()), rb(z(n), 0.0);
    for (int step = 1; step <= 3; ++step) {
      const Vec g = testing::uniform(n, 74 + static_cast<uint64_t>(step));
      for (int64_t i = 0; i < n; ++i) {
        const double d = g[z(i)] + double(wd) * rp[z(i)];
        rb[z(i)] = step == 1 ? d : double(mu) * rb[z(i)] + d;
        rp[z(i)] -= double(lr) * (mu > 0 ? rb[z(i)] : d);
      }
      cpu::sgd(p.data(), g.data(), buf.data(), n, lr, mu, wd);
      expect_close(p, rp, 1e-6, 1e-6, "p after step " + std::to_string(step));
    }
  }
}

// --- thread-count independence ---

TEST(Determinism, WeightReductionsAreBitwiseIdenticalAcrossThreadCounts) {
  ThreadGuard guard;
  const int64_t n = 1001, c = 300;
  const Vec dy = testing::uniform(n * c, 81), x = testing::uniform(n * c, 82, -2.0f, 2.0f);
  const Vec w = testing::uniform(c, 83), b = testing::uniform(c, 84);
  Vec y(z(n * c)), mean(z(n)), rstd(z(n));
  cpu::layernorm_forward(x.data(), w.data(), b.data(), y.data(), mean.data(), rstd.data(), n, c,
                         1e-5f);
  auto run = [&](int threads, Vec& dw, Vec& db, Vec& rows) {
    set_threads(threads);
    ASSERT_EQ(get_threads(), threads);
    dw = testing::uniform(c, 85);
    db = testing::uniform(c, 86);
    rows = testing::uniform(c, 87);
    cpu::layernorm_backward_weight(dy.data(), x.data(), mean.data(), rstd.data(), dw.data(),
                                   db.data(), n, c);
    cpu::sum_rows(dy.data(), rows.data(), n, c);
  };
  Vec dw1, db1, rows1;
  run(1, dw1, db1, rows1);
  for (int threads : {2, 3}) {
    Vec dw, db, rows;
    run(threads, dw, db, rows);
    EXPECT_EQ(std::memcmp(dw.data(), dw1.data(), dw.size() * sizeof(float)), 0) << threads;
    EXPECT_EQ(std::memcmp(db.data(), db1.data(), db.size() * sizeof(float)), 0) << threads;
    EXPECT_EQ(std::memcmp(rows.data(), rows1.data(), rows.size() * sizeof(float)), 0) << threads;
  }
}


// --- weft/ops.h: the device dispatch, on the CPU ---

// The slice kernels (tensor parallelism) against the whole-vocabulary ones:
// the slices' rows, placed side by side, are the whole table's, and a row
// whose token another slice holds is zero (positions added by one slice).
TEST(Ops, EmbeddingSlicesSumToTheWholeTable) {
  const int64_t b = 2, t = 5, c = 6, v = 12, parts = 3, rows = v / parts;
  Tensor tok = Tensor::empty({b, t}, DType::I32);
  for (int64_t i = 0; i < b * t; ++i)
    tok.data<int32_t>()[i] = static_cast<int32_t>((7 * i + 3) % v);
  Tensor wte = testing::uniform_tensor({v, c}, 1), wpe = testing::uniform_tensor({t, c}, 2);
  Tensor whole = Tensor::zeros({b, t, c});
  ops::embedding_forward(tok, wte, 0, wpe, whole);
  Tensor sum = Tensor::zeros({b, t, c});
  for (int64_t p = 0; p < parts; ++p) {
    Tensor part = Tensor::zeros({b, t, c});
    ops::embedding_forward(tok, wte.slice0(p * rows, (p + 1) * rows), p * rows,
                           p == 0 ? wpe : Tensor(), part);
    ops::add(sum, part);
  }
  for (int64_t i = 0; i < whole.numel(); ++i)
    ASSERT_EQ(sum.data<float>()[i], whole.data<float>()[i]) << i;  // adding zeros is exact

  Tensor dy = testing::uniform_tensor({b, t, c}, 3);
  Tensor dwte = Tensor::zeros({v, c}), dwpe = Tensor::zeros({t, c});
  ops::embedding_backward(tok, dy, dwte, 0, dwpe);
  for (int64_t p = 0; p < parts; ++p) {
    Tensor part = Tensor::zeros({rows, c}), pos = Tensor::zeros({t, c});
    ops::embedding_backward(tok, dy, part, p * rows, pos);
    for (int64_t i = 0; i < part.numel(); ++i)
      ASSERT_EQ(part.data<float>()[i], dwte.data<float>()[p * rows * c + i]) << "slice " << p;
    for (int64_t i = 0; i < pos.numel(); ++i)
      ASSERT_EQ(pos.data<float>()[i], dwpe.data<float>()[i]);
  }
}

// A target in another slice subtracts nothing; in this slice, its column.
TEST(Ops, CrossEntropyBackwardOnASlice) {
  const int64_t n = 3, v = 4;
  Tensor probs = testing::uniform_tensor({n, v}, 4, 0.0f, 1.0f);
  Tensor tgt = Tensor::empty({n}, DType::I32);
  tgt.data<int32_t>()[0] = 9, tgt.data<int32_t>()[1] = 2, tgt.data<int32_t>()[2] = 8;
  Tensor d = Tensor::zeros({n, v});
  ops::cross_entropy_backward(probs, tgt, 8, d, 0.5f);  // this slice: vocabulary [8, 12)
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < v; ++j) {
      const float p = probs.data<float>()[i * v + j] * 0.5f;
      const bool hit = tgt.data<int32_t>()[i] == 8 + j;
      EXPECT_EQ(d.data<float>()[i * v + j], hit ? p - 0.5f : p) << i << ", " << j;
    }
}

// bf16 activations: an operation reads bf16 values exactly, computes in fp32
// and rounds each bf16 output once. References here are written in double
// from the bf16 inputs. Where fp32 arithmetic is exact or correctly rounded
// (an add, a GEMM of small integers) the result must be the reference
// rounded once, bit for bit; elsewhere (tanh, a LayerNorm's reductions) it
// must be a bf16 value within half a bf16 ulp (2^-8 relative at most) plus
// fp32's own error of the double reference.
Tensor bf16_of(const Vec& v, Shape shape) {
  Tensor f32 = Tensor::empty(shape);
  std::copy(v.begin(), v.end(), f32.data<float>());
  Tensor t = Tensor::empty(shape, DType::BF16);
  ops::convert(f32, t);
  return t;
}
Vec floats_of(const Tensor& t) {
  Tensor f32 = Tensor::empty(t.shape());
  ops::convert(t, f32);
  return Vec(f32.data<float>(), f32.data<float>() + t.numel());
}

TEST(Bf16Activations, ConvertRoundsToNearestEvenAndWidensExactly) {
  const Vec v = {1.0f, 1.0f + 0x1p-8f, 1.0f + 0x1p-8f + 0x1p-20f, 1.0f + 3 * 0x1p-8f, -2.5f};
  // 1 + 2^-8 is a tie (bf16 keeps 2^-7 steps at 1): to even, 1; anything
  // above the tie rounds up; 1 + 3 x 2^-8 ties to 1 + 2^-6 (even).
  EXPECT_EQ(floats_of(bf16_of(v, {5})), (Vec{1.0f, 1.0f, 1.0f + 0x1p-7f, 1.0f + 0x1p-6f, -2.5f}));
  Tensor wrong = Tensor::empty({5}, DType::I32);
  EXPECT_TRUE(contains(error_message([&] { ops::convert(bf16_of(v, {5}), wrong); }),
                       "convert: BF16 to I32 is not supported"));
}

TEST(Bf16Activations, ElementwiseOpsRoundTheirFp32ResultOnce) {
  const int64_t n = 4, c = 24;
  Vec x = testing::uniform(n * c, 21), y0 = testing::uniform(n * c, 22);
  Vec w = testing::uniform(c, 23), b = testing::uniform(c, 24);
  for (float& e : x) e = round_to_bf16(3 * e);
  for (float& e : y0) e = round_to_bf16(e);
  for (float& e : w) e = 1.0f + 0.1f * e;
  const Tensor xb = bf16_of(x, {n, c});
  // GELU: y = round(gelu(x)).
  Tensor yb = Tensor::empty({n, c}, DType::BF16);
  ops::gelu_forward(xb, yb);
  Vec got = floats_of(yb);
  for (int64_t i = 0; i < n * c; ++i) {
    const double u = x[z(i)],
                 g = 0.5 * u * (1 + std::tanh(0.7978845608028654 * (u + 0.044715 * u * u * u)));
    // Half a bf16 ulp (<= 2^-8 relative) from one rounding, plus fp32's tanh error.
    EXPECT_NEAR(got[z(i)], g, std::ldexp(std::abs(g), -8) + 1e-6) << "gelu " << i;
    EXPECT_EQ(got[z(i)], round_to_bf16(got[z(i)])) << "gelu " << i << " is not a bf16 value";
  }
  // The residual add accumulates: y = round(y + x).
  Tensor acc = bf16_of(y0, {n, c});
  ops::add(acc, xb);
  got = floats_of(acc);
  for (int64_t i = 0; i < n * c; ++i)
    EXPECT_EQ(got[z(i)], round_to_bf16(y0[z(i)] + x[z(i)])) << "add " << i;
  // LayerNorm: bf16 in and out, fp32 statistics.
  Tensor wt = Tensor::empty({c}), bt = Tensor::empty({c});
  std::copy(w.begin(), w.end(), wt.data<float>());
  std::copy(b.begin(), b.end(), bt.data<float>());
  Tensor mean = Tensor::empty({n}), rstd = Tensor::empty({n});
  ops::layernorm_forward(xb, wt, bt, yb, mean, rstd, 1e-5f);
  got = floats_of(yb);
  for (int64_t r = 0; r < n; ++r) {
    double mu = 0, var = 0;
    for (int64_t j = 0; j < c; ++j) mu += x[z(r * c + j)];
    mu /= c;
    for (int64_t j = 0; j < c; ++j) var += (x[z(r * c + j)] - mu) * (x[z(r * c + j)] - mu);
    const double rs = 1 / std::sqrt(var / c + 1e-5);
    EXPECT_NEAR(mean.data<float>()[r], mu, 1e-6);
    for (int64_t j = 0; j < c; ++j) {
      const double want = (x[z(r * c + j)] - mu) * rs * w[z(j)] + b[z(j)];
      // fp32 LayerNorm is within ~c x 2^-24 relative of double: an ulp of bf16 at most.
      EXPECT_NEAR(got[z(r * c + j)], want, std::ldexp(std::abs(want), -8) + 1e-6)
          << "layernorm " << r << "," << j;
      EXPECT_EQ(got[z(r * c + j)], round_to_bf16(got[z(r * c + j)]));
    }
  }
}

// A GEMM of bf16 operands into a bf16 output accumulates in fp32 and rounds
// once: y = round(alpha a b + beta y), here with exact small integers so the
// fp32 sum is exact and only the final rounding remains.
TEST(Bf16Activations, GemmIntoBf16RoundsOnce) {
  const int64_t m = 3, k = 5, n = 4;
  Vec a(z(m * k)), bm(z(k * n)), c0(z(m * n));
  for (int64_t i = 0; i < m * k; ++i) a[z(i)] = static_cast<float>(i % 7) - 3;
  for (int64_t i = 0; i < k * n; ++i) bm[z(i)] = static_cast<float>(i % 5) + 0.5f;
  for (int64_t i = 0; i < m * n; ++i) c0[z(i)] = 100.0f + static_cast<float>(i);
  Tensor cb = bf16_of(c0, {m, n});
  Tensor wf = Tensor::empty({k, n});  // an fp32 operand (a parameter) with a bf16 one
  std::copy(bm.begin(), bm.end(), wf.data<float>());
  ops::gemm(bf16_of(a, {m, k}), false, wf, false, cb, 1.0f, 1.0f);
  const Vec got = floats_of(cb);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      float s = round_to_bf16(c0[z(i * n + j)]);
      for (int64_t l = 0; l < k; ++l) s += a[z(i * k + l)] * bm[z(l * n + j)];
      EXPECT_EQ(got[z(i * n + j)], round_to_bf16(s)) << i << "," << j;
    }
}

// Under --bf16 on the CPU, a bf16 operand is widened and used as it is (its
// values are bf16 already) while an fp32 one is still rounded: the same bits
// as sgemm on both operands rounded.
// ops::gemm of a bf16 activation and an fp32 weight under --bf16's
// precision, beside sgemm on both operands rounded to bf16 (want) and on the
// weight left unrounded.
struct MixedGemm {
  static constexpr int64_t m = 6, k = 33, n = 9;
  Vec ra = testing::uniform(m * k, 21), rw = testing::uniform(k * n, 22);
  Vec got, want = Vec(z(m * n)), unrounded = Vec(z(m * n));
  int64_t widened = 0;  // whether ops::gemm widened its bf16 operand (the emulation)
  MixedGemm() {
    CpuPrecision scope(ops::MatmulPrecision::Bf16);
    Tensor wf = Tensor::empty({k, n});
    std::copy(rw.begin(), rw.end(), wf.data<float>());
    Tensor c = Tensor::zeros({m, n});
    ops::reset_widened_ops();
    ops::gemm(bf16_of(ra, {m, k}), false, wf, false, c, 1.0f, 0.0f);
    const auto counts = ops::widened_ops();
    widened = counts.count("gemm") ? counts.at("gemm") : 0;
    got.assign(c.data<float>(), c.data<float>() + c.numel());
    const Vec w = rw;
    for (float& x : ra) x = round_to_bf16(x);
    for (float& x : rw) x = round_to_bf16(x);
    cpu::gemm(false, false, m, n, k, 1.0f, ra.data(), k, rw.data(), n, 0.0f, want.data(), n);
    cpu::gemm(false, false, m, n, k, 1.0f, ra.data(), k, w.data(), n, 0.0f, unrounded.data(), n);
  }
};

TEST(Bf16Activations, GemmRoundsOnlyItsFp32Operand) {
  Bf16GemmScope emulated(cpu::Bf16Gemm::Emulated);
  const MixedGemm g;
  EXPECT_EQ(g.widened, 1);
  EXPECT_EQ(std::memcmp(g.got.data(), g.want.data(), g.want.size() * sizeof(float)), 0);
  EXPECT_NE(std::memcmp(g.got.data(), g.unrounded.data(), g.want.size() * sizeof(float)), 0);
}

// oneDNN's bf16 matmul (where the CPU has AVX-512 BF16 or AMX): against
// the double sum of the same bf16 values, every transpose, strided operands,
// alpha and beta. Products of bf16 values are exact in fp32, so only the
// sums round: at most (k + 2) u of the magnitudes' sum (u = 2^-24), as for
// sgemm. Then through ops::gemm under --bf16's precision, a bf16 activation
// against an fp32 weight: the bits of sgemm on the rounded values up to that
// bound, where the unrounded weight is far outside it.
TEST(Bf16Gemm, OneDnnSumsTheRoundedProducts) {
  if (!cpu::bf16_gemm_runs()) GTEST_SKIP() << "no oneDNN, or a CPU without AVX-512 BF16 or AMX";
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      const int64_t m = 19, n = 23, k = 70;
      const int64_t lda = (ta ? m : k) + 3, ldb = (tb ? k : n) + 5, ldc = n + 2;
      const Vec ra = testing::uniform((ta ? k : m) * lda, 31),
                rb = testing::uniform((tb ? n : k) * ldb, 32);
      std::vector<uint16_t> a(ra.size()), b(rb.size());
      for (size_t i = 0; i < a.size(); ++i) a[i] = to_bf16(ra[i]);
      for (size_t i = 0; i < b.size(); ++i) b[i] = to_bf16(rb[i]);
      Vec c = testing::uniform(m * ldc, 33);
      const Vec c0 = c;
      const float alpha = 0.75f, beta = -0.5f;
      cpu::gemm_bf16(ta, tb, m, n, k, alpha, a.data(), lda, b.data(), ldb, beta, c.data(), ldc);
      int bad = 0;
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) {
          double s = 0, mag = 0;
          for (int64_t l = 0; l < k; ++l) {
            const double p =
                static_cast<double>(bf16_to_float(a[z(ta ? l * lda + i : i * lda + l)])) *
                bf16_to_float(b[z(tb ? j * ldb + l : l * ldb + j)]);
            s += p, mag += std::abs(p);
          }
          const double want = alpha * s + beta * static_cast<double>(c0[z(i * ldc + j)]);
          const double bound = (static_cast<double>(k) + 2) * 0x1p-24 *
                               (std::abs(alpha) * mag + std::abs(beta * c0[z(i * ldc + j)]));
          if (!(std::abs(c[z(i * ldc + j)] - want) <= bound) && ++bad <= 3)
            ADD_FAILURE() << "ta=" << ta << " tb=" << tb << " C[" << i << "," << j
                          << "] = " << c[z(i * ldc + j)] << ", want " << want;
        }
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = n; j < ldc; ++j) EXPECT_EQ(c[z(i * ldc + j)], c0[z(i * ldc + j)]);
    }

  Bf16GemmScope onednn(cpu::Bf16Gemm::OneDnn);
  const MixedGemm g;
  EXPECT_EQ(g.widened, 0) << "the bf16 activation was widened: the emulation ran";
  const int64_t m = MixedGemm::m, k = MixedGemm::k, n = MixedGemm::n;
  double far = 0;
  for (int64_t i = 0; i < m * n; ++i) {
    double mag = 0;
    for (int64_t l = 0; l < k; ++l)
      mag += std::abs(g.ra[z(i / n * k + l)] * g.rw[z(l * n + i % n)]);
    const double bound = (k + 2) * 0x1p-24 * mag;
    EXPECT_LE(std::abs(g.got[z(i)] - g.want[z(i)]), bound) << i;
    far = std::max(far, std::abs(g.unrounded[z(i)] - g.want[z(i)]) / bound);
  }
  EXPECT_GT(far, 4.0) << "the weight's rounding would not be seen";
}

TEST(Ops, GemmChecksThatShapesChain) {
  Tensor a = Tensor::zeros({4, 3}), b = Tensor::zeros({5, 2}), c = Tensor::zeros({4, 2});
  const std::string msg = error_message([&] { ops::gemm(a, false, b, false, c); });
  EXPECT_TRUE(contains(msg, "gemm: op(a) is (4, 3), op(b) (5, 2)")) << msg;
}

// Operands on two devices, or on a device this process cannot use, are
// refused with the operation and the devices named, before any kernel runs.
// (A view of host bytes labelled cuda:0 is never dereferenced: the check
// comes first.)
TEST(Ops, DevicesAreCheckedBeforeAnyKernel) {
  std::vector<float> bytes(8);
  Tensor gpu(bytes.data(), Shape{8}, DType::F32, Device::cuda(0));
  Tensor cpu = Tensor::zeros({8});
  std::string msg = error_message([&] { ops::add(cpu, gpu); });
  EXPECT_TRUE(contains(msg, "add: tensors on cpu and cuda:0; every operand must be on one device"))
      << msg;
  if (cuda_device_count() > 0) GTEST_SKIP() << "a GPU is visible: cuda:0 is usable here";
  msg = error_message([&] { ops::scale(gpu, 2.0f); });
  EXPECT_TRUE(contains(msg, "scale on cuda:0")) << msg;
  EXPECT_TRUE(contains(msg, cuda_built() ? "no such CUDA device (0 visible)"
                                         : "weft was built without CUDA"))
      << msg;
}


// --- many tensors at once (the gradient norm and clipping) ---

// Sizes around a GPU chunk (16384 elements): empty, under one, one and a
// bit, several and a remainder, and small ones between.
const std::vector<int64_t> kMultiSizes = {0, 1, 16383, 16385, 3 * 16384 + 5, 7, 0, 100003};

std::vector<Tensor> multi_tensors(uint64_t seed) {
  std::vector<Tensor> xs;
  for (const int64_t n : kMultiSizes)
    xs.push_back(testing::uniform_tensor({n}, seed++, -3.0f, 2.0f));
  return xs;
}

// The CPU's sum is the per-tensor loop's, bit for bit (what GradSync and
// grad_norm computed before, so no layout's numbers change), and the exact
// sum's to double rounding: a float's square is exact in double, and a sum
// of m non-negative doubles in any order is within (m - 1) 2^-53 of the
// exact sum relative, so the loop and the sequential reference below differ
// by at most 2 m 2^-53 = m 2^-52 of it.
TEST(MultiTensor, SumSquaresIsThePerTensorLoop) {
  const std::vector<Tensor> xs = multi_tensors(50);
  double loop = 0, exact = 0;
  int64_t m = 0;
  for (const Tensor& x : xs) {
    loop += ops::sum_squares(x);
    for (int64_t i = 0; i < x.numel(); ++i)
      exact += static_cast<double>(x.data<float>()[i]) * x.data<float>()[i];
    m += x.numel();
  }
  std::shared_ptr<void> cache;
  const double got = ops::sum_squares_multi(xs, cache);
  EXPECT_EQ(got, loop);
  EXPECT_NEAR(got, exact, static_cast<double>(m) * std::ldexp(1.0, -52) * exact);
  EXPECT_EQ(ops::sum_squares_multi(xs, cache), got);  // again, with the same cache
  // Accumulated in double: 1e20 squared overflows float but not the sum.
  const std::vector<Tensor> big = {Tensor::empty({1}), Tensor::empty({2})};
  big[0].data<float>()[0] = 1e20f;
  big[1].data<float>()[0] = -1e20f, big[1].data<float>()[1] = 1e20f;
  std::shared_ptr<void> big_cache;
  EXPECT_EQ(ops::sum_squares_multi(big, big_cache),
            ops::sum_squares(big[0]) + ops::sum_squares(big[1]));
  EXPECT_GT(ops::sum_squares_multi(big, big_cache), 2.9e40);
  // No tensors, or none with an element: 0.
  std::shared_ptr<void> none;
  EXPECT_EQ(ops::sum_squares_multi({}, none), 0.0);
  EXPECT_EQ(ops::sum_squares_multi({Tensor::zeros({0}), Tensor::zeros({0, 3})}, none), 0.0);
}

// scale_multi is scale on each tensor, bit for bit, and that is the float
// product x * s of every element (s = 0.7 is no power of two: most products
// round). Tensors outside the list are left alone.
TEST(MultiTensor, ScaleIsThePerTensorScale) {
  const float s = 0.7f;
  const std::vector<Tensor> xs = multi_tensors(60), one = multi_tensors(60),
                            before = multi_tensors(60);
  const Tensor outside = testing::uniform_tensor({5}, 99);
  std::shared_ptr<void> cache;
  ops::scale_multi(xs, s, cache);
  for (size_t t = 0; t < xs.size(); ++t) {
    ops::scale(one[t], s);
    const int64_t n = xs[t].numel();
    if (n == 0) continue;  // (an empty tensor's data may be null: nothing to compare)
    EXPECT_EQ(std::memcmp(xs[t].data<float>(), one[t].data<float>(), z(n) * sizeof(float)), 0)
        << "tensor " << t << " (" << n << " elements)";
    int bad = 0;
    for (int64_t i = 0; i < n; ++i) bad += xs[t].data<float>()[i] != before[t].data<float>()[i] * s;
    EXPECT_EQ(bad, 0) << "tensor " << t;
  }
  const Tensor fresh = testing::uniform_tensor({5}, 99);
  EXPECT_EQ(std::memcmp(outside.data<float>(), fresh.data<float>(), 5 * sizeof(float)), 0);
  std::shared_ptr<void> none;
  ops::scale_multi({}, s, none);  // nothing to do, and no error
}

// A bf16 tensor (no caller passes one: gradients are fp32) and tensors on two
// devices are refused, naming the tensor, before any kernel. (Host bytes
// labelled cuda:0 are never dereferenced: the check comes first.)
TEST(MultiTensor, RefusesBf16AndMixedDevices) {
  std::shared_ptr<void> cache;
  const std::vector<Tensor> mixed_dtypes = {Tensor::zeros({4}), bf16_of({1, 2, 3}, {3})};
  std::string msg = error_message([&] { ops::sum_squares_multi(mixed_dtypes, cache); });
  EXPECT_TRUE(
      contains(msg, "sum_squares_multi: tensor 1 of 2 [3] is BF16; every tensor must be F32"))
      << msg;
  msg = error_message([&] { ops::scale_multi(mixed_dtypes, 2.0f, cache); });
  EXPECT_TRUE(contains(msg, "scale_multi: tensor 1 of 2 [3] is BF16")) << msg;
  std::vector<float> bytes(8);
  const std::vector<Tensor> mixed_devices = {
      Tensor::zeros({8}), Tensor(bytes.data(), Shape{8}, DType::F32, Device::cuda(0))};
  msg = error_message([&] { ops::sum_squares_multi(mixed_devices, cache); });
  EXPECT_TRUE(contains(
      msg, "sum_squares_multi: tensors on cpu and cuda:0; every operand must be on one device"))
      << msg;
  msg = error_message([&] { ops::scale_multi(mixed_devices, 2.0f, cache); });
  EXPECT_TRUE(contains(msg, "scale_multi: tensors on cpu and cuda:0")) << msg;
}

// --- many tensors' bf16 copies (a --bf16 step's weights) ---

// convert_multi is convert on each pair, bit for bit: the same rounding to
// nearest even, ties included (1 + 2^-8 ties to 1, 1 + 3 x 2^-8 to
// 1 + 2^-6), infinities kept and a NaN kept a NaN; a 2-D pair and empty
// ones among ragged sizes. Destinations outside the list are left alone.
TEST(MultiTensor, ConvertMultiIsThePerTensorConvert) {
  std::vector<Tensor> srcs = multi_tensors(80);
  srcs.push_back(testing::uniform_tensor({3, 5}, 88, -1e5f, 1e5f));
  const Vec special = {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, -(1.0f + 0x1p-8f), 0x1p-130f,
                       INFINITY, -INFINITY, NAN, 3.0e38f, -0.0f};
  std::copy(special.begin(), special.end(), srcs[3].data<float>());  // 16385 elements
  std::vector<Tensor> dsts, want;
  for (const Tensor& x : srcs) {
    dsts.push_back(Tensor::zeros(x.shape(), DType::BF16));
    want.push_back(Tensor::zeros(x.shape(), DType::BF16));
    ops::convert(x, want.back());
  }
  const Tensor outside = Tensor::zeros({4}, DType::BF16);
  std::shared_ptr<void> cache;
  for (int call = 0; call < 2; ++call) {  // again with the same cache
    ops::convert_multi(srcs, dsts, cache);
    for (size_t t = 0; t < srcs.size(); ++t) {
      const int64_t n = srcs[t].numel();
      if (n == 0) continue;  // (an empty tensor's data may be null: nothing to compare)
      EXPECT_EQ(std::memcmp(dsts[t].data<uint16_t>(), want[t].data<uint16_t>(),
                            z(n) * sizeof(uint16_t)),
                0)
          << "call " << call << ", tensor " << t << " (" << n << " elements)";
    }
  }
  const Vec got = floats_of(dsts[3]);
  EXPECT_EQ(Vec(got.begin(), got.begin() + 6),
            (Vec{1.0f, 1.0f + 0x1p-6f, -1.0f, 0x1p-130f, INFINITY, -INFINITY}));
  EXPECT_TRUE(std::isnan(got[6]));
  EXPECT_EQ(floats_of(outside), (Vec{0, 0, 0, 0}));
  std::shared_ptr<void> none;
  ops::convert_multi({}, {}, none);  // nothing to do, and no error
}

// fill on a BF16 tensor writes the value rounded once (what converting an
// fp32 tensor of it would give); other dtypes are refused by name.
TEST(Fill, Bf16TensorsHoldTheValueRounded) {
  const Tensor t = Tensor::zeros({5}, DType::BF16);
  ops::fill(t, 1.0f / 3.0f);
  for (int64_t i = 0; i < 5; ++i) EXPECT_EQ(t.data<uint16_t>()[i], to_bf16(1.0f / 3.0f)) << i;
  EXPECT_NE(to_bf16(1.0f / 3.0f), 0u);
  const std::string msg =
      error_message([] { ops::fill(Tensor::zeros({2}, DType::I32), 1.0f); });
  EXPECT_TRUE(contains(msg, "fill: the tensor must be F32 or BF16, got I32")) << msg;
}

// Every pair is checked before any is written, and an error names the pair
// and the rule: list lengths, dtypes (F32 to BF16 only: a convert_multi of
// any other kind has no caller), shapes (equal, not only element counts),
// storage, and one device. (Host bytes labelled cuda:0 are never
// dereferenced: the checks come first.)
TEST(MultiTensor, ConvertMultiRefusesBadPairsBeforeWriting) {
  std::shared_ptr<void> cache;
  const Tensor a = Tensor::empty({6}), a16 = Tensor::zeros({6}, DType::BF16);
  ops::fill(a, 1.5f);
  auto refused = [&](const std::vector<Tensor>& srcs, const std::vector<Tensor>& dsts) {
    const std::string msg = error_message([&] { ops::convert_multi(srcs, dsts, cache); });
    EXPECT_EQ(floats_of(a16), (Vec(6, 0.0f))) << "written before the error: " << msg;
    return msg;
  };
  std::string msg = refused({a, a}, {a16});
  EXPECT_TRUE(contains(msg, "convert_multi: 2 sources for 1 destinations")) << msg;
  msg = refused({a, a}, {a16, Tensor::zeros({6})});
  EXPECT_TRUE(
      contains(msg, "convert_multi: pair 1 of 2 is F32 to F32; every pair must be F32 to BF16"))
      << msg;
  msg = refused({a, bf16_of({1, 2}, {2})}, {a16, Tensor::zeros({2}, DType::BF16)});
  EXPECT_TRUE(contains(msg, "pair 1 of 2 is BF16 to BF16")) << msg;
  msg = refused({a, Tensor::zeros({6})}, {a16, Tensor::zeros({2, 3}, DType::BF16)});
  EXPECT_TRUE(contains(msg, "convert_multi: pair 1 of 2 is [6] into [2, 3]; shapes must match"))
      << msg;
  msg = refused({a, Tensor()}, {a16, Tensor::zeros({6}, DType::BF16)});
  EXPECT_TRUE(contains(msg, "convert_multi: pair 1 of 2 has no storage")) << msg;
  std::vector<uint16_t> bytes(8);
  msg = refused({a, Tensor::zeros({8})},
                {a16, Tensor(bytes.data(), Shape{8}, DType::BF16, Device::cuda(0))});
  EXPECT_TRUE(contains(
      msg, "convert_multi: tensors on cpu and cuda:0; every operand must be on one device"))
      << msg;
}

}  // namespace
}  // namespace weft
