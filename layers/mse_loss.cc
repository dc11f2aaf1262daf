#include "layers/mse_loss.h"

namespace weft {

namespace {
struct Ctx : LayerCtx {
  Tensor pred, target;
};
}  // namespace

std::vector<Shape> MseLoss::output_shapes(std::span<const Shape> in) const {
  check(in.size() == 2 && in[0] == in[1], "mse loss compares two equal shapes, got {} and {}",
        in.empty() ? "nothing" : in[0].str(), in.size() > 1 ? in[1].str() : "nothing");
  return {Shape{1}};
}

std::unique_ptr<Layer> MseLoss::tensor_parallel(TpBuild&) const {
  return std::make_unique<MseLoss>();
}

std::unique_ptr<LayerCtx> MseLoss::make_ctx() const { return std::make_unique<Ctx>(); }

void MseLoss::forward(LayerCtx& ctx_, Arena&, std::span<const Tensor> in,
                      std::span<const Tensor> out) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  ctx.pred = in[0];
  ctx.target = in[1];
  const float* p = in[0].data<float>();
  const float* t = in[1].data<float>();
  double s = 0;
  for (int64_t i = 0; i < in[0].numel(); ++i) s += 0.5 * double(p[i] - t[i]) * double(p[i] - t[i]);
  out[0].data<float>()[0] = static_cast<float>(s);
}

void MseLoss::backward_input(LayerCtx& ctx_, Arena&, std::span<const Tensor> grad_out,
                             std::span<const Tensor> grad_in) {
  auto& ctx = static_cast<Ctx&>(ctx_);
  const float g = grad_out[0].data<float>()[0];
  const float* p = ctx.pred.data<float>();
  const float* t = ctx.target.data<float>();
  for (int k = 0; k < 2; ++k) {
    if (!grad_in[static_cast<size_t>(k)].defined()) continue;
    float* d = grad_in[static_cast<size_t>(k)].data<float>();
    const float sign = k == 0 ? 1.0f : -1.0f;
    for (int64_t i = 0; i < ctx.pred.numel(); ++i) d[i] += sign * g * (p[i] - t[i]);
  }
}

}  // namespace weft
