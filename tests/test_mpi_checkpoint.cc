// train_gpt under mpiexec: every rank writes its slices of a checkpoint and
// world rank 0 completes it while the others wait, and that wait is bounded by the disk, not by
// --comm-timeout: a healthy job whose saves are slower than the deadline
// trains on and ends well.
#include <weft/checkpoint.h>

#include <gtest/gtest.h>

#include "test_util.h"

#include <chrono>
#include <cstdlib>
#include <string>

#include <sys/wait.h>

namespace weft {
namespace {

// A small GPT over 60 lines of text written into `dir`, on 2 ranks' worth of
// batches, with a 2 s --comm-timeout: the flags, `extra` appended.
std::string small_job(const std::string& dir, const std::string& extra) {
  std::string text;
  for (int i = 0; i < 60; ++i) text += "Call me Ishmael. Some years ago, never mind how long. ";
  testing::write_file(dir + "/text.txt", text);
  return "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
         "--micro-batch-size 2 --global-batch-size 8 --threads 1 --comm-timeout 2 "
         "--train-iters 3 --save " + dir + "/ckpt --data-path " + dir + "/text.txt " + extra;
}

TEST(MpiCheckpoint, SavesSlowerThanTheCommTimeoutAreNoFailure) {
  ASSERT_NE(std::getenv("WEFT_MPIEXEC"), nullptr) << "meson test sets WEFT_MPIEXEC";
  const std::string dir = testing::temp_dir("mpi-slow-save");
  // Each save sleeps twice the deadline before it writes.
  ::setenv("WEFT_FAULT_INJECT", "slow-save:4000", 1);
  const auto start = std::chrono::steady_clock::now();
  const testing::TrainRun run = testing::run_train_gpt(2, small_job(dir, "--save-interval 2"), dir);
  ::unsetenv("WEFT_FAULT_INJECT");
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_TRUE(run.ok) << run.command << "\n" << run.output;
  EXPECT_GE(seconds, 8.0) << "two saves of 4 s each";
  EXPECT_EQ(testing::count(run.output, "saved checkpoint at step"), 2) << run.output;
  EXPECT_EQ(run.records.size(), 3u) << run.output;  // step 3 trained after the first save
  const CheckpointSource scan = scan_checkpoints(dir + "/ckpt");
  EXPECT_EQ(scan.step, 3);
  EXPECT_TRUE(scan.verified);
}

// A save that never finishes (the writer stuck on its disk) is no hang: the
// ranks waiting for it stop past --save-timeout, naming the save and its
// writer, and the job ends non-zero.
TEST(MpiCheckpoint, ASaveStuckPastTheSaveTimeoutEndsTheJobNamingIt) {
  ASSERT_NE(std::getenv("WEFT_MPIEXEC"), nullptr) << "meson test sets WEFT_MPIEXEC";
  const std::string dir = testing::temp_dir("mpi-stuck-save");
  ::setenv("WEFT_FAULT_INJECT", "slow-save:30000", 1);
  const auto start = std::chrono::steady_clock::now();
  const testing::TrainRun run = testing::run_train_gpt(2, small_job(dir, "--save-timeout 1"), dir);
  ::unsetenv("WEFT_FAULT_INJECT");
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_FALSE(run.ok) << run.output;
  EXPECT_LT(seconds, 25.0) << "the ranks waited for the whole stuck save";
  EXPECT_TRUE(testing::contains(run.output, "rank 1: error: the save of step 3 to " + dir +
                                                "/ckpt did not finish within --save-timeout 1 s "
                                                "(every rank writes its slices, then world rank 0 "
                                                "completes the folder"))
      << run.output;
}

// A rank that never joins at start-up (here: one that sleeps before it
// starts) leaves the others inside MPI's initialisation, which has no
// deadline of its own: they stop past --comm-timeout, saying why, and the
// job ends.
TEST(MpiStartup, ARankThatNeverJoinsIsNoSilentHang) {
  ASSERT_NE(std::getenv("WEFT_MPIEXEC"), nullptr) << "meson test sets WEFT_MPIEXEC";
  const std::string dir = testing::temp_dir("mpi-startup");
  testing::write_file(dir + "/text.txt", std::string(2000, 'a'));
  const std::string exe = std::getenv("WEFT_TRAIN_GPT");
  const std::string flags = " --num-layers 1 --hidden-size 16 --num-attention-heads 2 "
                            "--seq-length 8 --micro-batch-size 2 --global-batch-size 4 "
                            "--train-iters 1 --comm-timeout 2 --device cpu "
                            "--data-path " + dir + "/text.txt";
  // MPMD: rank 0 starts at once, rank 1 only after 30 s.
  const std::string cmd = std::string(std::getenv("WEFT_MPIEXEC")) + " -n 1 " + exe + flags +
                          " : -n 1 sh -c 'sleep 30; exec " + exe + flags + "' >" + dir +
                          "/out.txt 2>&1";
  const auto start = std::chrono::steady_clock::now();
  const int status = std::system(cmd.c_str());
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const std::string out = testing::read_file(dir + "/out.txt");
  EXPECT_FALSE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out;
  EXPECT_LT(seconds, 25.0) << out;
  EXPECT_TRUE(testing::contains(out, "rank 0 (host ") &&
              testing::contains(out, "error: MPI start-up did not finish within --comm-timeout "
                                     "2 s: a rank of the 2 never joined"))
      << out;
}

}  // namespace
}  // namespace weft
