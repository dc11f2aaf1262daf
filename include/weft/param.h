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

struct Param {
  std::string name;
  Tensor value;  // fp32, owned
  Tensor grad;   // same shape; accumulated by backward_weight
  Init init;
  // PyTorch/Megatron convention: decay matrices and embeddings, not biases or norms.
  bool weight_decay() const { return value.rank() >= 2; }
};

// Owns parameters at stable addresses; layers keep Param*.
class ParamStore {
 public:
  Param* create(const std::string& name, Shape shape, Init init);
  Param* find(const std::string& name);
  const Param* find(const std::string& name) const;
  std::vector<Param*> all();
  size_t size() const { return params_.size(); }

 private:
  std::deque<Param> params_;
};

// Fills p.value from (seed, p.name, p.init); independent of everything else.
void init_param(Param& p, uint64_t seed);
// Deterministic standard normals from (seed, name): element i of the tensor
// named `name` is the same number whatever slice of it a rank generates.
void normal_fill(float* out, int64_t n, uint64_t seed, const std::string& name, float std);

}  // namespace weft
