// The fused attention's core (src/cuda/sdpa.h) through cuDNN's fused
// scaled-dot-product attention (the SDPA graphs of cudnn-frontend): a
// flash-attention kernel that never writes the (B, H, T, T) scores. Built
// only when meson finds cudnn-frontend's headers and cuDNN (WEFT_CUDNN); the
// interfaces around it are src/cuda/fused_attention.cc, the unfused path
// src/cuda/attention.cc.
//
// cuDNN's kernels take bf16 q, k, v and give bf16 outputs, with fp32 softmax
// statistics (lse: the row log-sum-exp of the scaled, masked scores, natural
// log). q, k and v are read straight from the packed qkv through strides, and
// dq, dk, dv written into one packed buffer shaped like it. cuDNN sums a
// key/value head's gradient over the query heads of its group itself
// (grouped-query attention: query head i reads key/value head i / (H / G),
// cuDNN's convention too).
//
// Graphs are built once per (B, T, H, G, D) and direction and kept for the
// life of the process, with one cuDNN handle per device; a call after the
// first of its shape builds nothing, and cuDNN's workspace comes from the
// context's caching allocator.
#include <weft/cuda/kernels.h>

#include "src/cuda/check.h"
#include "src/cuda/sdpa.h"

#include <cudnn.h>
#include <cudnn_frontend.h>

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace weft::cuda::sdpa {

namespace {

namespace fe = cudnn_frontend;

// The tensors' ids in the graphs' variant packs.
enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV };

// Graphs by shape.
struct Key : Shape {
  explicit Key(const Shape& s) : Shape(s) {}
  auto tie() const { return std::tie(b, t, h, g, d); }
  bool operator<(const Key& o) const { return tie() < o.tie(); }
};

void check_cudnn(cudnnStatus_t status, const char* call) {
  if (status != CUDNN_STATUS_SUCCESS)
    throw Error("{} failed: {} (cuDNN {})", call, cudnnGetErrorString(status), cudnnGetVersion());
}

// One step of building or running a graph; cudnn-frontend reports errors as values.
void check_fe(fe::error_t e, const char* step, const Key& k, const char* direction) {
  if (e.is_bad())
    throw Error("cuDNN fused attention {} ({}): {} failed: {} (cuDNN {}, cudnn-frontend {}; "
                "CUDNN_FRONTEND_LOG_INFO=1 CUDNN_FRONTEND_LOG_FILE=stderr logs its steps)",
                direction, describe(k), step, e.get_message(), cudnnGetVersion(),
                CUDNN_FRONTEND_VERSION);
}

// Dimensions (B, heads, T, D) of one head block of the packed qkv (B, T, (H + 2G) D).
std::vector<int64_t> packed_stride(const Key& k) {
  const int64_t w = (k.h + 2 * k.g) * k.d;
  return {k.t * w, k.d, w, 1};
}
// (B, H, T, D) over a (B, T, H D) array: out and dout.
std::vector<int64_t> rows_stride(const Key& k) { return {k.t * k.h * k.d, k.d, k.h * k.d, 1}; }

using Tensor = std::shared_ptr<fe::graph::Tensor_attributes>;

std::shared_ptr<fe::graph::Graph> new_graph() {
  auto graph = std::make_shared<fe::graph::Graph>();
  graph->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return graph;
}

Tensor input(fe::graph::Graph& graph, const char* name, Uid uid, std::vector<int64_t> dim,
             std::vector<int64_t> stride) {
  return graph.tensor(fe::graph::Tensor_attributes()
                          .set_name(name)
                          .set_uid(uid)
                          .set_dim(std::move(dim))
                          .set_stride(std::move(stride)));
}

std::vector<int64_t> stats_dim(const Key& k) { return {k.b, k.h, k.t, 1}; }
std::vector<int64_t> stats_stride(const Key& k) { return {k.h * k.t, k.t, 1, 1}; }

float attn_scale(const Key& k) { return 1.0f / std::sqrt(static_cast<float>(k.d)); }

// Validates, lowers and plans the graph: each step named when it fails.
void finish(fe::graph::Graph& graph, cudnnHandle_t handle, const Key& k, const char* direction) {
  check_fe(graph.validate(), "validate", k, direction);
  check_fe(graph.build_operation_graph(handle), "build_operation_graph", k, direction);
  check_fe(graph.create_execution_plans({fe::HeurMode_t::A}), "create_execution_plans", k,
           direction);
  check_fe(graph.check_support(handle), "check_support", k, direction);
  check_fe(graph.build_plans(handle), "build_plans", k, direction);
}

std::shared_ptr<fe::graph::Graph> build_forward(cudnnHandle_t handle, const Key& k) {
  auto graph = new_graph();
  Tensor q = input(*graph, "q", kQ, {k.b, k.h, k.t, k.d}, packed_stride(k));
  Tensor kk = input(*graph, "k", kK, {k.b, k.g, k.t, k.d}, packed_stride(k));
  Tensor v = input(*graph, "v", kV, {k.b, k.g, k.t, k.d}, packed_stride(k));
  auto options = fe::graph::SDPA_attributes()
                     .set_name("causal_attention")
                     .set_generate_stats(true)
                     .set_causal_mask(true)
                     .set_attn_scale(attn_scale(k));
  auto [o, stats] = graph->sdpa(q, kk, v, options);
  o->set_output(true).set_uid(kO).set_dim({k.b, k.h, k.t, k.d}).set_stride(rows_stride(k));
  stats->set_output(true)
      .set_uid(kStats)
      .set_data_type(fe::DataType_t::FLOAT)
      .set_dim(stats_dim(k))
      .set_stride(stats_stride(k));
  finish(*graph, handle, k, "forward");
  return graph;
}

std::shared_ptr<fe::graph::Graph> build_backward(cudnnHandle_t handle, const Key& k) {
  auto graph = new_graph();
  Tensor q = input(*graph, "q", kQ, {k.b, k.h, k.t, k.d}, packed_stride(k));
  Tensor kk = input(*graph, "k", kK, {k.b, k.g, k.t, k.d}, packed_stride(k));
  Tensor v = input(*graph, "v", kV, {k.b, k.g, k.t, k.d}, packed_stride(k));
  Tensor o = input(*graph, "o", kO, {k.b, k.h, k.t, k.d}, rows_stride(k));
  Tensor d_o = input(*graph, "dO", kDO, {k.b, k.h, k.t, k.d}, rows_stride(k));
  Tensor stats = input(*graph, "stats", kStats, stats_dim(k), stats_stride(k));
  stats->set_data_type(fe::DataType_t::FLOAT);
  auto options = fe::graph::SDPA_backward_attributes()
                     .set_name("causal_attention_backward")
                     .set_causal_mask(true)
                     .set_attn_scale(attn_scale(k));
  auto [dq, dk, dv] = graph->sdpa_backward(q, kk, v, o, d_o, stats, options);
  dq->set_output(true).set_uid(kDQ).set_dim({k.b, k.h, k.t, k.d}).set_stride(packed_stride(k));
  dk->set_output(true).set_uid(kDK).set_dim({k.b, k.g, k.t, k.d}).set_stride(packed_stride(k));
  dv->set_output(true).set_uid(kDV).set_dim({k.b, k.g, k.t, k.d}).set_stride(packed_stride(k));
  finish(*graph, handle, k, "backward");
  return graph;
}

// One device's cuDNN handle and built graphs. The mutex covers building and
// queueing (execute only queues work on the compute stream).
struct DeviceState {
  std::mutex mu;
  cudnnHandle_t handle = nullptr;
  std::map<Key, std::shared_ptr<fe::graph::Graph>> forward, backward;
};

constexpr int kMaxDevices = 64;

DeviceState& state(Context& ctx) {
  static std::array<DeviceState, kMaxDevices> states;
  check(ctx.device() >= 0 && ctx.device() < kMaxDevices, "fused attention: device index {}",
        ctx.device());
  return states[static_cast<size_t>(ctx.device())];
}

// The graph of `k` for one direction, built on first use; the handle bound to
// the compute stream. Called with s.mu held.
fe::graph::Graph& graph_for(Context& ctx, DeviceState& s, const Key& k, bool backward) {
  if (s.handle == nullptr) check_cudnn(cudnnCreate(&s.handle), "cudnnCreate");
  check_cudnn(cudnnSetStream(s.handle, ctx.compute_stream()), "cudnnSetStream");
  auto& cache = backward ? s.backward : s.forward;
  auto it = cache.find(k);
  if (it == cache.end())
    it = cache.emplace(k, backward ? build_backward(s.handle, k) : build_forward(s.handle, k))
             .first;
  return *it->second;
}

void run(Context& ctx, DeviceState& s, fe::graph::Graph& graph, const Key& k,
         std::unordered_map<fe::graph::Tensor_attributes::uid_t, void*> pack,
         const char* direction) {
  int64_t bytes = 0;
  check_fe(graph.get_workspace_size(bytes), "get_workspace_size", k, direction);
  DeviceBuffer<std::byte> workspace(ctx, std::max<int64_t>(bytes, 1));
  check_fe(graph.execute(s.handle, pack, workspace.data()), "execute", k, direction);
}

template <typename T>
void* mut(const T* p) {
  return const_cast<T*>(p);
}

}  // namespace

void forward(Context& ctx, const Shape& shape, const bf16* qkv, bf16* o, float* lse) {
  const Key k(shape);
  DeviceState& s = state(ctx);
  std::lock_guard lock(s.mu);
  fe::graph::Graph& graph = graph_for(ctx, s, k, false);
  const bf16* base = qkv;
  run(ctx, s, graph, k,
      {{kQ, mut(base)},
       {kK, mut(base + k.h * k.d)},
       {kV, mut(base + (k.h + k.g) * k.d)},
       {kO, o},
       {kStats, lse}},
      "forward");
}

void backward(Context& ctx, const Shape& shape, const bf16* dout, const bf16* qkv, const bf16* o,
              const float* lse, bf16* dqkv) {
  const Key k(shape);
  DeviceState& s = state(ctx);
  std::lock_guard lock(s.mu);
  fe::graph::Graph& graph = graph_for(ctx, s, k, true);
  const bf16* base = qkv;
  bf16* dbase = dqkv;
  run(ctx, s, graph, k,
      {{kQ, mut(base)},
       {kK, mut(base + k.h * k.d)},
       {kV, mut(base + (k.h + k.g) * k.d)},
       {kO, mut(o)},
       {kDO, mut(dout)},
       {kStats, mut(lse)},
       {kDQ, dbase},
       {kDK, dbase + k.h * k.d},
       {kDV, dbase + (k.h + k.g) * k.d}},
      "backward");
}

size_t graphs(Context& ctx) {
  DeviceState& s = state(ctx);
  std::lock_guard lock(s.mu);
  return s.forward.size() + s.backward.size();
}

}  // namespace weft::cuda::sdpa
