// Tied LM head + cross-entropy: (x (B, T, C), targets (B, T) int32) -> loss (1).
//
//   logits = x wte^T          (B, T, V), wte shared with the embedding
//   loss   = sum over tokens of -log softmax(logits)[target]
// The output is the SUM of token losses; the caller seeds its gradient with
// 1 / (tokens in the global batch), which makes the result the gradient of the
// mean whatever the split into micro-batches and replicas.
//
// One layer for one process and for a tensor-parallel group (Megatron's
// vocab-parallel cross-entropy): with a group of tp ranks, rank r holds rows
// [r V/tp, (r+1) V/tp) of wte and computes only its logits, x wte_r^T. The
// softmax over the whole vocabulary needs three numbers per token, combined
// across the group:
//   m   = max over ranks of the local row max                (all-reduce Max)
//   S   = sum over ranks of sum_j exp(logit_j - m)            (all-reduce Sum)
//   z_t = the target's logit - m, from the rank that holds it (same all-reduce)
// loss = sum over tokens of log S - z_t. No rank ever holds full logits. x
// enters through copy_to_tp, so dx is the sum of every rank's dlogits_r wte_r.
// Without a group (or a group of one) the whole vocabulary is here and the
// softmax and loss are one fused pass.
//
// Chunked: where the logits (N, V) would take more than chunk_bytes() (GPT-2
// at B 16, T 1024: 3.1 GiB in fp32), without a group and with the logits
// not kept, the forward goes through the rows a chunk at a
// time: logits, loss and dlogits for a loss gradient of 1 (the fused
// classifier), then that chunk's dx (N, C) and dwte (V, C) contributions.
// The backward only scales those by the loss gradient g and adds them. The
// head then holds one chunk of logits, dx and dwte (fp32) instead of all the
// logits; its F does the work of I and W. The same on every device.
//
// bf16 activations (the input x is bf16), without a group and with the
// logits not kept: the logits GEMM writes bf16 logits (rounded once, as
// PyTorch's autocast and llm.c keep them), the classifier reads them in fp32
// and overwrites them with bf16 dlogits, and the backward GEMMs read those
// with the table's bf16 copy. Half the bytes of fp32 logits, and no second
// (N, V) buffer for the dlogits. The loss is computed in fp32 from the
// rounded logits.
//
// A padded table (wte->true_rows, Megatron's --make-vocab-size-divisible-by)
// has rows past the true vocabulary V. Their logits are set to -inf before
// either softmax, so they take no probability, and their dlogits and wte
// gradients are exactly zero: the loss is the unpadded model's. Tensor
// parallelism splits the padded rows, so a rank may hold only padding.
//
// Under sequence parallelism x arrives as this rank's tokens: the forward
// gathers it whole, dx is reduce-scattered back to the tokens, and W
// gathers x again.
#pragma once

#include <weft/communicator.h>
#include <weft/layer.h>

#include <optional>

#include "layers/tp_regions.h"

namespace weft {

class TiedLmHeadLoss final : public Layer {
 public:
  // wte (V, C), or this rank's rows (V/tp, C) of it (wte->shard says which),
  // V padded or not. `group`: the tensor-parallel group, or null.
  explicit TiedLmHeadLoss(Param* wte, Communicator* group = nullptr,
                          std::optional<SequenceParallel> sp = std::nullopt);
  const char* kind() const override {
    return group_ ? "vocab_parallel_lm_head_loss" : "lm_head_loss";
  }
  std::vector<Shape> output_shapes(std::span<const Shape> in) const override;
  std::vector<Param*> params() const override { return {wte_}; }
  double flops(std::span<const Shape> in) const override;
  std::unique_ptr<LayerCtx> make_ctx() const override;
  // Keep the logits (B, T, V, or this rank's V/tp columns; V padded, with
  // -inf in the padding columns) in the ctx after forward, for sampling and
  // tests.
  void set_keep_logits(bool keep) { keep_logits_ = keep; }
  // Rows per chunk (tests); 0, the default: chunk_rows(n, v, device).
  void set_chunk_rows(int64_t rows) { chunk_rows_ = rows; }
  // The most bytes of logits a chunk holds: 256 MiB on every device. GPT-2
  // at B 16, T 1024: 13 chunks of 1261 rows of fp32 logits, or on a GPU 7
  // chunks of 2341 rows of bf16 logits (0.22 GiB each; the CPU widens a bf16
  // chunk to fp32 for the mask and the classifier, so it budgets 4 bytes).
  // A GPU once took 1 GiB, for fewer, larger GEMMs and fewer passes over
  // the fp32 (V, C) weight-gradient accumulator (0.31 GB for GPT-2): 2
  // chunks of bf16 logits, 0.77 GiB each, which put --bf16's peak above
  // torch.compile's; 7 chunks cost about 1% of the step by the byte count.
  static int64_t chunk_bytes(const Device& d) {
    (void)d;
    return int64_t{256} << 20;
  }
  // Rows per chunk for n rows of v logits of `elem_bytes` each (4 fp32, 2
  // bf16) on `d`: the rows split evenly over the fewest chunks whose logits
  // fit chunk_bytes(d); n when they all fit (no chunking).
  static int64_t chunk_rows(int64_t n, int64_t v, const Device& d, int64_t elem_bytes = 4);
  // Logits of the last forward on this ctx (needs set_keep_logits(true)):
  // columns first_token() .. of the full logits.
  static const Tensor& logits(LayerCtx& ctx);
  int64_t first_token() const { return first_; }
  // The same layer over the embedding's rows of wte; the vocabulary must
  // divide by the group size.
  std::unique_ptr<Layer> tensor_parallel(TpBuild& build) const override;
  void forward(LayerCtx& ctx, Arena& arena, std::span<const Tensor> in,
               std::span<const Tensor> out) override;
  void backward_input(LayerCtx& ctx, Arena& arena, std::span<const Tensor> grad_out,
                      std::span<const Tensor> grad_in) override;
  void backward_weight(LayerCtx& ctx, Arena& arena) override;

 private:
  bool split() const { return group_ != nullptr && group_->size() > 1; }
  void forward_chunked(LayerCtx& ctx, Arena& arena, std::span<const Tensor> in,
                       std::span<const Tensor> out, int64_t rows);
  Communicator* group_;
  Param* wte_;
  int64_t vocab_;  // V, the whole vocabulary without padding
  int64_t first_;  // the first token id of this rank's rows
  bool keep_logits_ = false;
  int64_t chunk_rows_ = 0;
  std::optional<SequenceParallel> sp_;
};

}  // namespace weft
