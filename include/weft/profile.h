// weft/profile.h — measuring what each node of a graph costs on this machine.
//
// The partitioner's `time` method balances a CostModel; profile_costs fills
// one with measured seconds for every node's F, I and W (the median of a few
// runs of one micro-batch), and the analytic model's bytes. Both profilers
// run on the device that holds the graph's parameters (a Trainer places them
// on its device): the CPU, or a GPU, where SpanTimer reads CUDA events
// (`bench_cuda --profile` prints that breakdown).
//
// `train_gpt --profile FILE` writes profile_json: the node costs and, for the
// plan it chose, their sums per stage, which `weft-sched simulate --costs FILE`
// reads to time any schedule of the same stages on this machine.
#pragma once

#include <weft/partition.h>
#include <weft/schedule.h>
#include <weft/trainer.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace weft::cuda {
class TimingEvents;
}

namespace weft {

// Spans of one device's work, timed as that device does it. On the CPU, the
// host clock around the call (CPU kernels have finished when they return).
// On a GPU, a pair of CUDA events on the compute stream around the work the
// call queued, all read after one wait at the end (take()), so that timing
// neither stalls the host between spans, nor counts the host's launch time
// as the GPU's. A GPU span includes any time the GPU sat idle inside it
// waiting for the host (a node whose kernels are short is launch-bound, and
// that shows). Throws Error for a GPU in a build without CUDA.
class SpanTimer {
 public:
  explicit SpanTimer(Device device);
  ~SpanTimer();
  SpanTimer(const SpanTimer&) = delete;
  SpanTimer& operator=(const SpanTimer&) = delete;

  // Times `work` as the next span.
  template <typename F>
  void time(F&& work) {
    begin();
    work();
    end();
  }
  void begin();
  void end();
  // Seconds of every span since the last take(), in the order they began
  // (waits for the device); the next span is span 0 again.
  std::vector<double> take();
  // The same spans as (start, end) in seconds from span 0's start, on the
  // device's clock (waits for the device); the next span is span 0 again.
  std::vector<std::pair<double, double>> take_intervals();

 private:
  Device device_;
  bool open_ = false;
  std::vector<std::chrono::steady_clock::time_point> host_;  // CPU: begin, end, begin, ...
  // GPU: marks 2s and 2s + 1. Shared, so that a build without CUDA never
  // instantiates its destructor (which only a CUDA build defines).
  std::shared_ptr<cuda::TimingEvents> events_;
  size_t marks_ = 0;
};

// The one device every parameter of `params` is on (the CPU when there are
// none); throws Error naming two parameters on different devices.
Device params_device(const std::vector<Param*>& params);

CostModel profile_costs(const Graph& g, const ModelIO& io, const BatchSource& data,
                        int64_t micro_batch, int repeats = 3);

// Whether each node's output is whole on every tensor-parallel rank (true)
// or split among them: a column-parallel linear splits its output, a
// row-parallel one all-reduces it whole, and any other node's output is
// split exactly when one of its inputs is (attention and the activations
// between the MLP's GEMMs follow the column-parallel GEMM before them; norms,
// residual adds and the embedding read whole tensors).
std::vector<bool> tp_whole_outputs(const Graph& g);

// {"unit": "seconds", "nodes": [{"name", "f", "i", "w", "param_bytes", ...,
// "tp_whole"}]}; tp_whole from tp_whole_outputs.
nlohmann::json cost_model_json(const CostModel& cost, const Graph& g);

// Seconds, per stage of `plan`, that a training step spends on the stage's
// parameters once its pipeline has drained: zeroing the gradients, their
// norm, and the AdamW step with the clip (profile_update's parts, each the median
// of `repeats`, summed). Times the real parameters with zero gradients and
// learning rate 0, which leaves them as they were; it zeroes their gradients.
std::vector<double> profile_updates(const Graph& g, const StagePlan& plan, int repeats = 3);

// profile_updates' parts for one set of parameters, each the median of
// `repeats` (seconds): zeroing the gradients, their norm (which the host
// waits for), and AdamW with a clip's coefficient, as an active clip runs
// it (the clip is no pass of its own: AdamW reads each gradient scaled).
struct UpdateCosts {
  double zero = 0, norm = 0, adamw = 0;
  double total() const { return zero + norm + adamw; }
};
UpdateCosts profile_update(const std::vector<Param*>& params, int repeats = 3);

// A plan's costs per stage, in stage order (one micro-batch, seconds and bytes):
// {"pp", "chunks", "partition", "stages": [{"stage", "rank", "first", "last",
//  "nodes", "f", "i", "w", "update", "boundary_bytes", "stash_bytes"}]}.
// f, i and w sum the stage's nodes; update is `update[stage]` (0 when not
// given); boundary_bytes is what the stage sends forward (every value
// produced up to its end and read after it, as the executor sends them; the
// gradient back is as large); stash_bytes sums its nodes' activation_bytes,
// held from F until I and W. With `memory` (measure_stage_bytes, one per
// stage) each stage also gets "memory": {"recv_f", "f", "recv_b", "i", "w",
// "f_work", "i_work", "i_keep", "i_work_above"}, the bytes each action adds, and the object
// gets "recompute".
nlohmann::json stage_costs_json(const CostModel& cost, const StagePlan& plan, const Graph& g,
                                const std::vector<double>& update = {},
                                const std::vector<sched::StageBytes>& memory = {},
                                bool recompute = false);

// Times the updates (profile_updates), then writes cost_model_json and
// stage_costs_json in one object to `path`, with the fields of `extra`
// (train_gpt adds the micro-batch size and the model's shape, which
// weft-sched plan reads).
void write_profile(const std::string& path, const CostModel& cost, const StagePlan& plan,
                   const Graph& g, const std::vector<sched::StageBytes>& memory = {},
                   bool recompute = false, const nlohmann::json& extra = {});

}  // namespace weft
