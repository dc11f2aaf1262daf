#include <weft/mesh.h>

#include <fmt/ranges.h>

#include <cstdlib>

namespace weft {

MeshLayout::MeshLayout(int world, int tp, int pp) : world_(world), tp_(tp), dp_(0), pp_(pp) {
  check(world > 0, "world size ({}) must be positive", world);
  check(tp > 0, "tensor-parallel size ({}) must be positive", tp);
  check(pp > 0, "pipeline-parallel size ({}) must be positive", pp);
  check(world % (tp * pp) == 0,
        "world size ({}) must be divisible by tensor-parallel size ({}) x pipeline-parallel "
        "size ({}) = {}",
        world, tp, pp, tp * pp);
  dp_ = world / (tp * pp);
}

MeshCoord MeshLayout::coord(int r) const {
  check(r >= 0 && r < world_, "rank {} is outside the world [0, {})", r, world_);
  return MeshCoord{r % tp_, (r / tp_) % dp_, r / (tp_ * dp_)};
}

int MeshLayout::rank(MeshCoord c) const { return c.tp + tp_ * (c.dp + dp_ * c.pp); }

// Ranks that differ only along `axis` (0 tp, 1 dp, 2 pp), one group per
// value of the other two axes, the higher axis outermost.
std::vector<std::vector<int>> MeshLayout::groups_along(int axis) const {
  const int size[3] = {tp_, dp_, pp_};
  const int inner = axis == 0 ? 1 : 0, outer = axis == 2 ? 1 : 2;
  std::vector<std::vector<int>> g;
  for (int o = 0; o < size[outer]; ++o)
    for (int i = 0; i < size[inner]; ++i) {
      g.emplace_back();
      for (int a = 0; a < size[axis]; ++a) {
        int c[3] = {0, 0, 0};
        c[outer] = o, c[inner] = i, c[axis] = a;
        g.back().push_back(rank({c[0], c[1], c[2]}));
      }
    }
  return g;
}

std::vector<std::vector<int>> MeshLayout::tp_groups() const { return groups_along(0); }
std::vector<std::vector<int>> MeshLayout::dp_groups() const { return groups_along(1); }
std::vector<std::vector<int>> MeshLayout::pp_groups() const { return groups_along(2); }

namespace {
std::string groups_str(const std::vector<std::vector<int>>& groups) {
  std::string s;
  for (const auto& g : groups) s += fmt::format(" [{}]", fmt::join(g, ", "));
  return s;
}
}  // namespace

std::string MeshLayout::describe() const {
  return fmt::format("world {} = tp {} x dp {} x pp {} | TP groups{} | DP groups{} | PP groups{}",
                     world_, tp_, dp_, pp_, groups_str(tp_groups()), groups_str(dp_groups()),
                     groups_str(pp_groups()));
}

Mesh Mesh::build(Communicator& world, int tp, int pp) {
  MeshLayout layout(world.size(), tp, pp);
  Mesh m{layout, layout.coord(world.rank()), nullptr, nullptr, nullptr};
  m.tp = world.split(layout.tp_groups(), "tp");
  m.dp = world.split(layout.dp_groups(), "dp");
  m.pp = world.split(layout.pp_groups(), "pp");
  return m;
}

namespace {
// The variable's number; `fallback` when unset or not one. With `leading`,
// only its leading number counts: Slurm writes tasks per node as "4(x2),3".
int env_int(const char* name, int fallback, bool leading = false) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  long n = std::strtol(v, &end, 10);
  return (end && end != v && (leading || *end == '\0') && n >= 0) ? static_cast<int>(n)
                                                                  : fallback;
}
}  // namespace

LaunchInfo detect_launch() {
  LaunchInfo info;
  if (std::getenv("PMI_RANK") != nullptr) {  // MPICH hydra
    info.rank = env_int("PMI_RANK", 0);
    info.size = env_int("PMI_SIZE", 1);
    info.local_rank = env_int("MPI_LOCALRANKID", info.rank);
    info.local_size = env_int("MPI_LOCALNRANKS", info.size);
    info.launcher = "mpiexec";
  } else if (std::getenv("OMPI_COMM_WORLD_RANK") != nullptr) {
    info.rank = env_int("OMPI_COMM_WORLD_RANK", 0);
    info.size = env_int("OMPI_COMM_WORLD_SIZE", 1);
    info.local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK", info.rank);
    info.local_size = env_int("OMPI_COMM_WORLD_LOCAL_SIZE", info.size);
    info.launcher = "mpiexec";
  } else if (std::getenv("SLURM_PROCID") != nullptr) {
    info.rank = env_int("SLURM_PROCID", 0);
    info.size = env_int("SLURM_NTASKS", 1);
    info.local_rank = env_int("SLURM_LOCALID", 0);
    info.local_size = env_int("SLURM_NTASKS_PER_NODE",
                              env_int("SLURM_STEP_TASKS_PER_NODE",
                                      env_int("SLURM_TASKS_PER_NODE", 1, true), true));
    info.launcher = "srun";
  }
  return info;
}

DeviceTransport choose_device_transport(const std::string& backend, int world, int local_size,
                                        int gpus, bool ranks_as_hosts) {
  check(backend == "auto" || backend == "mpi" || backend == "nccl",
        "--comm-backend '{}' must be auto, mpi or nccl", backend);
  check(gpus > 0, "choosing how ranks on GPUs talk, but no GPU is visible");
  if (world == 1) return DeviceTransport::None;
  const bool sharing = local_size > gpus;
  if (backend == "nccl" && ranks_as_hosts) return DeviceTransport::Nccl;
  check(backend != "nccl" || !sharing,
        "--comm-backend nccl: {} ranks on this node share {} GPU{}, and NCCL refuses two "
        "ranks on one GPU; use --comm-backend mpi, which stages tensors through the host (or, "
        "for testing NCCL on one GPU, WEFT_NCCL_ONE_GPU=1: each rank its own NCCL host, over "
        "sockets)",
        local_size, gpus, gpus == 1 ? "" : "s");
  return sharing || backend == "mpi" ? DeviceTransport::HostStaged : DeviceTransport::Nccl;
}

}  // namespace weft
