// Kernel launchers: the boundary between nvcc-compiled device code (*.cu) and
// the host code that checks arguments, takes scratch memory and reports errors
// (*.cc, compiled by the C++ compiler).
//
// The .cu files include only this header and CUDA's: nvcc's C++20 front end
// cannot compile fmt, so weft/error.h (and every weft header that includes it)
// stays on the .cc side. Launchers queue one or two kernels on `stream` and
// return; the caller checks cudaGetLastError (WEFT_LAUNCH_CHECK). Arguments
// are as in weft/cuda/kernels.h; bf16 arrays are passed as uint16_t. A
// launcher of bf16 activations runs the same kernel body as its fp32 twin
// (the kernel is templated on the element type), rounding only on the store.
#pragma once

#include <weft/targets.h>

#include <cuda_runtime.h>

#include <cstdint>

namespace weft::cuda::launch {

// --- LayerNorm ---
void layernorm_forward(cudaStream_t s, const float* x, const float* w, const float* b, float* y,
                       float* mean, float* rstd, int64_t n, int64_t c, float eps);
void layernorm_forward(cudaStream_t s, const uint16_t* x, const float* w, const float* b,
                       uint16_t* y, float* mean, float* rstd, int64_t n, int64_t c, float eps);
void layernorm_backward_input(cudaStream_t s, const float* dy, const float* x, const float* w,
                              const float* mean, const float* rstd, float* dx, int64_t n,
                              int64_t c);
void layernorm_backward_input(cudaStream_t s, const uint16_t* dy, const uint16_t* x,
                              const float* w, const float* mean, const float* rstd, uint16_t* dx,
                              int64_t n, int64_t c);

// A residual add fused with the LayerNorm of its sum: sum = x + a, y =
// LayerNorm(sum), the bits of add then layernorm_forward. Runs where the
// 16-byte kernel takes rows of c (a multiple of 8 up to 2048, every array
// 16-byte aligned) and says so; false, launching nothing, elsewhere.
bool add_layernorm_forward(cudaStream_t s, const float* x, const float* a, float* sum,
                           const float* w, const float* b, float* y, float* mean, float* rstd,
                           int64_t n, int64_t c, float eps);
bool add_layernorm_forward(cudaStream_t s, const uint16_t* x, const uint16_t* a, uint16_t* sum,
                           const float* w, const float* b, uint16_t* y, float* mean, float* rstd,
                           int64_t n, int64_t c, float eps);
// dx += d/dx, then copy = dx, in one kernel under the same conditions.
bool layernorm_backward_input_copy(cudaStream_t s, const float* dy, const float* x,
                                   const float* w, const float* mean, const float* rstd,
                                   float* dx, float* copy, int64_t n, int64_t c);
bool layernorm_backward_input_copy(cudaStream_t s, const uint16_t* dy, const uint16_t* x,
                                   const float* w, const float* mean, const float* rstd,
                                   uint16_t* dx, uint16_t* copy, int64_t n, int64_t c);

// --- column sums over rows: db += sum_i dy[i]; with x/mean/rstd also dw += sum_i dy xhat ---
// Row slices of the first pass; `partials` holds (dw ? 2 : 1) * slices * c floats.
int64_t column_slices(int64_t n);
void column_sums(cudaStream_t s, const float* dy, const float* x, const float* mean,
                 const float* rstd, float* dw, float* db, float* partials, int64_t n, int64_t c);
void column_sums(cudaStream_t s, const uint16_t* dy, const uint16_t* x, const float* mean,
                 const float* rstd, float* dw, float* db, float* partials, int64_t n, int64_t c);

// --- element-wise ---
void rmsnorm_forward(cudaStream_t s, const float* x, const float* w, float* y, float* rstd,
                     int64_t n, int64_t c, float eps);
void rmsnorm_backward_input(cudaStream_t s, const float* dy, const float* x, const float* w,
                            const float* rstd, float* dx, int64_t n, int64_t c);
void swiglu_forward(cudaStream_t s, const float* x, float* y, int64_t n, int64_t h);
void swiglu_backward(cudaStream_t s, const float* dy, const float* x, float* dx, int64_t n,
                     int64_t h);
// qkv (B, T, (H + 2G) D): rotates the H query and G key heads, copies the
// values. `positions` (B*T) may be null: each row's place in its sequence.
void rope(cudaStream_t s, bool backward, const float* src, float* dst, int64_t b, int64_t t,
          int64_t h, int64_t g, int64_t d, float base, const int32_t* positions);
// The same on bf16 activations (the weight and rstd fp32).
void rmsnorm_forward(cudaStream_t s, const uint16_t* x, const float* w, uint16_t* y, float* rstd,
                     int64_t n, int64_t c, float eps);
void rmsnorm_backward_input(cudaStream_t s, const uint16_t* dy, const uint16_t* x, const float* w,
                            const float* rstd, uint16_t* dx, int64_t n, int64_t c);
void swiglu_forward(cudaStream_t s, const uint16_t* x, uint16_t* y, int64_t n, int64_t h);
void swiglu_backward(cudaStream_t s, const uint16_t* dy, const uint16_t* x, uint16_t* dx,
                     int64_t n, int64_t h);
void rope(cudaStream_t s, bool backward, const uint16_t* src, uint16_t* dst, int64_t b, int64_t t,
          int64_t h, int64_t g, int64_t d, float base, const int32_t* positions);
void gelu_forward(cudaStream_t s, const float* x, float* y, int64_t n);
void gelu_forward(cudaStream_t s, const uint16_t* x, uint16_t* y, int64_t n);
void gelu_backward(cudaStream_t s, const float* dy, const float* x, float* dx, int64_t n,
                   bool accumulate);
void gelu_backward(cudaStream_t s, const uint16_t* dy, const uint16_t* x, uint16_t* dx, int64_t n,
                   bool accumulate);
void add_bias(cudaStream_t s, float* y, const float* bias, int64_t n, int64_t c);
void add_inplace(cudaStream_t s, float* y, const float* x, int64_t n);
void add_inplace(cudaStream_t s, uint16_t* y, const uint16_t* x, int64_t n);
void add_inplace(cudaStream_t s, uint16_t* y, const float* x, int64_t n);
void add(cudaStream_t s, const float* a, const float* b, float* y, int64_t n);
void add(cudaStream_t s, const uint16_t* a, const uint16_t* b, uint16_t* y, int64_t n);
void add_scaled(cudaStream_t s, float* y, const float* x, float scale, int64_t n);
void add_scaled(cudaStream_t s, uint16_t* y, const float* x, float scale, int64_t n);
void fill_rows(cudaStream_t s, uint16_t* y, const float* row, int64_t n, int64_t c);
// y (n, c; rows ldy apart) = bf16(x + bias) with x (n, c) contiguous fp32.
void add_bias_bf16(cudaStream_t s, const float* x, const uint16_t* bias, uint16_t* y, int64_t n,
                   int64_t c, int64_t ldy);
void scale_inplace(cudaStream_t s, float* y, float scale, int64_t n);
void fill32(cudaStream_t s, uint32_t* y, uint32_t bits, int64_t n);
void fill16(cudaStream_t s, uint16_t* y, uint16_t bits, int64_t n);

// --- cross-entropy, one block per row (n < 2^31) ---
void mask_columns(cudaStream_t s, float* logits, int64_t n, int64_t v, int64_t from);
void mask_columns_bf16(cudaStream_t s, uint16_t* logits, int64_t n, int64_t v, int64_t from);
void cross_entropy(cudaStream_t s, float* logits, const int32_t* targets, float* losses,
                   float scale, bool fused, int64_t n, int64_t v);
// The fused classifier's dlogits into a separate bf16 (N, V), logits unread after.
void cross_entropy_bf16(cudaStream_t s, const float* logits, uint16_t* dlogits,
                        const int32_t* targets, float* losses, float scale, int64_t n, int64_t v);
// The same from bf16 logits; dlogits may be the logits themselves.
void cross_entropy_bf16_logits(cudaStream_t s, const uint16_t* logits, uint16_t* dlogits,
                               const int32_t* targets, float* losses, float scale, int64_t n,
                               int64_t v);
void cross_entropy_backward(cudaStream_t s, const float* probs, const int32_t* targets,
                            float* dlogits, float scale, int64_t n, int64_t v, int64_t first);

// --- the vocabulary-parallel cross-entropy's local steps, one block per row ---
void row_max(cudaStream_t s, const float* logits, float* m, int64_t n, int64_t v);
void exp_and_stats(cudaStream_t s, float* logits, const int32_t* targets, int64_t first,
                   const float* m, float* sum, float* z, int64_t n, int64_t v);
void normalise(cudaStream_t s, float* p, const float* sum, const float* z, const int32_t* targets,
               float* losses, int64_t n, int64_t v);

// --- embedding ---
void embedding_forward(cudaStream_t s, const int32_t* tokens, const float* wte, int64_t rows,
                       int64_t first, const float* wpe, float* y, int64_t b, int64_t t, int64_t c,
                       const int32_t* positions);
void embedding_forward(cudaStream_t s, const int32_t* tokens, const float* wte, int64_t rows,
                       int64_t first, const float* wpe, uint16_t* y, int64_t b, int64_t t,
                       int64_t c, const int32_t* positions);
void embedding_backward(cudaStream_t s, const int32_t* tokens, const float* dy, float* dwte,
                        int64_t rows, int64_t first, float* dwpe, int64_t b, int64_t t, int64_t c,
                        const int32_t* positions);
void embedding_backward(cudaStream_t s, const int32_t* tokens, const uint16_t* dy, float* dwte,
                        int64_t rows, int64_t first, float* dwpe, int64_t b, int64_t t, int64_t c,
                        const int32_t* positions);

// --- SGD with momentum, as cpu::sgd ---
void sgd(cudaStream_t s, float* p, const float* g, float* buf, int64_t n, float lr,
         float momentum, float weight_decay);

// --- Lion, as cpu::lion (decay: 1 - lr * weight_decay, worked out on the host) ---
void lion(cudaStream_t s, float* p, const float* g, float* m, int64_t n, float lr, float beta1,
          float beta2, float decay, float grad_scale, const float* grad_scale_at);

// --- AdamW with the host-computed scalars of cpu::adamw ---
void adamw(cudaStream_t s, float* p, const float* g, float* m, float* v, int64_t n, float beta1,
           float beta2, float eps, float step_size, float bc2_sqrt, float decay,
           float grad_scale, const float* grad_scale_at = nullptr);

// One chunk of a tensor in adamw_multi's device table: n elements from p, g,
// m, v (already offset to the chunk), in the decay group when decay != 0.
struct AdamWChunk {
  float* p;
  const float* g;
  float* m;
  float* v;
  int64_t n;
  int64_t decay;
};
static_assert(sizeof(AdamWChunk) == 6 * sizeof(int64_t), "AdamWTable stores chunks as 6 words");
// Elements per chunk: blocks of 256 threads, 64 elements each.
constexpr int64_t kAdamWChunk = 16384;
// Every chunk of the table in one launch; the scalars as adamw's, decay_on for
// the decay group and decay_off for the rest.
void adamw_multi(cudaStream_t s, const AdamWChunk* chunks, int64_t count, float beta1,
                 float beta2, float eps, float step_size, float bc2_sqrt, float decay_on,
                 float decay_off, float grad_scale, const float* grad_scale_at = nullptr);

// One chunk of a tensor in MultiTensorTable's device table: n elements from x
// (already offset to the chunk).
struct MultiChunk {
  float* x;
  int64_t n;
};
static_assert(sizeof(MultiChunk) == 2 * sizeof(int64_t),
              "MultiTensorTable stores chunks as 2 words");
// Elements per chunk: blocks of 256 threads, 64 elements each.
constexpr int64_t kMultiChunk = 16384;
// sums[c] = sum of x^2 over chunk c (in double), for every chunk of the
// table, then sums[count] = the sum of those partials in a fixed order. One
// partial per chunk, whatever the grid, so the total's bits depend only on
// the chunks. count >= 1; sums holds count + 1 doubles. With `total`, the
// sum of the partials goes there instead, rounded to a float.
void sum_squares_multi(cudaStream_t s, const MultiChunk* chunks, int64_t count, double* sums,
                       float* total = nullptr);
// x *= scale over every chunk of the table (*scale_at in place of scale
// when given: a value on the device).
void scale_multi(cudaStream_t s, const MultiChunk* chunks, int64_t count, float scale,
                 const float* scale_at = nullptr);
// *coef = clip_coefficient(max_norm, sqrt(*sum_squares)) (weft/optimizer.h),
// in double as the host computes it, so the same bits.
void clip_coefficient(cudaStream_t s, const float* sum_squares, double max_norm, float* coef);

// One chunk of a tensor in ConvertTable's device table: n elements of x
// rounded into y (both already offset to the chunk), kMultiChunk at most.
struct ConvertChunk {
  const float* x;
  uint16_t* y;
  int64_t n;
};
static_assert(sizeof(ConvertChunk) == 3 * sizeof(int64_t), "ConvertTable stores chunks as 3 words");
// y = x rounded to nearest even bf16 (to_bf16's rounding) over every chunk
// of the table.
void to_bf16_multi(cudaStream_t s, const ConvertChunk* chunks, int64_t count);

// --- reductions: *out = sum x (or x^2), in double; `partials` holds reduce_blocks(n) doubles ---
int64_t reduce_blocks(int64_t n);
void reduce(cudaStream_t s, const float* x, int64_t n, bool square, double* partials, double* out);
// The same total rounded to a float *out (on the device: nothing waits).
void reduce(cudaStream_t s, const float* x, int64_t n, bool square, double* partials, float* out);

// --- bf16 ---
void to_bf16(cudaStream_t s, const float* x, uint16_t* y, int64_t n);
void to_float(cudaStream_t s, const uint16_t* x, float* y, int64_t n);
// y = x rounded to nearest even bf16 (bf16 true) or fp16 values, kept as
// floats; fp16 gives +-inf past its largest value.
void round_values(cudaStream_t s, const float* x, float* y, int64_t n, bool bf16);
void add_bf16(cudaStream_t s, const uint16_t* x, float* y, int64_t n);  // y += x
// The fused attention's backward at T = 1, which cuDNN's SDPA backward
// refuses: dqkv (B, (H + 2G) D) = 0 for q and k, and for value head j the
// sum of dout (B, H D) over its query heads j (H / G) .. (j + 1) (H / G) - 1.
void attention_one_position_backward(cudaStream_t s, const uint16_t* dout, uint16_t* dqkv,
                                     int64_t b, int64_t h, int64_t g, int64_t d);

// --- attention pieces (src/cuda/attention.cu) ---
// qkv (B, T, (H + 2G) D) -> q, k, v (B, H, T, D): query head i gets key/value
// head i / (H / G), repeated for each query head of its group.
void split_qkv(cudaStream_t s, const float* qkv, float* q, float* k, float* v, int64_t b,
               int64_t t, int64_t h, int64_t g, int64_t d);
// (B, H, T, D) -> (B, T, C) when to_rows, else (B, T, C) -> (B, H, T, D)
void permute_heads(cudaStream_t s, const float* src, float* dst, int64_t b, int64_t t, int64_t h,
                   int64_t d, bool to_rows);
// dqkv (B, T, (H + 2G) D) += dq, dk, dv (B, H, T, D): the inverse of split_qkv,
// each key/value head summing its query heads' gradients in order.
void accumulate_qkv(cudaStream_t s, const float* dq, const float* dk, const float* dv,
                    float* dqkv, int64_t b, int64_t t, int64_t h, int64_t g, int64_t d);
// Rows of stacked T x T score matrices: row r keeps columns 0 .. r % T, or
// with `positions` (B*T, h heads a batch row) only its document's.
void causal_softmax(cudaStream_t s, float* p, int64_t rows, int64_t t, int64_t h,
                    const int32_t* positions);
void softmax_backward(cudaStream_t s, const float* p, float* ds, int64_t rows, int64_t t);

}  // namespace weft::cuda::launch
