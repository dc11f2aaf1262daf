// mpi_failures <scenario> — a job that fails on purpose, for test_mpi_failures.
// Run under `mpiexec -n 2`; each scenario must end the whole job promptly,
// with a non-zero status and a message that says what went wrong:
//
//   missing-send    rank 1 waits in recv for a message rank 0 never sends (1 s deadline)
//   shape-mismatch  rank 0 sends [2, 3], rank 1 posted a receive for [3, 2]
//   killed-rank     rank 0 dies of SIGKILL while rank 1 waits in recv (60 s deadline)
//   throws          rank 1 throws while rank 0 waits in all_reduce
//   missing-member  (3 ranks) ranks 0 and 1 wait in an all-reduce that rank 2,
//                   busy waiting for a message, never joins (1 s deadline)
//   missing-member-nonblocking  (3 ranks) the same with a posted all-reduce
//                   (iall_reduce, as data-parallel buckets are reduced): ranks 0
//                   and 1 post two and wait for the first
#include <weft/mpi_communicator.h>

#include <csignal>
#include <cstdio>
#include <string>

namespace {

using namespace weft;

int run(Communicator& world, const std::string& scenario) {
  const int want = scenario.starts_with("missing-member") ? 3 : 2;
  check(world.size() == want, "mpi_failures {} runs on {} ranks, not {}", scenario, want,
        world.size());
  const MessageTag tag{MessageTag::Kind::Activation, 3, 0, 0};
  Tensor t = Tensor::zeros({2, 3});
  if (scenario == "missing-send") {
    if (world.rank() == 1) {
      world.set_timeout(std::chrono::seconds(1));
      world.set_step("step 3, action 1F3");
      world.recv(t, 0, tag);
    }
  } else if (scenario == "shape-mismatch") {
    if (world.rank() == 0) world.send(t, 1, tag);
    if (world.rank() == 1) world.recv(Tensor::zeros({3, 2}), 0, tag);
  } else if (scenario == "killed-rank") {
    world.set_timeout(std::chrono::seconds(60));
    if (world.rank() == 0) std::raise(SIGKILL);
    world.recv(t, 0, tag);
  } else if (scenario.starts_with("missing-member")) {
    world.all_reduce(t, ReduceOp::Sum);  // collective #1: every rank
    if (world.rank() == 2) {
      world.set_timeout(std::chrono::seconds(30));
      world.recv(t, 0, tag);  // never sent: rank 2 is elsewhere
    } else if (scenario == "missing-member") {
      world.set_timeout(std::chrono::seconds(1));
      world.all_reduce(t, ReduceOp::Sum);
    } else {  // two posted, as buckets are; the first waited for
      world.set_timeout(std::chrono::seconds(1));
      Tensor u = Tensor::zeros({4});
      RequestPtr first = world.iall_reduce(t, ReduceOp::Sum);   // #2
      RequestPtr second = world.iall_reduce(u, ReduceOp::Sum);  // #3
      first->wait();
    }
  } else if (scenario == "throws") {
    if (world.rank() == 1) throw Error("boom");
    world.all_reduce(t, ReduceOp::Sum);
  } else {
    throw Error("unknown scenario '{}' (missing-send, shape-mismatch, killed-rank, throws, "
                "missing-member)",
                scenario);
  }
  // The surviving rank waits here until the failing one has ended the job.
  world.set_timeout(std::chrono::seconds(60));
  world.barrier();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string scenario = argc > 1 ? argv[1] : "";
  return weft::mpi_main(argc, argv,
                        [&](weft::Communicator& world) { return run(world, scenario); });
}
