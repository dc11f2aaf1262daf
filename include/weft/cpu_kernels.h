// weft/cpu_kernels.h — CPU kernels on raw fp32 arrays.
//
// Row-major throughout. GEMM goes to OpenBLAS's cblas or oneDNN's sgemm
// (gemm_library); the element-wise and reduction kernels are OpenMP loops
// written for the compiler's vectoriser.
// Shapes are given in comments as (rows, cols); N = rows = B*T tokens.
#pragma once

#include <weft/targets.h>

#include <cstdint>
#include <string>
#include <string_view>

namespace weft::cpu {

// The library behind gemm. Both share weft's OpenMP threads (set_threads).
// Each sums in its own order, so a run's GEMM library is part of what makes
// it reproducible bit for bit: a resume on the same host chooses the same one.
enum class GemmLibrary : uint8_t { OpenBlas, OneDnn };
// oneDNN where weft was built with it (meson -Donednn): its kernels follow the
// host's vector ISA, where OpenBLAS 0.3.21 runs SSE3 kernels on CPUs newer
// than itself; else OpenBLAS. The environment's WEFT_CPU_GEMM (openblas or
// onednn), read at the first use, overrides it, so a test suite can run under
// each library.
GemmLibrary default_gemm_library();
GemmLibrary gemm_library();  // the one in use: set, else the default
// Throws weft::Error for oneDNN in a build without it.
void set_gemm_library(GemmLibrary library);
bool onednn_built();
// "auto", "openblas" or "onednn" (auto: default_gemm_library()); anything
// else throws weft::Error naming `what` and the value.
GemmLibrary parse_gemm_library(std::string_view name, std::string_view what);
// For the log header: "OpenBLAS 0.3.21 (Prescott kernels)", "oneDNN 2.6.3
// (avx512_core_bf16)".
std::string describe_gemm_library(GemmLibrary library);

// C (m,n) = alpha * op(A) op(B) + beta * C, with op = transpose when trans_*.
// lda/ldb/ldc are row strides (elements); A is (m,k) or (k,m) when trans_a.
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
          const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
          int64_t ldc);

// Mixed precision's GEMM inputs: both operands rounded to nearest (ties to
// even) bf16 or fp16 before the fp32 products and sums. fp16 overflows to
// +-inf past 65504, which is why fp16 training scales its loss.
enum class Rounding : uint8_t { None, Bf16, Fp16 };
float round_to(Rounding r, float x);  // x itself for None
// gemm on rounded copies of A and B (per-thread scratch, kept between calls):
// an emulation for checking numerics, slower than the plain gemm it ends in.
void gemm_rounded(Rounding r, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                  float alpha, const float* a, int64_t lda, const float* b, int64_t ldb,
                  float beta, float* c, int64_t ldc);
// The same with each operand's own rounding (None: used as it is, for an
// operand that holds values of the rounded type already).
void gemm_rounded(Rounding round_a, Rounding round_b, bool trans_a, bool trans_b, int64_t m,
                  int64_t n, int64_t k, float alpha, const float* a, int64_t lda, const float* b,
                  int64_t ldb, float beta, float* c, int64_t ldc);

// bf16 GEMMs in hardware: C (fp32) = alpha op(A) op(B) + beta C with A and
// B bf16 (uint16_t, weft/bf16.h), through oneDNN's matmul, which runs them on
// AMX or AVX-512 BF16 with fp32 sums. Products of bf16 values are exact in
// fp32, so this is gemm_rounded(Bf16) up to the order of the sums. Each
// shape's primitive is built once and kept.
enum class Bf16Gemm : uint8_t { Emulated, OneDnn };
// OneDnn where oneDNN is built and its kernels use AMX (there its bf16
// matmul outruns the fp32 GEMM on rounded copies); else Emulated, as on a
// CPU with AVX-512 BF16 alone, where oneDNN 2.6's bf16 matmul runs at about
// half its fp32 speed. WEFT_CPU_BF16_GEMM (emulated or onednn), read at the
// first use, overrides it.
Bf16Gemm default_bf16_gemm();
Bf16Gemm bf16_gemm();  // the one in use
// Throws weft::Error for OneDnn where bf16_gemm_runs() is false.
void set_bf16_gemm(Bf16Gemm how);
// oneDNN is built and the host has AVX-512 BF16 or AMX.
bool bf16_gemm_runs();
std::string describe_bf16_gemm(Bf16Gemm how);
void gemm_bf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
               const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, float beta, float* c,
               int64_t ldc);

// --- LayerNorm over the last dimension, eps inside the square root. ---
// x, y (N, C); mean, rstd (N)
void layernorm_forward(const float* x, const float* w, const float* b, float* y, float* mean,
                       float* rstd, int64_t n, int64_t c, float eps);
// dx (N, C) += d/dx
void layernorm_backward_input(const float* dy, const float* x, const float* w, const float* mean,
                              const float* rstd, float* dx, int64_t n, int64_t c);
// dw, db (C) += d/dw, d/db
void layernorm_backward_weight(const float* dy, const float* x, const float* mean,
                               const float* rstd, float* dw, float* db, int64_t n, int64_t c);

// --- RMSNorm over the last dimension (Llama): y = x / sqrt(mean(x^2) + eps) * w ---
// x, y (N, C); rstd (N)
void rmsnorm_forward(const float* x, const float* w, float* y, float* rstd, int64_t n, int64_t c,
                     float eps);
// dx (N, C) += d/dx
void rmsnorm_backward_input(const float* dy, const float* x, const float* w, const float* rstd,
                            float* dx, int64_t n, int64_t c);
// dw (C) += d/dw
void rmsnorm_backward_weight(const float* dy, const float* x, const float* rstd, float* dw,
                             int64_t n, int64_t c);

// --- SwiGLU (Megatron's): x (N, 2H) = [gate | up] -> y (N, H) = silu(gate) * up ---
void swiglu_forward(const float* x, float* y, int64_t n, int64_t h);
void swiglu_backward(const float* dy, const float* x, float* dx, int64_t n, int64_t h);  // dx +=

// --- rotary position embedding on a packed qkv (B, T, (H + 2G) D) ---
// The layout of layers/attention.h: H query heads, then G key heads, then G
// value heads, each D wide. q and k heads rotate in pairs (i, i + D/2) by
// angle t * base^(-2i/D) (Llama's rotate-half convention); v is copied.
// y may not alias x.
// `positions` (B*T), where given: each token's position within its document
// (--reset-position-ids), in place of t.
void rope_forward(const float* x, float* y, int64_t b, int64_t t, int64_t h, int64_t g, int64_t d,
                  float base, const int32_t* positions = nullptr);
// dx += the inverse rotation of dy.
void rope_backward(const float* dy, float* dx, int64_t b, int64_t t, int64_t h, int64_t g,
                   int64_t d, float base, const int32_t* positions = nullptr);

// --- tanh-approximated GELU, element-wise over n values. ---
void gelu_forward(const float* x, float* y, int64_t n);
// dx += dy gelu'(x); with accumulate false, dx = dy gelu'(x) (dx's old bytes unread).
void gelu_backward(const float* dy, const float* x, float* dx, int64_t n, bool accumulate = true);

// --- bias helpers ---
void fill_rows(float* y, const float* row, int64_t n, int64_t c);       // y (N,C) = row
void add_bias(float* y, const float* bias, int64_t n, int64_t c);       // y (N,C) += bias
void sum_rows(const float* dy, float* db, int64_t n, int64_t c);        // db (C) += sum dy
void add_inplace(float* y, const float* x, int64_t n);                  // y += x
void scale_inplace(float* y, float s, int64_t n);                       // y *= s
// y += s x, x left as it is: the bits of scale_inplace(x, s) and then
// add_inplace(y, x) (each product rounded before the sum: no FMA).
void add_scaled(float* y, const float* x, float s, int64_t n);

// --- causal attention on a packed qkv (B, T, (H + 2G) D) -> out (B, T, H D) ---
// H query heads share G key/value heads (G divides H; G = H is multi-head
// attention): query head i reads key/value head i / (H / G).
// probs (B, H, T, T) keeps the softmax for backward (upper triangle zero).
// `r` rounds the inputs of every GEMM inside (gemm_rounded).
// `positions` (B*T), where given: each token's position p within its
// document (--reset-attention-mask); query t then reads keys t - p .. t only,
// and the other probabilities are 0 (the backward needs nothing more).
void attention_forward(const float* qkv, float* out, float* probs, int64_t b, int64_t t, int64_t h,
                       int64_t g, int64_t d, Rounding r = Rounding::None,
                       const int32_t* positions = nullptr);
// dqkv += gradient; scratch needs B*H*T*T floats.
void attention_backward(const float* dout, const float* qkv, const float* probs, float* dqkv,
                        float* scratch, int64_t b, int64_t t, int64_t h, int64_t g, int64_t d,
                        Rounding r = Rounding::None);

// --- softmax cross-entropy over logits (N, V), in place ---
// Columns [from, V) of each row = -inf (a padded vocabulary's columns).
void mask_columns(float* logits, int64_t n, int64_t v, int64_t from);
// On return logits hold the probabilities; losses[i] = -log p[i][target[i]].
// Masked columns (-inf, ending the row) get probability exactly 0.
// Returns the sum of losses (in double). Targets outside [0, V) throw Error.
double softmax_cross_entropy(float* logits, const int32_t* targets, float* losses, int64_t n,
                             int64_t v);
// dlogits (N,V) = (p - onehot(target - first)) * scale, written from probs
// (may alias). The V columns are vocabulary [first, first + V); a target
// outside them (another tensor-parallel rank's) subtracts nothing.
void cross_entropy_backward(const float* probs, const int32_t* targets, float* dlogits,
                            float scale, int64_t n, int64_t v, int64_t first = 0);

// --- the vocabulary-parallel cross-entropy's local steps, logits (N, V) of
// vocabulary [first, first + V) ---
// m (N) = row maxima.
void row_max(const float* logits, float* m, int64_t n, int64_t v);
// In place: logits = exp(logits - m); sum (N) = row sums of those; z (N) =
// logit[target] - m where this slice holds the target, else 0.
void exp_and_stats(float* logits, const int32_t* targets, int64_t first, const float* m,
                   float* sum, float* z, int64_t n, int64_t v);
// In place: p = exps / sum; returns the sum over rows of log(sum) - z, rows
// whose target is kIgnoredTarget left out.
double normalise_and_loss(float* p, const float* sum, const float* z, const int32_t* targets,
                          int64_t n, int64_t v);

// --- token + position embedding; wte holds the `rows` rows of tokens
// [first, first + rows), other tokens read zeros ---
// y (B*T, C) = wte[tokens - first] (or 0) + wpe[i % T]; wpe may be null.
// `positions` (B*T), where given, replace i % T (--reset-position-ids).
void embedding_forward(const int32_t* tokens, const float* wte, int64_t rows, int64_t first,
                       const float* wpe, float* y, int64_t b, int64_t t, int64_t c,
                       const int32_t* positions = nullptr);
// dwte[tokens - first] += dy for this slice's tokens; dwpe[i % T] (or
// dwpe[positions[i]]) += dy[i]. Summed in token order whatever the thread count.
void embedding_backward(const int32_t* tokens, const float* dy, float* dwte, int64_t rows,
                        int64_t first, float* dwpe, int64_t b, int64_t t, int64_t c,
                        const int32_t* positions = nullptr);

// --- squared error: returns 0.5 * sum (p - t)^2 in double; d += g * (p - t) ---
double mse_loss(const float* p, const float* t, int64_t n);
void mse_backward(const float* p, const float* t, float g, float* d, int64_t n);

// --- AdamW, PyTorch semantics (decoupled decay, bias-corrected moments). ---
// step is 1-based. Each gradient element is read as g * grad_scale, rounded
// once (a clip's coefficient: the bits of scaling g first, without a pass).
void adamw(float* p, const float* g, float* m, float* v, int64_t n, float lr, float beta1,
           float beta2, float eps, float weight_decay, int64_t step, float grad_scale = 1.0f);

// --- SGD with momentum, PyTorch semantics (L2 decay, no dampening). ---
// d = g + weight_decay p; buf = momentum buf + d (buf starts at zero, so the
// first step's buf is d, as PyTorch's); p -= lr (momentum > 0 ? buf : d).
// Lion: c = b1 m + (1 - b1) g s; p = p (1 - lr wd) - lr sign(c) (sign(0) = 0,
// as torch.sign); m = b2 m + (1 - b2) g s, with g s the gradient times grad_scale.
void lion(float* p, const float* g, float* m, int64_t n, float lr, float beta1, float beta2,
          float weight_decay, float grad_scale);
void sgd(float* p, const float* g, float* buf, int64_t n, float lr, float momentum,
         float weight_decay);

// Sum of squares in double.
double sum_squares(const float* x, int64_t n);

}  // namespace weft::cpu
