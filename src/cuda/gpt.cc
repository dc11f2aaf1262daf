// GPT-2 forward and backward on one GPU: models/gpt.cc's graph, written out as
// kernel calls. The backward pass is the forward read backwards, one layer
// call per line, with the CPU layers' accumulation rules (gradients +=).
#include <weft/cuda/gpt.h>

#include <algorithm>
#include <cmath>

namespace weft::cuda {

void GptShape::validate() const {
  check(vocab > 0 && positions > 0 && layers > 0 && hidden > 0 && heads > 0 && seq > 0 &&
            batch > 0,
        "GPT shape: every size must be positive (vocab {}, positions {}, layers {}, hidden {}, "
        "heads {}, seq {}, batch {})",
        vocab, positions, layers, hidden, heads, seq, batch);
  check(hidden % heads == 0, "GPT shape: heads ({}) must divide the hidden size ({})", heads,
        hidden);
  check(seq <= positions, "GPT shape: sequence length ({}) must not exceed the positions ({})", seq,
        positions);
}

int64_t GptStep::add_entry(const std::string& name, Shape shape) {
  entries_.push_back(Entry{name, shape, total_});
  total_ += shape.numel();
  return entries_.back().offset;
}

GptStep::GptStep(const GptShape& shape, const ParamStore& params, MathMode mode, int device)
    : shape_(shape), mode_(mode), ctx_(&weft::cuda::context(device)) {
  shape_.validate();
  const int64_t c = shape_.hidden;
  wte_ = add_entry("wte.weight", {shape_.vocab, c});
  wpe_ = add_entry("wpe.weight", {shape_.positions, c});
  for (int64_t i = 0; i < shape_.layers; ++i) {
    const std::string h = fmt::format("h.{}.", i);
    Block b{};
    b.ln1_w = add_entry(h + "ln_1.weight", {c});
    b.ln1_b = add_entry(h + "ln_1.bias", {c});
    b.attn_w = add_entry(h + "attn.c_attn.weight", {c, 3 * c});
    b.attn_b = add_entry(h + "attn.c_attn.bias", {3 * c});
    b.attn_proj_w = add_entry(h + "attn.c_proj.weight", {c, c});
    b.attn_proj_b = add_entry(h + "attn.c_proj.bias", {c});
    b.ln2_w = add_entry(h + "ln_2.weight", {c});
    b.ln2_b = add_entry(h + "ln_2.bias", {c});
    b.fc_w = add_entry(h + "mlp.c_fc.weight", {c, 4 * c});
    b.fc_b = add_entry(h + "mlp.c_fc.bias", {4 * c});
    b.mlp_proj_w = add_entry(h + "mlp.c_proj.weight", {4 * c, c});
    b.mlp_proj_b = add_entry(h + "mlp.c_proj.bias", {c});
    blocks_.push_back(b);
  }
  lnf_w_ = add_entry("ln_f.weight", {c});
  lnf_b_ = add_entry("ln_f.bias", {c});

  Context& ctx = *ctx_;
  params_ = DeviceBuffer<float>(ctx, total_);
  grads_ = DeviceBuffer<float>(ctx, total_);
  m_ = DeviceBuffer<float>(ctx, total_);
  v_ = DeviceBuffer<float>(ctx, total_);
  for (const Entry& e : entries_) {
    const Param* prm = params.find(e.name);
    check(prm != nullptr, "GPU GPT: the parameter store has no '{}' {}", e.name, e.shape.str());
    check(prm->value.shape() == e.shape && prm->value.dtype() == DType::F32 &&
              prm->value.device().is_cpu(),
          "GPU GPT: parameter '{}' is {} {} on {}, expected F32 {} on cpu", e.name,
          dtype_name(prm->value.dtype()), prm->value.shape().str(), prm->value.device().str(),
          e.shape.str());
    upload(ctx, p(e.offset), prm->value.raw(), prm->value.nbytes());
  }
  zero(ctx, grads_.data(), grads_.bytes());
  zero(ctx, m_.data(), m_.bytes());
  zero(ctx, v_.data(), v_.bytes());
}

double GptStep::forward_backward(const int32_t* tokens, const int32_t* targets, float grad_scale) {
  return run(tokens, targets, true, grad_scale);
}

double GptStep::forward(const int32_t* tokens, const int32_t* targets) {
  return run(tokens, targets, false, 0.0f);
}

double GptStep::run(const int32_t* tokens, const int32_t* targets, bool backward,
                    float grad_scale) {
  const int64_t B = shape_.batch, T = shape_.seq, C = shape_.hidden, H = shape_.heads;
  const int64_t V = shape_.vocab, L = shape_.layers, N = B * T;
  for (int64_t i = 0; i < N; ++i) {
    check(tokens[i] >= 0 && tokens[i] < V,
          "token {} at position {} is outside the vocabulary [0, {})", tokens[i], i, V);
    check(targets[i] >= 0 && targets[i] < V,
          "target token {} at position {} is outside the vocabulary [0, {})", targets[i], i, V);
  }
  Context& ctx = *ctx_;
  const MathMode mode = mode_;
  constexpr float kEps = 1e-5f;
  // Tokens and targets in one upload: a second upload would wait for the
  // first to leave the staging buffer, i.e. for the GPU to drain.
  std::vector<int32_t> io(static_cast<size_t>(2 * N));
  std::copy(tokens, tokens + N, io.begin());
  std::copy(targets, targets + N, io.begin() + N);
  DeviceBuffer<int32_t> io_d(ctx, 2 * N);
  upload(ctx, io_d.data(), io.data(), io_d.bytes());
  const int32_t* tok = io_d.data();
  const int32_t* tgt = io_d.data() + N;

  // What each block keeps from forward for backward. x is the block's input
  // (the residual stream), xm the stream between attention and MLP.
  struct Saved {
    DeviceBuffer<float> x, ln1, ln1_mean, ln1_rstd, qkv, probs, atty, xm, ln2, ln2_mean,
        ln2_rstd, fc, gelu;
  };
  std::vector<Saved> saved(static_cast<size_t>(L));
  for (Saved& s : saved) {
    s.x = DeviceBuffer<float>(ctx, N * C);
    s.ln1 = DeviceBuffer<float>(ctx, N * C);
    s.ln1_mean = DeviceBuffer<float>(ctx, N);
    s.ln1_rstd = DeviceBuffer<float>(ctx, N);
    s.qkv = DeviceBuffer<float>(ctx, N * 3 * C);
    s.probs = DeviceBuffer<float>(ctx, B * H * T * T);
    s.atty = DeviceBuffer<float>(ctx, N * C);
    s.xm = DeviceBuffer<float>(ctx, N * C);
    s.ln2 = DeviceBuffer<float>(ctx, N * C);
    s.ln2_mean = DeviceBuffer<float>(ctx, N);
    s.ln2_rstd = DeviceBuffer<float>(ctx, N);
    s.fc = DeviceBuffer<float>(ctx, N * 4 * C);
    s.gelu = DeviceBuffer<float>(ctx, N * 4 * C);
  }
  DeviceBuffer<float> x_out(ctx, N * C), lnf(ctx, N * C), lnf_mean(ctx, N), lnf_rstd(ctx, N);
  DeviceBuffer<float> logits(ctx, N * V), losses(ctx, N);
  DeviceBuffer<double> loss_sum(ctx, 1);

  // ---- forward ----
  embedding_forward(ctx, tok, p(wte_), p(wpe_), saved[0].x.data(), B, T, C);
  for (int64_t l = 0; l < L; ++l) {
    Saved& s = saved[static_cast<size_t>(l)];
    const Block& w = blocks_[static_cast<size_t>(l)];
    float* x_next = l + 1 < L ? saved[static_cast<size_t>(l + 1)].x.data() : x_out.data();
    layernorm_forward(ctx, s.x.data(), p(w.ln1_w), p(w.ln1_b), s.ln1.data(), s.ln1_mean.data(),
                      s.ln1_rstd.data(), N, C, kEps);
    gemm(ctx, mode, false, false, N, 3 * C, C, 1.0f, s.ln1.data(), C, p(w.attn_w), 3 * C, 0.0f,
         s.qkv.data(), 3 * C);
    add_bias(ctx, s.qkv.data(), p(w.attn_b), N, 3 * C);
    attention_forward(ctx, mode, s.qkv.data(), s.atty.data(), s.probs.data(), B, T, H, C);
    // xm = x + (atty W + b): the projection accumulates onto a copy of the stream.
    copy_device(ctx, s.xm.data(), s.x.data(), s.xm.bytes());
    gemm(ctx, mode, false, false, N, C, C, 1.0f, s.atty.data(), C, p(w.attn_proj_w), C, 1.0f,
         s.xm.data(), C);
    add_bias(ctx, s.xm.data(), p(w.attn_proj_b), N, C);
    layernorm_forward(ctx, s.xm.data(), p(w.ln2_w), p(w.ln2_b), s.ln2.data(), s.ln2_mean.data(),
                      s.ln2_rstd.data(), N, C, kEps);
    gemm(ctx, mode, false, false, N, 4 * C, C, 1.0f, s.ln2.data(), C, p(w.fc_w), 4 * C, 0.0f,
         s.fc.data(), 4 * C);
    add_bias(ctx, s.fc.data(), p(w.fc_b), N, 4 * C);
    gelu_forward(ctx, s.fc.data(), s.gelu.data(), N * 4 * C);
    copy_device(ctx, x_next, s.xm.data(), s.xm.bytes());
    gemm(ctx, mode, false, false, N, C, 4 * C, 1.0f, s.gelu.data(), 4 * C, p(w.mlp_proj_w), C,
         1.0f, x_next, C);
    add_bias(ctx, x_next, p(w.mlp_proj_b), N, C);
  }
  layernorm_forward(ctx, x_out.data(), p(lnf_w_), p(lnf_b_), lnf.data(), lnf_mean.data(),
                    lnf_rstd.data(), N, C, kEps);
  // logits (N, V) = lnf wte^T
  gemm(ctx, mode, false, true, N, V, C, 1.0f, lnf.data(), C, p(wte_), C, 0.0f, logits.data(), V);
  if (!backward) {
    softmax_cross_entropy(ctx, logits.data(), tgt, losses.data(), N, V);
    sum(ctx, losses.data(), N, loss_sum.data());
  } else {
    // logits become dlogits = (softmax - onehot) * grad_scale.
    fused_cross_entropy(ctx, logits.data(), tgt, losses.data(), grad_scale, N, V);
    sum(ctx, losses.data(), N, loss_sum.data());

    // ---- backward ----
    DeviceBuffer<float> dres(ctx, N * C), dln(ctx, N * C), datty(ctx, N * C);
    DeviceBuffer<float> dqkv(ctx, N * 3 * C), dgelu(ctx, N * 4 * C), dfc(ctx, N * 4 * C);
    DeviceBuffer<float> att_scratch(ctx, B * H * T * T);
    const float* dlogits = logits.data();
    // lm head: dlnf = dlogits wte; dwte += dlogits^T lnf
    gemm(ctx, mode, false, false, N, C, V, 1.0f, dlogits, V, p(wte_), C, 0.0f, dln.data(), C);
    gemm(ctx, mode, true, false, V, C, N, 1.0f, dlogits, V, lnf.data(), C, 1.0f, g(wte_), C);
    zero(ctx, dres.data(), dres.bytes());
    layernorm_backward_input(ctx, dln.data(), x_out.data(), p(lnf_w_), lnf_mean.data(),
                             lnf_rstd.data(), dres.data(), N, C);
    layernorm_backward_weight(ctx, dln.data(), x_out.data(), lnf_mean.data(), lnf_rstd.data(),
                              g(lnf_w_), g(lnf_b_), N, C);
    for (int64_t l = L - 1; l >= 0; --l) {
      Saved& s = saved[static_cast<size_t>(l)];
      const Block& w = blocks_[static_cast<size_t>(l)];
      // x_next = xm + gelu W_proj + b_proj: dres flows to xm unchanged
      gemm(ctx, mode, true, false, 4 * C, C, N, 1.0f, s.gelu.data(), 4 * C, dres.data(), C, 1.0f,
           g(w.mlp_proj_w), C);
      sum_rows(ctx, dres.data(), g(w.mlp_proj_b), N, C);
      gemm(ctx, mode, false, true, N, 4 * C, C, 1.0f, dres.data(), C, p(w.mlp_proj_w), C, 0.0f,
           dgelu.data(), 4 * C);
      zero(ctx, dfc.data(), dfc.bytes());
      gelu_backward(ctx, dgelu.data(), s.fc.data(), dfc.data(), N * 4 * C);
      gemm(ctx, mode, true, false, C, 4 * C, N, 1.0f, s.ln2.data(), C, dfc.data(), 4 * C, 1.0f,
           g(w.fc_w), 4 * C);
      sum_rows(ctx, dfc.data(), g(w.fc_b), N, 4 * C);
      gemm(ctx, mode, false, true, N, C, 4 * C, 1.0f, dfc.data(), 4 * C, p(w.fc_w), 4 * C, 0.0f,
           dln.data(), C);
      layernorm_backward_input(ctx, dln.data(), s.xm.data(), p(w.ln2_w), s.ln2_mean.data(),
                               s.ln2_rstd.data(), dres.data(), N, C);
      layernorm_backward_weight(ctx, dln.data(), s.xm.data(), s.ln2_mean.data(),
                                s.ln2_rstd.data(), g(w.ln2_w), g(w.ln2_b), N, C);
      // xm = x + atty W_attn_proj + b: dres (now d/dxm) flows to x unchanged
      gemm(ctx, mode, true, false, C, C, N, 1.0f, s.atty.data(), C, dres.data(), C, 1.0f,
           g(w.attn_proj_w), C);
      sum_rows(ctx, dres.data(), g(w.attn_proj_b), N, C);
      gemm(ctx, mode, false, true, N, C, C, 1.0f, dres.data(), C, p(w.attn_proj_w), C, 0.0f,
           datty.data(), C);
      zero(ctx, dqkv.data(), dqkv.bytes());
      attention_backward(ctx, mode, datty.data(), s.qkv.data(), s.probs.data(), dqkv.data(),
                         att_scratch.data(), B, T, H, C);
      gemm(ctx, mode, true, false, C, 3 * C, N, 1.0f, s.ln1.data(), C, dqkv.data(), 3 * C, 1.0f,
           g(w.attn_w), 3 * C);
      sum_rows(ctx, dqkv.data(), g(w.attn_b), N, 3 * C);
      gemm(ctx, mode, false, true, N, C, 3 * C, 1.0f, dqkv.data(), 3 * C, p(w.attn_w), 3 * C, 0.0f,
           dln.data(), C);
      layernorm_backward_input(ctx, dln.data(), s.x.data(), p(w.ln1_w), s.ln1_mean.data(),
                               s.ln1_rstd.data(), dres.data(), N, C);
      layernorm_backward_weight(ctx, dln.data(), s.x.data(), s.ln1_mean.data(), s.ln1_rstd.data(),
                                g(w.ln1_w), g(w.ln1_b), N, C);
    }
    embedding_backward(ctx, tok, dres.data(), g(wte_), g(wpe_), B, T, C);
  }
  double loss = 0;
  download(ctx, &loss, loss_sum.data(), sizeof loss);  // waits for the whole step
  return loss;
}

void GptStep::zero_grads() { zero(*ctx_, grads_.data(), grads_.bytes()); }

double GptStep::grad_norm() { return std::sqrt(sum_squares_to_host(*ctx_, grads_.data(), total_)); }

void GptStep::clip_grads(double max_norm, double norm) {
  if (max_norm <= 0) return;
  const double coef = max_norm / (norm + 1e-6);
  if (coef >= 1.0) return;
  scale_inplace(*ctx_, grads_.data(), static_cast<float>(coef), total_);
}

void GptStep::adamw_step(float lr, const AdamWConfig& config) {
  ++steps_;
  for (const Entry& e : entries_) {
    // Param::weight_decay(): matrices and embeddings, not biases or norms.
    const float wd = e.shape.rank >= 2 ? config.weight_decay : 0.0f;
    adamw(*ctx_, p(e.offset), g(e.offset), m_.data() + e.offset, v_.data() + e.offset,
          e.shape.numel(), lr, config.beta1, config.beta2, config.eps, wd, steps_);
  }
}

void GptStep::copy_params_to(ParamStore& params) {
  for (const Entry& e : entries_) {
    Param* prm = params.find(e.name);
    check(prm != nullptr && prm->value.shape() == e.shape && prm->value.device().is_cpu(),
          "GPU GPT: cannot copy '{}' {} back: the store lacks it or holds another shape", e.name,
          e.shape.str());
    download(*ctx_, prm->value.raw(), p(e.offset), prm->value.nbytes());
  }
}

void GptStep::copy_grads_to(ParamStore& params) {
  for (const Entry& e : entries_) {
    Param* prm = params.find(e.name);
    check(prm != nullptr && prm->grad.shape() == e.shape && prm->grad.device().is_cpu(),
          "GPU GPT: cannot copy the gradient of '{}' {} back", e.name, e.shape.str());
    download(*ctx_, prm->grad.raw(), g(e.offset), prm->grad.nbytes());
  }
}

}  // namespace weft::cuda
