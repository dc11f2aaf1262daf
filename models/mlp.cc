#include "models/mlp.h"

#include "layers/gelu.h"
#include "layers/linear.h"
#include "layers/mse_loss.h"

namespace weft {

MlpModel build_mlp(const std::vector<int64_t>& widths, int64_t batch) {
  check(widths.size() >= 2, "an MLP needs at least input and output widths, got {}",
        widths.size());
  for (int64_t w : widths) check(w > 0, "MLP width {} must be positive", w);
  auto params = std::make_shared<ParamStore>();
  MlpModel m{params, Graph(params), -1, -1, -1};
  Graph& g = m.graph;
  m.input = g.input("input", {batch, widths.front()}, DType::F32);
  m.target = g.input("target", {batch, widths.back()}, DType::F32);
  int x = m.input;
  for (size_t i = 0; i + 1 < widths.size(); ++i) {
    const std::string name = fmt::format("fc.{}", i);
    Param* w = params->create(name + ".weight", {widths[i], widths[i + 1]}, Init::normal(0.2f));
    Param* b = params->create(name + ".bias", {widths[i + 1]}, Init::constant(0));
    x = g.add1(name, std::make_unique<Linear>(w, b), {x});
    if (i + 2 < widths.size()) x = g.add1(name + ".gelu", std::make_unique<Gelu>(), {x});
  }
  m.loss = g.add1("loss", std::make_unique<MseLoss>(), {x, m.target});
  g.mark_output(m.loss);
  return m;
}

}  // namespace weft
