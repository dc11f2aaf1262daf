#include <weft/pipeline.h>
#include <weft/trainer.h>

#include <chrono>
#include <cmath>

namespace weft {

nlohmann::json StepRecord::json() const {
  nlohmann::json j = {{"step", step},           {"loss", loss},         {"lr", lr},
                      {"grad_norm", grad_norm}, {"step_ms", step_ms}, {"tokens_per_s", tokens_per_s}};
  if (bubble_frac >= 0) j["bubble_frac"] = bubble_frac;
  return j;
}

std::string StepRecord::line(int64_t train_iters) const {
  return fmt::format("step {:>5}/{} | loss {:.4f} | lr {:.3e} | grad norm {:.3f} | {:.0f} ms | "
                     "{:.0f} tok/s",
                     step + 1, train_iters, loss, lr, grad_norm, step_ms, tokens_per_s) +
         (bubble_frac >= 0 ? fmt::format(" | bubble {:.1f}%", 100 * bubble_frac) : "");
}

TokenBatches::TokenBatches(const TokenData& data, int64_t global_batch, int64_t seq_len)
    : data_(data), global_batch_(global_batch) {
  data_.windows(seq_len);  // throws when the data holds no whole window
}

void TokenBatches::fill(int64_t step, int64_t index, int64_t count, int64_t seq_len,
                        int32_t* inputs, int32_t* targets) const {
  data_.fill(step * global_batch_ + index, count, seq_len, inputs, targets);
}

Trainer::Trainer(LmGraph g, const BatchSource& data, TrainOptions opt)
    : g_(g),
      data_(data),
      opt_(std::move(opt)),
      params_(g.graph->params()),
      optimizer_(params_, opt_.adam),
      mb_(*g.graph) {
  check(opt_.micro_batch > 0 && opt_.global_batch % opt_.micro_batch == 0,
        "global batch size ({}) must be a multiple of the micro-batch size ({})",
        opt_.global_batch, opt_.micro_batch);
  const Shape& ts = g.graph->values()[static_cast<size_t>(g.tokens)].shape;
  check(ts[0] == opt_.micro_batch && ts[1] == opt_.seq_length,
        "the graph was built for micro-batches of {} but training uses ({}, {})", ts.str(),
        opt_.micro_batch, opt_.seq_length);
}

Trainer::Trainer(LmGraph g, const BatchSource& data, TrainOptions opt, PipelineExecutor& pipeline)
    : g_(g),
      data_(data),
      opt_(std::move(opt)),
      pipeline_(&pipeline),
      params_(pipeline.params()),
      optimizer_(params_, opt_.adam),
      mb_(*g.graph) {
  check(opt_.micro_batch > 0 && opt_.global_batch % opt_.micro_batch == 0,
        "global batch size ({}) must be a multiple of the micro-batch size ({})",
        opt_.global_batch, opt_.micro_batch);
}

double Trainer::compute_gradients(int64_t step) {
  if (pipeline_ != nullptr) return pipeline_->run(data_, step, opt_.micro_batch, opt_.seq_length);
  const Graph& graph = *g_.graph;
  const int64_t micro = opt_.global_batch / opt_.micro_batch;
  const int n = static_cast<int>(graph.nodes().size());
  const float seed = 1.0f / static_cast<float>(opt_.global_batch * opt_.seq_length);
  zero_grads(params_);
  double loss_sum = 0;
  for (int64_t j = 0; j < micro; ++j) {
    data_.fill(step, j * opt_.micro_batch, opt_.micro_batch, opt_.seq_length,
               mb_.input(g_.tokens).data<int32_t>(), mb_.input(g_.targets).data<int32_t>());
    forward(graph, mb_, 0, n);
    loss_sum += static_cast<double>(mb_.value(g_.loss).data<float>()[0]);
    mb_.seed_grad(g_.loss, seed);
    backward(graph, mb_, 0, n);
    mb_.reset();
  }
  return loss_sum / static_cast<double>(opt_.global_batch * opt_.seq_length);
}

StepRecord Trainer::train_step() {
  const auto t0 = std::chrono::steady_clock::now();
  StepRecord r;
  r.step = steps_done_;
  r.loss = compute_gradients(steps_done_);
  r.grad_norm = pipeline_ != nullptr ? pipeline_->grad_norm() : grad_norm(params_);
  if (pipeline_ != nullptr) r.bubble_frac = pipeline_->bubble_fraction();
  check(std::isfinite(r.loss) && std::isfinite(r.grad_norm),
        "step {}: loss is {} and gradient norm is {}; training diverged (try a lower --lr or "
        "--clip-grad)",
        steps_done_ + 1, r.loss, r.grad_norm);
  clip_grads(params_, opt_.clip_grad, r.grad_norm);
  r.lr = opt_.lr.at(steps_done_);
  optimizer_.step(static_cast<float>(r.lr));
  ++steps_done_;
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.step_ms = s * 1e3;
  r.tokens_per_s = static_cast<double>(opt_.global_batch * opt_.seq_length) / s;
  return r;
}

void Trainer::save(const std::string& dir) {
  CheckpointMeta meta;
  meta.step = steps_done_;
  meta.consumed_samples = steps_done_ * opt_.global_batch;
  meta.config = opt_.config;
  save_checkpoint(dir, params_, optimizer_, meta);
}

void Trainer::load(const std::string& dir) {
  CheckpointMeta meta = load_checkpoint(dir, params_, optimizer_);
  steps_done_ = meta.step;
}

}  // namespace weft
