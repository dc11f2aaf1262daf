// Causal attention through cuDNN's fused scaled-dot-product attention (the
// SDPA graphs of cudnn-frontend): a flash-attention kernel that never writes
// the (B, H, T, T) scores. Built only when meson finds cudnn-frontend's
// headers and cuDNN (WEFT_CUDNN); the unfused path is src/cuda/attention.cc.
//
// cuDNN's kernels take bf16 q, k, v and give bf16 outputs, with fp32 softmax
// statistics. With fp32 activations, each call rounds its fp32 inputs into
// bf16 scratch (one element-wise kernel each) and widens the bf16 results
// back:
//
//   forward:  qkv16 = bf16(qkv); O16 = sdpa(q, k, v) read straight from the
//             packed qkv16 through strides; out = float(O16); lse (B, H, T) =
//             the row log-sum-exp of the scaled, masked scores (natural log).
//   backward: qkv16 = bf16(qkv), O16 = bf16(out) (exact: out is O16 widened),
//             dO16 = bf16(dout); dq, dk, dv written by cuDNN into one packed
//             bf16 buffer shaped like qkv; dqkv += float(that buffer).
//
// With bf16 activations (--bf16) qkv and out, and their gradients dout and
// dqkv, are cuDNN's bf16 tensors themselves: the same graphs read and write
// them in place of the scratch copies (a dqkv that is accumulated into gets
// cuDNN's result through bf16 scratch and one rounded add). Both interfaces
// run one core (forward_core, backward_core) on bf16 pointers.
//
// The backward's O is the forward's output read back, not a copy kept in bf16:
// the runner keeps a micro-batch's values until its backward is done, so the
// layer keeps only the lse. cuDNN sums a key/value head's gradient over the
// query heads of its group itself (grouped-query attention: query head i
// reads key/value head i / (H / G), cuDNN's convention too).
//
// At T = 1 cuDNN has no backward (cudnn-frontend refuses s_q = s_kv = 1);
// one position needs none: dq = dk = 0 and dv is dO summed over each group's
// query heads, written into the same bf16 buffer by one element-wise kernel.
//
// Graphs are built once per (B, T, H, G, D) and direction and kept for the
// life of the process, with one cuDNN handle per device; a call after the
// first of its shape builds nothing, and every scratch buffer (bf16 copies,
// cuDNN's workspace) comes from the context's caching allocator.
#include <weft/cuda/kernels.h>

#include "src/cuda/check.h"
#include "src/cuda/launch.h"

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

namespace weft::cuda {

namespace {

namespace fe = cudnn_frontend;

// The tensors' ids in the graphs' variant packs.
enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV };

struct Key {
  int64_t b, t, h, g, d;
  auto tie() const { return std::tie(b, t, h, g, d); }
  bool operator<(const Key& o) const { return tie() < o.tie(); }
};

std::string describe(const Key& k) {
  return fmt::format("B {} T {} H {} G {} D {}", k.b, k.t, k.h, k.g, k.d);
}

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

Key key_of(int64_t b, int64_t t, int64_t h, int64_t g, int64_t d) {
  check(b > 0 && t > 0 && h > 0 && g > 0 && d > 0 && h % g == 0,
        "fused attention: {} query heads must be a multiple of {} key/value heads; B {} T {} D {}",
        h, g, b, t, d);
  check(d % 8 == 0 && d <= 128,
        "fused attention: head size {} must be a multiple of 8 and at most 128 (cuDNN's fused "
        "attention; the unfused backend takes any head size)",
        d);
  return Key{b, t, h, g, d};
}

template <typename T>
void* mut(const T* p) {
  return const_cast<T*>(p);
}

int64_t qkv_size(const Key& k) { return k.b * k.t * (k.h + 2 * k.g) * k.d; }
int64_t out_size(const Key& k) { return k.b * k.t * k.h * k.d; }

// A caller's bf16 array handed to cuDNN as it is: the graphs declare 16-byte
// aligned tensors (cudnn-frontend's default), and the q, k, v heads start at
// multiples of D elements (16 bytes, D % 8 == 0) from qkv.
void check_aligned(const void* p, const char* what, const Key& k) {
  check(reinterpret_cast<uintptr_t>(p) % 16 == 0,
        "fused attention ({}): bf16 {} at {} is not 16-byte aligned (cuDNN's graphs declare "
        "16-byte aligned tensors)",
        describe(k), what, p);
}

// The forward on bf16 qkv16 into bf16 o16 and fp32 lse.
void forward_core(Context& ctx, const Key& k, const bf16* qkv16, bf16* o16, float* lse) {
  DeviceState& s = state(ctx);
  std::lock_guard lock(s.mu);
  fe::graph::Graph& graph = graph_for(ctx, s, k, false);
  const bf16* base = qkv16;
  run(ctx, s, graph, k,
      {{kQ, mut(base)},
       {kK, mut(base + k.h * k.d)},
       {kV, mut(base + (k.h + k.g) * k.d)},
       {kO, o16},
       {kStats, lse}},
      "forward");
}

// The backward on bf16 qkv16, o16 and do16: cuDNN writes dq, dk and dv into
// dqkv16 (packed like qkv), every element of it.
void backward_core(Context& ctx, const Key& k, const bf16* do16, const bf16* qkv16,
                   const bf16* o16, const float* lse, bf16* dqkv16) {
  if (k.t == 1) {
    // cudnn-frontend's sdpa_backward refuses s_q = s_kv = 1 at validate()
    // (GRAPH_NOT_SUPPORTED, "s_q = s_kv = 1 is not supported."). With one
    // position the gradient needs no attention at all: dq = dk = 0 and dv
    // sums dO over its group's query heads, written as cuDNN would write it.
    launch::attention_one_position_backward(ctx.compute_stream(),
                                            reinterpret_cast<const uint16_t*>(do16),
                                            reinterpret_cast<uint16_t*>(dqkv16), k.b, k.h, k.g,
                                            k.d);
    WEFT_LAUNCH_CHECK("attention_one_position_backward");
    return;
  }
  DeviceState& s = state(ctx);
  std::lock_guard lock(s.mu);
  fe::graph::Graph& graph = graph_for(ctx, s, k, true);
  const bf16* base = qkv16;
  bf16* dbase = dqkv16;
  run(ctx, s, graph, k,
      {{kQ, mut(base)},
       {kK, mut(base + k.h * k.d)},
       {kV, mut(base + (k.h + k.g) * k.d)},
       {kO, mut(o16)},
       {kDO, mut(do16)},
       {kStats, mut(lse)},
       {kDQ, dbase},
       {kDK, dbase + k.h * k.d},
       {kDV, dbase + (k.h + k.g) * k.d}},
      "backward");
}

}  // namespace

void fused_attention_forward(Context& ctx, const float* qkv, float* out, float* lse, int64_t b,
                             int64_t t, int64_t h, int64_t g, int64_t d) {
  const Key k = key_of(b, t, h, g, d);
  ctx.make_current();
  const int64_t n_qkv = qkv_size(k), n_out = out_size(k);
  DeviceBuffer<bf16> qkv16(ctx, n_qkv), o16(ctx, n_out);
  to_bf16(ctx, qkv, qkv16.data(), n_qkv);
  forward_core(ctx, k, qkv16.data(), o16.data(), lse);
  to_float(ctx, o16.data(), out, n_out);
}

void fused_attention_forward(Context& ctx, const bf16* qkv, bf16* out, float* lse, int64_t b,
                             int64_t t, int64_t h, int64_t g, int64_t d) {
  const Key k = key_of(b, t, h, g, d);
  check_aligned(qkv, "qkv", k);
  check_aligned(out, "out", k);
  ctx.make_current();
  forward_core(ctx, k, qkv, out, lse);
}

void fused_attention_backward(Context& ctx, const float* dout, const float* qkv, const float* out,
                              const float* lse, float* dqkv, int64_t b, int64_t t, int64_t h,
                              int64_t g, int64_t d, bool accumulate) {
  const Key k = key_of(b, t, h, g, d);
  ctx.make_current();
  const int64_t n_qkv = qkv_size(k), n_out = out_size(k);
  DeviceBuffer<bf16> qkv16(ctx, n_qkv), o16(ctx, n_out), do16(ctx, n_out), dqkv16(ctx, n_qkv);
  to_bf16(ctx, qkv, qkv16.data(), n_qkv);
  to_bf16(ctx, out, o16.data(), n_out);
  to_bf16(ctx, dout, do16.data(), n_out);
  backward_core(ctx, k, do16.data(), qkv16.data(), o16.data(), lse, dqkv16.data());
  if (accumulate)
    add_bf16(ctx, dqkv16.data(), dqkv, n_qkv);
  else
    to_float(ctx, dqkv16.data(), dqkv, n_qkv);  // a fresh dqkv: written, not read
}

void fused_attention_backward(Context& ctx, const bf16* dout, const bf16* qkv, const bf16* out,
                              const float* lse, bf16* dqkv, int64_t b, int64_t t, int64_t h,
                              int64_t g, int64_t d, bool accumulate) {
  const Key k = key_of(b, t, h, g, d);
  check_aligned(qkv, "qkv", k);
  check_aligned(out, "out", k);
  check_aligned(dout, "dout", k);
  check_aligned(dqkv, "dqkv", k);
  ctx.make_current();
  if (!accumulate) {  // a fresh dqkv: cuDNN writes it
    backward_core(ctx, k, dout, qkv, out, lse, dqkv);
    return;
  }
  DeviceBuffer<bf16> dqkv16(ctx, qkv_size(k));
  backward_core(ctx, k, dout, qkv, out, lse, dqkv16.data());
  add_inplace(ctx, dqkv, dqkv16.data(), qkv_size(k));
}

size_t fused_attention_graphs(Context& ctx) {
  DeviceState& s = state(ctx);
  std::lock_guard lock(s.mu);
  return s.forward.size() + s.backward.size();
}

}  // namespace weft::cuda
