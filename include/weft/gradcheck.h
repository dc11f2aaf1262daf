// weft/gradcheck.h — a layer's backward against finite differences of its
// own forward: the check every layer of weft passes (tests/test_layers.cc),
// for a layer of yours.
//
//   Scale scale(0.5f);
//   const weft::GradCheck r = weft::check_gradients(scale, {x});
//   if (!r.ok()) fmt::print("{}\n", r.describe());
#pragma once

#include <weft/layer.h>
#include <weft/tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace weft {

struct GradCheck {
  // What disagreed most: "input i" or a parameter's name; empty when the
  // layer has nothing to differentiate.
  std::string worst;
  double rel_error = 0;  // its ||analytic - numeric|| / ||numeric||
  // Elements, over every input and parameter, whose analytic gradient is
  // off by more than 5e-4 + 5e-3 |analytic|.
  int64_t bad = 0;
  // What was compared, as "input 0 (N elements), w (M elements), ...".
  std::string compared;
  // fp32 forwards differenced at eps = 1e-2 agree with a correct backward to
  // well inside these bounds (the loss of each difference quotient is
  // rounded once in double from fp32 outputs), while a term missing from a
  // gradient, even a few percent of it, falls outside.
  bool ok() const { return bad == 0 && rel_error < 2e-3; }
  std::string describe() const;
};

// Runs `layer` on `inputs` (host tensors: F32 ones are differentiated, the
// others, such as token ids, are held fixed): forward, backward_input and
// backward_weight, for L = sum_k r_k . out_k with fixed uniform r_k drawn
// from `seed`, and compares the gradient of each F32 input and of each
// parameter (initialised by the caller; their gradients are overwritten)
// with central differences of L at step `eps`. Throws Error where the layer
// does (a shape it refuses).
GradCheck check_gradients(Layer& layer, const std::vector<Tensor>& inputs, uint64_t seed = 1,
                          double eps = 1e-2);

}  // namespace weft
