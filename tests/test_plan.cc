// The planner: the search space it walks, the rules it refuses by (train_gpt's
// own, through layout_rule), the memory limit, the node costs it reads from a
// profile, and its ranking on synthetic costs where the best plan and its
// step time are known in closed form.
#include <weft/error.h>
#include <weft/plan.h>

#include <gtest/gtest.h>

#include "test_util.h"

#include <cmath>
#include <set>
#include <tuple>

namespace weft::plan {
namespace {

using testing::contains;
using testing::error_message;

ModelShape small() { return {8, 128, 8, 64, 256}; }

// Every part costs a fixed time per sequence; messages cost `latency`.
PlanInput synthetic(int world, int64_t global, double latency = 1e-3) {
  PlanInput in;
  in.shape = small();
  in.global_batch = global;
  in.machine.world = world;
  in.machine.intra = {latency, 1e9};
  in.machine.inter = in.machine.intra;
  LayerCosts& c = in.costs;
  c.layer = {1.0, 1.0, 0.5, 1e6, 1e6};
  c.pre = {0.1, 0.0, 0.1, 2e5, 1e5};
  c.post = {0.3, 0.3, 0.3, 1e3, 4e5};
  c.boundary_bytes = 32768;
  c.update_per_param_byte = 1e-8;
  return in;
}

// The candidates the search walks, counted here independently: every
// dp x pp x tp of the world; at pp > 1 every schedule (interleaved with 2, 3
// and 4 chunks), with and without recompute; micro-batches 1, 2, 4, 8, 16;
// no sharding, ZeRO-1, ZeRO-2 and ZeRO-3 where dp > 1; with and without sequence
// parallelism where tp > 1.
TEST(Plan, WalksTheWholeSearchSpaceAndEveryPlanPassesTheRules) {
  const PlanInput in = synthetic(8, 32);
  const PlanResult r = plan(in);
  int expected = 0;
  std::set<std::tuple<int, int, int>> layouts;
  for (int tp : {1, 2, 4, 8})
    for (int pp : {1, 2, 4, 8}) {
      if (8 % (tp * pp) != 0) continue;
      const int dp = 8 / (tp * pp);
      const int schedules = pp > 1 ? 4 + 3 : 1;  // gpipe, 1f1b, zb-h1, zb-v + interleaved x3
      const int recompute = pp > 1 ? 2 : 1;
      const int sharding = dp > 1 ? 4 : 1;
      const int sequence = tp > 1 ? 2 : 1;
      expected += schedules * 5 * recompute * sharding * sequence;
      layouts.insert({dp, pp, tp});
    }
  EXPECT_EQ(static_cast<int>(r.plans.size()) + r.refused, expected);
  std::set<std::tuple<int, int, int>> seen;
  for (const Plan& p : r.plans) {
    const Layout& l = p.layout;
    EXPECT_EQ(layout_rule(in.shape, in.global_batch, 8, l), "") << l.describe();
    EXPECT_EQ(p.micro_batches * l.micro_batch * l.dp, 32) << l.describe();
    seen.insert({l.dp, l.pp, l.tp});
  }
  EXPECT_EQ(seen, layouts);  // each (dp, pp, tp) has at least one runnable plan
  // Fastest first; steps within 1e-9 of each other tie (less memory first).
  for (size_t k = 1; k < r.plans.size(); ++k)
    EXPECT_LE(r.plans[k - 1].step_time, r.plans[k].step_time + 1e-9 * r.plans.back().step_time);
}

TEST(Plan, RefusesWithTrainGptsRules) {
  const ModelShape s = small();
  auto rule = [&](Layout l, int64_t global = 32, int world = 8) {
    return layout_rule(s, global, world, l);
  };
  EXPECT_EQ(rule({8, 1, 1, "1f1b", 1, 1}), "");
  EXPECT_TRUE(contains(rule({2, 2, 1, "1f1b", 1, 1}), "dp (2) x pp (2) x tp (1) must be the world (8)"));
  EXPECT_EQ(rule({1, 1, 8, "1f1b", 1, 1}, 32, 8), "");
  ModelShape odd = s;
  odd.heads = 6;
  EXPECT_EQ(layout_rule(odd, 32, 8, {2, 1, 4, "1f1b", 1, 1}),
            "--num-attention-heads (6) must be divisible by --tensor-model-parallel-size (4)");
  // A vocabulary tp does not divide is no rule: train_gpt pads it to a multiple of tp.
  odd = s;
  odd.vocab = 250;
  EXPECT_EQ(layout_rule(odd, 32, 8, {2, 1, 4, "1f1b", 1, 1}), "");
  EXPECT_EQ(rule({1, 8, 1, "interleaved-1f1b", 2, 1}),
            "--num-layers (8) must be at least --pp (8) x virtual stages (2): every stage needs a "
            "layer");
  EXPECT_TRUE(contains(rule({4, 2, 1, "1f1b", 1, 3}),
                       "--global-batch-size (32) must be divisible by --micro-batch-size (3) x dp (4)"));
  EXPECT_TRUE(contains(rule({1, 2, 4, "zb-v", 3, 1}), "--virtual-stages 3: zb-v runs exactly 2"));
  // Recompute keeps a zero-bubble schedule's W apart (sched::folds_weights).
  EXPECT_EQ(rule({1, 2, 4, "zb-h1", 1, 1, true}), "");
  EXPECT_TRUE(contains(rule({8, 1, 1, "1f1b", 1, 1, true}), "it needs --pp > 1"));
  // The schedule's own rule: 1 micro-batch per replica is fewer than the
  // interleaved schedule runs on 2 ranks.
  EXPECT_NE(rule({4, 2, 1, "interleaved-1f1b", 2, 8}), "");
}

// The memory limit removes exactly the plans above it, and says why.
TEST(Plan, MemoryPerRankIsALimit) {
  PlanInput in = synthetic(8, 32);
  const PlanResult all = plan(in);
  double most = 0, least = 1e300;
  for (const Plan& p : all.plans) {
    most = std::max(most, p.memory_per_rank);
    least = std::min(least, p.memory_per_rank);
  }
  ASSERT_LT(least, most);
  in.machine.memory = (least + most) / 2;
  const PlanResult some = plan(in);
  size_t fit = 0;
  for (const Plan& p : all.plans) fit += p.memory_per_rank <= in.machine.memory;
  EXPECT_EQ(some.plans.size(), fit);
  EXPECT_EQ(some.refused, all.refused + static_cast<int>(all.plans.size() - fit));
  bool named = false;
  for (const auto& [why, count] : some.reasons) named = named || contains(why, "per rank, more than");
  EXPECT_TRUE(named);
  in.machine.memory = 1;
  EXPECT_TRUE(plan(in).plans.empty());
}

// Memory of a replica at dp: weights, gradients and AdamW's moments as
// GradSync keeps them (ZeRO-1: the moments' dp-th, and the reduced dp-th of
// the gradients beside them; ZeRO-2: the gradients' dp-th and a pool of 4
// buckets and their slices), and the activations the schedule holds.
TEST(Plan, MemoryIsStateAndTheSchedulesActivations) {
  const PlanInput in = synthetic(8, 32);
  const double params = 8 * 1e6 + 2e5 + 1e3;  // bytes of one replica's weights
  Plan p = evaluate(in, {8, 1, 1, "1f1b", 1, 2, false, false});
  // pp 1: one micro-batch of 2 sequences in flight: its stash, and I's bytes.
  const double stash = 2 * (8 * 1e6 + 1e5 + 4e5);
  EXPECT_NEAR(p.activation_bytes, 2 * stash, 1e-6 * stash);
  EXPECT_NEAR(p.memory_per_rank, 4 * params + p.activation_bytes, 1);
  const Plan zero1 = evaluate(in, {8, 1, 1, "1f1b", 1, 2, false, true});
  EXPECT_NEAR(zero1.memory_per_rank, (2 + 3.0 / 8) * params + p.activation_bytes, 1);
  // The pool's bucket: the default 2^20 elements (the small shape's largest
  // tensor, 256 x 128, is smaller).
  const Plan zero2 = evaluate(in, {8, 1, 1, "1f1b", 1, 2, false, true, true});
  const double pool = 4 * 4.0 * (1 << 20) * (1 + 1.0 / 8);
  EXPECT_NEAR(zero2.memory_per_rank, (1 + 3.0 / 8) * params + pool + p.activation_bytes, 1);
  // ZeRO-2 reduce-scatters once per micro-batch (2 per replica here: 32 /
  // (2 x 8)) and all-gathers once: 3/2 of an all-reduce.
  ASSERT_EQ(zero2.micro_batches, 2);
  EXPECT_NEAR(zero2.dp_time, 1.5 * zero1.dp_time, 1e-9 * zero1.dp_time);
  EXPECT_EQ(zero2.layout.flags().back(), "optim_grads");
  // ZeRO-3: the values sliced too, and a pool of 2 gathered buckets (twice
  // the one the MLP's 8 h^2 + 5 h elements fill at h 128); per micro-batch a
  // reduce-scatter and two all-gathers, none after the update: 3 halves of
  // an all-reduce per micro-batch.
  Layout l3{8, 1, 1, "1f1b", 1, 2, false, true, true};
  l3.zero3 = true;
  const Plan zero3 = evaluate(in, l3);
  const double gathered = 2 * 4.0 * (1 << 20);
  EXPECT_NEAR(zero3.memory_per_rank, (4.0 / 8) * params + pool + gathered + p.activation_bytes, 1);
  EXPECT_NEAR(zero3.dp_time, 3 * zero1.dp_time, 1e-9 * zero1.dp_time);
  EXPECT_EQ(zero3.layout.flags().back(), "optim_grads_params");
  EXPECT_TRUE(contains(zero3.layout.describe(), "zero-3")) << zero3.layout.describe();
}

// Where ZeRO-1's state does not fit and ZeRO-2's does, the planner runs
// ZeRO-2; with more memory, it prefers ZeRO-1 (fewer reductions).
TEST(Plan, ShardedGradientsWhereOnlyTheyFit) {
  PlanInput in = synthetic(8, 32);
  in.costs.layer.param_bytes = 1e8;  // a model whose state outweighs ZeRO-2's pool
  in.fixed.dp = 8;
  in.fixed.micro_batch = 2;
  const Plan zero1 = evaluate(in, {8, 1, 1, "1f1b", 1, 2, false, true});
  const Plan zero2 = evaluate(in, {8, 1, 1, "1f1b", 1, 2, false, true, true});
  ASSERT_LT(zero2.memory_per_rank, zero1.memory_per_rank);
  in.machine.memory = (zero1.memory_per_rank + zero2.memory_per_rank) / 2;
  PlanResult r = plan(in);
  ASSERT_FALSE(r.plans.empty());
  EXPECT_TRUE(r.plans.front().layout.zero2) << r.plans.front().layout.describe();
  in.machine.memory = 2 * zero1.memory_per_rank;
  r = plan(in);
  ASSERT_FALSE(r.plans.empty());
  EXPECT_FALSE(r.plans.front().layout.zero2) << r.plans.front().layout.describe();
  // And ZeRO-3 where only it fits: slower (two all-gathers per micro-batch),
  // so chosen only then.
  Layout l3{8, 1, 1, "1f1b", 1, 2, false, true, true};
  l3.zero3 = true;
  const Plan zero3 = evaluate(in, l3);
  ASSERT_LT(zero3.memory_per_rank, zero2.memory_per_rank);
  EXPECT_GT(zero3.step_time, zero2.step_time);
  in.machine.memory = (zero2.memory_per_rank + zero3.memory_per_rank) / 2;
  r = plan(in);
  ASSERT_FALSE(r.plans.empty());
  EXPECT_TRUE(r.plans.front().layout.zero3) << r.plans.front().layout.describe();
}

// Where the answer is known: free compute sharing and no bubble make pure
// data parallelism the fastest, ZeRO-1 shortens its update, and all
// micro-batch sizes tie on time (the least memory wins). Its step is the
// replica's work, one all-reduce of the gradients (2 log2 4 rounds of
// latency, 2 (4 - 1) / 4 of the bytes through each link) and a dp-th of the
// update.
TEST(Plan, RanksTheKnownBestFirst) {
  const PlanInput in = synthetic(4, 16);
  const PlanResult r = plan(in);
  ASSERT_FALSE(r.plans.empty());
  const Plan& best = r.plans.front();
  EXPECT_EQ(best.layout.describe(), "(dp 4, pp 1, tp 1) mb 1 zero-1");
  const double params = 8 * 1e6 + 2e5 + 1e3;
  const double work = 4 * (8 * 2.5 + 0.2 + 0.9);  // 4 sequences per replica
  const double ring = 2 * 2 * 1e-3 + 2.0 * 3 / 4 * params / 1e9;
  const double update = 1e-8 * params / 4;
  EXPECT_NEAR(best.step_time, work + ring + update, 1e-9 * best.step_time);
  EXPECT_DOUBLE_EQ(best.bubble, 0);
}

// Shared cores: 8 processes on 2 cores run a quarter as fast, so pure data
// parallelism takes 4x its replica's work (and the update 4x too).
TEST(Plan, SharedCoresSlowEveryProcess) {
  PlanInput in = synthetic(8, 16, 0);
  in.machine.cores = 2;
  const Plan p = evaluate(in, {8, 1, 1, "1f1b", 1, 1, false, false});
  const double params = 8 * 1e6 + 2e5 + 1e3;
  const double work = 2 * (8 * 2.5 + 0.2 + 0.9);
  EXPECT_NEAR(p.pipeline_time, 4 * work, 1e-9 * work);
  EXPECT_NEAR(p.update_time, 4 * 1e-8 * params, 1e-12);
}

// Tensor parallelism in closed form: each rank computes a tp-th of the
// split work and all of the replicated work, and every all-reduce of the
// activations (4 per block, 1 for the embedding, 1 into the head, 2 small
// ones in the loss) waits for the other ranks. The waits take no core: on
// one shared core, 2 ranks' compute takes twice as long, the waits do not.
TEST(Plan, TensorParallelSplitsWorkNotNormsAndWaitsOnItsAllReduces) {
  PlanInput in = synthetic(2, 1, 0);
  in.costs.layer.rf = 0.25;  // of the block's F = 1.0, I = 1.0 and W = 0.5
  in.costs.layer.ri = 0.25;
  in.machine.intra = {1e-3, 1e9};
  in.machine.wake = 2e-3;
  const double act = 32768;            // boundary bytes of one sequence
  // 2 log2(2) rounds, each a latency and a wake; (2 - 1) / 2 x 2 of the bytes.
  const double ar = 2 * (1e-3 + 2e-3) + act / 1e9;
  const double small = 2 * (1e-3 + 2e-3) + act / 128 / 1e9;
  const Plan p = evaluate(in, {1, 1, 2, "1f1b", 1, 1, false, false});
  const double compute = 8 * ((1.0 - 0.25) / 2 + 0.25) * 2 + 8 * 0.5 / 2 +
                         (0.1 + 0.1) / 2 + (0.3 + 0.3 + 0.3) / 2;
  const double waits = (2 * 8 + 1) * ar + 2 * small + (2 * 8 + 1) * ar;
  EXPECT_NEAR(p.pipeline_time, compute + waits, 1e-9 * p.pipeline_time);
  in.machine.cores = 1;
  const Plan shared = evaluate(in, {1, 1, 2, "1f1b", 1, 1, false, false});
  EXPECT_NEAR(shared.pipeline_time, 2 * compute + waits, 1e-9 * shared.pipeline_time);
}

// With too little memory for a whole replica, only plans that split the
// model remain.
TEST(Plan, TooLittleMemoryForAReplicaSplitsTheModel) {
  PlanInput in = synthetic(8, 32);
  in.machine.memory = 4 * (8 * 1e6 + 2e5 + 1e3) * 0.8;
  const PlanResult r = plan(in);
  ASSERT_FALSE(r.plans.empty());
  for (const Plan& p : r.plans) EXPECT_GT(p.layout.pp * p.layout.tp, 1) << p.layout.describe();
}

TEST(Plan, ConstraintsFixADimension) {
  PlanInput in = synthetic(8, 32);
  in.fixed.tp = 2;
  in.fixed.schedule = "zb-h1";
  const PlanResult r = plan(in);
  ASSERT_FALSE(r.plans.empty());
  for (const Plan& p : r.plans) {
    EXPECT_EQ(p.layout.tp, 2);
    EXPECT_TRUE(p.layout.pp == 1 || p.layout.schedule == "zb-h1");
  }
}

// A profile's nodes, grouped into blocks and divided by its micro-batch.
TEST(Plan, ProfileCostsAreNodesPerSequence) {
  auto node = [](const char* name, double f, double params, double act, double out = 0) {
    return nlohmann::json{{"name", name}, {"f", f},          {"i", 2 * f},
                          {"w", 3 * f},   {"param_bytes", params}, {"activation_bytes", act},
                          {"output_bytes", out}};
  };
  nlohmann::json p = {{"micro_batch_size", 2},
                      {"nodes",
                       {node("embed", 0.2, 100, 10), node("h.0.a", 1, 10, 4),
                        node("h.0.b", 1, 10, 4, 8), node("h.1.a", 3, 10, 4),
                        node("h.1.b", 1, 10, 4, 8), node("ln_f", 0.4, 2, 2),
                        node("head", 0.6, 0, 6)}},
                      {"stages",
                       {{{"update", 0.1}, {"memory", {{"f", 10.0}, {"i", 5.0}}}},
                        {{"update", 0.042}, {"memory", {{"f", 10.0}, {"i", 5.0}}}}}}};
  const LayerCosts c = profile_costs(p, "p.json");
  EXPECT_DOUBLE_EQ(c.layer.f, (2 + 4) / 2.0 / 2);  // the blocks' mean, per sequence
  EXPECT_DOUBLE_EQ(c.layer.i, 2 * c.layer.f);
  EXPECT_DOUBLE_EQ(c.layer.param_bytes, 20);        // weights do not scale with the batch
  EXPECT_DOUBLE_EQ(c.layer.stash_bytes, 8 / 2.0);
  EXPECT_DOUBLE_EQ(c.pre.f, 0.1);
  EXPECT_DOUBLE_EQ(c.post.f, 0.5);
  EXPECT_DOUBLE_EQ(c.boundary_bytes, 4);
  EXPECT_DOUBLE_EQ(c.update_per_param_byte, 0.142 / 142);
  EXPECT_DOUBLE_EQ(c.input_grad_ratio, 0.5);
  // What every tensor-parallel rank runs whole: the embedding and the final
  // norm here, no block node (h.N.a and h.N.b name no norm or residual).
  EXPECT_DOUBLE_EQ(c.layer.rf, 0);
  EXPECT_DOUBLE_EQ(c.pre.rf, 0.1);
  EXPECT_DOUBLE_EQ(c.pre.rw, 0.3);
  EXPECT_DOUBLE_EQ(c.post.rf, 0.2);
  EXPECT_DOUBLE_EQ(c.post.ri, 0.4);
  p["nodes"][1]["name"] = "h.0.ln_1";
  p["nodes"][2]["name"] = "h.0.res_1";
  p["nodes"][3]["name"] = "h.1.input_norm";
  const LayerCosts named = profile_costs(p, "p.json");
  EXPECT_DOUBLE_EQ(named.layer.rf, (1 + 1 + 3) / 2.0 / 2);
  EXPECT_DOUBLE_EQ(named.layer.rw, 3 * named.layer.rf);
  p.erase("micro_batch_size");
  EXPECT_TRUE(contains(error_message([&] { profile_costs(p, "p.json"); }),
                       "--profile p.json: no \"micro_batch_size\""));
  p["micro_batch_size"] = 2;
  p["tp"] = 2;
  EXPECT_TRUE(contains(error_message([&] { profile_costs(p, "p.json"); }), "tp 1"));
}

TEST(Plan, BadInputIsOneLine) {
  PlanInput in = synthetic(0, 32);
  EXPECT_TRUE(contains(error_message([&] { plan(in); }), "the world (0)"));
  in = synthetic(8, 0);
  EXPECT_TRUE(contains(error_message([&] { plan(in); }), "global batch (0)"));
}

}  // namespace
}  // namespace weft::plan
