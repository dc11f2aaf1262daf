#include <weft/profile.h>
#include <weft/runner.h>

#include <algorithm>
#include <chrono>

namespace weft {

namespace {
using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
}  // namespace

CostModel profile_costs(const Graph& g, const LmGraph& io, const BatchSource& data,
                        int64_t micro_batch, int64_t seq_len, int repeats) {
  check(repeats > 0, "profiling needs at least one repeat, got {}", repeats);
  const int n = static_cast<int>(g.nodes().size());
  std::vector<std::vector<double>> f(static_cast<size_t>(n)), i(f), w(f);
  MicroBatch mb(g);
  // One untimed pass first: it plans the arena and warms the caches.
  for (int r = -1; r < repeats; ++r) {
    data.fill(0, 0, micro_batch, seq_len, mb.input(io.tokens).data<int32_t>(),
              mb.input(io.targets).data<int32_t>());
    auto timed = [&](std::vector<std::vector<double>>& into, int node, auto&& run) {
      const auto t0 = Clock::now();
      run();
      if (r >= 0)
        into[static_cast<size_t>(node)].push_back(
            std::chrono::duration<double>(Clock::now() - t0).count());
    };
    for (int k = 0; k < n; ++k) timed(f, k, [&] { forward(g, mb, k, k + 1); });
    mb.seed_grad(io.loss, 1.0f / static_cast<float>(micro_batch * seq_len));
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

nlohmann::json cost_model_json(const CostModel& cost, const Graph& g) {
  nlohmann::json nodes = nlohmann::json::array();
  for (size_t k = 0; k < cost.nodes.size(); ++k) {
    const NodeCost& c = cost.nodes[k];
    nodes.push_back({{"name", g.nodes()[k].name},
                     {"kind", g.nodes()[k].layer->kind()},
                     {"f", c.f},
                     {"i", c.i},
                     {"w", c.w},
                     {"param_bytes", c.param_bytes},
                     {"activation_bytes", c.activation_bytes},
                     {"output_bytes", c.output_bytes}});
  }
  return {{"unit", "seconds"}, {"nodes", nodes}};
}

}  // namespace weft
