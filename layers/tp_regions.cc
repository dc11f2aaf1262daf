#include "layers/tp_regions.h"

#include <weft/ops.h>

#include <algorithm>

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

Tensor SequenceScratch::get(int slot, const Shape& shape, DType dtype, Device device) {
  check(slot >= 0 && slot < static_cast<int>(owned_.size()), "sequence scratch slot {}", slot);
  Tensor& t = owned_[static_cast<size_t>(slot)];
  const size_t bytes = static_cast<size_t>(shape.numel()) * dtype_size(dtype);
  if (!t.defined() || t.nbytes() < bytes || !(t.device() == device))
    t = Tensor::empty({static_cast<int64_t>(std::max<size_t>(bytes, 4) + 3) / 4}, DType::F32,
                      device);
  return Tensor(t.raw(), shape, dtype, device);
}

Shape SequenceParallel::slice_shape(const Shape& whole) const {
  const int tp = group->size();
  check(whole.rank >= 2 && whole[1] % tp == 0,
        "--sequence-parallel: the sequence ({} of shape {}) must be divisible by "
        "tensor-parallel size ({})",
        whole.rank >= 2 ? whole[1] : 0, whole.str(), tp);
  Shape s = whole;
  s[1] = whole[1] / tp;
  return s;
}

Shape SequenceParallel::whole_shape(const Shape& slice) const {
  check(slice.rank >= 2, "--sequence-parallel: a value of shape {} has no sequence", slice.str());
  Shape s = slice;
  s[1] = slice[1] * group->size();
  return s;
}

Tensor SequenceParallel::whole(const Tensor& like, int slot) const {
  return scratch->get(slot, whole_shape(like.shape()), like.dtype(), like.device());
}

Tensor SequenceParallel::gather(const Tensor& x, int slot) const {
  const Tensor w = whole(x, slot);
  group->all_gather(x, w);
  return w;
}

void SequenceParallel::gather_backward(const Tensor& part, const Tensor& dx, bool write) const {
  check_shape(part, whole_shape(dx.shape()),
              "partial gradient entering a sequence-parallel region");
  if (write) {
    group->reduce_scatter(part, dx, ReduceOp::Sum);
    return;
  }
  const Tensor mine = scratch->get(SequenceScratch::kSlice, dx.shape(), dx.dtype(), dx.device());
  group->reduce_scatter(part, mine, ReduceOp::Sum);
  ops::add(dx, mine);
}

void SequenceParallel::scatter(const Tensor& partial, const Tensor& y) const {
  check_shape(partial, whole_shape(y.shape()), "partial output leaving a sequence-parallel region");
  group->reduce_scatter(partial, y, ReduceOp::Sum);
}

std::optional<SequenceParallel> sequence_parallel(TpBuild& build) {
  if (!build.sequence) return std::nullopt;
  build.took_sequence = true;
  return SequenceParallel{build.group, build.sequence};
}

}  // namespace weft
