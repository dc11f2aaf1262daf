#include "layers/tp_regions.h"

#include <weft/ops.h>

namespace weft {

Tensor copy_to_tp_grad_buffer(Communicator& group, Arena& arena, const Tensor& dx) {
  if (group.size() == 1) return dx;
  return arena.zeros(dx.shape(), dx.dtype());
}

void copy_to_tp_backward(Communicator& group, const Tensor& part, const Tensor& dx) {
  if (part.raw() == dx.raw()) return;  // a group of one: part is dx
  check_shape(part, dx.shape(), "partial gradient entering a tensor-parallel region");
  group.all_reduce(part, ReduceOp::Sum);
  ops::add(dx, part);
}

void reduce_from_tp_forward(Communicator& group, const Tensor& y) {
  if (group.size() > 1) group.all_reduce(y, ReduceOp::Sum);
}

}  // namespace weft
