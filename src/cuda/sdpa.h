// The core of the fused causal attention (src/cuda/fused_attention.cc): one
// scaled-dot-product attention over bf16 arrays, forward and backward, queued
// on the context's compute stream. Two implementations: cuDNN's SDPA graphs
// (src/cuda/sdpa_cudnn.cc, a build with cuDNN), and the GPU emulator's
// stand-in (tests/cuda_emu/sdpa.cc, -Dgpu_emulator=true), which computes the
// same on the CPU so that everything around the core (the fp32 and bf16
// interfaces, their scratch, the layer's fused branch, the --bf16 step that
// runs it) runs in the emulator as it does on a GPU.
//
// Layout: qkv (B, T, (H + 2G) D) packs q | k | v per row; query head i reads
// key/value head i / (H / G); o and dout are (B, T, H D); lse (B, H, T) fp32
// is the row log-sum-exp (natural log) of the scaled, causally masked scores
// (scale 1 / sqrt(D)). Every bf16 array is 16-byte aligned, D a multiple of 8
// and at most 128 (the caller checks).
#pragma once

#include <weft/cuda/kernels.h>
#include <weft/cuda/runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace weft::cuda::sdpa {

struct Shape {
  int64_t b, t, h, g, d;
};
std::string describe(const Shape& k);  // "B 2 T 64 H 4 G 2 D 32"

// o = softmax(q k^T scale, causal) v, rounded to bf16; lse as above.
void forward(Context& ctx, const Shape& k, const bf16* qkv, bf16* o, float* lse);
// dq, dk, dv, written (not added) into dqkv, packed like qkv, every element;
// a key/value head's gradient summed over the query heads of its group.
// o and lse as the forward left them. T >= 2 (the caller handles T = 1).
void backward(Context& ctx, const Shape& k, const bf16* dout, const bf16* qkv, const bf16* o,
              const float* lse, bf16* dqkv);
// How many graphs (one per shape and direction) this device has built.
size_t graphs(Context& ctx);

}  // namespace weft::cuda::sdpa
