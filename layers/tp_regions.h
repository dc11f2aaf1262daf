// The conjugate pairs every tensor-parallel layer is made of (Megatron's
// mappings): each is one collective in one direction and the identity in the
// other, so forward and backward stay each other's transpose.
//
//   copy_to_tp      (Megatron's f)  forward: identity       backward: all-reduce
//   reduce_from_tp  (Megatron's g)  forward: all-reduce     backward: identity
//
// A column-parallel Linear is f then a local matmul (its output is this rank's
// slice); a row-parallel Linear is a local matmul then g. With a group of one
// every collective is skipped: tp = 1 runs the same code.
//
// Gradients accumulate (+=, see weft/layer.h), so f's backward cannot reduce
// the caller's buffer in place: it may already hold another consumer's
// contribution, which every rank has whole and must be counted once. The
// partial gradient goes to a buffer of its own, is reduced, then added:
//
//   Tensor part = copy_to_tp_grad_buffer(group, arena, dx);  // zeros, or dx at tp = 1
//   ... this rank's share of dx += into part ...
//   copy_to_tp_backward(group, part, dx);                     // dx += sum over ranks
//
// Sequence parallelism (Megatron's --sequence-parallel) replaces both with a
// split along the tokens outside the regions: norms, residual adds and the
// loss's input each hold 1/tp of the tokens on every rank.
//
//   SequenceParallel::gather   (enters)  forward: all-gather      backward: reduce-scatter
//   SequenceParallel::scatter  (leaves)  forward: reduce-scatter  backward: all-gather
//
// Of a micro-batch's N = B x T token rows (a row-major (B, T, C) value),
// rank r holds rows [r N/tp, (r + 1) N/tp), under the shape (B, T/tp, C).
// With B = 1 that is Megatron's split of the sequence. With B > 1 a rank's
// rows are consecutive tokens of the flattened batch: every layer outside a
// region works token by token and treats them alike, and the collectives
// move them with no copy (Megatron lays its values out (T, B, C) for the
// same reason).
#pragma once

#include <weft/arena.h>
#include <weft/communicator.h>
#include <weft/tensor_parallel.h>

#include <array>
#include <memory>
#include <optional>

namespace weft {

// --- f: a replicated input enters a tensor-parallel region ---

// x (any shape) is already whole on every rank: nothing to do.
inline void copy_to_tp_forward(Communicator& /*group*/, const Tensor& /*x*/) {}
// Where this rank's partial gradient of x goes: `dx` itself in a group of
// one, otherwise zeros of dx's shape from `arena`.
Tensor copy_to_tp_grad_buffer(Communicator& group, Arena& arena, const Tensor& dx);
// dx += sum over the group of every rank's `part` (part is reduced in place).
void copy_to_tp_backward(Communicator& group, const Tensor& part, const Tensor& dx);

// --- g: partial results leave the region as one replicated value ---

// y (any shape) = sum over the group of every rank's partial y, in place; every
// rank gets the same bits.
void reduce_from_tp_forward(Communicator& group, const Tensor& y);
// dy is the same on every rank, and each rank's partial y had gradient dy.
inline void reduce_from_tp_backward(Communicator& /*group*/, const Tensor& /*dy*/) {}

// --- sequence parallelism ---

// The whole-sequence tensors that live within one call of a layer (a
// gathered input, a partial output before its reduce-scatter): one set per
// rank's graph, shared by its layers in turn, so that nothing whole stays
// alive between actions. A layer that needs a whole input again (for a
// weight gradient) gathers it again, as Megatron does. Slots 0 and 1 hold
// whole tensors, slot 2 a slice; each keeps its memory (grown to the largest
// request, which the first step makes), and a tensor from a slot is valid
// until the next request for that slot. On a GPU the slots are reused in the
// compute stream's order, which the collectives keep (weft/communicator.h).
class SequenceScratch {
 public:
  static constexpr int kWholeA = 0, kWholeB = 1, kSlice = 2;
  Tensor get(int slot, const Shape& shape, DType dtype, Device device);

 private:
  std::array<Tensor, 3> owned_;
};

struct SequenceParallel {
  Communicator* group = nullptr;
  std::shared_ptr<SequenceScratch> scratch;

  // (B, T/tp, ...) from (B, T, ...) and back; throw Error naming the shape
  // when T does not divide.
  Shape slice_shape(const Shape& whole) const;
  Shape whole_shape(const Shape& slice) const;

  // The group's slices of `x` in rank order: a whole tensor in scratch
  // `slot` (forward of a region's entry, and again for a weight gradient).
  Tensor gather(const Tensor& x, int slot) const;
  // dx += this rank's rows of the group's sum of `part` (whole): the
  // entry's backward. With `write`, dx is overwritten instead (a fresh
  // buffer, LayerCtx::fresh_grads_in).
  void gather_backward(const Tensor& part, const Tensor& dx, bool write) const;
  // y = this rank's rows of the group's sum of `partial` (whole): a
  // region's exit.
  void scatter(const Tensor& partial, const Tensor& y) const;
  // A whole tensor of the slice `like`'s shape times tp, in scratch `slot`,
  // for a partial result to scatter.
  Tensor whole(const Tensor& like, int slot) const;
};

// A parallel layer's sequence-parallel form, when its graph has one
// (TpBuild::sequence); marks the build as taken.
std::optional<SequenceParallel> sequence_parallel(TpBuild& build);

}  // namespace weft
