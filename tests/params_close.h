// Parameters after training, compared as two runs of the same model should
// be: the difference's norm within `rel` of the reference's norm, plus `abs`
// per element in quadrature. The absolute part is for parameters whose true
// gradient is zero: the attention's key bias (softmax ignores a shift shared
// by every key), where Adam turns float noise into values near 1e-7 that
// differ between any two summation orders; a missed or doubled update moves
// a parameter by about the learning rate, far outside both.
#pragma once

#include <weft/tensor.h>

#include <gtest/gtest.h>

#include <cmath>

namespace weft::testing {

inline ::testing::AssertionResult params_close(const Tensor& got, const Tensor& want, double rel,
                                               double abs) {
  double diff = 0, ref = 0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    const double d = static_cast<double>(got.data<float>()[i]) - want.data<float>()[i];
    diff += d * d;
    ref += static_cast<double>(want.data<float>()[i]) * want.data<float>()[i];
  }
  diff = std::sqrt(diff), ref = std::sqrt(ref);
  const double allowed = rel * ref + abs * std::sqrt(static_cast<double>(want.numel()));
  if (diff <= allowed) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "|got - want| = " << diff << " > " << allowed << " (|want| = " << ref << ")";
}

}  // namespace weft::testing
