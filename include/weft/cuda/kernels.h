// weft/cuda/kernels.h — the device twins of weft/cpu_kernels.h.
//
// Same shapes, same semantics, same accumulation rules (a "+=" here is a "+="
// there), so a layer's CUDA path is its CPU path with `cpu::` replaced by
// `cuda::` and a Context in front. Every pointer is device memory on the
// context's GPU; every call is queued on the compute stream and returns
// without waiting, unless it says otherwise. Row-major throughout; N = rows =
// B*T tokens. Scratch memory comes from the context's caching allocator.
//
// Precision: fp32 kernels give the CPU result to rounding (1e-5 relative).
// GEMMs take a MathMode: FP32 (exact fp32 products), TF32 (tensor cores, 10-bit
// mantissa inputs), BF16 or FP16 (fp32 operands rounded to bf16 or fp16 inside
// cuBLAS's kernel, fp32 accumulation and output: mixed precision with fp32
// master weights).
//
// bf16 activations (--bf16): the overloads taking `bf16*` activations read
// them widened to fp32, compute exactly as their fp32 twin (one kernel body,
// the same arithmetic in the same order) and round to nearest even only when
// storing a bf16 output, so a bf16 output is the fp32 overload's output on the
// widened inputs, rounded once. Gradients, weights and statistics (mean,
// rstd, lse) stay fp32.
#pragma once

#include <weft/cuda/runtime.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace weft::cuda {

enum class MathMode : uint8_t { FP32, TF32, BF16, FP16 };
const char* math_mode_name(MathMode m);  // "fp32", "tf32", "bf16", "fp16"
MathMode parse_math_mode(const std::string& name);  // throws Error for anything else

// bfloat16 storage: the top 16 bits of an fp32 (layout of CUDA's __nv_bfloat16).
struct bf16 {
  uint16_t bits;
};

// fp32 -> bf16 rounding to nearest even (any NaN -> 0x7fff), as CUDA's
// __float2bfloat16_rn: the host reference for the device conversion.
inline bf16 to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{0x7fff};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>(u >> 16)};
}
inline float to_float(bf16 h) {
  const uint32_t u = static_cast<uint32_t>(h.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// --- GEMM through cuBLAS ---

// cpu::gemm's twin: C (m,n) = alpha * op(A) op(B) + beta * C, row-major, with
// lda/ldb/ldc the row strides. BF16 and FP16 round both operands to the
// nearest even bf16 or fp16 values (round_values, into scratch from the
// caching allocator; fp16 gives +-inf past 65504), as the CPU does, and
// multiply them on TF32 tensor cores, which hold those values exactly.
void gemm(Context& ctx, MathMode mode, bool trans_a, bool trans_b, int64_t m, int64_t n,
          int64_t k, float alpha, const float* a, int64_t lda, const float* b, int64_t ldb,
          float beta, float* c, int64_t ldc);
// bf16 A and B, fp32 accumulation, fp32 C.
void gemm_bf16(Context& ctx, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
               float alpha, const bf16* a, int64_t lda, const bf16* b, int64_t ldb, float beta,
               float* c, int64_t ldc);
// bf16 A, B and C, fp32 accumulation (CUBLAS_COMPUTE_32F; beta * C read
// widened), C rounded to bf16 once.
void gemm_bf16_out(Context& ctx, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                   float alpha, const bf16* a, int64_t lda, const bf16* b, int64_t ldb,
                   float beta, bf16* c, int64_t ldc);
// A linear layer's forward in one cuBLASLt call (CUBLASLT_EPILOGUE_BIAS):
// C (m,n) = op(A) op(B) + bias in every row, bias (n), with C's previous
// values not read. The bias is added to the fp32 accumulator in the epilogue,
// so the result is what filling C's rows with the bias and then gemm() with
// beta 1 gives, up to the order of the fp32 sum. When cuBLASLt has no
// bias-epilogue algorithm for the shape (or refuses it, or the bias is not
// 16-byte aligned), it is those two steps, and stderr says so once per
// context (Context::bias_epilogue_fallbacks counts them). k 0: C's rows are
// the bias. The algorithm is chosen once per shape, transposes, strides and
// operand alignments; cuBLASLt's workspace is the Context's.
// fp32 A, B, C and bias; the compute type of gemm() for `mode`.
void gemm_bias(Context& ctx, MathMode mode, bool trans_a, bool trans_b, int64_t m, int64_t n,
               int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb,
               const float* bias, float* c, int64_t ldc);
// bf16 A, B, C and bias, fp32 accumulation (CUBLAS_COMPUTE_32F):
// C = bf16(fp32 sum + float(bias)), rounded once. cuBLASLt's epilogue runs
// only where A, B and C and their row strides are 16-byte aligned (on an
// H200 its kernels for unaligned bf16 operands were up to 5 bf16 ulps off);
// otherwise the two steps are the fp32 product and add_bias_bf16.
void gemm_bias_bf16(Context& ctx, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                    const bf16* a, int64_t lda, const bf16* b, int64_t ldb, const bf16* bias,
                    bf16* c, int64_t ldc);
// An MLP's first GEMM and its GELU in one cuBLASLt call
// (CUBLASLT_EPILOGUE_GELU_AUX_BIAS), bf16 as gemm_bias_bf16: pre (m, n) =
// op(A) op(B) + bias, the GELU's input kept for the backward, and C (m, n)
// = gelu(pre) (tanh-approximated). pre and C are contiguous. Without an
// algorithm (or with pre less than 16-byte aligned, n not a multiple of 8,
// or an operand unaligned as gemm_bias_bf16 says) it is gemm_bias_bf16 into
// pre and then gelu_forward, and stderr says so
// once per context (Context::gelu_epilogue_fallbacks counts them).
void gemm_bias_gelu_bf16(Context& ctx, bool trans_a, bool trans_b, int64_t m, int64_t n,
                         int64_t k, const bf16* a, int64_t lda, const bf16* b, int64_t ldb,
                         const bf16* bias, bf16* pre, bf16* c);
// The GELU's input gradient from the MLP's second GEMM, in one cuBLASLt
// call (CUBLASLT_EPILOGUE_DGELU): C (m, n) = (op(A) op(B)) * gelu'(pre),
// written (C's old values not read), pre and C contiguous (m, n). The fp32
// product is multiplied before it is rounded once. Fallback as above:
// the fp32 product rounded to bf16 into C, then gelu_backward in place.
void gemm_dgelu_bf16(Context& ctx, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                     const bf16* a, int64_t lda, const bf16* b, int64_t ldb, const bf16* pre,
                     bf16* c);
// A linear layer's weight and bias gradients in one cuBLASLt call
// (CUBLASLT_EPILOGUE_BGRADA in the column-major view): C (m, n) = op(A) B +
// beta C with bf16 A and B (B not transposed) and fp32 C, as gemm_bf16, and
// db (n, fp32) = the sums of B's k rows, written: for dW += x^T dy it is
// the bias gradient of dy, without a second read of dy. Returns false,
// having done nothing, where cuBLASLt has no such algorithm (or k is 0, or
// db is not 16-byte aligned): then the caller runs gemm_bf16 and sum_rows;
// stderr says so once per context (Context::bias_grad_epilogue_fallbacks).
bool gemm_bf16_bias_grad(Context& ctx, bool trans_a, int64_t m, int64_t n, int64_t k,
                         const bf16* a, int64_t lda, const bf16* b, int64_t ldb, float beta,
                         float* c, int64_t ldc, float* db);
// `batch` independent GEMMs; matrix i of A, B, C starts stride_a/b/c elements after matrix i-1.
void gemm_strided_batched(Context& ctx, MathMode mode, bool trans_a, bool trans_b, int64_t m,
                          int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
                          int64_t stride_a, const float* b, int64_t ldb, int64_t stride_b,
                          float beta, float* c, int64_t ldc, int64_t stride_c, int64_t batch);

// --- LayerNorm over the last dimension, eps inside the square root ---
// x, y (N, C); mean, rstd (N)
void layernorm_forward(Context& ctx, const float* x, const float* w, const float* b, float* y,
                       float* mean, float* rstd, int64_t n, int64_t c, float eps);
void layernorm_forward(Context& ctx, const bf16* x, const float* w, const float* b, bf16* y,
                       float* mean, float* rstd, int64_t n, int64_t c, float eps);
// dx (N, C) += d/dx
void layernorm_backward_input(Context& ctx, const float* dy, const float* x, const float* w,
                              const float* mean, const float* rstd, float* dx, int64_t n,
                              int64_t c);
// bf16 activations: dy and dx bf16 like x (their gradients are), dx read
// widened and the sum rounded once.
void layernorm_backward_input(Context& ctx, const bf16* dy, const bf16* x, const float* w,
                              const float* mean, const float* rstd, bf16* dx, int64_t n,
                              int64_t c);
// A residual add fused with the LayerNorm of its sum: sum = x + a and y =
// LayerNorm(sum) in one kernel, the bits of add then layernorm_forward.
// Returns false, doing nothing, for rows that kernel does not take (C not a
// multiple of 8 or above 2048, an array not 16-byte aligned).
bool add_layernorm_forward(Context& ctx, const float* x, const float* a, float* sum,
                           const float* w, const float* b, float* y, float* mean, float* rstd,
                           int64_t n, int64_t c, float eps);
bool add_layernorm_forward(Context& ctx, const bf16* x, const bf16* a, bf16* sum, const float* w,
                           const float* b, bf16* y, float* mean, float* rstd, int64_t n,
                           int64_t c, float eps);
// dx += d/dx, then copy = dx, in one kernel; false, doing nothing, where
// add_layernorm_forward would be.
bool layernorm_backward_input_copy(Context& ctx, const float* dy, const float* x, const float* w,
                                   const float* mean, const float* rstd, float* dx, float* copy,
                                   int64_t n, int64_t c);
bool layernorm_backward_input_copy(Context& ctx, const bf16* dy, const bf16* x, const float* w,
                                   const float* mean, const float* rstd, bf16* dx, bf16* copy,
                                   int64_t n, int64_t c);
// dw, db (C) += d/dw, d/db
void layernorm_backward_weight(Context& ctx, const float* dy, const float* x, const float* mean,
                               const float* rstd, float* dw, float* db, int64_t n, int64_t c);
void layernorm_backward_weight(Context& ctx, const bf16* dy, const bf16* x, const float* mean,
                               const float* rstd, float* dw, float* db, int64_t n, int64_t c);

// --- RMSNorm, SwiGLU and rotary embedding: cpu_kernels.h's twins ---
void rmsnorm_forward(Context& ctx, const float* x, const float* w, float* y, float* rstd,
                     int64_t n, int64_t c, float eps);
void rmsnorm_backward_input(Context& ctx, const float* dy, const float* x, const float* w,
                            const float* rstd, float* dx, int64_t n, int64_t c);  // dx +=
void rmsnorm_backward_weight(Context& ctx, const float* dy, const float* x, const float* rstd,
                             float* dw, int64_t n, int64_t c);  // dw +=
void swiglu_forward(Context& ctx, const float* x, float* y, int64_t n, int64_t h);
void swiglu_backward(Context& ctx, const float* dy, const float* x, float* dx, int64_t n,
                     int64_t h);  // dx +=
// qkv (B, T, (H + 2G) D), as cpu::rope_forward.
// `positions` (B*T) may be null: each row's place in its sequence.
void rope_forward(Context& ctx, const float* x, float* y, int64_t b, int64_t t, int64_t h,
                  int64_t g, int64_t d, float base, const int32_t* positions = nullptr);
void rope_backward(Context& ctx, const float* dy, float* dx, int64_t b, int64_t t, int64_t h,
                   int64_t g, int64_t d, float base,
                   const int32_t* positions = nullptr);  // dx +=
// The same on bf16 activations (x, y, dy, dx; the weight, rstd and dw
// fp32): each computed as the fp32 kernel computes it, and rounded once.
void rmsnorm_forward(Context& ctx, const bf16* x, const float* w, bf16* y, float* rstd, int64_t n,
                     int64_t c, float eps);
void rmsnorm_backward_input(Context& ctx, const bf16* dy, const bf16* x, const float* w,
                            const float* rstd, bf16* dx, int64_t n, int64_t c);  // dx +=
void rmsnorm_backward_weight(Context& ctx, const bf16* dy, const bf16* x, const float* rstd,
                             float* dw, int64_t n, int64_t c);  // dw +=
void swiglu_forward(Context& ctx, const bf16* x, bf16* y, int64_t n, int64_t h);
void swiglu_backward(Context& ctx, const bf16* dy, const bf16* x, bf16* dx, int64_t n,
                     int64_t h);  // dx +=
void rope_forward(Context& ctx, const bf16* x, bf16* y, int64_t b, int64_t t, int64_t h, int64_t g,
                  int64_t d, float base, const int32_t* positions = nullptr);
void rope_backward(Context& ctx, const bf16* dy, bf16* dx, int64_t b, int64_t t, int64_t h,
                   int64_t g, int64_t d, float base,
                   const int32_t* positions = nullptr);  // dx +=

// --- tanh-approximated GELU, element-wise ---
void gelu_forward(Context& ctx, const float* x, float* y, int64_t n);
void gelu_forward(Context& ctx, const bf16* x, bf16* y, int64_t n);
// dx += dy gelu'(x), or dx = dy gelu'(x) with accumulate false (dx not read).
void gelu_backward(Context& ctx, const float* dy, const float* x, float* dx, int64_t n,
                   bool accumulate = true);
void gelu_backward(Context& ctx, const bf16* dy, const bf16* x, bf16* dx, int64_t n,
                   bool accumulate = true);

// --- bias and element-wise helpers ---
void add_bias(Context& ctx, float* y, const float* bias, int64_t n, int64_t c);  // y (N,C) += bias
void sum_rows(Context& ctx, const float* dy, float* db, int64_t n, int64_t c);   // db (C) += sum dy
void add_inplace(Context& ctx, float* y, const float* x, int64_t n);             // y += x
void sum_rows(Context& ctx, const bf16* dy, float* db, int64_t n, int64_t c);    // db += sum dy
void add_inplace(Context& ctx, bf16* y, const bf16* x, int64_t n);  // y = bf16(float(y) + float(x))
void add_inplace(Context& ctx, bf16* y, const float* x, int64_t n);  // y = bf16(float(y) + x)
void add(Context& ctx, const float* a, const float* b, float* y, int64_t n);  // y = a + b
void add(Context& ctx, const bf16* a, const bf16* b, bf16* y, int64_t n);     // rounded once
// Every row of y (N, C) = bf16(row): a bias placed before a GEMM (beta 1)
// accumulates onto it, in place of add_bias after it.
void fill_rows(Context& ctx, bf16* y, const float* row, int64_t n, int64_t c);
// y (N, C; rows ldy apart) = bf16(x + bias) per row, x (N, C) contiguous
// fp32, each element rounded once.
void add_bias_bf16(Context& ctx, const float* x, const bf16* bias, bf16* y, int64_t n, int64_t c,
                   int64_t ldy);
void scale_inplace(Context& ctx, float* y, float s, int64_t n);                  // y *= s
// y[i] = bits for every i: an fp32 (4 bytes) or bf16 (2 bytes) constant, as a
// kernel (no upload, so no staging buffer and no host wait).
void fill32(Context& ctx, uint32_t* y, uint32_t bits, int64_t n);
void fill16(Context& ctx, uint16_t* y, uint16_t bits, int64_t n);
// y += s x, x left as it is: the bits of scale_inplace(x, s), then add_inplace(y, x).
void add_scaled(Context& ctx, float* y, const float* x, float s, int64_t n);
void add_scaled(Context& ctx, bf16* y, const float* x, float s, int64_t n);

// --- causal attention on a packed qkv (B, T, (H + 2G) D) -> out (B, T, H D) ---
// The layout of layers/attention.h: H query heads, then G key heads, then G
// value heads, D columns each; query head i reads key/value head i / (H / G).
// probs (B, H, T, T) keeps the softmax (upper triangle zero). The score and
// value GEMMs use `mode`. `positions` (B*T), where given: each token's
// position within its document, and a query reads its document's keys only
// (cpu::attention_forward's).
void attention_forward(Context& ctx, MathMode mode, const float* qkv, float* out, float* probs,
                       int64_t b, int64_t t, int64_t h, int64_t g, int64_t d,
                       const int32_t* positions = nullptr);
// dqkv += gradient; scratch holds B*H*T*T floats.
void attention_backward(Context& ctx, MathMode mode, const float* dout, const float* qkv,
                        const float* probs, float* dqkv, float* scratch, int64_t b, int64_t t,
                        int64_t h, int64_t g, int64_t d);

// --- softmax cross-entropy over logits (N, V) ---
// Columns [from, V) of each row = -inf (a padded vocabulary's columns), which
// every softmax below gives probability exactly 0 (expf(-inf) is 0).
void mask_columns(Context& ctx, float* logits, int64_t n, int64_t v, int64_t from);
void mask_columns(Context& ctx, bf16* logits, int64_t n, int64_t v, int64_t from);
// In place: logits become the probabilities; losses[i] = -log p[i][target[i]].
// Targets must lie in [0, V) (the caller checks on the host, as the embedding
// does); a row with a target outside gets a NaN loss rather than a stray write.
void softmax_cross_entropy(Context& ctx, float* logits, const int32_t* targets, float* losses,
                           int64_t n, int64_t v);
// dlogits (N,V) = (p - onehot(target - first)) * scale, from probs (may
// alias). The V columns are vocabulary [first, first + V): a target outside
// them (tensor parallelism: another rank's) subtracts nothing.
void cross_entropy_backward(Context& ctx, const float* probs, const int32_t* targets,
                            float* dlogits, float scale, int64_t n, int64_t v, int64_t first = 0);
// Both in one pass (the fused classifier): losses as above, and logits
// replaced in place by dlogits = (softmax - onehot) * scale.
void fused_cross_entropy(Context& ctx, float* logits, const int32_t* targets, float* losses,
                         float scale, int64_t n, int64_t v);
// The same with dlogits written to a separate bf16 (N, V), each rounded
// once (bf16 activations: the LM head's backward GEMMs read them as bf16);
// the logits are only read.
void fused_cross_entropy(Context& ctx, const float* logits, bf16* dlogits, const int32_t* targets,
                         float* losses, float scale, int64_t n, int64_t v);
// The same from bf16 logits (bf16 activations' LM head: its logits GEMM
// rounds them once), computed in fp32; dlogits may be the logits themselves.
void fused_cross_entropy(Context& ctx, const bf16* logits, bf16* dlogits, const int32_t* targets,
                         float* losses, float scale, int64_t n, int64_t v);

// --- the vocabulary-parallel cross-entropy's local steps (cpu_kernels.h's
// row_max, exp_and_stats, normalise_and_loss), logits (N, V) of vocabulary
// [first, first + V) ---
void row_max(Context& ctx, const float* logits, float* m, int64_t n, int64_t v);
void exp_and_stats(Context& ctx, float* logits, const int32_t* targets, int64_t first,
                   const float* m, float* sum, float* z, int64_t n, int64_t v);
// p /= sum per row; loss[0] = the sum over rows of log(sum) - z, rows whose
// target is kIgnoredTarget left out, summed in double and rounded once
// (queued: the host does not wait).
void normalise_and_loss(Context& ctx, float* p, const float* sum, const float* z,
                        const int32_t* targets, int64_t n, int64_t v, float* loss);

// --- token + position embedding (layers/embedding.h) ---
// y (B, T, C) = wte[tokens - first] + wpe[t]. wte holds the `rows` rows of
// tokens [first, first + rows); other tokens read zeros (by default the
// whole vocabulary, first 0). wpe may be null: no positions are added.
// `positions` (B*T), where given, replace t (--reset-position-ids).
void embedding_forward(Context& ctx, const int32_t* tokens, const float* wte, const float* wpe,
                       float* y, int64_t b, int64_t t, int64_t c, int64_t rows = INT64_MAX,
                       int64_t first = 0, const int32_t* positions = nullptr);
// The same into bf16 y: wte + wpe summed in fp32, then rounded.
void embedding_forward(Context& ctx, const int32_t* tokens, const float* wte, const float* wpe,
                       bf16* y, int64_t b, int64_t t, int64_t c, int64_t rows = INT64_MAX,
                       int64_t first = 0, const int32_t* positions = nullptr);
// dwte[tokens[i] - first] += dy[i] (atomic scatter-add) for this slice's
// tokens; dwpe[t] += sum_b dy[b, t]
void embedding_backward(Context& ctx, const int32_t* tokens, const float* dy, float* dwte,
                        float* dwpe, int64_t b, int64_t t, int64_t c, int64_t rows = INT64_MAX,
                        int64_t first = 0, const int32_t* positions = nullptr);
// The same from a bf16 dy (bf16 activations' gradient), each element widened.
void embedding_backward(Context& ctx, const int32_t* tokens, const bf16* dy, float* dwte,
                        float* dwpe, int64_t b, int64_t t, int64_t c, int64_t rows = INT64_MAX,
                        int64_t first = 0, const int32_t* positions = nullptr);

// --- AdamW, PyTorch semantics, as cpu::adamw; step is 1-based; each
// gradient element read as g * grad_scale (a clip's coefficient), or as
// g * *grad_scale_at when that is given (the coefficient on the device) ---
void adamw(Context& ctx, float* p, const float* g, float* m, float* v, int64_t n, float lr,
           float beta1, float beta2, float eps, float weight_decay, int64_t step,
           float grad_scale = 1.0f, const float* grad_scale_at = nullptr);

// --- AdamW over many tensors in one launch (the multi-tensor apply) ---
// One tensor of the update: p, m, v updated from g, n elements each; decay:
// in the weight-decay group (else decayed by nothing, as adamw with weight
// decay 0).
struct AdamWTensor {
  float* p;
  const float* g;
  float* m;
  float* v;
  int64_t n;
  bool decay;
  bool operator==(const AdamWTensor&) const = default;
};
// The device table of adamw_multi: each tensor's chunks (pointers and
// sizes), uploaded on the first call and again only when the tensors change;
// its memory is the caching allocator's, held from one step to the next.
class AdamWTable {
 public:
  int64_t chunks() const { return chunks_; }
  int64_t builds() const { return builds_; }  // uploads so far
  // The caller's list for this step, kept here so that a steady step
  // allocates nothing on the host either.
  std::vector<AdamWTensor> scratch;

 private:
  friend void adamw_multi(Context&, const std::vector<AdamWTensor>&, AdamWTable&, float, float,
                          float, float, float, int64_t, float, const float*);
  std::vector<AdamWTensor> key_;  // the tensors the table was built from
  DeviceBuffer<int64_t> words_;   // chunks_ launch::AdamWChunk records, 6 words each
  int64_t chunks_ = 0, builds_ = 0;
};
// Every tensor's update as adamw's on that tensor alone (weight_decay for
// the decay group, 0 for the rest), bit for bit, in one launch.
void adamw_multi(Context& ctx, const std::vector<AdamWTensor>& tensors, AdamWTable& table,
                 float lr, float beta1, float beta2, float eps, float weight_decay, int64_t step,
                 float grad_scale = 1.0f, const float* grad_scale_at = nullptr);

// --- sums of squares and scaling over many tensors (the gradient norm and clipping) ---
// One tensor: n elements from x.
struct MultiTensor {
  float* x;
  int64_t n;
  bool operator==(const MultiTensor&) const = default;
};
// The device table of sum_squares_multi and scale_multi, as AdamWTable: each
// tensor's chunks, uploaded on the first call and again only when the
// tensors change, with sum_squares_multi's partial sums beside it; the
// caching allocator's memory, held from one step to the next.
class MultiTensorTable {
 public:
  int64_t chunks() const { return chunks_; }
  int64_t builds() const { return builds_; }  // uploads so far
  // The caller's list for this call, kept here so that a steady step
  // allocates nothing on the host either.
  std::vector<MultiTensor> scratch;

 private:
  friend double sum_squares_multi(Context&, const std::vector<MultiTensor>&, MultiTensorTable&);
  friend void sum_squares_multi(Context&, const std::vector<MultiTensor>&, MultiTensorTable&,
                                float*);
  friend void scale_multi(Context&, const std::vector<MultiTensor>&, float, MultiTensorTable&,
                          const float*);
  // Chunks and uploads `tensors` unless they are the ones the table holds.
  void update(Context& ctx, const std::vector<MultiTensor>& tensors);
  std::vector<MultiTensor> key_;  // the tensors the table was built from
  DeviceBuffer<int64_t> words_;   // chunks_ launch::MultiChunk records, 2 words each
  DeviceBuffer<double> sums_;     // one partial per chunk, then the total
  int64_t chunks_ = 0, builds_ = 0;
};
// The sum over every tensor of sum x^2, in double: one launch writes each
// chunk's partial, a second adds the partials in a fixed order (the same
// bits on every call), and one download brings the total back: one wait
// for the compute stream however many tensors. Zero tensors (or elements)
// give 0 without a launch or a wait.
double sum_squares_multi(Context& ctx, const std::vector<MultiTensor>& tensors,
                         MultiTensorTable& table);
// The same total, rounded to a float, into *total on the device: nothing
// waits (zero tensors write 0).
void sum_squares_multi(Context& ctx, const std::vector<MultiTensor>& tensors,
                       MultiTensorTable& table, float* total);
// x *= s in every tensor, as scale_inplace on each (the same float
// multiply, so the same bits), in one launch; x *= *s_at when that is given.
void scale_multi(Context& ctx, const std::vector<MultiTensor>& tensors, float s,
                 MultiTensorTable& table, const float* s_at = nullptr);
// *coef = clip_coefficient(max_norm, sqrt(*sum_squares)) (weft/optimizer.h),
// bit for bit, on the device.
void clip_coefficient(Context& ctx, const float* sum_squares, double max_norm, float* coef);

// --- fp32 to bf16 over many tensors (a --bf16 step's weight copies) ---
// One tensor: n elements of x rounded into y.
struct ConvertTensor {
  const float* x;
  bf16* y;
  int64_t n;
  bool operator==(const ConvertTensor&) const = default;
};
// The device table of to_bf16_multi, as MultiTensorTable: each tensor's
// chunks (pointers and sizes), uploaded on the first call and again only
// when the tensors change; the caching allocator's memory, held from one
// step to the next.
class ConvertTable {
 public:
  int64_t chunks() const { return chunks_; }
  int64_t builds() const { return builds_; }  // uploads so far
  // The caller's list for this call, kept here so that a steady step
  // allocates nothing on the host either.
  std::vector<ConvertTensor> scratch;

 private:
  friend void to_bf16_multi(Context&, const std::vector<ConvertTensor>&, ConvertTable&);
  std::vector<ConvertTensor> key_;  // the tensors the table was built from
  DeviceBuffer<int64_t> words_;     // chunks_ launch::ConvertChunk records, 3 words each
  int64_t chunks_ = 0, builds_ = 0;
};
// y = x rounded to bf16 in every tensor, as to_bf16 on each (the same
// rounding to nearest even, so the same bits), in one launch. Zero tensors
// (or elements) launch nothing.
void to_bf16_multi(Context& ctx, const std::vector<ConvertTensor>& tensors, ConvertTable& table);

// --- SGD with momentum, PyTorch semantics, as cpu::sgd ---
void sgd(Context& ctx, float* p, const float* g, float* buf, int64_t n, float lr, float momentum,
         float weight_decay);

// --- Lion, as cpu::lion; the gradient read times grad_scale, or times
// *grad_scale_at where it is not null (a device scalar) ---
void lion(Context& ctx, float* p, const float* g, float* m, int64_t n, float lr, float beta1,
          float beta2, float weight_decay, float grad_scale, const float* grad_scale_at);

// --- reductions into one double on the device (deterministic two-pass trees) ---
void sum(Context& ctx, const float* x, int64_t n, double* out);          // *out = sum x
void sum(Context& ctx, const float* x, int64_t n, float* out);  // *out = float(sum x in double)
void sum_squares(Context& ctx, const float* x, int64_t n, double* out);  // *out = sum x^2
// The same, brought back to the host (waits for the compute stream).
double sum_to_host(Context& ctx, const float* x, int64_t n);
double sum_squares_to_host(Context& ctx, const float* x, int64_t n);

// --- bf16 conversion, round to nearest even ---
void to_bf16(Context& ctx, const float* x, bf16* y, int64_t n);
void to_float(Context& ctx, const bf16* x, float* y, int64_t n);
void add_bf16(Context& ctx, const bf16* x, float* y, int64_t n);  // y += float(x)
// y = x rounded to nearest even bf16 (mode BF16) or fp16 (FP16) values,
// kept as floats (y may be x): the CPU's rounding of its 16-bit GEMM
// operands, bit for bit; fp16 gives +-inf past 65504. Other modes throw.
void round_values(Context& ctx, MathMode mode, const float* x, float* y, int64_t n);

// --- fused causal attention: cuDNN's flash attention (src/cuda/fused_attention.cc) ---
// Only in builds with cuDNN (WEFT_CUDNN in weft_config.h). The layout of
// attention_forward above; q, k, v rounded to bf16, fp32 softmax statistics,
// outputs rounded to bf16 and widened. D must be a multiple of 8, at most 128.

// lse (B, H, T) = log sum_j exp(q_i k_j / sqrt(D)) over the causal j <= i:
// what the backward needs instead of the probabilities.
void fused_attention_forward(Context& ctx, const float* qkv, float* out, float* lse, int64_t b,
                             int64_t t, int64_t h, int64_t g, int64_t d);
// dqkv += gradient (= with accumulate false, dqkv unread); out and lse as
// the forward left them.
void fused_attention_backward(Context& ctx, const float* dout, const float* qkv, const float* out,
                              const float* lse, float* dqkv, int64_t b, int64_t t, int64_t h,
                              int64_t g, int64_t d, bool accumulate = true);
// bf16 activations: the same graphs, reading qkv and writing (then reading)
// out directly, without the rounding and widening copies: the fp32 overloads'
// computation on the widened qkv, out left in bf16. Their gradients dout and
// dqkv are bf16 too: dout is read as it is, and cuDNN writes a fresh dqkv
// (accumulate false) itself; otherwise it writes bf16 scratch that is added
// to dqkv (one rounding). qkv, out, dout and dqkv must be 16-byte aligned
// (the alignment the graphs declare to cuDNN).
void fused_attention_forward(Context& ctx, const bf16* qkv, bf16* out, float* lse, int64_t b,
                             int64_t t, int64_t h, int64_t g, int64_t d);
void fused_attention_backward(Context& ctx, const bf16* dout, const bf16* qkv, const bf16* out,
                              const float* lse, bf16* dqkv, int64_t b, int64_t t, int64_t h,
                              int64_t g, int64_t d, bool accumulate = true);
// How many cuDNN graphs (one per shape and direction) this device has built.
size_t fused_attention_graphs(Context& ctx);

}  // namespace weft::cuda
