#include <weft/ops.h>
#include <weft/pipeline.h>
#include <weft/trainer.h>

#include <chrono>
#include <map>
#include <cmath>

namespace weft {

nlohmann::json StepRecord::json() const {
  nlohmann::json j = {{"step", step},           {"loss", loss},         {"lr", lr},
                      {"grad_norm", grad_norm}, {"step_ms", step_ms}, {"tokens_per_s", tokens_per_s}};
  if (bubble_frac >= 0) j["bubble_frac"] = bubble_frac;
  if (dp_wait_ms >= 0) j["dp_wait_ms"] = dp_wait_ms;
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

Trainer::Trainer(LmGraph g, const BatchSource& data, TrainOptions opt, Parallel par)
    : g_(g),
      opt_(std::move(opt)),
      par_(par),
      micro_batches_(replica_micro_batches(opt_, par_)),
      data_(data, par_.groups.dp_rank() * (opt_.global_batch / par_.groups.dp_size())),
      mb_(*g.graph, opt_.device) {
  const Graph& graph = *g.graph;
  if (!opt_.device.is_cpu()) {
    check(par_.pipeline == nullptr && par_.groups.dp_size() == 1 &&
              (par_.groups.tp == nullptr || par_.groups.tp->size() == 1),
          "training on {} runs one process for now: pipeline, tensor and data parallelism on "
          "GPUs are not available yet",
          opt_.device.str());
    place_params(graph.params(), opt_.device);
    host_tokens_ = Tensor::zeros({opt_.micro_batch, opt_.seq_length}, DType::I32);
    host_targets_ = Tensor::zeros({opt_.micro_batch, opt_.seq_length}, DType::I32);
  }
  std::vector<int> nodes;
  std::vector<Param*> params, late, owned;
  if (par_.pipeline != nullptr) {
    PipelineExecutor& p = *par_.pipeline;
    check(p.micro_batches() == micro_batches_,
          "the pipeline schedule has {} micro-batches but each replica runs {} (global batch {} "
          "/ (micro-batch {} x data-parallel {}))",
          p.micro_batches(), micro_batches_, opt_.global_batch, opt_.micro_batch,
          par_.groups.dp_size());
    par_.groups.pp = &p.group();
    nodes = p.local_nodes();
    params = p.params();
    late = p.tied_params();
    owned = p.norm_params();
  } else {
    for (int n = 0; n < static_cast<int>(graph.nodes().size()); ++n) nodes.push_back(n);
    params = graph.params();
    owned = params;
    const Shape& ts = graph.values()[static_cast<size_t>(g.tokens)].shape;
    check(ts[0] == opt_.micro_batch && ts[1] == opt_.seq_length,
          "the graph was built for micro-batches of {} but training uses ({}, {})", ts.str(),
          opt_.micro_batch, opt_.seq_length);
  }
  owned_.insert(owned.begin(), owned.end());
  sync_ = std::make_unique<GradSync>(graph, std::move(nodes), std::move(params), std::move(late),
                                     std::move(owned), par_.groups, opt_.adam, par_.sync);
  if (par_.pipeline != nullptr) par_.pipeline->set_grad_sync(sync_.get());
  scalar_ = Tensor::zeros({1});
}

Trainer::Trainer(LmGraph g, const BatchSource& data, TrainOptions opt, PipelineExecutor& pipeline)
    : Trainer(g, data, std::move(opt), Parallel{{}, &pipeline, {}}) {}

Trainer::~Trainer() {
  if (par_.pipeline != nullptr) par_.pipeline->set_grad_sync(nullptr);
}

double Trainer::compute_gradients(int64_t step) {
  sync_->begin(micro_batches_);
  double loss = 0;
  if (par_.pipeline != nullptr) {
    loss = par_.pipeline->run(data_, step, opt_.micro_batch, opt_.seq_length, opt_.global_batch);
  } else {
    const Graph& graph = *g_.graph;
    const int n = static_cast<int>(graph.nodes().size());
    const float seed = 1.0f / static_cast<float>(opt_.global_batch * opt_.seq_length);
    double loss_sum = 0;
    for (int64_t j = 0; j < micro_batches_; ++j) {
      if (opt_.device.is_cpu()) {  // straight into the arena
        data_.fill(step, j * opt_.micro_batch, opt_.micro_batch, opt_.seq_length,
                   mb_.input(g_.tokens).data<int32_t>(), mb_.input(g_.targets).data<int32_t>());
      } else {  // on the host, then an asynchronous upload through pinned memory
        data_.fill(step, j * opt_.micro_batch, opt_.micro_batch, opt_.seq_length,
                   host_tokens_.data<int32_t>(), host_targets_.data<int32_t>());
        mb_.input(g_.tokens).copy_from(host_tokens_);
        mb_.input(g_.targets).copy_from(host_targets_);
      }
      forward(graph, mb_, 0, n);
      loss_sum += static_cast<double>(ops::item(mb_.value(g_.loss)));
      mb_.seed_grad(g_.loss, seed);
      for (int k = n - 1; k >= 0; --k) {
        backward_input(graph, mb_, k);
        backward_weight(graph, mb_, k);
        sync_->weight_done(k);
      }
      mb_.reset();
    }
    loss = loss_sum / static_cast<double>(opt_.global_batch * opt_.seq_length);
  }
  sync_->finish();
  if (par_.groups.dp_size() > 1) {
    scalar_.data<float>()[0] = static_cast<float>(loss);
    par_.groups.dp->all_reduce(scalar_, ReduceOp::Sum);
    loss = scalar_.data<float>()[0];
  }
  return loss;
}

StepRecord Trainer::train_step() {
  const auto t0 = std::chrono::steady_clock::now();
  StepRecord r;
  r.step = steps_done_;
  r.loss = compute_gradients(steps_done_);
  r.grad_norm = sync_->grad_norm();
  if (par_.pipeline != nullptr) r.bubble_frac = par_.pipeline->bubble_fraction();
  if (par_.groups.dp_size() > 1) r.dp_wait_ms = sync_->stats().wait_ms;
  check(std::isfinite(r.loss) && std::isfinite(r.grad_norm),
        "step {}: loss is {} and gradient norm is {}; training diverged (try a lower --lr or "
        "--clip-grad)",
        steps_done_ + 1, r.loss, r.grad_norm);
  sync_->clip(opt_.clip_grad, r.grad_norm);
  r.lr = opt_.lr.at(steps_done_);
  sync_->step(static_cast<float>(r.lr));
  ++steps_done_;
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.step_ms = s * 1e3;
  r.tokens_per_s = static_cast<double>(opt_.global_batch * opt_.seq_length) / s;
  return r;
}

// Full tensors from every layout: each parameter's pieces are placed into a
// zero tensor by the ranks that own them (the pipeline rank that counts it,
// every tensor-parallel rank for a split tensor, tensor-parallel rank 0 for a
// whole one) and summed over the tensor- and pipeline-parallel groups of
// data-parallel replica 0, which holds world rank 0.
void Trainer::save(const std::string& dir) {
  const Graph& graph = *g_.graph;
  NamedTensors state = sync_->optimizer_state();  // collective over dp
  std::map<std::string, Tensor> moments(state.begin(), state.end());
  NamedTensors model, optimizer;
  const bool writer_replica = par_.groups.dp_rank() == 0;
  auto gather = [&](const Param& p, const Tensor* piece, bool owner) {
    Tensor full = Tensor::zeros(p.shard.full);
    if (piece != nullptr && owner && (p.shard.split() || par_.groups.tp_rank() == 0)) {
      if (p.shard.split())
        place_shard(*piece, p.shard, full);
      else
        full.copy_from(*piece);
    }
    if (par_.groups.tp) par_.groups.tp->all_reduce(full, ReduceOp::Sum);
    if (par_.groups.pp) par_.groups.pp->all_reduce(full, ReduceOp::Sum);
    return full;
  };
  if (writer_replica) {
    for (Param* p : graph.params()) {
      const bool owner = owned_.count(p) > 0;
      model.emplace_back(p->name, gather(*p, &p->value, owner));
      for (const char* suffix : {".exp_avg", ".exp_avg_sq"}) {
        auto it = moments.find(p->name + suffix);
        optimizer.emplace_back(p->name + suffix,
                               gather(*p, it == moments.end() ? nullptr : &it->second, owner));
      }
    }
  }
  const bool writer = writer_replica && par_.groups.tp_rank() == 0 &&
                      (par_.groups.pp == nullptr || par_.groups.pp->rank() == 0);
  if (writer) {
    CheckpointMeta meta;
    meta.step = steps_done_;
    meta.consumed_samples = steps_done_ * opt_.global_batch;
    meta.config = opt_.config;
    save_checkpoint(dir, model, optimizer, sync_->steps(), meta);
  }
  // Nobody returns before the checkpoint is complete.
  for (Communicator* c : {par_.groups.tp, par_.groups.pp, par_.groups.dp})
    if (c) c->barrier();
}

void Trainer::load(const std::string& dir) {
  Checkpoint c = open_checkpoint(dir);
  c.read_model(g_.graph->params());
  sync_->load_optimizer_state(c.read_optimizer(sync_->params()));
  sync_->set_steps(c.optimizer_steps);
  steps_done_ = c.meta.step;
}

}  // namespace weft
