// Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"):
// the sign of an interpolation of momentum and gradient, so every element
// moves by the learning rate; one state tensor, "<param>.exp_avg" (the
// momentum, as lion-pytorch names it). Element-wise, so a ZeRO-1 slice
// updates as its whole tensor would.
#include <weft/ops.h>
#include <weft/optimizer.h>

namespace weft {
namespace {

class LionRule final : public UpdateRule {
 public:
  explicit LionRule(const LionConfig& c) : c_(c) {}
  const char* name() const override { return "lion"; }
  std::vector<std::string> state_suffixes() const override { return {".exp_avg"}; }
  bool normalised() const override { return true; }
  void update(const std::vector<UpdatePiece>& pieces, const UpdateStep& s,
              std::shared_ptr<void>&) const override {
    for (const UpdatePiece& p : pieces)
      ops::lion(p.value, p.grad, p.state[0], s.lr, c_.beta1, c_.beta2,
                p.decay ? c_.weight_decay : 0.0f, s.grad_scale, s.grad_scale_at);
  }

 private:
  LionConfig c_;
};

}  // namespace

std::unique_ptr<UpdateRule> make_lion_rule(const LionConfig& config) {
  return std::make_unique<LionRule>(config);
}

}  // namespace weft
