#include <weft/local_communicator.h>
#include <weft/ops.h>
#include <weft/pipeline.h>
#include <weft/profile.h>

#include <algorithm>
#include <fstream>
#include <cmath>
#include <map>

#include <nlohmann/json.hpp>

namespace weft {

using sched::Action;
using sched::ActionKind;

struct PipelineExecutor::Boundary {
  std::vector<int> values;  // sent from stage s to stage s+1, in value order
};

namespace {
constexpr int kRetiring = -2;  // Slot::stage of a slot whose sends are in flight
}  // namespace

struct PipelineExecutor::Slot {
  Slot(const Graph& g, Device device) : mb(g, device) {}
  MicroBatch mb;
  int stage = -1, micro = -1;
  bool input_grad_done = false, weight_done = false, grads_sent = false;
  std::vector<RequestPtr> sends;
};

struct PipelineExecutor::Tied {
  Param* param = nullptr;  // this rank's copy, or null when it holds none
  std::unique_ptr<Communicator> group;
};

PipelineExecutor::PipelineExecutor(const Graph& graph, ModelIO io, StagePlan plan,
                                   sched::Schedule schedule, Communicator& pp,
                                   PipelineOptions options)
    : graph_(graph),
      io_(io),
      plan_(std::move(plan)),
      schedule_(std::move(schedule)),
      pp_(pp),
      options_(options) {
  const int stages = schedule_.stages();
  check(plan_.stages() == stages, "the stage plan has {} stages but schedule '{}' has {}",
        plan_.stages(), schedule_.name, stages);
  check(pp_.size() == schedule_.pp, "schedule '{}' is for {} pipeline ranks, the group has {}",
        schedule_.name, schedule_.pp, pp_.size());
  check(stages <= MessageTag::kMaxChunk, "{} pipeline stages exceed the {} a message tag can name",
        stages, MessageTag::kMaxChunk);
  // Boundaries: values produced by stage <= s and read after it.
  boundary_.resize(static_cast<size_t>(stages));
  const auto& values = graph_.values();
  for (int s = 0; s < stages; ++s) {
    const int end = plan_.begin[static_cast<size_t>(s) + 1];
    for (size_t v = 0; v < values.size(); ++v) {
      const Value& val = values[v];
      if (val.producer < 0 || val.producer >= end) continue;
      if (std::any_of(val.consumers.begin(), val.consumers.end(), [&](int c) { return c >= end; }))
        boundary_[static_cast<size_t>(s)].values.push_back(static_cast<int>(v));
    }
  }
  // This rank's stages and parameters; tied parameters across ranks.
  std::map<std::string, std::vector<int>> holders;  // name -> ranks using it
  std::map<std::string, Param*> by_name;
  for (int s = 0; s < stages; ++s) {
    const int r = schedule_.stage_rank[static_cast<size_t>(s)];
    if (r == pp_.rank()) local_stages_.push_back(s);
    for (Param* p : graph_.params(plan_.begin[static_cast<size_t>(s)],
                                  plan_.begin[static_cast<size_t>(s) + 1])) {
      auto& h = holders[p->name];
      if (std::find(h.begin(), h.end(), r) == h.end()) h.push_back(r);
      by_name[p->name] = p;
    }
  }
  for (auto& [name, ranks] : holders) {
    std::sort(ranks.begin(), ranks.end());
    const bool mine = std::find(ranks.begin(), ranks.end(), pp_.rank()) != ranks.end();
    if (mine) params_.push_back(by_name[name]);
    if (mine && ranks.front() == pp_.rank()) norm_params_.push_back(by_name[name]);
    if (ranks.size() < 2) continue;
    // Every rank takes part in each split, in the same (name) order.
    std::vector<std::vector<int>> groups = {ranks};
    for (int r = 0; r < pp_.size(); ++r)
      if (std::find(ranks.begin(), ranks.end(), r) == ranks.end()) groups.push_back({r});
    Tied t;
    t.param = mine ? by_name[name] : nullptr;
    t.group = pp_.split(groups, "tied " + name);
    tied_.push_back(std::move(t));
  }
  live_.assign(static_cast<size_t>(stages * schedule_.micro_batches), nullptr);
  stage_bytes_.assign(static_cast<size_t>(stages), {});
  step_stats_ = Tensor::zeros({2});
  all_step_stats_ = Tensor::zeros({2 * pp_.size()});
  pp_.barrier();
  epoch_ = std::chrono::steady_clock::now();
  check(options_.recompute_method == RecomputeMethod::None || options_.recompute_layers >= 1,
        "--recompute-num-layers {} must be at least 1", options_.recompute_layers);
  check((options_.recompute ? 1 : 0) + (options_.recompute_method != RecomputeMethod::None) +
                (options_.recompute_core_attention ? 1 : 0) <=
            1,
        "recompute: whole stages, blocks by a method, or attention alone; not two of them");
  // A recompute that would find nothing to recompute is refused, not ignored.
  const auto& nodes = graph_.nodes();
  check(options_.recompute_method == RecomputeMethod::None ||
            std::any_of(nodes.begin(), nodes.end(), [](const Node& n) { return block_of(n.name) >= 0; }),
        "--recompute-method recomputes transformer blocks, the nodes named h.<i> or h.<i>.<...>: "
        "this model has none (name each block's nodes so, as models/gpt.cc does)");
  check(!options_.recompute_core_attention ||
            std::any_of(nodes.begin(), nodes.end(),
                        [](const Node& n) { return std::string_view(n.layer->kind()) == "attention"; }),
        "--recompute-granularity selective recomputes the attention nodes (layer kind "
        "'attention'): this model has none");
  for (int s = 0; s < stages; ++s)
    units_.push_back(
        make_units(plan_.begin[static_cast<size_t>(s)], plan_.begin[static_cast<size_t>(s) + 1]));
  if (io_.loss >= 0) loss_node_ = graph_.values()[static_cast<size_t>(io_.loss)].producer;
  fold_ = sched::folds_weights(schedule_, options_.recomputes());
  if (options_.recomputes()) work_ = std::make_unique<MicroBatch>(graph_, options_.device);
  if (!options_.device.is_cpu())
    for (int v : io_.inputs) {
      const Value& val = graph_.values()[static_cast<size_t>(v)];
      host_inputs_.push_back(Tensor::zeros(val.shape, val.dtype));
    }
  p2p_steps_ = sched::p2p_steps(schedule_.actions[static_cast<size_t>(pp_.rank())]);
}

// Nodes [begin, end) of a stage as ranges: one kept range without
// recompute, one recomputed range with whole stages, and with a method (or
// attention alone) the blocks' (or attention nodes') ranges between kept
// ranges of the other nodes (PipelineOptions).
std::vector<PipelineExecutor::Unit> PipelineExecutor::make_units(int begin, int end) const {
  std::vector<Unit> units;
  auto add = [&](int b, int e, bool recompute) {
    if (b == e) return;
    if (!units.empty() && !recompute && !units.back().recompute) {
      units.back().end = e;  // kept ranges merge
      return;
    }
    units.push_back({b, e, recompute, {}, {}});
  };
  if (options_.recompute_core_attention) {
    for (int n = begin; n < end; ++n)
      add(n, n + 1, std::string_view(graph_.nodes()[static_cast<size_t>(n)].layer->kind()) ==
                        "attention");
  } else if (options_.recompute_method == RecomputeMethod::None) {
    add(begin, end, options_.recompute);
  } else {
    const int per =
        options_.recompute_method == RecomputeMethod::Uniform ? options_.recompute_layers : 1;
    int blocks = 0, open = -1, count = 0, last_block = -1;
    int kept = begin;  // start of the nodes not yet placed
    for (int n = begin; n <= end; ++n) {
      const int b = n < end ? block_of(graph_.nodes()[static_cast<size_t>(n)].name) : -1;
      if (b >= 0 && b == last_block) continue;  // inside the same block
      // A block ends at n: close the group once it holds `per` blocks, or
      // when no block follows.
      if (open >= 0 && (b < 0 || count == per)) {
        add(kept, open, false);
        add(open, n, true);
        kept = n;
        open = -1;
        count = 0;
      }
      last_block = b;
      if (b < 0) continue;
      const bool recomputed = options_.recompute_method == RecomputeMethod::Uniform ||
                              blocks < options_.recompute_layers;
      ++blocks;
      if (!recomputed) continue;
      if (open < 0) open = n;
      ++count;
    }
    add(kept, end, false);
  }
  // What crosses each range's edges.
  const auto& values = graph_.values();
  for (Unit& u : units)
    for (size_t v = 0; v < values.size(); ++v) {
      const Value& val = values[v];
      const bool made = val.producer >= u.begin && val.producer < u.end;
      const bool read_here = std::any_of(val.consumers.begin(), val.consumers.end(),
                                         [&](int c) { return c >= u.begin && c < u.end; });
      const bool read_after = std::any_of(val.consumers.begin(), val.consumers.end(),
                                          [&](int c) { return c >= u.end; });
      if (!made && read_here) u.ins.push_back(static_cast<int>(v));
      if (made && read_after) u.outs.push_back(static_cast<int>(v));
    }
  return units;
}

// "step 3, action 12 (1F4)" without allocating: a timeout names where it was.
void PipelineExecutor::set_step(int64_t step, size_t index, const sched::Action& a) {
  char buf[96];
  // Action texts fit std::string's small buffer, so str() does not allocate.
  auto r = fmt::format_to_n(buf, sizeof(buf), "step {}, action {} ({})", step + 1, index, a.str());
  pp_.set_step(std::string_view(buf, r.size < sizeof(buf) ? r.size : sizeof(buf)));
}

PipelineExecutor::~PipelineExecutor() = default;

namespace {
double used(MicroBatch& mb) { return static_cast<double>(mb.arena().used()); }
}  // namespace

// Called where an action's memory is at its most: after its allocations and
// before anything is freed (a released slot, recompute's work area).
void PipelineExecutor::note_memory() {
  double held = work_ ? used(*work_) : 0;
  for (auto& p : pool_)
    if (p->stage >= 0) held += used(p->mb);
  peak_bytes_ = std::max(peak_bytes_, held);
}

// A (stage, micro-batch) leaves the stash once both its I and its W are done.
void PipelineExecutor::backward_part_done(Slot& s) {
  if (s.input_grad_done && s.weight_done) --stashed_;
}

PipelineExecutor::Slot& PipelineExecutor::slot(int stage, int mb, bool create) {
  Slot*& s = live_[static_cast<size_t>(stage * schedule_.micro_batches + mb)];
  if (s == nullptr) {
    check(create, "stage {} micro-batch {} has no activations here: the schedule runs a backward "
                  "or send before its forward",
          stage, mb);
    for (auto& p : pool_)
      if (p->stage == -1 || (p->stage == kRetiring && sends_done(*p))) {
        s = p.get();
        break;
      }
    if (s == nullptr) {
      pool_.push_back(std::make_unique<Slot>(graph_, options_.device));
      s = pool_.back().get();
    }
    s->stage = stage;
    s->micro = mb;
    s->input_grad_done = s->weight_done = s->grads_sent = false;
    peak_slots_ = std::max(peak_slots_, ++slots_in_use_);
  }
  return *s;
}

// True once every send from the slot has completed; then frees its tensors.
// It asks, never waits: on a GPU the compute stream must not wait for a
// send either, since a send completes only once its receiver has posted the
// receive, which may come after this rank's later work.
bool PipelineExecutor::sends_done(Slot& s) {
  for (auto& r : s.sends)
    if (r && !r->test()) return false;
  s.sends.clear();
  s.mb.reset();
  return true;
}

void PipelineExecutor::release_if_done(int stage, int mb) {
  Slot& s = slot(stage, mb, false);
  const bool needs_send_b =
      stage > 0 && schedule_.stage_rank[static_cast<size_t>(stage) - 1] != pp_.rank();
  if (!s.input_grad_done || !s.weight_done || (needs_send_b && !s.grads_sent)) return;
  // A send still in flight keeps the slot's memory until its receiver takes
  // it (which may be after this rank's next actions): the slot retires and
  // is reused only once its sends are done. Waiting here could deadlock.
  s.stage = sends_done(s) ? -1 : kRetiring;
  s.micro = -1;
  live_[static_cast<size_t>(stage * schedule_.micro_batches + mb)] = nullptr;
  --slots_in_use_;
}

void PipelineExecutor::fill_inputs(Slot& s, int stage, int mb, int64_t step) {
  const int begin = plan_.begin[static_cast<size_t>(stage)];
  const int end = plan_.begin[static_cast<size_t>(stage) + 1];
  bool needs_data = false;
  for (int v : io_.inputs)
    for (int c : graph_.values()[static_cast<size_t>(v)].consumers) needs_data |= c >= begin && c < end;
  if (!needs_data) return;
  if (options_.device.is_cpu()) {  // straight into the arena
    inputs_.clear();
    for (int v : io_.inputs) inputs_.push_back(s.mb.input(v));
    data_->fill(step, mb * micro_batch_size_, inputs_);
    return;
  }
  data_->fill(step, mb * micro_batch_size_, host_inputs_);
  for (size_t k = 0; k < io_.inputs.size(); ++k) s.mb.input(io_.inputs[k]).copy_from(host_inputs_[k]);
}

// Copies `values` (and their gradients when `grads`) from one slot to another
// on the same rank: each slot owns its tensors, so either may be released first.
static void copy_local(const std::vector<int>& values, MicroBatch& from, MicroBatch& to,
                       const Graph& g, bool grads) {
  for (int v : values) {
    const Value& val = g.values()[static_cast<size_t>(v)];
    if (grads) {
      if (!val.requires_grad) continue;
      Tensor t = to.arena().alloc(val.shape, val.dtype);
      t.copy_from(from.grad(v));
      to.grad(v) = t;
    } else {
      Tensor t = to.arena().alloc(val.shape, val.dtype);
      t.copy_from(from.value(v));
      to.value(v) = t;
    }
  }
}

// With recompute a slot keeps only what crosses the edges of its recomputed
// ranges (inputs, outputs later nodes read, gradients to send); a range's
// activations live in the one work MicroBatch, for one forward, or one
// replayed forward + backward. These point `to`'s tensors at `from`'s.
static void share_values(const std::vector<int>& values, MicroBatch& from, MicroBatch& to) {
  for (int v : values)
    if (from.value(v).defined()) to.value(v) = from.value(v);
}
static void share_grads(const std::vector<int>& values, MicroBatch& from, MicroBatch& to) {
  for (int v : values)
    if (from.grad(v).defined()) to.grad(v) = from.grad(v);
}
// Copies into `to` each gradient of `values` that `from` has and that does
// not already live in `to` (a shared or relayed one); returns their bytes.
static double keep_grads(const std::vector<int>& values, MicroBatch& from, MicroBatch& to,
                         bool copy = true) {
  double bytes = 0;
  for (int v : values) {
    const Tensor& g = from.grad(v);
    if (!g.defined() || g.raw() == to.grad(v).raw()) continue;
    bytes += static_cast<double>(Arena::bytes_for(g.shape(), g.dtype()));
    if (!copy) continue;
    Tensor t = to.arena().alloc(g.shape(), g.dtype());
    t.copy_from(g);
    to.grad(v) = t;
  }
  return bytes;
}

void PipelineExecutor::forward_nodes(MicroBatch& m, int begin, int end) {
  if (sync_ == nullptr || !sync_->sharded_params()) {
    forward(graph_, m, begin, end);
    return;
  }
  for (int n = begin; n < end; ++n) {
    sync_->gather(n, n + 1 < end ? n + 1 : -1);
    forward(graph_, m, n, n + 1);
  }
}

void PipelineExecutor::forward_action(int stage, int mb, int64_t step) {
  Slot& s = slot(stage, mb, true);
  peak_stashed_ = std::max(peak_stashed_, ++stashed_);
  sched::StageBytes& bytes = stage_bytes_[static_cast<size_t>(stage)];
  if (stage > 0 && schedule_.stage_rank[static_cast<size_t>(stage) - 1] == pp_.rank()) {
    const double before = used(s.mb);
    copy_local(boundary_[static_cast<size_t>(stage) - 1].values, slot(stage - 1, mb, false).mb,
               s.mb, graph_, false);
    bytes.recv_f = used(s.mb) - before;
  }
  const double before = used(s.mb);
  fill_inputs(s, stage, mb, step);
  double peak = 0;  // the most this action held above `before` at once
  for (const Unit& u : units_[static_cast<size_t>(stage)]) {
    MicroBatch& m = u.recompute ? *work_ : s.mb;
    if (u.recompute) share_values(u.ins, s.mb, m);
    forward_nodes(m, u.begin, u.end);
    if (loss_node_ >= u.begin && loss_node_ < u.end) {
      if (!losses_.defined())
        losses_ = Tensor::zeros({schedule_.micro_batches}, DType::F32, options_.device);
      losses_.slice0(mb, mb + 1).copy_from(m.value(io_.loss).view({1}));
      loss_order_.push_back(mb);
    }
    if (!u.recompute) continue;
    copy_local(u.outs, m, s.mb, graph_, false);
    peak = std::max(peak, used(s.mb) - before + used(m));
    note_memory();
    m.reset();
  }
  bytes.f = used(s.mb) - before;
  bytes.f_work = std::max(0.0, peak - bytes.f);
  note_memory();
}

// With `with_weights` (a B action), each node's W runs right after its I, so
// that the data-parallel buckets fill, and go out, during the backward; the
// bytes each part adds are still counted apart (StageBytes i and w), as
// measure_stage_bytes measures them. With recompute W runs with I too, unless
// the schedule splits the backward: then I replays each recomputed range
// into the slot, where the W action finds what it saved.
void PipelineExecutor::backward_input_action(int stage, int mb, bool with_weights) {
  Slot& s = slot(stage, mb, false);
  const double before = used(s.mb);
  const bool recompute = fold_;  // in the work area, with W
  const bool weights = with_weights || recompute;
  const bool last = stage == schedule_.stages() - 1;
  const std::vector<Unit>& units = units_[static_cast<size_t>(stage)];
  double weight_bytes = 0, peak = 0;
  MicroBatch* low = &s.mb;  // where the stage's first range ran its backward
  for (size_t k = units.size(); k-- > 0;) {
    const Unit& u = units[k];
    MicroBatch& m = u.recompute && fold_ ? *work_ : s.mb;
    if (u.recompute && !fold_) forward_nodes(m, u.begin, u.end);  // into the slot
    if (u.recompute && fold_) {
      share_values(u.ins, s.mb, m);
      forward_nodes(m, u.begin, u.end);
      share_grads(u.outs, s.mb, m);
      share_grads(u.ins, s.mb, m);  // what later ranges added to: accumulated in place
      // The gradients of values relayed through the stage, for the edge below.
      if (k == 0 && stage > 0)
        share_grads(boundary_[static_cast<size_t>(stage) - 1].values, s.mb, m);
    }
    if (last && loss_node_ >= u.begin && loss_node_ < u.end)
      m.seed_grad(io_.loss, 1.0f / static_cast<float>(loss_terms_) * loss_scale_);
    for (int n = u.end - 1; n >= u.begin; --n) {
      if (sync_) sync_->gather(n, n > u.begin ? n - 1 : -1);
      backward_input(graph_, m, n);
      if (!weights) continue;
      const double at = used(s.mb);
      if (sync_) sync_->weight_begin(n, mb);
      backward_weight(graph_, m, n);
      if (sync_) sync_->weight_done(n, mb);
      if (!recompute) weight_bytes += used(s.mb) - at;
    }
    if (!u.recompute || !fold_) continue;
    if (k == 0) {  // its inputs' gradients are the stage's edge, placed below
      low = &m;
      break;
    }
    keep_grads(u.ins, m, s.mb);  // the range's inputs' gradients, into the slot
    peak = std::max(peak, used(s.mb) - before + used(m));
    note_memory();
    m.reset();
  }
  s.input_grad_done = true;
  if (weights) s.weight_done = true;
  backward_part_done(s);
  sched::StageBytes& bytes = stage_bytes_[static_cast<size_t>(stage)];
  if (with_weights && !recompute) bytes.w = weight_bytes;
  bytes.i = used(s.mb) - before - weight_bytes;
  // With recompute over several ranges: the most the ranges above the
  // stage's first held beyond i, before the edge's gradients are placed.
  bytes.i_work_above = std::max(0.0, peak - bytes.i);
  MicroBatch& work = *low;
  if (stage > 0) {
    const auto& edge = boundary_[static_cast<size_t>(stage) - 1].values;
    // With recompute, what the slot must keep of the gradient it sends back:
    // each edge gradient that does not already live in it (a relayed one).
    const bool local = schedule_.stage_rank[static_cast<size_t>(stage) - 1] == pp_.rank();
    bytes.i_keep = keep_grads(edge, work, s.mb, /*copy=*/!local);
    if (local) {
      Slot& prev = slot(stage - 1, mb, false);
      const double at = used(prev.mb);
      copy_local(edge, work, prev.mb, graph_, true);
      stage_bytes_[static_cast<size_t>(stage) - 1].recv_b = used(prev.mb) - at;
    }
  }
  if (low != &s.mb) {
    bytes.i_work = used(work);
    note_memory();
    work.reset();
  } else {
    bytes.i_work = 0;
    note_memory();
  }
}

void PipelineExecutor::backward_weight_action(int stage, int mb) {
  Slot& s = slot(stage, mb, false);
  if (s.weight_done) return;
  const int begin = plan_.begin[static_cast<size_t>(stage)];
  const int end = plan_.begin[static_cast<size_t>(stage) + 1];
  const double before = used(s.mb);
  for (int n = end - 1; n >= begin; --n) {
    // A layer's W may read its parameters: gathered as for I.
    if (sync_) sync_->gather(n, n > begin ? n - 1 : -1);
    if (sync_) sync_->weight_begin(n, mb);
    backward_weight(graph_, s.mb, n);
    if (sync_) sync_->weight_done(n, mb);
  }
  s.weight_done = true;
  backward_part_done(s);
  stage_bytes_[static_cast<size_t>(stage)].w = used(s.mb) - before;
  note_memory();
}

// Posts the receive of action i (RECV_F or RECV_B) into new tensors of its
// slot, which it creates if need be: a receive posted ahead may come before
// its own forward (the gradient of a micro-batch about to be forwarded).
void PipelineExecutor::post_receive(const Action& a, size_t i) {
  const int st = a.stage, mb = a.micro_batch;
  const bool fwd = a.kind == ActionKind::RECV_F;
  Slot& s = slot(st, mb, true);
  const double before = used(s.mb);
  const int from = fwd ? st - 1 : st + 1;
  const auto& vals = boundary_[static_cast<size_t>(fwd ? st - 1 : st)].values;
  const int peer = schedule_.stage_rank[static_cast<size_t>(from)];
  const MessageTag::Kind kind = fwd ? MessageTag::Kind::Activation : MessageTag::Kind::Gradient;
  for (size_t k = 0; k < vals.size(); ++k) {
    const Value& val = graph_.values()[static_cast<size_t>(vals[k])];
    if (!fwd && !val.requires_grad) continue;
    Tensor t = s.mb.arena().alloc(val.shape, val.dtype);  // a gradient takes its value's dtype
    receives_[i].push_back(pp_.irecv(t, peer, {kind, mb, from, static_cast<int>(k)}));
    (fwd ? s.mb.value(vals[k]) : s.mb.grad(vals[k])) = t;
  }
  sched::StageBytes& b = stage_bytes_[static_cast<size_t>(st)];
  (fwd ? b.recv_f : b.recv_b) = used(s.mb) - before;
  posted_[i] = true;
  note_memory();
}

// Before compute action i: the receives between it and the next compute
// action, so that their messages arrive while it computes.
void PipelineExecutor::post_receives_after(size_t i) {
  const auto& mine = schedule_.actions[static_cast<size_t>(pp_.rank())];
  for (size_t j = i + 1; j < mine.size() && !sched::is_compute(mine[j].kind); ++j)
    if ((mine[j].kind == ActionKind::RECV_F || mine[j].kind == ActionKind::RECV_B) && !posted_[j])
      post_receive(mine[j], j);
}

// Closes p2p step `st` (its last action, `last`, just ran) and waits for its
// receives: only now, so that a transport starting the step's messages
// together (NCCL) has them all. A receive's trace span ends when it arrived.
void PipelineExecutor::end_p2p_step(const sched::P2pStep& st, int64_t step, size_t last) {
  pp_.group_end();
  const auto& mine = schedule_.actions[static_cast<size_t>(pp_.rank())];
  for (size_t j = st.begin; j < st.end; ++j) {
    if (mine[j].kind != ActionKind::RECV_F && mine[j].kind != ActionKind::RECV_B) continue;
    set_step(step, j, mine[j]);
    wait_all_on_device(receives_[j]);  // on a GPU with NCCL, the device waits
    receives_[j].clear();
    posted_[j] = false;
    if (options_.trace) {
      ActionSpan& span = spans_[spans_.size() - 1 - (last - j)];
      span.end_us = std::chrono::duration_cast<std::chrono::microseconds>(
                        std::chrono::steady_clock::now() - epoch_)
                        .count();
    }
  }
}

void PipelineExecutor::run(const BatchSource& data, int64_t step, int64_t micro_batch,
                           int64_t global_batch, const std::function<void()>& at_end,
                           bool measure) {
  data_ = &data;
  global_batch_ = global_batch > 0 ? global_batch : schedule_.micro_batches * micro_batch;
  const int64_t counted = data.loss_terms(step);  // a step with none left: loss and gradients 0
  loss_terms_ = counted >= 0 ? std::max<int64_t>(counted, 1) : global_batch_ * io_.terms_per_sample;
  micro_batch_size_ = micro_batch;
  step_ = step;
  loss_order_.clear();
  peak_slots_ = 0;
  peak_stashed_ = 0;
  peak_bytes_ = 0;
  if (!sync_) zero_grads(params_);  // else GradSync::begin has zeroed them where they live
  const auto& mine = schedule_.actions[static_cast<size_t>(pp_.rank())];
  using Clock = std::chrono::steady_clock;
  const auto run_start = Clock::now();
  busy_s_ = 0;
  // On a GPU, measuring means timing each action on the device (the trace's
  // spans too), which the host then waits for.
  measure = measure || options_.trace;
  const bool device_timing = !options_.device.is_cpu() && measure;
  if (device_timing) {
    if (!device_timer_) device_timer_ = std::make_shared<SpanTimer>(options_.device);
    device_timer_->time([] {});  // span 0: the run's start, on the device's clock
  }
  const size_t first_span = spans_.size();
  posted_.assign(mine.size(), false);
  receives_.resize(mine.size());
  const std::vector<sched::P2pStep>& steps = p2p_steps_;
  size_t next_step = 0;  // the p2p step that action i opens, is in, or comes before
  for (size_t i = 0; i < mine.size(); ++i) {
    const Action& a = mine[i];
    const auto t0 = Clock::now();
    if (device_timing) device_timer_->begin();
    set_step(step, i, a);
    const bool opens_step = next_step < steps.size() && steps[next_step].begin == i;
    if (opens_step) pp_.group_start();
    const int st = a.stage, mb = a.micro_batch;
    if (options_.post_receives_ahead && sched::is_compute(a.kind)) post_receives_after(i);
    switch (a.kind) {
      case ActionKind::F:
        forward_action(st, mb, step);
        break;
      case ActionKind::B:
        backward_input_action(st, mb, /*with_weights=*/true);
        release_if_done(st, mb);
        break;
      case ActionKind::I:
        backward_input_action(st, mb);
        release_if_done(st, mb);
        break;
      case ActionKind::W:
        if (fold_) break;  // W ran with I, and the slot may be gone
        backward_weight_action(st, mb);
        release_if_done(st, mb);
        break;
      case ActionKind::SEND_F: {
        Slot& s = slot(st, mb, false);
        const auto& vals = boundary_[static_cast<size_t>(st)].values;
        const int peer = schedule_.stage_rank[static_cast<size_t>(st) + 1];
        for (size_t k = 0; k < vals.size(); ++k)
          s.sends.push_back(pp_.isend(s.mb.value(vals[k]), peer,
                                      {MessageTag::Kind::Activation, mb, st, static_cast<int>(k)}));
        break;
      }
      case ActionKind::RECV_F:
      case ActionKind::RECV_B:
        if (!posted_[i]) post_receive(a, i);
        break;  // waited for when its p2p step ends, below
      case ActionKind::SEND_B: {
        Slot& s = slot(st, mb, false);
        const auto& vals = boundary_[static_cast<size_t>(st) - 1].values;
        const int peer = schedule_.stage_rank[static_cast<size_t>(st) - 1];
        for (size_t k = 0; k < vals.size(); ++k) {
          if (!graph_.values()[static_cast<size_t>(vals[k])].requires_grad) continue;
          s.sends.push_back(pp_.isend(s.mb.grad(vals[k]), peer,
                                      {MessageTag::Kind::Gradient, mb, st, static_cast<int>(k)}));
        }
        s.grads_sent = true;
        release_if_done(st, mb);
        break;
      }
      case ActionKind::REDUCE_GRAD:
      case ActionKind::REDUCE_TIED:
      case ActionKind::STEP:
        break;  // done once per run, below
    }
    if (device_timing) device_timer_->end();
    const auto t1 = Clock::now();
    if (sched::is_compute(a.kind)) busy_s_ += std::chrono::duration<double>(t1 - t0).count();
    if (options_.trace) {
      auto us = [&](Clock::time_point t) {
        return std::chrono::duration_cast<std::chrono::microseconds>(t - epoch_).count();
      };
      spans_.push_back({step, a, us(t0), us(t1)});
    }
    if (next_step < steps.size() && steps[next_step].end == i + 1) {
      end_p2p_step(steps[next_step], step, i);
      ++next_step;
    }
  }
  span_s_ = std::chrono::duration<double>(Clock::now() - run_start).count();
  if (device_timing) device_timer_->time([] {});  // the end of this rank's actions
  pp_.set_step("end of the pipeline's actions");
  check(slots_in_use_ == 0, "{} (stage, micro-batch) slots are still alive after the last action "
                            "of schedule '{}' on pipeline rank {}",
        slots_in_use_, schedule_.name, pp_.rank());
  for (auto& sl : pool_)
    if (sl->stage == kRetiring) {
      // Every send is received within the step: on a GPU, the next step's
      // work waits for them (its memory is rewritten after), not the host.
      wait_all_on_device(sl->sends);
      sl->sends.clear();
      sl->mb.reset();
      sl->stage = -1;
    }
  reduce_tied();
  if (at_end) at_end();
  if (!measure) {
    bubble_ = -1;
    return;
  }
  if (device_timing) {
    // The host only queued the work: the device's clock says how long each
    // action's work ran, and when this rank's last one ended.
    const std::vector<std::pair<double, double>> t = device_timer_->take_intervals();
    check(t.size() == mine.size() + 2, "pipeline: {} device spans timed for {} actions",
          t.size(), mine.size());
    busy_s_ = 0;
    for (size_t i = 0; i < mine.size(); ++i)
      if (sched::is_compute(mine[i].kind)) busy_s_ += t[i + 1].second - t[i + 1].first;
    span_s_ = t.back().second;
    if (options_.trace) {  // compute spans on the device's clock, from the run's start
      const double start_us = static_cast<double>(
          std::chrono::duration_cast<std::chrono::microseconds>(run_start - epoch_).count());
      for (size_t i = 0; i < mine.size(); ++i) {
        if (!sched::is_compute(mine[i].kind)) continue;
        ActionSpan& span = spans_[first_span + i];
        span.start_us = static_cast<int64_t>(start_us + 1e6 * t[i + 1].first);
        span.end_us = static_cast<int64_t>(start_us + 1e6 * t[i + 1].second);
      }
    }
  }
  // One collective for the bubble: every rank's (busy, span).
  float* stats = step_stats_.data<float>();
  stats[0] = static_cast<float>(busy_s_);
  stats[1] = static_cast<float>(span_s_);
  pp_.all_gather(step_stats_, all_step_stats_);
  double busy = 0, span = 0;
  for (int r = 0; r < pp_.size(); ++r) {
    const float* st = all_step_stats_.data<float>() + 2 * r;
    busy += st[0];
    span = std::max(span, static_cast<double>(st[1]));
  }
  bubble_ = span > 0 ? 1.0 - busy / (span * pp_.size()) : 0.0;
}

size_t PipelineExecutor::arena_allocations() const {
  size_t n = work_ ? work_->arena().system_allocations() : 0;
  for (const auto& p : pool_) n += p->mb.arena().system_allocations();
  return n;
}

StagePlan whole_graph_plan(const Graph& graph, const CostModel& cost) {
  PartitionOptions po;
  po.stage_rank = {0};
  return evaluate_plan(graph, cost, po, {0, static_cast<int>(graph.nodes().size())}, "whole graph");
}

sched::Schedule one_stage_schedule(int micro_batches) {
  return sched::lower(sched::make_schedule("1f1b", 1, micro_batches));
}

std::vector<Param*> PipelineExecutor::tied_params() const {
  std::vector<Param*> v;
  for (const auto& t : tied_)
    if (t.param != nullptr) v.push_back(t.param);
  return v;
}

std::vector<int> PipelineExecutor::local_nodes() const {
  std::vector<int> v;
  for (int s : local_stages_)
    for (int n = plan_.begin[static_cast<size_t>(s)]; n < plan_.begin[static_cast<size_t>(s) + 1]; ++n)
      v.push_back(n);
  return v;
}

void PipelineExecutor::reduce_tied() {
  for (auto& t : tied_)
    if (t.param != nullptr) t.group->all_reduce(t.param->grad, ReduceOp::Sum);
}

void PipelineExecutor::write_trace(const std::string& path) const {
  check(options_.trace, "write_trace needs the executor built with tracing on");
  // Gather every rank's spans on rank 0 as rows of int32:
  // step, kind, stage, micro-batch, start us, duration us.
  constexpr int64_t kCols = 6;
  Tensor count = Tensor::zeros({1}, DType::I32), counts = Tensor::zeros({pp_.size()}, DType::I32);
  count.data<int32_t>()[0] = static_cast<int32_t>(spans_.size());
  pp_.all_gather(count, counts);
  int32_t most = 0;
  for (int r = 0; r < pp_.size(); ++r) most = std::max(most, counts.data<int32_t>()[r]);
  Tensor mine = Tensor::zeros({std::max<int64_t>(1, most) * kCols}, DType::I32);
  int32_t* m = mine.data<int32_t>();
  for (size_t k = 0; k < spans_.size(); ++k) {
    const ActionSpan& sp = spans_[k];
    const int32_t row[kCols] = {static_cast<int32_t>(sp.step), static_cast<int32_t>(sp.action.kind),
                                sp.action.stage, sp.action.micro_batch,
                                static_cast<int32_t>(sp.start_us),
                                static_cast<int32_t>(sp.end_us - sp.start_us)};
    std::copy(row, row + kCols, m + static_cast<int64_t>(k) * kCols);
  }
  Tensor all = Tensor::zeros({pp_.size() * mine.numel()}, DType::I32);
  pp_.all_gather(mine, all);
  if (pp_.rank() != 0) return;
  nlohmann::json events = nlohmann::json::array();
  for (int r = 0; r < pp_.size(); ++r) {
    events.push_back({{"ph", "M"}, {"pid", 0}, {"tid", r}, {"name", "thread_name"},
                      {"args", {{"name", fmt::format("rank {}", r)}}}});
    const int32_t* rows = all.data<int32_t>() + static_cast<int64_t>(r) * mine.numel();
    for (int32_t k = 0; k < counts.data<int32_t>()[r]; ++k) {
      const int32_t* row = rows + static_cast<int64_t>(k) * kCols;
      const Action a{static_cast<ActionKind>(row[1]), row[2], row[3]};
      events.push_back({{"ph", "X"}, {"pid", 0}, {"tid", r}, {"name", a.str()},
                        {"ts", row[4]}, {"dur", row[5]}, {"args", {{"step", row[0] + 1}}}});
      // A send starts an arrow that its receive, on the peer, ends.
      const bool send = a.kind == ActionKind::SEND_F || a.kind == ActionKind::SEND_B;
      const bool recv = a.kind == ActionKind::RECV_F || a.kind == ActionKind::RECV_B;
      if (!send && !recv) continue;
      const bool fwd = a.kind == ActionKind::SEND_F || a.kind == ActionKind::RECV_F;
      const int from_stage = send ? a.stage : (fwd ? a.stage - 1 : a.stage + 1);
      const int64_t id = ((static_cast<int64_t>(row[0]) * 2 + (fwd ? 0 : 1)) * 64 + from_stage) *
                             MessageTag::kMaxMicroBatch + a.micro_batch;
      events.push_back({{"ph", send ? "s" : "f"}, {"pid", 0}, {"tid", r}, {"name", "message"},
                        {"cat", fwd ? "activation" : "gradient"}, {"id", id},
                        {"ts", send ? row[4] : row[4] + row[5]}, {"bp", "e"}});
    }
  }
  std::ofstream f(path, std::ios::trunc);
  f << nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump() << '\n';
  check(f.good(), "--trace {}: cannot write", path);
}

std::vector<sched::StageBytes> measure_stage_bytes(const Graph& graph, const ModelIO& io,
                                                   StagePlan plan, const BatchSource& data,
                                                   int64_t micro_batch,
                                                   const PipelineOptions& options,
                                                   bool split_backward) {
  const Device device = options.device;
  for (const Param* p : graph.params())
    check(p->value.device() == device,
          "measuring the stages' memory on {}: parameter {} is on {} (place every parameter there "
          "first)",
          device.str(), p->name, p->value.device().str());
  const int stages = plan.stages();
  plan.pp = 1;
  plan.chunks = stages;
  plan.stage_rank.assign(static_cast<size_t>(stages), 0);
  sched::Schedule one = sched::empty_schedule("one-rank", 1, 1, stages);
  for (int st = 0; st < stages; ++st) one.actions[0].push_back({ActionKind::F, st, 0});
  for (int st = stages - 1; st >= 0; --st) {
    if (!split_backward) {
      one.actions[0].push_back({ActionKind::B, st, 0});
      continue;
    }
    one.actions[0].push_back({ActionKind::I, st, 0});
    one.actions[0].push_back({ActionKind::W, st, 0});
  }
  std::vector<sched::StageBytes> bytes;
  run_local(1, [&](Communicator& self) {
    PipelineOptions one_rank = options;  // its recompute, with no trace or receives ahead
    one_rank.trace = false;
    one_rank.post_receives_ahead = false;
    PipelineExecutor exec(graph, io, plan, one, self, one_rank);
    exec.run(data, 0, micro_batch);
    bytes = exec.stage_bytes();
  });
  return bytes;
}

}  // namespace weft
