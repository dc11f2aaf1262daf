// What the GPU layout tests (test_cuda_mpi: ranks sharing a GPU;
// test_cuda_nccl: NCCL) share: the small GPT they train, its text, and the
// comparison of a run's steps with another's.
#pragma once

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "test_util.h"

namespace weft::testing {

// Writes the text the runs train on into `dir`; returns the train_gpt flags
// of five steps of an 8-layer GPT on it, on `device`.
inline std::string small_gpt(const std::string& dir, const std::string& device = "cuda") {
  std::string text;
  for (int i = 0; i < 80; ++i) text += "Call me Ishmael. Some years ago, never mind how long. ";
  write_file(dir + "/text.txt", text);
  return "--device " + device + " --num-layers 8 --hidden-size 32 --num-attention-heads 4 "
         "--seq-length 16 --micro-batch-size 2 --global-batch-size 16 --train-iters 5 "
         "--lr 3e-3 --clip-grad 0.5 --comm-timeout 60 --data-path " + dir + "/text.txt";
}

// Each of `got`'s steps against `want`'s from step `first` on (a resumed
// run's against the whole one's): the same step, loss and gradient norm
// within `tol` relative.
inline void expect_steps_close(const std::vector<nlohmann::json>& got,
                               const std::vector<nlohmann::json>& want, size_t first, double tol,
                               const std::string& what) {
  ASSERT_EQ(got.size() + first, want.size()) << what;
  for (size_t k = 0; k < got.size(); ++k) {
    const double loss = want[first + k]["loss"], norm = want[first + k]["grad_norm"];
    EXPECT_EQ(got[k]["step"], want[first + k]["step"]) << what;
    EXPECT_NEAR(got[k]["loss"].get<double>(), loss, tol * loss) << what << ", step " << first + k + 1;
    EXPECT_NEAR(got[k]["grad_norm"].get<double>(), norm, tol * norm)
        << what << ", step " << first + k + 1;
  }
}

}  // namespace weft::testing
