// What the GPU tests share: device copies of host vectors, and an
// element-wise bound check that reports the worst element.
#pragma once

#include <weft/cuda/runtime.h>

#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace weft::cuda::test_util {

// A device copy of host values on cuda:0, and back.
template <typename T>
class Dev {
 public:
  explicit Dev(const std::vector<T>& host)
      : buf_(context(0), static_cast<int64_t>(host.size())) {
    upload(context(0), buf_.data(), host.data(), buf_.bytes());
  }
  T* p() const { return buf_.data(); }
  std::vector<T> host() const {
    std::vector<T> h(static_cast<size_t>(buf_.size()));
    download(context(0), h.data(), buf_.data(), buf_.bytes());
    return h;
  }

 private:
  DeviceBuffer<T> buf_;
};

// |got - want| <= bound, element by element (NaN fails); on a miss, how many
// and the worst one.
inline void expect_within(const std::vector<float>& got, const std::vector<float>& want,
                          const std::vector<double>& bound, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  ASSERT_EQ(bound.size(), want.size()) << what;
  size_t bad = 0, worst = 0;
  double worst_ratio = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(static_cast<double>(got[i]) - static_cast<double>(want[i]));
    const double ratio = err / bound[i];
    if (!(ratio <= 1.0)) ++bad;  // NaN counts
    if (!(ratio <= worst_ratio)) {
      worst_ratio = ratio;
      worst = i;
    }
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size()
                     << " elements outside the bound; worst at " << worst << ": got "
                     << got[worst] << ", want " << want[worst] << ", bound " << bound[worst]
                     << " (error / bound " << worst_ratio << ")";
}

}  // namespace weft::cuda::test_util
