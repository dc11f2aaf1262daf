// Every dp x pp x tp layout trains the same model. On LocalCommunicator
// threads, RankLayout assembles each rank; every rank's losses, gradient
// norms and final parameters are the single-process ones. Also: the
// distributed optimizer (ZeRO-1) against the plain one, the data-parallel
// buckets' overlap with the backward, checkpoints saved by one layout and
// resumed by another, and config errors raised before any communication.
#include <weft/checkpoint.h>
#include <weft/layout.h>
#include <weft/param_server.h>
#include <weft/plan.h>
#include <weft/profile.h>
#include <weft/local_communicator.h>
#include <weft/staged_communicator.h>

#include <gtest/gtest.h>

#include "models/gpt.h"
#include "params_close.h"
#include "test_util.h"

#include <cmath>
#include <functional>
#include <cstring>
#include <map>
#include <mutex>
#include <numeric>
#include <ostream>
#include <set>
#include <tuple>

namespace weft {
namespace {

using testing::contains;
using testing::error_message;

constexpr int kSteps = 5;
constexpr uint64_t kSeed = 42;
constexpr double kTol = 1e-5;
constexpr int64_t kMicro = 1, kGlobal = 8;

size_t z(int64_t i) { return static_cast<size_t>(i); }

// Parameters after training: kTol relative, plus kParamAbs per element
// absolute (tests/params_close.h says why).
constexpr double kParamAbs = 1e-6;
::testing::AssertionResult params_close(const Tensor& got, const Tensor& want) {
  return testing::params_close(got, want, kTol, kParamAbs);
}

const TokenData& text_data() {
  static const TokenData data = testing::best_of_times_tokens(60);
  return data;
}

// 8 heads, so tp up to 8 divides the heads, the widths and the vocabulary.
GptConfig tiny() {
  GptConfig c;
  c.vocab_size = 256, c.num_layers = 8, c.hidden_size = 32, c.num_heads = 8, c.seq_length = 16;
  return c;
}

TrainOptions options() {
  TrainOptions o;
  o.micro_batch = kMicro;
  o.global_batch = kGlobal;
  // Warmup then cosine: the learning rate depends on the step, so a resumed
  // run must know where it is.
  o.lr.lr = 3e-3f;
  o.lr.min_lr = 3e-4f;
  o.lr.decay = LrDecay::Cosine;
  o.lr.warmup_iters = 2;
  o.lr.decay_iters = kSteps;
  o.adam.weight_decay = 0.1f;
  o.clip_grad = 0.5;  // active: the reference checks that the norm starts above it
  return o;
}

// The single-process run every layout must reproduce, computed once.
struct Reference {
  std::vector<double> loss, norm;
  std::map<std::string, Tensor> params;   // after kSteps
  std::map<std::string, Tensor> moments;  // Adam's, after kSteps
  std::map<std::string, Tensor> first_moments;  // Adam's, after step 1
};

Reference train_reference(const GptConfig& cfg, const DocumentOptions& docs) {
  TokenBatches batches(text_data(), kGlobal, cfg.seq_length);
  batches.set_documents(docs);
  GptModel m = build_gpt(cfg, kMicro);
  init_gpt(m, kSeed);
  Trainer t(m.io, batches, options());
  Reference r;
  for (int s = 0; s < kSteps; ++s) {
    const StepRecord rec = t.train_step();
    r.loss.push_back(rec.loss);
    r.norm.push_back(rec.grad_norm);
    if (s == 0)
      for (auto& [name, moment] : t.grad_sync().optimizer_state())
        r.first_moments.emplace(name, moment.clone());
  }
  for (Param* p : m.graph.params()) r.params.emplace(p->name, p->value.clone());
  for (auto& [name, moment] : t.grad_sync().optimizer_state())
    r.moments.emplace(name, moment.clone());
  return r;
}

const Reference& reference() {
  static const Reference ref = train_reference(tiny(), {});
  return ref;
}

// --- running a layout ---

struct Layout {
  int dp = 1, pp = 1, tp = 1;
  std::string schedule = "1f1b";
  int chunks = 1;
  bool distributed = false;
  bool recompute = false;
  int64_t bucket_elements = int64_t{1} << 20;
  bool shard_grads = false;  // with distributed: ZeRO-2
  bool shard_params = false;  // with shard_grads: ZeRO-3
  bool overlap = true;
  // Every tensor travels through HostStagedCommunicator's host buffers, as
  // device tensors do when ranks share a GPU.
  bool staged = false;
  OptimizerKind optimizer = OptimizerKind::Adam;
  bool sequence_parallel = false;

  int world() const { return dp * pp * tp; }
  LayoutOptions options() const {
    LayoutOptions lo;
    lo.tp = tp, lo.pp = pp, lo.schedule = schedule, lo.chunks = chunks;
    lo.sequence_parallel = sequence_parallel;
    lo.sync.optimizer = optimizer;
    lo.sync.sgd = {0.9f, 0.1f};
    lo.sync.lion = {0.9f, 0.99f, 0.1f};
    lo.pipeline.recompute = recompute;
    lo.sync.distributed_optimizer = distributed;
    lo.sync.shard_grads = shard_grads;
    lo.sync.shard_params = shard_params;
    lo.sync.bucket_elements = bucket_elements;
    lo.sync.overlap = overlap;
    return lo;
  }
  std::string name() const {
    std::string n =
        "dp" + std::to_string(dp) + "_pp" + std::to_string(pp) + "_tp" + std::to_string(tp);
    if (pp > 1) n += "_" + schedule + (chunks > 1 ? "_v" + std::to_string(chunks) : "");
    if (distributed) n += shard_params ? "_zero3" : shard_grads ? "_zero2" : "_zero1";
    if (bucket_elements != int64_t{1} << 20) n += "_b" + std::to_string(bucket_elements);
    if (recompute) n += "_recompute";
    if (staged) n += "_staged";
    if (sequence_parallel) n += "_sp";
    for (char& ch : n)
      if (ch == '-') ch = '_';
    return n;
  }
};

// gtest names a failing case by its layout.
void PrintTo(const Layout& l, std::ostream* os) { *os << l.name(); }

// What one rank saw.
struct RankRun {
  MeshCoord coord;
  std::vector<StepRecord> steps;
  std::vector<GradSync::Stats> stats;    // after each step
  std::map<std::string, Tensor> params;  // the ones this rank updates, its pieces
  std::map<std::string, Shard> shards;
  NamedTensors moments;        // optimizer_state() after the last step
  NamedTensors first_moments;  // optimizer_state() after step 1
};

// Runs `steps` steps of layout `l` on its world of threads. `before` runs on
// each rank after the layout is built (e.g. to load a checkpoint), `after`
// after the steps (e.g. to save one); both are collective when they need be.
using RankHook = std::function<void(RankLayout&)>;
std::vector<RankRun> run_layout(const Layout& l, int steps, const RankHook& before = {},
                                const RankHook& after = {}, const GptConfig& cfg = tiny(),
                                bool with_moments = false, const DocumentOptions& docs = {}) {
  std::vector<RankRun> runs(z(l.world()));
  std::mutex mu;
  auto body = [&](Communicator* world) {
    TokenBatches batches(text_data(), kGlobal, cfg.seq_length);
    batches.set_documents(docs);
    GptModel model = build_gpt(cfg, kMicro);  // zero-filled: RankLayout initialises
    RankLayout rank(world, model.graph, model.io, batches, options(), l.options(), kSeed);
    if (before) before(rank);
    RankRun r;
    r.coord = rank.coord();
    for (int s = 0; s < steps; ++s) {
      r.steps.push_back(rank.trainer().train_step());
      r.stats.push_back(rank.trainer().grad_sync().stats());
      if (with_moments && s == 0)
        for (auto& [name, t] : rank.trainer().grad_sync().optimizer_state())
          r.first_moments.emplace_back(name, t.clone());
    }
    // Whole, gathered where the values are sharded (ZeRO-3).
    const std::vector<Tensor> whole = rank.trainer().grad_sync().whole_values();
    const std::vector<Param*>& synced = rank.trainer().grad_sync().params();
    for (Param* p : rank.trainer().params()) {
      const size_t i =
          static_cast<size_t>(std::find(synced.begin(), synced.end(), p) - synced.begin());
      r.params.emplace(p->name, i < synced.size() ? whole[i] : p->value.clone());
      r.shards.emplace(p->name, p->shard);
    }
    if (with_moments) {
      for (auto& [name, t] : rank.trainer().grad_sync().optimizer_state())
        r.moments.emplace_back(name, t.clone());
    }
    if (after) after(rank);
    std::lock_guard<std::mutex> lock(mu);
    runs[z(world ? world->rank() : 0)] = std::move(r);
  };
  if (l.world() == 1) {
    body(nullptr);
  } else {
    run_local(l.world(), [&](Communicator& world) {
      if (!l.staged) return body(&world);
      HostStagedCommunicator staged(world, HostStagedCommunicator::Stage::All);
      body(&staged);
    });
  }
  return runs;
}

// Every rank's steps are reference steps first .. first + n - 1.
void expect_reference_steps(const std::vector<RankRun>& runs, int first,
                            const Reference& ref = reference()) {
  for (size_t rank = 0; rank < runs.size(); ++rank) {
    const RankRun& r = runs[rank];
    ASSERT_FALSE(r.steps.empty()) << "rank " << rank << " ran no step";
    for (size_t k = 0; k < r.steps.size(); ++k) {
      const size_t s = z(first) + k;
      ASSERT_LT(s, ref.loss.size());
      EXPECT_EQ(r.steps[k].step, static_cast<int64_t>(s)) << "rank " << rank;
      EXPECT_NEAR(r.steps[k].loss, ref.loss[s], kTol * ref.loss[s])
          << "rank " << rank << " step " << s + 1;
      EXPECT_NEAR(r.steps[k].grad_norm, ref.norm[s], kTol * ref.norm[s])
          << "rank " << rank << " step " << s + 1;
    }
  }
}

// Every rank's parameters after the run are its pieces of the reference's,
// and the pieces of each (dp, pp) slice of ranks, placed together, are the
// whole tensors: an update that only some ranks (or some pieces) take fails.
void expect_reference_params(const std::vector<RankRun>& runs, const Layout& l) {
  const Reference& ref = reference();
  // (dp, pp) -> name -> the full tensor, from the pieces of that slice's tp ranks
  std::map<std::pair<int, int>, std::map<std::string, Tensor>> assembled;
  std::map<std::pair<int, int>, std::map<std::string, int>> pieces;
  std::set<std::string> updated;
  for (size_t rank = 0; rank < runs.size(); ++rank) {
    const RankRun& r = runs[rank];
    EXPECT_FALSE(r.params.empty()) << "rank " << rank << " updates no parameter";
    for (const auto& [name, value] : r.params) {
      updated.insert(name);
      const Shard& shard = r.shards.at(name);
      const Tensor& want_full = ref.params.at(name);
      ASSERT_EQ(shard.split() ? shard.full : value.shape(), want_full.shape()) << name;
      Tensor want = Tensor::zeros(value.shape());
      if (shard.split())
        slice_shard(want_full, shard, want);
      else
        want.copy_from(want_full);
      EXPECT_TRUE(params_close(value, want))
          << "rank " << rank << " (tp " << r.coord.tp << ", dp " << r.coord.dp << ", pp "
          << r.coord.pp << "): " << name << " after " << kSteps << " steps";
      auto& full = assembled[{r.coord.dp, r.coord.pp}];
      auto it = full.find(name);
      if (it == full.end()) it = full.emplace(name, Tensor::zeros(want_full.shape())).first;
      if (shard.split()) {
        place_shard(value, shard, it->second);
      } else {
        it->second.copy_from(value);
      }
      ++pieces[{r.coord.dp, r.coord.pp}][name];
    }
  }
  // Every parameter of the model is updated somewhere.
  EXPECT_EQ(updated.size(), ref.params.size());
  for (const auto& [where, full] : assembled)
    for (const auto& [name, t] : full) {
      EXPECT_EQ(pieces[where][name], l.tp) << name << " at dp " << where.first << " pp "
                                           << where.second << ": not held by every tp rank";
      EXPECT_TRUE(params_close(t, ref.params.at(name)))
          << name << " assembled at dp " << where.first << " pp " << where.second;
    }
}

// --- 1. every layout trains the same model ---

class EveryLayout : public ::testing::TestWithParam<Layout> {};

TEST_P(EveryLayout, GivesTheSingleProcessLossesNormsAndParameters) {
  const Layout l = GetParam();
  const std::vector<RankRun> runs = run_layout(l, kSteps);
  ASSERT_EQ(runs.size(), z(l.world()));
  // Each rank has its own place in the mesh.
  std::set<std::tuple<int, int, int>> coords;
  for (const RankRun& r : runs) coords.insert({r.coord.tp, r.coord.dp, r.coord.pp});
  EXPECT_EQ(coords.size(), runs.size());
  expect_reference_steps(runs, 0);
  expect_reference_params(runs, l);
}

std::vector<Layout> layouts() {
  std::vector<Layout> v;
  // The eight-rank layouts, each pipeline with 1F1B and the zero-bubble schedule.
  for (auto [dp, pp, tp] : std::vector<std::tuple<int, int, int>>{
           {2, 2, 2}, {1, 2, 4}, {2, 4, 1}, {4, 1, 2}, {8, 1, 1}, {1, 8, 1}, {1, 1, 8}}) {
    if (pp == 1) {
      v.push_back({dp, pp, tp});
      continue;
    }
    v.push_back({dp, pp, tp, "1f1b"});
    v.push_back({dp, pp, tp, "zb-h1"});
  }
  // More layouts and schedules.
  v.push_back({2, 1, 1});
  v.push_back({1, 1, 2});
  v.push_back({2, 2, 1, "interleaved-1f1b", 2});
  v.push_back({1, 2, 2, "zb-v", 2});
  v.push_back({4, 2, 1, "gpipe"});
  v.push_back({2, 1, 4});
  // The distributed optimizer.
  v.push_back({2, 2, 2, "zb-h1", 1, true});
  v.push_back({8, 1, 1, "1f1b", 1, true});
  v.push_back({4, 1, 2, "1f1b", 1, true});
  v.push_back({2, 4, 1, "1f1b", 1, true});
  // Sharded gradients (ZeRO-2): small buckets, so that several are open and
  // in flight at once; pipelines whose W actions of two micro-batches
  // interleave on one rank (interleaved and ZB-V chunks); tied weights (the
  // late buckets at pp > 1); recompute.
  for (Layout z2 : std::vector<Layout>{{2, 2, 2, "zb-h1"},
                                       {8, 1, 1},
                                       {4, 1, 2},
                                       {2, 2, 1, "interleaved-1f1b", 2},
                                       {2, 2, 1, "zb-v", 2},
                                       {2, 2, 2, "1f1b", 1, false, true}}) {
    z2.distributed = z2.shard_grads = true;
    z2.bucket_elements = 2048;
    v.push_back(z2);
  }
  // Sharded parameters (ZeRO-3): small buckets, so that nodes gather several
  // and the pool evicts; tp and pipelines (tied weights stay whole), W actions
  // apart from I (ZB-H1, ZB-V) gathering again, recompute's replays, one
  // bucket for the whole model (1 << 20), sequence parallelism, host buffers.
  for (Layout z3 : std::vector<Layout>{{8, 1, 1},
                                       {2, 2, 2, "zb-h1"},
                                       {4, 1, 2},
                                       {2, 2, 1, "interleaved-1f1b", 2},
                                       {2, 2, 1, "zb-v", 2},
                                       {2, 2, 2, "1f1b", 1, false, true}}) {
    z3.distributed = z3.shard_grads = z3.shard_params = true;
    z3.bucket_elements = 2048;
    v.push_back(z3);
  }
  Layout z3_whole{2, 1, 1, "1f1b", 1, true};
  z3_whole.shard_grads = z3_whole.shard_params = true;
  v.push_back(z3_whole);
  Layout z3_sp{2, 1, 2, "1f1b", 1, true};
  z3_sp.shard_grads = z3_sp.shard_params = z3_sp.sequence_parallel = true;
  z3_sp.bucket_elements = 2048;
  v.push_back(z3_sp);
  Layout z3_staged{2, 2, 2, "zb-h1", 1, true};
  z3_staged.shard_grads = z3_staged.shard_params = z3_staged.staged = true;
  z3_staged.bucket_elements = 2048;
  v.push_back(z3_staged);
  // Recomputation, with every axis.
  v.push_back({2, 2, 2, "1f1b", 1, false, true});
  // Staged through host buffers: pipeline messages, tensor-parallel
  // collectives and data-parallel buckets (plain and ZeRO-1).
  Layout staged{2, 2, 2, "zb-h1"};
  staged.staged = true;
  v.push_back(staged);
  staged.schedule = "1f1b", staged.distributed = true;
  v.push_back(staged);
  staged.shard_grads = true, staged.bucket_elements = 2048;
  v.push_back(staged);
  // Sequence parallelism: tp 2, 4 and 8 (two tokens a rank), with pipelines
  // whose W actions run apart from I (ZB-H1, ZB-V), recompute (each replay
  // gathers and scatters again), ZeRO-2, and through host buffers.
  for (Layout sp : std::vector<Layout>{{2, 2, 2, "1f1b"},
                                       {1, 2, 4, "zb-h1"},
                                       {4, 1, 2},
                                       {1, 1, 8},
                                       {1, 2, 2, "zb-v", 2},
                                       {2, 2, 2, "1f1b", 1, false, true},
                                       {2, 2, 2, "zb-h1", 1, true}}) {
    sp.sequence_parallel = true;
    v.push_back(sp);
  }
  Layout sp_zero2{2, 1, 2, "1f1b", 1, true};
  sp_zero2.shard_grads = true, sp_zero2.bucket_elements = 2048, sp_zero2.sequence_parallel = true;
  v.push_back(sp_zero2);
  Layout sp_staged{2, 2, 2, "zb-h1"};
  sp_staged.staged = sp_staged.sequence_parallel = true;
  v.push_back(sp_staged);
  return v;
}

INSTANTIATE_TEST_SUITE_P(Layouts, EveryLayout, ::testing::ValuesIn(layouts()),
                         [](const ::testing::TestParamInfo<Layout>& p) { return p.param.name(); });

// --- documents: every layout divides by the same counted terms and reads
// the same positions (--eod-mask-loss, --reset-position-ids,
// --reset-attention-mask) ---

// Spaces end the documents of the text: words, several in every sequence
// of 16.
DocumentOptions documents() {
  DocumentOptions d;
  d.eod = ' ';
  d.eod_mask_loss = d.reset_position_ids = d.reset_attention_mask = true;
  return d;
}

GptConfig tiny_documents() {
  GptConfig c = tiny();
  c.reset_position_ids = c.reset_attention_mask = true;
  return c;
}

const Reference& documents_reference() {
  static const Reference ref = train_reference(tiny_documents(), documents());
  return ref;
}

TEST(DocumentsReference, DiffersFromThePlainRun) {
  // At initialisation every token's loss is near ln 256 either way; the
  // gradients differ at once (a fifth of the terms are left out, the
  // positions and masks are others), the losses after an update.
  EXPECT_GT(std::abs(documents_reference().norm[0] / reference().norm[0] - 1), 0.05);
  EXPECT_GT(std::abs(documents_reference().loss[1] - reference().loss[1]), 1e-2);
  EXPECT_LT(documents_reference().loss.back(), documents_reference().loss.front());
}

class DocumentLayouts : public ::testing::TestWithParam<Layout> {};

TEST_P(DocumentLayouts, GiveTheSingleProcessLossesAndNorms) {
  const Layout l = GetParam();
  const std::vector<RankRun> runs =
      run_layout(l, kSteps, {}, {}, tiny_documents(), false, documents());
  ASSERT_EQ(runs.size(), z(l.world()));
  expect_reference_steps(runs, 0, documents_reference());
}

// Replicas (each counts the whole batch's terms), pipelines (the positions
// reach every stage, the loss's count the last), tensor parallelism
// (vocabulary-parallel loss with ignored targets), sequence parallelism
// (positions whole inside the regions), recompute (replays read them again).
INSTANTIATE_TEST_SUITE_P(Layouts, DocumentLayouts, ::testing::ValuesIn([] {
                           std::vector<Layout> v = {{2, 2, 2, "1f1b"},
                                                    {8, 1, 1},
                                                    {1, 2, 4, "zb-h1"},
                                                    {2, 2, 1, "interleaved-1f1b", 2},
                                                    {2, 2, 2, "1f1b", 1, false, true}};
                           Layout sp{2, 1, 4};
                           sp.sequence_parallel = true;
                           v.push_back(sp);
                           Layout zero2{4, 1, 2, "1f1b", 1, true};
                           zero2.shard_grads = true, zero2.bucket_elements = 2048;
                           v.push_back(zero2);
                           return v;
                         }()),
                         [](const ::testing::TestParamInfo<Layout>& p) { return p.param.name(); });

// The reference itself is a meaningful target: clipping acts, and training moves.
TEST(Reference, ClipsAndLearns) {
  const Reference& ref = reference();
  EXPECT_GT(ref.norm[0], options().clip_grad) << "clipping would not act";
  EXPECT_LT(ref.loss.back(), ref.loss.front());
}

// --- 2. the distributed optimizer ---

// Same layout, both flags: the same losses, norms, parameters and Adam moments.
// The planner's activation memory under tensor parallelism, from a profile
// taken at tp 1, against the bytes the executor's arenas held at tp 2 (and at
// tp 1), and with sequence parallelism at tp 2 and 4 (where the outputs the
// profile calls whole are split, and so are the norms' statistics). The profile gives each stage's
// F and I bytes, measured; the planner splits what each node's "tp_whole" says is split and what F
// keeps beyond the outputs (attention's probabilities, the loss's), gives I its gradients in the
// same proportion and, under tp, one whole partial input gradient per column-parallel GEMM. Its
// errors:
//   - I's bytes: every stage gets the profile's mean ratio of I's bytes to
//     F's, while each stage has its own; at the peak one I is held, so the
//     error is at most max over stages |i_s - ratio f_s| (at tp 1; split
//     like F at tp 2, so the tp 1 bound holds);
//   - the norms' statistics (2 floats per token per norm) are whole on
//     every rank, and the planner splits them with what F keeps: (1 - 1/tp)
//     of them, in F and in I alike, for each micro-batch held;
//   - a byte for the sums of doubles.
TEST(Plan, ActivationMemoryUnderTensorParallelismIsWhatTheArenasHold) {
  const GptConfig cfg = tiny();
  TokenBatches batches(text_data(), kGlobal, cfg.seq_length);
  GptModel model = build_gpt(cfg, kMicro);
  init_gpt(model, kSeed);
  PartitionOptions po;
  po.method = PartitionMethod::Uniform;
  po.pp = 2;
  const StagePlan plan = partition(model.graph, CostModel::analytic(model.graph), po);
  const std::vector<sched::StageBytes> bytes =
      measure_stage_bytes(model.graph, model.io, plan, batches, kMicro);
  nlohmann::json profile = cost_model_json(CostModel::analytic(model.graph), model.graph);
  profile.update(stage_costs_json(CostModel::analytic(model.graph), plan, model.graph, {}, bytes));
  profile["micro_batch_size"] = kMicro;

  plan::PlanInput in;
  in.shape = {cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.seq_length, cfg.vocab_size};
  in.global_batch = kGlobal;
  in.costs = plan::profile_costs(profile, "test");
  double ratio_error = 0, f_sum = 0, i_sum = 0;
  for (const sched::StageBytes& b : bytes) f_sum += b.f, i_sum += b.i;
  for (const sched::StageBytes& b : bytes)
    ratio_error = std::max(ratio_error, std::abs(b.i - i_sum / f_sum * b.f));
  const double norm_stats = 2.0 * 4 * static_cast<double>(kMicro * cfg.seq_length);

  for (auto [tp, sp] : {std::pair{1, false}, {2, false}, {2, true}, {4, true}}) {
    in.machine.world = 2 * tp;
    Layout l;
    l.pp = 2, l.tp = tp, l.sequence_parallel = sp;
    std::vector<double> held(2);
    run_layout(l, 1, {}, [&](RankLayout& rank) {
      if (rank.coord().tp == 0) held[z(rank.coord().pp)] = rank.pipeline()->peak_bytes();
    });
    const plan::Plan p = plan::evaluate(in, {1, 2, tp, "1f1b", 1, kMicro, false, false, false, sp});
    const double blocks = static_cast<double>(cfg.num_layers) / 2;
    const sched::Schedule s = sched::lower(sched::make_schedule("1f1b", 2, kGlobal / kMicro, 1));
    const std::vector<int> in_flight = sched::peak_in_flight(s, false);
    const double held_f = *std::max_element(in_flight.begin(), in_flight.end()) + 1;
    // Under sequence parallelism the norms' statistics are split too.
    const double allowed =
        ratio_error + (sp ? 0 : held_f * (2 * blocks + 1) * norm_stats * (tp - 1.0) / tp) + 1;
    const double most = *std::max_element(held.begin(), held.end());
    EXPECT_NEAR(p.activation_bytes, most, allowed) << "tp " << tp << (sp ? " sp" : "");
    // Before, the planner divided every stashed byte by tp and left out
    // what F keeps beyond the outputs: far outside this bound.
    EXPECT_LT(allowed, 0.1 * most) << "tp " << tp;
  }
}

// The planner's activation bytes without a profile (weft-sched plan
// --flops, flops_costs) against a profile's, measured by the executor's
// arenas on this CPU, fp32 and --bf16 (the activations between nodes in
// bf16, attention's probabilities and the norms' statistics in fp32): per
// sequence, a block's outputs and what it keeps beyond them, the whole
// ones under tensor parallelism, the boundary, the embedding's and the
// head's. Both count the same tensors; the arena rounds each allocation up
// to 64 bytes, which the formula leaves out: the block's and the head's
// small ones (the loss's one float, 60 bytes of padding a micro-batch) are
// the difference, under 64 bytes each, two at most a part here. Fused
// attention, GPU-only, is the formula's alone.
TEST(Plan, FlopsCostsHoldTheActivationsTheArenasHold) {
  const GptConfig cfg = tiny();
  for (const bool bf16 : {false, true}) {
    TokenBatches batches(text_data(), kGlobal, cfg.seq_length);
    GptModel model = build_gpt(cfg, kMicro);
    init_gpt(model, kSeed);
    if (bf16) model.graph.set_activation_dtype(DType::BF16);
    PartitionOptions po;
    po.method = PartitionMethod::Uniform;
    po.pp = 2;
    const CostModel analytic = CostModel::analytic(model.graph);
    const StagePlan stages = partition(model.graph, analytic, po);
    const std::vector<sched::StageBytes> bytes =
        measure_stage_bytes(model.graph, model.io, stages, batches, kMicro);
    nlohmann::json profile = cost_model_json(analytic, model.graph);
    profile.update(stage_costs_json(analytic, stages, model.graph, {}, bytes));
    profile["micro_batch_size"] = kMicro;
    const plan::LayerCosts measured = plan::profile_costs(profile, "test");
    const plan::ModelShape shape{cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.seq_length,
                                 cfg.vocab_size};
    const plan::LayerCosts formula = plan::flops_costs(shape, 1e12, 1e12, {bf16 ? 2 : 4, false});
    const std::string what = bf16 ? "bf16" : "fp32";
    EXPECT_EQ(formula.layer.stash_bytes, measured.layer.stash_bytes) << what;
    EXPECT_EQ(formula.layer.whole_stash_bytes, measured.layer.whole_stash_bytes) << what;
    EXPECT_NEAR(formula.layer.kept_bytes, measured.layer.kept_bytes, 2 * 63) << what;
    EXPECT_EQ(formula.boundary_bytes, measured.boundary_bytes) << what;
    EXPECT_EQ(formula.pre.stash_bytes, measured.pre.stash_bytes) << what;
    EXPECT_EQ(formula.post.stash_bytes, measured.post.stash_bytes) << what;
    EXPECT_NEAR(formula.post.kept_bytes, measured.post.kept_bytes, 2 * 63) << what;
    // bf16 activations keep a bf16 copy of every weight: half its fp32 bytes more.
    EXPECT_EQ(formula.weight_copy_ratio, bf16 ? 0.5 : 0.0) << what;
    EXPECT_EQ(measured.weight_copy_ratio, formula.weight_copy_ratio) << what;
    plan::PlanInput in;
    in.shape = shape;
    in.global_batch = kGlobal;
    in.costs = formula;
    const plan::Plan one = plan::evaluate(in, {1, 1, 1, "1f1b", 1, kMicro});
    double weights = 0;
    for (Param* q : model.graph.params()) weights += 4.0 * static_cast<double>(q->value.numel());
    EXPECT_NEAR(one.memory_per_rank - one.activation_bytes,
                (4 + formula.weight_copy_ratio) * weights, 1e-6 * weights)
        << what;
  }
  // Fused attention keeps 4 bytes a head and token where unfused keeps 4 T.
  const plan::ModelShape shape{2, 64, 4, 128, 256};
  const double unfused = plan::flops_costs(shape, 1e12, 1e12, {2, false}).layer.kept_bytes;
  const double fused = plan::flops_costs(shape, 1e12, 1e12, {2, true}).layer.kept_bytes;
  EXPECT_EQ(unfused - fused, 128.0 * 4 * 4 * (128 - 1));
}

// Sequence parallelism: exactly the values the profile calls whole under
// tensor parallelism (tp_whole_outputs: the embedding's, the norms', the
// residual adds', the row-parallel GEMMs') hold 1/tp of the tokens on each
// rank, every other value keeps its shape, and the arenas hold less by at
// least those values' bytes for each micro-batch a stage keeps in flight
// at its peak, with the shared whole-sequence buffers counted beside (the
// values' gradients shrink too, and the whole partial gradients entering a
// region go to those buffers).
TEST(SequenceParallel, TheValuesBetweenRegionsHoldOneTpthOfTheirTokens) {
  const GptConfig cfg = tiny();
  GptModel logical = build_gpt(cfg, kMicro);
  const std::vector<bool> whole = tp_whole_outputs(logical.graph);
  for (int tp : {2, 4}) {
    std::vector<Shape> plain_shapes, sp_shapes;
    double plain_peak = 0, sp_peak = 0;
    for (bool sp : {false, true}) {
      Layout l{1, 2, tp, "1f1b"};
      l.sequence_parallel = sp;
      run_layout(l, 1, {}, [&](RankLayout& rank) {
        if (rank.coord().tp != 0 || rank.coord().pp != 0) return;
        std::vector<Shape>& shapes = sp ? sp_shapes : plain_shapes;
        for (const Value& v : rank.graph().values()) shapes.push_back(v.shape);
        (sp ? sp_peak : plain_peak) = rank.pipeline()->peak_bytes();
      });
    }
    ASSERT_EQ(sp_shapes.size(), plain_shapes.size());
    double split_bytes = 0;  // one micro-batch's, on stage 0
    const StagePlan plan = [&] {
      PartitionOptions po;
      po.pp = 2;
      return partition(logical.graph, CostModel::analytic(logical.graph), po);
    }();
    for (size_t v = 0; v < sp_shapes.size(); ++v) {
      const Value& val = logical.graph.values()[v];
      const bool between = val.producer >= 0 && whole[z(val.producer)] && val.shape.rank >= 2;
      Shape want = plain_shapes[v];
      if (between) want[1] /= tp;
      EXPECT_EQ(sp_shapes[v], want) << val.name << " at tp " << tp;
      if (between && val.producer < plan.begin[1])
        split_bytes += 4.0 * static_cast<double>(plain_shapes[v].numel() - want.numel());
    }
    EXPECT_GT(split_bytes, 0);
    // Stage 0 of 1F1B at pp 2 holds at least this many micro-batches'
    // activations, awaiting their backward, at its peak.
    const sched::Schedule s = sched::lower(sched::make_schedule("1f1b", 2, kGlobal / kMicro, 1));
    const double held = sched::peak_in_flight(s, false)[0];
    ASSERT_GE(held, 2);
    // The shared buffers: two whole (B, T, C) tensors and one slice.
    const double scratch = (2.0 + 1.0 / tp) * 4 * kMicro * cfg.seq_length * cfg.hidden_size;
    EXPECT_LE(sp_peak + scratch, plain_peak - held * split_bytes)
        << "tp " << tp << ": " << held << " micro-batches of " << split_bytes << " bytes";
  }
}

// Every step's loss and norm of a ZeRO-1 run against the plain run in the
// same layout, rank by rank, to kTol.
void expect_same_steps(const std::vector<RankRun>& a, const std::vector<RankRun>& b,
                       const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t rank = 0; rank < a.size(); ++rank)
    for (size_t s = 0; s < z(kSteps); ++s) {
      EXPECT_NEAR(b[rank].steps[s].loss, a[rank].steps[s].loss, kTol * a[rank].steps[s].loss)
          << what << " rank " << rank << " step " << s + 1;
      EXPECT_NEAR(b[rank].steps[s].grad_norm, a[rank].steps[s].grad_norm,
                  kTol * a[rank].steps[s].grad_norm)
          << what << " rank " << rank << " step " << s + 1;
    }
}

TEST(DistributedOptimizer, SameNumbersAsThePlainOne) {
  Layout plain{4, 1, 2};
  Layout zero1 = plain;
  zero1.distributed = true;
  const std::vector<RankRun> a = run_layout(plain, kSteps, {}, {}, tiny(), true);
  const std::vector<RankRun> b = run_layout(zero1, kSteps, {}, {}, tiny(), true);
  expect_same_steps(a, b, "adamw");
  for (size_t rank = 0; rank < a.size(); ++rank) {
    // optimizer_state() is this rank's tp piece of each moment, whole across dp.
    ASSERT_EQ(a[rank].moments.size(), b[rank].moments.size()) << "rank " << rank;
    ASSERT_EQ(a[rank].moments.size(), 2 * a[rank].params.size()) << "rank " << rank;
    std::map<std::string, Tensor> plain_moments(a[rank].moments.begin(), a[rank].moments.end());
    for (const auto& [name, t] : b[rank].moments) {
      ASSERT_TRUE(plain_moments.count(name)) << name;
      EXPECT_LT(testing::rel_error(t, plain_moments.at(name)), kTol)
          << "rank " << rank << ": " << name;
    }
    // A reduce-scatter moves half an all-reduce's bytes.
    EXPECT_NEAR(b[rank].stats.back().bytes_sent, a[rank].stats.back().bytes_sent / 2,
                1e-9 * a[rank].stats.back().bytes_sent);
  }
  // And the moments are the single-process ones (tp 2: compare the pieces),
  // after step 1. Error model: step 1's gradient is a sum over the G*T = 128
  // tokens of the batch, carried back through 8 blocks; another split over
  // ranks (or another BLAS kernel set) sums in another order, about
  // 2^-24 * sqrt(128) = 7e-7 relative per sum, a few times that through the
  // blocks: below kTol. m = (1 - beta1) g keeps g's relative error; v =
  // (1 - beta2) g^2 doubles it, hence 2 kTol. After kSteps the moments are not
  // compared with the reference: each Adam step normalises a gradient element
  // by its own size, so an element whose gradient is at rounding level (the
  // key bias's is zero in exact arithmetic) moves by about lr in either
  // direction, and later gradients inherit that. After five steps the moments
  // of two summation orders differ by 1e-5 to 2e-5 (seen with OpenBLAS's
  // Prescott kernels and on an AVX-512 host), which says nothing about the
  // optimizer. The comparison with the plain optimizer in the same layout
  // above (the same sums, so nothing for Adam to amplify) covers those steps.
  const Reference& ref = reference();
  for (size_t rank = 0; rank < b.size(); ++rank)
    for (const auto& [name, t] : b[rank].first_moments) {
      const std::string param = name.substr(0, name.rfind(".exp_avg"));
      const Shard& shard = b[rank].shards.at(param);
      Tensor want = Tensor::zeros(t.shape());
      if (shard.split())
        slice_shard(ref.first_moments.at(name), shard, want);
      else
        want.copy_from(ref.first_moments.at(name));
      const bool squared = name.ends_with(".exp_avg_sq");
      EXPECT_LT(testing::rel_error(t, want), squared ? 2 * kTol : kTol)
          << "rank " << rank << ": " << name << " after step 1";
    }
}

// Every optimizer shards through one interface (weft/optimizer.h,
// UpdateRule): ZeRO-1 updates each replica's slices with the rule the plain
// optimizer runs on whole tensors. SGD and Lion, whose ZeRO-1 path is that
// interface alone, give the plain optimizer's losses, norms and state in the
// same layout: the same sums, so the same bits but for the reductions'
// order (a reduce-scatter against an all-reduce), within kTol.
TEST(DistributedOptimizer, EveryOptimizerShardsAsItsPlainSelf) {
  for (const OptimizerKind kind : {OptimizerKind::Sgd, OptimizerKind::Lion}) {
    Layout plain{2, 1, 2};
    plain.optimizer = kind;
    Layout zero1 = plain;
    zero1.distributed = true;
    const std::vector<RankRun> a = run_layout(plain, kSteps, {}, {}, tiny(), true);
    const std::vector<RankRun> b = run_layout(zero1, kSteps, {}, {}, tiny(), true);
    expect_same_steps(a, b, optimizer_name(kind));
    ASSERT_EQ(a.size(), b.size());
    for (size_t rank = 0; rank < a.size(); ++rank) {
      ASSERT_EQ(a[rank].moments.size(), a[rank].params.size()) << optimizer_name(kind);
      ASSERT_EQ(b[rank].moments.size(), a[rank].moments.size()) << optimizer_name(kind);
      std::map<std::string, Tensor> plain_state(a[rank].moments.begin(), a[rank].moments.end());
      for (const auto& [name, t] : b[rank].moments) {
        ASSERT_TRUE(plain_state.count(name)) << name;
        EXPECT_LT(testing::rel_error(t, plain_state.at(name)), kTol)
            << optimizer_name(kind) << " rank " << rank << ": " << name;
      }
    }
  }
}

// Each replica keeps Adam's moments for its slice only. Replica r loads a
// state filled with r + 1; gathered back, the state is made of every
// replica's slice, each about 1/dp of it. The plain optimizer keeps what it
// loaded, all of it.
struct OwnedCounts {
  std::vector<int64_t> by_replica;  // elements holding replica r's value
  int64_t total = 0;
  int buckets = 0;
};

std::vector<OwnedCounts> moments_after_loading_per_replica_values(const Layout& l) {
  std::vector<OwnedCounts> counts(z(l.world()));
  std::mutex mu;
  run_local(l.world(), [&](Communicator& world) {
    TokenBatches batches(text_data(), kGlobal, tiny().seq_length);
    GptModel model = build_gpt(tiny(), kMicro);
    RankLayout rank(&world, model.graph, model.io, batches, options(), l.options(), kSeed);
    rank.trainer().train_step();
    GradSync& sync = rank.trainer().grad_sync();
    const float mine = static_cast<float>(rank.coord().dp + 1);
    NamedTensors state = sync.optimizer_state();
    for (auto& [name, t] : state) {
      t = t.clone();
      for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = mine;
    }
    sync.load_optimizer_state(state);
    OwnedCounts c;
    c.by_replica.assign(z(l.dp), 0);
    c.buckets = sync.stats().buckets;
    for (const auto& [name, t] : sync.optimizer_state())
      for (int64_t i = 0; i < t.numel(); ++i) {
        const float x = t.data<float>()[i];
        const int r = static_cast<int>(x) - 1;
        ++c.total;
        if (x == static_cast<float>(r + 1) && r >= 0 && r < l.dp) ++c.by_replica[z(r)];
      }
    std::lock_guard<std::mutex> lock(mu);
    counts[z(world.rank())] = c;
  });
  return counts;
}

TEST(DistributedOptimizer, EachReplicaKeepsMomentsForItsSliceOnly) {
  Layout l{2, 1, 1};
  l.bucket_elements = 2048;  // several buckets, each cut in two
  l.distributed = true;
  const std::vector<OwnedCounts> all = moments_after_loading_per_replica_values(l);
  for (size_t r = 1; r < all.size(); ++r)
    EXPECT_EQ(all[r].by_replica, all[0].by_replica) << "rank " << r << " sees another state";
  const OwnedCounts& c = all[0];
  ASSERT_GT(c.buckets, 1);
  int64_t found = 0;
  for (int r = 0; r < l.dp; ++r) {
    // Each replica's slice is half of each bucket, rounded up to an even size.
    EXPECT_NEAR(static_cast<double>(c.by_replica[z(r)]), static_cast<double>(c.total) / l.dp,
                static_cast<double>(2 * c.buckets))
        << "replica " << r;
    found += c.by_replica[z(r)];
  }
  EXPECT_EQ(found, c.total) << "moments that belong to no replica";

  // Without it, each replica keeps everything it loaded.
  l.distributed = false;
  const std::vector<OwnedCounts> plain = moments_after_loading_per_replica_values(l);
  for (size_t r = 0; r < plain.size(); ++r) EXPECT_EQ(plain[r].by_replica[r], plain[r].total);
}

// Runs `l` for `steps` steps of `cfg`, and keeps what each replica's GradSync
// holds after them (weft/grad_sync.h's Memory), by data-parallel rank.
std::vector<RankRun> run_keeping_memory(const Layout& l, const GptConfig& cfg, int steps,
                                        std::vector<GradSync::Memory>& held) {
  std::mutex mu;
  held.assign(z(l.world()), {});
  return run_layout(
      l, steps, {},
      [&](RankLayout& rank) {
        std::lock_guard<std::mutex> lock(mu);
        held[z(rank.coord().dp)] = rank.trainer().grad_sync().memory();
      },
      cfg);
}

// Sharded gradients (ZeRO-2) keep, per replica, the reduced slice of each
// bucket (padded / dp elements) and a pool of micro-batch buffers, where
// ZeRO-1 keeps every bucket whole beside its slice. Measured: the bytes
// GradSync holds after the steps, against those formulas, with small buckets
// at dp 2. The pool holds the buckets open at once (those the running node's
// parameters fall in, and wte's, open from the head's W to the embedding's:
// the weights are tied) and the reductions in flight: it depends on a
// layer's size, not on the depth, so twice the layers leave it as it is while
// the slices double. Each bucket is reduce-scattered once per micro-batch
// instead of once per step: M times ZeRO-1's messages and bytes. The steps
// are ZeRO-1's and the single process's to kTol (another summation order:
// micro-batches summed after the replicas, not before).
TEST(ShardedGradients, KeepTheirSliceAndAPoolThatTheDepthDoesNotGrow) {
  GptConfig deep = tiny();
  deep.num_layers = 16;
  for (const bool overlap : {true, false}) {
    SCOPED_TRACE(overlap ? "overlap" : "no overlap");
    Layout zero1{2, 1, 1};
    zero1.distributed = true;
    zero1.bucket_elements = 2048;
    zero1.overlap = overlap;
    Layout zero2 = zero1;
    zero2.shard_grads = true;
    std::vector<GradSync::Memory> h1, h2, d1, d2;
    const std::vector<RankRun> a = run_keeping_memory(zero1, tiny(), kSteps, h1);
    const std::vector<RankRun> b = run_keeping_memory(zero2, tiny(), kSteps, h2);
    run_keeping_memory(zero1, deep, 1, d1);
    run_keeping_memory(zero2, deep, 1, d2);
    expect_same_steps(a, b, "zero2 against zero1");
    expect_reference_steps(b, 0);
    const double micro_batches = static_cast<double>(kGlobal / (kMicro * zero1.dp));
    for (size_t r = 0; r < b.size(); ++r) {
      const GradSync::Memory &m1 = h1[r], &m2 = h2[r];
      // ZeRO-1: each bucket whole (4 P' bytes) and its slice (4 P' / dp).
      const double padded = m1.grads / (1.0 + 1.0 / zero1.dp);
      EXPECT_EQ(m1.grad_buffers, 0.0);
      // ZeRO-2: the slices alone; values and state as ZeRO-1's.
      EXPECT_EQ(m2.grads, padded / zero1.dp) << "rank " << r;
      EXPECT_EQ(d2[r].grads, d1[r].grads / (1.0 + zero1.dp)) << "rank " << r;
      EXPECT_EQ(m2.values, m1.values);
      EXPECT_EQ(m2.state, m1.state);
      EXPECT_GT(m2.grad_buffers, 0.0);
      EXPECT_EQ(d2[r].grad_buffers, m2.grad_buffers)
          << "rank " << r << ": the pool grew with depth";
      EXPECT_GT(d1[r].grads, 1.9 * m1.grads) << "rank " << r;
      EXPECT_LT(d2[r].grads + d2[r].grad_buffers, d1[r].grads) << "rank " << r;
      const GradSync::Stats &s1 = a[r].stats.back(), &s2 = b[r].stats.back();
      EXPECT_EQ(s2.buckets, s1.buckets * micro_batches) << "rank " << r;
      EXPECT_NEAR(s2.bytes_sent, s1.bytes_sent * micro_batches, 1e-9 * s2.bytes_sent);
      // Each starts when its micro-batch's last W is done (without overlap it
      // is also waited for there).
      EXPECT_EQ(s2.started_in_backward, s2.buckets) << "rank " << r;
    }
  }
}

// Sharded parameters (ZeRO-3) keep, per replica, each bucket's slice of the
// values (padded / dp elements, where ZeRO-2 keeps the bucket whole) and a
// pool of gathered buckets: at most twice the buckets one node touches, so
// twice the layers leave the pool as it is while the slices double.
// Gradients and optimizer state are ZeRO-2's. The values a node reads are
// the ones ZeRO-2's all-gather after the update gives, bit for bit, so the
// steps are ZeRO-2's exactly. Each micro-batch gathers every bucket at least
// once (the deep model's pool holds fewer buckets than it has), and some
// gathers are posted ahead, while the node before computes.
TEST(ShardedParameters, KeepTheirSliceAndAPoolThatTheDepthDoesNotGrow) {
  GptConfig deep = tiny();
  deep.num_layers = 16;
  Layout zero2{2, 1, 1};
  zero2.distributed = zero2.shard_grads = true;
  zero2.bucket_elements = 2048;
  Layout zero3 = zero2;
  zero3.shard_params = true;
  std::vector<GradSync::Memory> h2, h3, d2, d3;
  const std::vector<RankRun> a = run_keeping_memory(zero2, tiny(), kSteps, h2);
  const std::vector<RankRun> b = run_keeping_memory(zero3, tiny(), kSteps, h3);
  const std::vector<RankRun> da = run_keeping_memory(zero2, deep, 1, d2);
  const std::vector<RankRun> db = run_keeping_memory(zero3, deep, 1, d3);
  for (size_t r = 0; r < b.size(); ++r)
    for (size_t s = 0; s < z(kSteps); ++s) {
      EXPECT_EQ(b[r].steps[s].loss, a[r].steps[s].loss) << "rank " << r << " step " << s + 1;
      EXPECT_EQ(b[r].steps[s].grad_norm, a[r].steps[s].grad_norm)
          << "rank " << r << " step " << s + 1;
    }
  expect_reference_steps(b, 0);
  expect_reference_params(b, zero3);
  for (size_t r = 0; r < b.size(); ++r) {
    const GradSync::Memory &m2 = h2[r], &m3 = h3[r];
    EXPECT_EQ(m3.values, m2.values / zero2.dp) << "rank " << r;
    EXPECT_EQ(d3[r].values, d2[r].values / zero2.dp) << "rank " << r;
    EXPECT_EQ(m3.grads, m2.grads);
    EXPECT_EQ(m3.grad_buffers, m2.grad_buffers);
    EXPECT_EQ(m3.state, m2.state);
    EXPECT_EQ(m2.value_buffers, 0.0);
    EXPECT_GT(m3.value_buffers, 0.0);
    EXPECT_EQ(d3[r].value_buffers, m3.value_buffers)
        << "rank " << r << ": the pool grew with depth";
    EXPECT_LT(d3[r].values + d3[r].value_buffers, d2[r].values) << "rank " << r;
    const GradSync::Stats& s = db[r].stats.back();
    // ZeRO-2's reduce-scatters: one per bucket and micro-batch.
    EXPECT_GE(s.gathers, da[r].stats.back().buckets) << "rank " << r;
    EXPECT_GT(s.prefetched, 0) << "rank " << r;
    EXPECT_EQ(a[r].stats.back().gathers, 0) << "rank " << r;
  }
}

// --- 3. bucket overlap ---

TEST(GradBuckets, StartDuringTheBackwardUnlessOverlapIsOff) {
  Layout on{2, 1, 1};
  on.bucket_elements = 2048;
  Layout off = on;
  off.overlap = false;
  const std::vector<RankRun> a = run_layout(on, 2);
  const std::vector<RankRun> b = run_layout(off, 2);
  // A parameter larger than a bucket is a bucket of its own; the others
  // share buckets of at most bucket_elements.
  int64_t alone = 0, shared = 0;
  for (const auto& [name, t] : reference().params) {
    if (t.numel() > on.bucket_elements)
      ++alone;
    else
      shared += t.numel();
  }
  const int64_t at_least = alone + (shared + on.bucket_elements - 1) / on.bucket_elements;
  for (size_t rank = 0; rank < a.size(); ++rank) {
    for (size_t s = 0; s < a[rank].stats.size(); ++s) {
      const GradSync::Stats& x = a[rank].stats[s];
      EXPECT_GE(x.buckets, at_least) << "rank " << rank;
      EXPECT_EQ(x.started_in_backward, x.buckets) << "rank " << rank << " step " << s + 1;
      EXPECT_GT(x.bytes_sent, 0.0);
      const GradSync::Stats& y = b[rank].stats[s];
      EXPECT_EQ(y.buckets, x.buckets) << "rank " << rank;
      EXPECT_EQ(y.started_in_backward, 0) << "rank " << rank << " step " << s + 1;
      // Identical either way: the same reductions, started at other times.
      EXPECT_EQ(a[rank].steps[s].loss, b[rank].steps[s].loss) << "rank " << rank;
      EXPECT_EQ(a[rank].steps[s].grad_norm, b[rank].steps[s].grad_norm) << "rank " << rank;
      EXPECT_GE(a[rank].steps[s].dp_wait_ms, 0.0);
    }
  }
  expect_reference_steps(a, 0);
}

// With a pipeline, the buckets of weights tied across stages (wte, in the
// first and last stage) wait for the pipeline's sum: they start in finish().
TEST(GradBuckets, TiedWeightsAreTheLateBucketsOfAPipeline) {
  Layout l{2, 2, 1, "1f1b"};
  l.bucket_elements = 2048;
  std::vector<int> late(z(l.world()), -1);
  std::mutex mu;
  const std::vector<RankRun> runs = run_layout(l, 2, [&](RankLayout& rank) {
    int n = 0;
    for (Param* p : rank.pipeline()->tied_params()) {
      // Larger than a bucket: each is a bucket of its own.
      EXPECT_GT(p->value.numel(), l.bucket_elements) << p->name;
      ++n;
    }
    std::lock_guard<std::mutex> lock(mu);
    late[z(rank.coord().tp + l.tp * (rank.coord().dp + l.dp * rank.coord().pp))] = n;
  });
  for (size_t rank = 0; rank < runs.size(); ++rank) {
    EXPECT_EQ(late[rank], 1) << "rank " << rank << ": wte is tied between the two stages";
    for (const GradSync::Stats& x : runs[rank].stats) {
      EXPECT_GT(x.buckets, 2) << "rank " << rank;
      EXPECT_EQ(x.started_in_backward, x.buckets - late[rank]) << "rank " << rank;
    }
  }
  expect_reference_steps(runs, 0);
}

// --- 4. checkpoints across layouts ---

constexpr int kSaveAfter = 2;

// Saves after kSaveAfter steps of `from`, then resumes at each of `to`: their
// steps kSaveAfter + 1 .. kSteps are the uninterrupted run's.
void save_and_resume(const Layout& from, const std::vector<Layout>& to, const std::string& tag) {
  const std::string dir = testing::temp_dir(tag);
  const std::vector<RankRun> first =
      run_layout(from, kSaveAfter, {}, [&](RankLayout& rank) { rank.trainer().save(dir); });
  expect_reference_steps(first, 0);
  for (const Layout& l : to) {
    SCOPED_TRACE("resumed at " + l.name());
    const std::vector<RankRun> rest = run_layout(l, kSteps - kSaveAfter, [&](RankLayout& rank) {
      rank.trainer().load(dir);
      EXPECT_EQ(rank.trainer().steps_done(), kSaveAfter);
    });
    expect_reference_steps(rest, kSaveAfter);
    expect_reference_params(rest, l);
  }
}

TEST(Checkpoint, SavedAt222ResumesAt142And811AndOneProcess) {
  save_and_resume({2, 2, 2, "1f1b"}, {{1, 4, 2, "1f1b"}, {8, 1, 1}, {1, 1, 1}}, "ckpt_222");
}

TEST(Checkpoint, SavedByTheDistributedOptimizerResumesElsewhere) {
  Layout from{2, 2, 2, "zb-h1"};
  from.distributed = true;
  Layout to_zero1{4, 1, 2};
  to_zero1.distributed = true;
  save_and_resume(from, {{1, 4, 2, "zb-h1"}, to_zero1, {1, 1, 1}}, "ckpt_222_zero1");
}

// Sharded gradients save what ZeRO-1 saves (the gradients are not state):
// a checkpoint moves between every strategy and layout.
TEST(Checkpoint, SavedWithShardedGradientsResumesUnderEveryStrategy) {
  Layout from{2, 2, 2, "1f1b"};
  from.distributed = from.shard_grads = true;
  from.bucket_elements = 2048;
  Layout to_zero2{4, 1, 2};
  to_zero2.distributed = to_zero2.shard_grads = true;
  Layout to_zero1{8, 1, 1};
  to_zero1.distributed = true;
  save_and_resume(from, {to_zero2, to_zero1, {2, 2, 2, "1f1b"}, {1, 1, 1}}, "ckpt_222_zero2");
}

// Sharded parameters save each replica's slice of the values, as ZeRO-1
// saves its slice of the state: the checkpoint is the same files, and it
// moves both ways between ZeRO-3 and every other strategy and layout (a
// ZeRO-3 replica reads only its slices; tied weights whole).
TEST(Checkpoint, SavedWithShardedParametersResumesUnderEveryStrategy) {
  Layout from{2, 2, 2, "zb-h1"};
  from.distributed = from.shard_grads = from.shard_params = true;
  from.bucket_elements = 2048;
  Layout to_zero3{4, 1, 2};
  to_zero3.distributed = to_zero3.shard_grads = to_zero3.shard_params = true;
  to_zero3.bucket_elements = 4096;
  Layout to_zero1{8, 1, 1};
  to_zero1.distributed = true;
  save_and_resume(from, {to_zero3, to_zero1, {1, 1, 1}}, "ckpt_222_zero3");
  Layout plain{2, 2, 2, "1f1b"};
  save_and_resume(plain, {to_zero3, from}, "ckpt_222_to_zero3");
}

// --init-from under sharded parameters: each replica keeps its slices of
// the file's weights (the values between actions are gathered buffers, not
// the parameters' own), and trains as one process that read the same file.
TEST(Checkpoint, WeightsFileInitialisesShardedParameters) {
  const std::string dir = testing::temp_dir("init_zero3");
  GptModel other = build_gpt(tiny(), kMicro);
  init_gpt(other, kSeed + 1);  // not the layouts' own initialisation
  save_weights(dir + "/w.safetensors", other.graph.params());
  auto from_file = [&](RankLayout& rank) { rank.trainer().load_weights(dir + "/w.safetensors"); };
  const std::vector<RankRun> one = run_layout({1, 1, 1}, kSteps, from_file);
  EXPECT_GT(std::abs(one[0].steps[0].loss - reference().loss[0]), 1e-4)
      << "the file's weights train as the default ones";
  for (Layout l : std::vector<Layout>{{2, 2, 2, "zb-h1"}, {4, 1, 2}}) {
    l.distributed = l.shard_grads = l.shard_params = true;
    l.bucket_elements = 2048;
    SCOPED_TRACE(l.name());
    const std::vector<RankRun> runs = run_layout(l, kSteps, from_file);
    for (const RankRun& r : runs)
      for (size_t s = 0; s < z(kSteps); ++s)
        EXPECT_NEAR(r.steps[s].loss, one[0].steps[s].loss, kTol * one[0].steps[s].loss)
            << "step " << s + 1;
  }
}

TEST(Checkpoint, AnotherModelShapeNamesTheTensorAndBothShapes) {
  const std::string dir = testing::temp_dir("ckpt_shape");
  run_layout({2, 1, 1}, 1, {}, [&](RankLayout& rank) { rank.trainer().save(dir); });

  // More positions: only wpe differs.
  GptConfig longer = tiny();
  longer.max_positions = 32;
  std::string msg = error_message([&] {
    run_layout(
        {1, 1, 1}, 0, [&](RankLayout& rank) { rank.trainer().load(dir); }, {}, longer);
  });
  EXPECT_TRUE(contains(msg, "'wpe.weight'")) << msg;
  EXPECT_TRUE(contains(msg, Shape{16, 32}.str()) && contains(msg, Shape{32, 32}.str())) << msg;

  // A larger vocabulary, at tp 2 where wte is split: the shapes named are the full ones.
  GptConfig wider = tiny();
  wider.vocab_size = 512;
  msg = error_message([&] {
    run_layout(
        {1, 1, 2}, 0, [&](RankLayout& rank) { rank.trainer().load(dir); }, {}, wider);
  });
  EXPECT_TRUE(contains(msg, "'wte.weight'")) << msg;
  EXPECT_TRUE(contains(msg, Shape{256, 32}.str()) && contains(msg, Shape{512, 32}.str())) << msg;
}

// --- 5. config errors, before any communication ---

// A world whose every communication is an error: a RankLayout given one of
// its ranks must find a bad config by arithmetic alone, as every rank of a
// real job does, each on its own.
class NoCommunication final : public Communicator {
 public:
  NoCommunication(int rank, int size) : Communicator(CommOptions{}), rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int world_rank(int r) const override { return r; }
  std::string describe() const override { return "world"; }
  RequestPtr isend(const Tensor&, int, MessageTag) override { fail("isend"); }
  RequestPtr irecv(const Tensor&, int, MessageTag) override { fail("irecv"); }
  void all_reduce(const Tensor&, ReduceOp) override { fail("all_reduce"); }
  void all_gather(const Tensor&, const Tensor&) override { fail("all_gather"); }
  void reduce_scatter(const Tensor&, const Tensor&, ReduceOp) override { fail("reduce_scatter"); }
  void broadcast(const Tensor&, int) override { fail("broadcast"); }
  void barrier() override { fail("barrier"); }
  std::unique_ptr<Communicator> split(const std::vector<std::vector<int>>&,
                                      const std::string& name) override {
    fail("split " + name);
  }

 private:
  [[noreturn]] static void fail(const std::string& op) {
    throw Error("communicated ({}) before the config was checked", op);
  }
  int rank_, size_;
};

std::string layout_error(int world, LayoutOptions lo, TrainOptions opt = options(),
                         GptConfig cfg = tiny()) {
  TokenBatches batches(text_data(), opt.global_batch, cfg.seq_length);
  GptModel model = build_gpt(cfg, opt.micro_batch);
  std::string first;
  // Every rank throws the same error by itself.
  for (int r = 0; r < world; ++r) {
    NoCommunication comm(r, world);
    const std::string msg = error_message(
        [&] { RankLayout rank(&comm, model.graph, model.io, batches, opt, lo, kSeed); });
    if (r == 0) first = msg;
    EXPECT_EQ(msg, first) << "rank " << r;
  }
  return first;
}

TEST(ConfigErrors, WorldNotDivisibleByTpTimesPp) {
  LayoutOptions lo;
  lo.tp = 3;
  const std::string msg = layout_error(8, lo);
  EXPECT_TRUE(contains(msg, "world size (8) must be divisible by tensor-parallel size (3)")) << msg;
  lo.tp = 2, lo.pp = 3;
  const std::string pp_msg = layout_error(8, lo);
  EXPECT_TRUE(contains(pp_msg, "pipeline-parallel size (3)")) << pp_msg;
}

TEST(ConfigErrors, GlobalBatchNotDivisibleByMicroBatchTimesDp) {
  TrainOptions opt = options();
  opt.global_batch = 6;
  const std::string msg = layout_error(4, {}, opt);
  EXPECT_TRUE(contains(msg, "--global-batch-size (6)")) << msg;
  EXPECT_TRUE(contains(msg, "--micro-batch-size (1)")) << msg;
  EXPECT_TRUE(contains(msg, "data-parallel size (4)")) << msg;
}

TEST(ConfigErrors, HeadsOrVocabularyNotDivisibleByTp) {
  GptConfig cfg = tiny();
  cfg.hidden_size = 48, cfg.num_heads = 6;  // every width divides by 4: only the heads do not
  LayoutOptions lo;
  lo.tp = 4;
  const std::string msg = layout_error(4, lo, options(), cfg);
  EXPECT_TRUE(contains(msg, "attention heads (6) must be divisible by tensor-parallel size (4)"))
      << msg;
  cfg = tiny();
  cfg.vocab_size = 255;
  lo.tp = 2;
  const std::string vocab_msg = layout_error(2, lo, options(), cfg);
  EXPECT_TRUE(contains(vocab_msg, "vocabulary (255) must be divisible by tensor-parallel size (2)"))
      << vocab_msg;
}

// The heads error on a world of threads: it names the rule, and no rank hangs.
TEST(ConfigErrors, HeadsErrorOnAWorldOfThreads) {
  GptConfig cfg = tiny();
  cfg.hidden_size = 48, cfg.num_heads = 6;
  const std::string msg = error_message([&] {
    run_local(4, [&](Communicator& world) {
      TokenBatches batches(text_data(), kGlobal, cfg.seq_length);
      GptModel model = build_gpt(cfg, kMicro);
      LayoutOptions lo;
      lo.tp = 4;
      RankLayout rank(&world, model.graph, model.io, batches, options(), lo, kSeed);
    });
  });
  EXPECT_TRUE(contains(msg, "attention heads (6) must be divisible by tensor-parallel size (4)"))
      << msg;
}

// --- local SGD and DiLoCo ---
//
// SGD (momentum 0.9, no clipping) on every replica's own gradients, its
// parameters averaged every H steps. With H = 1 this is synchronous data
// parallelism: every step averages (p - lr g_r) over the replicas where the
// synchronous run steps with the average of g_r; SGD's update is linear in
// the gradient, so the two differ only by the order of float sums, and by
// 1e-5 relative at most over six steps (the parity tests' bound). AdamW's
// moments are not linear, so that equality is not claimed for it.
struct LocalRun {
  int dp = 2, pp = 1, tp = 1;
  int64_t local_steps = 0;
  bool nesterov = false;
  float outer_lr = 1.0f, outer_momentum = 0.0f;
  DType reduce = DType::F32;  // the averages' dtype (--grad-reduce-dtype)
  GradCompression compression = GradCompression::None;
};

std::vector<StepRecord> local_sgd_steps(const LocalRun& r, int steps, const RankHook& before = {},
                                        const RankHook& after = {}) {
  TrainOptions o = options();
  o.clip_grad = 0;
  o.lr = LrSchedule{};
  o.lr.lr = 0.05f;
  o.local = {r.local_steps, r.nesterov, r.outer_lr, r.outer_momentum};
  LayoutOptions lo;
  lo.tp = r.tp, lo.pp = r.pp;
  lo.sync.optimizer = OptimizerKind::Sgd;
  lo.sync.sgd = {0.9f, 0.0f};
  lo.sync.reduce_dtype = r.reduce;
  lo.sync.compression = r.compression;
  lo.sync.powersgd_rank = 2;
  std::vector<std::vector<StepRecord>> records(z(r.dp * r.pp * r.tp));
  run_local(r.dp * r.pp * r.tp, [&](Communicator& world) {
    TokenBatches batches(text_data(), kGlobal, tiny().seq_length);
    GptModel model = build_gpt(tiny(), kMicro);
    RankLayout rank(&world, model.graph, model.io, batches, o, lo, kSeed);
    if (before) before(rank);
    for (int s = 0; s < steps; ++s) records[z(world.rank())].push_back(rank.trainer().train_step());
    if (after) after(rank);
  });
  for (const auto& rec : records)
    for (size_t s = 0; s < rec.size(); ++s)
      EXPECT_EQ(rec[s].loss, records[0][s].loss) << "every rank reports the same loss";
  return records[0];
}

std::vector<double> local_sgd_losses(const LocalRun& r, int steps, const RankHook& before = {},
                                     const RankHook& after = {}) {
  std::vector<double> losses;
  for (const StepRecord& rec : local_sgd_steps(r, steps, before, after)) losses.push_back(rec.loss);
  return losses;
}

TEST(LocalSgd, OneLocalStepIsSynchronousDataParallelismWithSgd) {
  for (const LocalRun& layout : {LocalRun{2, 1, 1}, LocalRun{2, 2, 1}, LocalRun{2, 1, 2}}) {
    LocalRun sync = layout, local = layout;
    local.local_steps = 1;
    const std::vector<double> want = local_sgd_losses(sync, 6), got = local_sgd_losses(local, 6);
    for (size_t s = 0; s < want.size(); ++s)
      EXPECT_NEAR(got[s], want[s], kTol * want[s])
          << "(dp, pp, tp) = (" << layout.dp << ", " << layout.pp << ", " << layout.tp
          << ") step " << s + 1;
  }
}

// dp_bytes: the gradients' all-reduce every step synchronously; with local
// steps nothing between averages, and at an average the parameters and the
// momentum (SGD's state is one tensor per parameter): the same bytes as a
// gradient reduction for each.
TEST(LocalSgd, BytesAreSentOnlyAtTheAverages) {
  LocalRun sync, local;
  local.local_steps = 3;
  const std::vector<StepRecord> s = local_sgd_steps(sync, 3), l = local_sgd_steps(local, 3);
  ASSERT_GT(s[0].dp_bytes, 0);
  EXPECT_EQ(l[0].dp_bytes, 0);
  EXPECT_EQ(l[1].dp_bytes, 0);
  EXPECT_EQ(l[2].dp_bytes, 2 * s[0].dp_bytes);
}

TEST(LocalSgd, ReplicasDivergeBetweenAveragesAndDiLoCoWithUnitOuterStepIsTheAverage) {
  LocalRun sync, local, diloco;
  local.local_steps = diloco.local_steps = 3;
  diloco.nesterov = true;  // outer lr 1, momentum 0: start - (start - average) = average
  const std::vector<double> s = local_sgd_losses(sync, 6), l = local_sgd_losses(local, 6),
                            d = local_sgd_losses(diloco, 6);
  double most = 0;
  for (size_t i = 0; i < s.size(); ++i) most = std::max(most, std::abs(l[i] - s[i]) / s[i]);
  EXPECT_GT(most, 1e-4) << "three local steps train differently from synchronous ones";
  for (size_t i = 0; i < l.size(); ++i) EXPECT_NEAR(d[i], l[i], kTol * l[i]) << "step " << i + 1;
}

// Compressed averages: each replica's delta from the period's start travels
// in bf16 (or as PowerSGD factors), the momentum in bf16 (or fp32). bf16
// halves every byte of an average. Rounding a delta to bf16 errs by at most
// 2^-9 of it, so the parameters stray from the exact average by at most
// 2^-9 of how far they moved, and the loss from synchronous training's by
// about 2^-9 of how far it fell (bounded here by 2^-7 of the fall, plus the
// parity bound); but it does differ. PowerSGD sends the deltas as low-rank
// factors and the momentum whole; every replica applies the same mean delta
// from the same start, so the replicas stay identical.
TEST(LocalSgd, CompressedAveragesTravelAsDeltas) {
  LocalRun plain, bf16, powersgd;
  plain.local_steps = bf16.local_steps = powersgd.local_steps = 3;
  bf16.reduce = DType::BF16;
  powersgd.compression = GradCompression::PowerSgd;
  const std::vector<StepRecord> p = local_sgd_steps(plain, 3), b = local_sgd_steps(bf16, 3);
  ASSERT_GT(p[2].dp_bytes, 0);
  EXPECT_EQ(b[0].dp_bytes, 0);
  EXPECT_EQ(2 * b[2].dp_bytes, p[2].dp_bytes);
  for (const LocalRun& layout : {LocalRun{2, 1, 1}, LocalRun{2, 2, 1}}) {
    LocalRun sync1 = layout, bf16_1 = layout;
    bf16_1.local_steps = 1;
    bf16_1.reduce = DType::BF16;
    const std::vector<double> want = local_sgd_losses(sync1, 6), got = local_sgd_losses(bf16_1, 6);
    const double fall = std::abs(want.front() - want.back());
    double most = 0;
    for (size_t s = 0; s < want.size(); ++s) {
      EXPECT_NEAR(got[s], want[s], fall / 128 + kTol * want[s])
          << "pp " << layout.pp << " step " << s + 1;
      most = std::max(most, std::abs(got[s] - want[s]));
    }
    EXPECT_GT(most, 0) << "bf16 deltas trained exactly as fp32 averages at pp " << layout.pp;
  }
  // PowerSGD: fewer bytes than bf16's; both replicas end with the same parameters.
  std::map<int, std::map<std::string, Tensor>> ends;
  std::mutex mu;
  const std::vector<StepRecord> c =
      local_sgd_steps(powersgd, 6, {}, [&](RankLayout& rank) {
        std::lock_guard<std::mutex> lock(mu);
        auto& mine = ends[static_cast<int>(ends.size())];
        for (Param* q : rank.trainer().params()) mine.emplace(q->name, q->value.clone());
      });
  ASSERT_EQ(ends.size(), 2u);
  for (const auto& [name, value] : ends[0])
    EXPECT_EQ(std::memcmp(value.raw(), ends[1].at(name).raw(), value.nbytes()), 0) << name;
  // The momentum's half of an average travels whole (fp32), the deltas' as factors.
  EXPECT_GT(c[2].dp_bytes, p[2].dp_bytes / 2);
  EXPECT_LT(c[2].dp_bytes, p[2].dp_bytes);
  for (const StepRecord& rec : c) EXPECT_TRUE(std::isfinite(rec.loss));
}

// A checkpoint after an average holds DiLoCo's outer momentum: resuming there
// gives the uninterrupted run's losses bit for bit.
TEST(LocalSgd, DiLoCoResumesBitExactly) {
  LocalRun r;
  r.local_steps = 2, r.nesterov = true, r.outer_lr = 0.7f, r.outer_momentum = 0.9f;
  const std::vector<double> whole = local_sgd_losses(r, 6);
  const std::string dir = testing::temp_dir("diloco-resume");
  const std::vector<double> first =
      local_sgd_losses(r, 4, {}, [&](RankLayout& rank) { rank.trainer().save(dir); });
  const std::vector<double> rest =
      local_sgd_losses(r, 2, [&](RankLayout& rank) { rank.trainer().load(dir); });
  ASSERT_EQ(rest.size(), 2u);
  EXPECT_EQ(rest[0], whole[4]);
  EXPECT_EQ(rest[1], whole[5]);
  // Between averages the replicas differ: no checkpoint there.
  const std::string msg = error_message(
      [&] { local_sgd_losses(r, 3, {}, [&](RankLayout& rank) { rank.trainer().save(dir); }); });
  EXPECT_TRUE(contains(msg, "with --local-steps 2, a checkpoint is taken when the replicas agree"))
      << msg;
}

// --- parameter servers ---
//
// Workers are replicas of one process each; the last `servers` ranks of the
// world are servers (weft/param_server.h). With --max-staleness 0 a server
// sums every worker's gradients of a step in worker order, clips by the whole
// sum's norm and updates once: synchronous data parallelism's steps, whose
// sums run in the same order, so the same 1e-5 as every layout here.
struct PsRun {
  std::vector<StepRecord> steps;                  // worker 0's
  std::map<std::string, Tensor> params;           // worker 0's, after the run
  std::vector<int64_t> histogram;                 // staleness counts, all servers
  int64_t max_gap = 0;                            // the most steps a worker was ahead
  int64_t updates = 0;                            // applied by server 0
};

// Each worker's ranks: a pipeline x tensor-parallel group.
struct PsGroup {
  int pp = 1, tp = 1;
  int ranks() const { return pp * tp; }
};

// Steps [first, steps) of a parameter-server run; with `load`, from that
// checkpoint (first is its step); with `save`, a checkpoint after the last.
// `params` holds worker 0's whole tensors when a worker is one process.
PsRun run_ps(int workers, int servers, int64_t staleness, int steps, int first = 0,
             const std::string& save = "", const std::string& load = "", PsGroup group = {}) {
  PsConfig cfg;
  cfg.servers = servers;
  cfg.max_staleness = staleness;
  cfg.save_last = !save.empty();
  const TrainOptions o = options();
  cfg.adam = o.adam, cfg.lr = o.lr, cfg.clip_grad = o.clip_grad;
  PsRun out;
  std::mutex mu;
  const int worker_ranks = workers * group.ranks();
  run_local(worker_ranks + servers, [&](Communicator& world) {
    std::vector<int> w(z(worker_ranks)), sv(z(servers));
    std::iota(w.begin(), w.end(), 0);
    std::iota(sv.begin(), sv.end(), worker_ranks);
    std::unique_ptr<Communicator> role = world.split({w, sv}, "ps");
    TokenBatches batches(text_data(), kGlobal, tiny().seq_length);
    GptModel model = build_gpt(tiny(), kMicro);
    if (world.rank() >= worker_ranks) {
      for (Param* p : model.graph.params()) init_param(*p, kSeed);
      PsServer server(world, *role, model.graph.params(), cfg);
      if (!load.empty()) server.load(open_checkpoint(load));
      server.serve(first, steps);
      std::lock_guard<std::mutex> lock(mu);
      out.max_gap = std::max(out.max_gap, server.max_clock_gap());
      if (world.rank() == worker_ranks) out.updates = server.updates();
      return;
    }
    PsWorker ps(world, model.graph.params(), cfg);
    LayoutOptions lo;
    lo.ps = &ps;
    lo.pp = group.pp, lo.tp = group.tp;
    RankLayout rank(role.get(), model.graph, model.io, batches, o, lo, kSeed);
    if (!load.empty()) rank.trainer().load(load);
    std::vector<StepRecord> recs;
    for (int s = first; s < steps; ++s) recs.push_back(rank.trainer().train_step());
    if (!save.empty()) rank.trainer().save(save);
    if (world.rank() != 0) return;
    out.histogram = ps.staleness_histogram();
    out.steps = recs;
    if (group.ranks() == 1)
      for (Param* p : rank.trainer().params()) out.params.emplace(p->name, p->value.clone());
  });
  return out;
}

// The whole tensors of the newest checkpoint in `dir`.
std::map<std::string, Tensor> checkpoint_params(const std::string& dir) {
  GptModel model = build_gpt(tiny(), kMicro);
  open_checkpoint(dir).read_model(model.graph.params());
  std::map<std::string, Tensor> out;
  for (Param* p : model.graph.params()) out.emplace(p->name, p->value.clone());
  return out;
}

TEST(ParamServer, NoStalenessIsSynchronousDataParallelism) {
  const Reference& ref = reference();
  for (auto [workers, servers] : std::vector<std::pair<int, int>>{{2, 1}, {4, 2}, {8, 3}}) {
    const PsRun r = run_ps(workers, servers, 0, kSteps);
    ASSERT_EQ(r.steps.size(), z(kSteps));
    for (size_t s = 0; s < r.steps.size(); ++s) {
      EXPECT_NEAR(r.steps[s].loss, ref.loss[s], kTol * ref.loss[s])
          << workers << " workers, " << servers << " servers, step " << s + 1;
      EXPECT_NEAR(r.steps[s].grad_norm, ref.norm[s], kTol * ref.norm[s])
          << workers << " workers, " << servers << " servers, step " << s + 1;
      EXPECT_EQ(r.steps[s].ps_staleness, 0);
      EXPECT_GE(r.steps[s].ps_wait_ms, 0);
    }
    for (const auto& [name, value] : r.params)
      EXPECT_TRUE(params_close(value, ref.params.at(name))) << name;
    EXPECT_EQ(r.params.size(), ref.params.size());
    EXPECT_LE(r.max_gap, 1);  // a worker pushes step t + 1 only after the round of t
    EXPECT_EQ(r.updates, kSteps);  // one update per step
    EXPECT_EQ(r.histogram[0], servers * kSteps);
  }
}

// With S > 0 every worker's push is an update of its own: the run differs
// from synchronous training, no worker is ever more than S + 1 steps ahead of
// the slowest when it pushes, and updates from other workers come between a
// worker's read and its push (staleness above 0).
TEST(ParamServer, BoundedStalenessAppliesEachPushAndKeepsTheBound) {
  const Reference& ref = reference();
  for (int64_t s : {1, 4}) {
    const int workers = 4, servers = 2, steps = 8;
    const PsRun r = run_ps(workers, servers, s, steps);
    ASSERT_EQ(r.steps.size(), z(steps));
    EXPECT_LE(r.max_gap, s + 1) << "S " << s;
    EXPECT_EQ(r.updates, workers * steps) << "S " << s;
    int64_t counted = 0, stale = 0;
    for (size_t b = 0; b < r.histogram.size(); ++b) {
      counted += r.histogram[b];
      if (b > 0) stale += r.histogram[b];
    }
    EXPECT_EQ(counted, servers * workers * steps) << "S " << s;
    EXPECT_GT(stale, 0) << "S " << s;
    bool differs = false;
    for (size_t k = 1; k < z(kSteps); ++k)
      differs |= std::abs(r.steps[k].loss - ref.loss[k]) > 1e-3 * ref.loss[k];
    EXPECT_TRUE(differs) << "S " << s << " trained exactly as synchronous steps";
    for (const StepRecord& rec : r.steps) EXPECT_TRUE(std::isfinite(rec.loss));
  }
}

// A checkpoint holds the servers' parameters and optimizer state: resumed,
// S = 0 continues bit for bit, and any layout without servers loads it and
// takes the single-process steps. With S > 0 the save step is one every
// worker waits at, and a resumed run goes on from it.
TEST(ParamServer, CheckpointsHoldTheServersStateAndResume) {
  const std::string dir = testing::temp_dir("ps-checkpoint");
  const PsRun full = run_ps(2, 2, 0, kSteps);
  run_ps(2, 2, 0, 3, 0, dir + "/s0");
  const PsRun rest = run_ps(2, 2, 0, kSteps, 3, "", dir + "/s0");
  ASSERT_EQ(rest.steps.size(), 2u);
  for (size_t k = 0; k < 2; ++k) {
    EXPECT_EQ(rest.steps[k].step, static_cast<int64_t>(3 + k));
    EXPECT_EQ(rest.steps[k].loss, full.steps[3 + k].loss) << "step " << 4 + k;
    EXPECT_EQ(rest.steps[k].grad_norm, full.steps[3 + k].grad_norm) << "step " << 4 + k;
  }
  for (const auto& [name, value] : rest.params) {
    const Tensor& want = full.params.at(name);
    EXPECT_EQ(std::memcmp(value.raw(), want.raw(), want.nbytes()), 0) << name;
  }
  // Plain data parallelism, from the servers' checkpoint.
  const std::vector<RankRun> dp =
      run_layout({2, 1, 1}, kSteps - 3, [&](RankLayout& rank) { rank.trainer().load(dir + "/s0"); });
  expect_reference_steps(dp, 3);
  // S = 2: saved after step 4 of 8 and resumed.
  run_ps(4, 1, 2, 4, 0, dir + "/s2");
  const PsRun stale = run_ps(4, 1, 2, 8, 4, "", dir + "/s2");
  ASSERT_EQ(stale.steps.size(), 4u);
  EXPECT_EQ(stale.steps.front().step, 4);
  for (const StepRecord& r : stale.steps) EXPECT_TRUE(std::isfinite(r.loss));
}

// Workers that are pipeline x tensor-parallel groups: each rank pushes the
// pieces it owns (a split tensor's slice from every tp rank, a replicated one
// from tp rank 0, the tied embedding from its first pipeline holder) and
// pulls every piece it holds. With S = 0 that is synchronous data
// parallelism at that layout, so the single-process steps (kTol, the bound
// of every layout here); the checkpoint written at the end holds the
// single-process parameters (params_close's model), and a run resumed from
// one saved midway continues bit for bit. With S = 1 each worker's push is
// an update of its own, across all its ranks' pieces.
TEST(ParamServer, WorkersArePipelineAndTensorParallelGroups) {
  const Reference& ref = reference();
  const std::string dir = testing::temp_dir("ps-groups");
  for (const PsGroup g : {PsGroup{2, 1}, PsGroup{1, 2}, PsGroup{2, 2}}) {
    const std::string where = "pp " + std::to_string(g.pp) + " x tp " + std::to_string(g.tp);
    const std::string save = dir + "/pp" + std::to_string(g.pp) + "tp" + std::to_string(g.tp);
    const PsRun r = run_ps(2, 2, 0, kSteps, 0, save, "", g);
    ASSERT_EQ(r.steps.size(), z(kSteps)) << where;
    for (size_t s = 0; s < r.steps.size(); ++s) {
      EXPECT_NEAR(r.steps[s].loss, ref.loss[s], kTol * ref.loss[s]) << where << " step " << s + 1;
      EXPECT_NEAR(r.steps[s].grad_norm, ref.norm[s], kTol * ref.norm[s])
          << where << " step " << s + 1;
    }
    EXPECT_EQ(r.updates, kSteps) << where;
    const std::map<std::string, Tensor> saved = checkpoint_params(save);
    EXPECT_EQ(saved.size(), ref.params.size());
    for (const auto& [name, value] : saved)
      EXPECT_TRUE(params_close(value, ref.params.at(name))) << where << " " << name;
  }
  // Saved after step 3 at pp 2 x tp 2, resumed there: the uninterrupted steps.
  const PsGroup g{2, 2};
  const PsRun whole = run_ps(2, 1, 0, kSteps, 0, "", "", g);
  run_ps(2, 1, 0, 3, 0, dir + "/mid", "", g);
  const PsRun rest = run_ps(2, 1, 0, kSteps, 3, "", dir + "/mid", g);
  ASSERT_EQ(rest.steps.size(), 2u);
  for (size_t k = 0; k < 2; ++k) {
    EXPECT_EQ(rest.steps[k].loss, whole.steps[3 + k].loss) << "step " << 4 + k;
    EXPECT_EQ(rest.steps[k].grad_norm, whole.steps[3 + k].grad_norm) << "step " << 4 + k;
  }
  // S = 1: one update per worker and step, within the bound.
  const PsRun stale = run_ps(2, 2, 1, 6, 0, "", "", g);
  ASSERT_EQ(stale.steps.size(), 6u);
  EXPECT_EQ(stale.updates, 2 * 6);
  EXPECT_LE(stale.max_gap, 2);
  for (const StepRecord& rec : stale.steps) EXPECT_TRUE(std::isfinite(rec.loss));
}

TEST(ParamServer, MoreServersThanTensorsIsRefused) {
  GptModel model = build_gpt(tiny(), kMicro);
  const int n = static_cast<int>(model.graph.params().size());
  const std::string msg = error_message([&] { assign_to_servers(model.graph.params(), n + 1); });
  EXPECT_TRUE(contains(msg, fmt::format("--ps-ranks {} is more servers than the model's {} "
                                        "parameter tensors",
                                        n + 1, n)))
      << msg;
  // Largest first, each onto the least-loaded server: the loads end close.
  const std::vector<int> server = assign_to_servers(model.graph.params(), 3);
  std::vector<int64_t> load(3, 0);
  int64_t largest = 0;
  for (size_t i = 0; i < server.size(); ++i) {
    load[z(server[i])] += model.graph.params()[i]->value.numel();
    largest = std::max(largest, model.graph.params()[i]->value.numel());
  }
  EXPECT_LE(*std::max_element(load.begin(), load.end()) -
                *std::min_element(load.begin(), load.end()),
            largest);
}

}  // namespace
}  // namespace weft
