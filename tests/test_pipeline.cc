// Pipelines train the same model: every schedule, on LocalCommunicator
// threads, gives the single-process losses and gradient norms step for step,
// and holds exactly the memory its schedule's model predicts.
#include <gtest/gtest.h>
#include <weft/layout.h>
#include <weft/local_communicator.h>
#include <weft/partition.h>
#include <weft/pipeline.h>
#include <weft/profile.h>
#include <weft/schedule.h>
#include <weft/trainer.h>

#include <chrono>
#include <mutex>
#include <thread>

#include "models/gpt.h"
#include "models/mlp.h"
#include "test_util.h"

namespace weft {
namespace {

constexpr int kSteps = 5;

TokenData text_data() { return testing::best_of_times_tokens(60); }

GptConfig config(int layers, bool skip) {
  GptConfig c;
  c.num_layers = layers, c.hidden_size = 32, c.num_heads = 4, c.seq_length = 16;
  c.embedding_skip = skip;
  return c;
}

TrainOptions options(int64_t micro, int64_t global) {
  TrainOptions o;
  o.micro_batch = micro;
  o.global_batch = global;
  o.lr.lr = 3e-3f;
  o.adam.weight_decay = 0.1f;
  o.clip_grad = 0.5;  // active: the norm starts above it
  return o;
}

struct Losses {
  std::vector<double> loss, norm;
};

Losses single_process(const GptConfig& cfg, int64_t micro, int64_t global, const TokenData& data) {
  TokenBatches batches(data, global, cfg.seq_length);
  GptModel m = build_gpt(cfg, micro);
  init_gpt(m, 42);
  Trainer t(m.io, batches, options(micro, global));
  Losses r;
  for (int s = 0; s < kSteps; ++s) {
    StepRecord rec = t.train_step();
    r.loss.push_back(rec.loss);
    r.norm.push_back(rec.grad_norm);
  }
  return r;
}

struct Case {
  std::string schedule;
  int pp;
  int chunks;
  bool skip = false;
  bool recompute = false;
  bool receives_ahead = false;
  // Megatron's recompute over blocks, with this many blocks per stage.
  RecomputeMethod method = RecomputeMethod::None;
  int recompute_layers = 1;
  int blocks_per_stage = 1;
  bool selective = false;  // each attention node recomputed alone
};

PipelineOptions exec_options(const Case& c) {
  PipelineOptions o;
  o.recompute = c.recompute;
  o.post_receives_ahead = c.receives_ahead;
  o.recompute_method = c.method;
  o.recompute_layers = c.recompute_layers;
  o.recompute_core_attention = c.selective;
  return o;
}

std::string name_of(const ::testing::TestParamInfo<Case>& info) {
  std::string n = info.param.schedule + "_pp" + std::to_string(info.param.pp) + "_v" +
                  std::to_string(info.param.chunks) + (info.param.skip ? "_skip" : "") +
                  (info.param.recompute ? "_recompute" : "") +
                  (info.param.receives_ahead ? "_receives_ahead" : "") +
                  (info.param.method == RecomputeMethod::None      ? ""
                   : info.param.method == RecomputeMethod::Uniform ? "_uniform"
                                                                   : "_block") +
                  (info.param.method == RecomputeMethod::None
                       ? ""
                       : std::to_string(info.param.recompute_layers) + "_of_" +
                             std::to_string(info.param.blocks_per_stage)) +
                  (info.param.selective ? "_selective" : "");
  for (char& ch : n)
    if (ch == '-') ch = '_';
  return n;
}

class PipelineMatchesSingleProcess : public ::testing::TestWithParam<Case> {};

TEST_P(PipelineMatchesSingleProcess, LossesNormsAndStash) {
  const Case c = GetParam();
  const int64_t micro = 2, m = 8, global = micro * m;
  GptConfig cfg = config(c.pp * c.chunks * c.blocks_per_stage, c.skip);
  TokenData data = text_data();
  const Losses want = single_process(cfg, micro, global, data);
  const PipelineOptions po_exec = exec_options(c);

  sched::Schedule schedule = sched::lower(sched::make_schedule(c.schedule, c.pp, m, c.chunks));
  ASSERT_TRUE(sched::validate(schedule).ok) << sched::validate(schedule).message;
  const std::vector<int> promised = sched::peak_in_flight(schedule, po_exec.recomputes());
  std::mutex mu;
  std::vector<Losses> got(static_cast<size_t>(c.pp));
  std::vector<int> peaks(static_cast<size_t>(c.pp)), slots(static_cast<size_t>(c.pp));
  std::vector<double> bytes(static_cast<size_t>(c.pp));
  StagePlan plan_used;
  run_local(c.pp, [&](Communicator& comm) {
    // Each rank builds the whole model from the same seed, as separate processes would.
    TokenBatches batches(data, global, cfg.seq_length);
    GptModel model = build_gpt(cfg, micro);
    init_gpt(model, 42);
    PartitionOptions po;
    po.method = PartitionMethod::Uniform;
    po.pp = c.pp;
    po.chunks = schedule.chunks;
    po.stage_rank = schedule.stage_rank;
    StagePlan plan = partition(model.graph, CostModel::analytic(model.graph), po);
    PipelineExecutor exec(model.graph, model.io, plan, schedule, comm, po_exec);
    Trainer trainer(model.io, batches, options(micro, global), exec);
    Losses r;
    for (int s = 0; s < kSteps; ++s) {
      StepRecord rec = trainer.train_step();
      r.loss.push_back(rec.loss);
      r.norm.push_back(rec.grad_norm);
    }
    std::lock_guard<std::mutex> lock(mu);
    got[static_cast<size_t>(comm.rank())] = r;
    peaks[static_cast<size_t>(comm.rank())] = exec.peak_stashed();
    slots[static_cast<size_t>(comm.rank())] = exec.peak_slots();
    bytes[static_cast<size_t>(comm.rank())] = exec.peak_bytes();
    if (comm.rank() == 0) plan_used = plan;
  });
  // Memory: what every rank held at its peak, in arena bytes, is what the
  // schedule's model gives from the one-rank measurement of each action.
  // Byte counts are whole numbers well below 2^53: equal, not near.
  // measure_stage_bytes runs every stage on one process, with no schedule.
  TokenBatches batches(data, global, cfg.seq_length);
  GptModel model_copy = build_gpt(cfg, micro);
  init_gpt(model_copy, 42);
  const sched::MemoryUse model =
      sched::memory_use(schedule,
                        measure_stage_bytes(model_copy.graph, model_copy.io, plan_used, batches,
                                            micro, po_exec, !sched::folds_weights(schedule, true)),
                        po_exec.recomputes(), c.receives_ahead);
  EXPECT_EQ(bytes, model.peak);
  EXPECT_EQ(slots, model.peak_slots);
  for (int rank = 0; rank < c.pp; ++rank) {
    for (int s = 0; s < kSteps; ++s) {
      EXPECT_NEAR(got[static_cast<size_t>(rank)].loss[static_cast<size_t>(s)],
                  want.loss[static_cast<size_t>(s)], 1e-5 * want.loss[static_cast<size_t>(s)])
          << "rank " << rank << " step " << s;
      EXPECT_NEAR(got[static_cast<size_t>(rank)].norm[static_cast<size_t>(s)],
                  want.norm[static_cast<size_t>(s)], 1e-5 * want.norm[static_cast<size_t>(s)])
          << "rank " << rank << " step " << s;
    }
    EXPECT_EQ(peaks[static_cast<size_t>(rank)], promised[static_cast<size_t>(rank)])
        << "rank " << rank;
  }
}

// Wraps a transport and checks the executor's side of p2p grouping: every
// send and receive is posted inside a group, groups do not nest, no request
// is waited for while a group is open, and no collective runs
// inside one. That is what NCCL needs (its group calls); the other
// transports ignore groups, so the losses must not change.
class GroupChecker final : public Communicator {
 public:
  explicit GroupChecker(Communicator& inner) : Communicator(inner.options()), inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  int world_rank(int r) const override { return inner_.world_rank(r); }
  std::string describe() const override { return inner_.describe(); }
  RequestPtr isend(const Tensor& t, int peer, MessageTag tag) override {
    if (!open_) violations.push_back("isend outside a group at " + step());
    return std::make_unique<Checked>(*this, inner_.isend(t, peer, tag));
  }
  RequestPtr irecv(const Tensor& t, int peer, MessageTag tag) override {
    if (!open_) violations.push_back("irecv outside a group at " + step());
    return std::make_unique<Checked>(*this, inner_.irecv(t, peer, tag));
  }
  void all_reduce(const Tensor& t, ReduceOp op) override {
    collective("all_reduce");
    inner_.all_reduce(t, op);
  }
  void all_gather(const Tensor& in, const Tensor& out) override {
    collective("all_gather");
    inner_.all_gather(in, out);
  }
  void reduce_scatter(const Tensor& in, const Tensor& out, ReduceOp op) override {
    collective("reduce_scatter");
    inner_.reduce_scatter(in, out, op);
  }
  void broadcast(const Tensor& t, int root) override {
    collective("broadcast");
    inner_.broadcast(t, root);
  }
  void barrier() override {
    collective("barrier");
    inner_.barrier();
  }
  std::unique_ptr<Communicator> split(const std::vector<std::vector<int>>& groups,
                                      const std::string& name) override {
    return inner_.split(groups, name);
  }
  void group_start() override {
    if (open_) violations.push_back("nested group at " + step());
    open_ = true;
    ++groups_opened;
  }
  void group_end() override {
    if (!open_) violations.push_back("group_end without group_start at " + step());
    open_ = false;
  }

  std::vector<std::string> violations;
  int groups_opened = 0;

 private:
  class Checked final : public Request {
   public:
    Checked(GroupChecker& owner, RequestPtr inner) : owner_(owner), inner_(std::move(inner)) {}
    // Testing may come at any time (a slot polls its sends); a request
    // still inside an open group is simply not done yet.
    bool test() override { return inner_->test(); }
    void wait() override {
      owner_.no_open_group("wait");
      inner_->wait();
    }

   private:
    GroupChecker& owner_;
    RequestPtr inner_;
  };
  void no_open_group(const char* what) {
    if (open_) violations.push_back(std::string(what) + " inside an open group at " + step());
  }
  void collective(const char* what) { no_open_group(what); }

  Communicator& inner_;
  bool open_ = false;
};

TEST(Pipeline, P2pStepsArePostedAsGroupsAndWaitedForAfter) {
  const int64_t micro = 2, m = 8, global = micro * m;
  TokenData data = text_data();
  for (const Case& c : {Case{"1f1b", 4, 1}, Case{"interleaved-1f1b", 2, 2}, Case{"zb-v", 2, 2},
                       Case{"zb-h1", 2, 1, false, true}}) {
    SCOPED_TRACE(c.schedule);
    GptConfig cfg = config(c.pp * c.chunks, c.skip);
    const Losses want = single_process(cfg, micro, global, data);
    sched::Schedule schedule = sched::lower(sched::make_schedule(c.schedule, c.pp, m, c.chunks));
    std::mutex mu;
    std::vector<Losses> got(static_cast<size_t>(c.pp));
    std::vector<std::vector<std::string>> violations(static_cast<size_t>(c.pp));
    std::vector<int> groups(static_cast<size_t>(c.pp));
    run_local(c.pp, [&](Communicator& world) {
      GroupChecker comm(world);
      TokenBatches batches(data, global, cfg.seq_length);
      GptModel model = build_gpt(cfg, micro);
      init_gpt(model, 42);
      PartitionOptions po;
      po.method = PartitionMethod::Uniform;
      po.pp = c.pp;
      po.chunks = schedule.chunks;
      po.stage_rank = schedule.stage_rank;
      StagePlan plan = partition(model.graph, CostModel::analytic(model.graph), po);
      PipelineOptions po_exec;
      po_exec.recompute = c.recompute;
      PipelineExecutor exec(model.graph, model.io, plan, schedule, comm, po_exec);
      Trainer trainer(model.io, batches, options(micro, global), exec);
      Losses r;
      for (int s = 0; s < kSteps; ++s) r.loss.push_back(trainer.train_step().loss);
      std::lock_guard<std::mutex> lock(mu);
      const auto i = static_cast<size_t>(comm.rank());
      got[i] = r;
      violations[i] = comm.violations;
      groups[i] = comm.groups_opened;
    });
    for (int rank = 0; rank < c.pp; ++rank) {
      const auto i = static_cast<size_t>(rank);
      EXPECT_EQ(violations[i], std::vector<std::string>{}) << "rank " << rank;
      EXPECT_EQ(groups[i],
                kSteps * static_cast<int>(sched::p2p_steps(schedule.actions[i]).size()))
          << "rank " << rank;
      for (int s = 0; s < kSteps; ++s)
        EXPECT_NEAR(got[i].loss[static_cast<size_t>(s)], want.loss[static_cast<size_t>(s)],
                    1e-5 * want.loss[static_cast<size_t>(s)])
            << "rank " << rank << " step " << s;
    }
  }
}

std::vector<Case> cases() {
  std::vector<Case> v;
  for (int pp : {2, 4}) {
    v.push_back({"gpipe", pp, 1});
    v.push_back({"1f1b", pp, 1});
    v.push_back({"interleaved-1f1b", pp, 2});
    v.push_back({"zb-h1", pp, 1});
    v.push_back({"zb-v", pp, 2});
  }
  v.push_back({"1f1b", 4, 1, true});
  v.push_back({"zb-v", 2, 2, true});
  v.push_back({"1f1b", 2, 1, false, true});
  v.push_back({"interleaved-1f1b", 2, 2, true, true});
  v.push_back({"zb-h1", 4, 1, false, true});
  // Each receive posted before the compute action ahead of it, every schedule.
  for (const char* s : {"gpipe", "1f1b", "zb-h1"}) v.push_back({s, 4, 1, false, false, true});
  v.push_back({"zb-v", 2, 2, true, false, true});
  v.push_back({"interleaved-1f1b", 2, 2, false, true, true});
  // Megatron's recompute over blocks: groups of 1 and 2 of 3 blocks (the
  // last group shorter), the first 2 blocks alone; with a skip, whose value
  // crosses the ranges; on one rank, and with interleaving.
  using M = RecomputeMethod;
  v.push_back({"1f1b", 1, 1, false, false, false, M::Uniform, 1, 3});
  v.push_back({"1f1b", 2, 1, false, false, false, M::Uniform, 2, 3});
  v.push_back({"gpipe", 2, 1, true, false, false, M::Uniform, 1, 3});
  v.push_back({"1f1b", 2, 1, false, false, true, M::Block, 2, 3});
  v.push_back({"interleaved-1f1b", 2, 2, true, false, false, M::Uniform, 1, 2});
  // Zero-bubble schedules keep W apart: I replays a range into its slot.
  v.push_back({"zb-v", 2, 2, true, false, false, M::Uniform, 1, 2});
  v.push_back({"zb-h1", 2, 1, false, false, true, M::Block, 1, 3});
  v.push_back({"zb-h1", 2, 1, false, false, false, M::None, 1, 2, true});
  v.push_back({"1f1b", 1, 1, false, false, false, M::None, 1, 2, true});
  v.push_back({"interleaved-1f1b", 2, 2, true, false, true, M::None, 1, 2, true});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Schedules, PipelineMatchesSingleProcess, ::testing::ValuesIn(cases()),
                         name_of);

// Recompute over blocks, or of attention alone, takes the same steps bit
// for bit as keeping the activations, at pp 1 and 2 (RankLayout: pp 1 runs the same executor): the
// replayed forward computes what the first one did, and every gradient adds
// in the same order. It holds less: with 3 blocks a stage, one replayed
// range's activations at a time instead of the stage's.
TEST(Pipeline, RecomputedBlocksTakeTheSameStepsBitForBitInLessMemory) {
  const int64_t micro = 2, global = 8;
  TokenData data = text_data();
  for (int pp : {1, 2}) {
    const GptConfig cfg = config(3 * pp, true);
    std::vector<std::vector<double>> steps;
    std::vector<double> peak;
    // None, uniform groups of 1, the first 2 blocks, the attention nodes.
    for (int way = 0; way < 4; ++way) {
      const RecomputeMethod method = way == 1   ? RecomputeMethod::Uniform
                                     : way == 2 ? RecomputeMethod::Block
                                                : RecomputeMethod::None;
      std::vector<double> got;
      double held = 0;
      std::mutex mu;
      run_local(pp, [&](Communicator& comm) {
        TokenBatches batches(data, global, cfg.seq_length);
        GptModel model = build_gpt(cfg, micro);
        LayoutOptions lo;
        lo.pp = pp;
        lo.pipeline.recompute_method = method;
        lo.pipeline.recompute_layers = method == RecomputeMethod::Block ? 2 : 1;
        lo.pipeline.recompute_core_attention = way == 3;
        RankLayout rank(&comm, model.graph, model.io, batches, options(micro, global), lo, 42);
        std::vector<double> mine;
        for (int s = 0; s < kSteps; ++s) {
          const StepRecord r = rank.trainer().train_step();
          mine.push_back(r.loss);
          mine.push_back(r.grad_norm);
        }
        std::lock_guard<std::mutex> lock(mu);
        if (comm.rank() == 0) got = mine, held = rank.pipeline()->peak_bytes();
      });
      steps.push_back(got);
      peak.push_back(held);
    }
    EXPECT_EQ(steps[1], steps[0]) << "uniform, pp " << pp;
    EXPECT_EQ(steps[2], steps[0]) << "block, pp " << pp;
    EXPECT_EQ(steps[3], steps[0]) << "selective, pp " << pp;
    EXPECT_LT(peak[1], peak[2]) << "pp " << pp;  // all three blocks replayed, not two
    EXPECT_LT(peak[2], peak[0]) << "pp " << pp;
    // The CPU's attention is unfused: without its (B, H, T, T) probabilities.
    EXPECT_LT(peak[3], peak[0]) << "pp " << pp;
  }
}

// A recompute that would find nothing to recompute is refused, naming what
// it looks for: an MLP has no blocks named h.<i> and no attention.
TEST(Pipeline, ARecomputeWithNothingToRecomputeIsRefused) {
  MlpModel m = build_mlp({4, 16, 2}, 2);
  const sched::Schedule one = one_stage_schedule(2);
  const StagePlan plan = whole_graph_plan(m.graph, CostModel::analytic(m.graph));
  PipelineOptions blocks, attention;
  blocks.recompute_method = RecomputeMethod::Uniform;
  attention.recompute_core_attention = true;
  run_local(1, [&](Communicator& self) {
    EXPECT_TRUE(testing::contains(
        testing::error_message([&] { PipelineExecutor(m.graph, m.io(), plan, one, self, blocks); }),
        "recomputes transformer blocks, the nodes named h.<i>"));
    EXPECT_TRUE(testing::contains(
        testing::error_message(
            [&] { PipelineExecutor(m.graph, m.io(), plan, one, self, attention); }),
        "recomputes the attention nodes (layer kind 'attention'): this model has none"));
    PipelineExecutor whole(m.graph, m.io(), plan, one, self, PipelineOptions{true});  // any graph
  });
}

// Measured costs: every node is timed, and the time plan they give is never
// worse than the uniform one by the same costs.
TEST(Pipeline, ProfiledCostsDriveTheTimePartition) {
  GptConfig cfg = config(4, false);
  TokenData data = text_data();
  TokenBatches batches(data, 4, cfg.seq_length);
  GptModel m = build_gpt(cfg, 2);
  init_gpt(m, 1);
  CostModel cost = profile_costs(m.graph, m.io, batches, 2, 2);
  ASSERT_EQ(cost.nodes.size(), m.graph.nodes().size());
  for (size_t k = 0; k < cost.nodes.size(); ++k) {
    EXPECT_GT(cost.nodes[k].f, 0.0) << m.graph.nodes()[k].name;
    EXPECT_GE(cost.nodes[k].i, 0.0) << m.graph.nodes()[k].name;
  }
  for (Param* p : m.graph.params()) EXPECT_EQ(testing::rel_error(p->grad, Tensor::zeros(p->grad.shape())), 0.0);
  PartitionOptions po;
  po.pp = 2;
  po.method = PartitionMethod::Time;
  StagePlan timed = partition(m.graph, cost, po);
  po.method = PartitionMethod::Uniform;
  StagePlan uniform = partition(m.graph, cost, po);
  EXPECT_LE(timed.max_stage_cost(), uniform.max_stage_cost());
  auto json = cost_model_json(cost, m.graph);
  EXPECT_EQ(json["nodes"].size(), cost.nodes.size());
  EXPECT_EQ(json["nodes"][0]["name"], "embed");
}

// The profilers' timer on the CPU: each span is the host time of its work,
// in the order the spans began, and take() starts over. A span can only be
// longer than its sleep (a loaded machine delays, never hastens), so the
// bound is one-sided.
TEST(Pipeline, SpanTimerTimesEachSpanInOrder) {
  SpanTimer timer(Device::cpu());
  timer.time([] {});
  timer.time([] { std::this_thread::sleep_for(std::chrono::milliseconds(30)); });
  const std::vector<double> s = timer.take();
  ASSERT_EQ(s.size(), 2u);
  EXPECT_GE(s[0], 0.0);
  EXPECT_GE(s[1], 0.030);
  EXPECT_TRUE(timer.take().empty());
  EXPECT_THROW(timer.end(), Error);  // no span is open
  timer.begin();
  EXPECT_THROW(timer.begin(), Error);  // spans do not nest
  EXPECT_THROW(timer.take(), Error);   // nor is one read while open
  timer.end();
  EXPECT_EQ(timer.take().size(), 1u);
}

TEST(Pipeline, OneFOneBStashIsPpMinusRank) {
  sched::Schedule s = sched::lower(sched::make_schedule("1f1b", 4, 8));
  EXPECT_EQ(sched::peak_in_flight(s), (std::vector<int>{4, 3, 2, 1}));
  sched::Schedule g = sched::lower(sched::make_schedule("gpipe", 4, 8));
  EXPECT_EQ(sched::peak_in_flight(g), (std::vector<int>{8, 8, 8, 8}));
}

}  // namespace
}  // namespace weft
