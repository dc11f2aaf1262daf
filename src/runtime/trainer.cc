#include <weft/local_communicator.h>
#include <weft/ops.h>
#include <weft/param_server.h>
#include <weft/pipeline.h>
#include <weft/trainer.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <set>

namespace weft {

nlohmann::json StepRecord::json() const {
  // One numbering everywhere: step N is the N-th step taken (1-based), as in
  // the console log, the pipeline trace and checkpoint names.
  nlohmann::json j = {{"step", step + 1},           {"loss", loss},         {"lr", lr},
                      {"grad_norm", grad_norm}, {"step_ms", step_ms}, {"tokens_per_s", tokens_per_s}};
  if (bubble_frac >= 0) j["bubble_frac"] = bubble_frac;
  if (dp_wait_ms >= 0) j["dp_wait_ms"] = dp_wait_ms;
  if (dp_bytes >= 0) j["dp_bytes"] = dp_bytes;
  if (ps_wait_ms >= 0) j["ps_wait_ms"] = ps_wait_ms;
  if (ps_staleness >= 0) j["ps_staleness"] = ps_staleness;
  if (skipped) j["skipped"] = true;
  if (loss_scale > 0) j["loss_scale"] = loss_scale;
  if (overflow) j["overflow"] = true;
  return j;
}

std::string StepRecord::line(int64_t train_iters) const {
  return fmt::format("step {:>5}/{} | loss {:.4f} | lr {:.3e} | grad norm {:.3f} | {:.0f} ms | "
                     "{:.0f} tok/s",
                     step + 1, train_iters, loss, lr, grad_norm, step_ms, tokens_per_s) +
         (bubble_frac >= 0 ? fmt::format(" | bubble {:.1f}%", 100 * bubble_frac) : "") +
         (ps_wait_ms >= 0 ? fmt::format(" | waited {:.1f} ms, staleness {}", ps_wait_ms,
                                        ps_staleness)
                          : "") +
         (loss_scale > 0 ? fmt::format(" | loss scale {}", loss_scale) : "") +
         (overflow ? fmt::format(" | skipped: gradients overflowed (loss scale now {})",
                                 next_loss_scale)
          : skipped ? fmt::format(" | skipped: a loss spike (recent mean {:.4f})", spike_mean)
                    : "");
}

TokenBatches::TokenBatches(std::shared_ptr<const WindowOrder> order, int64_t global_batch,
                           int64_t vocab)
    : order_(std::move(order)), global_batch_(global_batch), vocab_(vocab) {
  check(order_ != nullptr && global_batch > 0,
        "token batches need an order and a global batch "
        "of at least one sequence (got {})",
        global_batch);
}

TokenBatches::TokenBatches(const TokenData& data, int64_t global_batch, int64_t seq_len,
                           int64_t first_window, int64_t num_windows)
    : TokenBatches(std::make_shared<const WindowOrder>(
                       std::vector<BlendPart>{{std::make_shared<const TokenData>(data), 1.0,
                                               first_window, num_windows}},
                       seq_len, /*shuffle=*/false, /*seed=*/0),
                   global_batch) {}

void TokenBatches::set_documents(const DocumentOptions& docs) {
  check(!docs.any() || (docs.eod >= 0 && (vocab_ <= 0 || docs.eod < vocab_)),
        "the end-of-document token {} is outside the vocabulary [0, {})", docs.eod, vocab_);
  docs_ = docs;
}

void document_positions(const int32_t* tokens, int32_t* positions, int64_t count, int64_t t,
                        int32_t eod) {
  for (int64_t s = 0; s < count; ++s) {
    int32_t p = 0;
    for (int64_t i = s * t; i < (s + 1) * t; ++i) {
      positions[i] = p;
      p = tokens[i] == eod ? 0 : p + 1;
    }
  }
}

int64_t TokenBatches::loss_terms(int64_t step) const {
  if (!docs_.eod_mask_loss) return -1;
  std::lock_guard<std::mutex> lock(terms_mu_);
  if (terms_step_ == step) return terms_;
  const int64_t n = global_batch_ * order_->seq_len();
  terms_tokens_.resize(static_cast<size_t>(n));
  terms_targets_.resize(static_cast<size_t>(n));
  order_->fill(step * global_batch_, global_batch_, terms_tokens_.data(), terms_targets_.data(),
               vocab_);
  terms_ = n - std::count(terms_tokens_.begin(), terms_tokens_.end(), docs_.eod);
  terms_step_ = step;
  return terms_;
}

void TokenBatches::fill(int64_t step, int64_t index, std::span<const Tensor> inputs) const {
  const size_t want = docs_.positions() ? 3 : 2;
  check(inputs.size() == want, "token batches fill {} inputs (tokens, targets{}), the model has {}",
        want, want == 3 ? ", positions" : "", inputs.size());
  for (const Tensor& t : inputs)
    check(t.dtype() == DType::I32 && t.rank() == 2 && t.shape() == inputs[0].shape(),
          "token batches fill (count, T) int32 tokens and targets, got {} {} and {} {}",
          dtype_name(inputs[0].dtype()), inputs[0].shape().str(), dtype_name(inputs[1].dtype()),
          inputs[1].shape().str());
  check(inputs[0].dim(1) == order_->seq_len(),
        "token batches of sequence length {} cannot fill inputs of length {}", order_->seq_len(),
        inputs[0].dim(1));
  order_->fill(step * global_batch_ + index, inputs[0].dim(0), inputs[0].data<int32_t>(),
               inputs[1].data<int32_t>(), vocab_);
  const int32_t* tokens = inputs[0].data<int32_t>();
  if (docs_.eod_mask_loss) {
    int32_t* targets = inputs[1].data<int32_t>();
    for (int64_t i = 0; i < inputs[0].numel(); ++i)
      if (tokens[i] == docs_.eod) targets[i] = kIgnoredTarget;
  }
  if (want == 3)
    document_positions(tokens, inputs[2].data<int32_t>(), inputs[0].dim(0), inputs[0].dim(1),
                       docs_.eod);
}

void check_model_io(const ModelIO& io, int64_t micro_batch) {
  check(io.graph != nullptr, "the model has no graph");
  const Graph& g = *io.graph;
  const auto& values = g.values();
  auto name = [&](int v) { return values[static_cast<size_t>(v)].name; };
  check(io.loss >= 0 && io.loss < static_cast<int>(values.size()),
        "the model has no loss: set ModelIO::loss to the graph output that sums the loss");
  check(values[static_cast<size_t>(io.loss)].producer >= 0 &&
            values[static_cast<size_t>(io.loss)].shape.numel() == 1,
        "the loss '{}' must be one element made by a node (a loss layer), got shape {}",
        name(io.loss), values[static_cast<size_t>(io.loss)].shape.str());
  check(io.terms_per_sample > 0, "ModelIO::terms_per_sample ({}) must be positive",
        io.terms_per_sample);
  for (int v : io.inputs) {
    const bool known = v >= 0 && v < static_cast<int>(values.size());
    check(known && values[static_cast<size_t>(v)].producer < 0,
          "model input {} is not a graph input",
          known ? fmt::format("'{}'", name(v)) : fmt::format("#{}", v));
    const Shape& s = values[static_cast<size_t>(v)].shape;
    check(s.rank >= 1 && s[0] == micro_batch,
          "input '{}' has shape {}; its first dimension must be the micro-batch size ({})",
          name(v), s.str(), micro_batch);
  }
  for (int v : g.inputs())
    check(std::find(io.inputs.begin(), io.inputs.end(), v) != io.inputs.end(),
          "graph input '{}' has no source: list it in ModelIO::inputs for the BatchSource to "
          "fill",
          name(v));
}

namespace {

// Checks the layout against the batch before any communication.
int64_t replica_micro_batches(const TrainOptions& opt, const Parallel& par) {
  const int64_t dp = par.groups.dp_size();
  check(opt.micro_batch > 0, "--micro-batch-size ({}) must be positive", opt.micro_batch);
  check(opt.global_batch % (opt.micro_batch * dp) == 0,
        "--global-batch-size ({}) must be divisible by --micro-batch-size ({}) x data-parallel "
        "size ({})",
        opt.global_batch, opt.micro_batch, dp);
  return opt.global_batch / (opt.micro_batch * dp);
}

}  // namespace

Trainer::Trainer(ModelIO g, const BatchSource& data, TrainOptions opt, Parallel par)
    : g_(g),
      opt_(std::move(opt)),
      par_(par),
      micro_batches_(replica_micro_batches(opt_, par_)),
      data_(data, par_.groups.dp_rank() * (opt_.global_batch / par_.groups.dp_size())) {
  const Graph& graph = *g.graph;
  check_model_io(g_, opt_.micro_batch);
  if (par_.pipeline == nullptr) {
    // No pipeline: the whole graph is one stage on this rank, run by the same
    // executor as every pipeline stage (one step path for every layout).
    self_ = std::move(make_local_world(1).front());
    PipelineOptions po;
    po.device = opt_.device;
    own_pipeline_ = std::make_unique<PipelineExecutor>(
        graph, g_, whole_graph_plan(graph, CostModel::analytic(graph)),
        one_stage_schedule(static_cast<int>(micro_batches_)), *self_, po);
    par_.pipeline = own_pipeline_.get();
  }
  if (opt_.spike.enabled)
    check(std::isfinite(opt_.spike.factor) && opt_.spike.factor > 1 && opt_.spike.window >= 1 &&
              opt_.spike.max_skipped >= 0,
          "the loss-spike check needs a factor > 1 (--spiky-loss-factor {}), a window >= 1 ({}) "
          "and --max-skipped-steps >= 0 ({})",
          opt_.spike.factor, opt_.spike.window, opt_.spike.max_skipped);
  if (scaling()) {
    const TrainOptions::LossScale& ls = opt_.loss_scale;
    check(std::isfinite(ls.fixed) && ls.fixed >= 0, "--loss-scale {} must be positive", ls.fixed);
    check(std::isfinite(ls.initial) && ls.initial > 0,
          "--initial-loss-scale {} must be positive and finite", ls.initial);
    check(std::isfinite(ls.min) && ls.min > 0 && ls.min <= ls.initial,
          "--min-loss-scale {} must be positive and at most --initial-loss-scale ({})", ls.min,
          ls.initial);
    check(ls.window >= 1, "--loss-scale-window {} must be at least 1", ls.window);
    check(ls.hysteresis >= 1, "--hysteresis {} must be at least 1", ls.hysteresis);
    // An overflow must be seen alike by every replica, and must not reach
    // state that outlives the step.
    check(par.ps == nullptr && opt_.local.steps == 0 &&
              par.sync.compression == GradCompression::None,
          "--fp16's loss scaling skips a step when the all-reduced gradients overflow; it "
          "cannot be combined with --ps-ranks or --local-steps (no all-reduced gradients) or "
          "--grad-compression (the overflow would enter the error feedback)");
    scale_ = ls.fixed > 0 ? ls.fixed : ls.initial;
    hysteresis_left_ = ls.hysteresis;
  }
  PipelineExecutor& exec = *par_.pipeline;
  // A pipeline rank places only the parameters of its own stages.
  if (!opt_.device.is_cpu()) place_params(exec.params(), opt_.device);
  check(exec.micro_batches() == micro_batches_,
        "the pipeline schedule has {} micro-batches but each replica runs {} (global batch {} "
        "/ (micro-batch {} x data-parallel {}))",
        exec.micro_batches(), micro_batches_, opt_.global_batch, opt_.micro_batch,
        par_.groups.dp_size());
  if (pipelined()) par_.groups.pp = &exec.group();
  std::vector<Param*> owned = exec.norm_params();
  owned_.insert(owned.begin(), owned.end());
  sync_ = std::make_unique<GradSync>(graph, exec.local_nodes(), exec.params(), exec.tied_params(),
                                     std::move(owned), par_.groups, opt_.adam, par_.sync);
  exec.set_grad_sync(sync_.get());
  scalar_ = Tensor::zeros({1});
  if (local()) {
    check(!par_.sync.distributed_optimizer,
          "--local-steps {}: each replica keeps its whole optimizer state, so it cannot be "
          "combined with --use-distributed-optimizer",
          opt_.local.steps);
    check(std::isfinite(opt_.local.outer_lr) && opt_.local.outer_lr > 0 &&
              std::isfinite(opt_.local.outer_momentum) && opt_.local.outer_momentum >= 0 &&
              opt_.local.outer_momentum < 1,
          "DiLoCo's outer step needs --outer-lr > 0 ({}) and --outer-momentum in [0, 1) ({})",
          opt_.local.outer_lr, opt_.local.outer_momentum);
    sync_->set_reduce(false);
  }
  if (par_.ps != nullptr) {
    check(opt_.device.is_cpu(), "--ps-ranks runs on the CPU for now, not on {}", opt_.device.str());
    check(!par_.sync.distributed_optimizer && !local() && !opt_.spike.enabled &&
              par_.sync.compression == GradCompression::None && par_.sync.reduce_dtype == DType::F32,
          "--ps-ranks: the servers hold the optimizer and reduce nothing, so it cannot be combined "
          "with --use-distributed-optimizer, --local-steps, --grad-compression, "
          "--grad-reduce-dtype or --check-for-spiky-loss");
    sync_->set_reduce(false);
    // Each piece of the model is pushed by one rank of the worker, as the
    // gradient norm counts it: the pipeline rank that owns it (tied tensors
    // are summed over their holders first), every tensor-parallel rank its
    // slice of a split tensor, tensor-parallel rank 0 a replicated one.
    std::vector<const Param*> pushed;
    for (Param* p : sync_->params())
      if (owned_.count(p) > 0 && (p->shard.split() || par_.groups.tp_rank() == 0))
        pushed.push_back(p);
    par_.ps->attach(sync_->params(), pushed, par_.groups.dp_rank(), par_.groups.dp_size());
  }
}

Trainer::Trainer(ModelIO g, const BatchSource& data, TrainOptions opt, PipelineExecutor& pipeline)
    : Trainer(g, data, std::move(opt), Parallel{{}, &pipeline, {}}) {}

Trainer::~Trainer() {
  if (writer_.joinable()) writer_.join();  // a save in flight is never cut short
  par_.pipeline->set_grad_sync(nullptr);
}

bool Trainer::pipelined() const { return par_.pipeline->group().size() > 1; }

double Trainer::compute_gradients(int64_t step) { return run_batch(data_, step); }

// The gradients the update reads: with the distributed optimizer, the
// replica's reduced slices.
void Trainer::scale_grads(float s) { sync_->scale_grads(s); }

double Trainer::evaluate(const BatchSource& data, int64_t iters) {
  check(iters > 0, "evaluation needs at least one batch, got {}", iters);
  const ReplicaBatches replica(data, par_.groups.dp_rank() *
                                         (opt_.global_batch / par_.groups.dp_size()));
  sync_->set_reduce(false);
  double sum = 0;
  try {
    for (int64_t k = 0; k < iters; ++k) {
      double loss = run_batch(replica, k);
      // A parameter-server worker's step leaves the loss to the servers; here
      // the workers sum their shares themselves (each with the parameters it
      // last read: with S > 0 those differ a little between workers).
      if (par_.ps != nullptr && par_.groups.dp_size() > 1) {
        scalar_.data<float>()[0] = static_cast<float>(loss);
        par_.groups.dp->all_reduce(scalar_, ReduceOp::Sum);
        loss = scalar_.data<float>()[0];
      }
      sum += loss;
    }
  } catch (...) {
    sync_->set_reduce(!local() && par_.ps == nullptr);
    throw;
  }
  sync_->set_reduce(!local() && par_.ps == nullptr);
  return sum / static_cast<double>(iters);
}

double Trainer::run_batch_into(const BatchSource& batches, int64_t step, const Tensor& losses,
                               std::vector<int>& order, bool measure) {
  // Sharded parameters are rounded as each bucket is gathered.
  const Bf16Copies copies(*g_.graph, sync_->whole_params(), bf16_tables_);
  sync_->begin(micro_batches_);
  order.clear();
  PipelineExecutor& pipeline = *par_.pipeline;
  pipeline.set_loss_scale(static_cast<float>(scale_));
  // The last buckets' reductions go out behind the backward. One stage has
  // no bubble to measure.
  pipeline.run(
      batches, step, opt_.micro_batch, opt_.global_batch, [this] { sync_->finish(); },
      measure && pipelined());
  if (pipeline.losses().defined()) {
    losses.copy_from(pipeline.losses());
    order = pipeline.loss_order();
  }
  return static_cast<double>(pipeline.loss_terms());
}

// From each step's micro-batch loss sums, added in `order` as the CPU adds
// them, to the global batch's mean: over the pipeline (only its last stage
// holds losses, so the float sum is exact) and over the data-parallel
// replicas (a parameter-server worker's servers sum its loss). One
// collective per group for all the steps.
void Trainer::mean_losses(std::span<const float* const> rows,
                          std::span<const std::vector<int>* const> orders,
                          std::span<const double> terms, std::span<double> out) {
  const size_t n = out.size();
  if (!loss_sums_.defined() || loss_sums_.numel() < static_cast<int64_t>(n))
    loss_sums_ = Tensor::zeros({static_cast<int64_t>(std::max<size_t>(n, kRows))});
  const Tensor sums = loss_sums_.slice0(0, static_cast<int64_t>(n));
  float* f = sums.data<float>();
  for (size_t i = 0; i < n; ++i) {
    double sum = 0;
    for (int j : *orders[i]) sum += static_cast<double>(rows[i][j]);
    out[i] = sum;
  }
  if (pipelined()) {
    for (size_t i = 0; i < n; ++i) f[i] = static_cast<float>(out[i]);
    par_.pipeline->group().all_reduce(sums, ReduceOp::Sum);
    for (size_t i = 0; i < n; ++i) out[i] = static_cast<double>(f[i]) / terms[i];
  } else {
    for (size_t i = 0; i < n; ++i) out[i] /= terms[i];
  }
  if (par_.groups.dp_size() > 1 && par_.ps == nullptr) {
    for (size_t i = 0; i < n; ++i) f[i] = static_cast<float>(out[i]);
    par_.groups.dp->all_reduce(sums, ReduceOp::Sum);
    for (size_t i = 0; i < n; ++i) out[i] = f[i];
  }
}

double Trainer::run_batch(const BatchSource& batches, int64_t step) {
  const int64_t width = micro_batches_ + 1;
  if (!scratch_values_.defined()) {
    scratch_values_ = Tensor::zeros({width}, DType::F32, opt_.device);
    scratch_host_ = Tensor::zeros({width});
  }
  std::vector<int> order;
  const double terms =
      run_batch_into(batches, step, scratch_values_.slice0(0, micro_batches_), order, true);
  scratch_host_.copy_from(scratch_values_);  // on a GPU, the host waits here
  const float* row = scratch_host_.data<float>();
  const std::vector<int>* o = &order;
  double loss = 0;
  mean_losses({&row, 1}, {&o, 1}, {&terms, 1}, {&loss, 1});
  return loss;
}

bool Trainer::host_decides() const {
  return opt_.device.is_cpu() || scaling() || opt_.spike.enabled || par_.ps != nullptr ||
         local();
}

Tensor Trainer::row_losses(int64_t row) const {
  const int64_t width = micro_batches_ + 1;
  return values_.slice0(row * width, row * width + micro_batches_);
}

Tensor Trainer::row_norm(int64_t row) const {
  const int64_t width = micro_batches_ + 1;
  return values_.slice0(row * width + micro_batches_, (row + 1) * width);
}

void Trainer::check_finite(const StepRecord& r) const {
  check(r.overflow || (std::isfinite(r.loss) && std::isfinite(r.grad_norm)),
        "step {}: loss is {} and gradient norm is {}; training diverged (try a lower --lr or "
        "--clip-grad)",
        r.step + 1, r.loss, r.grad_norm);
  check(r.overflow || opt_.max_loss <= 0 || r.loss <= opt_.max_loss,
        "step {}: loss {:.4f} is past --max-loss {:.4f}; training diverged (try a lower --lr or "
        "--clip-grad)",
        r.step + 1, r.loss, opt_.max_loss);
}

// The launched steps whose values are still on the device: their rows, read
// back in one copy (the one wait of a GPU), then reduced over the groups.
void Trainer::read_values() {
  const int64_t n = unread_;
  if (n == 0) return;
  const int64_t width = micro_batches_ + 1;
  const Tensor host = host_values_.slice0(0, n * width);
  host.copy_from(values_.slice0(0, n * width));
  const size_t first = static_cast<size_t>(launched_ - n);
  rows_.clear();
  orders_.clear();
  terms_.clear();
  for (int64_t i = 0; i < n; ++i) {
    rows_.push_back(host.data<float>() + i * width);
    orders_.push_back(&launches_[first + static_cast<size_t>(i)].loss_order);
    terms_.push_back(launches_[first + static_cast<size_t>(i)].terms);
  }
  read_losses_.assign(static_cast<size_t>(n), 0.0);
  mean_losses(rows_, orders_, terms_, read_losses_);
  unread_ = 0;
  // A deferred step's time: the span since the first of them started,
  // shared evenly (the device's pace, which the host follows only here).
  const auto now = std::chrono::steady_clock::now();
  const double each_s =
      std::chrono::duration<double>(now - launches_[first].start).count() / static_cast<double>(n);
  for (int64_t i = 0; i < n; ++i) {
    Launched& l = launches_[first + static_cast<size_t>(i)];
    StepRecord& r = l.record;
    r.loss = read_losses_[static_cast<size_t>(i)];
    r.grad_norm = std::sqrt(static_cast<double>(rows_[static_cast<size_t>(i)][micro_batches_]));
    if (host_decides()) continue;  // launch_step decides, and times, it
    r.step_ms = each_s * 1e3;
    r.tokens_per_s = static_cast<double>(opt_.global_batch * g_.terms_per_sample) / each_s;
    check_finite(r);
  }
}

const std::vector<StepRecord>& Trainer::take_records() {
  read_values();
  taken_.clear();  // keeps its capacity
  for (int64_t i = 0; i < launched_; ++i) taken_.push_back(launches_[static_cast<size_t>(i)].record);
  launched_ = 0;
  return taken_;
}

StepRecord Trainer::train_step() {
  check(launched_ == 0,
        "train_step: the records of {} launched steps (from step {}) are not taken yet; call "
        "take_records() first",
        launched_, launched_ == 0 ? 0 : launches_[0].record.step + 1);
  launch_step(true);
  return take_records().back();
}

void Trainer::launch_step(bool measure) {
  const auto t0 = std::chrono::steady_clock::now();
  if (unread_ == kRows) read_values();
  if (!values_.defined()) {
    values_ = Tensor::zeros({kRows * (micro_batches_ + 1)}, DType::F32, opt_.device);
    host_values_ = Tensor::zeros({kRows * (micro_batches_ + 1)});
    coef_ = Tensor::zeros({1}, DType::F32, opt_.device);
  }
  if (static_cast<int64_t>(launches_.size()) == launched_) launches_.emplace_back();
  Launched& l = launches_[static_cast<size_t>(launched_++)];
  l.start = t0;
  l.record = StepRecord();
  StepRecord& r = l.record;
  r.step = steps_done_;
  r.lr = opt_.lr.at(steps_done_);
  // DiLoCo, and compressed averages: the parameters each period starts from
  // (the same on every replica).
  if (local() && (opt_.local.nesterov || compressed_averages()) &&
      steps_done_ % opt_.local.steps == 0) {
    const std::vector<Param*>& ps = sync_->params();
    if (outer_start_.empty())
      for (Param* p : ps)
        outer_start_.push_back(Tensor::zeros(p->value.shape(), DType::F32, p->value.device()));
    if (opt_.local.nesterov && outer_buf_.empty())
      for (Param* p : ps)
        outer_buf_.push_back(Tensor::zeros(p->value.shape(), DType::F32, p->value.device()));
    for (size_t i = 0; i < ps.size(); ++i) outer_start_[i].copy_from(ps[i]->value);
  }
  const bool now = host_decides();
  const int64_t row = unread_++;
  l.terms = run_batch_into(data_, steps_done_, row_losses(row), l.loss_order, measure || now);
  if (pipelined()) r.bubble_frac = par_.pipeline->bubble_fraction();
  if (par_.ps != nullptr) {
    read_values();
    exchange_with_servers(r, t0);
  } else {
    // Local SGD: this replica's gradients, unreduced, are (1 / dp) of its own
    // mean gradient (the loss is seeded for the global batch).
    if (local() && par_.groups.dp_size() > 1)
      scale_grads(static_cast<float>(par_.groups.dp_size()));
    if (scaling()) {  // the gradients of the mean loss, from those of scale x the loss
      r.loss_scale = scale_;
      const float inv = static_cast<float>(1.0 / scale_);
      scale_grads(inv);
    }
    // The norm and the clip's coefficient stay where the gradients are.
    sync_->grad_norm_squared(row_norm(row));
    ops::clip_coefficient(row_norm(row), opt_.clip_grad, coef_);
    if (par_.groups.dp_size() > 1) {
      r.dp_wait_ms = sync_->stats().wait_ms;
      r.dp_bytes = sync_->stats().bytes_sent;
    }
    if (now) read_values();
  }
  if (now) {
    // With loss scaling, a norm that is not finite is an overflow: the step
    // is skipped. The norm is all-reduced, so every rank decides alike.
    r.overflow = scaling() && !std::isfinite(r.grad_norm);
    if (r.overflow) {
      r.skipped = true;
      update_loss_scale(true);
      r.next_loss_scale = scale_;
    }
    check_finite(r);
    const TrainOptions::SpikeCheck& spike = opt_.spike;
    if (spike.enabled && !r.overflow &&
        static_cast<int64_t>(recent_losses_.size()) == spike.window) {
      double mean = 0;
      for (double x : recent_losses_) mean += x / static_cast<double>(recent_losses_.size());
      // Every rank holds the same loss, so every rank decides alike.
      if (r.loss > spike.factor * mean) {
        r.skipped = true;
        r.spike_mean = mean;
        ++skipped_;
        check(skipped_ <= spike.max_skipped,
              "step {}: loss {:.4f} is over {} x the recent mean {:.4f}, and {} steps have now "
              "been skipped for loss spikes, more than --max-skipped-steps {}: training stopped; "
              "look at the data of the skipped steps, or lower --lr",
              steps_done_ + 1, r.loss, spike.factor, mean, skipped_, spike.max_skipped);
      }
    }
    if (!r.skipped && spike.enabled) {
      recent_losses_.push_back(r.loss);
      if (static_cast<int64_t>(recent_losses_.size()) > spike.window) recent_losses_.pop_front();
    }
  }
  if (!r.skipped && par_.ps == nullptr)  // servers update the parameters themselves
    sync_->step(static_cast<float>(r.lr), coef_);
  if (scaling() && !r.overflow) {
    update_loss_scale(false);
    r.next_loss_scale = scale_;
  }
  ++steps_done_;
  if (local() && steps_done_ % opt_.local.steps == 0) {
    const double bytes = average_replicas();
    if (r.dp_bytes >= 0) r.dp_bytes += bytes;
  }
  if (now) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    r.step_ms = s * 1e3;
    r.tokens_per_s = static_cast<double>(opt_.global_batch * g_.terms_per_sample) / s;
  }
}

SaveRank Trainer::save_rank() const {
  const int tp = par_.groups.tp ? par_.groups.tp->size() : 1;
  const int pp = par_.groups.pp ? par_.groups.pp->size() : 1;
  const int pp_rank = par_.groups.pp ? par_.groups.pp->rank() : 0;
  SaveRank who;
  who.rank = (par_.groups.dp_rank() * pp + pp_rank) * tp + par_.groups.tp_rank();
  who.ranks = par_.groups.dp_size() * pp * tp;
  who.timeout_s = opt_.save_timeout_s;
  return who;
}

void Trainer::barrier_all() {
  for (Communicator* c : {par_.groups.tp, par_.groups.pp, par_.groups.dp})
    if (c) c->barrier();
}

bool Trainer::any_rank(bool yes) {
  Tensor flag = Tensor::zeros({1});
  flag.data<float>()[0] = yes ? 1.0f : 0.0f;
  for (Communicator* c : {par_.groups.tp, par_.groups.pp, par_.groups.dp})
    if (c) c->all_reduce(flag, ReduceOp::Max);
  return flag.data<float>()[0] > 0;
}

// Every rank writes what it holds (weft/checkpoint.h): of each parameter it
// owns (its pipeline share; a tensor replicated across the tensor-parallel
// group on tp rank 0 only), the elements its data-parallel replica owns, and
// their optimizer state. Host copies are taken here; with async_save the
// files are written by a thread while training goes on.
void Trainer::save(const std::string& dir, int64_t keep_last) {
  const auto t0 = std::chrono::steady_clock::now();
  join_writer();  // one save at a time, each complete before the next starts
  read_values();  // a step that diverged is found before anything is written
  check(!local() || steps_done_ % opt_.local.steps == 0,
        "with --local-steps {}, a checkpoint is taken when the replicas agree, after a step "
        "divisible by {}; this is step {}",
        opt_.local.steps, opt_.local.steps, steps_done_);
  const SaveRank who = save_rank();
  int64_t optimizer_steps = sync_->steps();  // the servers' count, with parameter servers
  const std::vector<std::string> suffixes = optimizer_state_suffixes(par_.sync.optimizer);
  const bool tp0 = par_.groups.tp_rank() == 0;
  auto host_elements = [](const Tensor& t, int64_t lo, int64_t hi) {
    Tensor h = Tensor::zeros({hi - lo});
    h.copy_from(Tensor(t.data<float>() + lo, Shape{hi - lo}, DType::F32, t.device()));
    return h;
  };
  auto slice = [](const Param& p, std::string name, int64_t lo, int64_t hi, Tensor data) {
    SliceOut s;
    s.name = std::move(name);
    s.shard = p.shard;
    s.true_rows = p.true_rows;
    s.lo = lo, s.hi = hi;
    s.data = std::move(data);
    return s;
  };
  RankSlices out;
  // With parameter servers the replicas' copies may differ by a few steps:
  // replica 0's are the checkpoint's, as the servers' state is.
  std::vector<GradSync::OwnedSlice> owned;
  if (par_.ps == nullptr) {
    owned = sync_->owned_slices();
  } else if (par_.groups.dp_rank() == 0) {
    for (size_t i = 0; i < sync_->params().size(); ++i)
      owned.push_back({i, 0, sync_->params()[i]->value.numel()});
  }
  for (const GradSync::OwnedSlice& o : owned) {
    const Param& p = *sync_->params()[o.param];
    if (owned_.count(&p) == 0 || !(p.shard.split() || tp0)) continue;
    out.model.push_back(slice(p, p.name, o.lo, o.hi, sync_->value_slice(o)));
    if (par_.ps == nullptr)
      for (size_t j = 0; j < suffixes.size(); ++j)
        out.optimizer.push_back(
            slice(p, p.name + suffixes[j], o.lo, o.hi, sync_->state_slice(o, j)));
    if (!outer_buf_.empty())  // DiLoCo's outer momentum (the same on every replica)
      out.optimizer.push_back(slice(p, p.name + ".outer_momentum", o.lo, o.hi,
                                    host_elements(outer_buf_[o.param], o.lo, o.hi)));
  }
  // The servers' state: whole tensors of the model, sent to world rank 0.
  if (par_.ps != nullptr && par_.ps->writer()) {
    std::map<std::string, const Param*> by_state;
    for (const Param* p : g_.graph->params())
      for (const std::string& suffix : suffixes) by_state[p->name + suffix] = p;
    for (auto& [name, t] : par_.ps->optimizer_state(optimizer_steps)) {
      const Param& p = *by_state.at(name);
      SliceOut s = slice(p, name, 0, t.numel(), t.view(Shape{t.numel()}));
      s.shard = Shard{};
      s.shard.full = t.shape();
      out.optimizer.push_back(std::move(s));
    }
  }
  CheckpointMeta meta;
  meta.step = steps_done_;
  meta.consumed_samples = steps_done_ * opt_.global_batch;
  meta.config = opt_.config;
  meta.trainer = nlohmann::json::object();
  if (opt_.spike.enabled) meta.trainer["spike"] = spike_state();
  if (scaling()) meta.trainer["loss_scale"] = loss_scale_state();
  if (meta.trainer.empty()) meta.trainer = nullptr;
  const std::string rule = meta.config.is_object() && meta.config.contains("optimizer")
                               ? meta.config["optimizer"].get<std::string>()
                               : std::string("adamw");
  if (who.rank == 0) begin_checkpoint(dir, steps_done_);
  barrier_all();  // the folder is there before any writer starts
  auto write = [dir, keep_last, who, optimizer_steps, rule, out = std::move(out),
                meta = std::move(meta)] {
    write_checkpoint_slices(dir, meta.step, who, out, rule, optimizer_steps);
    if (who.rank == 0) {
      finish_checkpoint(dir, meta, optimizer_steps, who);
      prune_checkpoints(dir, keep_last);
    }
  };
  if (opt_.async_save) {
    // The copies move to the thread; the parameters train on meanwhile.
    writer_ = std::thread([this, write = std::move(write)] {
      try {
        write();
      } catch (...) {
        writer_error_ = std::current_exception();
      }
    });
  } else {
    write();
  }
  writing_step_ = steps_done_;
  writing_dir_ = dir;
  if (!opt_.async_save) await_writer(dir, steps_done_);
  save_stall_ms_ =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

void Trainer::join_writer() {
  if (writer_.joinable()) writer_.join();
  if (writer_error_) std::rethrow_exception(std::exchange(writer_error_, nullptr));
}

void Trainer::wait_for_saves() {
  join_writer();
  if (opt_.async_save && writing_step_ >= 0) await_writer(writing_dir_, writing_step_);
  writing_step_ = -1;
}

void Trainer::await_writer(const std::string& dir, int64_t step) {
  // Nobody goes on before the checkpoint is complete: one barrier per group,
  // in turn, is a barrier of the world. The writer's disk, not the network,
  // bounds this wait, so --comm-timeout does not: a slow save is no failure,
  // a stuck one (past --save-timeout) is.
  const auto within = std::chrono::milliseconds(static_cast<int64_t>(opt_.save_timeout_s * 1e3));
  for (Communicator* c : {par_.groups.tp, par_.groups.pp, par_.groups.dp}) {
    if (!c) continue;
    try {
      c->barrier_within(within);
    } catch (const CommTimeout& e) {
      throw CommTimeout(
          "the save of step {} to {} did not finish within --save-timeout {:g} s "
          "(every rank writes its slices, then world rank 0 completes the folder; look at "
          "their disks, or raise the timeout): {}",
          step, dir, opt_.save_timeout_s, e.what());
    }
  }
}

// A parameter-server worker's step: the servers take its gradients and send
// back the parameters; they report the loss and norm (weft/param_server.h).
void Trainer::exchange_with_servers(StepRecord& r, std::chrono::steady_clock::time_point t0) {
  const double compute_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  const double own = sync_->grad_norm();
  const PsStep s = par_.ps->exchange(steps_done_, r.loss, own * own, compute_ms);
  r.loss = s.loss;
  r.grad_norm = s.grad_norm;
  if (pipelined()) r.bubble_frac = par_.pipeline->bubble_fraction();
  r.ps_wait_ms = s.wait_ms;
  r.ps_staleness = s.staleness;
  r.dp_bytes = s.bytes;
}

// Local SGD's synchronisation, through the data-parallel gradient buckets
// (GradSync::reduce_written): the replicas' parameters and their inner
// optimizer state are averaged. Uncompressed, the parameters themselves are
// summed. Compressed (--grad-reduce-dtype bf16, --grad-compression powersgd),
// what travels is each replica's delta from the period's start, start - p,
// which is small and, like a gradient, survives rounding and low rank (with
// PowerSGD's error feedback, nothing of it is lost for good); every replica
// then steps from the same start by the same mean delta, so the replicas stay
// identical. The optimizer state travels in the reduce dtype, never low-rank
// (Adam's second moment must stay positive).
double Trainer::average_replicas() {
  const std::vector<Param*>& ps = sync_->params();
  const float inv = 1.0f / static_cast<float>(par_.groups.dp_size());
  const bool compressed = compressed_averages();
  double bytes = 0;
  // delta[i]: start - average, in the gradient buffers.
  if (compressed) {
    for (size_t i = 0; i < ps.size(); ++i) {
      ps[i]->grad.copy_from(ps[i]->value);
      ops::scale(ps[i]->grad, -1.0f);
      ops::add(ps[i]->grad, outer_start_[i]);
    }
    bytes += sync_->reduce_written(/*compress=*/true);
    for (Param* p : ps) ops::scale(p->grad, inv);
    if (!opt_.local.nesterov)
      for (size_t i = 0; i < ps.size(); ++i) {  // p = start - delta
        ps[i]->value.copy_from(ps[i]->grad);
        ops::scale(ps[i]->value, -1.0f);
        ops::add(ps[i]->value, outer_start_[i]);
      }
  } else {
    for (Param* p : ps) p->grad.copy_from(p->value);
    bytes += sync_->reduce_written(/*compress=*/false);
    for (Param* p : ps) {
      p->value.copy_from(p->grad);
      ops::scale(p->value, inv);
    }
    if (opt_.local.nesterov)
      for (size_t i = 0; i < ps.size(); ++i) {  // delta = start - average
        ps[i]->grad.copy_from(ps[i]->value);
        ops::scale(ps[i]->grad, -1.0f);
        ops::add(ps[i]->grad, outer_start_[i]);
      }
  }
  if (opt_.local.nesterov) {
    const float mu = opt_.local.outer_momentum, lr = opt_.local.outer_lr;
    for (size_t i = 0; i < ps.size(); ++i) {
      // buf = mu buf + delta; p = start - lr (delta + mu buf)
      const Tensor& delta = ps[i]->grad;
      ops::scale(outer_buf_[i], mu);
      ops::add(outer_buf_[i], delta);
      Tensor& p = ps[i]->value;
      p.copy_from(outer_buf_[i]);
      ops::scale(p, mu);
      ops::add(p, delta);
      ops::scale(p, -lr);
      ops::add(p, outer_start_[i]);
    }
  }
  // The inner optimizer's state too (SGD's momentum, Adam's moments): after an
  // average every replica is the same, so one replica's checkpoint is the
  // whole run's, and any number of replicas can resume it. One round per
  // kind of state, each tensor in its parameter's place in the buckets.
  const NamedTensors state = sync_->optimizer_state();
  const size_t kinds = ps.empty() ? 0 : state.size() / ps.size();
  check(kinds * ps.size() == state.size(), "the optimizer holds {} state tensors for {} parameters",
        state.size(), ps.size());
  for (size_t k = 0; k < kinds; ++k) {
    for (size_t i = 0; i < ps.size(); ++i) ps[i]->grad.copy_from(state[i * kinds + k].second);
    bytes += sync_->reduce_written(/*compress=*/false);
    for (size_t i = 0; i < ps.size(); ++i) {
      const Tensor& t = state[i * kinds + k].second;
      t.copy_from(ps[i]->grad);
      ops::scale(t, inv);
    }
  }
  return bytes;
}

// Megatron's DynamicGradScaler.update: an overflow restarts the growth count
// and uses up one unit of hysteresis, halving the scale (down to the minimum)
// once none is left; `window` clean steps in a row double the scale and
// restore the hysteresis. A fixed scale (--loss-scale) never changes.
void Trainer::update_loss_scale(bool overflow) {
  const TrainOptions::LossScale& ls = opt_.loss_scale;
  if (ls.fixed > 0) return;
  if (overflow) {
    growth_tracker_ = 0;
    if (--hysteresis_left_ <= 0) scale_ = std::max(scale_ * 0.5, ls.min);
  } else if (++growth_tracker_ == ls.window) {
    growth_tracker_ = 0;
    hysteresis_left_ = ls.hysteresis;
    scale_ *= 2;
  }
}

nlohmann::json Trainer::loss_scale_state() const {
  return {{"scale", scale_}, {"growth_tracker", growth_tracker_},
          {"hysteresis_left", hysteresis_left_}};
}

void Trainer::set_loss_scale_state(const nlohmann::json& state) {
  scale_ = state.at("scale").get<double>();
  growth_tracker_ = state.at("growth_tracker").get<int64_t>();
  hysteresis_left_ = state.at("hysteresis_left").get<int64_t>();
  check(std::isfinite(scale_) && scale_ > 0, "the loss scale {} must be positive", scale_);
  if (opt_.loss_scale.fixed > 0) scale_ = opt_.loss_scale.fixed;  // --loss-scale wins
}

nlohmann::json Trainer::spike_state() const {
  return {{"recent_losses", std::vector<double>(recent_losses_.begin(), recent_losses_.end())},
          {"skipped", skipped_}};
}

void Trainer::set_spike_state(const nlohmann::json& state) {
  const auto& losses = state.at("recent_losses");
  recent_losses_.assign(losses.begin(), losses.end());
  skipped_ = state.at("skipped").get<int64_t>();
  while (static_cast<int64_t>(recent_losses_.size()) > opt_.spike.window) recent_losses_.pop_front();
}

CheckpointSource Trainer::load(const std::string& dir, bool allow_unverified, bool weights_only) {
  check(launched_ == 0,
        "loading {}: {} launched steps' records are not taken yet (take_records first)", dir,
        launched_);
  std::vector<std::pair<std::string, std::string>> failed;
  for (;;) {
    Checkpoint c = open_checkpoint(dir, allow_unverified, failed);
    std::string fault;
    try {
      read_checkpoint(c, weights_only);
    } catch (const std::exception& e) {
      fault = e.what();
    }
    if (!any_rank(!fault.empty())) {
      if (!weights_only) {
        sync_->set_steps(c.optimizer_steps);
        steps_done_ = c.meta.step;
      }
      CheckpointSource source = c.source;
      source.bytes_read = c.bytes_read();
      source.bytes_wanted = c.bytes_wanted();
      // Sums, exact in 32-bit integers: each count as its MiB and its remainder.
      Tensor sums = Tensor::zeros({4}, DType::I32);
      int32_t* v = sums.data<int32_t>();
      v[0] = static_cast<int32_t>(source.bytes_read >> 20);
      v[1] = static_cast<int32_t>(source.bytes_read & ((1 << 20) - 1));
      v[2] = static_cast<int32_t>(source.bytes_wanted >> 20);
      v[3] = static_cast<int32_t>(source.bytes_wanted & ((1 << 20) - 1));
      Tensor most = Tensor::zeros({1});
      most.data<float>()[0] = static_cast<float>(source.bytes_read);
      for (Communicator* g : {par_.groups.tp, par_.groups.pp, par_.groups.dp}) {
        if (!g) continue;
        g->all_reduce(sums, ReduceOp::Sum);
        g->all_reduce(most, ReduceOp::Max);
      }
      source.all_read = (int64_t{v[0]} << 20) + v[1];
      source.all_wanted = (int64_t{v[2]} << 20) + v[3];
      source.most_read = static_cast<int64_t>(most.data<float>()[0]);
      return source;
    }
    // Every rank passes over the folder, whichever rank found the fault.
    const std::string why =
        fault.empty() ? "a slice another rank read does not verify (that rank names it)" : fault;
    check(!is_checkpoint_folder(dir), "--load {}: {}", dir, why);
    failed.emplace_back(c.source.path, why);
  }
}

void Trainer::load_weights(const std::string& path) {
  if (!sync_->sharded_params()) {
    weft::load_weights(path, g_.graph->params());
    return;
  }
  // This rank's parameters read whole into host copies, then handed to
  // GradSync, which keeps this replica's slices (the values between
  // actions are views of gathered buffers, not the parameters' own).
  const std::vector<Param*>& synced = sync_->params();
  std::vector<Param> whole(synced.size());
  std::map<const Param*, size_t> index;
  for (size_t i = 0; i < synced.size(); ++i) {
    index[synced[i]] = i;
    whole[i].name = synced[i]->name;
    whole[i].shard = synced[i]->shard;
    whole[i].true_rows = synced[i]->true_rows;
    whole[i].value = Tensor::zeros(synced[i]->value.shape());
  }
  std::vector<Param*> targets;
  for (Param* p : g_.graph->params()) {
    auto it = index.find(p);
    targets.push_back(it == index.end() ? p : &whole[it->second]);
  }
  weft::load_weights(path, targets);
  sync_->load_values([&](size_t param, int64_t lo, int64_t hi, const Tensor& dest) {
    const Tensor& t = whole[param].value;
    dest.copy_from(Tensor(t.data<float>() + lo, Shape{hi - lo}, DType::F32, t.device()));
  });
}

void Trainer::read_checkpoint(const Checkpoint& c, bool weights_only) {
  if (sync_->sharded_params()) {
    // Each replica reads only its slices of the sharded values; the
    // parameters of the other pipeline ranks' stages whole, as before.
    c.check_model(g_.graph->params());
    const std::set<const Param*> synced(sync_->params().begin(), sync_->params().end());
    std::vector<Param*> others;
    for (Param* p : g_.graph->params())
      if (synced.count(p) == 0) others.push_back(p);
    c.read_values(others);
    const std::vector<Param*>& params = sync_->params();
    sync_->load_values([&](size_t param, int64_t lo, int64_t hi, const Tensor& dest) {
      const Param& p = *params[param];
      c.read(Checkpoint::Part::Model, p.name, p.shard, p.true_rows, lo, hi, dest);
    });
  } else {
    c.read_model(g_.graph->params());
  }
  if (weights_only) return;
  const std::vector<std::string> suffixes = optimizer_state_suffixes(par_.sync.optimizer);
  const std::vector<Param*>& params = sync_->params();
  sync_->load_optimizer_state(
      [&](size_t param, size_t which, int64_t lo, int64_t hi, const Tensor& dest) {
        const Param& p = *params[param];
        c.read(Checkpoint::Part::Optimizer, p.name + suffixes[which], p.shard, p.true_rows, lo, hi,
               dest);
      });
  if (local() && opt_.local.nesterov) {
    outer_start_.clear();
    outer_buf_.clear();
    for (Param* p : params) {
      outer_start_.push_back(Tensor::zeros(p->value.shape(), DType::F32, p->value.device()));
      Tensor host = Tensor::zeros(p->value.shape());
      c.read(Checkpoint::Part::Optimizer, p->name + ".outer_momentum", p->shard, p->true_rows, 0,
             host.numel(), host.view(Shape{host.numel()}));
      outer_buf_.push_back(Tensor::zeros(p->value.shape(), DType::F32, p->value.device()));
      outer_buf_.back().copy_from(host);
    }
  }
  if (c.meta.trainer.is_object() && c.meta.trainer.contains("spike")) {
    try {
      set_spike_state(c.meta.trainer.at("spike"));
    } catch (const nlohmann::json::exception& e) {
      throw Error("--load {}: meta.json's trainer.spike is malformed: {}", c.source.path, e.what());
    }
  }
  // A checkpoint of an fp16 run resumes its scaler; one without starts the
  // scaler afresh.
  if (scaling() && c.meta.trainer.is_object() && c.meta.trainer.contains("loss_scale")) {
    try {
      set_loss_scale_state(c.meta.trainer.at("loss_scale"));
    } catch (const nlohmann::json::exception& e) {
      throw Error("--load {}: meta.json's trainer.loss_scale is malformed: {}", c.source.path,
                  e.what());
    }
  }
}

}  // namespace weft
