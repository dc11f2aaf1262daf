// Parameter servers with bounded staleness: the workers' exchange and the
// servers' event loop.
//
// Messages, one pair per (worker, server) and step, in per-peer FIFO order:
//   push   worker -> server  #0 I32 [step, version read]   #1 F32 [loss, |g|^2, gradients...]
//   answer server -> worker  #2 I32 [version, staleness]   #3 F32 [loss, norm, values...]
//   counts server -> rank 0  #4 I32 the staleness histogram, after the last step
//   state  server -> rank 0  #5 I32 [optimizer steps]  #6 F32 its optimizer state, at saves
#include <weft/checkpoint.h>
#include <weft/ops.h>
#include <weft/param_server.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <thread>

namespace weft {

namespace {

MessageTag tag(int index) { return MessageTag{MessageTag::Kind::User, 0, 0, index}; }

// Elements [at, at + n) of a flat fp32 tensor, as a view.
Tensor elements(const Tensor& flat, int64_t at, int64_t n) {
  return Tensor(flat.data<float>() + at, Shape{n}, DType::F32, flat.device());
}

Tensor flat_of(const Param& p, const Tensor& t) { return t.view(Shape{p.value.numel()}); }

int64_t elements_of(const std::vector<Param*>& ps) {
  int64_t n = 0;
  for (const Param* p : ps) n += p->value.numel();
  return n;
}

}  // namespace

std::vector<int> assign_to_servers(const std::vector<Param*>& params, int servers) {
  check(servers >= 1, "--ps-ranks ({}) must be at least 1", servers);
  check(static_cast<int>(params.size()) >= servers,
        "--ps-ranks {} is more servers than the model's {} parameter tensors: each server holds "
        "whole tensors, so some would hold none",
        servers, params.size());
  std::vector<size_t> order(params.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return params[a]->value.numel() > params[b]->value.numel();
  });
  std::vector<int> server(params.size(), 0);
  std::vector<int64_t> load(static_cast<size_t>(servers), 0);
  for (size_t i : order) {
    const auto least = std::min_element(load.begin(), load.end());
    server[i] = static_cast<int>(least - load.begin());
    *least += params[i]->value.numel();
  }
  return server;
}

// --- the worker ---

struct PsWorker::Shard {
  int world_rank = 0;
  std::vector<Param*> params;
  Tensor push_header, push, answer_header, answer;
  std::vector<RequestPtr> sends;
  int64_t version = 0;  // of the parameters last read from this server
};

PsWorker::PsWorker(Communicator& world, std::vector<Param*> params, PsConfig config)
    : world_(world), params_(std::move(params)), config_(config) {
  const int workers = config_.workers(world_.size());
  check(world_.rank() < workers, "world rank {} is a server, not a worker ({} workers)",
        world_.rank(), workers);
  const std::vector<int> server = assign_to_servers(params_, config_.servers);
  for (int k = 0; k < config_.servers; ++k) {
    auto s = std::make_unique<Shard>();
    s->world_rank = workers + k;
    for (size_t i = 0; i < params_.size(); ++i)
      if (server[i] == k) s->params.push_back(params_[i]);
    const int64_t n = elements_of(s->params);
    s->push_header = Tensor::zeros({2}, DType::I32);
    s->push = Tensor::zeros({2 + n});
    s->answer_header = Tensor::zeros({2}, DType::I32);
    s->answer = Tensor::zeros({2 + n});
    shards_.push_back(std::move(s));
  }
}

PsWorker::~PsWorker() = default;

PsStep PsWorker::exchange(int64_t step, double loss, double norm_sq, double compute_ms) {
  using Clock = std::chrono::steady_clock;
  if (config_.slow_factor > 1)
    std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(
        (config_.slow_factor - 1) * compute_ms));
  PsStep r;
  const auto t0 = Clock::now();
  std::vector<RequestPtr>& answers = answers_;
  answers.clear();
  for (auto& sp : shards_) {
    Shard& s = *sp;
    wait_all(s.sends);  // the last step's push buffers are free again
    s.sends.clear();
    s.push_header.data<int32_t>()[0] = static_cast<int32_t>(step);
    s.push_header.data<int32_t>()[1] = static_cast<int32_t>(s.version);
    s.push.data<float>()[0] = static_cast<float>(loss);
    s.push.data<float>()[1] = static_cast<float>(norm_sq);
    int64_t at = 2;
    for (Param* p : s.params) {
      const int64_t n = p->value.numel();
      elements(s.push, at, n).copy_from(flat_of(*p, p->grad));
      at += n;
    }
    s.sends.push_back(world_.isend(s.push_header, s.world_rank, tag(0)));
    s.sends.push_back(world_.isend(s.push, s.world_rank, tag(1)));
    answers.push_back(world_.irecv(s.answer_header, s.world_rank, tag(2)));
    answers.push_back(world_.irecv(s.answer, s.world_rank, tag(3)));
    r.bytes += static_cast<double>(s.push.nbytes() + s.push_header.nbytes());
  }
  wait_all(answers);
  r.wait_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  for (auto& sp : shards_) {
    Shard& s = *sp;
    s.version = s.answer_header.data<int32_t>()[0];
    r.staleness = std::max<int64_t>(r.staleness, s.answer_header.data<int32_t>()[1]);
    int64_t at = 2;
    for (Param* p : s.params) {
      const int64_t n = p->value.numel();
      flat_of(*p, p->value).copy_from(elements(s.answer, at, n));
      at += n;
    }
  }
  // Every server sums the same numbers in the same order: server 0's stand for all.
  r.loss = shards_.front()->answer.data<float>()[0];
  r.grad_norm = shards_.front()->answer.data<float>()[1];
  return r;
}

std::vector<int64_t> PsWorker::staleness_histogram() {
  check(world_.rank() == 0, "the staleness counts go to world rank 0, not {}", world_.rank());
  std::vector<int64_t> total(PsServer::kHistogramBins, 0);
  for (auto& s : shards_) {
    Tensor h = Tensor::zeros({PsServer::kHistogramBins}, DType::I32);
    world_.recv(h, s->world_rank, tag(4));
    for (int b = 0; b < PsServer::kHistogramBins; ++b) total[static_cast<size_t>(b)] += h.data<int32_t>()[b];
  }
  return total;
}

std::vector<std::pair<std::string, Tensor>> PsWorker::optimizer_state(int64_t& steps) {
  check(world_.rank() == 0, "the servers' state goes to world rank 0, not {}", world_.rank());
  const std::vector<std::string> suffixes = optimizer_state_suffixes(config_.optimizer);
  std::vector<std::pair<std::string, Tensor>> state;
  for (auto& s : shards_) {
    Tensor header = Tensor::zeros({1}, DType::I32);
    Tensor flat = Tensor::zeros({static_cast<int64_t>(suffixes.size()) * elements_of(s->params)});
    world_.recv(header, s->world_rank, tag(5));
    world_.recv(flat, s->world_rank, tag(6));
    steps = header.data<int32_t>()[0];
    int64_t at = 0;
    for (Param* p : s->params)  // in the order of the optimizer's state(): parameter, then suffix
      for (const std::string& suffix : suffixes) {
        Tensor t = Tensor::zeros(p->value.shape());
        flat_of(*p, t).copy_from(elements(flat, at, p->value.numel()));
        at += p->value.numel();
        state.emplace_back(p->name + suffix, t);
      }
  }
  return state;
}

// --- the server ---

struct PsServer::Inbox {
  Tensor header, push;
  RequestPtr h, p;
  bool full = false;  // a push has arrived and waits to be applied (S = 0)
  Tensor answer_header, answer;
  std::vector<RequestPtr> sends;
};

PsServer::PsServer(Communicator& world, Communicator& servers, std::vector<Param*> params,
                   PsConfig config)
    : world_(world), servers_(servers), config_(config) {
  workers_ = config_.workers(world_.size());
  server_ = world_.rank() - workers_;
  check(server_ >= 0 && server_ < config_.servers,
        "world rank {} is not one of the {} servers (world ranks {}..{})", world_.rank(),
        config_.servers, workers_, world_.size() - 1);
  check(config_.max_staleness >= 0, "--max-staleness ({}) must be >= 0", config_.max_staleness);
  all_ = params;
  const std::vector<int> server = assign_to_servers(params, config_.servers);
  for (size_t i = 0; i < params.size(); ++i)
    if (server[i] == server_) mine_.push_back(params[i]);
  for (Param* p : mine_)
    if (!p->grad.defined() || p->grad.numel() != p->value.numel())
      p->grad = Tensor::zeros(p->value.shape());
  elements_ = elements_of(mine_);
  if (config_.optimizer == OptimizerKind::Sgd)
    optimizer_ = std::make_unique<Sgd>(mine_, config_.sgd);
  else
    optimizer_ = std::make_unique<AdamW>(mine_, config_.adam);
  for (int w = 0; w < workers_; ++w) {
    auto in = std::make_unique<Inbox>();
    in->header = Tensor::zeros({2}, DType::I32);
    in->push = Tensor::zeros({2 + elements_});
    in->answer_header = Tensor::zeros({2}, DType::I32);
    in->answer = Tensor::zeros({2 + elements_});
    inbox_.push_back(std::move(in));
  }
  pushed_.assign(static_cast<size_t>(workers_), 0);
  owed_.assign(static_cast<size_t>(workers_), -1);
  staleness_.assign(static_cast<size_t>(workers_), 0);
  answer_loss_.assign(static_cast<size_t>(workers_), 0);
  answer_norm_.assign(static_cast<size_t>(workers_), 0);
  histogram_.assign(kHistogramBins, 0);
  norm_ = Tensor::zeros({1});
}

PsServer::~PsServer() = default;

void PsServer::load(const Checkpoint& c) {
  c.read_model(all_);  // every tensor the file holds, though this server serves some
  const NamedTensors state = c.read_optimizer(mine_, optimizer_state_suffixes(config_.optimizer));
  std::map<std::string, const Tensor*> by_name;
  for (const auto& [name, t] : state) by_name[name] = &t;
  for (auto& [name, t] : optimizer_->state()) t.copy_from(*by_name.at(name));
  optimizer_->set_steps(c.optimizer_steps);
}

bool PsServer::saving(int64_t step) const {
  return (config_.save_interval > 0 && (step + 1) % config_.save_interval == 0) ||
         (config_.save_last && step + 1 == last_);
}

void PsServer::send_state() {
  std::vector<std::pair<std::string, Tensor>> state = optimizer_->state();
  int64_t n = 0;
  for (const auto& [name, t] : state) n += t.numel();
  Tensor header = Tensor::zeros({1}, DType::I32), flat = Tensor::zeros({n});
  header.data<int32_t>()[0] = static_cast<int32_t>(optimizer_->steps());
  int64_t at = 0;
  for (const auto& [name, t] : state) {
    elements(flat, at, t.numel()).copy_from(t.view(Shape{t.numel()}));
    at += t.numel();
  }
  world_.send(header, 0, tag(5));
  world_.send(flat, 0, tag(6));
}

void PsServer::post(int w) {
  Inbox& in = *inbox_[static_cast<size_t>(w)];
  in.h = world_.irecv(in.header, w, tag(0));
  in.p = world_.irecv(in.push, w, tag(1));
  in.full = false;
}

// S = 0: every worker's gradients of `step`, summed in worker order, clipped
// by the whole sum's norm and applied once, as synchronous data parallelism.
void PsServer::round(int64_t step) {
  double loss = 0;
  for (int w = 0; w < workers_; ++w) loss += inbox_[static_cast<size_t>(w)]->push.data<float>()[0];
  int64_t at = 2;
  double local = 0;
  for (Param* p : mine_) {
    const int64_t n = p->value.numel();
    const Tensor g = flat_of(*p, p->grad);
    g.copy_from(elements(inbox_[0]->push, at, n));
    for (int w = 1; w < workers_; ++w) ops::add(g, elements(inbox_[static_cast<size_t>(w)]->push, at, n));
    local += ops::sum_squares(g);
    at += n;
  }
  norm_.data<float>()[0] = static_cast<float>(local);
  servers_.all_reduce(norm_, ReduceOp::Sum);
  const double grad_norm = std::sqrt(static_cast<double>(norm_.data<float>()[0]));
  clip_grads(mine_, config_.clip_grad, grad_norm);
  optimizer_->step(config_.lr.at(step));
  ++version_;
  ++histogram_[0];
  for (int w = 0; w < workers_; ++w) {
    answer_loss_[static_cast<size_t>(w)] = loss;
    answer_norm_[static_cast<size_t>(w)] = grad_norm;
    staleness_[static_cast<size_t>(w)] = 0;
  }
}

// S > 0: worker w's gradients alone, as they arrive: one update, clipped by
// its own gradient's norm (times the workers, as a whole batch's estimate).
// Its gradient is already 1 / workers of its share's mean gradient, so SGD
// moves the parameters 1 / workers as far as a synchronous step; AdamW
// normalises that scale away, so its learning rate takes the 1 / workers.
void PsServer::apply(int w) {
  Inbox& in = *inbox_[static_cast<size_t>(w)];
  const int64_t step = in.header.data<int32_t>()[0], read = in.header.data<int32_t>()[1];
  const double n = static_cast<double>(workers_);
  const double norm = n * std::sqrt(std::max(0.0, static_cast<double>(in.push.data<float>()[1])));
  int64_t at = 2;
  for (Param* p : mine_) {
    const int64_t k = p->value.numel();
    flat_of(*p, p->grad).copy_from(elements(in.push, at, k));
    at += k;
  }
  clip_grads(mine_, config_.clip_grad / n, norm / n);
  const float lr = config_.lr.at(step);
  optimizer_->step(config_.optimizer == OptimizerKind::Adam ? lr / static_cast<float>(n) : lr);
  const int64_t stale = version_ - read;
  ++histogram_[static_cast<size_t>(std::min<int64_t>(stale, kHistogramBins - 1))];
  ++version_;
  staleness_[static_cast<size_t>(w)] = stale;
  answer_loss_[static_cast<size_t>(w)] = n * in.push.data<float>()[0];
  answer_norm_[static_cast<size_t>(w)] = norm;
}

void PsServer::reply(int w) {
  Inbox& in = *inbox_[static_cast<size_t>(w)];
  wait_all(in.sends);  // the worker took the last answer before it pushed again
  in.sends.clear();
  in.answer_header.data<int32_t>()[0] = static_cast<int32_t>(version_);
  in.answer_header.data<int32_t>()[1] = static_cast<int32_t>(staleness_[static_cast<size_t>(w)]);
  in.answer.data<float>()[0] = static_cast<float>(answer_loss_[static_cast<size_t>(w)]);
  in.answer.data<float>()[1] = static_cast<float>(answer_norm_[static_cast<size_t>(w)]);
  int64_t at = 2;
  for (Param* p : mine_) {
    const int64_t n = p->value.numel();
    elements(in.answer, at, n).copy_from(flat_of(*p, p->value));
    at += n;
  }
  in.sends.push_back(world_.isend(in.answer_header, w, tag(2)));
  in.sends.push_back(world_.isend(in.answer, w, tag(3)));
  owed_[static_cast<size_t>(w)] = -1;
}

void PsServer::serve(int64_t first, int64_t last) {
  using Clock = std::chrono::steady_clock;
  const int64_t S = config_.max_staleness;
  last_ = last;
  std::fill(pushed_.begin(), pushed_.end(), first);
  if (first < last)
    for (int w = 0; w < workers_; ++w) post(w);
  int64_t answered = 0;
  const int64_t total = workers_ * std::max<int64_t>(0, last - first);
  auto progressed_at = Clock::now();
  while (answered < total) {
    bool progress = false;
    for (int w = 0; w < workers_; ++w) {
      Inbox& in = *inbox_[static_cast<size_t>(w)];
      if (!in.h || in.full || !in.h->test() || !in.p->test()) continue;
      in.h.reset(), in.p.reset();
      progress = true;
      const int64_t step = in.header.data<int32_t>()[0];
      check(step == pushed_[static_cast<size_t>(w)],
            "server {}: worker {} pushed step {} but step {} was due", server_, w, step + 1,
            pushed_[static_cast<size_t>(w)] + 1);
      pushed_[static_cast<size_t>(w)] = step + 1;
      owed_[static_cast<size_t>(w)] = step;
      const auto [lo, hi] = std::minmax_element(pushed_.begin(), pushed_.end());
      max_gap_ = std::max(max_gap_, *hi - *lo);
      if (S == 0) {
        in.full = true;
      } else {
        apply(w);
        if (step + 1 < last) post(w);
      }
    }
    if (S == 0 && std::all_of(inbox_.begin(), inbox_.end(), [](const auto& in) { return in->full; })) {
      const int64_t step = pushed_[0] - 1;
      round(step);
      for (int w = 0; w < workers_; ++w)
        if (step + 1 < last) post(w);
        else inbox_[static_cast<size_t>(w)]->full = false;
    }
    // Answers the staleness bound allows: worker w may start step t + 1 once
    // every worker has pushed step t - S, or step t itself after a save step.
    const int64_t slowest = *std::min_element(pushed_.begin(), pushed_.end());
    int64_t saved = -1;
    for (int w = 0; w < workers_; ++w) {
      const int64_t t = owed_[static_cast<size_t>(w)];
      if (t < 0 || inbox_[static_cast<size_t>(w)]->full ||
          slowest < t + 1 - (saving(t) ? 0 : S))
        continue;
      reply(w);
      ++answered;
      progress = true;
      if (saving(t)) saved = t;
    }
    // Every worker has pushed the save step and none can push the next before
    // its answer: the state is the checkpoint's.
    if (saved >= 0) send_state();
    if (progress) {
      progressed_at = Clock::now();
      continue;
    }
    if (Clock::now() - progressed_at > world_.options().timeout) {
      std::vector<int> waiting;
      for (int w = 0; w < workers_; ++w)
        if (inbox_[static_cast<size_t>(w)]->h) waiting.push_back(w);
      throw CommTimeout(
          "parameter server {} (world rank {}) waited {} ms for a push from worker(s) {} (at "
          "steps {}); the slowest worker has pushed {} of {} steps",
          server_, world_.rank(), world_.options().timeout.count(), fmt::join(waiting, ", "),
          fmt::join(pushed_, ", "), slowest, last);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  for (auto& in : inbox_) {
    wait_all(in->sends);
    in->sends.clear();
  }
  Tensor h = Tensor::zeros({kHistogramBins}, DType::I32);
  for (int b = 0; b < kHistogramBins; ++b) h.data<int32_t>()[b] = static_cast<int32_t>(histogram_[static_cast<size_t>(b)]);
  world_.send(h, 0, tag(4));
}

}  // namespace weft
