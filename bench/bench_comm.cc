// bench_comm — MpiCommunicator against raw MPI in the same job, as markdown.
//
//   mpiexec -n 2 bench_comm    # ping-pong 8 B .. 64 MiB, and all_reduce on 2 ranks
//   mpiexec -n 8 bench_comm    # all_reduce on 8 ranks
//   bench/comm.sh build        # both, for 2, 4 and 8 ranks
//
// Raw MPI uses blocking MPI_Send/MPI_Recv/MPI_Allreduce, which busy-wait;
// weft posts non-blocking operations and polls. Rounds of the two alternate,
// so drift on a shared machine hits both alike, and the table reports the
// median call (rank 0's clock): a rank descheduled for a few milliseconds by
// another process moves a mean, not the median.
#include <weft/mpi_communicator.h>

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

namespace {

using namespace weft;
using Clock = std::chrono::steady_clock;

constexpr int kRounds = 7;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::string size_str(int64_t bytes) {
  if (bytes >= (1 << 20)) return fmt::format("{} MiB", bytes >> 20);
  if (bytes >= (1 << 10)) return fmt::format("{} KiB", bytes >> 10);
  return fmt::format("{} B", bytes);
}

// Iterations for about `budget` seconds of an operation that took `once` s,
// decided by rank 0 so every rank runs the same count.
int iterations(Communicator& world, double once, double budget, int most) {
  Tensor n = Tensor::empty({1}, DType::I32);
  n.data<int32_t>()[0] =
      static_cast<int32_t>(std::clamp(budget / std::max(once, 1e-7), 3.0, double(most)));
  world.broadcast(n, 0);
  return n.data<int32_t>()[0];
}

// Appends the seconds each of `iters` calls of fn took on this rank; returns
// their mean. Barriers around keep the rounds of raw MPI and weft apart.
template <typename F>
double timed(Communicator& world, int iters, F&& fn, std::vector<double>* samples = nullptr) {
  world.barrier();
  const auto start = Clock::now();
  auto last = start;
  for (int i = 0; i < iters; ++i) {
    fn();
    const auto now = Clock::now();
    if (samples) samples->push_back(std::chrono::duration<double>(now - last).count());
    last = now;
  }
  world.barrier();
  return std::chrono::duration<double>(last - start).count() / iters;
}

void ping_pong(Communicator& world) {
  const int me = world.rank();
  const MessageTag tag{MessageTag::Kind::Activation, 0, 0, 0};
  if (me == 0) {
    std::printf(
        "## Ping-pong, 2 ranks: one-way time (round trip / 2), median of %d rounds of calls\n\n",
        kRounds);
    std::printf("| size | MPI us | weft us | MPI GB/s | weft GB/s | weft / MPI |\n");
    std::printf("|---:|---:|---:|---:|---:|---:|\n");
  }
  const int64_t KiB = 1024, MiB = KiB * KiB;
  for (int64_t b : {int64_t{8}, int64_t{64}, int64_t{512}, 4 * KiB, 32 * KiB, 64 * KiB, 256 * KiB,
                    MiB, 4 * MiB, 16 * MiB, 64 * MiB}) {
    const int n = static_cast<int>(b / 4);
    Tensor buf = Tensor::zeros({n});
    auto raw = [&] {
      if (me == 0) {
        MPI_Send(buf.raw(), n, MPI_FLOAT, 1, 0, MPI_COMM_WORLD);
        MPI_Recv(buf.raw(), n, MPI_FLOAT, 1, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      } else if (me == 1) {
        MPI_Recv(buf.raw(), n, MPI_FLOAT, 0, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        MPI_Send(buf.raw(), n, MPI_FLOAT, 0, 0, MPI_COMM_WORLD);
      }
    };
    auto weft = [&] {
      if (me == 0) {
        world.send(buf, 1, tag);
        world.recv(buf, 1, tag);
      } else if (me == 1) {
        world.recv(buf, 0, tag);
        world.send(buf, 0, tag);
      }
    };
    const double once = std::max(timed(world, 3, raw), timed(world, 3, weft));
    const int iters = iterations(world, once, 0.08, 20000);
    std::vector<double> t_raw, t_weft;
    for (int round = 0; round < kRounds; ++round) {
      timed(world, iters, raw, &t_raw);
      timed(world, iters, weft, &t_weft);
    }
    if (me == 0) {
      const double r = median(t_raw) / 2, w = median(t_weft) / 2;
      std::printf("| %s | %.2f | %.2f | %.3f | %.3f | %.3f |\n", size_str(b).c_str(), r * 1e6,
                  w * 1e6, double(b) / r * 1e-9, double(b) / w * 1e-9, w / r);
    }
  }
  if (me == 0) std::printf("\n");
}

void all_reduce(Communicator& world) {
  const int size = world.size();
  if (world.rank() == 0) {
    std::printf("## all_reduce (sum, F32), %d ranks, median of %d rounds of calls\n\n", size,
                kRounds);
    std::printf("| elements | bytes | MPI_Allreduce ms | weft ms | weft / MPI |\n");
    std::printf("|---:|---:|---:|---:|---:|\n");
  }
  for (int64_t n : {int64_t{1}, int64_t{1024}, int64_t{65536}, int64_t{1} << 20}) {
    Tensor buf = Tensor::zeros({n});
    const int count = static_cast<int>(n);
    auto raw = [&] {
      MPI_Allreduce(MPI_IN_PLACE, buf.raw(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    };
    auto weft = [&] { world.all_reduce(buf, ReduceOp::Sum); };
    const double once = std::max(timed(world, 2, raw), timed(world, 2, weft));
    const int iters = iterations(world, once, 0.15, 5000);
    std::vector<double> t_raw, t_weft;
    for (int round = 0; round < kRounds; ++round) {
      timed(world, iters, raw, &t_raw);
      timed(world, iters, weft, &t_weft);
    }
    if (world.rank() == 0) {
      const double r = median(t_raw), w = median(t_weft);
      std::printf("| %lld | %s | %.3f | %.3f | %.3f |\n", static_cast<long long>(n),
                  size_str(n * 4).c_str(), r * 1e3, w * 1e3, w / r);
    }
  }
  if (world.rank() == 0) std::printf("\n");
}

}  // namespace

int main(int argc, char** argv) {
  return weft::mpi_main(argc, argv, [](weft::Communicator& world) {
    if (world.size() == 2) ping_pong(world);
    all_reduce(world);
    std::fflush(stdout);
    return 0;
  });
}
