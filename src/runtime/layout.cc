#include <weft/layout.h>
#include <weft/local_communicator.h>
#include <weft/tensor_parallel.h>

namespace weft {

RankLayout::RankLayout(Communicator* world, Graph& logical, ModelIO io, const BatchSource& data,
                       TrainOptions opt, LayoutOptions lo, uint64_t seed, const CostModel* cost)
    : logical_(logical), lo_(std::move(lo)), io_(io) {
  const int size = world ? world->size() : 1;
  const MeshLayout shape(size, lo_.tp, lo_.pp);  // throws naming the rule, before any message
  check(opt.global_batch % (opt.micro_batch * shape.dp()) == 0,
        "--global-batch-size ({}) must be divisible by --micro-batch-size ({}) x data-parallel "
        "size ({})",
        opt.global_batch, opt.micro_batch, shape.dp());
  const int64_t micro_batches = opt.global_batch / (opt.micro_batch * shape.dp());
  // heads, vocabulary, the sequence: before any message
  check_tensor_parallel(logical_, lo_.tp, lo_.sequence_parallel);
  if (world != nullptr) mesh_.emplace(Mesh::build(*world, lo_.tp, lo_.pp));

  // This rank's graph and parameters: each rank starts from its piece of the
  // same full tensors, a function of (seed, name) only.
  if (lo_.tp > 1) {
    tp_graph_ = std::make_unique<Graph>(tensor_parallel_graph(
        logical_, *mesh_->tp, std::make_shared<ParamStore>(), lo_.sequence_parallel));
    io_.graph = tp_graph_.get();
  } else {
    io_.graph = &logical_;
  }
  for (Param* p : graph().param_store().all()) init_param(*p, seed);

  Parallel par;
  par.sync = lo_.sync;
  par.ps = lo_.ps;
  if (mesh_ && lo_.tp > 1) par.groups.tp = mesh_->tp.get();
  if (mesh_ && shape.dp() > 1) par.groups.dp = mesh_->dp.get();
  lo_.pipeline.device = opt.device;  // activations live with the parameters
  const CostModel analytic = cost ? CostModel{} : CostModel::analytic(logical_);
  const CostModel& costs = cost ? *cost : analytic;
  if (lo_.pp == 1) {
    // The whole graph as one stage, on a group of this rank alone: the same
    // executor, and its recompute and trace, at every pp.
    schedule_ = one_stage_schedule(static_cast<int>(micro_batches));
    plan_ = whole_graph_plan(logical_, costs);
    self_ = std::move(make_local_world(1).front());
    pipeline_ =
        std::make_unique<PipelineExecutor>(graph(), io_, plan_, schedule_, *self_, lo_.pipeline);
    par.pipeline = pipeline_.get();
  } else {
    schedule_ = sched::lower(
        sched::make_schedule(lo_.schedule, lo_.pp, static_cast<int>(micro_batches), lo_.chunks));
    PartitionOptions po;
    po.method = lo_.partition;
    po.pp = lo_.pp;
    po.chunks = schedule_.chunks;
    po.stage_rank = schedule_.stage_rank;
    po.in_flight = sched::peak_in_flight(schedule_, lo_.pipeline.recompute);
    po.memory_budget = lo_.memory_budget;
    // The plan is cut on the logical graph: the tensor-parallel form has the
    // same nodes in the same order.
    plan_ = partition(logical_, costs, po);
    pipeline_ = std::make_unique<PipelineExecutor>(graph(), io_, plan_, schedule_, *mesh_->pp,
                                                   lo_.pipeline);
    par.pipeline = pipeline_.get();
  }
  trainer_ = std::make_unique<Trainer>(io_, data, std::move(opt), par);
}

RankLayout::~RankLayout() = default;

}  // namespace weft
