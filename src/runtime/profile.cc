#include <weft/optimizer.h>
#include <weft/profile.h>
#include <weft/runner.h>

#include "layers/linear.h"
#include "weft_config.h"

#if WEFT_CUDA
#include <weft/cuda/runtime.h>
#endif

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

SpanTimer::SpanTimer(Device device) : device_(device) {
  if (device.is_cpu()) return;
#if WEFT_CUDA
  events_ = std::make_shared<cuda::TimingEvents>(cuda::context(device.index));
#else
  throw Error("timing on {}: weft was built without CUDA (meson setup -Dcuda=enabled)",
              device.str());
#endif
}

SpanTimer::~SpanTimer() = default;

void SpanTimer::begin() {
  check(!open_, "SpanTimer: a span begins inside another");
  open_ = true;
  if (device_.is_cpu()) {
    host_.emplace_back();  // grows the vector before the clock is read, not inside the span
    host_.back() = Clock::now();
    return;
  }
#if WEFT_CUDA
  events_->record(marks_++);
#endif
}

void SpanTimer::end() {
  check(open_, "SpanTimer: a span ends that did not begin");
  open_ = false;
  if (device_.is_cpu()) {
    host_.push_back(Clock::now());
    return;
  }
#if WEFT_CUDA
  events_->record(marks_++);
#endif
}

std::vector<double> SpanTimer::take() {
  check(!open_, "SpanTimer: take() inside a span");
  std::vector<double> seconds;
  if (device_.is_cpu()) {
    for (size_t k = 0; k + 1 < host_.size(); k += 2)
      seconds.push_back(std::chrono::duration<double>(host_[k + 1] - host_[k]).count());
    host_.clear();
    return seconds;
  }
#if WEFT_CUDA
  events_->synchronize();
  for (size_t k = 0; k + 1 < marks_; k += 2)
    seconds.push_back(1e-3 * static_cast<double>(events_->elapsed_ms(k, k + 1)));
#endif
  marks_ = 0;
  return seconds;
}

std::vector<std::pair<double, double>> SpanTimer::take_intervals() {
  check(!open_, "SpanTimer: take_intervals() inside a span");
  std::vector<std::pair<double, double>> spans;
  if (device_.is_cpu()) {
    auto since = [&](Clock::time_point t) {
      return std::chrono::duration<double>(t - host_.front()).count();
    };
    for (size_t k = 0; k + 1 < host_.size(); k += 2)
      spans.emplace_back(since(host_[k]), since(host_[k + 1]));
    host_.clear();
    return spans;
  }
#if WEFT_CUDA
  events_->synchronize();
  for (size_t k = 0; k + 1 < marks_; k += 2)
    spans.emplace_back(1e-3 * static_cast<double>(events_->elapsed_ms(0, k)),
                       1e-3 * static_cast<double>(events_->elapsed_ms(0, k + 1)));
#endif
  marks_ = 0;
  return spans;
}

Device params_device(const std::vector<Param*>& params) {
  if (params.empty()) return Device::cpu();
  const Device d = params.front()->value.device();
  for (const Param* p : params)
    check(p->value.device() == d, "parameters on two devices: {} on {}, {} on {}",
          params.front()->name, d.str(), p->name, p->value.device().str());
  return d;
}

CostModel profile_costs(const Graph& g, const ModelIO& io, const BatchSource& data,
                        int64_t micro_batch, int repeats) {
  check(repeats > 0, "profiling needs at least one repeat, got {}", repeats);
  const int n = static_cast<int>(g.nodes().size());
  std::vector<std::vector<double>> f(static_cast<size_t>(n)), i(f), w(f);
  const Device device = params_device(g.params());
  MicroBatch mb(g, device);
  SpanTimer timer(device);
  // A GPU's inputs are filled on the host and uploaded, as the Trainer does.
  std::vector<Tensor> inputs, host;
  if (!device.is_cpu())
    for (int v : io.inputs) {
      const Value& val = g.values()[static_cast<size_t>(v)];
      host.push_back(Tensor::zeros(val.shape, val.dtype));
    }
  const std::vector<Param*> params = g.params();
  Bf16Tables bf16_tables;
  const Bf16Copies copies(g, params, bf16_tables);  // as a training step has them
  // One untimed pass first: it plans the arena and warms the caches.
  for (int r = -1; r < repeats; ++r) {
    if (device.is_cpu()) {
      inputs.clear();
      for (int v : io.inputs) inputs.push_back(mb.input(v));
      data.fill(0, 0, inputs);
    } else {
      data.fill(0, 0, host);
      for (size_t k = 0; k < io.inputs.size(); ++k) mb.input(io.inputs[k]).copy_from(host[k]);
    }
    // Spans in the order F of nodes 0 .. n-1, I of n-1 .. 0, W of n-1 .. 0.
    for (int k = 0; k < n; ++k) timer.time([&] { forward(g, mb, k, k + 1); });
    mb.seed_grad(io.loss, 1.0f / static_cast<float>(micro_batch * io.terms_per_sample));
    for (int k = n - 1; k >= 0; --k) timer.time([&] { backward_input(g, mb, k); });
    for (int k = n - 1; k >= 0; --k) timer.time([&] { backward_weight(g, mb, k); });
    const std::vector<double> s = timer.take();
    check(s.size() == 3 * static_cast<size_t>(n), "profile: {} spans timed for {} nodes",
          s.size(), n);
    if (r >= 0)
      for (int k = 0; k < n; ++k) {
        const auto at = static_cast<size_t>(k), back = static_cast<size_t>(n - 1 - k);
        f[at].push_back(s[at]);
        i[at].push_back(s[static_cast<size_t>(n) + back]);
        w[at].push_back(s[2 * static_cast<size_t>(n) + back]);
      }
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
  // bf16 activations keep a bf16 copy of every weight beside it (Bf16Copies).
  return {{"unit", "seconds"},
          {"activation_dtype", g.activation_dtype() == DType::BF16 ? "bf16" : "fp32"},
          {"nodes", nodes}};
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

UpdateCosts profile_update(const std::vector<Param*>& params, int repeats) {
  check(repeats > 0, "profiling needs at least one repeat, got {}", repeats);
  const Device device = params_device(params);
  AdamW adam(params, AdamWConfig{0.9f, 0.95f, 1e-8f, 0.1f});
  SpanTimer timer(device);
  GradTables tables;  // as the trainer's: built in the untimed round, then reused
  std::vector<double> zero, norm, step;
  // One untimed round first, as the trainer's first step allocates the moments.
  for (int r = -1; r < repeats; ++r) {
    timer.time([&] { zero_grads(params); });
    double n = 0;
    timer.time([&] { n = grad_norm(params, tables); });
    check(n == 0, "profiling the update: the gradients' norm is {} after zeroing them", n);
    // Learning rate 0: the parameters stay. A clip's coefficient, as when
    // clipping is active.
    timer.time([&] { adam.step(0.0f, 0.5f); });
    const std::vector<double> s = timer.take();
    if (r < 0) continue;
    zero.push_back(s[0]), norm.push_back(s[1]), step.push_back(s[2]);
  }
  return {median(zero), median(norm), median(step)};
}

std::vector<double> profile_updates(const Graph& g, const StagePlan& plan, int repeats) {
  check(repeats > 0, "profiling needs at least one repeat, got {}", repeats);
  check_plan(plan, g);
  std::vector<double> seconds;
  for (int s = 0; s < plan.stages(); ++s) {
    const std::vector<Param*> params =
        g.params(plan.begin[static_cast<size_t>(s)], plan.begin[static_cast<size_t>(s) + 1]);
    seconds.push_back(profile_update(params, repeats).total());
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
    stages.back()["memory"] = {
        {"recv_f", b.recv_f}, {"f", b.f},           {"recv_b", b.recv_b},
        {"i", b.i},           {"w", b.w},           {"f_work", b.f_work},
        {"i_work", b.i_work}, {"i_keep", b.i_keep}, {"i_work_above", b.i_work_above}};
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
