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
#pragma once

#include <weft/arena.h>
#include <weft/communicator.h>

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

}  // namespace weft
