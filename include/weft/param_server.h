// weft/param_server.h — data parallelism through parameter servers, with
// bounded staleness (stale-synchronous parallel).
//
// The last K ranks of the world are servers; each holds a shard of the
// parameters (whole tensors of the logical model, assign_to_servers) with
// their optimizer state. The other ranks are workers: each data-parallel
// replica is a worker, one process or a pipeline x tensor-parallel group of
// them. A worker computes the gradients of its share of the global batch;
// each of its ranks pushes its pieces of those gradients to their servers
// (every piece once: the pipeline rank that owns a tied tensor, tensor-
// parallel rank 0 of a replicated one, every rank its slice of a split one)
// and waits for the values of every piece it holds back. A server assembles
// a worker's whole tensors from the pieces of its ranks. With
// --max-staleness S, no worker starts a step more than S steps ahead of the
// slowest (a server answers worker i's push of step t once every worker has
// pushed step t - S).
//
//  - S = 0: a server waits for every worker's gradients of step t, sums them
//    in worker order, clips by the norm of the whole summed gradient (the
//    servers all-reduce it) and applies one update: synchronous data
//    parallelism's numbers.
//  - S > 0: a server applies each worker's gradients as they arrive, one
//    update each, clipped by that worker's own norm and moving the
//    parameters 1 / workers as far as a synchronous step would (SGD: the
//    gradient is a 1 / workers share; AdamW: the learning rate over
//    workers), and records how many other updates came between the
//    parameters the worker read and its own (its staleness).
//
//   // every rank, with the logical model's parameters:
//   auto role = world.split({workers, servers}, "ps");
//   if (server) PsServer(world, *role, params, config).serve(0, steps);
//   else { PsWorker ps(world, params, config); ... trainer with Parallel::ps = &ps ... }
//
// The Trainer attaches its rank's parameters (PsWorker::attach), which tells
// every server which pieces this rank pushes and pulls.
#pragma once

#include <weft/communicator.h>
#include <weft/optimizer.h>
#include <weft/param.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

namespace weft {

struct Checkpoint;

struct PsConfig {
  int servers = 1;            // --ps-ranks K: world ranks [world - K, world)
  int64_t max_staleness = 0;  // --max-staleness S
  // What the servers' optimizer does (the same flags as data parallelism).
  OptimizerKind optimizer = OptimizerKind::Adam;
  AdamWConfig adam;
  SgdConfig sgd;
  LionConfig lion;
  LrSchedule lr;
  double clip_grad = 1.0;
  // Benchmarking (--slow-rank, --slow-factor): this worker takes this many
  // times its compute time per step.
  double slow_factor = 1.0;
  // Checkpoints: after every save_interval-th step (0: none), and after the
  // last with save_last, every worker waits for the others (as at S = 0), so
  // the servers hold exactly the updates of the steps so far, and each server
  // sends its optimizer state to world rank 0, which writes the checkpoint.
  int64_t save_interval = 0;
  bool save_last = false;

  int workers(int world) const { return world - servers; }
};

// The server of each parameter: the largest tensors first, each onto the
// server holding the fewest elements so far (ties: the lower server). A
// function of the parameters' order and sizes: the same on every rank.
// Throws Error when servers < 1 or there are fewer tensors than servers.
std::vector<int> assign_to_servers(const std::vector<Param*>& params, int servers);

// What a worker saw in one exchange.
struct PsStep {
  double loss = 0;       // S = 0: the global batch's; S > 0: this worker's share, times workers
  double grad_norm = 0;  // S = 0: of the summed gradient; S > 0: this worker's, times workers
  double wait_ms = 0;    // from the push until the parameters were back
  int64_t staleness = 0; // of this worker's update (the most over servers)
  double bytes = 0;      // sent by this rank: its gradient pieces out
};

// A worker rank's side: one per worker rank, holding the logical model's
// parameter list (the same names, shapes and order as the servers').
class PsWorker {
 public:
  // `world` is the whole job; this rank is worker rank world.rank().
  // `logical`: the whole model's parameters (only names and shapes are read).
  PsWorker(Communicator& world, std::vector<Param*> logical, PsConfig config);
  ~PsWorker();
  // This rank's parameters (each a piece of a logical one, Param::shard): it
  // pulls all of them and pushes the gradients of those in `pushed`. Rank
  // `replica` of `replicas` data-parallel replicas (the workers). Tells every
  // server its pieces (a server waits for this from every worker rank). Throws
  // Error naming a parameter the logical model does not have, or a rank that
  // holds no parameter at all.
  void attach(const std::vector<Param*>& local, const std::vector<const Param*>& pushed,
              int replica, int replicas);
  // Pushes this rank's pieces of the gradients of `step` (Param::grad, its
  // worker's share of the batch's mean-loss gradient), `loss` (the worker's
  // share of the mean loss) and the squared norm of the worker's gradients;
  // waits for the parameters the staleness bound allows and copies them into
  // Param::value. `compute_ms` is the step's compute time (for the slow factor).
  PsStep exchange(int64_t step, double loss, double norm_sq, double compute_ms);
  // On world rank 0, after the last step: the servers' staleness counts
  // summed (index s: updates of staleness s; the last bin holds the larger).
  std::vector<int64_t> staleness_histogram();
  // On world rank 0, after the exchange of a save step: every server's
  // optimizer state ("<param><suffix>", optimizer_state_suffixes; whole
  // tensors of the logical model), and in `steps` their optimizer's step count.
  std::vector<std::pair<std::string, Tensor>> optimizer_state(int64_t& steps);
  // World rank 0: the rank the servers send their state and counts to.
  bool writer() const { return world_.rank() == 0; }

 private:
  struct Shard;
  Communicator& world_;
  std::vector<Param*> logical_;
  std::vector<int> server_of_;  // per logical parameter
  PsConfig config_;
  std::vector<std::unique_ptr<Shard>> shards_;  // per server this rank holds pieces of
  std::vector<RequestPtr> answers_;              // this step's receives, reused
  std::vector<RequestPtr> manifests_;            // attach's sends
  std::vector<Tensor> manifest_buffers_;
};

class PsServer {
 public:
  // `servers` is the group of the server ranks (for the S = 0 norm);
  // `params` the whole logical model in the workers' order, initialised as
  // theirs. Waits for every worker rank's pieces (PsWorker::attach).
  PsServer(Communicator& world, Communicator& servers, std::vector<Param*> params,
           PsConfig config);
  ~PsServer();
  // Its tensors' values and optimizer state from a checkpoint, to serve on
  // from the checkpoint's step.
  void load(const Checkpoint& c);
  // Answers every worker's pushes of steps [first, last), then sends its
  // staleness counts to world rank 0. Throws CommTimeout naming the workers
  // it waits for when none pushes within the world's deadline.
  void serve(int64_t first, int64_t last);

  static constexpr int kHistogramBins = 32;
  const std::vector<int64_t>& histogram() const { return histogram_; }
  // The most steps any worker was ahead of the slowest when a push arrived.
  int64_t max_clock_gap() const { return max_gap_; }
  int64_t updates() const { return version_; }

 private:
  struct Member;
  struct Worker;
  void receive_pieces();
  void post(int worker);
  void assemble(int worker, const std::vector<Tensor>& into);  // whole gradients from pieces
  void round(int64_t step);                 // S = 0
  void apply(int worker);                   // S > 0
  void reply(int worker);
  bool saving(int64_t step) const;
  void send_state();
  Communicator& world_;
  Communicator& servers_;
  PsConfig config_;
  int workers_ = 0, server_ = 0;  // workers: data-parallel replicas, each of one or more ranks
  std::vector<Param*> all_;   // the model's tensors
  std::vector<Param*> mine_;  // this server's tensors, in model order
  std::vector<Tensor> sum_;   // S = 0: a worker's gradients before they join the sum
  std::vector<Tensor> grads_;  // mine_'s gradients, where a step's sum or update is assembled
  GradTables tables_;          // the norm's and the clipping's (weft/optimizer.h)
  std::unique_ptr<Optimizer> optimizer_;
  std::vector<std::unique_ptr<Worker>> worker_;  // per worker
  std::vector<int64_t> pushed_;                // per worker: steps pushed
  std::vector<int64_t> owed_;                  // per worker: the step whose answer is owed, or -1
  std::vector<int64_t> staleness_;             // per worker: of its last update
  std::vector<double> answer_loss_, answer_norm_;
  std::vector<int64_t> histogram_;
  Tensor norm_;  // the S = 0 norm's all-reduce
  int64_t version_ = 0, max_gap_ = 0, last_ = 0;
};

}  // namespace weft
