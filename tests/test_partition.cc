// The partitioner: `time` is optimal against brute force over every cut (with link
// cost, memory budgets and several stages per rank), the other methods follow their
// rules, and every plan covers the graph exactly once.
#include <weft/partition.h>

#include <gtest/gtest.h>

#include "layers/linear.h"
#include "layers/residual.h"
#include "models/gpt.h"
#include "models/mlp.h"
#include "test_util.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <random>

namespace weft {
namespace {

using testing::contains;
using testing::error_message;

constexpr double kInf = std::numeric_limits<double>::infinity();

// A chain of Linear layers with a residual add every third node (so some values skip
// a node and cross two cuts), the last Linear tied to the first one's weight.
struct Chain {
  std::shared_ptr<ParamStore> params = std::make_shared<ParamStore>();
  Graph graph{params};
};

std::unique_ptr<Chain> residual_chain(int nodes) {
  auto c = std::make_unique<Chain>();
  ParamStore& ps = *c->params;
  Graph& g = c->graph;
  int x = g.input("x", {2, 4}, DType::F32);
  int skip = x;
  Param* tied = ps.create("w0", {4, 4}, Init::normal(0.02f));
  const int last_linear = (nodes - 1) % 3 == 2 ? nodes - 2 : nodes - 1;
  for (int i = 0; i < nodes; ++i) {
    const std::string name = fmt::format("n{}", i);
    if (i % 3 == 2) {
      x = g.add1(name, std::make_unique<Residual>(), {skip, x});
      skip = x;
      continue;
    }
    Param* w =
        i == 0 || i == last_linear ? tied : ps.create(name + ".w", {4, 4}, Init::normal(0.02f));
    Param* b = ps.create(name + ".b", {4}, Init::constant(0));
    x = g.add1(name, std::make_unique<Linear>(w, b), {x});
  }
  g.mark_output(x);
  return c;
}

// Unequal integer costs (sums stay exact). Parameter bytes are multiples of 20 so the
// 16 : 4 split between a weight and its bias is exact too.
CostModel random_costs(const Graph& g, uint64_t seed, double link = 0) {
  std::mt19937_64 rng(seed);
  auto draw = [&](int lo, int hi) {
    return static_cast<double>(std::uniform_int_distribution<int>(lo, hi)(rng));
  };
  CostModel m;
  for (const Node& n : g.nodes()) {
    NodeCost c;
    c.f = draw(0, 20);
    c.i = draw(0, 20);
    c.w = n.layer->params().empty() ? 0 : draw(0, 20);
    c.param_bytes = n.layer->params().empty() ? 0 : 20 * draw(0, 10);
    c.activation_bytes = draw(0, 50);
    c.output_bytes = draw(0, 64);
    m.nodes.push_back(c);
  }
  m.link_bytes_per_unit = link;
  return m;
}

// Calls f(begin) for every cut of n nodes into `stages` non-empty ranges.
void for_each_cut(int n, int stages, const std::function<void(const std::vector<int>&)>& f) {
  std::vector<int> begin{0};
  std::function<void(int)> next = [&](int s) {
    if (s == stages - 1) {
      begin.push_back(n);
      f(begin);
      begin.pop_back();
      return;
    }
    for (int b = begin.back() + 1; b <= n - (stages - s - 1); ++b) {
      begin.push_back(b);
      next(s + 1);
      begin.pop_back();
    }
  };
  next(0);
}

double peak(const StagePlan& p) {
  return *std::max_element(p.rank_memory.begin(), p.rank_memory.end());
}

struct BruteForce {
  double best_time = kInf;   // least largest rank cost among cuts within the budget
  double least_peak = kInf;  // least peak rank memory among all cuts
  double most_peak = 0;      // largest peak rank memory among all cuts
  // Within the budget: the least largest stage cost, and the least largest rank
  // cost of the cuts that reach it (what minimising the slowest stage gives at best).
  double best_stage = kInf, rank_of_best_stage = kInf;
};

BruteForce brute_force(const Graph& g, const CostModel& cost, const PartitionOptions& opt) {
  BruteForce bf;
  const int n = static_cast<int>(g.nodes().size());
  for_each_cut(n, opt.pp * opt.chunks, [&](const std::vector<int>& begin) {
    const StagePlan p = evaluate_plan(g, cost, opt, begin, "brute");
    bf.least_peak = std::min(bf.least_peak, peak(p));
    bf.most_peak = std::max(bf.most_peak, peak(p));
    if (opt.memory_budget > 0 && peak(p) > opt.memory_budget) return;
    bf.best_time = std::min(bf.best_time, p.max_rank_cost());
    if (p.max_stage_cost() < bf.best_stage) {
      bf.best_stage = p.max_stage_cost();
      bf.rank_of_best_stage = kInf;
    }
    if (p.max_stage_cost() == bf.best_stage)
      bf.rank_of_best_stage = std::min(bf.rank_of_best_stage, p.max_rank_cost());
  });
  return bf;
}

PartitionOptions options(PartitionMethod m, int pp, int chunks = 1, double budget = 0) {
  PartitionOptions o;
  o.method = m;
  o.pp = pp;
  o.chunks = chunks;
  o.memory_budget = budget;
  return o;
}

TEST(Partition, TimeIsOptimalAgainstEveryCut) {
  int checked = 0;
  for (int n : {6, 9, 12}) {
    auto c = residual_chain(n);
    for (int pp : {2, 3, 4}) {
      for (double link : {0.0, 4.0}) {
        const CostModel cost = random_costs(c->graph, static_cast<uint64_t>(n * 100 + pp), link);
        const PartitionOptions opt = options(PartitionMethod::Time, pp);
        const StagePlan plan = partition(c->graph, cost, opt);
        const BruteForce bf = brute_force(c->graph, cost, opt);
        EXPECT_DOUBLE_EQ(plan.max_stage_cost(), bf.best_time)
            << n << " nodes, pp " << pp << ", link " << link;
        EXPECT_EQ(plan.method, "time");
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 18);
}

TEST(Partition, LinkCostChargesValuesReadAfterTheStage) {
  // n2 = n1 + x reads the graph input x (free) and n1; n3 reads n2; n5 reads n4 and n2.
  auto c = residual_chain(6);
  CostModel cost = random_costs(c->graph, 7);
  for (NodeCost& nc : cost.nodes) nc.f = nc.i = nc.w = 0;
  for (size_t i = 0; i < cost.nodes.size(); ++i) cost.nodes[i].output_bytes = 1 << i;
  cost.link_bytes_per_unit = 2;
  const PartitionOptions opt = options(PartitionMethod::Time, 3);
  // Stage 0 = n0..n2 sends n2 (read by n3 and by the residual n5): 4 bytes.
  // Stage 1 = n3 sends n3 (read by n4): 8 bytes; n2 was sent by its producer's stage.
  const StagePlan p = evaluate_plan(c->graph, cost, opt, {0, 3, 4, 6}, "given");
  EXPECT_DOUBLE_EQ(p.stage_cost[0], 4.0 / 2);
  EXPECT_DOUBLE_EQ(p.stage_cost[1], 8.0 / 2);
  EXPECT_DOUBLE_EQ(p.stage_cost[2], 0.0);
  // Cutting after n1: n1 is read by n2 only, and n0 by n1 only.
  const StagePlan q = evaluate_plan(c->graph, cost, opt, {0, 2, 3, 6}, "given");
  EXPECT_DOUBLE_EQ(q.stage_cost[0], 2.0 / 2);
  EXPECT_DOUBLE_EQ(q.stage_cost[1], 4.0 / 2);
}

TEST(Partition, TimeIsOptimalWithinAMemoryBudget) {
  int binding = 0;
  for (int n : {8, 11}) {
    auto c = residual_chain(n);
    for (int pp : {2, 3}) {
      for (double link : {0.0, 4.0}) {
        const CostModel cost = random_costs(c->graph, static_cast<uint64_t>(n * 10 + pp), link);
        PartitionOptions opt = options(PartitionMethod::Time, pp);
        opt.in_flight = pp == 2 ? std::vector<int>{3, 1} : std::vector<int>{3, 2, 1};
        const BruteForce all = brute_force(c->graph, cost, opt);
        for (double frac : {0.0, 0.1, 0.3, 0.6}) {
          opt.memory_budget = all.least_peak + frac * (all.most_peak - all.least_peak);
          const StagePlan plan = partition(c->graph, cost, opt);
          const BruteForce bf = brute_force(c->graph, cost, opt);
          EXPECT_DOUBLE_EQ(plan.max_stage_cost(), bf.best_time)
              << n << " nodes, pp " << pp << ", budget " << opt.memory_budget;
          EXPECT_LE(peak(plan), opt.memory_budget);
          if (bf.best_time > all.best_time) ++binding;
        }
      }
    }
  }
  EXPECT_GT(binding, 3);  // the budgets did change the answer
}

TEST(Partition, SeveralStagesPerRankAreExactWithinABudget) {
  // A rank's memory and time sum non-adjacent stages; the V placement puts the tied
  // weight's two users on one rank, where it is held once.
  int binding = 0, rank_objective_mattered = 0;
  for (int n : {9, 12}) {
    auto c = residual_chain(n);
    for (bool v_shape : {false, true}) {
      const CostModel cost = random_costs(c->graph, static_cast<uint64_t>(n + 3 * v_shape), 4.0);
      PartitionOptions opt = options(PartitionMethod::Time, 2, 2);
      opt.in_flight = {4, 2};
      if (v_shape) opt.stage_rank = {0, 1, 1, 0};
      const BruteForce all = brute_force(c->graph, cost, opt);
      for (double frac : {0.0, 0.05, 0.2, 0.5, 1.0}) {
        opt.memory_budget = all.least_peak + frac * (all.most_peak - all.least_peak);
        const StagePlan plan = partition(c->graph, cost, opt);
        const BruteForce bf = brute_force(c->graph, cost, opt);
        EXPECT_DOUBLE_EQ(plan.max_rank_cost(), bf.best_time)
            << n << " nodes, v " << v_shape << ", budget " << opt.memory_budget;
        EXPECT_LE(peak(plan), opt.memory_budget);
        if (bf.best_time > all.best_time) ++binding;
        // A rank's time sums its chunks: the cut with the slowest stage as fast as
        // possible leaves some rank busier than this plan does.
        if (bf.best_time < bf.rank_of_best_stage) ++rank_objective_mattered;
      }
    }
  }
  EXPECT_GT(binding, 3);
  EXPECT_GT(rank_objective_mattered, 0);
}

TEST(Partition, AnImpossibleBudgetNamesTheLeastPeakMemory) {
  auto c = residual_chain(10);
  const CostModel cost = random_costs(c->graph, 11);
  for (int chunks : {1, 2}) {
    PartitionOptions opt = options(PartitionMethod::Time, 2, chunks);
    opt.in_flight = {2, 1};
    const double least = brute_force(c->graph, cost, opt).least_peak;
    opt.memory_budget = least - 1;
    const std::string msg = error_message([&] { partition(c->graph, cost, opt); });
    EXPECT_TRUE(contains(msg, fmt::format("budget of {:.0f} bytes", least - 1))) << msg;
    EXPECT_TRUE(contains(msg, fmt::format("stages is {:.0f} bytes", least))) << msg;
    opt.memory_budget = least;  // just enough
    EXPECT_EQ(peak(partition(c->graph, cost, opt)), least) << chunks;
  }
}

TEST(Partition, ParametersBalancesStageParameterBytes) {
  auto c = residual_chain(12);
  const CostModel cost = random_costs(c->graph, 5);
  for (int pp : {2, 3, 4}) {
    PartitionOptions opt = options(PartitionMethod::Parameters, pp);
    // With no activations and no optimizer state, a stage's memory is its parameters.
    CostModel params_only = cost;
    params_only.state_per_param_byte = 0;
    for (NodeCost& nc : params_only.nodes) nc.activation_bytes = 0;
    const double least = brute_force(c->graph, params_only, opt).least_peak;
    const StagePlan plan = partition(c->graph, params_only, opt);
    EXPECT_DOUBLE_EQ(peak(plan), least) << pp;
    EXPECT_EQ(plan.method, "parameters");
  }
}

TEST(Partition, TimeIsNeverWorseThanTheOtherMethodsOnGpt) {
  int compared = 0, strictly_better = 0;
  for (const char* preset : {"toy", "mini"}) {
    const GptConfig cfg = gpt_preset(preset);
    GptModel m = build_gpt(cfg, 2);
    for (int costs = 0; costs < 2; ++costs) {
      const CostModel cost =
          costs == 0 ? CostModel::analytic(m.graph) : random_costs(m.graph, 17, 8.0);
      for (int pp : {2, 4}) {
        for (int chunks : {1, 2}) {
          const double best =
              partition(m.graph, cost, options(PartitionMethod::Time, pp, chunks)).max_rank_cost();
          const double params =
              partition(m.graph, cost, options(PartitionMethod::Parameters, pp, chunks))
                  .max_rank_cost();
          EXPECT_LE(best, params) << preset << " pp " << pp << " chunks " << chunks;
          if (cfg.num_layers < pp * chunks) continue;  // uniform needs a block per stage
          const double uniform =
              partition(m.graph, cost, options(PartitionMethod::Uniform, pp, chunks))
                  .max_rank_cost();
          EXPECT_LE(best, uniform) << preset << " pp " << pp << " chunks " << chunks;
          if (best < uniform * 0.999) ++strictly_better;
          ++compared;
        }
      }
    }
  }
  EXPECT_EQ(compared, 8);
  // Uniform ignores the LM head's cost and the embedding's lightness.
  EXPECT_GT(strictly_better, 3);
}

GptConfig eight_layers() {
  GptConfig c;
  c.vocab_size = 64, c.num_layers = 8, c.hidden_size = 32, c.num_heads = 2, c.seq_length = 16;
  return c;
}

std::vector<std::string> stage_nodes(const Graph& g, const StagePlan& p, int s) {
  std::vector<std::string> names;
  for (int i = p.begin[static_cast<size_t>(s)]; i < p.begin[static_cast<size_t>(s) + 1]; ++i)
    names.push_back(g.nodes()[static_cast<size_t>(i)].name);
  return names;
}

TEST(Partition, UniformGivesEachStageTheSameBlocks) {
  GptModel m = build_gpt(eight_layers(), 1);
  const Graph& g = m.graph;
  const StagePlan p = partition(g, CostModel::analytic(g), options(PartitionMethod::Uniform, 4));
  ASSERT_EQ(p.begin.size(), 5u);
  EXPECT_EQ(stage_nodes(g, p, 0).front(), "embed");
  EXPECT_EQ(stage_nodes(g, p, 0)[1], "h.0.ln_1");
  EXPECT_EQ(stage_nodes(g, p, 0).back(), "h.1.res_2");
  for (int s = 0; s < 4; ++s) {
    const auto names = stage_nodes(g, p, s);
    const int blocks = static_cast<int>(std::count_if(
        names.begin(), names.end(), [](const std::string& x) { return x.ends_with(".ln_1"); }));
    EXPECT_EQ(blocks, 2) << s;
    EXPECT_TRUE(contains(names[s == 0 ? 1 : 0], fmt::format("h.{}.ln_1", 2 * s))) << s;
  }
  const auto last = stage_nodes(g, p, 3);
  EXPECT_EQ(last[last.size() - 2], "ln_f");
  EXPECT_EQ(last.back(), "lm_head");
  EXPECT_EQ(p.stage_of(0), 0);
  EXPECT_EQ(p.stage_of(static_cast<int>(g.nodes().size()) - 1), 3);
}

TEST(Partition, UniformGivesTheRemainderToTheFirstStages) {
  GptConfig cfg = eight_layers();
  cfg.num_layers = 6;
  GptModel m = build_gpt(cfg, 1);
  const StagePlan p =
      partition(m.graph, CostModel::analytic(m.graph), options(PartitionMethod::Uniform, 2, 2));
  const std::vector<std::string> first{"h.0.ln_1", "h.2.ln_1", "h.4.ln_1", "h.5.ln_1"};
  for (int s = 1; s < 4; ++s)
    EXPECT_EQ(m.graph.nodes()[static_cast<size_t>(p.begin[static_cast<size_t>(s)])].name,
              first[static_cast<size_t>(s)]);
  // Without blocks the nodes split evenly, the first stages taking the remainder: 12
  // nodes over 5 stages.
  MlpModel mlp = build_mlp({4, 4, 4, 4, 4, 4, 4}, 2);
  const StagePlan q =
      partition(mlp.graph, CostModel::analytic(mlp.graph), options(PartitionMethod::Uniform, 5));
  EXPECT_EQ(q.begin, (std::vector<int>{0, 3, 6, 8, 10, 12}));
  // Fewer blocks than stages: refused, naming both.
  const std::string msg = error_message([&] {
    partition(m.graph, CostModel::analytic(m.graph), options(PartitionMethod::Uniform, 4, 2));
  });
  EXPECT_TRUE(contains(msg, "6 blocks")) << msg;
  EXPECT_TRUE(contains(msg, "8 stages")) << msg;
}

TEST(Partition, EvaluatePlanRefusesCutsThatDropDuplicateOrEmpty) {
  auto c = residual_chain(9);
  const CostModel cost = random_costs(c->graph, 3);
  const PartitionOptions opt = options(PartitionMethod::Time, 3);
  auto msg = [&](std::vector<int> begin) {
    return error_message([&] { evaluate_plan(c->graph, cost, opt, begin, "given"); });
  };
  EXPECT_EQ(msg({0, 3, 6, 9}), "");
  EXPECT_TRUE(contains(msg({1, 3, 6, 9}), "nodes 0..0 are in no stage")) << msg({1, 3, 6, 9});
  EXPECT_TRUE(contains(msg({0, 3, 6, 8}), "nodes 8..8 are in no stage")) << msg({0, 3, 6, 8});
  EXPECT_TRUE(contains(msg({0, 5, 3, 9}), "stage 1 ends at node 3 before it starts at node 5"))
      << msg({0, 5, 3, 9});
  EXPECT_TRUE(contains(msg({0, 5, 3, 9}), "nodes 3..4 would run in two stages"));
  EXPECT_TRUE(contains(msg({0, 4, 4, 9}), "stage 1 is empty: it starts and ends at node 4"))
      << msg({0, 4, 4, 9});
  EXPECT_TRUE(contains(msg({0, 3, 9, 9}), "stage 2 is empty")) << msg({0, 3, 9, 9});
  EXPECT_TRUE(contains(msg({0, 3, 6, 10}), "ends at node 10, past the graph's 9 nodes"))
      << msg({0, 3, 6, 10});
  EXPECT_TRUE(contains(msg({0, 12, 6, 9}), "stage 1 starts at node 12, past the graph's 9 nodes"))
      << msg({0, 12, 6, 9});
  EXPECT_TRUE(contains(msg({0, 3, 9}), "a plan of 3 stages needs 4 stage starts"))
      << msg({0, 3, 9});
}

TEST(Partition, OptionErrorsNameTheValueAndTheRule) {
  auto c = residual_chain(6);
  const CostModel cost = random_costs(c->graph, 1);
  auto msg = [&](PartitionOptions o) {
    return error_message([&] { partition(c->graph, cost, o); });
  };
  EXPECT_EQ(msg(options(PartitionMethod::Time, 4, 2)),
            "the graph has 6 nodes, fewer than pp x chunks = 8 stages");
  EXPECT_TRUE(contains(msg(options(PartitionMethod::Time, 0)), "pp (0) must be at least 1"));
  EXPECT_TRUE(contains(msg(options(PartitionMethod::Time, 2, 0)), "chunks (0) must be at least 1"));
  PartitionOptions o = options(PartitionMethod::Time, 2, 2);
  o.stage_rank = {0, 1, 1, 1};
  EXPECT_TRUE(contains(msg(o), "rank 0 1 stages; every rank must run chunks = 2")) << msg(o);
  o.stage_rank = {0, 1, 2, 0};
  EXPECT_TRUE(contains(msg(o), "stage_rank[2] = 2 is not a rank in 0..1")) << msg(o);
  o.stage_rank.clear();
  o.in_flight = {1};
  EXPECT_TRUE(contains(msg(o), "in_flight has 1 entries")) << msg(o);
  CostModel short_cost = cost;
  short_cost.nodes.pop_back();
  EXPECT_TRUE(contains(
      error_message([&] { partition(c->graph, short_cost, options(PartitionMethod::Time, 2)); }),
      "5 node costs for a graph of 6 nodes"));
  EXPECT_EQ(parse_partition_method("parameters"), PartitionMethod::Parameters);
  EXPECT_EQ(parse_partition_method("time"), PartitionMethod::Time);
  EXPECT_EQ(parse_partition_method("uniform"), PartitionMethod::Uniform);
  EXPECT_TRUE(contains(error_message([] { parse_partition_method("fast"); }),
                       "'fast' is unknown; choose one of: uniform, parameters, time"));
}

TEST(Partition, AnalyticCostsFollowTheLayers) {
  GptModel m = build_gpt(gpt_preset("toy"), 2);
  const Graph& g = m.graph;
  const CostModel cost = CostModel::analytic(g);
  ASSERT_EQ(cost.nodes.size(), g.nodes().size());
  auto node = [&](const std::string& name) {
    for (size_t i = 0; i < g.nodes().size(); ++i)
      if (g.nodes()[i].name == name) return cost.nodes[i];
    ADD_FAILURE() << name;
    return NodeCost{};
  };
  const NodeCost qkv = node("h.0.attn.c_attn"), act = node("h.0.attn.core");
  EXPECT_GT(qkv.f, 0);
  EXPECT_EQ(qkv.i, qkv.f);
  EXPECT_EQ(qkv.w, qkv.f);
  EXPECT_EQ(act.i, act.f);
  EXPECT_EQ(act.w, 0);
  EXPECT_EQ(qkv.param_bytes, 4.0 * (64 * 192 + 192));
  EXPECT_EQ(qkv.output_bytes, 4.0 * 2 * 64 * 192);
  EXPECT_EQ(qkv.activation_bytes, qkv.output_bytes);
  // The MLP node keeps its hidden pre-activation and activation (B T x 4C
  // each) besides its output.
  const NodeCost mlp = node("h.0.mlp");
  EXPECT_EQ(mlp.param_bytes, 4.0 * (64 * 256 + 256 + 256 * 64 + 64));
  EXPECT_EQ(mlp.output_bytes, 4.0 * 2 * 64 * 64);
  EXPECT_EQ(mlp.activation_bytes, mlp.output_bytes + 4.0 * 2 * (2 * 64 * 256));
  EXPECT_EQ(mlp.w, mlp.f);
  // wte counts where it is first used: the embedding, not the tied head.
  EXPECT_EQ(node("embed").param_bytes, 4.0 * (256 * 64 + 64 * 64));
  EXPECT_EQ(node("lm_head").param_bytes, 0);
  double total = 0;
  for (const NodeCost& c : cost.nodes) total += c.param_bytes;
  EXPECT_EQ(total, 4.0 * static_cast<double>(g.param_count()));
}

TEST(Partition, TiedEmbeddingIsHeldByEveryRankThatUsesIt) {
  GptModel m = build_gpt(gpt_preset("toy"), 2);
  const Graph& g = m.graph;
  const CostModel cost = CostModel::analytic(g);
  const int n = static_cast<int>(g.nodes().size());
  const double wte = 4.0 * 256 * 64;
  auto expected = [&](int a, int b) {  // one stage's ranks: params once, x4 with AdamW state
    double params = 0, acts = 0;
    for (const Param* p : g.params(a, b)) params += 4.0 * static_cast<double>(p->value.numel());
    for (int i = a; i < b; ++i) acts += cost.nodes[static_cast<size_t>(i)].activation_bytes;
    return 4 * params + acts;
  };
  PartitionOptions opt = options(PartitionMethod::Time, 2);
  const StagePlan split = evaluate_plan(g, cost, opt, {0, 12, n}, "given");
  EXPECT_EQ(split.rank_memory[0], expected(0, 12));
  EXPECT_EQ(split.rank_memory[1], expected(12, n));
  // Both ranks hold wte: together they hold it (and its state) twice.
  EXPECT_EQ(split.rank_memory[0] + split.rank_memory[1], expected(0, n) + 4 * wte);
  // A V placement puts the embedding and the head on rank 0, which holds wte once.
  ASSERT_EQ(n, 17);  // embed, 2 blocks of 7 nodes, ln_f, lm_head
  opt = options(PartitionMethod::Time, 2, 2);
  opt.stage_rank = {0, 1, 1, 0};
  opt.in_flight = {3, 2};
  const StagePlan v = evaluate_plan(g, cost, opt, {0, 5, 10, 16, n}, "given");
  double acts0 = 0;
  for (int i = 0; i < n; ++i)
    if (i < 5 || i >= 16) acts0 += cost.nodes[static_cast<size_t>(i)].activation_bytes;
  double params0 = 0;
  std::vector<const Param*> seen;
  for (auto [a, b] : {std::pair{0, 5}, std::pair{16, n}})
    for (const Param* p : g.params(a, b))
      if (std::find(seen.begin(), seen.end(), p) == seen.end()) {
        seen.push_back(p);
        params0 += 4.0 * static_cast<double>(p->value.numel());
      }
  EXPECT_EQ(v.rank_memory[0], 4 * params0 + 3 * acts0);
}

TEST(Partition, TiedEmbeddingShapesTheBudgetedPlan) {
  // On a GPT the tied wte is the largest parameter: where the head's stage runs decides
  // whether a rank holds it twice. Tight budgets, both placements, against every cut.
  GptModel m = build_gpt(gpt_preset("toy"), 1);
  const Graph& g = m.graph;
  const CostModel cost = CostModel::analytic(g);
  for (bool v_shape : {false, true}) {
    PartitionOptions opt = options(PartitionMethod::Time, 2, 2);
    opt.in_flight = {3, 2};
    if (v_shape) opt.stage_rank = {0, 1, 1, 0};
    const BruteForce all = brute_force(g, cost, opt);
    for (double frac : {0.0, 0.02, 0.1}) {
      opt.memory_budget = std::floor(all.least_peak + frac * (all.most_peak - all.least_peak));
      const StagePlan plan = partition(g, cost, opt);
      EXPECT_DOUBLE_EQ(plan.max_rank_cost(), brute_force(g, cost, opt).best_time)
          << "v " << v_shape << " budget " << opt.memory_budget;
      EXPECT_LE(peak(plan), opt.memory_budget);
    }
  }
}

// How far from optimal a plan may be, by its own description: 0 when proven
// optimal, else the "at most X% slower" the search could bound.
double stated_gap(const StagePlan& p) {
  if (p.method == "time") return 0;
  const size_t at = p.method.find("at most ");
  if (at == std::string::npos) return kInf;
  return std::stod(p.method.substr(at + 8));
}

TEST(Partition, TimeSearchesLargerGraphsQuickly) {
  // 24 blocks, 8 stages over 4 ranks. With one chunk per rank the DP is exact and
  // instant, budget or not. With two, a rank's time sums two stages and the exact search
  // may stop at its step limit (a fraction of a second): the plan then says how far from
  // optimal it can be, by the search's lower bound, and that is small.
  GptConfig cfg = eight_layers();
  cfg.num_layers = 24;
  GptModel m = build_gpt(cfg, 1);
  const CostModel cost = CostModel::analytic(m.graph);
  for (int chunks : {1, 2}) {
    PartitionOptions opt = options(PartitionMethod::Time, 4, chunks);
    opt.in_flight = {7, 5, 3, 1};
    const StagePlan free_plan = partition(m.graph, cost, opt);
    opt.memory_budget = 0.97 * peak(free_plan);
    const StagePlan tight = partition(m.graph, cost, opt);
    for (const StagePlan* p : {&free_plan, &tight}) {
      if (chunks == 1) {
        EXPECT_EQ(p->method, "time");  // proven optimal
      }
      EXPECT_LE(stated_gap(*p), 3.0) << p->method;
      // No rank can do less than its share of the work.
      double total = 0;
      for (double c : p->stage_cost) total += c;
      EXPECT_GE(p->max_rank_cost(), total / 4);
    }
    EXPECT_LE(peak(tight), opt.memory_budget);
    // The budget can only slow the optimum: found tight >= optimum tight >= optimum free,
    // and the free plan is within its stated gap of its optimum.
    EXPECT_GE(tight.max_rank_cost() * (1 + stated_gap(free_plan) / 100),
              free_plan.max_rank_cost());
    const std::string text = tight.describe(m.graph);
    EXPECT_TRUE(contains(text, fmt::format("plan: {} stages (pp 4 x {} chunks)", 4 * chunks,
                                           chunks)))
        << text;
    EXPECT_TRUE(contains(text, "embed .. ")) << text;
    EXPECT_TRUE(contains(text, ".. lm_head")) << text;
  }
}

}  // namespace
}  // namespace weft
