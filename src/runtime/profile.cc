#include <weft/optimizer.h>
#include <weft/profile.h>
#include <weft/runner.h>

#include "layers/linear.h"

#include <algorithm>
#include <chrono>
#include <fstream>

namespace weft {

namespace {
using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
}  // namespace

CostModel profile_costs(const Graph& g, const ModelIO& io, const BatchSource& data,
                        int64_t micro_batch, int repeats) {
  check(repeats > 0, "profiling needs at least one repeat, got {}", repeats);
  const int n = static_cast<int>(g.nodes().size());
  std::vector<std::vector<double>> f(static_cast<size_t>(n)), i(f), w(f);
  MicroBatch mb(g);
  std::vector<Tensor> inputs;
  // One untimed pass first: it plans the arena and warms the caches.
  for (int r = -1; r < repeats; ++r) {
    inputs.clear();
    for (int v : io.inputs) inputs.push_back(mb.input(v));
    data.fill(0, 0, inputs);
    auto timed = [&](std::vector<std::vector<double>>& into, int node, auto&& run) {
      const auto t0 = Clock::now();
      run();
      if (r >= 0)
        into[static_cast<size_t>(node)].push_back(
            std::chrono::duration<double>(Clock::now() - t0).count());
    };
    for (int k = 0; k < n; ++k) timed(f, k, [&] { forward(g, mb, k, k + 1); });
    mb.seed_grad(io.loss, 1.0f / static_cast<float>(micro_batch * io.terms_per_sample));
    for (int k = n - 1; k >= 0; --k) timed(i, k, [&] { backward_input(g, mb, k); });
    for (int k = n - 1; k >= 0; --k) timed(w, k, [&] { backward_weight(g, mb, k); });
    mb.reset();
  }
  zero_grads(g.params());
  CostModel cost = CostModel::analytic(g);
  for (size_t k = 0; k < cost.nodes.size(); ++k) {
    cost.nodes[k].f = median(f[k]);
    cost.nodes[k].i = median(i[k]);
    cost.nodes[k].w = median(w[k]);
  }
  cost.link_bytes_per_unit = 0;
  return cost;
}

std::vector<bool> tp_whole_outputs(const Graph& g) {
  std::vector<bool> whole(g.nodes().size(), true);
  for (size_t k = 0; k < g.nodes().size(); ++k) {
    const Node& n = g.nodes()[k];
    const auto* linear = dynamic_cast<const Linear*>(n.layer.get());
    if (linear && linear->role() == ParallelRole::Column) {
      whole[k] = false;
    } else if (!linear || linear->role() != ParallelRole::Row) {
      for (int v : n.inputs) {
        const int from = g.values()[static_cast<size_t>(v)].producer;
        if (from >= 0 && !whole[static_cast<size_t>(from)]) whole[k] = false;
      }
    }
  }
  return whole;
}

nlohmann::json cost_model_json(const CostModel& cost, const Graph& g) {
  nlohmann::json nodes = nlohmann::json::array();
  const std::vector<bool> whole = tp_whole_outputs(g);
  for (size_t k = 0; k < cost.nodes.size(); ++k) {
    const NodeCost& c = cost.nodes[k];
    nodes.push_back({{"name", g.nodes()[k].name},
                     {"kind", g.nodes()[k].layer->kind()},
                     {"f", c.f},
                     {"i", c.i},
                     {"w", c.w},
                     {"param_bytes", c.param_bytes},
                     {"activation_bytes", c.activation_bytes},
                     {"output_bytes", c.output_bytes},
                     {"tp_whole", static_cast<bool>(whole[k])}});
  }
  return {{"unit", "seconds"}, {"nodes", nodes}};
}

namespace {
void check_plan(const StagePlan& plan, const Graph& g) {
  const size_t n = g.nodes().size();
  check(plan.begin.size() == static_cast<size_t>(plan.stages()) + 1 && plan.begin.front() == 0 &&
            plan.begin.back() == static_cast<int>(n) &&
            plan.stage_rank.size() == static_cast<size_t>(plan.stages()),
        "stage costs: the plan's {} cut points and {} ranks do not split {} nodes into {} stages",
        plan.begin.size(), plan.stage_rank.size(), n, plan.stages());
}
}  // namespace

std::vector<double> profile_updates(const Graph& g, const StagePlan& plan, int repeats) {
  check(repeats > 0, "profiling needs at least one repeat, got {}", repeats);
  check_plan(plan, g);
  std::vector<double> seconds;
  for (int s = 0; s < plan.stages(); ++s) {
    const std::vector<Param*> params =
        g.params(plan.begin[static_cast<size_t>(s)], plan.begin[static_cast<size_t>(s) + 1]);
    AdamW adam(params, AdamWConfig{0.9f, 0.95f, 1e-8f, 0.1f});
    std::vector<double> t;
    // One untimed round first, as the trainer's first step allocates the moments.
    for (int r = -1; r < repeats; ++r) {
      const auto t0 = Clock::now();
      zero_grads(params);
      clip_grads(params, 1.0, grad_norm(params));
      adam.step(0.0f);
      if (r >= 0) t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    seconds.push_back(median(t));
  }
  return seconds;
}

nlohmann::json stage_costs_json(const CostModel& cost, const StagePlan& plan, const Graph& g,
                                const std::vector<double>& update,
                                const std::vector<sched::StageBytes>& memory, bool recompute) {
  const size_t n = g.nodes().size();
  check(cost.nodes.size() == n, "stage costs: the cost model has {} nodes, the graph {}",
        cost.nodes.size(), n);
  check_plan(plan, g);
  check(update.empty() || update.size() == static_cast<size_t>(plan.stages()),
        "stage costs: {} update times for {} stages", update.size(), plan.stages());
  check(memory.empty() || memory.size() == static_cast<size_t>(plan.stages()),
        "stage costs: {} stage byte counts for {} stages", memory.size(), plan.stages());
  nlohmann::json stages = nlohmann::json::array();
  for (int s = 0; s < plan.stages(); ++s) {
    const int begin = plan.begin[static_cast<size_t>(s)];
    const int end = plan.begin[static_cast<size_t>(s) + 1];
    double f = 0, i = 0, w = 0, stash = 0, boundary = 0;
    for (int k = begin; k < end; ++k) {
      const NodeCost& c = cost.nodes[static_cast<size_t>(k)];
      f += c.f, i += c.i, w += c.w, stash += c.activation_bytes;
    }
    // The executor's boundary: values produced before `end` and read after it.
    for (const Value& v : g.values()) {
      if (v.producer < 0 || v.producer >= end) continue;
      if (std::any_of(v.consumers.begin(), v.consumers.end(), [&](int c) { return c >= end; }))
        boundary += static_cast<double>(v.shape.numel()) * static_cast<double>(dtype_size(v.dtype));
    }
    stages.push_back({{"stage", s},
                      {"rank", plan.stage_rank[static_cast<size_t>(s)]},
                      {"first", g.nodes()[static_cast<size_t>(begin)].name},
                      {"last", g.nodes()[static_cast<size_t>(end) - 1].name},
                      {"nodes", end - begin},
                      {"f", f},
                      {"i", i},
                      {"w", w},
                      {"update", update.empty() ? 0.0 : update[static_cast<size_t>(s)]},
                      {"boundary_bytes", boundary},
                      {"stash_bytes", stash}});
    if (memory.empty()) continue;
    const sched::StageBytes& b = memory[static_cast<size_t>(s)];
    stages.back()["memory"] = {{"recv_f", b.recv_f}, {"f", b.f},           {"recv_b", b.recv_b},
                               {"i", b.i},           {"w", b.w},           {"f_work", b.f_work},
                               {"i_work", b.i_work}, {"i_keep", b.i_keep}};
  }
  nlohmann::json j = {{"pp", plan.pp}, {"chunks", plan.chunks}, {"partition", plan.method},
                      {"stages", stages}};
  if (!memory.empty()) j["recompute"] = recompute;
  return j;
}

void write_profile(const std::string& path, const CostModel& cost, const StagePlan& plan,
                   const Graph& g, const std::vector<sched::StageBytes>& memory, bool recompute,
                   const nlohmann::json& extra) {
  nlohmann::json j = cost_model_json(cost, g);
  j.update(stage_costs_json(cost, plan, g, profile_updates(g, plan), memory, recompute));
  if (extra.is_object()) j.update(extra);
  std::ofstream f(path, std::ios::trunc);
  f << j.dump(2) << '\n';
  check(f.good(), "--profile {}: cannot write", path);
}

}  // namespace weft
