// The dp x pp x tp layout: Megatron's rank formula, groups, errors, and the
// communicators Mesh::build makes.
#include <weft/local_communicator.h>
#include <weft/mesh.h>

#include <gtest/gtest.h>

#include "test_util.h"

#include <algorithm>
#include <cstdlib>
#include <set>

namespace weft {
namespace {

using G = std::vector<std::vector<int>>;

TEST(MeshLayout, WorkedExampleFromTheDesign) {
  MeshLayout m(8, 2, 2);
  EXPECT_EQ(m.dp(), 2);
  EXPECT_EQ(m.tp_groups(), (G{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(m.dp_groups(), (G{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(m.pp_groups(), (G{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(m.coord(5), (MeshCoord{1, 0, 1}));
  EXPECT_NE(m.describe().find("world 8 = tp 2 x dp 2 x pp 2"), std::string::npos);
}

TEST(MeshLayout, EveryLayoutOfEightIsAConsistentPartition) {
  for (int tp : {1, 2, 4, 8})
    for (int pp : {1, 2, 4, 8}) {
      if (8 % (tp * pp) != 0) continue;
      MeshLayout m(8, tp, pp);
      for (int r = 0; r < 8; ++r) {
        MeshCoord c = m.coord(r);
        EXPECT_EQ(m.rank(c), r);
        EXPECT_EQ(r, c.tp + tp * (c.dp + m.dp() * c.pp));
      }
      for (const G& groups : {m.tp_groups(), m.dp_groups(), m.pp_groups()}) {
        std::multiset<int> seen;
        for (const auto& g : groups) seen.insert(g.begin(), g.end());
        EXPECT_EQ(seen.size(), 8u);
        for (int r = 0; r < 8; ++r) EXPECT_EQ(seen.count(r), 1u);
      }
      // A TP group is consecutive ranks; members of a PP group differ only in pp.
      for (const auto& g : m.tp_groups())
        for (size_t i = 1; i < g.size(); ++i) EXPECT_EQ(g[i], g[i - 1] + 1);
      for (const auto& g : m.pp_groups())
        for (size_t i = 0; i < g.size(); ++i) EXPECT_EQ(m.coord(g[i]).pp, static_cast<int>(i));
    }
}

TEST(MeshLayout, ImpossibleLayoutsNameTheRule) {
  EXPECT_PRED2(testing::contains, testing::error_message([] { MeshLayout(6, 4, 1); }),
               "world size (6) must be divisible by tensor-parallel size (4) x pipeline-parallel "
               "size (1) = 4");
  EXPECT_PRED2(testing::contains, testing::error_message([] { MeshLayout(8, 0, 1); }),
               "tensor-parallel size (0)");
  EXPECT_PRED2(testing::contains, testing::error_message([] { MeshLayout(8, 1, -2); }),
               "pipeline-parallel size (-2)");
}

TEST(Mesh, BuildsGroupsThatTalkOnlyAmongThemselves) {
  run_local(8, [](Communicator& world) {
    Mesh mesh = Mesh::build(world, 2, 2);
    EXPECT_EQ(mesh.tp->size(), 2);
    EXPECT_EQ(mesh.dp->size(), 2);
    EXPECT_EQ(mesh.pp->size(), 2);
    EXPECT_EQ(mesh.tp->rank(), mesh.coord.tp);
    EXPECT_EQ(mesh.pp->rank(), mesh.coord.pp);
    // Sum of world ranks over each group equals the layout's groups.
    for (auto [comm, groups] : {std::pair{mesh.tp.get(), mesh.layout.tp_groups()},
                                std::pair{mesh.dp.get(), mesh.layout.dp_groups()},
                                std::pair{mesh.pp.get(), mesh.layout.pp_groups()}}) {
      Tensor t = Tensor::empty({1});
      t.data<float>()[0] = static_cast<float>(world.rank());
      comm->all_reduce(t, ReduceOp::Sum);
      int want = -1;
      for (const auto& g : groups)
        if (std::find(g.begin(), g.end(), world.rank()) != g.end()) {
          want = 0;
          for (int r : g) want += r;
        }
      EXPECT_EQ(t.data<float>()[0], static_cast<float>(want)) << comm->describe();
    }
  });
}

TEST(Launch, ReadsTheLauncherEnvironment) {
  ::unsetenv("PMI_RANK");
  ::unsetenv("OMPI_COMM_WORLD_RANK");
  ::unsetenv("SLURM_PROCID");
  EXPECT_EQ(detect_launch().launcher, "none");
  ::setenv("SLURM_PROCID", "3", 1);
  ::setenv("SLURM_NTASKS", "8", 1);
  ::setenv("SLURM_NTASKS_PER_NODE", "4", 1);
  LaunchInfo s = detect_launch();
  EXPECT_EQ(s.launcher, "srun");
  EXPECT_EQ(s.rank, 3);
  EXPECT_EQ(s.size, 8);
  EXPECT_EQ(s.local_size, 4);
  EXPECT_EQ(s.local_rank, 0);
  // Without the per-node count, Slurm's step layout "3(x2),2": 3 on this node.
  ::unsetenv("SLURM_NTASKS_PER_NODE");
  ::setenv("SLURM_STEP_TASKS_PER_NODE", "3(x2),2", 1);
  ::setenv("SLURM_LOCALID", "2", 1);
  s = detect_launch();
  EXPECT_EQ(s.local_size, 3);
  EXPECT_EQ(s.local_rank, 2);
  ::setenv("PMI_RANK", "5", 1);  // hydra wins when both are present (srun --mpi=pmi2)
  ::setenv("PMI_SIZE", "8", 1);
  ::setenv("MPI_LOCALNRANKS", "4", 1);
  ::setenv("MPI_LOCALRANKID", "1", 1);
  LaunchInfo h = detect_launch();
  EXPECT_EQ(h.launcher, "mpiexec");
  EXPECT_EQ(h.rank, 5);
  EXPECT_EQ(h.size, 8);
  EXPECT_EQ(h.local_rank, 1);
  EXPECT_EQ(h.local_size, 4);
  for (const char* v : {"PMI_RANK", "PMI_SIZE", "MPI_LOCALNRANKS", "MPI_LOCALRANKID",
                        "SLURM_PROCID", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE",
                        "SLURM_STEP_TASKS_PER_NODE", "SLURM_LOCALID"})
    ::unsetenv(v);
  ::setenv("OMPI_COMM_WORLD_RANK", "3", 1);
  ::setenv("OMPI_COMM_WORLD_SIZE", "4", 1);
  ::setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1", 1);
  ::setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2", 1);
  LaunchInfo o = detect_launch();
  EXPECT_EQ(o.launcher, "mpiexec");
  EXPECT_EQ(o.rank, 3);
  EXPECT_EQ(o.local_rank, 1);
  EXPECT_EQ(o.local_size, 2);
  for (const char* v : {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                        "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"})
    ::unsetenv(v);
}

}  // namespace
// train_gpt --comm-backend on GPUs: NCCL when each rank has its own GPU,
// the host-staged path when ranks share one, and nccl refused then.
TEST(DeviceTransport, NcclWhenEachRankHasItsOwnGpu) {
  EXPECT_EQ(choose_device_transport("auto", 1, 1, 1), DeviceTransport::None);
  EXPECT_EQ(choose_device_transport("auto", 4, 4, 4), DeviceTransport::Nccl);
  EXPECT_EQ(choose_device_transport("nccl", 4, 4, 8), DeviceTransport::Nccl);
  EXPECT_EQ(choose_device_transport("mpi", 4, 4, 4), DeviceTransport::HostStaged);
  // Two nodes of 2 ranks, each node with 2 GPUs.
  EXPECT_EQ(choose_device_transport("auto", 4, 2, 2), DeviceTransport::Nccl);
}

// WEFT_NCCL_ONE_GPU=1: each rank its own NCCL host, so --comm-backend nccl
// runs while ranks share a GPU; auto and mpi still stage through the host.
TEST(DeviceTransport, RanksAsNcclHostsTakeNcclOnOneGpu) {
  EXPECT_EQ(choose_device_transport("nccl", 4, 4, 1, true), DeviceTransport::Nccl);
  EXPECT_EQ(choose_device_transport("auto", 4, 4, 1, true), DeviceTransport::HostStaged);
  EXPECT_EQ(choose_device_transport("mpi", 2, 2, 1, true), DeviceTransport::HostStaged);
  EXPECT_EQ(choose_device_transport("nccl", 1, 1, 1, true), DeviceTransport::None);
}

TEST(DeviceTransport, HostStagedWhenRanksShareAGpu) {
  EXPECT_EQ(choose_device_transport("auto", 4, 4, 1), DeviceTransport::HostStaged);
  EXPECT_EQ(choose_device_transport("mpi", 8, 8, 2), DeviceTransport::HostStaged);
  const std::string e = testing::error_message([] { choose_device_transport("nccl", 4, 4, 1); });
  EXPECT_TRUE(testing::contains(e, "--comm-backend nccl: 4 ranks on this node share 1 GPU, and "
                                   "NCCL refuses two ranks on one GPU"))
      << e;
  const std::string two = testing::error_message([] { choose_device_transport("nccl", 3, 3, 2); });
  EXPECT_TRUE(testing::contains(two, "3 ranks on this node share 2 GPUs")) << two;
  const std::string bad = testing::error_message([] { choose_device_transport("gloo", 2, 2, 2); });
  EXPECT_TRUE(testing::contains(bad, "--comm-backend 'gloo' must be auto, mpi or nccl")) << bad;
}

}  // namespace weft
