// Every layer against finite differences of its own forward, a double-precision reference
// for its forward, and the contract of layer.h: the I/W split, several micro-batches in
// flight, accumulation into gradient buffers, and undefined gradients for inputs.
#include <gtest/gtest.h>
#include <weft/arena.h>
#include <weft/bf16.h>
#include <weft/gradcheck.h>
#include <weft/layer.h>
#include <weft/ops.h>
#include <weft/param.h>
#include <weft/tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "layers/attention.h"
#include "layers/embedding.h"
#include "layers/gelu.h"
#include "layers/gelu_mlp.h"
#include "layers/layernorm.h"
#include "layers/linear.h"
#include "layers/lm_head.h"
#include "layers/mse_loss.h"
#include "layers/residual.h"
#include "layers/rmsnorm.h"
#include "layers/rotary.h"
#include "layers/swiglu.h"
#include "test_util.h"

namespace weft {
namespace {

using testing::contains;
using testing::error_message;

constexpr int64_t kB = 2, kT = 5, kC = 8, kHeads = 2, kV = 11, kPos = 6;

size_t z(int64_t i) { return static_cast<size_t>(i); }


void fill_uniform(const Tensor& t, uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  const std::vector<float> v = testing::uniform(t.numel(), seed, lo, hi);
  std::copy(v.begin(), v.end(), t.data<float>());
}

Tensor uniform(Shape s, uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  return testing::uniform_tensor(s, seed, lo, hi);
}

// Token ids with repeats (so gradient rows collect several contributions), covering both
// ends of the vocabulary for seed 0.
Tensor tokens(uint64_t seed) {
  static const int32_t base[kB * kT] = {3, 7, 3, 0, 10, 7, 7, 1, 3, 5};
  Tensor t = Tensor::empty({kB, kT}, DType::I32);
  for (int64_t i = 0; i < kB * kT; ++i)
    t.data<int32_t>()[i] = static_cast<int32_t>((base[i] + static_cast<int64_t>(seed)) % kV);
  return t;
}

double at(const Tensor& t, int64_t i) { return static_cast<double>(t.data<float>()[i]); }

// Positions within documents (--reset-position-ids, --reset-attention-mask):
// three documents in sequence 0 and two in sequence 1 (or the reverse, by
// seed), each a document's first token at 0.
Tensor doc_positions(uint64_t seed) {
  static const int32_t a[kB * kT] = {0, 1, 0, 1, 2, 0, 1, 2, 0, 0};
  static const int32_t b[kB * kT] = {0, 1, 2, 0, 0, 0, 0, 1, 0, 1};
  Tensor t = Tensor::empty({kB, kT}, DType::I32);
  std::copy_n(seed % 2 ? b : a, kB * kT, t.data<int32_t>());
  return t;
}

// tokens(seed) with two targets ignored (--eod-mask-loss).
Tensor masked_targets(uint64_t seed) {
  Tensor t = tokens(seed);
  t.data<int32_t>()[2] = t.data<int32_t>()[2 + kT + static_cast<int64_t>(seed % 2)] =
      kIgnoredTarget;
  return t;
}

// Each token's position: its own within its document, or t.
int64_t position_of(const Tensor* positions, int64_t row, int64_t t_len) {
  return positions ? positions->data<int32_t>()[row] : row % t_len;
}

// --- the layers under test ---

struct Case {
  std::string name;
  std::unique_ptr<ParamStore> store;  // params live at stable addresses
  std::unique_ptr<Layer> layer;
  std::function<std::vector<Tensor>(uint64_t)> make_inputs;  // owned master copies
  std::vector<bool> float_input;  // inputs that get a gradient; int inputs never do
  bool loss = false;              // one scalar output, a sum
  // The first output in double, from the inputs and the current parameter values.
  std::function<std::vector<double>(const std::vector<Tensor>&)> reference;
};

Param* make_param(ParamStore& s, const std::string& name, Shape shape, float std, float offset,
                  uint64_t seed) {
  Param* p = s.create(name, shape, Init::normal(std));
  init_param(*p, seed);
  for (int64_t i = 0; i < p->value.numel(); ++i) p->value.data<float>()[i] += offset;
  return p;
}

std::vector<double> layernorm_ref(const Tensor& x, const Param* w, const Param* b, double eps) {
  const int64_t n = x.shape().rows(), c = x.shape().last();
  std::vector<double> y(z(n * c));
  for (int64_t i = 0; i < n; ++i) {
    double m = 0, var = 0;
    for (int64_t j = 0; j < c; ++j) m += at(x, i * c + j) / static_cast<double>(c);
    for (int64_t j = 0; j < c; ++j)
      var += std::pow(at(x, i * c + j) - m, 2) / static_cast<double>(c);
    for (int64_t j = 0; j < c; ++j)
      y[z(i * c + j)] =
          (at(x, i * c + j) - m) / std::sqrt(var + eps) * at(w->value, j) + at(b->value, j);
  }
  return y;
}

// x with a different offset per row, so that a LayerNorm's mean matters.
Tensor rows_offset(Tensor x) {
  const int64_t c = x.shape().last();
  for (int64_t i = 0; i < x.shape().rows(); ++i)
    for (int64_t j = 0; j < c; ++j) x.data<float>()[i * c + j] += 0.3f * float(i % 4);
  return x;
}

// in[0] + in[1], element by element, in double.
std::vector<double> sum_ref(const std::vector<Tensor>& in) {
  std::vector<double> y(z(in[0].numel()));
  for (int64_t i = 0; i < in[0].numel(); ++i) y[z(i)] = at(in[0], i) + at(in[1], i);
  return y;
}

// qkv (B, T, (H + 2G) D): query head hi reads key/value head hi / (H / G);
// with positions, query i reads keys i - positions[i] .. i only.
std::vector<double> attention_ref(const Tensor& qkv, int64_t h, int64_t g,
                                  const Tensor* positions = nullptr) {
  const int64_t b = qkv.dim(0), t = qkv.dim(1), w = qkv.dim(2), d = w / (h + 2 * g), c = h * d;
  std::vector<double> out(z(b * t * c), 0.0);
  auto q = [&](int64_t bi, int64_t ti, int64_t col) { return at(qkv, (bi * t + ti) * w + col); };
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t hi = 0; hi < h; ++hi) {
      const int64_t k0 = c + hi / (h / g) * d, v0 = k0 + g * d;
      for (int64_t i = 0; i < t; ++i) {
        const int64_t first = positions ? i - position_of(positions, bi * t + i, t) : 0;
        std::vector<double> s(z(i + 1));
        double mx = -std::numeric_limits<double>::infinity(), sum = 0;
        for (int64_t j = first; j <= i; ++j) {
          for (int64_t e = 0; e < d; ++e)
            s[z(j)] += q(bi, i, hi * d + e) * q(bi, j, k0 + e) / std::sqrt(double(d));
          mx = std::max(mx, s[z(j)]);
        }
        for (int64_t j = first; j <= i; ++j) sum += (s[z(j)] = std::exp(s[z(j)] - mx));
        for (int64_t j = first; j <= i; ++j)
          for (int64_t e = 0; e < d; ++e)
            out[z((bi * t + i) * c + hi * d + e)] += s[z(j)] / sum * q(bi, j, v0 + e);
      }
    }
  return out;
}

// Rotary embedding of qkv (B, T, (H + 2G) D) in double: the H query and G key
// heads' pairs (i, i + D/2) rotated by t * base^(-2i/D); the values as they are.
std::vector<double> rotary_ref(const Tensor& qkv, int64_t h, int64_t g, double base,
                               const Tensor* positions = nullptr) {
  const int64_t rows = qkv.shape().rows(), t_len = qkv.dim(1), w = qkv.dim(2);
  const int64_t d = w / (h + 2 * g), half = d / 2;
  std::vector<double> y(z(qkv.numel()));
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t t = position_of(positions, row, t_len);
    for (int64_t head = 0; head < h + 2 * g; ++head)
      for (int64_t i = 0; i < half; ++i) {
        const int64_t a = row * w + head * d + i, b = a + half;
        if (head >= h + g) {
          y[z(a)] = at(qkv, a), y[z(b)] = at(qkv, b);
          continue;
        }
        const double ang = double(t) * std::pow(base, -2.0 * double(i) / double(d));
        y[z(a)] = at(qkv, a) * std::cos(ang) - at(qkv, b) * std::sin(ang);
        y[z(b)] = at(qkv, b) * std::cos(ang) + at(qkv, a) * std::sin(ang);
      }
  }
  return y;
}

// Sum over tokens of -log softmax(x wte^T)[target], in double.
double lm_loss_ref(const Tensor& x, const Tensor& targets, const Param* wte) {
  const int64_t n = x.shape().rows(), c = x.shape().last(), v = wte->value.dim(0);
  double total = 0;
  for (int64_t i = 0; i < n; ++i) {
    std::vector<double> logit(z(v), 0.0);
    double mx = -std::numeric_limits<double>::infinity(), sum = 0;
    for (int64_t k = 0; k < v; ++k) {
      for (int64_t j = 0; j < c; ++j) logit[z(k)] += at(x, i * c + j) * at(wte->value, k * c + j);
      mx = std::max(mx, logit[z(k)]);
    }
    for (double l : logit) sum += std::exp(l - mx);
    const int32_t target = targets.data<int32_t>()[i];
    if (target != kIgnoredTarget) total += std::log(sum) + mx - logit[z(target)];
  }
  return total;
}

Case make_case(const std::string& name) {
  Case c;
  c.name = name;
  c.store = std::make_unique<ParamStore>();
  ParamStore& s = *c.store;
  const Shape act{kB, kT, kC};
  if (name == "embedding" || name == "embedding_documents") {
    Param* wte = make_param(s, "wte", {kV, kC}, 0.5f, 0.0f, 1);
    Param* wpe = make_param(s, "wpe", {kPos, kC}, 0.5f, 0.0f, 1);
    c.layer = std::make_unique<Embedding>(wte, wpe);
    const bool docs = name == "embedding_documents";
    c.make_inputs = [docs](uint64_t seed) {
      return docs ? std::vector<Tensor>{tokens(seed), doc_positions(seed)}
                  : std::vector<Tensor>{tokens(seed)};
    };
    c.float_input = docs ? std::vector<bool>{false, false} : std::vector<bool>{false};
    c.reference = [wte, wpe](const std::vector<Tensor>& in) {
      const Tensor* positions = in.size() > 1 ? &in[1] : nullptr;
      std::vector<double> y(z(kB * kT * kC));
      for (int64_t i = 0; i < kB * kT; ++i)
        for (int64_t j = 0; j < kC; ++j)
          y[z(i * kC + j)] = at(wte->value, in[0].data<int32_t>()[i] * kC + j) +
                             at(wpe->value, position_of(positions, i, kT) * kC + j);
      return y;
    };
  } else if (name == "layernorm") {
    // Weights around one and a non-zero bias, so neither hides a missing term.
    Param* w = make_param(s, "ln.weight", {kC}, 0.2f, 1.0f, 2);
    Param* b = make_param(s, "ln.bias", {kC}, 0.3f, 0.0f, 2);
    c.layer = std::make_unique<LayerNorm>(w, b);
    c.make_inputs = [act](uint64_t seed) {
      return std::vector<Tensor>{rows_offset(uniform(act, 100 + seed, -1.0f, 1.0f))};
    };
    c.float_input = {true};
    c.reference = [w, b](const std::vector<Tensor>& in) {
      return layernorm_ref(in[0], w, b, 1e-5);
    };
  } else if (name == "residual_layernorm") {
    // Both outputs reach the loss: the sum (checked against the reference)
    // and its LayerNorm, so every gradient has both parts.
    Param* w = make_param(s, "ln.weight", {kC}, 0.2f, 1.0f, 8);
    Param* b = make_param(s, "ln.bias", {kC}, 0.3f, 0.0f, 8);
    c.layer = std::make_unique<ResidualLayerNorm>(w, b);
    c.make_inputs = [act](uint64_t seed) {
      return std::vector<Tensor>{rows_offset(uniform(act, 1400 + seed, -1.0f, 1.0f)),
                                 uniform(act, 1500 + seed)};
    };
    c.float_input = {true, true};
    c.reference = sum_ref;
  } else if (name == "linear_bias" || name == "linear_nobias") {
    const int64_t out = 6;
    Param* w = make_param(s, "fc.weight", {kC, out}, 0.5f, 0.0f, 3);
    Param* b = name == "linear_bias" ? make_param(s, "fc.bias", {out}, 0.5f, 0.0f, 3) : nullptr;
    c.layer = std::make_unique<Linear>(w, b);
    c.make_inputs = [act](uint64_t seed) { return std::vector<Tensor>{uniform(act, 200 + seed)}; };
    c.float_input = {true};
    c.reference = [w, b, out](const std::vector<Tensor>& in) {
      const int64_t n = in[0].shape().rows();
      std::vector<double> y(z(n * out));
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < out; ++j) {
          double acc = b ? at(b->value, j) : 0.0;
          for (int64_t k = 0; k < kC; ++k) acc += at(in[0], i * kC + k) * at(w->value, k * out + j);
          y[z(i * out + j)] = acc;
        }
      return y;
    };
  } else if (name == "gelu") {
    c.layer = std::make_unique<Gelu>();
    c.make_inputs = [act](uint64_t seed) {
      return std::vector<Tensor>{uniform(act, 300 + seed, -3.0f, 3.0f)};
    };
    c.float_input = {true};
    c.reference = [](const std::vector<Tensor>& in) {
      std::vector<double> y(z(in[0].numel()));
      for (int64_t i = 0; i < in[0].numel(); ++i) {
        const double x = at(in[0], i);
        y[z(i)] = 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
      }
      return y;
    };
  } else if (name == "gelu_mlp") {
    const int64_t hidden = 12;  // H, not a multiple of C: the two widths stay apart
    Param* w1 = make_param(s, "mlp.c_fc.weight", {kC, hidden}, 0.6f, 0.0f, 6);
    Param* b1 = make_param(s, "mlp.c_fc.bias", {hidden}, 0.5f, 0.0f, 16);
    Param* w2 = make_param(s, "mlp.c_proj.weight", {hidden, kC}, 0.5f, 0.0f, 7);
    Param* b2 = make_param(s, "mlp.c_proj.bias", {kC}, 0.5f, 0.0f, 17);
    c.layer = std::make_unique<GeluMlp>(w1, b1, w2, b2);
    c.make_inputs = [act](uint64_t seed) { return std::vector<Tensor>{uniform(act, 350 + seed)}; };
    c.float_input = {true};
    c.reference = [w1, b1, w2, b2, hidden](const std::vector<Tensor>& in) {
      const int64_t n = in[0].shape().rows();
      std::vector<double> y(z(n * kC)), h(z(hidden));
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t j = 0; j < hidden; ++j) {
          double pre = at(b1->value, j);
          for (int64_t k = 0; k < kC; ++k)
            pre += at(in[0], i * kC + k) * at(w1->value, k * hidden + j);
          const double u = std::sqrt(2 / M_PI) * (pre + 0.044715 * pre * pre * pre);
          h[z(j)] = 0.5 * pre * (1 + std::tanh(u));
        }
        for (int64_t j = 0; j < kC; ++j) {
          double acc = at(b2->value, j);
          for (int64_t k = 0; k < hidden; ++k) acc += h[z(k)] * at(w2->value, k * kC + j);
          y[z(i * kC + j)] = acc;
        }
      }
      return y;
    };
  } else if (name == "attention") {
    c.layer = std::make_unique<CausalSelfAttention>(kHeads);
    c.make_inputs = [](uint64_t seed) {
      return std::vector<Tensor>{uniform({kB, kT, 3 * kC}, 400 + seed, -1.5f, 1.5f)};
    };
    c.float_input = {true};
    c.reference = [](const std::vector<Tensor>& in) { return attention_ref(in[0], kHeads, kHeads); };
  } else if (name == "attention_documents") {  // each query reads its document's keys only
    c.layer = std::make_unique<CausalSelfAttention>(kHeads);
    c.make_inputs = [](uint64_t seed) {
      return std::vector<Tensor>{uniform({kB, kT, 3 * kC}, 420 + seed, -1.5f, 1.5f),
                                 doc_positions(seed)};
    };
    c.float_input = {true, false};
    c.reference = [](const std::vector<Tensor>& in) {
      return attention_ref(in[0], kHeads, kHeads, &in[1]);
    };
  } else if (name == "attention_gqa") {  // both query heads share one key/value head
    c.layer = std::make_unique<CausalSelfAttention>(kHeads, 1);
    c.make_inputs = [](uint64_t seed) {
      return std::vector<Tensor>{uniform({kB, kT, kC + 2 * kC / kHeads}, 450 + seed, -1.5f, 1.5f)};
    };
    c.float_input = {true};
    c.reference = [](const std::vector<Tensor>& in) { return attention_ref(in[0], kHeads, 1); };
  } else if (name == "residual") {
    c.layer = std::make_unique<Residual>();
    c.make_inputs = [act](uint64_t seed) {
      return std::vector<Tensor>{uniform(act, 500 + seed), uniform(act, 600 + seed)};
    };
    c.float_input = {true, true};
    c.reference = sum_ref;
  } else if (name == "lm_head" || name == "lm_head_chunked" || name == "lm_head_ignored" ||
             name == "lm_head_chunked_ignored") {
    Param* wte = make_param(s, "wte", {kV, kC}, 0.7f, 0.0f, 4);
    auto head = std::make_unique<TiedLmHeadLoss>(wte);
    // Chunks of 3 rows: the ragged last one too (B T is not a multiple of 3).
    if (contains(name, "chunked")) head->set_chunk_rows(3);
    c.layer = std::move(head);
    // Ignored targets (--eod-mask-loss) add no term and no gradient.
    const bool ignored = contains(name, "ignored");
    c.make_inputs = [act, ignored](uint64_t seed) {
      return std::vector<Tensor>{uniform(act, 700 + seed),
                                 ignored ? masked_targets(seed + 4) : tokens(seed + 4)};
    };
    c.float_input = {true, false};
    c.loss = true;
    c.reference = [wte](const std::vector<Tensor>& in) {
      return std::vector<double>{lm_loss_ref(in[0], in[1], wte)};
    };
  } else if (name == "mse") {
    c.layer = std::make_unique<MseLoss>();
    c.make_inputs = [](uint64_t seed) {
      return std::vector<Tensor>{uniform({kB * kT, 4}, 800 + seed),
                                 uniform({kB * kT, 4}, 900 + seed)};
    };
    c.float_input = {true, true};
    c.loss = true;
    c.reference = [](const std::vector<Tensor>& in) {
      double s2 = 0;
      for (int64_t i = 0; i < in[0].numel(); ++i)
        s2 += 0.5 * std::pow(at(in[0], i) - at(in[1], i), 2);
      return std::vector<double>{s2};
    };
  } else if (name == "rmsnorm") {
    Param* w = make_param(s, "norm.weight", {kC}, 0.2f, 1.0f, 5);
    c.layer = std::make_unique<RmsNorm>(w, 1e-5f);
    c.make_inputs = [act](uint64_t seed) {
      Tensor x = uniform(act, 1000 + seed, -1.0f, 1.0f);
      for (int64_t i = 0; i < act.rows(); ++i)  // rows of different scales
        for (int64_t j = 0; j < kC; ++j) x.data<float>()[i * kC + j] *= 0.5f + 0.4f * float(i % 3);
      return std::vector<Tensor>{x};
    };
    c.float_input = {true};
    c.reference = [w](const std::vector<Tensor>& in) {
      const int64_t n = in[0].shape().rows();
      std::vector<double> y(z(n * kC));
      for (int64_t i = 0; i < n; ++i) {
        double ss = 0;
        for (int64_t j = 0; j < kC; ++j) ss += at(in[0], i * kC + j) * at(in[0], i * kC + j);
        const double r = 1.0 / std::sqrt(ss / kC + 1e-5);
        for (int64_t j = 0; j < kC; ++j) y[z(i * kC + j)] = at(in[0], i * kC + j) * r * at(w->value, j);
      }
      return y;
    };
  } else if (name == "swiglu") {
    c.layer = std::make_unique<SwiGlu>();
    c.make_inputs = [](uint64_t seed) {
      return std::vector<Tensor>{uniform({kB, kT, 2 * kC}, 1100 + seed, -3.0f, 3.0f)};
    };
    c.float_input = {true};
    c.reference = [](const std::vector<Tensor>& in) {
      const int64_t n = in[0].shape().rows();
      std::vector<double> y(z(n * kC));
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < kC; ++j) {
          const double g = at(in[0], i * 2 * kC + j), u = at(in[0], i * 2 * kC + kC + j);
          y[z(i * kC + j)] = g / (1 + std::exp(-g)) * u;
        }
      return y;
    };
  } else if (name == "rotary") {
    c.layer = std::make_unique<Rotary>(kHeads, kHeads, 100.0f);
    c.make_inputs = [](uint64_t seed) {
      return std::vector<Tensor>{uniform({kB, kT, 3 * kC}, 1200 + seed)};
    };
    c.float_input = {true};
    c.reference = [](const std::vector<Tensor>& in) {
      return rotary_ref(in[0], kHeads, kHeads, 100.0);
    };
  } else if (name == "rotary_gqa") {
    c.layer = std::make_unique<Rotary>(kHeads, 1, 100.0f);
    c.make_inputs = [](uint64_t seed) {
      return std::vector<Tensor>{uniform({kB, kT, kC + 2 * kC / kHeads}, 1300 + seed)};
    };
    c.float_input = {true};
    c.reference = [](const std::vector<Tensor>& in) { return rotary_ref(in[0], kHeads, 1, 100.0); };
  } else if (name == "rotary_documents") {  // positions within documents
    c.layer = std::make_unique<Rotary>(kHeads, kHeads, 100.0f);
    c.make_inputs = [](uint64_t seed) {
      return std::vector<Tensor>{uniform({kB, kT, 3 * kC}, 1250 + seed), doc_positions(seed)};
    };
    c.float_input = {true, false};
    c.reference = [](const std::vector<Tensor>& in) {
      return rotary_ref(in[0], kHeads, kHeads, 100.0, &in[1]);
    };
  } else {
    ADD_FAILURE() << "unknown layer case " << name;
  }
  return c;
}

const std::vector<std::string> kAllLayers = {"embedding",
                                             "layernorm",
                                             "linear_bias",
                                             "linear_nobias",
                                             "gelu",
                                             "attention",
                                             "residual",
                                             "lm_head",
                                             "mse",
                                             "rmsnorm",
                                             "swiglu",
                                             "rotary",
                                             "attention_gqa",
                                             "rotary_gqa",
                                             "lm_head_chunked",
                                             "gelu_mlp",
                                             "residual_layernorm",
                                             "embedding_documents",
                                             "attention_documents",
                                             "rotary_documents",
                                             "lm_head_ignored",
                                             "lm_head_chunked_ignored"};
const std::vector<std::string> kParamLayers = {
    "embedding",      "layernorm",       "linear_bias", "linear_nobias",      "lm_head",
    "rmsnorm",        "lm_head_chunked", "gelu_mlp",    "residual_layernorm", "embedding_documents",
    "lm_head_ignored"};

// --- running a layer the way the runner does ---

// One micro-batch in flight: its arena, its ctx and the tensors it keeps alive.
struct Pass {
  Arena arena;
  std::unique_ptr<LayerCtx> ctx;
  std::vector<Tensor> in, out, grad_out, grad_in;
};

class Harness {
 public:
  explicit Harness(Case& c) : c_(c) {
    const std::vector<Tensor> in = c.make_inputs(0);
    std::vector<Shape> shapes;
    for (const Tensor& t : in) shapes.push_back(t.shape());
    out_shapes_ = c.layer->output_shapes(shapes);
    set_dout(0);
  }

  // d L / d out: random weights for ordinary layers; for loss layers the scalar seed, 1 for
  // seed 0 (so L is the loss itself). Micro-batches in flight get different ones, so a
  // layer that mixed up whose dout it kept would show.
  void set_dout(uint64_t seed) {
    r_.clear();
    for (size_t k = 0; k < out_shapes_.size(); ++k) {
      if (c_.loss) {
        r_.push_back(Tensor::zeros(out_shapes_[k]));
        r_.back().data<float>()[0] = seed == 0 ? 1.0f : 0.25f + 0.5f * static_cast<float>(seed);
      } else {
        r_.push_back(uniform(out_shapes_[k], 1000 + 10 * seed + k));
      }
    }
  }
  void scale_dout(float s) {
    for (const Tensor& r : r_)
      for (int64_t i = 0; i < r.numel(); ++i) r.data<float>()[i] *= s;
  }

  Layer& layer() { return *c_.layer; }
  std::vector<Param*> params() { return c_.layer->params(); }

  std::unique_ptr<Pass> forward(const std::vector<Tensor>& inputs) {
    auto p = std::make_unique<Pass>();
    std::vector<Shape> shapes;
    for (const Tensor& t : inputs) {
      Tensor a = p->arena.alloc(t.shape(), t.dtype());
      a.copy_from(t);
      p->in.push_back(a);
      shapes.push_back(t.shape());
    }
    const std::vector<Shape> os = layer().output_shapes(shapes);
    const std::vector<DType> od = layer().output_dtypes(shapes);
    for (size_t k = 0; k < os.size(); ++k) {
      // NaN-poisoned: an output element the layer forgets to write shows up downstream.
      Tensor o = p->arena.alloc(os[k], od[k]);
      std::fill_n(o.data<float>(), o.numel(), std::numeric_limits<float>::quiet_NaN());
      p->out.push_back(o);
    }
    p->ctx = layer().make_ctx();
    layer().forward(*p->ctx, p->arena, p->in, p->out);
    return p;
  }

  // L = sum_i r_i out_i in double from the fp32 outputs.
  double loss(const Pass& p) const {
    double l = 0;
    for (size_t k = 0; k < p.out.size(); ++k)
      for (int64_t i = 0; i < p.out[k].numel(); ++i) l += at(r_[k], i) * at(p.out[k], i);
    return l;
  }

  // want[i]: give input i a gradient buffer (float inputs only); start[i]: its initial
  // contents, zeros when undefined.
  void backward_input(Pass& p, std::vector<bool> want = {}, const std::vector<Tensor>& start = {}) {
    if (want.empty()) want = c_.float_input;
    for (const Tensor& r : r_) {
      Tensor g = p.arena.alloc(r.shape());
      g.copy_from(r);
      p.grad_out.push_back(g);
    }
    for (size_t i = 0; i < p.in.size(); ++i) {
      if (!want[i] || !c_.float_input[i]) {
        p.grad_in.emplace_back();
        continue;
      }
      Tensor g = p.arena.zeros(p.in[i].shape());
      if (i < start.size() && start[i].defined()) g.copy_from(start[i]);
      p.grad_in.push_back(g);
    }
    layer().backward_input(*p.ctx, p.arena, p.grad_out, p.grad_in);
  }

  void backward_weight(Pass& p) { layer().backward_weight(*p.ctx, p.arena); }

  void zero_param_grads() {
    for (Param* q : params()) q->grad.zero_();
  }
  std::vector<Tensor> param_grads() {
    std::vector<Tensor> g;
    for (Param* q : params()) g.push_back(q->grad.clone());
    return g;
  }

  // Central differences of L over every element of `x` (an input master copy or a
  // parameter value), using the perturbation actually representable in fp32.
  Tensor numeric_grad(const Tensor& x, const std::vector<Tensor>& inputs, double eps = 1e-2) {
    Tensor g = Tensor::zeros(x.shape());
    float* v = x.data<float>();
    for (int64_t i = 0; i < x.numel(); ++i) {
      const float orig = v[i];
      const float up = orig + static_cast<float>(eps), down = orig - static_cast<float>(eps);
      v[i] = up;
      const double lp = loss(*forward(inputs));
      v[i] = down;
      const double lm = loss(*forward(inputs));
      v[i] = orig;
      g.data<float>()[i] = static_cast<float>((lp - lm) / (double(up) - double(down)));
    }
    return g;
  }

 private:
  Case& c_;
  std::vector<Shape> out_shapes_;
  std::vector<Tensor> r_;
};

// |num - ana| <= 5e-4 + 5e-3 |ana| per element and a relative norm error below 2e-3.
// With eps = 1e-2 the observed errors are at most 1/8 of this (the LM head's, whose fp32
// loss of ~24 rounds to 2e-6 before the difference quotient), so a missing term as small
// as a few percent of a gradient still fails.
void expect_grad_matches(const Tensor& ana, const Tensor& num, const std::string& what) {
  ASSERT_EQ(ana.shape(), num.shape()) << what;
  int bad = 0;
  double norm = 0;
  for (int64_t i = 0; i < ana.numel(); ++i) {
    const double a = at(ana, i), n = at(num, i);
    norm += n * n;
    if (!(std::abs(n - a) <= 5e-4 + 5e-3 * std::abs(a)) && ++bad <= 5)
      ADD_FAILURE() << what << "[" << i << "]: analytic " << a << ", numeric " << n;
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << ana.numel() << " elements off";
  EXPECT_LT(testing::rel_error(ana, num), 2e-3) << what;
  // A vanishing gradient would make the comparison vacuous.
  EXPECT_GT(std::sqrt(norm), 1e-2) << what << " has no gradient to compare";
}

// Close in fp32 terms: for results that differ only in summation order.
void expect_near_tensor(const Tensor& got, const Tensor& want, const std::string& what,
                        double tol = 1e-5) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  int bad = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double g = at(got, i), w = at(want, i);
    if (!(std::abs(g - w) <= tol * (1.0 + std::abs(w))) && ++bad <= 5)
      ADD_FAILURE() << what << "[" << i << "]: got " << g << ", want " << w;
  }
  EXPECT_EQ(bad, 0) << what;
}

void expect_all_zero(const Tensor& t, const std::string& what) {
  int64_t nonzero = 0;
  for (int64_t i = 0; i < t.numel(); ++i) nonzero += t.data<float>()[i] != 0.0f;
  EXPECT_EQ(nonzero, 0) << what << " was written";
}

class AllLayers : public ::testing::TestWithParam<std::string> {};
class ParamLayers : public ::testing::TestWithParam<std::string> {};

TEST_P(AllLayers, ForwardMatchesDoubleReference) {
  Case c = make_case(GetParam());
  Harness h(c);
  const std::vector<Tensor> in = c.make_inputs(0);
  auto p = h.forward(in);
  const std::vector<double> want = c.reference(in);
  ASSERT_EQ(static_cast<size_t>(p->out[0].numel()), want.size());
  int bad = 0;
  for (int64_t i = 0; i < p->out[0].numel(); ++i) {
    const double got = at(p->out[0], i), w = want[z(i)];
    if (!(std::abs(got - w) <= 1e-5 * (1.0 + std::abs(w))) && ++bad <= 5)
      ADD_FAILURE() << c.name << " out[" << i << "] = " << got << ", want " << w;
  }
  EXPECT_EQ(bad, 0);
}

// The main check. Also the first half of the I/W split: backward_input leaves every
// parameter gradient exactly zero, and backward_weight alone produces it.
TEST_P(AllLayers, GradientsMatchFiniteDifferences) {
  Case c = make_case(GetParam());
  Harness h(c);
  std::vector<Tensor> in = c.make_inputs(0);

  h.zero_param_grads();
  auto p = h.forward(in);
  h.backward_input(*p);
  for (Param* q : h.params()) expect_all_zero(q->grad, q->name + " grad after backward_input");
  h.backward_weight(*p);

  for (size_t i = 0; i < in.size(); ++i) {
    if (!c.float_input[i]) continue;
    expect_grad_matches(p->grad_in[i], h.numeric_grad(in[i], in),
                        c.name + " d/d input " + std::to_string(i));
  }
  for (Param* q : h.params())
    expect_grad_matches(q->grad, h.numeric_grad(q->value, in), c.name + " d/d " + q->name);
}

// Gradient buffers are accumulated into: a value read by two nodes gets both contributions.
TEST_P(AllLayers, GradientsAccumulateIntoExistingBuffers) {
  Case c = make_case(GetParam());
  Harness h(c);
  const std::vector<Tensor> in = c.make_inputs(0);

  h.zero_param_grads();
  auto clean = h.forward(in);
  h.backward_input(*clean);
  h.backward_weight(*clean);
  const std::vector<Tensor> clean_params = h.param_grads();

  std::vector<Tensor> start, start_params;
  for (size_t i = 0; i < in.size(); ++i)
    start.push_back(c.float_input[i] ? uniform(in[i].shape(), 50 + i, 5.0f, 7.0f) : Tensor());
  uint64_t seed = 60;
  for (Param* q : h.params()) {
    fill_uniform(q->grad, seed++, -3.0f, 3.0f);
    start_params.push_back(q->grad.clone());
  }
  auto p = h.forward(in);
  h.backward_input(*p, {}, start);
  h.backward_weight(*p);

  for (size_t i = 0; i < in.size(); ++i) {
    if (!c.float_input[i]) continue;
    Tensor want = start[i].clone();
    for (int64_t k = 0; k < want.numel(); ++k)
      want.data<float>()[k] += clean->grad_in[i].data<float>()[k];
    expect_near_tensor(p->grad_in[i], want, c.name + " grad_in " + std::to_string(i));
  }
  const std::vector<Param*> ps = h.params();
  for (size_t k = 0; k < ps.size(); ++k) {
    Tensor want = start_params[k].clone();
    for (int64_t e = 0; e < want.numel(); ++e)
      want.data<float>()[e] += clean_params[k].data<float>()[e];
    expect_near_tensor(ps[k]->grad, want, c.name + " " + ps[k]->name + " grad");
  }
}

// An input whose gradient is not wanted arrives undefined; the others, and the parameter
// gradients (the first layer of a network still trains its weights), are unaffected.
TEST_P(AllLayers, UndefinedGradInIsSkipped) {
  Case c = make_case(GetParam());
  Harness h(c);
  const std::vector<Tensor> in = c.make_inputs(0);

  h.zero_param_grads();
  auto full = h.forward(in);
  h.backward_input(*full);
  h.backward_weight(*full);
  const std::vector<Tensor> full_params = h.param_grads();

  // Every subset of the inputs left without a gradient buffer, including all of them.
  const size_t n = in.size();
  for (unsigned mask = 0; mask < (1u << n) - 1; ++mask) {
    std::vector<bool> want(n);
    for (size_t i = 0; i < n; ++i) want[i] = (mask >> i) & 1u;
    h.zero_param_grads();
    auto p = h.forward(in);
    ASSERT_NO_THROW(h.backward_input(*p, want)) << "mask " << mask;
    ASSERT_NO_THROW(h.backward_weight(*p)) << "mask " << mask;
    for (size_t i = 0; i < n; ++i) {
      EXPECT_EQ(p->grad_in[i].defined(), want[i] && c.float_input[i]);
      if (p->grad_in[i].defined())
        expect_near_tensor(p->grad_in[i], full->grad_in[i], c.name + " grad_in", 0);
    }
    const std::vector<Param*> ps = h.params();
    for (size_t k = 0; k < ps.size(); ++k)
      expect_near_tensor(ps[k]->grad, full_params[k], c.name + " " + ps[k]->name, 0);
  }
}

// d L / d in is linear in the seed grad_out: scaling it scales every gradient. For the loss
// layers this is how the caller turns the sum into a mean.
TEST_P(AllLayers, GradientsScaleWithGradOut) {
  Case c = make_case(GetParam());
  Harness h(c);
  const std::vector<Tensor> in = c.make_inputs(0);
  h.zero_param_grads();
  auto base = h.forward(in);
  h.backward_input(*base);
  h.backward_weight(*base);
  const std::vector<Tensor> base_params = h.param_grads();

  const float s = 0.37f;
  h.scale_dout(s);
  h.zero_param_grads();
  auto scaled = h.forward(in);
  h.backward_input(*scaled);
  h.backward_weight(*scaled);
  auto times_s = [s](const Tensor& t) {
    Tensor u = t.clone();
    for (int64_t i = 0; i < u.numel(); ++i) u.data<float>()[i] *= s;
    return u;
  };
  for (size_t i = 0; i < in.size(); ++i)
    if (c.float_input[i])
      expect_near_tensor(scaled->grad_in[i], times_s(base->grad_in[i]),
                         c.name + " grad_in " + std::to_string(i), 1e-6);
  const std::vector<Param*> ps = h.params();
  for (size_t k = 0; k < ps.size(); ++k)
    expect_near_tensor(ps[k]->grad, times_s(base_params[k]), c.name + " " + ps[k]->name, 1e-6);
}

// Several micro-batches in flight, each with its own ctx: interleaving their F, I and W
// actions gives each input the same gradient as running it alone, and the parameters the
// sum of the micro-batches' gradients.
TEST_P(AllLayers, InterleavedMicroBatchesMatchOneAtATime) {
  Case c = make_case(GetParam());
  Harness h(c);
  // F_A F_B I_B I_A W_A W_B as in a zero-bubble pipeline, and a three-deep schedule where
  // a W runs between other micro-batches' I actions.
  const std::vector<std::string> schedules = {"FA FB IB IA WA WB", "FA FB FC IC IB WB IA WC WA"};
  for (const std::string& sched : schedules) {
    const int micro = sched.find('C') != std::string::npos ? 3 : 2;
    std::vector<std::vector<Tensor>> inputs;
    for (int m = 0; m < micro; ++m) inputs.push_back(c.make_inputs(static_cast<uint64_t>(m + 1)));

    // One at a time.
    std::vector<std::vector<Tensor>> solo_in(z(micro));
    std::vector<Tensor> sum_params;
    for (Param* q : h.params()) sum_params.push_back(Tensor::zeros(q->grad.shape()));
    for (int m = 0; m < micro; ++m) {
      h.zero_param_grads();
      auto p = h.forward(inputs[z(m)]);
      h.set_dout(static_cast<uint64_t>(m + 1));
      h.backward_input(*p);
      h.backward_weight(*p);
      for (const Tensor& g : p->grad_in) solo_in[z(m)].push_back(g.defined() ? g.clone() : g);
      const std::vector<Tensor> g = h.param_grads();
      for (size_t k = 0; k < g.size(); ++k)
        for (int64_t e = 0; e < g[k].numel(); ++e)
          sum_params[k].data<float>()[e] += g[k].data<float>()[e];
    }

    // Interleaved.
    h.zero_param_grads();
    std::vector<std::unique_ptr<Pass>> passes(z(micro));
    for (size_t k = 0; k < sched.size(); k += 3) {
      const auto m = z(sched[k + 1] - 'A');
      if (sched[k] == 'F') passes[m] = h.forward(inputs[m]);
      if (sched[k] == 'I') {
        h.set_dout(m + 1);
        h.backward_input(*passes[m]);
      }
      if (sched[k] == 'W') h.backward_weight(*passes[m]);
    }
    for (int m = 0; m < micro; ++m)
      for (size_t i = 0; i < solo_in[z(m)].size(); ++i)
        if (solo_in[z(m)][i].defined())
          expect_near_tensor(passes[z(m)]->grad_in[i], solo_in[z(m)][i],
                             c.name + " " + sched + " grad_in of micro-batch " +
                                 std::string(1, static_cast<char>('A' + m)),
                             0);
    const std::vector<Param*> ps = h.params();
    for (size_t k = 0; k < ps.size(); ++k)
      expect_near_tensor(ps[k]->grad, sum_params[k], c.name + " " + sched + " " + ps[k]->name);
  }
}

INSTANTIATE_TEST_SUITE_P(Layers, AllLayers, ::testing::ValuesIn(kAllLayers),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

// The I/W split for layers with parameters, with I and W far apart: parameter gradients
// that already hold values (a previous micro-batch) are left alone by I, and W adds to them.
TEST_P(ParamLayers, BackwardInputNeverTouchesParamGrads) {
  Case c = make_case(GetParam());
  Harness h(c);
  const std::vector<Tensor> in = c.make_inputs(0);
  ASSERT_FALSE(h.params().empty());
  uint64_t seed = 70;
  std::vector<Tensor> before;
  for (Param* q : h.params()) {
    fill_uniform(q->grad, seed++);
    before.push_back(q->grad.clone());
  }
  auto p = h.forward(in);
  const std::vector<Param*> ps = h.params();
  for (size_t k = 0; k < ps.size(); ++k)
    EXPECT_EQ(std::memcmp(ps[k]->grad.raw(), before[k].raw(), before[k].nbytes()), 0)
        << ps[k]->name << " changed by forward";
  h.backward_input(*p);
  for (size_t k = 0; k < ps.size(); ++k)
    EXPECT_EQ(std::memcmp(ps[k]->grad.raw(), before[k].raw(), before[k].nbytes()), 0)
        << ps[k]->name << " changed by backward_input";
  // Another micro-batch's forward and I in between must not disturb what W reads.
  auto other = h.forward(c.make_inputs(9));
  h.backward_input(*other);
  h.backward_weight(*p);
  bool changed = false;
  for (size_t k = 0; k < ps.size(); ++k)
    changed |= std::memcmp(ps[k]->grad.raw(), before[k].raw(), before[k].nbytes()) != 0;
  EXPECT_TRUE(changed) << "backward_weight produced nothing";
}

INSTANTIATE_TEST_SUITE_P(Layers, ParamLayers, ::testing::ValuesIn(kParamLayers),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

// --- layer-specific behaviour ---

// A layer that writes its input gradients whole (Layer::writes_input_grad)
// ignores what a fresh buffer held (LayerCtx::fresh_grads_in): NaN-filled
// buffers give the gradients zeroed ones give, bit for bit.
TEST(FreshGradients, LayersThatWriteTheirInputGradientsIgnoreWhatTheBuffersHeld) {
  for (const char* name : {"linear_bias", "linear_nobias", "gelu", "residual", "attention",
                           "attention_gqa", "gelu_mlp", "residual_layernorm"}) {
    Case c = make_case(name);
    Harness h(c);
    const std::vector<Tensor> in = c.make_inputs(0);
    auto zeroed = h.forward(in);
    h.backward_input(*zeroed);
    auto fresh = h.forward(in);
    std::vector<Tensor> nan_starts;
    uint32_t bits = 0;
    for (size_t i = 0; i < in.size(); ++i) {
      Tensor t = Tensor::empty(in[i].shape());
      std::fill_n(t.data<float>(), t.numel(), std::nanf(""));
      nan_starts.push_back(t);
      ASSERT_TRUE(c.layer->writes_input_grad(i)) << name;
      bits |= 1u << i;
    }
    fresh->ctx->fresh_grads_in = bits;
    h.backward_input(*fresh, {}, nan_starts);
    for (size_t i = 0; i < in.size(); ++i) {
      const Tensor& a = zeroed->grad_in[i];
      const Tensor& b = fresh->grad_in[i];
      ASSERT_TRUE(a.defined() && b.defined()) << name;
      EXPECT_EQ(0, std::memcmp(a.raw(), b.raw(), a.nbytes())) << name << " input " << i;
    }
  }
}

// GeluMlp is Linear -> Gelu -> Linear in one node; on the CPU it runs the
// same operations in the same order, so it gives the chain's bits, forward
// and backward (an input gradient accumulated onto what its buffer held),
// in fp32 and with bf16 activations.
TEST(GeluMlp, GivesTheBitsOfTheLinearGeluLinearChain) {
  for (DType dt : {DType::F32, DType::BF16}) {
    ParamStore s;
    const int64_t hidden = 12;
    Param* w1 = make_param(s, "fc.weight", {kC, hidden}, 0.6f, 0.0f, 21);
    Param* b1 = make_param(s, "fc.bias", {hidden}, 0.5f, 0.0f, 22);
    Param* w2 = make_param(s, "proj.weight", {hidden, kC}, 0.5f, 0.0f, 23);
    Param* b2 = make_param(s, "proj.bias", {kC}, 0.5f, 0.0f, 24);
    const std::vector<Param*> ps = {w1, b1, w2, b2};
    for (Param* p : ps) {
      p->value16 = Tensor::empty(p->value.shape(), DType::BF16);
      ops::convert(p->value, p->value16);
    }
    const Shape act{kB, kT, kC}, hs{kB * kT, hidden};
    auto as = [&](const Tensor& t) {  // t in the activations' dtype
      Tensor o = Tensor::empty(t.shape(), dt);
      ops::convert(t, o);
      return o;
    };
    const Tensor x = as(uniform(act, 31)), dy = as(uniform(act, 32)), dx0 = as(uniform(act, 33));
    auto one = [](const Tensor& t) { return std::span<const Tensor>(&t, 1); };
    auto grads = [&] {
      std::vector<Tensor> g;
      for (Param* p : ps) g.push_back(p->grad.clone());
      for (Param* p : ps) p->grad.zero_();
      return g;
    };
    for (Param* p : ps) p->grad.zero_();
    Arena arena;

    GeluMlp mlp(w1, b1, w2, b2);
    auto ctx = mlp.make_ctx();
    const Tensor y1 = arena.alloc(act, dt), dx1 = dx0.clone();
    mlp.forward(*ctx, arena, one(x), one(y1));
    mlp.backward_input(*ctx, arena, one(dy), one(dx1));
    mlp.backward_weight(*ctx, arena);
    const std::vector<Tensor> g1 = grads();

    Linear fc(w1, b1), proj(w2, b2);
    Gelu gelu;
    auto cf = fc.make_ctx(), cg = gelu.make_ctx(), cp = proj.make_ctx();
    const Tensor pre = arena.alloc(hs, dt), h = arena.alloc(hs, dt), y2 = arena.alloc(act, dt);
    fc.forward(*cf, arena, one(x), one(pre));
    gelu.forward(*cg, arena, one(pre), one(h));
    proj.forward(*cp, arena, one(h), one(y2));
    const Tensor dh = arena.zeros(hs, dt), dpre = arena.zeros(hs, dt), dx2 = dx0.clone();
    proj.backward_input(*cp, arena, one(dy), one(dh));
    gelu.backward_input(*cg, arena, one(dh), one(dpre));
    fc.backward_input(*cf, arena, one(dpre), one(dx2));
    proj.backward_weight(*cp, arena);
    fc.backward_weight(*cf, arena);
    const std::vector<Tensor> g2 = grads();

    const std::string what = dtype_name(dt);
    EXPECT_EQ(0, std::memcmp(y1.raw(), y2.raw(), y1.nbytes())) << what << " y";
    EXPECT_EQ(0, std::memcmp(dx1.raw(), dx2.raw(), dx1.nbytes())) << what << " dx";
    EXPECT_NE(0, std::memcmp(dx1.raw(), dx0.raw(), dx1.nbytes())) << what << " dx unchanged";
    for (size_t k = 0; k < ps.size(); ++k) {
      EXPECT_EQ(0, std::memcmp(g1[k].raw(), g2[k].raw(), g1[k].nbytes()))
          << what << " " << ps[k]->name;
      EXPECT_GT(ops::sum_squares(g1[k]), 0.0) << what << " " << ps[k]->name;
    }
  }
}

// ResidualLayerNorm is Residual then LayerNorm in one node; on the CPU it
// runs the same operations, so it gives their bits in fp32 and with bf16
// activations: forward, and backward in each way the runner hands it
// gradient buffers. As in a GPT block, where the sum's gradient reaches it
// already holding the block's downstream part: accumulated into (both
// inputs' buffers holding gradients already), written whole (fresh), and
// the branch's buffer being the sum's own (shared, as the runner gives the
// branch a single node reads), with the input before it fresh.
TEST(ResidualLayerNorm, GivesTheBitsOfTheResidualThenLayerNorm) {
  enum Mode { kAccumulate, kFresh, kShared };
  for (DType dt : {DType::F32, DType::BF16}) {
    for (Mode mode : {kAccumulate, kFresh, kShared}) {
      const std::string what = std::string(dtype_name(dt)) + " mode " + std::to_string(mode);
      ParamStore s;
      Param* w = make_param(s, "ln.weight", {kC}, 0.2f, 1.0f, 41);
      Param* b = make_param(s, "ln.bias", {kC}, 0.3f, 0.0f, 42);
      const Shape act{kB, kT, kC};
      auto as = [&](const Tensor& t) {
        Tensor o = Tensor::empty(t.shape(), dt);
        ops::convert(t, o);
        return o;
      };
      const Tensor x = as(uniform(act, 43)), a = as(uniform(act, 44)), dz = as(uniform(act, 45)),
                   ds = as(uniform(act, 46)), gx0 = as(uniform(act, 47)),
                   ga0 = as(uniform(act, 48));
      auto grads = [&] {
        std::vector<Tensor> g{w->grad.clone(), b->grad.clone()};
        w->grad.zero_();
        b->grad.zero_();
        return g;
      };
      w->grad.zero_();
      b->grad.zero_();
      Arena arena;

      // The fused node, given buffers as the runner would.
      ResidualLayerNorm fused(w, b);
      auto ctx = fused.make_ctx();
      const Tensor s1 = arena.alloc(act, dt), z1 = arena.alloc(act, dt);
      const std::vector<Tensor> outs{s1, z1};
      fused.forward(*ctx, arena, std::vector<Tensor>{x, a}, outs);
      const Tensor ds1 = ds.clone();
      Tensor gx1 = gx0.clone(), ga1 = ga0.clone();
      if (mode != kAccumulate) {
        ops::fill(gx1, std::nanf(""));
        ops::fill(ga1, std::nanf(""));
        ctx->fresh_grads_in = mode == kFresh ? 3u : 1u;
      }
      if (mode == kShared) {
        ga1 = ds1;
        ctx->shared_grads_in = 2u;
      }
      fused.backward_input(*ctx, arena, std::vector<Tensor>{ds1, dz.clone()},
                           std::vector<Tensor>{gx1, ga1});
      fused.backward_weight(*ctx, arena);
      const std::vector<Tensor> g1 = grads();

      // The two layers apart: the add's gradients a copy of (or added to
      // what held) the sum's, after LayerNorm added its own to that.
      Residual res;
      LayerNorm norm(w, b);
      auto cr = res.make_ctx(), cn = norm.make_ctx();
      const Tensor s2 = arena.alloc(act, dt), z2 = arena.alloc(act, dt);
      res.forward(*cr, arena, std::vector<Tensor>{x, a}, std::vector<Tensor>{s2});
      norm.forward(*cn, arena, std::vector<Tensor>{s2}, std::vector<Tensor>{z2});
      const Tensor ds2 = ds.clone();
      norm.backward_input(*cn, arena, std::vector<Tensor>{dz.clone()}, std::vector<Tensor>{ds2});
      const Tensor gx2 = mode == kAccumulate ? gx0.clone() : Tensor::zeros(act, dt);
      const Tensor ga2 = mode == kAccumulate ? ga0.clone() : Tensor::zeros(act, dt);
      res.backward_input(*cr, arena, std::vector<Tensor>{ds2}, std::vector<Tensor>{gx2, ga2});
      norm.backward_weight(*cn, arena);
      const std::vector<Tensor> g2 = grads();

      auto same = [&](const Tensor& p, const Tensor& q, const char* name) {
        EXPECT_EQ(0, std::memcmp(p.raw(), q.raw(), p.nbytes())) << what << " " << name;
      };
      same(s1, s2, "sum");
      same(z1, z2, "layernorm");
      same(gx1, gx2, "gradient of x");
      same(ga1, ga2, "gradient of a");
      same(g1[0], g2[0], "weight gradient");
      same(g1[1], g2[1], "bias gradient");
      EXPECT_NE(0, std::memcmp(gx1.raw(), gx0.raw(), gx1.nbytes())) << what << " gx unchanged";
      EXPECT_GT(ops::sum_squares(g1[0]), 0.0) << what;
    }
  }
}

TEST(TiedLmHeadLoss, OutputIsTheSumOfTokenCrossEntropies) {
  Case c = make_case("lm_head");
  Harness h(c);
  const std::vector<Tensor> in = c.make_inputs(0);
  auto p = h.forward(in);
  Param* wte = c.store->find("wte");
  const double want = lm_loss_ref(in[0], in[1], wte);
  EXPECT_NEAR(at(p->out[0], 0), want, 1e-5 * want);
  // A sum, not a mean: the loss of the batch is the loss of its halves added.
  const Tensor x0 = in[0].slice0(0, 1).clone(), x1 = in[0].slice0(1, 2).clone();
  const Tensor t0 = in[1].slice0(0, 1).clone(), t1 = in[1].slice0(1, 2).clone();
  const double halves = at(h.forward({x0, t0})->out[0], 0) + at(h.forward({x1, t1})->out[0], 0);
  EXPECT_NEAR(at(p->out[0], 0), halves, 1e-5 * want);
}

TEST(TiedLmHeadLoss, GradOutScalesTheGradients) {
  Case c = make_case("lm_head");
  Harness h(c);
  const std::vector<Tensor> in = c.make_inputs(0);
  Param* wte = c.store->find("wte");

  h.zero_param_grads();
  auto one = h.forward(in);
  h.backward_input(*one);
  h.backward_weight(*one);
  const Tensor dwte_sum = wte->grad.clone();

  // Seeding 1/N gives the gradient of the mean loss.
  const float inv_n = 1.0f / static_cast<float>(kB * kT);
  h.scale_dout(inv_n);
  h.zero_param_grads();
  auto mean = h.forward(in);
  h.backward_input(*mean);
  h.backward_weight(*mean);

  Tensor want_dx = one->grad_in[0].clone(), want_dwte = dwte_sum.clone();
  for (int64_t i = 0; i < want_dx.numel(); ++i) want_dx.data<float>()[i] *= inv_n;
  for (int64_t i = 0; i < want_dwte.numel(); ++i) want_dwte.data<float>()[i] *= inv_n;
  expect_near_tensor(mean->grad_in[0], want_dx, "dx of the mean", 1e-6);
  expect_near_tensor(wte->grad, want_dwte, "dwte of the mean", 1e-6);
  EXPECT_GT(testing::rel_error(want_dx, one->grad_in[0]), 0.5);  // really scaled

  // And those are the finite differences of the mean: L = (1/N) sum.
  expect_grad_matches(mean->grad_in[0], h.numeric_grad(in[0], in, 1e-2),
                      "dx of the mean vs finite differences");
}

TEST(TiedLmHeadLoss, KeptLogitsAreXTimesWteTransposed) {
  Case c = make_case("lm_head");
  auto* head = static_cast<TiedLmHeadLoss*>(c.layer.get());
  head->set_keep_logits(true);
  Harness h(c);
  const std::vector<Tensor> in = c.make_inputs(0);
  auto p = h.forward(in);
  const Tensor& logits = TiedLmHeadLoss::logits(*p->ctx);
  ASSERT_EQ(logits.shape().numel(), kB * kT * kV);
  const Param* wte = c.store->find("wte");
  Tensor want = Tensor::zeros({kB * kT, kV});
  for (int64_t i = 0; i < kB * kT; ++i)
    for (int64_t v = 0; v < kV; ++v) {
      double s = 0;
      for (int64_t j = 0; j < kC; ++j) s += at(in[0], i * kC + j) * at(wte->value, v * kC + j);
      want.data<float>()[i * kV + v] = static_cast<float>(s);
    }
  expect_near_tensor(logits.view({kB * kT, kV}), want, "logits");
  // Keeping logits must not change the loss or the gradients.
  Case plain = make_case("lm_head");
  Harness hp(plain);
  EXPECT_EQ(at(hp.forward(in)->out[0], 0), at(p->out[0], 0));
}

TEST(TiedLmHeadLoss, TargetOutsideVocabularyThrows) {
  Case c = make_case("lm_head");
  Harness h(c);
  std::vector<Tensor> in = c.make_inputs(0);
  in[1].data<int32_t>()[3] = 4321;
  try {
    h.forward(in);
    ADD_FAILURE() << "no error for target 4321";
  } catch (const Error& e) {
    EXPECT_PRED2(contains, std::string(e.what()), "4321");
  }
}

TEST(Embedding, OutOfRangeTokenThrowsNamingIt) {
  Case c = make_case("embedding");
  Harness h(c);
  for (int32_t bad : {1234, -7, static_cast<int32_t>(kV)}) {
    std::vector<Tensor> in = c.make_inputs(0);
    in[0].data<int32_t>()[kT + 2] = bad;
    try {
      h.forward(in);
      ADD_FAILURE() << "no error for token " << bad;
    } catch (const Error& e) {
      EXPECT_PRED2(contains, std::string(e.what()), std::to_string(bad));
    }
  }
  // The last valid id is accepted.
  std::vector<Tensor> in = c.make_inputs(0);
  in[0].data<int32_t>()[0] = static_cast<int32_t>(kV - 1);
  EXPECT_NO_THROW(h.forward(in));
}

TEST(Embedding, SequenceLongerThanPositionTableIsRejected) {
  Case c = make_case("embedding");
  const Shape ok{kB, kPos}, too_long{kB, kPos + 1};
  EXPECT_NO_THROW(c.layer->output_shapes(std::span<const Shape>(&ok, 1)));
  EXPECT_THROW(c.layer->output_shapes(std::span<const Shape>(&too_long, 1)), Error);
}

TEST(CausalSelfAttention, LaterPositionsDoNotAffectEarlierOutputs) {
  Case c = make_case("attention");
  Harness h(c);
  const std::vector<Tensor> in = c.make_inputs(0);
  const Tensor base = h.forward(in)->out[0].clone();
  for (int64_t t = 0; t < kT; ++t) {
    std::vector<Tensor> changed = {in[0].clone()};
    // Change q, k and v of position t in batch row 1 only.
    for (int64_t j = 0; j < 3 * kC; ++j)
      changed[0].data<float>()[(1 * kT + t) * 3 * kC + j] += 0.5f + 0.1f * float(j % 3);
    const Tensor out = h.forward(changed)->out[0].clone();
    for (int64_t b = 0; b < kB; ++b)
      for (int64_t s = 0; s < kT; ++s) {
        const bool same =
            std::memcmp(out.data<float>() + (b * kT + s) * kC,
                        base.data<float>() + (b * kT + s) * kC, kC * sizeof(float)) == 0;
        if (b == 0 || s < t)
          EXPECT_TRUE(same) << "position " << s << " of row " << b << " saw position " << t;
        else
          EXPECT_FALSE(same) << "position " << s << " ignored position " << t;
      }
  }
}

TEST(CausalSelfAttention, GradientDoesNotFlowBackwardInTime) {
  // d out[s] / d in[t] = 0 for t > s: with grad_out nonzero only at position s, the
  // input gradient is exactly zero at every later position.
  Case c = make_case("attention");
  const std::vector<Tensor> in = c.make_inputs(0);
  for (int64_t s = 0; s < kT; ++s) {
    Pass p;
    Tensor x = p.arena.alloc(in[0].shape());
    x.copy_from(in[0]);
    Tensor out = p.arena.alloc({kB, kT, kC});
    p.ctx = c.layer->make_ctx();
    const Tensor ins[] = {x}, outs[] = {out};
    c.layer->forward(*p.ctx, p.arena, ins, outs);
    Tensor dy = p.arena.zeros({kB, kT, kC});
    for (int64_t b = 0; b < kB; ++b)
      for (int64_t j = 0; j < kC; ++j) dy.data<float>()[(b * kT + s) * kC + j] = 1.0f;
    Tensor dx = p.arena.zeros(in[0].shape());
    const Tensor gos[] = {dy}, gis[] = {dx};
    c.layer->backward_input(*p.ctx, p.arena, gos, gis);
    for (int64_t b = 0; b < kB; ++b)
      for (int64_t t = 0; t < kT; ++t) {
        double norm = 0;
        for (int64_t j = 0; j < 3 * kC; ++j) norm += std::abs(at(dx, (b * kT + t) * 3 * kC + j));
        if (t > s)
          EXPECT_EQ(norm, 0.0) << "position " << t << " got gradient from output " << s;
        else
          EXPECT_GT(norm, 0.0) << "position " << t << " got no gradient from output " << s;
      }
  }
}

TEST(CausalSelfAttention, HeadsMustDivideWidth) {
  EXPECT_THROW(CausalSelfAttention(0), Error);
  CausalSelfAttention attn(3);
  const Shape bad{kB, kT, 3 * kC}, good{kB, kT, 3 * 9};
  EXPECT_THROW(attn.output_shapes(std::span<const Shape>(&bad, 1)), Error);
  EXPECT_EQ(attn.output_shapes(std::span<const Shape>(&good, 1))[0], (Shape{kB, kT, 9}));
}

// The CPU has one attention method: the fused one (cuDNN's) is refused
// there, and the CPU layer keeps its probs (B, H, T, T) whatever is asked.
TEST(CausalSelfAttention, CpuIsAlwaysUnfused) {
  const Device cpu = Device::cpu();
  EXPECT_TRUE(testing::contains(
      testing::error_message([&] { ops::set_attention_backend(cpu, ops::AttentionBackend::Fused); }),
      "fused attention is cuDNN's, for CUDA devices"));
  ops::set_attention_backend(cpu, ops::AttentionBackend::Unfused);  // accepted: it is what runs
  EXPECT_EQ(ops::attention_backend(cpu), ops::AttentionBackend::Unfused);
  EXPECT_FALSE(ops::attention_uses_fused(cpu, 64));
  Tensor qkv = Tensor::zeros({1, 4, 3 * 16}), out = Tensor::zeros({1, 4, 16});
  Tensor lse = Tensor::zeros({1, 2, 4});
  EXPECT_TRUE(testing::contains(
      testing::error_message([&] { ops::attention_forward_fused(qkv, out, lse, 2, 2); }),
      "attention_forward_fused on cpu"));
  CausalSelfAttention attn(2);
  Arena arena;
  auto ctx = attn.make_ctx();
  Tensor in[1] = {qkv}, outs[1] = {out};
  attn.forward(*ctx, arena, in, outs);
  EXPECT_EQ(arena.used(), Arena::bytes_for({1, 2, 4, 4}));
  EXPECT_EQ(std::string(ops::attention_backend_name(ops::parse_attention_backend("fused"))),
            "fused");
  EXPECT_TRUE(testing::contains(
      testing::error_message([] { ops::parse_attention_backend("flash"); }),
      "attention backend 'flash' is not one of auto, unfused, fused"));
}

TEST(Linear, ShapesAndParams) {
  ParamStore s;
  Param* w = make_param(s, "w", {kC, 6}, 0.5f, 0.0f, 1);
  Param* b = make_param(s, "b", {6}, 0.5f, 0.0f, 1);
  Param* wrong_b = make_param(s, "wrong_b", {5}, 0.5f, 0.0f, 1);
  Linear with_bias(w, b), no_bias(w, nullptr);
  EXPECT_EQ(with_bias.params().size(), 2u);
  EXPECT_EQ(no_bias.params().size(), 1u);
  const Shape x{3, 4, kC}, bad{3, 4, kC + 1};
  EXPECT_EQ(with_bias.output_shapes(std::span<const Shape>(&x, 1))[0], (Shape{3, 4, 6}));
  EXPECT_THROW(with_bias.output_shapes(std::span<const Shape>(&bad, 1)), Error);
  EXPECT_THROW(Linear(w, wrong_b), Error);
}


// The automatic chunks: the fewest whose fp32 logits fit the device's
// budget, the rows split evenly over them, and no chunking where all fit.
TEST(TiedLmHeadLoss, ChunksAreTheFewestThatFitSplitEvenly) {
  const Device cpu = Device::cpu(), gpu = Device::cuda(0);
  const int64_t n = 16 * 1024, v = 50304;  // GPT-2 at B 16, T 1024, padded vocabulary
  EXPECT_EQ(TiedLmHeadLoss::chunk_rows(n, v, gpu), 1261);  // 13 chunks, the last of 1252
  EXPECT_EQ(TiedLmHeadLoss::chunk_rows(n, v, cpu), 1261);
  EXPECT_EQ(TiedLmHeadLoss::chunk_rows(n, v, gpu, 2), 2341);  // bf16 logits: 7 of 0.22 GiB
  EXPECT_THROW(TiedLmHeadLoss::chunk_rows(n, v, gpu, 0), Error);
  for (const Device& d : {cpu, gpu})
    for (int64_t rows : {int64_t{1}, int64_t{7}, n - 1, n, n + 1, 3 * n}) {
      const int64_t r = TiedLmHeadLoss::chunk_rows(rows, v, d);
      const int64_t most = TiedLmHeadLoss::chunk_bytes(d) / (4 * v);
      const int64_t chunks = (rows + r - 1) / r;
      EXPECT_LE(r, std::max<int64_t>(most, 1)) << rows;  // a chunk's logits fit
      EXPECT_EQ(chunks, (rows + most - 1) / most) << rows;  // in the fewest chunks
      EXPECT_GT(rows - (chunks - 1) * r, r - chunks) << rows;  // the last is not a sliver
    }
  EXPECT_EQ(TiedLmHeadLoss::chunk_rows(100, 64, cpu), 100);  // all fit: one chunk
  // Wider than the budget holds in one row: a row per chunk.
  EXPECT_EQ(TiedLmHeadLoss::chunk_rows(5, int64_t{1} << 27, cpu), 1);
}

// bf16 activations: the chunked and the whole LM head both write bf16
// logits, replace them by bf16 dlogits and run the backward GEMMs on those
// with the weight's bf16 copy. With bf16 GEMMs (both round every operand to
// bf16) and a loss gradient of 0.5 (a power of two, so rounding p - onehot
// and then scaling equals rounding the scaled value), both get the same
// bf16 operands and differ at most in fp32 summation order (~1e-6
// relative). A bf16 logit, dlogit or dx element either agrees or, where the
// two fp32 sums straddle a rounding boundary, is one bf16 unit (2^-8
// relative) apart; a logit one unit off moves its row's loss by at most
// twice that unit (the loss's gradient in the logits has an L1 norm of at
// most 2), under 1e-3 of this loss (about 11 log 37). 1e-3 bounds all three
// with margin; a lost or doubled chunk is off by a third or more.
TEST(TiedLmHeadLoss, ChunkedBf16DlogitsGiveTheWholeHeadsGradients) {
  struct Precision {
    Precision() { ops::set_matmul_precision(Device::cpu(), ops::MatmulPrecision::Bf16); }
    ~Precision() { ops::set_matmul_precision(Device::cpu(), ops::MatmulPrecision::Fp32); }
  } precision;
  const int64_t n = 11, c = 16, v = 37;
  struct Run {
    double loss;
    Tensor dx, dw;
  };
  auto run = [&](bool chunked) {
    ParamStore s;
    Param* wte = make_param(s, "wte", {v, c}, 0.5f, 0.0f, 7);
    wte->value16 = Tensor::empty(wte->value.shape(), DType::BF16);
    ops::convert(wte->value, wte->value16);
    TiedLmHeadLoss head(wte);
    if (chunked) head.set_chunk_rows(4);
    Tensor x32 = Tensor::empty({n, c}), targets = Tensor::empty({n}, DType::I32);
    fill_uniform(x32, 8);
    for (int64_t i = 0; i < n; ++i) targets.data<int32_t>()[i] = static_cast<int32_t>(i * 5 % v);
    Tensor x = Tensor::empty({n, c}, DType::BF16), loss = Tensor::zeros({1});
    ops::convert(x32, x);
    Arena arena;
    auto ctx = head.make_ctx();
    const Tensor in[2] = {x, targets}, out[1] = {loss};
    head.forward(*ctx, arena, in, out);
    Tensor g = Tensor::zeros({1});
    ops::set_item(g, 0.5f);
    Run r{ops::item(loss), Tensor::zeros({n, c}, DType::BF16), Tensor()};
    const Tensor grad_out[1] = {g}, grad_in[2] = {r.dx, Tensor()};
    head.backward_input(*ctx, arena, grad_out, grad_in);
    head.backward_weight(*ctx, arena);
    r.dw = wte->grad;
    Tensor dx32 = Tensor::empty({n, c});
    ops::convert(r.dx, dx32);
    r.dx = dx32;
    return r;
  };
  const Run whole = run(false), chunked = run(true);
  EXPECT_NEAR(chunked.loss, whole.loss, 1e-3 * whole.loss);
  EXPECT_LT(testing::rel_error(chunked.dx, whole.dx), 1e-3);
  EXPECT_LT(testing::rel_error(chunked.dw, whole.dw), 1e-3);
  EXPECT_GT(testing::rel_error(chunked.dw, Tensor::zeros({v, c})), 0.5) << "no gradient at all";
}

// bf16 activations: the head's loss is the softmax cross-entropy of the
// logits rounded to bf16 (as PyTorch's autocast and llm.c compute it), and
// its dx comes from bf16 dlogits, whole or chunked. The inputs make every
// logit a + s b exact in fp32 (x = (1, s) and rows (a, b) of a few
// significant bits), so the GEMM's fp32 logit is exact and its bf16
// rounding is known: the reference rounds the same values in double. What
// is left is the fp32 classifier's error, about (V + 10) 2^-24 of a row's
// loss, far under the 1e-5 bound per row; the loss of the unrounded logits
// is 100 times that bound away, so fp32 logits would fail. A dlogit is
// fp32 p - onehot rounded once: it may round one bf16 unit (2^-8 of it)
// away from the double reference's rounding where the two straddle a
// boundary, so dx's bound is 2^-8 sum_j |d_j| |w_j| plus fp32 sums.
TEST(TiedLmHeadLoss, Bf16ActivationsGiveTheLossOfBf16Logits) {
  const int64_t n = 6, c = 2, v = 37;
  ParamStore s;
  Param* wte = make_param(s, "wte", {v, c}, 0.5f, 0.0f, 3);
  for (int64_t j = 0; j < v; ++j) {
    float* row = wte->value.data<float>() + j * c;
    row[0] = round_to_bf16(row[0] * 4.0f);                             // a: 8 bits
    row[1] = static_cast<float>(2 * (j % 7) + 1) * std::ldexp(1.0f, -9);  // b: odd units of 2^-9
  }
  wte->value16 = Tensor::empty(wte->value.shape(), DType::BF16);
  ops::convert(wte->value, wte->value16);
  Tensor x32 = Tensor::empty({n, c}), targets = Tensor::empty({n}, DType::I32);
  for (int64_t i = 0; i < n; ++i) {
    x32.data<float>()[i * c] = 1.0f;
    x32.data<float>()[i * c + 1] = static_cast<float>(1 + i % 3);
    targets.data<int32_t>()[i] = static_cast<int32_t>((i * 11) % v);
  }
  Tensor x = Tensor::empty({n, c}, DType::BF16);
  ops::convert(x32, x);
  // The reference in double: logits, rounded and not, the loss, and dx for g.
  const float g = 0.25f;
  double want = 0, unrounded = 0;
  std::vector<double> dx_want(n * c, 0.0), dx_bound(n * c, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    std::vector<double> z(v), zr(v);
    double m = -1e300, mr = -1e300;
    for (int64_t j = 0; j < v; ++j) {
      const float* w = wte->value.data<float>() + j * c;
      const float exact = w[0] * x32.data<float>()[i * c] + w[1] * x32.data<float>()[i * c + 1];
      zr[j] = exact;
      z[j] = round_to_bf16(exact);
      m = std::max(m, z[j]), mr = std::max(mr, zr[j]);
    }
    double se = 0, ser = 0;
    for (int64_t j = 0; j < v; ++j) se += std::exp(z[j] - m), ser += std::exp(zr[j] - mr);
    const int32_t t = targets.data<int32_t>()[i];
    want += std::log(se) + m - z[t];
    unrounded += std::log(ser) + mr - zr[t];
    for (int64_t j = 0; j < v; ++j) {
      const double d = round_to_bf16(static_cast<float>(std::exp(z[j] - m) / se - (j == t)));
      for (int64_t k = 0; k < c; ++k) {
        const double w = wte->value.data<float>()[j * c + k];
        dx_want[i * c + k] += g * d * w;
        dx_bound[i * c + k] += g * (std::ldexp(std::fabs(d), -8) + 1e-6) * std::fabs(w);
      }
    }
  }
  const double bound = 1e-5 * static_cast<double>(n);
  ASSERT_GT(std::fabs(unrounded - want), 100 * bound) << "the inputs do not tell bf16 logits";
  for (const int64_t rows : {int64_t{0}, int64_t{4}}) {  // whole, then chunks of 4 rows
    TiedLmHeadLoss head(wte);
    head.set_chunk_rows(rows);
    Tensor loss = Tensor::zeros({1}), gt = Tensor::zeros({1});
    ops::set_item(gt, g);
    Tensor dx = Tensor::zeros({n, c});
    Arena arena;
    auto ctx = head.make_ctx();
    const Tensor in[2] = {x, targets}, out[1] = {loss}, grad_out[1] = {gt};
    const Tensor grad_in[2] = {dx, Tensor()};
    head.forward(*ctx, arena, in, out);
    EXPECT_NEAR(ops::item(loss), want, bound) << "rows " << rows;
    head.backward_input(*ctx, arena, grad_out, grad_in);
    for (int64_t e = 0; e < n * c; ++e)
      EXPECT_NEAR(dx.data<float>()[e], dx_want[e], dx_bound[e] + 1e-6)
          << "rows " << rows << " at " << e;
  }
}

// The installed helper (weft/gradcheck.h) passes a correct layer, inputs and
// parameters both, and names what a wrong backward got wrong: here a
// LayerNorm whose input gradient is off by 3%, a term of the size a
// forgotten piece of a gradient would have.
class OffByThreePercent final : public Layer {
 public:
  explicit OffByThreePercent(std::unique_ptr<Layer> inner) : inner_(std::move(inner)) {}
  const char* kind() const override { return "off_by_3_percent"; }
  std::vector<Shape> output_shapes(std::span<const Shape> in) const override {
    return inner_->output_shapes(in);
  }
  std::vector<Param*> params() const override { return inner_->params(); }
  std::unique_ptr<LayerCtx> make_ctx() const override { return inner_->make_ctx(); }
  void forward(LayerCtx& ctx, Arena& arena, std::span<const Tensor> in,
               std::span<const Tensor> out) override {
    inner_->forward(ctx, arena, in, out);
  }
  void backward_input(LayerCtx& ctx, Arena& arena, std::span<const Tensor> grad_out,
                      std::span<const Tensor> grad_in) override {
    inner_->backward_input(ctx, arena, grad_out, grad_in);
    ops::scale(grad_in[0], 1.03f);
  }
  void backward_weight(LayerCtx& ctx, Arena& arena) override { inner_->backward_weight(ctx, arena); }

 private:
  std::unique_ptr<Layer> inner_;
};

TEST(GradCheck, PassesACorrectLayerAndNamesAWrongOne) {
  ParamStore store;
  Param* w = store.create("ln.weight", {6}, Init::normal(1.0f));
  Param* b = store.create("ln.bias", {6}, Init::normal(1.0f));
  init_param(*w, 1);
  init_param(*b, 2);
  const Tensor x = uniform({4, 6}, 3);
  LayerNorm ln(w, b);
  const GradCheck good = check_gradients(ln, {x});
  EXPECT_TRUE(good.ok()) << good.describe();
  EXPECT_EQ(good.bad, 0) << good.describe();
  EXPECT_NE(good.compared.find("input 0 (24 elements), ln.weight (6 elements), ln.bias"),
            std::string::npos)
      << good.compared;
  OffByThreePercent wrong(std::make_unique<LayerNorm>(w, b));
  const GradCheck bad = check_gradients(wrong, {x});
  EXPECT_FALSE(bad.ok()) << bad.describe();
  EXPECT_EQ(bad.worst, "input 0") << bad.describe();
  EXPECT_GT(bad.bad, 0);
  EXPECT_NE(bad.describe().find("do not match"), std::string::npos) << bad.describe();
}

}  // namespace
}  // namespace weft
