// weft/layout.h — one rank of a dp x pp x tp layout, assembled.
//
// The steps every caller (train_gpt, the tests, the benches) would otherwise
// repeat: build the mesh's communicators, instantiate the logical graph's
// tensor-parallel form for this rank, initialise its parameters from the
// seed (each rank its piece of the same full tensors), cut the graph into
// pipeline stages, lower the schedule, and hand it all to a Trainer.
//
//   RankLayout rank(&world, model.graph, model.io, batches, train_options,
//                   {.tp = 2, .pp = 2, .schedule = "1f1b"}, seed);
//   StepRecord r = rank.trainer().train_step();
#pragma once

#include <weft/mesh.h>
#include <weft/partition.h>
#include <weft/pipeline.h>
#include <weft/schedule.h>
#include <weft/trainer.h>

#include <memory>
#include <optional>
#include <string>

namespace weft {

struct LayoutOptions {
  int tp = 1, pp = 1;  // dp = world / (tp x pp)
  // Megatron's --sequence-parallel: outside the tensor-parallel regions each
  // tp rank holds 1/tp of the tokens (weft/tensor_parallel.h); tp > 1.
  bool sequence_parallel = false;
  std::string schedule = "1f1b";
  int chunks = 1;      // virtual stages per pipeline rank
  PartitionMethod partition = PartitionMethod::Uniform;
  double memory_budget = 0;  // bytes per rank for the partitioner; 0 = unlimited
  PipelineOptions pipeline;
  GradSyncOptions sync;
  PsWorker* ps = nullptr;  // a parameter-server worker (Parallel::ps)
};

class RankLayout {
 public:
  // Collective over `world` (null: one process). `logical` (the model as
  // models/ builds it) must outlive this; with tp = 1 it is the graph this
  // rank runs. `cost` prices nodes for the partitioner (null: analytic).
  RankLayout(Communicator* world, Graph& logical, ModelIO io, const BatchSource& data,
             TrainOptions opt, LayoutOptions lo, uint64_t seed, const CostModel* cost = nullptr);
  ~RankLayout();

  const LayoutOptions& options() const { return lo_; }
  // Null on one process.
  const Mesh* mesh() const { return mesh_ ? &*mesh_ : nullptr; }
  MeshCoord coord() const { return mesh_ ? mesh_->coord : MeshCoord{}; }
  // The graph this rank runs (the logical one, or its tensor-parallel form).
  Graph& graph() { return tp_graph_ ? *tp_graph_ : logical_; }
  ModelIO io() const { return io_; }
  // The executor of this rank's stages; at pp 1 the whole graph is one stage.
  PipelineExecutor* pipeline() { return pipeline_.get(); }
  const sched::Schedule& schedule() const { return schedule_; }
  const StagePlan& plan() const { return plan_; }
  Trainer& trainer() { return *trainer_; }

 private:
  Graph& logical_;
  LayoutOptions lo_;
  std::optional<Mesh> mesh_;
  std::unique_ptr<Graph> tp_graph_;
  ModelIO io_;
  sched::Schedule schedule_;
  StagePlan plan_;
  std::unique_ptr<Communicator> self_;  // pp 1: the one-stage pipeline's group
  std::unique_ptr<PipelineExecutor> pipeline_;
  std::unique_ptr<Trainer> trainer_;
};

}  // namespace weft
