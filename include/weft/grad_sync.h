// weft/grad_sync.h — data-parallel gradient reduction in buckets, the
// distributed optimizer (ZeRO-1), and the gradient norm over every layout.
//
// The gradients of this rank's parameters live in flat bucket buffers
// (Param::grad becomes a view into one), in the order they become final
// during backward. The executor reports each node's W action; when the last
// W that touches a bucket's parameters has run for the step's last
// micro-batch, the bucket's reduction across the data-parallel group starts
// at once (non-blocking) and overlaps the rest of the backward. finish()
// starts what is left (parameters tied across pipeline ranks go last, after
// their pipeline sum) and waits for all.
//
// Plain data parallelism all-reduces each bucket; every replica then holds
// the summed gradient and runs AdamW on all of it. With the distributed
// optimizer (ZeRO-1) each bucket is reduce-scattered: replica r owns slice r
// of every bucket, keeps Adam's moments for that slice only, updates it, and
// the parameters are all-gathered back (Param::value is a view into the
// bucket's flat parameter buffer). Both give the same numbers. Every buffer,
// slice and moment lives on the parameters' device (on a GPU, the
// collectives move device tensors and AdamW runs there); optimizer_state()
// returns the distributed optimizer's moments on the host, as a CPU run's.
//
// Compression, off by default, trades exactness for traffic. With
// reduce_dtype BF16 each bucket is rounded to bf16 (to nearest even), reduced
// in bf16 (every addition done in fp32 and rounded once to bf16, so the sum
// depends on the transport's reduction order but is the same bits on every
// replica) and widened back: half the bytes, with plain data parallelism and
// with the distributed optimizer. With compression PowerSgd (plain data
// parallelism only) each bucket's matrices travel as rank-r PowerSGD factors
// with error feedback (weft/compress.h), from step powersgd_start_iter on
// (uncompressed before): the first all-reduce (the P factors and the
// bucket's vectors) starts with the bucket and overlaps the backward; the
// second (the Q factors) needs the first's result, and starts in finish() in
// bucket order, so that every replica posts its collectives alike.
//
// With sharded gradients as well (ZeRO-2, Megatron-FSDP's optim_grads) no
// replica keeps a whole gradient between micro-batches: the backward of each
// micro-batch writes a bucket's gradients into a buffer borrowed from a pool
// (weight_begin points Param::grad into it), and once that micro-batch's last
// W on the bucket has run, the buffer is reduce-scattered and this replica's
// slice added to the bucket's persistent slice, in micro-batch order; the
// buffer goes back to the pool when the reduction is done. A replica keeps
// (padded / dp) gradient elements per bucket plus the pool, whose size is
// the buckets open or in flight at once, not the model. Parameters tied
// across pipeline ranks keep ZeRO-1's whole gradient (they are summed over
// the pipeline after the last W). It reduces once per micro-batch instead of
// once per step: M times the reduce-scatters of ZeRO-1, the same bytes each.
//
// With sharded parameters as well (ZeRO-3, Megatron-FSDP's
// optim_grads_params) a replica keeps only its slice of each bucket's
// values between actions, the slice its optimizer updates; nothing gathers
// them back after the update. Before each node's action (its forward, the
// input and weight parts of its backward, a recomputed forward) the executor
// calls gather(node, next): every bucket holding the node's parameters is
// all-gathered into a buffer of a second pool (Param::value becomes a view
// into it), and the gather of the next node's buckets is posted at once, so
// that it moves while this node computes. A bucket stays gathered until its
// buffer is needed for another (the least recently used one goes), so a
// bucket two nodes share is gathered once for both; the pool holds at most
// twice the most buckets one node touches. Between actions a sharded
// parameter's value is a view of whatever its buffer holds: read it whole
// through whole_values(), a slice through value_slice(). Parameters tied
// across pipeline ranks keep ZeRO-1's whole values. With bf16 activations
// each gathered bucket is rounded to bf16 once, into the buffer's bf16 half
// (Param::value16), in place of the batch's copies.
//
// The gradient norm counts every parameter once, whether it is split by
// tensor parallelism (each rank adds its piece), replicated across the
// tensor-parallel group (tp rank 0 adds it), tied across pipeline stages (its
// first holder adds it) or replicated across data-parallel replicas.
#pragma once

#include <weft/communicator.h>
#include <weft/compress.h>
#include <weft/graph.h>
#include <weft/optimizer.h>
#include <weft/sharding.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace weft {

struct GradSyncOptions {
  // Elements per bucket (Megatron's --ddp-bucket-size); a parameter larger
  // than this gets a bucket of its own.
  int64_t bucket_elements = int64_t{1} << 20;
  // Start each bucket as soon as its gradients are final (--overlap-grad-reduce);
  // off, every bucket starts in finish(), after the whole backward.
  bool overlap = true;
  bool distributed_optimizer = false;  // --use-distributed-optimizer
  // Gradients sharded too (ZeRO-2; --data-parallel-sharding-strategy
  // optim_grads): needs distributed_optimizer.
  bool shard_grads = false;
  // Parameters sharded too (ZeRO-3; optim_grads_params): needs shard_grads.
  bool shard_params = false;
  // With shard_grads: the reductions in flight before a new buffer waits for
  // the oldest instead of growing the pool (on the CPU's transports; a GPU's
  // stream-ordered ones are retired without the host waiting).
  int max_in_flight = 2;
  // --grad-reduce-dtype: F32, or BF16 (rounded, reduced and sent as bf16).
  DType reduce_dtype = DType::F32;
  // --grad-compression, --powersgd-rank and --powersgd-start-iter (the steps
  // before it reduce uncompressed); plain data parallelism only.
  GradCompression compression = GradCompression::None;
  int powersgd_rank = 4;
  int64_t powersgd_start_iter = 0;
  // --optimizer: AdamW (the adam config), SGD or Lion with these settings.
  // The distributed optimizer shards the state of each.
  OptimizerKind optimizer = OptimizerKind::Adam;
  SgdConfig sgd;
  LionConfig lion;
};

// "fp32" -> F32, "bf16" -> BF16; throws Error naming the value and the choices.
DType parse_grad_reduce_dtype(const std::string& name);

// ShardingStrategy, parse_sharding_strategy: weft/sharding.h.
// Throws Error naming the flags and values of impossible options: a bucket
// size or PowerSGD rank below 1, a negative PowerSGD start, a reduce dtype
// other than F32 or BF16, PowerSGD with the distributed optimizer or with a
// bf16 reduction. Every replica reaches the same verdict from the options alone.
void check_grad_sync_options(const GradSyncOptions& options);

// The groups this rank belongs to; a null communicator is a group of one.
struct ParallelGroups {
  Communicator* tp = nullptr;
  Communicator* dp = nullptr;
  Communicator* pp = nullptr;

  int tp_rank() const { return tp ? tp->rank() : 0; }
  int dp_size() const { return dp ? dp->size() : 1; }
  int dp_rank() const { return dp ? dp->rank() : 0; }
};

class GradSync {
 public:
  // `params`: this rank's parameters. `nodes`: the graph nodes this rank
  // runs (each once per micro-batch). `late`: parameters whose gradients are
  // completed after the last W (summed across pipeline ranks that share
  // them); they are reduced in finish(). `norm_owned`: the parameters whose
  // squares this rank counts as their pipeline owner (every rank holding a
  // parameter has it, exactly one counts it).
  GradSync(const Graph& graph, std::vector<int> nodes, std::vector<Param*> params,
           std::vector<Param*> late, std::vector<Param*> norm_owned, ParallelGroups groups,
           AdamWConfig adam, GradSyncOptions options);
  ~GradSync();

  // Zeroes every gradient and arms the buckets for `micro_batches` W actions
  // of each node.
  void begin(int64_t micro_batches);
  // Node `node` is about to run its W action for micro-batch `micro_batch`
  // (0 .. micro_batches - 1): with sharded gradients, points its parameters'
  // gradients into that micro-batch's buffers (borrowed here on first use).
  // Nothing otherwise.
  void weight_begin(int node, int micro_batch);
  // Node `node` finished its W action for one micro-batch; starts every
  // bucket this completes (in bucket order; with sharded gradients, every
  // bucket it completes for this micro-batch), and lets the transport
  // progress.
  void weight_done(int node, int micro_batch = 0);
  // Starts the remaining buckets and waits for all reductions.
  void finish();

  // Sharded parameters: node `node`'s parameters are about to be read (its
  // forward, either part of its backward, or a replayed forward): waits for
  // the gathers of their buckets (posting the ones not yet posted), and
  // posts the gathers of `next`'s (the node whose action follows, or -1).
  // Nothing otherwise. Every replica calls it in the same order.
  void gather(int node, int next = -1);

  // Multiplies the gradients the update will read by `s`: every gradient, or
  // with the distributed optimizer this replica's reduced slices (after
  // finish). fp16's unscaling.
  void scale_grads(float s);

  // Global L2 norm of the reduced gradients (collective over tp, dp and pp):
  // grad_norm_squared's sum, read back (on a GPU the host waits for it).
  double grad_norm();
  // The norm's square into `out` (one F32 element on the parameters'
  // device), summed over the groups there: over NCCL the host neither waits
  // nor reads it.
  void grad_norm_squared(const Tensor& out);
  // AdamW (or SGD): plain, on every parameter; distributed, on this
  // replica's slice, followed by the all-gather of the parameters. Each
  // gradient is read times grad_scale: clipping (clip_coefficient) folded
  // into the update, with the bits of scaling the gradients first.
  void step(float lr, float grad_scale = 1.0f);
  // The same with grad_scale on the device (ops::clip_coefficient's).
  void step(float lr, const Tensor& grad_scale);

  // Local SGD's averages (TrainOptions::local): sums over the data-parallel
  // replicas what the caller wrote into the gradients (Param::grad), every
  // bucket at once, as the step's reduction would: in the reduce dtype, and,
  // with `compress` and PowerSGD on (past its start step), as PowerSGD
  // factors with error feedback. Plain data parallelism only; returns this
  // rank's bytes (ring shares).
  double reduce_written(bool compress);

  const std::vector<Param*>& params() const { return params_; }
  bool distributed() const { return options_.distributed_optimizer && groups_.dp_size() > 1; }
  bool sharded_grads() const { return distributed() && options_.shard_grads; }
  bool sharded_params() const { return sharded_grads() && options_.shard_params; }
  // The parameters whose values are whole on this rank between actions:
  // all of them, but with sharded parameters only the tied ones.
  const std::vector<Param*>& whole_params() const { return whole_params_; }
  // Every parameter's value (this rank's tensor-parallel piece), whole, on
  // the parameters' device, in params() order: with sharded parameters
  // gathered from the replicas (collective over dp), else copies.
  std::vector<Tensor> whole_values();
  // Off: the next steps' gradients are not reduced across replicas (and
  // PowerSGD's state is left alone): for evaluation, whose gradients are
  // thrown away. Every replica must agree.
  void set_reduce(bool reduce) { reduce_ = reduce; }
  int64_t steps() const { return steps_; }
  void set_steps(int64_t s);

  // The optimizer's state per parameter ("<name><suffix>", the rule's
  // suffixes: AdamW's ".exp_avg" and ".exp_avg_sq"), this rank's
  // tensor-parallel piece of each, whole across data parallelism
  // (collective over dp when distributed).
  std::vector<std::pair<std::string, Tensor>> optimizer_state();
  // Sets the state from tensors shaped as optimizer_state() returns them.
  void load_optimizer_state(const std::vector<std::pair<std::string, Tensor>>& state);

  // What this replica writes of a checkpoint: elements [lo, hi) of the piece
  // params()[param] holds. Every bucket is cut into dp equal slices (the
  // distributed optimizer's), and replica r writes slice r, whether the
  // optimizer is distributed or not: each element once over the replicas.
  struct OwnedSlice {
    size_t param = 0;
    int64_t lo = 0, hi = 0;
  };
  std::vector<OwnedSlice> owned_slices() const;
  // The state `which` (an index into the rule's suffixes) of one owned
  // slice, copied to the host.
  Tensor state_slice(const OwnedSlice& s, size_t which) const;
  // Sets the state from a reader that fills `dest` (hi - lo fp32 on the
  // host) with elements [lo, hi) of params()[param]'s piece of state `which`.
  // The distributed optimizer asks only for its own slices.
  using StateReader =
      std::function<void(size_t param, size_t which, int64_t lo, int64_t hi, const Tensor& dest)>;
  void load_optimizer_state(const StateReader& read);
  // Elements [lo, hi) of the value of params()[s.param], on the host; with
  // sharded parameters only this replica's slices (owned_slices()).
  Tensor value_slice(const OwnedSlice& s) const;
  // Sets the values from a reader that fills `dest` (hi - lo fp32 on the
  // host) with elements [lo, hi) of params()[param]'s piece: with sharded
  // parameters only this replica's slices (and tied ones whole), else
  // every value whole.
  using ValueReader = std::function<void(size_t param, int64_t lo, int64_t hi, const Tensor& dest)>;
  void load_values(const ValueReader& read);

  // What the last step moved and waited for.
  struct Stats {
    int buckets = 0;
    int collectives = 0;          // reductions posted (PowerSGD posts two per bucket)
    int started_in_backward = 0;  // buckets started before finish(): overlapped
    double bytes_sent = 0;      // this rank's share of the data-parallel traffic
    double wait_ms = 0;         // time finish() spent waiting: communication not hidden
                                // (and, compressed, the decompression done there)
    double reduce_ms = 0;       // from the first bucket's start to the last one's end
    // Sharded parameters: the buckets gathered, and of those the ones posted
    // ahead (while the node before computed).
    int gathers = 0, prefetched = 0;
  };
  const Stats& stats() const { return stats_; }

  // The bytes this rank keeps for its parameters' training state, on their
  // device: the values, the gradients between steps (whole, or with sharded
  // gradients this replica's slices and tied parameters' whole buffers), the
  // most the pool of micro-batch buffers has held (sharded gradients only; it
  // grows to its peak in the first step and keeps it), and the optimizer's
  // state (whole, or the distributed optimizer's slices).
  // With sharded parameters, values are this replica's slices (and tied
  // parameters' whole buffers) and value_buffers the gathered buckets' pool
  // at its most (with their bf16 halves).
  struct Memory {
    double values = 0, value_buffers = 0, grads = 0, grad_buffers = 0, state = 0;
    double total() const { return values + value_buffers + grads + grad_buffers + state; }
  };
  Memory memory() const;

 private:
  struct Bucket;
  void launch(Bucket& b);
  void post(Bucket& b);  // posts the bucket's reduction (its first, with PowerSGD)
  void complete();       // PowerSGD's second round, then waits for and unpacks every bucket
  void launch_ready();
  void poll();
  // Posts a reduction of `t` (all-reduce, or reduce-scatter into `out`) and counts its bytes.
  RequestPtr reduce(const Tensor& t, const Tensor* out);
  // PowerSGD's second all-reduce of every compressed bucket, in bucket order.
  void launch_second_round();
  // Turns a bucket's reduced message back into fp32 gradients.
  void unpack(Bucket& b);

  ParallelGroups groups_;
  GradSyncOptions options_;
  AdamWConfig adam_;
  std::unique_ptr<UpdateRule> rule_;  // the optimizer's update, on ZeRO-1's slices
  size_t state_count_ = 0;            // its state tensors per parameter
  std::vector<Param*> params_;
  std::vector<std::unique_ptr<Bucket>> buckets_;
  std::vector<std::vector<int>> node_params_;  // node -> indices into params_
  std::vector<int> bucket_of_;                 // param index -> bucket
  std::vector<int64_t> remaining_;             // param index -> W actions to go
  std::vector<char> norm_counts_;              // param index -> counted in the norm
  std::vector<int> nodes_per_param_;
  size_t next_launch_ = 0;
  int64_t steps_ = 0;
  std::unique_ptr<Optimizer> plain_;  // when not distributed
  Stats stats_;
  std::chrono::steady_clock::time_point first_launch_;
  bool launched_any_ = false;
  bool in_finish_ = false;
  bool reduce_ = true;  // set_reduce
  bool compressing_ = false;  // PowerSGD this step
  Tensor norm_sq_;  // grad_norm's sum, on the parameters' device
  void update(float lr, float grad_scale, const Tensor& grad_scale_at);

  // Sharded gradients: one bucket's buffer for one micro-batch, from its
  // first W to the end of its reduction.
  struct Open {
    int bucket = -1, micro_batch = -1;
    int pending = 0;  // W actions on the bucket still to run for this micro-batch
    int buffer = -1;  // index into pool_
    RequestPtr request;
    int64_t posted = -1;  // its place in the order of posting, once posted
  };
  struct PoolBuffer {
    Tensor grad;   // (largest padded bucket): the micro-batch's gradients
    Tensor shard;  // (its slice): this replica's part of their sum
    Tensor grad16, shard16;  // the same as bf16, for a bf16 reduction (host memory)
    bool busy = false;
    std::vector<Tensor> views;  // per parameter index: its gradient in `grad`, once made
  };
  bool sharded(const Bucket& b) const;
  // Parameter `param`'s gradient inside pool buffer `buffer` (made once).
  const Tensor& grad_view(int buffer, int param);
  std::vector<int64_t> offset_of_;  // param index -> its first element in its bucket
  Open& open_for(int bucket, int micro_batch);
  int borrow();
  void post_open(Open& o);
  // The oldest posted buffer, if its reduction is done (or, with `wait`,
  // once it is): adds its slice to its bucket's and returns it to the pool.
  // Buffers retire in the order they were posted, so each bucket adds its
  // micro-batches in order. False when there is none to retire.
  bool retire_oldest(bool wait);
  // Sharded parameters: a pool buffer holding one bucket's gathered values.
  struct Gathered {
    Tensor value;    // (largest padded bucket), fp32
    Tensor value16;  // the same rounded to bf16, with bf16 activations
    int bucket = -1;
    RequestPtr request;  // the gather, until waited for
    bool rounded = false;
    int64_t used = 0;                    // when a node last needed it
    std::vector<Tensor> views, views16;  // per parameter index, once made
  };
  bool params_sharded(const Bucket& b) const;
  // Parameter `param`'s value inside gathered buffer `buffer` (its bf16
  // half with `half`), made once.
  const Tensor& gathered_view(int buffer, int param, bool half);
  bool pinned(int bucket, int node, int next) const;
  int free_gathered(int node, int next);
  // Makes bucket `bucket` resident (posting its gather) and, with `wait`,
  // waits for it and rounds it.
  void resident(int bucket, int node, int next, bool wait);
  // Waits for every gather in flight and forgets what the buffers hold
  // (the values are about to change).
  void drop_gathered();
  const Graph* graph_;
  std::vector<Param*> whole_params_;
  std::vector<Gathered> gathered_;
  std::vector<int> resident_;                   // bucket -> its buffer, or -1
  std::vector<std::vector<int>> node_buckets_;  // node -> its sharded-parameter buckets
  size_t gathered_cap_ = 0;
  int64_t clock_ = 0;
  bool bf16_ = false;       // the graph's activations are bf16
  std::vector<Open> open_;  // in the order they were opened; reused
  std::vector<PoolBuffer> pool_;
  std::vector<int> per_micro_batch_;  // bucket -> W actions on it per micro-batch
  int64_t pool_elements_ = 0;         // elements of each pool buffer's `grad`
  int64_t posts_ = 0;
  std::shared_ptr<void> scale_cache_;
  // grad_norm's and clip's gradient lists and device tables, kept between steps.
  GradTables tables_;
};

}  // namespace weft
