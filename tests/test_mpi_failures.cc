// A failing rank ends the whole MPI job quickly, non-zero, with a message
// naming the cause: runs `mpiexec -n 2 mpi_failures <scenario>` per scenario.
#include <gtest/gtest.h>

#include "test_util.h"

#include <sys/wait.h>

#include <chrono>
#include <cstdlib>

namespace weft {
namespace {

using testing::contains;
using testing::read_file;

struct Job {
  int status = -1;  // mpiexec's exit status, -1 when it did not exit normally
  double seconds = 0;
  std::string err;
};

Job run_job(const std::string& scenario, int ranks = 2) {
  const std::string dir = testing::temp_dir("mpi-" + scenario);
  // MPIEXEC_TIMEOUT: should a job hang after all, hydra ends it and the
  // elapsed-time checks fail instead of the test hanging.
  const std::string cmd = "MPIEXEC_TIMEOUT=30 " + std::string(std::getenv("WEFT_MPIEXEC")) +
                          " -n " + std::to_string(ranks) + " " +
                          std::getenv("WEFT_MPI_FAILURES") + " " + scenario + " >" +
                          dir + "/out.txt 2>" + dir + "/err.txt";
  const auto start = std::chrono::steady_clock::now();
  const int raw = std::system(cmd.c_str());
  Job job;
  job.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  job.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  job.err = read_file(dir + "/err.txt") + read_file(dir + "/out.txt");
  return job;
}

class MpiFailures : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::getenv("WEFT_MPIEXEC") || !std::getenv("WEFT_MPI_FAILURES"))
      FAIL() << "WEFT_MPIEXEC and WEFT_MPI_FAILURES name mpiexec and mpi_failures (meson test "
                "sets them)";
  }
};

TEST_F(MpiFailures, MissingSendTimesOutNamingTheWait) {
  Job job = run_job("missing-send");
  EXPECT_NE(job.status, 0) << job.err;
  EXPECT_GE(job.seconds, 1.0) << "the deadline is 1 s";
  EXPECT_LT(job.seconds, 6.0);
  for (const char* part :
       {"rank 1: error: rank 1 (world rank 1) timed out after 1000 ms waiting for recv",
        "from rank 0 (world rank 0)", "tag activation mb 3 chunk 0 #0", "in world",
        "at step 3, action 1F3"})
    EXPECT_TRUE(contains(job.err, part)) << "missing '" << part << "' in:\n" << job.err;
}

// A collective that times out names who never arrived: the members that
// also waited in it answer a roll call, the one busy elsewhere does not.
void expect_rank_2_named(const std::string& scenario) {
  Job job = run_job(scenario, 3);
  EXPECT_NE(job.status, 0) << job.err;
  EXPECT_LT(job.seconds, 10.0) << job.err;
  EXPECT_TRUE(contains(job.err, "timed out after 1000 ms waiting for all_reduce (sum)")) << job.err;
  EXPECT_TRUE(contains(job.err, "never arrived: rank 2 (world rank 2) (no answer within 1 s"))
      << job.err;
  EXPECT_FALSE(contains(job.err, "never arrived: rank 0")) << job.err;
  EXPECT_FALSE(contains(job.err, "never arrived: rank 1")) << job.err;
  EXPECT_FALSE(contains(job.err, "in another collective")) << job.err;
}

TEST_F(MpiFailures, ATimedOutCollectiveNamesTheMemberThatNeverArrived) {
  expect_rank_2_named("missing-member");
}

// The same for a posted collective (data-parallel buckets are reduced this
// way): the members that waited for it hold the roll call, numbering it by
// the group's collectives posted so far (#2), whatever they posted after it.
TEST_F(MpiFailures, ATimedOutPostedCollectiveNamesTheMemberThatNeverArrived) {
  expect_rank_2_named("missing-member-nonblocking");
}

TEST_F(MpiFailures, ShapeMismatchNamesBothShapes) {
  Job job = run_job("shape-mismatch");
  EXPECT_NE(job.status, 0) << job.err;
  EXPECT_LT(job.seconds, 5.0);
  for (const char* part : {"rank 1: error: rank 1 (world rank 1) received F32 [2, 3] from rank 0",
                           "tag activation mb 3 chunk 0 #0", "posted a receive for F32 [3, 2]"})
    EXPECT_TRUE(contains(job.err, part)) << "missing '" << part << "' in:\n" << job.err;
}

TEST_F(MpiFailures, KilledRankEndsTheJob) {
  // Rank 1 would wait 60 s; hydra ends the job as soon as rank 0 dies.
  Job job = run_job("killed-rank");
  EXPECT_NE(job.status, 0) << job.err;
  EXPECT_LT(job.seconds, 5.0) << job.err;
  EXPECT_TRUE(contains(job.err, "KILLED") || contains(job.err, "Killed") ||
              contains(job.err, "signal 9"))
      << job.err;
}

TEST_F(MpiFailures, ThrowingRankEndsTheJob) {
  Job job = run_job("throws");
  EXPECT_NE(job.status, 0) << job.err;
  EXPECT_LT(job.seconds, 5.0);
  EXPECT_TRUE(contains(job.err, "rank 1: error: boom\n")) << job.err;
}

}  // namespace
}  // namespace weft
