// weft/mesh.h — the dp x pp x tp layout of ranks, and its communicators.
//
// world = tp x dp x pp, laid out as Megatron does:
//   rank = tp_rank + tp * (dp_rank + dp * pp_rank)
// so a tensor-parallel group is a block of consecutive ranks (one node).
// Worked example, world 8 with tp = 2, pp = 2 (dp = 2):
//   TP groups [0, 1] [2, 3] [4, 5] [6, 7]
//   DP groups [0, 2] [1, 3] [4, 6] [5, 7]
//   PP groups [0, 4] [1, 5] [2, 6] [3, 7]
#pragma once

#include <weft/communicator.h>

#include <memory>
#include <string>
#include <vector>

namespace weft {

struct MeshCoord {
  int tp = 0, dp = 0, pp = 0;
  bool operator==(const MeshCoord&) const = default;
};

class MeshLayout {
 public:
  // Throws Error naming the rule when world is not divisible by tp x pp, or a
  // size is not positive. Pure arithmetic: call it before any communication.
  MeshLayout(int world, int tp, int pp);

  int world() const { return world_; }
  int tp() const { return tp_; }
  int dp() const { return dp_; }
  int pp() const { return pp_; }

  MeshCoord coord(int rank) const;
  int rank(MeshCoord c) const;
  // Every group of each kind, as world ranks; together a partition of the world.
  std::vector<std::vector<int>> tp_groups() const;
  std::vector<std::vector<int>> dp_groups() const;
  std::vector<std::vector<int>> pp_groups() const;
  // "world 8 = tp 2 x dp 2 x pp 2" plus the groups, for rank 0 to print.
  std::string describe() const;

 private:
  std::vector<std::vector<int>> groups_along(int axis) const;
  int world_, tp_, dp_, pp_;
};

// This rank's communicators for the layout.
struct Mesh {
  MeshLayout layout;
  MeshCoord coord;
  std::unique_ptr<Communicator> tp, dp, pp;

  // Collective over `world` (every rank calls it).
  static Mesh build(Communicator& world, int tp, int pp);
};

// How this process was launched: rank, size, and its rank among the ranks on
// this node (which picks its GPU, as LOCAL_RANK does for torchrun), from the
// launcher's environment (MPICH/hydra PMI_* and MPI_LOCAL*, Open MPI
// OMPI_COMM_WORLD_*, Slurm SLURM_*); a lone process is rank 0 of 1.
struct LaunchInfo {
  int rank = 0;
  int size = 1;
  int local_rank = 0;
  int local_size = 1;
  std::string launcher = "none";  // "mpiexec", "srun", "none"
};
LaunchInfo detect_launch();

// How ranks on GPUs move device tensors (train_gpt --comm-backend).
enum class DeviceTransport : uint8_t {
  None,        // one process: nothing to move
  HostStaged,  // pinned copies and MPI (HostStagedCommunicator)
  Nccl,        // NCCL, bootstrapped over MPI (nccl_world)
};
// For `backend` auto, mpi or nccl, a job of `world` ranks, `local_size` of
// them on this node, which has `gpus` GPUs. NCCL refuses two ranks on one
// GPU, so when ranks share one, auto and mpi stage through the host and nccl
// is refused; when each rank has its own, auto and nccl choose NCCL and mpi
// stages. `ranks_as_hosts` (WEFT_NCCL_ONE_GPU=1, nccl_ranks_as_hosts()):
// each rank is its own NCCL host, so nccl is taken even while ranks share a
// GPU (auto still stages). Throws Error with one line naming the values and
// the rule.
DeviceTransport choose_device_transport(const std::string& backend, int world, int local_size,
                                        int gpus, bool ranks_as_hosts = false);

}  // namespace weft
