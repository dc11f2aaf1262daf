// weft/plan.h — choosing a layout before running one.
//
// plan() searches every way to run a model on `world` ranks: data, pipeline
// and tensor parallel sizes (dp x pp x tp = world), the schedule and its
// model chunks per rank, the micro-batch size, activation recompute and
// the data-parallel sharding (--data-parallel-sharding-strategy: none,
// ZeRO-1's optimizer state, ZeRO-2's gradients too). It refuses what train_gpt would
// refuse (layout_rule: the same rules, in the same words) and what does not
// fit the memory per rank (sched::memory_use over the schedule, plus the
// weights, gradients and AdamW state), times the rest with the simulator,
// and ranks them by predicted step time.
//
//   PlanInput in;
//   in.shape = {.layers = 48, .hidden = 1600, .heads = 25, .seq = 1024, .vocab = 50304};
//   in.global_batch = 512;
//   in.machine = {.world = 64, .memory = 141e9, ...};
//   in.costs = flops_costs(in.shape, 989e12 * 0.4, 4.8e12);   // or profile_costs(json)
//   for (const Plan& p : plan(in).plans) ...
//
// The cost model, per stage of a candidate: F, I and W are the summed costs
// of its layers (LayerCosts, for one sequence) times the micro-batch size,
// the split part divided by tp and the replicated part (norms, residual
// adds, the embedding) not; plus tp's all-reduces of the micro-batch's
// activations (two per layer in F and two in I, as Megatron's tensor
// parallelism does, and the embedding's and the head's), which wait without
// a core (SimCost::f_wait, i_wait). An all-reduce over n ranks costs
// 2 ceil(log2 n) rounds of (latency + machine.wake) and 2 (n - 1) / n of its
// bytes over the bandwidth. A message between pipeline ranks costs latency
// + bytes / bandwidth (plus a wake when its receiver waited); after the
// pipeline, the gradients are all-reduced over dp (ZeRO-1: reduce-scattered
// and the parameters all-gathered, the same bytes; ZeRO-2: reduce-scattered
// once per micro-batch, M times, then all-gathered), then each rank updates
// its share (1/dp of it with ZeRO-1 or 2). Memory per rank, P the fp32
// bytes of a rank's parameters: P values, P gradients and 2P of AdamW's
// moments; ZeRO-1 keeps the moments' 1/dp and, beside the whole gradients,
// their reduced 1/dp; ZeRO-2 keeps the gradients' 1/dp (weights tied
// across pipeline stages whole) and a pool of 4 buffers of the largest
// gradient bucket (2^20 elements, or the largest tensor if larger) and
// their slices, as weft/grad_sync.h runs them. Processes share `machine.cores` when
// it is set (dp x tp processes per pipeline rank; see SimCost::cores).
//
// Sequence parallelism (weft/tensor_parallel.h): the outputs every tp rank
// held whole, and the work of the norms and residual adds of the blocks and
// the final norm, are split too (the embedding's lookup is not: each rank
// writes its whole partial sum before the reduce-scatter); the pipeline
// messages are 1/tp; each all-reduce becomes a reduce-scatter and an
// all-gather of the same total, and W gathers again what it needs whole
// (per block: the attention's input, its projection's and the MLP's output
// gradients, the MLP's input; the head's input): half an all-reduce each,
// waited without a core. The whole partial input gradients go to three
// shared buffers (two whole activations and a slice), counted once per rank
// rather than per micro-batch.
#pragma once

#include <weft/simulate.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace weft::plan {

// A GPT-2 shaped decoder (Megatron's flag names in train_gpt).
struct ModelShape {
  int64_t layers = 0;  // --num-layers
  int64_t hidden = 0;  // --hidden-size
  int64_t heads = 0;   // --num-attention-heads
  int64_t seq = 0;     // --seq-length
  int64_t vocab = 0;   // --vocab-size
  // Parameters: 12 h^2 + 13 h per layer, the tied embedding V h, positions T h.
  double params() const;
};

// What one layer (and the parts before and after the layers) costs for one
// sequence at tp 1: seconds and bytes.
struct PartCosts {
  double f = 0, i = 0, w = 0;
  double param_bytes = 0;
  double stash_bytes = 0;  // activations F keeps until I and W are done: the nodes' outputs
  // Of f, i and w: what every tensor-parallel rank computes whole rather
  // than a 1/tp share of (norms, residual adds, the embedding's lookup).
  double rf = 0, ri = 0, rw = 0;
  // Of stash_bytes: the outputs every tensor-parallel rank holds whole (the
  // profile's "tp_whole": norms, residual adds, row-parallel GEMMs' outputs
  // after their all-reduce, the embedding's); the rest is split.
  double whole_stash_bytes = 0;
  // What F holds beyond the outputs (attention's probabilities, the loss's,
  // the norms' statistics), split among tensor-parallel ranks (by heads, by
  // vocabulary): the profile's measured bytes per stage less its outputs.
  double kept_bytes = 0;
  // Column-parallel GEMMs (the profile's linear nodes whose output is split).
  // Under tensor parallelism each one's input gradient is summed over the
  // ranks from a partial one: I holds one more whole activation per GEMM.
  double column_gemms = 0;
};
struct LayerCosts {
  PartCosts layer;        // one transformer block (the mean over the profiled blocks)
  PartCosts pre, post;    // embedding; final norm and LM head with the loss
  double boundary_bytes = 0;  // a block's output, what crosses a stage boundary
  double input_grad_ratio = 1;  // bytes I keeps per byte F stashed (StageBytes::i / f)
  double update_per_param_byte = 0;  // seconds of the update (norm, clip, AdamW)
  // Bytes kept beside each byte of fp32 weights: bf16 activations' copies of
  // the weights for the GEMMs (Bf16Copies), 0.5; else 0.
  double weight_copy_ratio = 0;
  double compute_scale = 1;          // times every F, I and W (a calibration)
};

// From a train_gpt --profile file: its "nodes" (F, I, W, param and
// activation bytes of every graph node, seconds), grouped into the blocks
// "h.N.*" and what comes before and after them, divided by the
// "micro_batch_size" it was profiled at. Throws weft::Error naming the file
// and what is missing.
LayerCosts profile_costs(const nlohmann::json& profile, const std::string& path);

// What the engine computes in, for flops_costs: the activations between
// nodes in fp32 (4 bytes) or bf16 (2, --bf16), and attention unfused (its
// probabilities kept, fp32) or fused (cuDNN's: the row log-sum-exp alone).
struct Recipe {
  int activation_bytes = 4;
  bool fused_attention = false;
};

// From FLOPs, where no profile exists: a block's forward is
// (24 h^2 + 4 T h) FLOPs per token, the head's 2 h V; I and W each cost
// what F does (W: the weights' part only), all at `flops_per_second` (peak
// times an assumed efficiency). Activations as GPT's graph holds them, per
// token (b the recipe's bytes per activation):
//   a block's outputs b 10 h and the MLP's hidden pair b 8 h; beyond them
//   its norms' statistics (16 bytes) and attention's probabilities (4 a T,
//   fp32) or, fused, its log-sum-exp (4 a);
//   the embedding's output b h; the final norm's b h and statistics (8),
//   the head's logits (b V, the whole vocabulary's: chunking, which caps
//   them at 256 MiB a micro-batch, is not modelled) and loss (4).
// The update streams 32 bytes per parameter at `memory_bandwidth`.
LayerCosts flops_costs(const ModelShape& shape, double flops_per_second, double memory_bandwidth,
                       Recipe recipe = {});

struct Link {
  double latency = 0;  // seconds per message
  double bandwidth = std::numeric_limits<double>::infinity();  // bytes per second
  double time(double bytes) const { return latency + bytes / bandwidth; }
};

struct Machine {
  int world = 1;
  double memory = std::numeric_limits<double>::infinity();  // bytes per rank
  Link intra;            // between ranks of one node
  Link inter;            // between nodes (defaults to intra when nodes are one)
  int ranks_per_node = 0;  // 0: all ranks on one node
  double cores = 0;      // shared cores (0: one per rank), SimCost::cores
  // Seconds a rank that waited takes to run again (SimCost::wake): after
  // every pipeline receive that waited, and after every round of an
  // all-reduce (tensor- and data-parallel).
  double wake = 0;
};

// One candidate layout. recompute and zero1 as train_gpt's --recompute and
// --use-distributed-optimizer; zero2 (with zero1) as
// --data-parallel-sharding-strategy optim_grads; zero3 (with zero2) as
// optim_grads_params; sequence_parallel as --sequence-parallel (tp > 1).
struct Layout {
  int dp = 1, pp = 1, tp = 1;
  std::string schedule = "1f1b";  // at pp 1: none is run
  int chunks = 1;
  int64_t micro_batch = 1;
  bool recompute = false;
  bool zero1 = false;
  bool zero2 = false;
  bool sequence_parallel = false;
  bool zero3 = false;
  int64_t micro_batches(int64_t global_batch) const { return global_batch / (micro_batch * dp); }
  std::string describe() const;
  // The train_gpt flags that run it.
  std::vector<std::string> flags() const;
};

// The first rule `l` breaks for train_gpt, in train_gpt's words, or "" when
// it runs: tp divides the heads and the vocabulary, dp x pp x tp = world,
// every stage gets a layer, the global batch divides into micro-batches x
// dp, the schedule runs those sizes and chunks (sched::make_schedule,
// chunks_rule), recompute has a pipeline. train_gpt checks its flags with
// this function.
std::string layout_rule(const ModelShape& shape, int64_t global_batch, int world,
                        const Layout& l);

// What the search may choose; an unset field is searched, a set one fixed
// (train_gpt --plan auto fixes the layout flags the command gives).
struct Constraints {
  std::optional<int> dp, pp, tp, chunks;
  std::optional<std::string> schedule;
  std::optional<int64_t> micro_batch;
  std::optional<bool> recompute, zero1, zero2, zero3, sequence_parallel;
  int64_t max_micro_batch = 16;
};

struct PlanInput {
  ModelShape shape;
  int64_t global_batch = 1;
  Machine machine;
  LayerCosts costs;
  Constraints fixed;
};

struct Plan {
  Layout layout;
  int64_t micro_batches = 0;  // per step and replica
  double step_time = 0;  // seconds
  double pipeline_time = 0, dp_time = 0, update_time = 0;
  double bubble = 0;            // the pipeline's idle share
  double memory_per_rank = 0;   // bytes: the most any rank holds
  double activation_bytes = 0;  // of which activations at their peak
  double bytes_per_step = 0;    // sent by all ranks together
};

struct PlanResult {
  std::vector<Plan> plans;  // feasible, fastest first
  // Candidates refused, and one example line per reason.
  int refused = 0;
  std::vector<std::pair<std::string, int>> reasons;  // first example text, count
};

// Times one layout (already checked by layout_rule).
Plan evaluate(const PlanInput& in, const Layout& l);
// Every layout the constraints allow, checked, timed and ranked. Throws
// weft::Error when the input is malformed (world < 1, no layers, ...).
PlanResult plan(const PlanInput& in);

// The ranked table as text: rank, dp, pp, tp, sequence-parallel, schedule,
// chunks, micro-batch, recompute, ZeRO stage (-, 1, 2 or 3), step, bubble,
// memory per rank, bytes per step; `top` rows at most (0: all).
std::string plan_table(const PlanResult& r, size_t top = 10);

}  // namespace weft::plan
