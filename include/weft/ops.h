// weft/ops.h — the operations layers are written in, on tensors of any device.
//
// A layer says *what* (a GEMM, a LayerNorm, a row sum) on Tensors; the
// tensors' device says *how*: cpu:: kernels (OpenBLAS, OpenMP loops) for
// Device::cpu(), cuda:: kernels (cuBLAS, CUDA) for Device::cuda(i), on that
// GPU's compute stream. Every tensor of one call must be on one device; a
// call that mixes devices, or asks for CUDA in a build without it, throws
// Error naming the operation and the devices. So each layer is one class for
// both devices, and nothing in layers/ holds a loop or a kernel launch.
//
//   ops::gemm(x, false, w, false, y);            // y (N, out) = x (N, in) w (in, out)
//   ops::add_rows(y, bias);                      // y (N, out) += bias (out)
//   ops::sum_rows(dy, db);                       // db (out) += sum over rows of dy
//
// Matrices: a tensor is read as the row-major (rows(), last()) matrix of its
// bytes, so (B, T, C) activations are (B*T, C) matrices. fp32 unless a
// parameter says otherwise; int32 for tokens and targets. "+=" in a comment
// means the operation accumulates into its output, as backward passes do.
//
// bf16 activations (--bf16): every float tensor argument may instead be
// BF16. An operation reads bf16 values exactly, computes in fp32 and rounds
// each BF16 output once, to nearest even; an accumulating one rounds
// float(out) + its fp32 result. A GPU runs bf16 kernels for the hot
// operations (GEMMs of two bf16 operands in cuBLAS); elsewhere, and always on
// the CPU, the operation runs its fp32 kernel on widened copies and rounds
// back, which gives the same values (a GEMM's up to its summation order).
// Parameters, their gradients and optimizer state stay fp32.
//
// Results that the host needs (a loss, a norm) come back as doubles; on a
// GPU those calls wait for the compute stream.
#pragma once

#include <weft/targets.h>
#include <weft/tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace weft::ops {

// How a device's GEMMs (ops::gemm and the attention's) round their inputs;
// products accumulate in fp32 and outputs are fp32 in every mode. Fp32 is
// exact fp32 products. Tf32 (CUDA only) uses tensor cores with 10-bit mantissa
// inputs. Bf16 and Fp16 round both operands to nearest even bf16 or fp16
// (--bf16, --fp16: mixed precision, everything outside the GEMMs stays fp32);
// fp16 overflows to +-inf past 65504. Both devices round copies of the
// operands (the GPU then multiplies them on TF32 tensor cores, which hold
// every bf16 and fp16 value exactly; the CPU runs its fp32 GEMM, slower
// than fp32 alone, there to check the numerics). Setting Tf32 on the CPU
// throws Error.
enum class MatmulPrecision : uint8_t { Fp32, Tf32, Bf16, Fp16 };
const char* matmul_precision_name(MatmulPrecision p);  // "fp32", "tf32", "bf16", "fp16"
void set_matmul_precision(Device device, MatmulPrecision precision);
MatmulPrecision matmul_precision(Device device);

// --- dtypes ---

// dst = src: F32 to BF16 (round to nearest even), BF16 to F32 (exact), or a
// copy between tensors of one dtype; the same element count.
void convert(const Tensor& src, const Tensor& dst);
// dsts[i] = srcs[i] rounded to bf16 for every i: F32 sources, BF16
// destinations of the same shapes, on one device (a --bf16 step's weight
// copies). On a GPU one launch rounds them all, with convert's rounding (the
// same bits), over a device table of the tensors kept in `cache`, as
// sum_squares_multi's: made on the first call, rebuilt only when the tensors
// change, so a steady step allocates nothing. The CPU calls convert on each
// pair in turn.
void convert_multi(const std::vector<Tensor>& srcs, const std::vector<Tensor>& dsts,
                   std::shared_ptr<void>& cache);
// How many calls of each operation (by name) found no bf16 kernel for their
// tensors' dtypes on their device and widened bf16 tensors to fp32 around
// an fp32 one, since the last reset (every call on the CPU; on a GPU, the
// ones a --bf16 step still pays conversions for); a GPU GEMM that rounds
// an fp32 operand to bf16 first counts too, as "gemm (an fp32 operand
// rounded to bf16)". Thread-safe.
std::map<std::string, int64_t> widened_ops();
void reset_widened_ops();

// --- matrices ---

// c = alpha * op(a) op(b) + beta * c; op(x) is x or its transpose.
void gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c,
          float alpha = 1.0f, float beta = 0.0f);
// c = op(a) op(b) + bias (C) in every row: a linear layer's forward. On a GPU
// one cuBLASLt GEMM adds the bias in its epilogue (a bf16 c takes the bias
// rounded to bf16); elsewhere, and for mixed dtypes, fill_rows(c, bias) then
// gemm(..., beta 1), which computes the same sums.
void gemm_bias(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& bias,
               const Tensor& c);
// An MLP's first GEMM and its GELU (layers/gelu_mlp.h): pre = op(a) op(b) +
// bias in every row, y = gelu(pre), both written. With bf16 a, b, pre and y
// on a GPU, one cuBLASLt GEMM does all of it in its epilogue (GELU of the
// fp32 sum; pre is that sum rounded); elsewhere gemm_bias, then gelu_forward.
void gemm_bias_gelu(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b,
                    const Tensor& bias, const Tensor& pre, const Tensor& y);
// The GELU's input gradient straight from the GEMM its output fed:
// dx = (op(a) op(b)) * gelu'(pre), written, not added. With bf16 a, b, pre
// and dx on a GPU, one cuBLASLt GEMM (the fp32 product times gelu', rounded
// once); elsewhere gemm (beta 0) into dx, then gelu_backward in place.
void gemm_dgelu(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& pre,
                const Tensor& dx);
// A linear layer's weight and bias gradients: c = op(a) b + beta c, and
// db += the sums of b's rows (dW += x^T dy, db += the sum of dy's rows).
// With bf16 a and b and fp32 c and db on a GPU, one cuBLASLt GEMM sums the
// bias gradient in its epilogue (into a scratch vector, then added to db)
// rather than a second pass reading b; elsewhere gemm, then sum_rows.
void gemm_bias_grad(const Tensor& a, bool trans_a, const Tensor& b, const Tensor& c, float beta,
                    const Tensor& db);
// y (N, C) = row (C) in every row (a bias, before a GEMM accumulates onto it).
void fill_rows(const Tensor& y, const Tensor& row);
// y (N, C) += row (C) in every row.
void add_rows(const Tensor& y, const Tensor& row);
// db (C) += the sum of dy's (N, C) rows.
void sum_rows(const Tensor& dy, const Tensor& db);

// --- element-wise ---

void add(const Tensor& y, const Tensor& x);  // y += x, the same element count
// y = a + b, the same element count, each sum rounded once (what y = a, then
// y += b, gives; on a GPU one kernel for tensors of one dtype).
void add(const Tensor& a, const Tensor& b, const Tensor& y);
void scale(const Tensor& y, float s);        // y *= s
// y += s x, x (fp32) left as it is: the bits of scale(x, s), then add(y, x),
// in one pass (y fp32, or bf16 on a GPU; elsewhere widened).
void add_scaled(const Tensor& y, const Tensor& x, float s);
double sum_squares(const Tensor& x);         // sum of x^2, accumulated in double
double sum(const Tensor& x);                 // sum of x, accumulated in double
// out (one F32 element) = float(sum(x)), left on x's device: nothing waits
// for a GPU (sum(x) returns it to the host, which waits).
void sum(const Tensor& x, const Tensor& out);

// Several fp32 tensors at once (a model's gradients: the norm and clipping),
// on one device. On a GPU each is one launch (and the sum one wait) over a
// device table of the tensors kept in `cache`, as adamw_multi's: made on the
// first call, rebuilt only when the tensors change, so a steady step
// allocates nothing. Give each tensor list its own cache: one that serves
// two lists rebuilds on every call.
// The sum over the tensors of sum_squares(x), in double. The CPU adds
// sum_squares(x) of each in turn to 0, so it gives what that loop gives, bit
// for bit; a GPU adds fixed chunks' partials in a fixed order (the same bits
// on every call, the CPU's to double rounding). No tensors: 0.
double sum_squares_multi(const std::vector<Tensor>& xs, std::shared_ptr<void>& cache);
// The same sum rounded to a float, into `out` (one F32 element on the
// tensors' device): nothing waits for a GPU.
void sum_squares_multi(const std::vector<Tensor>& xs, std::shared_ptr<void>& cache,
                       const Tensor& out);
// x *= s for every tensor: scale(x, s) on each, bit for bit.
void scale_multi(const std::vector<Tensor>& xs, float s, std::shared_ptr<void>& cache);
// The same with s read from `s` (one F32 element on the tensors' device).
void scale_multi(const std::vector<Tensor>& xs, const Tensor& s, std::shared_ptr<void>& cache);
// coef = clip_coefficient(max_norm, sqrt(sum_squares)) (weft/optimizer.h), bit
// for bit, worked out where the tensors are (one F32 element each): on a
// GPU the host neither waits nor reads the norm.
void clip_coefficient(const Tensor& sum_squares, double max_norm, const Tensor& coef);

// A one-element tensor's value, and setting it (the loss and its seed gradient).
float item(const Tensor& t);
void set_item(const Tensor& t, float value);
// Every element = value (of a BF16 tensor: value rounded to bf16).
void fill(const Tensor& t, float value);

// --- LayerNorm over the last dimension, eps inside the square root ---

// x, y (N, C); w, b (C); mean, rstd (N)
void layernorm_forward(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& y,
                       const Tensor& mean, const Tensor& rstd, float eps);
// dx (N, C) += d/dx
void layernorm_backward_input(const Tensor& dy, const Tensor& x, const Tensor& w,
                              const Tensor& mean, const Tensor& rstd, const Tensor& dx);
// dw, db (C) += d/dw, d/db
void layernorm_backward_weight(const Tensor& dy, const Tensor& x, const Tensor& mean,
                               const Tensor& rstd, const Tensor& dw, const Tensor& db);
// A residual add and the LayerNorm of its sum: sum = x + a (add's bits),
// then layernorm_forward(sum, ...). On a GPU one kernel reads x and a and
// writes both, where rows allow (weft/cuda/kernels.h); the same bits.
void add_layernorm_forward(const Tensor& x, const Tensor& a, const Tensor& w, const Tensor& b,
                           const Tensor& sum, const Tensor& y, const Tensor& mean,
                           const Tensor& rstd, float eps);
// layernorm_backward_input(dy, x, w, mean, rstd, dx), then copy = dx (written
// whole); on a GPU one kernel where rows allow.
void layernorm_backward_input_copy(const Tensor& dy, const Tensor& x, const Tensor& w,
                                   const Tensor& mean, const Tensor& rstd, const Tensor& dx,
                                   const Tensor& copy);

// --- RMSNorm over the last dimension (Llama): y = x / sqrt(mean(x^2) + eps) * w ---

// x, y (N, C); w (C); rstd (N)
void rmsnorm_forward(const Tensor& x, const Tensor& w, const Tensor& y, const Tensor& rstd,
                     float eps);
void rmsnorm_backward_input(const Tensor& dy, const Tensor& x, const Tensor& w,
                            const Tensor& rstd, const Tensor& dx);  // dx +=
void rmsnorm_backward_weight(const Tensor& dy, const Tensor& x, const Tensor& rstd,
                             const Tensor& dw);  // dw +=

// --- SwiGLU: x (N, 2H) = [gate | up] -> y (N, H) = silu(gate) * up ---

void swiglu_forward(const Tensor& x, const Tensor& y);
void swiglu_backward(const Tensor& dy, const Tensor& x, const Tensor& dx);  // dx +=

// --- rotary position embedding of q and k in a packed qkv (B, T, (H + 2G) D) ---
// `heads` query heads, then `groups` key and `groups` value heads (see
// layers/attention.h). Pairs (i, i + D/2) of each q and k head rotate by
// t * base^(-2i/D); v is copied. y must not alias qkv. `positions` (B, T)
// int32, where given, replace t: each token's position within its document
// (--reset-position-ids; check_positions' rule).
void rope_forward(const Tensor& qkv, const Tensor& y, int64_t heads, int64_t groups, float base,
                  const Tensor& positions = {});
void rope_backward(const Tensor& dy, const Tensor& dqkv, int64_t heads, int64_t groups, float base,
                   const Tensor& positions = {});  // dqkv +=

// Throws Error unless `positions` (B, T) int32 are positions within
// documents: each 0, or one more than the token before it's, and below
// `limit` (the rows of a position table) where limit > 0. Checked on the
// host only (a device's come from the data reader, which makes them so).
void check_positions(const Tensor& positions, int64_t limit = 0);

// --- tanh-approximated GELU ---

void gelu_forward(const Tensor& x, const Tensor& y);
// dx += dy gelu'(x); with accumulate false, dx = dy gelu'(x), its old bytes unread.
void gelu_backward(const Tensor& dy, const Tensor& x, const Tensor& dx, bool accumulate = true);

// --- causal self-attention on a packed qkv (B, T, (H + 2G) D) -> out (B, T, H D) ---
// H = heads query heads share G = groups key/value heads (G = H: multi-head).

// probs (B, H, T, T) keeps the softmax for backward. `positions` (B, T)
// int32, where given: each token's position p within its document
// (--reset-attention-mask); query t then reads keys t - p .. t only. The
// backward needs nothing more: probs are 0 elsewhere.
void attention_forward(const Tensor& qkv, const Tensor& out, const Tensor& probs, int64_t heads,
                       int64_t groups, const Tensor& positions = {});
// dqkv += gradient; scratch holds B*H*T*T floats.
void attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& probs,
                        const Tensor& dqkv, const Tensor& scratch, int64_t heads, int64_t groups);

// Which method computes attention on a device (set once, before training):
//   Unfused: the scores q k^T materialised, probs (B, H, T, T) kept for the
//            backward; fp32 (or the GEMMs' precision). The only one on a CPU.
//   Fused:   cuDNN's fused flash attention: q, k, v rounded to bf16, fp32
//            softmax statistics, no T x T tensor; only the row log-sum-exp
//            (B, H, T) kept. CUDA builds with cuDNN only (fused_attention_built),
//            head size a multiple of 8, at most 128.
//   Auto:    Fused where the GEMMs run in bf16 (MatmulPrecision::Bf16), the
//            build has it and the head size suits it; Unfused otherwise.
enum class AttentionBackend : uint8_t { Auto, Unfused, Fused };
const char* attention_backend_name(AttentionBackend b);  // "auto", "unfused", "fused"
AttentionBackend parse_attention_backend(const std::string& name);  // throws Error otherwise
// Throws Error for Fused on a CPU or in a build without cuDNN fused attention.
void set_attention_backend(Device device, AttentionBackend backend);
AttentionBackend attention_backend(Device device);
// Whether this build has cuDNN's fused attention (CUDA and cuDNN found at set-up).
bool fused_attention_built();
// Whether attention of head size `head_size` on `device` runs fused: Auto resolved.
bool attention_uses_fused(Device device, int64_t head_size);

// The fused forward: out as attention_forward; lse (B, H, T) = the log-sum-exp
// of each row of the scaled, causally masked scores, all the backward needs.
void attention_forward_fused(const Tensor& qkv, const Tensor& out, const Tensor& lse,
                             int64_t heads, int64_t groups);
// dqkv += gradient (= with accumulate false: dqkv's old bytes unread); out
// and lse as attention_forward_fused left them.
void attention_backward_fused(const Tensor& dout, const Tensor& qkv, const Tensor& out,
                              const Tensor& lse, const Tensor& dqkv, int64_t heads,
                              int64_t groups, bool accumulate = true);

// --- token and position embedding over a vocabulary slice ---
// wte holds the rows of tokens [first, first + wte.rows); a token outside
// gives a zero row (tensor parallelism: another rank holds it). first = 0
// and the whole table is the plain embedding.

// Throws Error naming the first token outside [0, vocab) and its position.
// On a GPU nothing is checked here: tokens reach the device from the data
// reader, which checks them on the host.
// With `targets`, kIgnoredTarget is allowed too.
void check_token_range(const Tensor& tokens, int64_t vocab, const char* what, bool targets = false);
// y (B, T, C) = wte[tokens - first] (or 0) + wpe[t]; wpe may be undefined
// (no positions added: with tensor parallelism only one rank adds them).
// `positions` (B, T) int32, where given, replace t (--reset-position-ids).
void embedding_forward(const Tensor& tokens, const Tensor& wte, int64_t first, const Tensor& wpe,
                       const Tensor& y, const Tensor& positions = {});
// dwte[tokens - first] += dy for the tokens of this slice; dwpe[t] += sum_b dy[b, t]
// (dwpe[positions[b, t]] += dy[b, t] where positions are given).
void embedding_backward(const Tensor& tokens, const Tensor& dy, const Tensor& dwte, int64_t first,
                        const Tensor& dwpe, const Tensor& positions = {});

// --- softmax cross-entropy over logits (N, V) ---

// Columns [from, V) of every row of logits (N, V) become -inf: a padded
// vocabulary's rows, which every softmax below then gives probability exactly 0.
void mask_columns(const Tensor& logits, int64_t from);

// In place: logits become the probabilities; losses (N) = -log p[target].
// Returns the sum of the losses.
double softmax_cross_entropy(const Tensor& logits, const Tensor& targets, const Tensor& losses);
// Both at once, the fused classifier: losses and the returned sum as above,
// and logits replaced in place by dlogits = (softmax - onehot(target)) * scale.
// On a GPU one kernel reads each row twice and writes it once; the CPU runs
// the two steps (softmax_cross_entropy, then cross_entropy_backward in place).
double fused_cross_entropy(const Tensor& logits, const Tensor& targets, const Tensor& losses,
                           float scale);
// The same without the sum, so nothing waits for a GPU (the LM head sums its
// losses on the device, with sum(losses, out)); fused_cross_entropy is this,
// then sum(losses).
void fused_cross_entropy_rows(const Tensor& logits, const Tensor& targets, const Tensor& losses,
                              float scale);
// The same into a separate dlogits of logits' shape, F32 or BF16 (rounded
// once: bf16 activations' LM head, whose backward GEMMs round them to bf16
// anyway); fp32 logits are left as they were on a GPU, and may be changed on
// the CPU. BF16 logits (read exactly, computed in fp32) need BF16 dlogits,
// which may be the logits themselves.
void fused_cross_entropy_rows(const Tensor& logits, const Tensor& targets, const Tensor& losses,
                              float scale, const Tensor& dlogits);
// dlogits (N, V) = (probs - onehot(target - first)) * scale; may alias probs.
// With first != 0 or a slice of the vocabulary, targets outside it add nothing.
void cross_entropy_backward(const Tensor& probs, const Tensor& targets, int64_t first,
                            const Tensor& dlogits, float scale);

// The vocabulary-parallel cross-entropy's local steps (Megatron's): each rank
// holds logits (N, V/tp) of vocabulary [first, first + V/tp).
// max (N) = the row maxima of the local logits.
void row_max(const Tensor& logits, const Tensor& max);
// In place: logits become exp(logit - max); stats (2, N) = the row sums of
// those, then logit[target] - max where this slice holds the target, else 0.
void exp_and_stats(const Tensor& logits, const Tensor& targets, int64_t first, const Tensor& max,
                   const Tensor& stats);
// In place: exps become probabilities, exps / sum; loss (one F32 on the same
// device) = the sum over rows of log(sum) - z, from the all-reduced stats
// (2, N), summed in double and rounded once, rows whose target is
// kIgnoredTarget left out. On a GPU nothing waits for it.
void normalise_and_loss(const Tensor& exps, const Tensor& stats, const Tensor& targets,
                        const Tensor& loss);

// --- mean-squared error, as a sum: 0.5 * sum (pred - target)^2 ---

double mse_loss(const Tensor& pred, const Tensor& target);
// d (same shape) += g * (pred - target)
void mse_backward(const Tensor& pred, const Tensor& target, float g, const Tensor& d);

// --- AdamW, PyTorch semantics (decoupled decay, bias-corrected moments) ---

struct AdamWStep {
  float lr = 0, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0;
  int64_t step = 1;  // 1-based
  // Each gradient element is read as g * grad_scale, rounded once: a clip's
  // coefficient, with the bits of scale(g, grad_scale) first but no pass
  // over the gradients (g itself is left as it was).
  float grad_scale = 1.0f;
};
// p, g, m, v: the same element count; p, m, v are updated. `grad_scale_at`,
// when defined (one F32 element on the update's device), is read in place of
// s.grad_scale, where it is: a clip coefficient the device worked out.
void adamw(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v, const AdamWStep& s,
           const Tensor& grad_scale_at = Tensor());

// Several tensors' updates at once: each as adamw(p, g, m, v, s) with
// s.weight_decay where decay is set and 0 where not, bit for bit. On a GPU
// one launch updates them all from a device table of the tensors, kept in
// `cache` (made on the first call, rebuilt only when the tensors change, so a
// steady step allocates nothing); the CPU calls adamw on each in turn.
struct AdamWTensors {
  Tensor p, g, m, v;
  bool decay = true;
};
void adamw_multi(const std::vector<AdamWTensors>& ts, const AdamWStep& s,
                 std::shared_ptr<void>& cache, const Tensor& grad_scale_at = Tensor());

// --- SGD with momentum, PyTorch semantics (L2 weight decay, no dampening) ---
// p, g, buf: the same element count; p and the momentum buffer are updated.
void sgd(const Tensor& p, const Tensor& g, const Tensor& buf, float lr, float momentum,
         float weight_decay);

// --- Lion (weft/optimizer.h, LionConfig): p, g and the momentum m of n
// elements each; the gradient read times grad_scale, or times the device
// scalar grad_scale_at where defined ---
void lion(const Tensor& p, const Tensor& g, const Tensor& m, float lr, float beta1, float beta2,
          float weight_decay, float grad_scale, const Tensor& grad_scale_at = Tensor());

}  // namespace weft::ops
