// The planner: enumerate layouts, refuse what train_gpt refuses or what does
// not fit, time the rest with the simulator, rank them. The cost model is
// described in weft/plan.h.
#include <weft/error.h>
#include <weft/plan.h>
#include <weft/units.h>

#include <fmt/core.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>

namespace weft::plan {
namespace {

double num(const nlohmann::json& j, const char* key, const std::string& path, const char* what) {
  const auto it = j.find(key);
  check(it != j.end() && it->is_number(), "--profile {}: {} has no number \"{}\"", path, what,
        key);
  const double v = it->get<double>();
  check(std::isfinite(v) && v >= 0, "--profile {}: {}.{} = {} must be finite and not negative",
        path, what, key, v);
  return v;
}

void add(PartCosts& to, const PartCosts& p, double k = 1) {
  to.f += k * p.f;
  to.i += k * p.i;
  to.w += k * p.w;
  to.param_bytes += k * p.param_bytes;
  to.stash_bytes += k * p.stash_bytes;
  to.whole_stash_bytes += k * p.whole_stash_bytes;
  to.kept_bytes += k * p.kept_bytes;
  to.column_gemms += k * p.column_gemms;
  to.rf += k * p.rf;
  to.ri += k * p.ri;
  to.rw += k * p.rw;
}

// Whether every tensor-parallel rank runs a node whole: a block's norms and
// residual adds (their inputs are the full activations every rank holds),
// and the embedding (each rank looks up every token in its vocabulary slice
// and writes the whole output). The rest (the QKV, projection and MLP
// GEMMs, attention over a rank's heads, the activation between the MLP's
// GEMMs, the vocabulary-parallel head and loss) computes a 1/tp share.
bool replicated_in_tp(const std::string& name) {
  const size_t dot = name.rfind('.');
  const std::string last = dot == std::string::npos ? name : name.substr(dot + 1);
  return last.rfind("ln", 0) == 0 || last.rfind("res", 0) == 0 ||
         last.find("norm") != std::string::npos || last == "embed" || last == "embedding_skip";
}

// An all-reduce of `bytes` over n ranks, as MPI and NCCL run them: 2
// ceil(log2 n) rounds (reduce-scatter by recursive halving, then all-gather
// by recursive doubling, what MPICH runs above 2 KiB; a tree's depth), each
// a message's latency plus a wake (every round waits on a peer), and the
// bandwidth term of those algorithms and of a ring, 2 (n - 1) / n of the
// bytes through each rank's link.
double all_reduce(const Link& link, double bytes, int n, double wake) {
  if (n <= 1) return 0;
  const double rounds = 2.0 * std::ceil(std::log2(static_cast<double>(n)));
  return rounds * (link.latency + wake) + 2.0 * (n - 1) / n * bytes / link.bandwidth;
}

// What F holds beyond its nodes' outputs, per block and in the head (into
// out.layer and out.post, per profiled micro-batch): each stage's measured
// bytes (memory.f) less its outputs (stash_bytes). The stages without the
// head give a block's (the embedding keeps nothing beyond its output); the
// last stage's rest is the head's. Nothing where the profile has no measured
// bytes or was taken with --recompute (its F keeps only the boundary).
void kept_bytes(const nlohmann::json& p, size_t blocks, LayerCosts& out) {
  if (p.value("recompute", false) || !p.contains("stages") || !p["stages"].is_array()) return;
  std::map<std::string, size_t> index;
  size_t first_post = 0, block_nodes = 0;
  for (size_t k = 0; k < p["nodes"].size(); ++k) {
    const std::string name = p["nodes"][k]["name"].get<std::string>();
    index[name] = k;
    if (name.rfind("h.", 0) == 0) first_post = k + 1, ++block_nodes;
  }
  const double per_block = static_cast<double>(block_nodes) / static_cast<double>(blocks);
  double body_extra = 0, body_blocks = 0, head_extra = 0, head_blocks = 0;
  bool head_seen = false;
  for (const nlohmann::json& st : p["stages"]) {
    if (!st.contains("memory") || !st["memory"].is_object() || !st.contains("first") ||
        !st.contains("last") || !index.count(st.value("first", "")) ||
        !index.count(st.value("last", "")))
      return;
    const size_t a = index[st["first"].get<std::string>()], b = index[st["last"].get<std::string>()];
    double n = 0;  // the stage's blocks (its block nodes over a block's)
    for (size_t k = a; k <= b; ++k)
      n += p["nodes"][k]["name"].get<std::string>().rfind("h.", 0) == 0 ? 1 : 0;
    n /= per_block;
    const double extra = st["memory"].value("f", 0.0) - st.value("stash_bytes", 0.0);
    if (b >= first_post) {
      head_extra += extra, head_blocks += n, head_seen = true;
    } else {
      body_extra += extra, body_blocks += n;
    }
  }
  if (body_blocks <= 0 || !head_seen) return;
  out.layer.kept_bytes = std::max(0.0, body_extra / body_blocks);
  out.post.kept_bytes = std::max(0.0, head_extra - head_blocks * out.layer.kept_bytes);
}

std::vector<int> divisors(int n) {
  std::vector<int> d;
  for (int k = 1; k <= n; ++k)
    if (n % k == 0) d.push_back(k);
  return d;
}

}  // namespace

double ModelShape::params() const {
  const double h = static_cast<double>(hidden);
  return static_cast<double>(layers) * (12 * h * h + 13 * h) +
         static_cast<double>(vocab + seq) * h + 2 * h;
}

LayerCosts profile_costs(const nlohmann::json& p, const std::string& path) {
  check(p.is_object() && p.contains("nodes") && p["nodes"].is_array(),
        "--profile {}: no \"nodes\" list; `train_gpt --pp P --profile FILE` writes one", path);
  const auto mb = p.find("micro_batch_size");
  check(mb != p.end() && mb->is_number_integer() && mb->get<int64_t>() >= 1,
        "--profile {}: no \"micro_batch_size\" (whole number >= 1); profiles written by "
        "train_gpt --profile say it",
        path);
  const auto tp = p.find("tp");
  check(tp == p.end() || (tp->is_number_integer() && tp->get<int64_t>() == 1),
        "--profile {}: profiled at tp {}; the planner reads node costs of the whole model (a "
        "profile at tp 1)",
        path, tp == p.end() ? "1" : tp->dump());
  const double per = 1.0 / static_cast<double>(mb->get<int64_t>());
  std::map<int, PartCosts> blocks;
  PartCosts pre, post;
  double boundary = 0;
  for (const nlohmann::json& n : p["nodes"]) {
    check(n.is_object() && n.contains("name") && n["name"].is_string(),
          "--profile {}: a node without a \"name\"", path);
    const std::string name = n["name"].get<std::string>();
    const std::string what = "node " + name;
    PartCosts c{num(n, "f", path, what.c_str()), num(n, "i", path, what.c_str()),
                num(n, "w", path, what.c_str()), num(n, "param_bytes", path, what.c_str()),
                num(n, "activation_bytes", path, what.c_str())};
    if (replicated_in_tp(name)) c.rf = c.f, c.ri = c.i, c.rw = c.w;
    // Profiles from before "tp_whole" name the replicated nodes only.
    const auto whole = n.find("tp_whole");
    if (n.value("kind", "") == "gelu_mlp") {
      // The MLP node (layers/gelu_mlp.h): its output is whole on every rank
      // (after the row-parallel sum), the hidden values it keeps are split,
      // and its first GEMM is column-parallel.
      c.whole_stash_bytes = num(n, "output_bytes", path, what.c_str());
      c.column_gemms = 1;
    } else if (whole != n.end() ? whole->is_boolean() && whole->get<bool>()
                                : replicated_in_tp(name)) {
      c.whole_stash_bytes = c.stash_bytes;
    } else if (whole != n.end() && n.value("kind", "") == "linear") {
      c.column_gemms = 1;
    }
    int block = -1;
    if (name.rfind("h.", 0) == 0) block = std::atoi(name.c_str() + 2);
    if (block >= 0) {
      add(blocks[block], c);
      if (n.contains("output_bytes") && n["output_bytes"].is_number())
        boundary = n["output_bytes"].get<double>();  // the block's last node: its output
    } else {
      add(blocks.empty() ? pre : post, c);
    }
  }
  check(!blocks.empty(), "--profile {}: no transformer blocks (nodes named h.N.*)", path);
  LayerCosts out;
  for (const auto& [b, c] : blocks) add(out.layer, c, 1.0 / static_cast<double>(blocks.size()));
  add(out.pre, pre);
  add(out.post, post);
  kept_bytes(p, blocks.size(), out);
  out.weight_copy_ratio = p.value("activation_dtype", "fp32") == "bf16" ? 0.5 : 0;
  for (PartCosts* c : {&out.layer, &out.pre, &out.post}) {
    PartCosts scaled;
    add(scaled, *c, per);
    scaled.param_bytes = c->param_bytes;  // weights do not grow with the batch
    scaled.column_gemms = c->column_gemms;
    *c = scaled;
  }
  out.boundary_bytes = boundary * per;
  // Seconds of update per parameter byte, and the bytes I keeps per byte F
  // stashes, from the stages where the profile has them.
  double upd = 0, params = 0, kept = 0, stashed = 0;
  if (p.contains("stages") && p["stages"].is_array())
    for (const nlohmann::json& st : p["stages"]) {
      if (st.contains("update") && st["update"].is_number()) upd += st["update"].get<double>();
      if (st.contains("memory") && st["memory"].is_object()) {
        kept += st["memory"].value("i", 0.0);
        stashed += st["memory"].value("f", 0.0);
      }
    }
  for (const auto& [b, c] : blocks) params += c.param_bytes;
  params += pre.param_bytes + post.param_bytes;
  out.update_per_param_byte = params > 0 ? upd / params : 0;
  if (stashed > 0) out.input_grad_ratio = kept / stashed;
  return out;
}

LayerCosts flops_costs(const ModelShape& s, double flops_per_second, double memory_bandwidth,
                       Recipe r) {
  check(flops_per_second > 0 && memory_bandwidth > 0,
        "flops_costs: FLOP/s ({}) and memory bandwidth ({}) must be positive", flops_per_second,
        memory_bandwidth);
  check(r.activation_bytes == 4 || r.activation_bytes == 2,
        "flops_costs: activations of {} bytes: fp32 (4) or bf16 (2)", r.activation_bytes);
  const double h = static_cast<double>(s.hidden), t = static_cast<double>(s.seq);
  const double v = static_cast<double>(s.vocab), a = static_cast<double>(s.heads);
  const double b = r.activation_bytes;
  LayerCosts c;
  const double block_f = t * (24 * h * h + 4 * t * h) / flops_per_second;
  c.layer = {block_f, block_f, t * 24 * h * h / flops_per_second, 4 * (12 * h * h + 13 * h),
             b * t * 18 * h};
  c.layer.kept_bytes = t * (16 + (r.fused_attention ? 4 * a : 4 * a * t));
  const double head = t * 2 * h * v / flops_per_second;
  c.pre = {0, 0, 0, 4 * (v + t) * h, b * t * h};
  c.post = {head, head, head, 4 * 2 * h, b * t * h + 4};
  c.post.kept_bytes = t * (8 + b * v + 4);
  // Whole on every tensor-parallel rank: a block's two norms, two residual
  // sums and two row-parallel outputs (6 of its 18 h per token), the
  // embedding's output and the final norm's.
  c.layer.whole_stash_bytes = b * t * 6 * h;
  c.layer.column_gemms = 2;
  c.pre.whole_stash_bytes = b * t * h;
  c.post.whole_stash_bytes = b * t * h;
  c.boundary_bytes = b * t * h;
  c.weight_copy_ratio = r.activation_bytes == 2 ? 0.5 : 0;
  c.update_per_param_byte = 32.0 / 4.0 / memory_bandwidth;
  return c;
}

std::string Layout::describe() const {
  std::string s = fmt::format("(dp {}, pp {}, tp {})", dp, pp, tp);
  if (pp > 1) s += fmt::format(" {}", schedule) + (chunks > 1 ? fmt::format(" x{}", chunks) : "");
  s += fmt::format(" mb {}", micro_batch);
  if (recompute) s += " recompute";
  if (zero1) s += zero3 ? " zero-3" : zero2 ? " zero-2" : " zero-1";
  if (sequence_parallel) s += " sequence-parallel";
  return s;
}

std::vector<std::string> Layout::flags() const {
  std::vector<std::string> f = {"--tp", std::to_string(tp), "--pp", std::to_string(pp),
                                "--micro-batch-size", std::to_string(micro_batch)};
  if (pp > 1) {
    f.insert(f.end(), {"--schedule", schedule, "--virtual-stages", std::to_string(chunks)});
    if (recompute) f.push_back("--recompute");
  }
  if (zero3) {
    f.insert(f.end(), {"--data-parallel-sharding-strategy", "optim_grads_params"});
  } else if (zero2) {
    f.insert(f.end(), {"--data-parallel-sharding-strategy", "optim_grads"});
  } else if (zero1) {
    f.push_back("--use-distributed-optimizer");
  }
  if (sequence_parallel) f.push_back("--sequence-parallel");
  return f;
}

std::string layout_rule(const ModelShape& shape, int64_t global, int world, const Layout& l) {
  if (l.dp < 1 || l.pp < 1 || l.tp < 1 || static_cast<int64_t>(l.dp) * l.pp * l.tp != world)
    return fmt::format("dp ({}) x pp ({}) x tp ({}) must be the world ({})", l.dp, l.pp, l.tp,
                       world);
  if (shape.heads % l.tp != 0)
    return fmt::format(
        "--num-attention-heads ({}) must be divisible by --tensor-model-parallel-size ({})",
        shape.heads, l.tp);
  // The vocabulary needs no rule: train_gpt pads it to a multiple of tp
  // (--make-vocab-size-divisible-by), so every tp splits it.
  if (l.sequence_parallel && l.tp < 2)
    return fmt::format(
        "--sequence-parallel needs --tensor-model-parallel-size above 1 (got {}): it splits "
        "the tokens across the tensor-parallel ranks",
        l.tp);
  if (l.sequence_parallel && shape.seq % l.tp != 0)
    return fmt::format(
        "--sequence-parallel splits the sequence across the tensor-parallel ranks: "
        "--seq-length ({}) must be divisible by --tensor-model-parallel-size ({})",
        shape.seq, l.tp);
  if (l.pp > 1) {
    const std::string rule = sched::chunks_rule(l.schedule, l.chunks);
    if (!rule.empty()) return fmt::format("--virtual-stages {}: {}", l.chunks, rule);
  }
  const int chunks = l.pp > 1 ? l.chunks : 1;
  if (shape.layers < static_cast<int64_t>(l.pp) * chunks)
    return fmt::format(
        "--num-layers ({}) must be at least --pp ({}) x virtual stages ({}): every stage needs "
        "a layer",
        shape.layers, l.pp, chunks);
  if (l.micro_batch < 1 || global % (l.micro_batch * l.dp) != 0)
    return fmt::format(
        "--global-batch-size ({}) must be divisible by --micro-batch-size ({}) x dp ({}) (dp = "
        "world {} / (tp {} x pp {}))",
        global, l.micro_batch, l.dp, world, l.tp, l.pp);
  if (l.pp > 1) {
    try {
      sched::make_schedule(l.schedule, l.pp, static_cast<int>(l.micro_batches(global)), chunks);
    } catch (const Error& e) {
      return e.what();
    }
  } else if (l.recompute) {
    return "--recompute shapes the pipeline, and there is none: it needs --pp > 1 (--pp is 1)";
  }
  return "";
}

// The data-parallel traffic of a step in all-reduces of the parameters:
// one; ZeRO-2's M reduce-scatters and one all-gather, each half of one;
// ZeRO-3's M reduce-scatters and 2 M all-gathers.
double dp_rounds(const Layout& l, int64_t mbs) {
  const double m = static_cast<double>(mbs);
  if (l.zero3) return 3 * m / 2;
  if (l.zero2) return (m + 1) / 2;
  return 1;
}

Plan evaluate(const PlanInput& in, const Layout& l) {
  const ModelShape& shape = in.shape;
  const LayerCosts& c = in.costs;
  const Machine& m = in.machine;
  const int chunks = l.pp > 1 ? l.chunks : 1;
  const int stages = l.pp * chunks;
  const int64_t mbs = l.micro_batches(in.global_batch);
  const double mb = static_cast<double>(l.micro_batch), tp = l.tp;
  // Links: tp innermost, then dp, then pp outermost (Megatron's order).
  const int per_node = m.ranks_per_node > 0 ? m.ranks_per_node : m.world;
  const Link& tp_link = l.tp <= per_node ? m.intra : m.inter;
  const Link& dp_link = l.tp * l.dp <= per_node ? m.intra : m.inter;
  const Link& pp_link = m.world <= per_node ? m.intra : m.inter;

  const sched::Schedule s = sched::lower(
      sched::make_schedule(l.pp > 1 ? l.schedule : "1f1b", l.pp, static_cast<int>(mbs), chunks));
  // Layers per stage as evenly as possible, the first stages taking the rest.
  std::vector<int64_t> layers(static_cast<size_t>(stages), shape.layers / stages);
  for (int64_t k = 0; k < shape.layers % stages; ++k) ++layers[static_cast<size_t>(k)];
  const double act = c.boundary_bytes * mb;  // a micro-batch's activations at a boundary
  // Tensor parallelism's all-reduces of the activations (or their
  // gradients), each `act` bytes: per block two in F (after the attention's
  // and the MLP's row-parallel projections) and two in I (into the
  // column-parallel QKV and first MLP GEMM); the embedding's sum over the
  // vocabulary slices in F; the vocabulary-parallel loss's row maxima and
  // sums (2 N floats together, small) in F, and the final norm's gradient
  // into the column-parallel head in I.
  const double tp_ar = all_reduce(tp_link, act, l.tp, m.wake);
  const double tp_small =
      all_reduce(tp_link, act / std::max<double>(1, static_cast<double>(shape.hidden)), l.tp,
                 m.wake);
  const bool sp = l.sequence_parallel && l.tp > 1;
  const double message = sp ? act / tp : act;  // what a tp rank sends between stages
  sched::SimCost cost;
  std::vector<sched::StageBytes> bytes(static_cast<size_t>(stages));
  std::vector<double> stage_params(static_cast<size_t>(stages));
  for (int st = 0; st < stages; ++st) {
    const size_t k = static_cast<size_t>(st);
    PartCosts p;
    add(p, c.layer, static_cast<double>(layers[k]));
    if (st == 0) add(p, c.pre);
    if (st == stages - 1) add(p, c.post);
    const double n = static_cast<double>(layers[k]);
    const double scale = c.compute_scale * mb;
    // A 1/tp share of the split work, all of the replicated work; under
    // sequence parallelism the replicated work but the embedding's is split.
    double rf = p.rf, ri = p.ri, rw = p.rw;
    if (sp) {
      const double keep = st == 0 ? 1 : 0;
      rf = keep * c.pre.rf + (p.rf - keep * c.pre.rf) / tp;
      ri = keep * c.pre.ri + (p.ri - keep * c.pre.ri) / tp;
      rw = keep * c.pre.rw + (p.rw - keep * c.pre.rw) / tp;
    }
    double f = ((p.f - p.rf) / tp + rf) * scale, i = ((p.i - p.ri) / tp + ri) * scale;
    const double w = ((p.w - p.rw) / tp + rw) * scale;
    // The collectives wait on the other tensor-parallel ranks: no core.
    double f_wait = 0, i_wait = 0, w_wait = 0;
    if (l.tp > 1) {
      f_wait = 2 * n * tp_ar + (st == 0 ? tp_ar : 0) + (st == stages - 1 ? 2 * tp_small : 0);
      i_wait = 2 * n * tp_ar + (st == stages - 1 ? tp_ar : 0);
      // W's gathers: four per block, the head's input; the embedding's
      // output gradient.
      if (sp) w_wait = (4 * n + (st == 0 ? 1 : 0) + (st == stages - 1 ? 1 : 0)) * tp_ar / 2;
    }
    if (l.recompute) i += f, i_wait += f_wait;  // the forward again, before the input gradient
    cost.f.push_back(f);
    cost.i.push_back(i);
    cost.w.push_back(w);
    cost.f_wait.push_back(f_wait);
    cost.i_wait.push_back(i_wait);
    cost.w_wait.push_back(w_wait);
    cost.activation_bytes.push_back(message);
    stage_params[k] = p.param_bytes / tp;
    cost.update.push_back(c.update_per_param_byte * stage_params[k] / (l.zero1 ? l.dp : 1));
    // Whole outputs on every tp rank, a 1/tp share of the split ones and of
    // what F keeps beyond its outputs.
    const double split = p.stash_bytes - p.whole_stash_bytes + p.kept_bytes;
    const double stash = ((sp ? p.whole_stash_bytes / tp : p.whole_stash_bytes) + split / tp) * mb;
    // I's gradients as F's outputs, and under tp the column-parallel GEMMs'
    // whole partial input gradients (under sequence parallelism in the
    // shared buffers instead).
    const double partials = l.tp > 1 && !sp ? p.column_gemms * act : 0;
    sched::StageBytes& b = bytes[k];
    b.recv_f = st > 0 ? message : 0;
    b.recv_b = st + 1 < stages ? message : 0;
    if (l.recompute && (l.schedule == "zb-h1" || l.schedule == "zb-v")) {
      // The backward is split (sched::folds_weights): I replays the stage
      // into its slot, where W finds it.
      b.f = message;
      b.f_work = stash;
      b.i = stash * (1 + c.input_grad_ratio) + partials;
    } else if (l.recompute) {
      b.f = message;
      b.f_work = stash;
      b.i_work = stash * (1 + c.input_grad_ratio) + partials;
      b.i_keep = st > 0 ? message : 0;
    } else {
      b.f = stash;
      b.i = stash * c.input_grad_ratio + partials;
    }
  }
  cost.link_latency = pp_link.latency;
  cost.bandwidth = pp_link.bandwidth;
  cost.memory = bytes;
  cost.recompute = l.recompute;
  cost.cores = m.cores;
  cost.wake = m.wake;
  cost.processes_per_rank = l.dp * l.tp;
  const sched::SimResult r = sched::simulate(s, cost);

  Plan out;
  out.layout = l;
  out.layout.chunks = chunks;
  out.micro_batches = mbs;
  out.pipeline_time = r.pipeline_time;
  out.update_time = r.update_time;
  out.bubble = r.bubble_fraction;
  // Gradients over dp after the pipeline drains (the slowest rank's share);
  // ZeRO-1 reduce-scatters and all-gathers the same bytes.
  double most_params = 0;
  std::vector<double> rank_params(static_cast<size_t>(l.pp), 0);
  for (int st = 0; st < stages; ++st)
    rank_params[static_cast<size_t>(s.stage_rank[static_cast<size_t>(st)])] +=
        stage_params[static_cast<size_t>(st)];
  most_params = *std::max_element(rank_params.begin(), rank_params.end());
  out.dp_time = all_reduce(dp_link, most_params, l.dp, m.wake);
  // ZeRO-2: a reduce-scatter (half an all-reduce) per micro-batch, and the
  // all-gather. ZeRO-3: per micro-batch the reduce-scatter and two
  // all-gathers (before the forward, and again before the backward), and
  // none after the update. Counted whole, as ZeRO-2's: the prefetch hides
  // some of it behind the compute, which this does not credit.
  const double gathers = dp_rounds(l, mbs);
  out.dp_time *= gathers;
  out.step_time = out.pipeline_time + out.dp_time + out.update_time;
  // Memory: weights, gradients and AdamW's two moments, as the strategy
  // shards them (weft/plan.h), on the rank that holds the most.
  out.activation_bytes = *std::max_element(r.peak_activation_bytes.begin(),
                                           r.peak_activation_bytes.end());
  const double dp = static_cast<double>(l.dp);
  const double h = static_cast<double>(shape.hidden);
  // The tied embedding, vocabulary-parallel: wte's bytes on a tp rank.
  const double embedding_bytes = 4.0 * static_cast<double>(shape.vocab) * h / tp;
  // ZeRO-2's pool buffer: the default bucket, or the largest tensor that is
  // a bucket of its own (an MLP matrix; at pp 1 the tied embedding, whose
  // bucket is open from the head's W to the embedding's).
  const double bucket = 1 << 20;  // GradSyncOptions::bucket_elements' default
  const double largest_bucket =
      std::max({4.0 * bucket, 4.0 * 4 * h * h / tp, l.pp == 1 ? embedding_bytes : 0.0});
  // ZeRO-3's pool of gathered buckets: twice the most buckets one node
  // touches (at least 2), each as large as the largest bucket, with its bf16
  // half under bf16 activations. The node is the MLP, (8 h^2 + 5 h) / tp
  // elements: where a matrix outgrows the default bucket, each matrix and
  // each bias after it opens a bucket of its own (4); else it spans as many
  // default buckets as it fills.
  const double mlp = (8 * h * h + 5 * h) / tp;
  const double node_buckets = 4 * h * h / tp > bucket ? 4 : std::ceil(mlp / bucket);
  const double gathered =
      std::max(2.0, 2 * node_buckets) * largest_bucket * (1 + c.weight_copy_ratio);
  double state = 0;
  for (int rank = 0; rank < l.pp; ++rank) {
    const double p = rank_params[static_cast<size_t>(rank)];
    double here = 4 * p;  // values, gradients, two moments
    if (l.zero3) {
      // Values sliced like the gradients; the tied embedding keeps both whole.
      const bool tied = l.pp > 1 && (rank == 0 || rank == s.stage_rank.back());
      const double whole = tied ? embedding_bytes : 0;
      here = 2 * ((p - whole) / dp + whole * (1 + 1 / dp)) + 2 * p / dp +
             4 * largest_bucket * (1 + 1 / dp) + gathered + c.weight_copy_ratio * whole;
      state = std::max(state, here);
      continue;
    }
    if (l.zero2) {
      // The tied embedding (on the first and last pipeline ranks, when
      // they differ) keeps its whole gradient and its slice.
      const bool tied = l.pp > 1 && (rank == 0 || rank == s.stage_rank.back());
      const double whole = tied ? embedding_bytes : 0;
      here = p + (p - whole) / dp + whole * (1 + 1 / dp) + 2 * p / dp +
             4 * largest_bucket * (1 + 1 / dp);
    } else if (l.zero1) {
      here = p + p * (1 + 1 / dp) + 2 * p / dp;
    }
    here += c.weight_copy_ratio * p;  // whole on every replica, unless gathered (ZeRO-3)
    state = std::max(state, here);
  }
  // Sequence parallelism's shared buffers: two whole activations and a slice.
  const double shared = sp ? (2 + 1 / tp) * act : 0;
  out.memory_per_rank = state + out.activation_bytes + shared;
  // Bytes: every replica's pipeline messages (each tp rank sends its copy),
  // tp's all-reduces (2 (tp - 1) / tp of the tensor per rank), dp's.
  const double pp_bytes =
      std::accumulate(r.bytes_sent.begin(), r.bytes_sent.end(), 0.0) * l.tp * l.dp;
  // Sequence parallelism's gathers in W: 2 L + 1 more all-reduces' worth.
  const double tp_collectives = 4 * static_cast<double>(shape.layers) + 2 +
                                (sp ? 2 * static_cast<double>(shape.layers) + 1 : 0);
  const double tp_bytes =
      l.tp > 1 ? tp_collectives * 2.0 * (tp - 1) * act * static_cast<double>(mbs) * l.dp : 0;
  double params_all = std::accumulate(stage_params.begin(), stage_params.end(), 0.0) * tp;
  double dp_bytes = l.dp > 1 ? 2.0 * (l.dp - 1) * params_all : 0;
  dp_bytes *= gathers;
  out.bytes_per_step = pp_bytes + tp_bytes + dp_bytes;
  return out;
}

PlanResult plan(const PlanInput& in) {
  const Machine& m = in.machine;
  check(m.world >= 1, "plan: the world ({}) must be at least 1 rank", m.world);
  check(in.shape.layers >= 1 && in.shape.hidden >= 1 && in.shape.heads >= 1 &&
            in.shape.seq >= 1 && in.shape.vocab >= 1,
        "plan: the model shape needs layers, hidden size, heads, sequence length and "
        "vocabulary of at least 1");
  check(in.global_batch >= 1, "plan: the global batch ({}) must be at least 1", in.global_batch);
  check(m.memory > 0, "plan: the memory per rank ({}) must be positive", m.memory);
  const Constraints& fx = in.fixed;
  PlanResult out;
  std::map<std::string, std::pair<std::string, int>> reasons;  // rule kind -> example, count
  auto refuse = [&](const std::string& why) {
    ++out.refused;
    const std::string kind = why.substr(0, why.find_first_of("(0123456789"));
    auto& [example, count] = reasons[kind];
    if (count++ == 0) example = why;
  };
  std::vector<std::string> schedules = sched::schedule_names();
  for (int tp : fx.tp ? std::vector<int>{*fx.tp} : divisors(m.world)) {
    for (int pp : fx.pp ? std::vector<int>{*fx.pp} : divisors(m.world / std::max(1, tp))) {
      if (tp < 1 || pp < 1 || m.world % (tp * pp) != 0) {
        refuse(fmt::format("--tp ({}) x --pp ({}) must divide the world ({})", tp, pp, m.world));
        continue;
      }
      const int dp = m.world / (tp * pp);
      if (fx.dp && *fx.dp != dp) continue;
      for (const std::string& name : pp > 1 ? schedules : std::vector<std::string>{"1f1b"}) {
        if (pp > 1 && fx.schedule && *fx.schedule != name) continue;
        std::vector<int> chunk_counts = {sched::default_chunks(name)};
        if (pp > 1 && name == "interleaved-1f1b") chunk_counts = {2, 3, 4};
        if (pp == 1) chunk_counts = {1};
        for (int chunks : chunk_counts) {
          if (pp > 1 && fx.chunks && *fx.chunks != chunks) continue;
          for (int64_t mb = 1; mb <= std::max<int64_t>(1, fx.max_micro_batch); mb *= 2) {
            if (fx.micro_batch && *fx.micro_batch != mb) continue;
            for (bool recompute : {false, true}) {
              if (fx.recompute && *fx.recompute != recompute) continue;
              if (recompute && pp == 1) continue;  // no pipeline to recompute in
              for (int zero : {0, 1, 2, 3}) {
                const bool zero1 = zero >= 1, zero2 = zero >= 2, zero3 = zero == 3;
                if (fx.zero1 && *fx.zero1 != zero1) continue;
                if (fx.zero2 && *fx.zero2 != zero2) continue;
                if (fx.zero3 && *fx.zero3 != zero3) continue;
                if (zero1 && dp == 1 && !fx.zero1) continue;  // nothing to shard
                for (bool sp : {false, true}) {
                  if (fx.sequence_parallel && *fx.sequence_parallel != sp) continue;
                  if (sp && tp == 1 && !fx.sequence_parallel) continue;  // nothing to split
                  Layout l{dp, pp, tp, name, chunks, mb, recompute, zero1, zero2, sp, zero3};
                  if (const std::string why = layout_rule(in.shape, in.global_batch, m.world, l);
                      !why.empty()) {
                    refuse(why);
                    continue;
                  }
                  Plan p = evaluate(in, l);
                  if (p.memory_per_rank > m.memory) {
                    refuse(fmt::format("needs {} per rank, more than the {} each has",
                                       format_bytes(p.memory_per_rank), format_bytes(m.memory)));
                    continue;
                  }
                  out.plans.push_back(std::move(p));
                }
              }
            }
          }
        }
      }
    }
  }
  // Fastest first; steps equal to 9 digits of the slowest tie, and the one
  // that holds less memory goes first.
  double slowest = 0;
  for (const Plan& p : out.plans) slowest = std::max(slowest, p.step_time);
  const double grain = slowest > 0 ? 1e-9 * slowest : 1;
  std::stable_sort(out.plans.begin(), out.plans.end(), [grain](const Plan& a, const Plan& b) {
    const double ta = std::round(a.step_time / grain), tb = std::round(b.step_time / grain);
    if (ta != tb) return ta < tb;
    return a.memory_per_rank < b.memory_per_rank;
  });
  for (const auto& [kind, ex] : reasons) out.reasons.push_back(ex);
  return out;
}

std::string plan_table(const PlanResult& r, size_t top) {
  constexpr const char* row =
      "{:>4} {:>3} {:>3} {:>3} {:>3} {:<17} {:>6} {:>3} {:>4} {:>9} {:>6} {:>11} {:>8} {:>11} "
      "{:>11}\n";
  std::string out =
      fmt::format(row, "rank", "dp", "pp", "tp", "sp", "schedule", "chunks", "mb", "m", "recompute",
                  "zero", "step ms", "bubble", "memory/rank", "bytes/step");
  const size_t n = top == 0 ? r.plans.size() : std::min(top, r.plans.size());
  for (size_t k = 0; k < n; ++k) {
    const Plan& p = r.plans[k];
    const Layout& l = p.layout;
    const char* zero = l.zero3 ? "3" : l.zero2 ? "2" : l.zero1 ? "1" : "-";
    out += fmt::format(row, k + 1, l.dp, l.pp, l.tp, l.sequence_parallel ? "yes" : "-",
                       l.pp > 1 ? l.schedule : "-", l.chunks, l.micro_batch, p.micro_batches,
                       l.recompute ? "yes" : "no", zero, fmt::format("{:.3f}", 1e3 * p.step_time),
                       fmt::format("{:.1f}%", 100 * std::max(0.0, p.bubble)),
                       format_bytes(p.memory_per_rank), format_bytes(p.bytes_per_step));
  }
  out += fmt::format("{} feasible plans ({} shown); {} refused\n", r.plans.size(), n, r.refused);
  for (const auto& [why, count] : r.reasons) out += fmt::format("  {} x {}\n", count, why);
  return out;
}

}  // namespace weft::plan
