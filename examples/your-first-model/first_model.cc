// Your first model with weft: a new layer, a new model made of it and of
// weft's layers, trained on two pipeline stages and checked against one
// process. docs/your-first-model.md walks through this file.
//
//   ./first_model                    # one process, then 2 stages on threads
//   mpiexec -n 4 ./first_model       # 2 stages x 2 tensor-parallel ranks, as processes
#include <weft/graph.h>
#include <weft/layout.h>
#include <weft/local_communicator.h>
#include <weft/mesh.h>
#include <weft/mpi_communicator.h>
#include <weft/ops.h>
#include <weft/trainer.h>

#include "layers/embedding.h"
#include "layers/gelu.h"
#include "layers/layernorm.h"
#include "layers/linear.h"
#include "layers/lm_head.h"
#include "layers/residual.h"

#include <fmt/core.h>

#include <cmath>
#include <mutex>
#include <string>
#include <vector>

// --- 1. A new layer: y = s * x, a fixed scale on a residual branch. ---
// It says what to compute with weft/ops.h, so it runs on any device.
class Scale final : public weft::Layer {
 public:
  explicit Scale(float s) : s_(s) {}
  const char* kind() const override { return "scale"; }
  std::vector<weft::Shape> output_shapes(std::span<const weft::Shape> in) const override {
    return {in[0]};
  }
  // x (N, C) -> y (N, C) = s x
  void forward(weft::LayerCtx&, weft::Arena&, std::span<const weft::Tensor> in,
               std::span<const weft::Tensor> out) override {
    out[0].copy_from(in[0]);
    weft::ops::scale(out[0], s_);
  }
  // dx (N, C) += s dy: gradients accumulate, so scale a copy and add it.
  void backward_input(weft::LayerCtx&, weft::Arena& arena, std::span<const weft::Tensor> grad_out,
                      std::span<const weft::Tensor> grad_in) override {
    if (!grad_in[0].defined()) return;
    weft::Tensor t = arena.alloc(grad_out[0].shape());
    t.copy_from(grad_out[0]);
    weft::ops::scale(t, s_);
    weft::ops::add(grad_in[0], t);
  }
  // No parameters, so nothing to split: every tensor-parallel rank runs a copy.
  std::unique_ptr<weft::Layer> tensor_parallel(weft::TpBuild&) const override {
    return std::make_unique<Scale>(s_);
  }

 private:
  float s_;
};

// --- 2. A new model: a byte-level language model of MLP blocks. ---
constexpr int64_t kVocab = 256, kWidth = 32, kBlocks = 4, kSeq = 16, kMicro = 2, kGlobal = 8;

struct Model {
  std::shared_ptr<weft::ParamStore> params = std::make_shared<weft::ParamStore>();
  weft::Graph graph{params};
  weft::ModelIO io;
};

// Parameters are made by name; every layout initialises them from (seed,
// name), so each rank of any layout starts from the same model.
std::unique_ptr<Model> build_model() {
  using namespace weft;
  auto m = std::make_unique<Model>();
  ParamStore& ps = *m->params;
  Graph& g = m->graph;
  // A weight made before its bias, in statements (a call's arguments are
  // made in an order of the compiler's choosing).
  auto norm = [&](const std::string& name) {
    Param* w = ps.create(name + ".weight", {kWidth}, Init::constant(1));
    return std::make_unique<LayerNorm>(w, ps.create(name + ".bias", {kWidth}, Init::constant(0)));
  };
  auto linear = [&](const std::string& name, int64_t in, int64_t out, ParallelRole role) {
    Param* w = ps.create(name + ".weight", {in, out}, Init::normal(0.02f));
    return std::make_unique<Linear>(w, ps.create(name + ".bias", {out}, Init::constant(0)), role);
  };
  Param* wte = ps.create("wte.weight", {kVocab, kWidth}, Init::normal(0.02f));
  Param* wpe = ps.create("wpe.weight", {kSeq, kWidth}, Init::normal(0.02f));
  const int tokens = g.input("tokens", {kMicro, kSeq}, DType::I32);
  const int targets = g.input("targets", {kMicro, kSeq}, DType::I32);
  int x = g.add1("embed", std::make_unique<Embedding>(wte, wpe), {tokens});
  for (int64_t i = 0; i < kBlocks; ++i) {
    const std::string b = fmt::format("block.{}", i);
    int h = g.add1(b + ".norm", norm(b + ".norm"), {x});
    h = g.add1(b + ".up", linear(b + ".up", kWidth, 4 * kWidth, ParallelRole::Column), {h});
    h = g.add1(b + ".gelu", std::make_unique<Gelu>(), {h});
    h = g.add1(b + ".down", linear(b + ".down", 4 * kWidth, kWidth, ParallelRole::Row), {h});
    h = g.add1(b + ".scale", std::make_unique<Scale>(0.5f), {h});
    x = g.add1(b + ".residual", std::make_unique<Residual>(), {x, h});
  }
  x = g.add1("norm_f", norm("norm_f"), {x});
  const int loss = g.add1("head", std::make_unique<TiedLmHeadLoss>(wte), {x, targets});
  g.mark_output(loss);
  // What the Trainer needs: the inputs a BatchSource fills (TokenBatches
  // fills tokens and targets), and the loss, a sum of kSeq terms per sequence.
  m->io = ModelIO{&m->graph, {tokens, targets}, loss, kSeq};
  return m;
}

// --- 3. Train it: one process, then two pipeline stages (threads here;
// train_gpt does the same under mpiexec). ---
constexpr int kSteps = 5;

std::vector<double> train(weft::Communicator* world, const weft::BatchSource& data, int pp,
                          int tp = 1) {
  using namespace weft;
  std::unique_ptr<Model> m = build_model();
  TrainOptions opt;
  opt.micro_batch = kMicro, opt.global_batch = kGlobal;
  opt.lr.lr = 1e-2f;
  LayoutOptions lo;
  lo.pp = pp, lo.tp = tp;
  lo.schedule = "1f1b";
  RankLayout rank(world, m->graph, m->io, data, opt, lo, /*seed=*/42);
  std::vector<double> losses;
  for (int s = 0; s < kSteps; ++s) losses.push_back(rank.trainer().train_step().loss);
  return losses;
}

// fp32 sums in another order: 1e-5 relative is rounding.
bool agree(const std::vector<double>& one, const std::vector<double>& other) {
  for (int s = 0; s < kSteps; ++s)
    if (std::abs(one[s] - other[s]) > 1e-5 * one[s]) return false;
  return true;
}

bool report(const std::vector<double>& one, const std::vector<double>& other,
            const std::string& what) {
  const bool same = agree(one, other);
  fmt::print("| step | one process | {} |\n|---:|---:|---:|\n", what);
  for (int s = 0; s < kSteps; ++s) fmt::print("| {} | {:.6f} | {:.6f} |\n", s + 1, one[s], other[s]);
  fmt::print("{}\n", same ? what + " train the same model" : "the runs differ beyond rounding");
  return same;
}

int main(int argc, char** argv) {
  using namespace weft;
  std::string text;
  for (int i = 0; i < 40; ++i) text += "The quick brown fox jumps over the lazy dog. ";
  const TokenData data = TokenData::from_tokens(std::vector<int32_t>(text.begin(), text.end()), 256);
  TokenBatches batches(data, kGlobal, kSeq);
  const std::vector<double> one = train(nullptr, batches, 1);

  const LaunchInfo launch = detect_launch();
  if (launch.size > 1) {  // under mpiexec: 2 pipeline stages x (ranks / 2) tensor-parallel ranks
    return mpi_main(argc, argv, [&](Communicator& world) {
      const int tp = world.size() / 2;
      const std::vector<double> layout = train(&world, batches, 2, tp);
      if (world.rank() == 0) report(one, layout, fmt::format("2 stages x {} tp ranks", tp));
      return agree(one, layout) ? 0 : 1;
    });
  }
  std::vector<double> two;
  std::mutex mu;
  run_local(2, [&](Communicator& world) {
    std::vector<double> l = train(&world, batches, 2);
    std::lock_guard<std::mutex> lock(mu);
    if (world.rank() == 0) two = l;
  });
  return report(one, two, "two pipeline stages") ? 0 : 1;
}
