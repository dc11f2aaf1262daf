// main() of the CUDA tests: exit 77 (meson: SKIP) when weft was built without
// CUDA, when the binary needs a GPU (WEFT_TEST_NEEDS_GPU) and none is visible,
// or when it needs cuDNN's fused attention (WEFT_TEST_NEEDS_CUDNN) and the
// build has none.
#include <weft/device.h>
#include <weft/ops.h>

#include <fmt/core.h>
#include <gtest/gtest.h>

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  if (!weft::cuda_built()) {
    fmt::print("SKIP: weft was built without CUDA (-Dcuda=enabled)\n");
    return 77;
  }
  if (WEFT_TEST_NEEDS_GPU && weft::cuda_device_count() == 0) {
    fmt::print("SKIP: no CUDA device is visible\n");
    return 77;
  }
#if WEFT_TEST_NEEDS_CUDNN
  if (!weft::ops::fused_attention_built()) {
    fmt::print("SKIP: weft was built without cuDNN fused attention (scripts/cudnn-frontend.sh)\n");
    return 77;
  }
#endif
  return RUN_ALL_TESTS();
}
