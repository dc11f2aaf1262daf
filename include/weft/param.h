// weft/param.h — named parameters, their gradients and how they start.
//
// A parameter is named as in Hugging Face GPT-2 ("h.0.attn.c_attn.weight"),
// and its initial value is a function of (seed, name) only: every parallel
// layout, which generates the full tensor and then keeps its own slice, starts
// from the same model.
#pragma once

#include <weft/tensor.h>

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

namespace weft {

struct Init {
  enum class Kind : uint8_t { Normal, Constant } kind = Kind::Normal;
  float value = 0.02f;  // standard deviation for Normal, the value for Constant

  static Init normal(float std) { return {Kind::Normal, std}; }
  static Init constant(float v) { return {Kind::Constant, v}; }
};

// How the tensor a rank holds relates to the full parameter under tensor
// parallelism. Dimension `dim` of the full tensor is packed blocks of the
// widths `blocks` (empty: one block, the whole dimension; {C, C, C} for GPT's
// q|k|v projection, {H D, G D, G D} for grouped-query attention's), and each
// block is cut into `parts` equal pieces; this rank holds piece `index` of
// every block, concatenated in block order. dim = -1 means the whole tensor
// (replicated across the group).
struct Shard {
  int dim = -1;
  int parts = 1;
  int index = 0;
  std::vector<int64_t> blocks;
  Shape full;  // the full tensor's shape (set for every parameter)

  bool split() const { return dim >= 0 && parts > 1; }
  // The widths of the blocks along dim (one block when `blocks` is empty).
  std::vector<int64_t> block_widths() const;
  // The shape this rank holds.
  Shape local() const;
};

// `count` equal blocks of a dimension `extent` wide (count must divide it).
std::vector<int64_t> equal_blocks(int64_t extent, int count);

struct Param {
  std::string name;
  Tensor value;  // fp32, owned; this rank's part (see shard)
  Tensor grad;   // same shape; accumulated by backward_weight
  Init init;
  Shard shard;  // whole by default
  // A vocabulary table padded to more rows than there are tokens (Megatron's
  // --make-vocab-size-divisible-by): rows true_rows.. of the full tensor are
  // padding. They are zero from initialisation on and stay zero (no token
  // reads them and their logits are masked, so their gradients are zero), and
  // files hold only the true rows. 0: every row is real.
  int64_t true_rows = 0;
  // bf16 activations: value rounded to bf16, for the GEMMs of one batch's
  // forward and backward (a GEMM of two bf16 operands is cuBLAS's own; a
  // bf16 and an fp32 one would widen) and the biases their epilogues add. Made when the batch starts and
  // dropped (undefined) when it ends, before anything changes value, so it
  // is never stale; value16_store keeps its memory from batch to batch.
  Tensor value16, value16_store;
  // PyTorch/Megatron convention: decay matrices and embeddings, not biases or norms.
  bool weight_decay() const { return value.rank() >= 2; }
};

// What a GEMM multiplies p by when its other operand has dtype `other`: the
// bf16 copy for a BF16 operand while the batch has one, else value. Either
// gives the same product: --bf16's GEMMs round their fp32 operands to bf16.
inline const Tensor& gemm_operand(const Param& p, DType other) {
  return other == DType::BF16 && p.value16.defined() ? p.value16 : p.value;
}

// The full tensor's rows that are real: shard.full[0], or true_rows when padded.
int64_t real_rows(const Param& p);
// The shape a file holds for p: the full tensor without its padding rows.
Shape file_shape(const Param& p);
// The padded full tensor (shape p.shard.full) from one without padding
// (file_shape(p)): the rows copied, the padding zero. And back: the real rows
// of a padded full tensor, as a view.
Tensor pad_rows(const Param& p, const Tensor& real);
Tensor unpad_rows(const Param& p, const Tensor& full);

// Owns parameters at stable addresses; layers keep Param*.
class ParamStore {
 public:
  Param* create(const std::string& name, Shape shape, Init init);
  // A parameter holding part `shard` of a full tensor of shape shard.full.
  Param* create_shard(const std::string& name, Shard shard, Init init);
  Param* find(const std::string& name);
  const Param* find(const std::string& name) const;
  std::vector<Param*> all();
  size_t size() const { return params_.size(); }

 private:
  std::deque<Param> params_;
};

// Copies this rank's part of `full` (shape s.full) into `part` (shape
// s.local()), and back: the two are exact inverses on a rank's piece. Either
// side may be on a GPU (copied through the host after its queued work).
void slice_shard(const Tensor& full, const Shard& s, const Tensor& part);
void place_shard(const Tensor& part, const Shard& s, const Tensor& full);

// The contiguous runs a rank's part is made of, in order: elements
// [part, part + n) of the part are elements [full, full + n) of the full
// tensor (row-major). Both offsets increase from run to run.
struct ShardRun {
  int64_t full = 0, part = 0, n = 0;
};
std::vector<ShardRun> shard_runs(const Shard& s);

// Fills p.value from (seed, p.name, p.init); independent of everything else.
// A shard gets its piece of the full tensor, so every layout starts alike.
// Padding rows (true_rows) are zero; the real rows get the numbers the
// unpadded tensor would (element i of the full tensor is counter i either way).
void init_param(Param& p, uint64_t seed);

// Moves each parameter's value to `device` (a copy) and gives it a zero
// gradient there. Parameters are initialised and loaded on the host, then
// placed; a no-op for those already there.
void place_params(const std::vector<Param*>& params, Device device);
// Deterministic standard normals from (seed, name): element i of the tensor
// named `name` is the same number whatever slice of it a rank generates.
void normal_fill(float* out, int64_t n, uint64_t seed, const std::string& name, float std);

}  // namespace weft
