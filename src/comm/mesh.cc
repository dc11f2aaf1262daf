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

std::vector<std::vector<int>> MeshLayout::tp_groups() const {
  std::vector<std::vector<int>> g;
  for (int pp = 0; pp < pp_; ++pp)
    for (int dp = 0; dp < dp_; ++dp) {
      g.emplace_back();
      for (int tp = 0; tp < tp_; ++tp) g.back().push_back(rank({tp, dp, pp}));
    }
  return g;
}

std::vector<std::vector<int>> MeshLayout::dp_groups() const {
  std::vector<std::vector<int>> g;
  for (int pp = 0; pp < pp_; ++pp)
    for (int tp = 0; tp < tp_; ++tp) {
      g.emplace_back();
      for (int dp = 0; dp < dp_; ++dp) g.back().push_back(rank({tp, dp, pp}));
    }
  return g;
}

std::vector<std::vector<int>> MeshLayout::pp_groups() const {
  std::vector<std::vector<int>> g;
  for (int dp = 0; dp < dp_; ++dp)
    for (int tp = 0; tp < tp_; ++tp) {
      g.emplace_back();
      for (int pp = 0; pp < pp_; ++pp) g.back().push_back(rank({tp, dp, pp}));
    }
  return g;
}

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
int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  long n = std::strtol(v, &end, 10);
  return (end && *end == '\0' && n >= 0) ? static_cast<int>(n) : fallback;
}
}  // namespace

LaunchInfo detect_launch() {
  LaunchInfo info;
  if (std::getenv("PMI_RANK") != nullptr) {  // MPICH hydra
    info.rank = env_int("PMI_RANK", 0);
    info.size = env_int("PMI_SIZE", 1);
    info.local_size = env_int("MPI_LOCALNRANKS", info.size);
    info.launcher = "mpiexec";
  } else if (std::getenv("OMPI_COMM_WORLD_RANK") != nullptr) {
    info.rank = env_int("OMPI_COMM_WORLD_RANK", 0);
    info.size = env_int("OMPI_COMM_WORLD_SIZE", 1);
    info.local_size = env_int("OMPI_COMM_WORLD_LOCAL_SIZE", info.size);
    info.launcher = "mpiexec";
  } else if (std::getenv("SLURM_PROCID") != nullptr) {
    info.rank = env_int("SLURM_PROCID", 0);
    info.size = env_int("SLURM_NTASKS", 1);
    info.local_size = env_int("SLURM_NTASKS_PER_NODE", env_int("SLURM_TASKS_PER_NODE", 1));
    info.launcher = "srun";
  }
  return info;
}

}  // namespace weft
