// One layer class, two devices: every layer of layers/ runs forward,
// backward_input and backward_weight through weft/ops.h on cuda:0 and on the
// CPU from the same inputs and parameters, and the GPU's outputs, input
// gradients and parameter gradients match the CPU's.
//
// Error model (fp32 GEMMs, no TF32): both devices compute every element in
// fp32 and differ only in the order of reductions: a GEMM or row sum over K
// terms differs by about 2^-24 * sqrt(K) relative (K <= 1024 here: 2e-6), and
// the softmaxes of attention and cross-entropy add a few more roundings per
// element. 1e-5 relative (||gpu - cpu|| / ||cpu||) covers that with margin;
// an indexing or accumulation bug gives O(1). The token-embedding gradient is
// a scatter-add with atomics on the GPU: the same sums in another order.
// Shapes are ragged (T = 37, C = 48, V = 1000). Needs a GPU; exits 77 without.
#include "weft_config.h"

#if WEFT_CUDA
#include <weft/arena.h>
#include <weft/cuda/runtime.h>
#include <weft/ops.h>
#include <weft/param.h>

#include "layers/attention.h"
#include "layers/embedding.h"
#include "layers/gelu.h"
#include "layers/gelu_mlp.h"
#include "layers/layernorm.h"
#include "layers/linear.h"
#include "layers/lm_head.h"
#include "layers/residual.h"
#include "layers/rmsnorm.h"
#include "layers/rotary.h"
#include "layers/swiglu.h"

#include <weft/local_communicator.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "test_util.h"

namespace weft {
namespace {

using testing::rel_error;
using testing::uniform_tensor;

constexpr double kFp32 = 1e-5;
const Device kGpu = Device::cuda(0);

Tensor on(const Tensor& t, Device d) {
  Tensor out = Tensor::empty(t.shape(), t.dtype(), d);
  out.copy_from(t);
  return out;
}

// A layer built twice: over CPU parameters and over GPU copies of them.
struct Twin {
  std::deque<Param> cpu, gpu;
  Param* add(const std::string& name, Tensor value) {
    Param& c = cpu.emplace_back();
    c.name = name, c.value = value, c.grad = Tensor::zeros(value.shape());
    c.shard.full = value.shape();
    Param& g = gpu.emplace_back();
    g.name = name, g.value = on(value, kGpu), g.grad = Tensor::zeros(value.shape(), DType::F32, kGpu);
    g.shard.full = value.shape();
    return &c;
  }
  // The bf16 copies a --bf16 batch gives every parameter (Bf16Copies), on
  // both devices: the layers' GEMMs then read them, as in training.
  void make_bf16_copies() {
    for (auto* side : {&cpu, &gpu})
      for (Param& p : *side) {
        p.value16 = Tensor::empty(p.value.shape(), DType::BF16, p.value.device());
        ops::convert(p.value, p.value16);
      }
  }
  Param* gpu_of(const Param* p) {
    for (size_t i = 0; i < cpu.size(); ++i)
      if (&cpu[i] == p) return &gpu[i];
    return nullptr;
  }
};

// Runs forward, backward_input (with random output gradients; input
// gradients start at zero and need_grad[i] says which are wanted) and
// backward_weight on both devices; compares everything.
// With act BF16 the float inputs and the outputs (but a loss) are bf16
// tensors, as --bf16 stores activations, and so are their gradients; the
// parameters' gradients stay fp32.
void expect_same_on_both(Layer& cpu_layer, Layer& gpu_layer, Twin& twin,
                         const std::vector<Tensor>& inputs, const std::vector<bool>& need_grad,
                         const std::string& what, double tol = kFp32,
                         DType act = DType::F32, bool fresh = false) {
  std::vector<Shape> in_shapes;
  for (const Tensor& t : inputs) in_shapes.push_back(t.shape());
  const std::vector<Shape> out_shapes = cpu_layer.output_shapes(in_shapes);

  struct Run {
    std::vector<Tensor> out, grad_in;
  };
  auto narrowed = [&](Tensor x, Device d) {
    if (x.dtype() != DType::F32 || act == DType::F32) return x;
    Tensor narrow = Tensor::empty(x.shape(), act, d);
    ops::convert(x, narrow);
    return narrow;
  };
  auto run = [&](Layer& layer, Device d) {
    Arena arena(d);
    std::vector<Tensor> in;
    for (const Tensor& t : inputs) in.push_back(narrowed(on(t, d), d));
    Run r;
    for (const Shape& s : out_shapes)
      r.out.push_back(Tensor::zeros(s, s.numel() == 1 ? DType::F32 : act, d));
    auto ctx = layer.make_ctx();
    layer.forward(*ctx, arena, in, r.out);
    std::vector<Tensor> grad_out;
    for (size_t k = 0; k < out_shapes.size(); ++k)
      grad_out.push_back(out_shapes[k].numel() == 1
                             ? on(Tensor::zeros({1}), d)
                             : narrowed(on(uniform_tensor(out_shapes[k], 100 + k), d), d));
    // A loss's gradient: a power of two. The LM head with bf16 activations
    // rounds the unit dlogits (p - onehot) to bf16 on both devices and scales
    // by g in its GEMMs' alpha; a power of two keeps that equal to rounding
    // the scaled dlogits, so any path that scales first gives the GEMMs the
    // same bf16 operands (as
    // TiedLmHeadLoss.ChunkedBf16DlogitsGiveTheWholeHeadsGradients argues). With
    // 0.37 each dlogit may round differently, up to a bf16 unit apart: ~3e-3
    // of dx's norm, past kBf16.
    if (out_shapes.size() == 1 && out_shapes[0].numel() == 1) ops::set_item(grad_out[0], 0.5f);
    for (size_t k = 0; k < inputs.size(); ++k)
      r.grad_in.push_back(need_grad[k] ? Tensor::zeros(inputs[k].shape(), in[k].dtype(), d)
                                       : Tensor());
    // fresh: the buffers the layer writes whole hold NaN, as the runner's
    // uninitialised ones may; a layer that added to them would give NaN.
    ctx->fresh_grads_in = 0;
    for (size_t k = 0; fresh && k < inputs.size(); ++k)
      if (need_grad[k] && layer.writes_input_grad(k)) {
        ops::fill(r.grad_in[k], std::nanf(""));
        ctx->fresh_grads_in |= 1u << k;
      }
    layer.backward_input(*ctx, arena, grad_out, r.grad_in);
    layer.backward_weight(*ctx, arena);
    return r;
  };
  const Run c = run(cpu_layer, Device::cpu());
  const Run g = run(gpu_layer, kGpu);
  auto fp32_on_host = [](const Tensor& t) {
    Tensor h = on(t, Device::cpu()), w = Tensor::empty(t.shape());
    ops::convert(h, w);
    return w;
  };
  for (size_t k = 0; k < c.out.size(); ++k)
    EXPECT_LT(rel_error(fp32_on_host(g.out[k]), fp32_on_host(c.out[k])), tol)
        << what << ": output " << k;
  for (size_t k = 0; k < c.grad_in.size(); ++k) {
    if (!need_grad[k]) continue;
    EXPECT_EQ(g.grad_in[k].dtype(), c.grad_in[k].dtype()) << what << ": gradient of input " << k;
    EXPECT_LT(rel_error(fp32_on_host(g.grad_in[k]), fp32_on_host(c.grad_in[k])), tol)
        << what << ": gradient of input " << k;
  }
  for (size_t i = 0; i < twin.cpu.size(); ++i)
    EXPECT_LT(rel_error(on(twin.gpu[i].grad, Device::cpu()), twin.cpu[i].grad), tol)
        << what << ": gradient of " << twin.cpu[i].name;
}

const int64_t kB = 2, kT = 37, kC = 48, kV = 1000, kHeads = 4;

// --bf16's GEMM precision on both devices for a scope, fp32 again after.
struct Bf16Matmuls {
  Bf16Matmuls() {
    ops::set_matmul_precision(Device::cpu(), ops::MatmulPrecision::Bf16);
    ops::set_matmul_precision(kGpu, ops::MatmulPrecision::Bf16);
  }
  ~Bf16Matmuls() {
    ops::set_matmul_precision(Device::cpu(), ops::MatmulPrecision::Fp32);
    ops::set_matmul_precision(kGpu, ops::MatmulPrecision::Fp32);
  }
  Bf16Matmuls(const Bf16Matmuls&) = delete;
  Bf16Matmuls& operator=(const Bf16Matmuls&) = delete;
};

TEST(CudaLayers, LinearWithAndWithoutBias) {
  for (bool bias : {true, false}) {
    Twin tw;
    Param* w = tw.add("w", uniform_tensor({kC, 3 * kC}, 1));
    Param* b = bias ? tw.add("b", uniform_tensor({3 * kC}, 2)) : nullptr;
    Linear cpu(w, b), gpu(tw.gpu_of(w), bias ? tw.gpu_of(b) : nullptr);
    expect_same_on_both(cpu, gpu, tw, {uniform_tensor({kB, kT, kC}, 3)}, {true},
                        bias ? "linear" : "linear without bias");
  }
}

TEST(CudaLayers, LayerNorm) {
  Twin tw;
  Param* w = tw.add("w", uniform_tensor({kC}, 4, 0.5f, 1.5f));
  Param* b = tw.add("b", uniform_tensor({kC}, 5));
  LayerNorm cpu(w, b, 1e-5f), gpu(tw.gpu_of(w), tw.gpu_of(b), 1e-5f);
  expect_same_on_both(cpu, gpu, tw, {uniform_tensor({kB, kT, kC}, 6)}, {true}, "layernorm");
}

// The residual add fused with LayerNorm: C = 48 takes the one-kernel path
// on the GPU (the CPU runs the add, then LayerNorm), C = 44 the GPU's
// fallback to the two kernels. Input gradients written whole (fresh) take
// the backward's one kernel, accumulated ones the LayerNorm kernel and an add.
TEST(CudaLayers, ResidualLayerNorm) {
  for (const int64_t c : {kC, int64_t{44}}) {
    for (const bool fresh : {false, true}) {
      Twin tw;
      Param* w = tw.add("w", uniform_tensor({c}, 10, 0.5f, 1.5f));
      Param* b = tw.add("b", uniform_tensor({c}, 11));
      ResidualLayerNorm cpu(w, b, 1e-5f), gpu(tw.gpu_of(w), tw.gpu_of(b), 1e-5f);
      expect_same_on_both(cpu, gpu, tw,
                          {uniform_tensor({kB, kT, c}, 12), uniform_tensor({kB, kT, c}, 13)},
                          {true, true}, "residual layernorm", kFp32, DType::F32, fresh);
    }
  }
}

TEST(CudaLayers, GeluAndResidual) {
  Twin tw;
  Gelu gelu_cpu, gelu_gpu;
  expect_same_on_both(gelu_cpu, gelu_gpu, tw, {uniform_tensor({kB, kT, kC}, 7, -3.0f, 3.0f)},
                      {true}, "gelu");
  Residual res_cpu, res_gpu;
  expect_same_on_both(res_cpu, res_gpu, tw,
                      {uniform_tensor({kB, kT, kC}, 8), uniform_tensor({kB, kT, kC}, 9)},
                      {true, true}, "residual");
}

// The Llama family's layers.
TEST(CudaLayers, RmsNormSwiGluAndRotary) {
  Twin tw;
  Param* w = tw.add("w", uniform_tensor({kC}, 30, 0.5f, 1.5f));
  RmsNorm norm_cpu(w), norm_gpu(tw.gpu_of(w));
  expect_same_on_both(norm_cpu, norm_gpu, tw, {uniform_tensor({kB, kT, kC}, 31)}, {true},
                      "rmsnorm");
  Twin none;
  SwiGlu swiglu_cpu, swiglu_gpu;
  expect_same_on_both(swiglu_cpu, swiglu_gpu, none,
                      {uniform_tensor({kB, kT, 2 * kC}, 32, -3.0f, 3.0f)}, {true}, "swiglu");
  Rotary rope_cpu(kHeads, kHeads, 10000.0f), rope_gpu(kHeads, kHeads, 10000.0f);
  expect_same_on_both(rope_cpu, rope_gpu, none, {uniform_tensor({kB, kT, 3 * kC}, 33)}, {true},
                      "rotary");
  // Grouped-query: kHeads query heads, one key/value head.
  const int64_t d = kC / kHeads;
  Rotary gqa_cpu(kHeads, 1, 10000.0f), gqa_gpu(kHeads, 1, 10000.0f);
  expect_same_on_both(gqa_cpu, gqa_gpu, none, {uniform_tensor({kB, kT, kC + 2 * d}, 34)}, {true},
                      "rotary (grouped-query)");
}

TEST(CudaLayers, CausalSelfAttention) {
  Twin tw;
  CausalSelfAttention cpu(kHeads), gpu(kHeads);
  expect_same_on_both(cpu, gpu, tw, {uniform_tensor({kB, kT, 3 * kC}, 10)}, {true}, "attention");
  const int64_t d = kC / kHeads;
  CausalSelfAttention gqa_cpu(kHeads, 1), gqa_gpu(kHeads, 1);
  expect_same_on_both(gqa_cpu, gqa_gpu, tw, {uniform_tensor({kB, kT, kC + 2 * d}, 11)}, {true},
                      "attention (grouped-query)");
}

// The layer (unfused: fp32 GEMMs) at every T of kSeqLengths up to 1024, two
// heads of 16 so that the largest stays small.
TEST(CudaLayers, CausalSelfAttentionAtEverySequenceLength) {
  Twin tw;
  for (const int64_t t : testing::kSeqLengths) {
    CausalSelfAttention cpu(2), gpu(2);
    expect_same_on_both(cpu, gpu, tw, {uniform_tensor({t <= 129 ? 2 : 1, t, 3 * 32}, 200 + t)},
                        {true}, "attention, T " + std::to_string(t));
  }
}

Tensor tokens(int64_t n, uint64_t seed) {
  Tensor u = uniform_tensor({n}, seed, 0.0f, static_cast<float>(kV));
  Tensor t = Tensor::empty({kB, n / kB}, DType::I32);
  for (int64_t i = 0; i < n; ++i)
    t.data<int32_t>()[i] = std::min<int32_t>(kV - 1, static_cast<int32_t>(u.data<float>()[i]));
  return t;
}

TEST(CudaLayers, EmbeddingAndTiedLmHead) {
  Twin tw;
  Param* wte = tw.add("wte", uniform_tensor({kV, kC}, 11));
  Param* wpe = tw.add("wpe", uniform_tensor({kT, kC}, 12));
  Embedding cpu(wte, wpe), gpu(tw.gpu_of(wte), tw.gpu_of(wpe));
  expect_same_on_both(cpu, gpu, tw, {tokens(kB * kT, 13)}, {false}, "embedding");

  Twin head;
  Param* table = head.add("wte", uniform_tensor({kV, kC}, 14));
  TiedLmHeadLoss head_cpu(table), head_gpu(head.gpu_of(table));
  Tensor targets = tokens(kB * kT, 15).view({kB * kT});
  expect_same_on_both(head_cpu, head_gpu, head, {uniform_tensor({kB * kT, kC}, 16), targets},
                      {true, false}, "tied lm head + cross-entropy");
  // Chunked (as GPT-2's logits are): 16 rows at a time, the last chunk ragged.
  Twin chunked;
  Param* t2 = chunked.add("wte", uniform_tensor({kV, kC}, 17));
  TiedLmHeadLoss chunk_cpu(t2), chunk_gpu(chunked.gpu_of(t2));
  chunk_cpu.set_chunk_rows(16), chunk_gpu.set_chunk_rows(16);
  expect_same_on_both(chunk_cpu, chunk_gpu, chunked,
                      {uniform_tensor({kB * kT, kC}, 18), targets}, {true, false},
                      "chunked lm head + cross-entropy");
}

// --bf16: activations stored in bf16 and GEMM inputs rounded to bf16, on
// both devices; the GPU's bf16 kernels against the CPU's widened operations.
// Error model: both devices round the same fp32 operands to bf16 and differ
// in fp32 summation order (~1e-6 relative); a bf16 output then either
// agrees or, where the two fp32 results straddle a rounding boundary (a
// fraction ~1e-6 / 2^-8 of the elements), differs by one bf16 ulp (2^-8):
// sqrt(4e-4) x 2^-8 ~ 1e-4 of the norm. The input gradients are bf16
// outputs too (the same argument), and the parameters' fp32 gradients
// inherit as much through the GEMMs' rounded operands. 1e-3 holds that with margin; reading
// bf16 bytes as fp32, or the reverse, gives O(1).
TEST(CudaLayers, Bf16Activations) {
  constexpr double kBf16 = 1e-3;
  const Bf16Matmuls scope;
  const DType bf16 = DType::BF16;
  {
    Twin tw;
    Param* w = tw.add("w", uniform_tensor({kC, 3 * kC}, 40));
    Param* b = tw.add("b", uniform_tensor({3 * kC}, 41));
    Linear cpu(w, b), gpu(tw.gpu_of(w), tw.gpu_of(b));
    expect_same_on_both(cpu, gpu, tw, {uniform_tensor({kB, kT, kC}, 42)}, {true}, "bf16 linear",
                        kBf16, bf16);
    tw.make_bf16_copies();
    expect_same_on_both(cpu, gpu, tw, {uniform_tensor({kB, kT, kC}, 42)}, {true},
                        "bf16 linear on the weights' bf16 copies", kBf16, bf16);
  }
  {
    Twin tw;
    Param* w = tw.add("w", uniform_tensor({kC}, 43, 0.5f, 1.5f));
    Param* b = tw.add("b", uniform_tensor({kC}, 44));
    LayerNorm cpu(w, b, 1e-5f), gpu(tw.gpu_of(w), tw.gpu_of(b), 1e-5f);
    expect_same_on_both(cpu, gpu, tw, {uniform_tensor({kB, kT, kC}, 45)}, {true},
                        "bf16 layernorm", kBf16, bf16);
    ResidualLayerNorm rcpu(w, b, 1e-5f), rgpu(tw.gpu_of(w), tw.gpu_of(b), 1e-5f);
    for (const bool fresh : {false, true})
      expect_same_on_both(rcpu, rgpu, tw,
                          {uniform_tensor({kB, kT, kC}, 45), uniform_tensor({kB, kT, kC}, 46)},
                          {true, true}, "bf16 residual layernorm", kBf16, bf16, fresh);
  }
  {
    Twin none;
    Gelu gelu_cpu, gelu_gpu;
    expect_same_on_both(gelu_cpu, gelu_gpu, none, {uniform_tensor({kB, kT, kC}, 46, -3.0f, 3.0f)},
                        {true}, "bf16 gelu", kBf16, bf16);
    Residual res_cpu, res_gpu;
    expect_same_on_both(res_cpu, res_gpu, none,
                        {uniform_tensor({kB, kT, kC}, 47), uniform_tensor({kB, kT, kC}, 48)},
                        {true, true}, "bf16 residual", kBf16, bf16);
    CausalSelfAttention attn_cpu(kHeads), attn_gpu(kHeads);  // head size 12: unfused
    expect_same_on_both(attn_cpu, attn_gpu, none, {uniform_tensor({kB, kT, 3 * kC}, 49)}, {true},
                        "bf16 attention (unfused, widened)", kBf16, bf16);
  }
  {  // the Llama family's: the GPU's bf16 kernels against the CPU's widened ones
    Twin tw;
    Param* w = tw.add("w", uniform_tensor({kC}, 70, 0.5f, 1.5f));
    RmsNorm norm_cpu(w), norm_gpu(tw.gpu_of(w));
    expect_same_on_both(norm_cpu, norm_gpu, tw, {uniform_tensor({kB, kT, kC}, 71)}, {true},
                        "bf16 rmsnorm", kBf16, bf16);
    Twin none;
    SwiGlu swiglu_cpu, swiglu_gpu;
    expect_same_on_both(swiglu_cpu, swiglu_gpu, none,
                        {uniform_tensor({kB, kT, 2 * kC}, 72, -3.0f, 3.0f)}, {true},
                        "bf16 swiglu", kBf16, bf16);
    const int64_t d = kC / kHeads;
    Rotary gqa_cpu(kHeads, 1, 10000.0f), gqa_gpu(kHeads, 1, 10000.0f);
    expect_same_on_both(gqa_cpu, gqa_gpu, none, {uniform_tensor({kB, kT, kC + 2 * d}, 73)},
                        {true}, "bf16 rotary, grouped", kBf16, bf16);
  }
  {
    Twin tw;
    Param* wte = tw.add("wte", uniform_tensor({kV, kC}, 50));
    Param* wpe = tw.add("wpe", uniform_tensor({kT, kC}, 51));
    Embedding cpu(wte, wpe), gpu(tw.gpu_of(wte), tw.gpu_of(wpe));
    expect_same_on_both(cpu, gpu, tw, {tokens(kB * kT, 52)}, {false}, "bf16 embedding", kBf16,
                        bf16);
    Twin head;
    Param* table = head.add("wte", uniform_tensor({kV, kC}, 53));
    TiedLmHeadLoss head_cpu(table), head_gpu(head.gpu_of(table));
    head_cpu.set_chunk_rows(16), head_gpu.set_chunk_rows(16);
    expect_same_on_both(head_cpu, head_gpu, head,
                        {uniform_tensor({kB * kT, kC}, 54), tokens(kB * kT, 55).view({kB * kT})},
                        {true, false}, "bf16 chunked lm head + cross-entropy", kBf16, bf16);
    head.make_bf16_copies();
    TiedLmHeadLoss whole_cpu(table), whole_gpu(head.gpu_of(table));  // the GPU: bf16 dlogits
    expect_same_on_both(whole_cpu, whole_gpu, head,
                        {uniform_tensor({kB * kT, kC}, 56), tokens(kB * kT, 57).view({kB * kT})},
                        {true, false}, "bf16 lm head (whole) on the table's bf16 copy", kBf16,
                        bf16);
    expect_same_on_both(head_cpu, head_gpu, head,
                        {uniform_tensor({kB * kT, kC}, 54), tokens(kB * kT, 55).view({kB * kT})},
                        {true, false}, "bf16 chunked lm head on the table's bf16 copy", kBf16,
                        bf16);
  }
}

// The MLP node (c_fc, GELU, c_proj). fp32: the error model above, fresh dx
// too. bf16 activations on the weights' bf16 copies: the GPU runs GELU in
// the first GEMM's epilogue (on the fp32 sum, where the CPU rounds pre to
// bf16 first) and gelu' in the epilogue of the second GEMM's input gradient
// (on the fp32 product, where the CPU rounds it first). So each element of
// h and dpre may be a bf16 ulp (2^-8 relative) apart, not only the rare
// straddles of the other layers' comparisons; y, dx and the weight
// gradients sum such terms, whose relative RMS difference stays under
// 2^-8 ~ 4e-3, plus their own roundings. 2e-2 holds that; a missing GELU, a
// wrong layout of pre or a transposed operand gives O(1). The bias
// gradients come out of the weight gradients' GEMMs (gemm_bias_grad).
TEST(CudaLayers, GeluMlp) {
  auto twin = [](Twin& tw, uint64_t seed) {
    Param* w1 = tw.add("w_fc", uniform_tensor({kC, 4 * kC}, seed));
    Param* b1 = tw.add("b_fc", uniform_tensor({4 * kC}, seed + 1));
    Param* w2 = tw.add("w_proj", uniform_tensor({4 * kC, kC}, seed + 2, -0.5f, 0.5f));
    Param* b2 = tw.add("b_proj", uniform_tensor({kC}, seed + 3));
    return std::pair{GeluMlp(w1, b1, w2, b2),
                     GeluMlp(tw.gpu_of(w1), tw.gpu_of(b1), tw.gpu_of(w2), tw.gpu_of(b2))};
  };
  {
    Twin tw;
    auto [cpu, gpu] = twin(tw, 80);
    expect_same_on_both(cpu, gpu, tw, {uniform_tensor({kB, kT, kC}, 84)}, {true}, "gelu mlp");
  }
  {
    Twin tw;
    auto [cpu, gpu] = twin(tw, 85);
    expect_same_on_both(cpu, gpu, tw, {uniform_tensor({kB, kT, kC}, 89)}, {true},
                        "gelu mlp, fresh dx", kFp32, DType::F32, true);
  }
  const Bf16Matmuls scope;
  Twin tw;
  auto [cpu, gpu] = twin(tw, 90);
  tw.make_bf16_copies();
  const int64_t before = cuda::context(0).gelu_epilogue_fallbacks();
  const int64_t bgrad_before = cuda::context(0).bias_grad_epilogue_fallbacks();
  expect_same_on_both(cpu, gpu, tw, {uniform_tensor({kB, kT, kC}, 94)}, {true},
                      "bf16 gelu mlp (GELU in the GEMMs' epilogues)", 2e-2, DType::BF16, true);
  EXPECT_EQ(cuda::context(0).gelu_epilogue_fallbacks(), before) << "the epilogues did not run";
  EXPECT_EQ(cuda::context(0).bias_grad_epilogue_fallbacks(), bgrad_before)
      << "the bias gradients were summed separately";
}

// Fresh input-gradient buffers (LayerCtx::fresh_grads_in) are written, not
// added to, on both devices: the same results as from zeroed buffers.
TEST(CudaLayers, FreshInputGradientsAreWritten) {
  Twin tw;
  Param* w = tw.add("w", uniform_tensor({kC, 3 * kC}, 60));
  Param* b = tw.add("b", uniform_tensor({3 * kC}, 61));
  Linear lin_cpu(w, b), lin_gpu(tw.gpu_of(w), tw.gpu_of(b));
  expect_same_on_both(lin_cpu, lin_gpu, tw, {uniform_tensor({kB, kT, kC}, 62)}, {true},
                      "linear, fresh dx", kFp32, DType::F32, true);
  Twin none;
  Gelu gelu_cpu, gelu_gpu;
  expect_same_on_both(gelu_cpu, gelu_gpu, none, {uniform_tensor({kB, kT, kC}, 63, -3.0f, 3.0f)},
                      {true}, "gelu, fresh dx", kFp32, DType::F32, true);
  Residual res_cpu, res_gpu;
  expect_same_on_both(res_cpu, res_gpu, none,
                      {uniform_tensor({kB, kT, kC}, 64), uniform_tensor({kB, kT, kC}, 65)},
                      {true, true}, "residual, fresh dx", kFp32, DType::F32, true);
  CausalSelfAttention attn_cpu(kHeads), attn_gpu(kHeads);
  expect_same_on_both(attn_cpu, attn_gpu, none, {uniform_tensor({kB, kT, 3 * kC}, 66)}, {true},
                      "attention, fresh dqkv", kFp32, DType::F32, true);
}

// The layers with a tensor-parallel group of one, on the GPU against the CPU.
TEST(CudaLayers, VocabularyParallelFormsOnAGroupOfOne) {
  run_local(1, [&](Communicator& group) {
    Twin tw;
    Param* wte = tw.add("wte", uniform_tensor({kV, kC}, 17));
    Param* wpe = tw.add("wpe", uniform_tensor({kT, kC}, 18));
    Embedding cpu(wte, wpe, &group), gpu(tw.gpu_of(wte), tw.gpu_of(wpe), &group);
    expect_same_on_both(cpu, gpu, tw, {tokens(kB * kT, 19)}, {false}, "vocab-parallel embedding");

    Twin head;
    Param* table = head.add("wte", uniform_tensor({kV, kC}, 20));
    TiedLmHeadLoss head_cpu(table, &group), head_gpu(head.gpu_of(table), &group);
    expect_same_on_both(head_cpu, head_gpu, head,
                        {uniform_tensor({kB * kT, kC}, 21), tokens(kB * kT, 22).view({kB * kT})},
                        {true, false}, "vocab-parallel lm head + cross-entropy");
  });
}

TEST(CudaLayers, AdamWAndNormOnTheDevice) {
  Tensor p = uniform_tensor({kV, kC}, 20), g = uniform_tensor({kV, kC}, 21);
  Tensor m = Tensor::zeros({kV, kC}), v = Tensor::zeros({kV, kC});
  Tensor pg = on(p, kGpu), gg = on(g, kGpu), mg = on(m, kGpu), vg = on(v, kGpu);
  for (int64_t step = 1; step <= 3; ++step) {
    const ops::AdamWStep s{1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, step};
    ops::adamw(p, g, m, v, s);
    ops::adamw(pg, gg, mg, vg, s);
  }
  EXPECT_LT(rel_error(on(pg, Device::cpu()), p), kFp32);
  EXPECT_LT(rel_error(on(vg, Device::cpu()), v), kFp32);
  EXPECT_NEAR(ops::sum_squares(gg), ops::sum_squares(g), 1e-9 * ops::sum_squares(g));
}

}  // namespace
// Threads sharing the GPU: LocalCommunicator moves device tensors by
// device-to-device copies and reduces them on host copies. Small integers
// in fp32, so every result is exact.
TEST(CudaLocalCommunicator, DeviceTensorsMoveAndReduceAcrossThreads) {
  constexpr int kRanks = 3;
  const Device gpu = Device::cuda(0);
  auto on_gpu = [&](std::vector<float> v) {
    Tensor h = Tensor::zeros({static_cast<int64_t>(v.size())});
    std::copy(v.begin(), v.end(), h.data<float>());
    Tensor d = Tensor::empty(h.shape(), DType::F32, gpu);
    d.copy_from(h);
    return d;
  };
  auto on_host = [](const Tensor& d) {
    Tensor h = Tensor::zeros(d.shape());
    h.copy_from(d);
    return std::vector<float>(h.data<float>(), h.data<float>() + h.numel());
  };
  run_local(kRanks, [&](Communicator& comm) {
    const auto me = static_cast<float>(comm.rank());
    const int next = (comm.rank() + 1) % kRanks, prev = (comm.rank() + kRanks - 1) % kRanks;
    Tensor in = on_gpu({-1, -1});
    auto r = comm.irecv(in, prev, {MessageTag::Kind::Activation, 0});
    comm.send(on_gpu({me, 10 + me}), next, {MessageTag::Kind::Activation, 0});
    r->wait();
    EXPECT_EQ(on_host(in), (std::vector<float>{float(prev), 10.0f + float(prev)}));

    Tensor sum = on_gpu({me, 1});
    comm.all_reduce(sum, ReduceOp::Sum);
    EXPECT_EQ(on_host(sum), (std::vector<float>{3, 3}));  // 0 + 1 + 2, three ones
    Tensor all = Tensor::empty({kRanks}, DType::F32, gpu);
    comm.all_gather(on_gpu({me}), all);
    EXPECT_EQ(on_host(all), (std::vector<float>{0, 1, 2}));
    Tensor part = Tensor::empty({1}, DType::F32, gpu);
    comm.reduce_scatter(on_gpu({me, 2 * me, 3 * me}), part, ReduceOp::Sum);
    EXPECT_EQ(on_host(part), (std::vector<float>{3.0f * (me + 1)}));
    Tensor b = on_gpu({me + 5});
    comm.broadcast(b, 1);
    EXPECT_EQ(on_host(b), (std::vector<float>{6}));
  });
}

}  // namespace weft

#endif  // WEFT_CUDA
