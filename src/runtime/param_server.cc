// Parameter servers with bounded staleness: the workers' exchange and the
// servers' event loop.
//
// Messages, one pair per (worker, server) and step, in per-peer FIFO order:
//   push   worker -> server  #0 I32 [step, version read]   #1 F32 [loss, |g|^2, gradients...]
//   answer server -> worker  #2 I32 [version, staleness]   #3 F32 [loss, norm, values...]
//   counts server -> rank 0  #4 I32 the staleness histogram, after the last step
//   state  server -> rank 0  #5 I32 [optimizer steps]  #6 F32 its optimizer state, at saves
//   pieces worker -> server  #7 I32 [length]  #8 I32 which pieces it holds, once, before step 1
// A worker of several ranks (pipeline x tensor parallel) exchanges these per
// rank that holds pieces of the server's tensors: the pushes carry the pieces
// it owns, the answers every piece it holds.
#include <weft/checkpoint.h>
#include <weft/ops.h>
#include <weft/param_server.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <set>
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
//
// A piece: this rank's part (Param::shard) of logical tensor `logical`. The
// manifest a worker rank sends each server before the first step (#7 I32
// [length], #8 I32 body) lists the pieces it holds of that server's tensors,
// in the order its pushes and answers carry them:
//   [replica, replicas, pieces, then per piece: logical index, pushed, dim,
//    parts, index, blocks, block widths...]

struct PsWorker::Shard {
  int world_rank = 0;
  std::vector<Param*> params;  // pulled, in this rank's order
  std::vector<Param*> pushed;  // of those, the ones whose gradients this rank pushes
  Tensor push_header, push, answer_header, answer;
  std::vector<RequestPtr> sends;
  int64_t version = 0;  // of the parameters last read from this server
};

PsWorker::PsWorker(Communicator& world, std::vector<Param*> logical, PsConfig config)
    : world_(world), logical_(std::move(logical)), config_(config) {
  const int workers = config_.workers(world_.size());
  check(world_.rank() < workers, "world rank {} is a server, not a worker ({} worker ranks)",
        world_.rank(), workers);
  server_of_ = assign_to_servers(logical_, config_.servers);
}

PsWorker::~PsWorker() {
  // The manifests went out before the first step; a server has read them.
  try {
    wait_all(manifests_);
  } catch (...) {  // a failed peer: the job is ending anyway
  }
}

void PsWorker::attach(const std::vector<Param*>& local, const std::vector<const Param*>& pushed,
                      int replica, int replicas) {
  check(shards_.empty(), "PsWorker::attach: this rank's parameters are attached already");
  check(!local.empty(),
        "world rank {} holds no parameter, so it has nothing to push or pull: give every "
        "pipeline stage of a worker at least one parameter (fewer --pp, or another --partition)",
        world_.rank());
  std::map<std::string, int> index;
  for (size_t i = 0; i < logical_.size(); ++i) index[logical_[i]->name] = static_cast<int>(i);
  const std::set<const Param*> push(pushed.begin(), pushed.end());
  const int workers = config_.workers(world_.size());
  std::vector<std::vector<int32_t>> manifest(static_cast<size_t>(config_.servers));
  for (auto& m : manifest) m = {replica, replicas, 0};
  std::vector<std::unique_ptr<Shard>> shards(static_cast<size_t>(config_.servers));
  for (Param* p : local) {
    const auto it = index.find(p->name);
    check(it != index.end(), "parameter {} of world rank {} is not in the model the servers hold",
          p->name, world_.rank());
    const int k = server_of_[static_cast<size_t>(it->second)];
    auto& s = shards[static_cast<size_t>(k)];
    if (!s) {
      s = std::make_unique<Shard>();
      s->world_rank = workers + k;
    }
    s->params.push_back(p);
    const bool pushes = push.count(p) > 0;
    if (pushes) s->pushed.push_back(p);
    std::vector<int32_t>& m = manifest[static_cast<size_t>(k)];
    ++m[2];
    const weft::Shard& sh = p->shard;
    m.insert(m.end(), {it->second, pushes ? 1 : 0, sh.dim, sh.parts, sh.index,
                       static_cast<int32_t>(sh.blocks.size())});
    for (int64_t b : sh.blocks) m.push_back(static_cast<int32_t>(b));
  }
  for (int k = 0; k < config_.servers; ++k) {
    const std::vector<int32_t>& m = manifest[static_cast<size_t>(k)];
    Tensor length = Tensor::zeros({1}, DType::I32);
    length.data<int32_t>()[0] = static_cast<int32_t>(m.size());
    Tensor body = Tensor::zeros({static_cast<int64_t>(m.size())}, DType::I32);
    std::copy(m.begin(), m.end(), body.data<int32_t>());
    manifests_.push_back(world_.isend(length, workers + k, tag(7)));
    manifests_.push_back(world_.isend(body, workers + k, tag(8)));
    manifest_buffers_.push_back(length);
    manifest_buffers_.push_back(body);
    auto& s = shards[static_cast<size_t>(k)];
    if (!s) continue;  // this rank holds nothing of server k's tensors
    int64_t pushed_n = 0, pulled_n = 0;
    for (Param* p : s->pushed) pushed_n += p->value.numel();
    for (Param* p : s->params) pulled_n += p->value.numel();
    s->push_header = Tensor::zeros({2}, DType::I32);
    s->push = Tensor::zeros({2 + pushed_n});
    s->answer_header = Tensor::zeros({2}, DType::I32);
    s->answer = Tensor::zeros({2 + pulled_n});
    shards_.push_back(std::move(s));
  }
}

PsStep PsWorker::exchange(int64_t step, double loss, double norm_sq, double compute_ms) {
  using Clock = std::chrono::steady_clock;
  check(!shards_.empty(), "PsWorker::exchange before attach: the servers do not know this rank");
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
    for (Param* p : s.pushed) {
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
  // Every server sums the same numbers in the same order: any one stands for all.
  r.loss = shards_.front()->answer.data<float>()[0];
  r.grad_norm = shards_.front()->answer.data<float>()[1];
  return r;
}

std::vector<int64_t> PsWorker::staleness_histogram() {
  check(world_.rank() == 0, "the staleness counts go to world rank 0, not {}", world_.rank());
  std::vector<int64_t> total(PsServer::kHistogramBins, 0);
  const int workers = config_.workers(world_.size());
  for (int k = 0; k < config_.servers; ++k) {
    Tensor h = Tensor::zeros({PsServer::kHistogramBins}, DType::I32);
    world_.recv(h, workers + k, tag(4));
    for (int b = 0; b < PsServer::kHistogramBins; ++b) total[static_cast<size_t>(b)] += h.data<int32_t>()[b];
  }
  return total;
}

std::vector<std::pair<std::string, Tensor>> PsWorker::optimizer_state(int64_t& steps) {
  check(world_.rank() == 0, "the servers' state goes to world rank 0, not {}", world_.rank());
  const std::vector<std::string> suffixes = optimizer_state_suffixes(config_.optimizer);
  std::vector<std::pair<std::string, Tensor>> state;
  const int workers = config_.workers(world_.size());
  for (int k = 0; k < config_.servers; ++k) {
    std::vector<Param*> held;  // server k's tensors, in model order
    for (size_t i = 0; i < logical_.size(); ++i)
      if (server_of_[i] == k) held.push_back(logical_[i]);
    Tensor header = Tensor::zeros({1}, DType::I32);
    Tensor flat = Tensor::zeros({static_cast<int64_t>(suffixes.size()) * elements_of(held)});
    world_.recv(header, workers + k, tag(5));
    world_.recv(flat, workers + k, tag(6));
    steps = header.data<int32_t>()[0];
    int64_t at = 0;
    for (Param* p : held)  // in the order of the optimizer's state(): parameter, then suffix
      for (const std::string& suffix : suffixes) {
        Tensor t = Tensor::zeros(p->shard.full);
        t.view(Shape{t.numel()}).copy_from(elements(flat, at, t.numel()));
        at += t.numel();
        state.emplace_back(p->name + suffix, t);
      }
  }
  return state;
}

// --- the server ---

// One worker rank, as this server sees it: the pieces of this server's
// tensors it holds, and its messages.
struct PsServer::Member {
  struct Piece {
    int tensor = 0;  // index into mine_
    Shard shard;     // this rank's part of it
    int64_t at = 0;  // where the piece sits in the push (pushed ones) or the answer
  };
  int world_rank = 0;
  std::vector<Piece> pushed, pulled;
  Tensor header, push;
  RequestPtr h, p;
  bool arrived = false;  // this step's push is here
  Tensor answer_header, answer;
  std::vector<RequestPtr> sends;
};

// A worker: one data-parallel replica, its ranks that hold pieces of this
// server's tensors in world-rank order.
struct PsServer::Worker {
  std::vector<std::unique_ptr<Member>> members;
  bool full = false;  // a whole push has arrived and waits to be applied (S = 0)
};

PsServer::PsServer(Communicator& world, Communicator& servers, std::vector<Param*> params,
                   PsConfig config)
    : world_(world), servers_(servers), config_(config) {
  const int worker_ranks = config_.workers(world_.size());
  server_ = world_.rank() - worker_ranks;
  check(server_ >= 0 && server_ < config_.servers,
        "world rank {} is not one of the {} servers (world ranks {}..{})", world_.rank(),
        config_.servers, worker_ranks, world_.size() - 1);
  check(config_.max_staleness >= 0, "--max-staleness ({}) must be >= 0", config_.max_staleness);
  all_ = params;
  const std::vector<int> server = assign_to_servers(params, config_.servers);
  for (size_t i = 0; i < params.size(); ++i)
    if (server[i] == server_) mine_.push_back(params[i]);
  for (Param* p : mine_) {
    if (!p->grad.defined() || p->grad.numel() != p->value.numel())
      p->grad = Tensor::zeros(p->value.shape());
    sum_.push_back(Tensor::zeros(p->value.shape()));
    grads_.push_back(p->grad);
  }
  OptimizerConfig oc;
  oc.kind = config_.optimizer, oc.adam = config_.adam, oc.sgd = config_.sgd;
  oc.lion = config_.lion;
  optimizer_ = std::make_unique<Optimizer>(mine_, make_update_rule(oc));
  receive_pieces();
  pushed_.assign(static_cast<size_t>(workers_), 0);
  owed_.assign(static_cast<size_t>(workers_), -1);
  staleness_.assign(static_cast<size_t>(workers_), 0);
  answer_loss_.assign(static_cast<size_t>(workers_), 0);
  answer_norm_.assign(static_cast<size_t>(workers_), 0);
  histogram_.assign(kHistogramBins, 0);
  norm_ = Tensor::zeros({1});
}

PsServer::~PsServer() = default;

// Every worker rank's manifest (PsWorker::attach): which worker it belongs
// to and which pieces of this server's tensors it pushes and pulls. Checks
// that each worker's pushed pieces cover each tensor exactly once.
void PsServer::receive_pieces() {
  const int worker_ranks = config_.workers(world_.size());
  std::map<int, int> mine_of;  // logical index -> index into mine_
  for (size_t i = 0, j = 0; i < all_.size(); ++i)
    if (j < mine_.size() && all_[i] == mine_[j]) mine_of[static_cast<int>(i)] = static_cast<int>(j++);
  int replicas = -1;
  std::vector<std::vector<int64_t>> covered;  // per worker, per tensor: elements pushed
  for (int r = 0; r < worker_ranks; ++r) {
    Tensor length = Tensor::zeros({1}, DType::I32);
    world_.recv(length, r, tag(7));
    Tensor body = Tensor::zeros({length.data<int32_t>()[0]}, DType::I32);
    world_.recv(body, r, tag(8));
    const int32_t* m = body.data<int32_t>();
    const int32_t* const end = m + body.numel();
    auto next = [&](const char* what) {
      check(m < end, "server {}: world rank {}'s list of pieces ends before its {}", server_, r,
            what);
      return *m++;
    };
    const int replica = next("replica"), count = next("replica count"), pieces = next("pieces");
    if (replicas < 0) {
      replicas = count;
      check(replicas >= 1 && replicas <= worker_ranks && worker_ranks % replicas == 0,
            "server {}: {} worker replicas do not divide the {} worker ranks", server_, replicas,
            worker_ranks);
      for (int w = 0; w < replicas; ++w) worker_.push_back(std::make_unique<Worker>());
      covered.assign(static_cast<size_t>(replicas), std::vector<int64_t>(mine_.size(), 0));
    }
    check(count == replicas && replica >= 0 && replica < replicas,
          "server {}: world rank {} says it is replica {} of {}, but world rank 0 said {} "
          "replicas",
          server_, r, replica, count, replicas);
    auto member = std::make_unique<Member>();
    member->world_rank = r;
    int64_t push_n = 0, pull_n = 0;
    for (int k = 0; k < pieces; ++k) {
      const int logical = next("tensor"), pushes = next("push flag");
      Shard sh;
      sh.dim = next("dimension"), sh.parts = next("parts"), sh.index = next("index");
      const int blocks = next("block count");
      for (int b = 0; b < blocks; ++b) sh.blocks.push_back(next("block width"));
      const auto it = mine_of.find(logical);
      check(it != mine_of.end(), "server {}: world rank {} sent a piece of tensor {}, which "
            "server {} does not hold", server_, r, logical, server_);
      sh.full = mine_[static_cast<size_t>(it->second)]->value.shape();
      const int64_t n = sh.local().numel();
      member->pulled.push_back({it->second, sh, 2 + pull_n});
      pull_n += n;
      if (pushes != 0) {
        member->pushed.push_back({it->second, sh, 2 + push_n});
        push_n += n;
        covered[static_cast<size_t>(replica)][static_cast<size_t>(it->second)] += n;
      }
    }
    if (pieces == 0) continue;  // no piece here: this rank never writes to this server
    member->header = Tensor::zeros({2}, DType::I32);
    member->push = Tensor::zeros({2 + push_n});
    member->answer_header = Tensor::zeros({2}, DType::I32);
    member->answer = Tensor::zeros({2 + pull_n});
    worker_[static_cast<size_t>(replica)]->members.push_back(std::move(member));
  }
  workers_ = replicas;
  for (int w = 0; w < workers_; ++w)
    for (size_t t = 0; t < mine_.size(); ++t)
      check(covered[static_cast<size_t>(w)][t] == mine_[t]->value.numel(),
            "server {}: worker {} pushes {} elements of {} ({} elements): every element must "
            "come from exactly one of its ranks",
            server_, w, covered[static_cast<size_t>(w)][t], mine_[t]->name,
            mine_[t]->value.numel());
}

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
  Worker& wk = *worker_[static_cast<size_t>(w)];
  for (auto& m : wk.members) {
    m->h = world_.irecv(m->header, m->world_rank, tag(0));
    m->p = world_.irecv(m->push, m->world_rank, tag(1));
    m->arrived = false;
  }
  wk.full = false;
}

// Worker w's whole gradients of this server's tensors, from its ranks' pieces.
void PsServer::assemble(int w, const std::vector<Tensor>& into) {
  for (auto& m : worker_[static_cast<size_t>(w)]->members)
    for (const Member::Piece& piece : m->pushed) {
      const Tensor part = elements(m->push, piece.at, piece.shard.local().numel())
                              .view(piece.shard.local());
      place_shard(part, piece.shard, into[static_cast<size_t>(piece.tensor)]);
    }
}

// Worker w's loss share and squared norm: every rank of it sent the same.
namespace {
float push_field(const Tensor& push, int field) { return push.data<float>()[field]; }
}  // namespace

// S = 0: every worker's gradients of `step`, summed in worker order, clipped
// by the whole sum's norm and applied once, as synchronous data parallelism.
void PsServer::round(int64_t step) {
  double loss = 0;
  for (int w = 0; w < workers_; ++w)
    loss += push_field(worker_[static_cast<size_t>(w)]->members.front()->push, 0);
  assemble(0, grads_);
  for (int w = 1; w < workers_; ++w) {
    assemble(w, sum_);
    for (size_t t = 0; t < mine_.size(); ++t) ops::add(grads_[t], sum_[t]);
  }
  const double local = ops::sum_squares_multi(grads_, tables_.norm);
  norm_.data<float>()[0] = static_cast<float>(local);
  servers_.all_reduce(norm_, ReduceOp::Sum);
  const double grad_norm = std::sqrt(static_cast<double>(norm_.data<float>()[0]));
  clip_grads(mine_, config_.clip_grad, grad_norm, tables_);
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
// moves the parameters 1 / workers as far as a synchronous step; AdamW and
// Lion normalise that scale away (UpdateRule::normalised), so their learning
// rate takes the 1 / workers.
void PsServer::apply(int w) {
  const Member& first = *worker_[static_cast<size_t>(w)]->members.front();
  const int64_t step = first.header.data<int32_t>()[0], read = first.header.data<int32_t>()[1];
  const double n = static_cast<double>(workers_);
  const double norm = n * std::sqrt(std::max(0.0, static_cast<double>(push_field(first.push, 1))));
  assemble(w, grads_);
  clip_grads(mine_, config_.clip_grad / n, norm / n, tables_);
  const float lr = config_.lr.at(step);
  optimizer_->step(optimizer_->rule().normalised() ? lr / static_cast<float>(n) : lr);
  const int64_t stale = version_ - read;
  ++histogram_[static_cast<size_t>(std::min<int64_t>(stale, kHistogramBins - 1))];
  ++version_;
  staleness_[static_cast<size_t>(w)] = stale;
  answer_loss_[static_cast<size_t>(w)] = n * push_field(first.push, 0);
  answer_norm_[static_cast<size_t>(w)] = norm;
}

void PsServer::reply(int w) {
  for (auto& mp : worker_[static_cast<size_t>(w)]->members) {
    Member& m = *mp;
    wait_all(m.sends);  // the rank took the last answer before it pushed again
    m.sends.clear();
    m.answer_header.data<int32_t>()[0] = static_cast<int32_t>(version_);
    m.answer_header.data<int32_t>()[1] = static_cast<int32_t>(staleness_[static_cast<size_t>(w)]);
    m.answer.data<float>()[0] = static_cast<float>(answer_loss_[static_cast<size_t>(w)]);
    m.answer.data<float>()[1] = static_cast<float>(answer_norm_[static_cast<size_t>(w)]);
    for (const Member::Piece& piece : m.pulled)
      slice_shard(mine_[static_cast<size_t>(piece.tensor)]->value, piece.shard,
                  elements(m.answer, piece.at, piece.shard.local().numel())
                      .view(piece.shard.local()));
    m.sends.push_back(world_.isend(m.answer_header, m.world_rank, tag(2)));
    m.sends.push_back(world_.isend(m.answer, m.world_rank, tag(3)));
  }
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
      Worker& wk = *worker_[static_cast<size_t>(w)];
      if (wk.full) continue;
      for (auto& m : wk.members) {
        if (!m->h || m->arrived || !m->h->test() || !m->p->test()) continue;
        m->h.reset(), m->p.reset();
        m->arrived = true;
        progress = true;
        const int64_t step = m->header.data<int32_t>()[0];
        check(step == pushed_[static_cast<size_t>(w)],
              "server {}: world rank {} of worker {} pushed step {} but step {} was due", server_,
              m->world_rank, w, step + 1, pushed_[static_cast<size_t>(w)] + 1);
      }
      if (!std::all_of(wk.members.begin(), wk.members.end(),
                       [](const auto& m) { return m->arrived; }))
        continue;
      // The worker's whole push of this step is here.
      const int64_t step = pushed_[static_cast<size_t>(w)];
      pushed_[static_cast<size_t>(w)] = step + 1;
      owed_[static_cast<size_t>(w)] = step;
      const auto [lo, hi] = std::minmax_element(pushed_.begin(), pushed_.end());
      max_gap_ = std::max(max_gap_, *hi - *lo);
      if (S == 0) {
        wk.full = true;
      } else {
        apply(w);
        if (step + 1 < last) post(w);
        else for (auto& m : wk.members) m->arrived = false;
      }
    }
    if (S == 0 && std::all_of(worker_.begin(), worker_.end(), [](const auto& wk) { return wk->full; })) {
      const int64_t step = pushed_[0] - 1;
      round(step);
      for (int w = 0; w < workers_; ++w) {
        Worker& wk = *worker_[static_cast<size_t>(w)];
        if (step + 1 < last) {
          post(w);
        } else {
          wk.full = false;
          for (auto& m : wk.members) m->arrived = false;
        }
      }
    }
    // Answers the staleness bound allows: worker w may start step t + 1 once
    // every worker has pushed step t - S, or step t itself after a save step.
    const int64_t slowest = *std::min_element(pushed_.begin(), pushed_.end());
    int64_t saved = -1;
    for (int w = 0; w < workers_; ++w) {
      const int64_t t = owed_[static_cast<size_t>(w)];
      if (t < 0 || worker_[static_cast<size_t>(w)]->full ||
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
        for (auto& m : worker_[static_cast<size_t>(w)]->members)
          if (m->h && !m->arrived) waiting.push_back(m->world_rank);
      throw CommTimeout(
          "parameter server {} (world rank {}) waited {} ms for a push from world rank(s) {} (the "
          "workers are at steps {}); the slowest worker has pushed {} of {} steps",
          server_, world_.rank(), world_.options().timeout.count(), fmt::join(waiting, ", "),
          fmt::join(pushed_, ", "), slowest, last);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  for (auto& wk : worker_)
    for (auto& m : wk->members) {
      wait_all(m->sends);
      m->sends.clear();
    }
  Tensor h = Tensor::zeros({kHistogramBins}, DType::I32);
  for (int b = 0; b < kHistogramBins; ++b) h.data<int32_t>()[b] = static_cast<int32_t>(histogram_[static_cast<size_t>(b)]);
  world_.send(h, 0, tag(4));
}

}  // namespace weft
