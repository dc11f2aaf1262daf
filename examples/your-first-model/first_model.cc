// Your first model with weft: a new layer, a model family made of it and of
// weft's layers, and a main that gives the model every flag of train_gpt
// (weft/job.h). docs/your-first-model.md walks through this file.
//
//   ./first_model                                          # one process
//   mpiexec -n 4 ./first_model --pp 2 --tp 2 --save ckpt   # 2 stages x 2 tensor-parallel ranks
#include <weft/job.h>
#include <weft/ops.h>

#include "layers/embedding.h"
#include "layers/gelu.h"
#include "layers/layernorm.h"
#include "layers/linear.h"
#include "layers/lm_head.h"
#include "layers/residual.h"

#include <fmt/core.h>

#include <memory>
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

// --- 2. A model family: a byte-level language model of MLP blocks, shaped by
// the job's flags (--num-layers, --hidden-size, --seq-length, --vocab-size). ---
weft::JobModel build_model(const weft::ModelArgs& args) {
  using namespace weft;
  const int64_t B = args.micro_batch, T = args.shape.seq_length, C = args.shape.hidden_size;
  JobModel m;
  ParamStore& ps = *m.params;
  Graph& g = m.graph;
  // Parameters are made by name; every layout initialises them from (seed,
  // name), so each rank of any layout starts from the same model. A weight
  // is made before its bias, in statements (a call's arguments are made in
  // an order of the compiler's choosing).
  auto norm = [&](const std::string& name) {
    Param* w = ps.create(name + ".weight", {C}, Init::constant(1));
    return std::make_unique<LayerNorm>(w, ps.create(name + ".bias", {C}, Init::constant(0)));
  };
  auto linear = [&](const std::string& name, int64_t in, int64_t out, ParallelRole role) {
    Param* w = ps.create(name + ".weight", {in, out}, Init::normal(0.02f));
    return std::make_unique<Linear>(w, ps.create(name + ".bias", {out}, Init::constant(0)), role);
  };
  // The vocabulary table, padded to table_rows() for --tp as Megatron pads
  // it: the padding rows are zero, masked and never saved.
  Param* wte = ps.create("wte.weight", {args.shape.table_rows(), C}, Init::normal(0.02f));
  if (args.shape.table_rows() > args.shape.vocab_size) wte->true_rows = args.shape.vocab_size;
  Param* wpe = ps.create("wpe.weight", {T, C}, Init::normal(0.02f));
  m.tokens = g.input("tokens", {B, T}, DType::I32);
  m.targets = g.input("targets", {B, T}, DType::I32);
  int x = g.add1("embed", std::make_unique<Embedding>(wte, wpe), {m.tokens});
  for (int64_t i = 0; i < args.shape.num_layers; ++i) {
    const std::string b = fmt::format("block.{}", i);
    int h = g.add1(b + ".norm", norm(b + ".norm"), {x});
    h = g.add1(b + ".up", linear(b + ".up", C, 4 * C, ParallelRole::Column), {h});
    h = g.add1(b + ".gelu", std::make_unique<Gelu>(), {h});
    h = g.add1(b + ".down", linear(b + ".down", 4 * C, C, ParallelRole::Row), {h});
    h = g.add1(b + ".scale", std::make_unique<Scale>(0.5f), {h});
    x = g.add1(b + ".residual", std::make_unique<Residual>(), {x, h});
  }
  x = g.add1("norm_f", norm("norm_f"), {x});
  auto head = std::make_unique<TiedLmHeadLoss>(wte);
  m.head = head.get();  // its logits are what --sample draws from
  const int loss = g.add1("head", std::move(head), {x, m.targets});
  g.mark_output(loss);
  // What the job needs: the inputs the data fills (tokens and targets), and
  // the loss, a sum of T terms per sequence.
  m.io = ModelIO{&m.graph, {m.tokens, m.targets}, loss, T};
  return m;
}

// --- 3. The job: train_gpt's flags, layouts, checkpoints and signals. ---
int main(int argc, char** argv) {
  weft::Job job;
  job.program = "first_model";
  job.about = "first_model: a byte-level language model of MLP blocks, trained with weft";
  job.families = {{"mlp", "MLP blocks with a scaled residual branch", build_model}};
  // This program's defaults; any flag on the command line wins.
  job.defaults = {{"--num-layers", "4"},        {"--hidden-size", "32"},
                  {"--seq-length", "16"},       {"--micro-batch-size", "2"},
                  {"--global-batch-size", "8"}, {"--lr", "1e-2"},
                  {"--train-iters", "40"},      {"--log-interval", "10"},
                  {"--data-path", FIRST_MODEL_TEXT}};
  return weft::train_main(argc, argv, job);
}
