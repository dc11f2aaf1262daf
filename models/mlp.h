// A plain multi-layer perceptron with a squared-error loss:
//   x (B, in) -> [Linear -> GELU] x (layers-1) -> Linear -> (B, out); loss vs target.
#pragma once

#include <weft/graph.h>
#include <weft/trainer.h>

#include <memory>
#include <vector>

namespace weft {

struct MlpModel {
  std::shared_ptr<ParamStore> params;
  Graph graph;
  int input = -1;   // (B, in) fp32
  int target = -1;  // (B, out) fp32
  int loss = -1;    // (1)
  // For the Trainer and any layout: inputs {input, target}; the loss sums
  // `out` squared errors per sample.
  ModelIO io() {
    return ModelIO{&graph, {input, target}, loss, graph.values()[static_cast<size_t>(target)].shape[1]};
  }
};

// widths = {in, hidden..., out}; parameters "fc.{i}.weight" (in, out) and "fc.{i}.bias".
MlpModel build_mlp(const std::vector<int64_t>& widths, int64_t batch);

}  // namespace weft
