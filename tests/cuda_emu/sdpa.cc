// GPU emulator: a stand-in for cuDNN's fused attention (src/cuda/sdpa.h),
// so that -Dgpu_emulator=true builds have WEFT_CUDNN and run what a GPU
// with cuDNN runs around it: the fp32 and bf16 interfaces and their scratch
// (src/cuda/fused_attention.cc), the attention layer's fused branch (the lse
// stash, the fresh dqkv it writes), and the --bf16 step that takes it by
// default. It is not cuDNN: its results say nothing of cuDNN's kernels, only
// of the code around them (tests/cuda_emu/README.md).
//
// The arithmetic is cuDNN's as test_cuda_fused_attention's error model
// describes it: bf16 q, k, v and dO; scores, softmax statistics and sums in
// fp32; P and dS rounded to bf16 before the products that use them; outputs
// rounded to bf16. It runs on the compute stream in stream order, as one
// kernel (WEFT_EMU_HOST_ONLY=1 counts it and drops it), and builds nothing:
// "graphs" counts the shapes and directions seen, as cuDNN's cache would.
#include <weft/cuda/kernels.h>
#include <weft/cuda/runtime.h>

#include "src/cuda/sdpa.h"
#include "tests/cuda_emu/streams.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <mutex>
#include <set>
#include <tuple>
#include <vector>

namespace weft::cuda::sdpa {

namespace {

float load(const bf16* p, int64_t i) {
  const uint32_t u = static_cast<uint32_t>(p[i].bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
float round_bf16(float x) {
  const uint16_t b = to_bf16(x).bits;
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

struct Seen {
  std::mutex mu;
  std::set<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, bool>> keys;
};
Seen& seen(Context& ctx) {
  static std::array<Seen, 64> all;
  return all[static_cast<size_t>(ctx.device())];
}
void note(Context& ctx, const Shape& k, bool backward) {
  Seen& s = seen(ctx);
  std::lock_guard lock(s.mu);
  s.keys.emplace(k.b, k.t, k.h, k.g, k.d, backward);
}

// Element (b, row t, head block `head` of width D, column d) of an array
// whose rows are `width` wide.
int64_t at(const Shape& k, int64_t width, int64_t bi, int64_t ti, int64_t head, int64_t dd) {
  return (bi * k.t + ti) * width + head * k.d + dd;
}

// The scaled scores of query row i of head hi against keys j <= i, in s.
void scores(const Shape& k, const bf16* qkv, int64_t bi, int64_t hi, int64_t i,
            std::vector<float>& s) {
  const int64_t w = (k.h + 2 * k.g) * k.d, kv = k.h + hi / (k.h / k.g);
  const float scale = 1.0f / std::sqrt(static_cast<float>(k.d));
  for (int64_t j = 0; j <= i; ++j) {
    float dot = 0;
    for (int64_t dd = 0; dd < k.d; ++dd)
      dot += load(qkv, at(k, w, bi, i, hi, dd)) * load(qkv, at(k, w, bi, j, kv, dd));
    s[static_cast<size_t>(j)] = dot * scale;
  }
}

void run_forward(const Shape& k, const bf16* qkv, bf16* o, float* lse) {
  const int64_t w = (k.h + 2 * k.g) * k.d, c = k.h * k.d;
  std::vector<float> s(static_cast<size_t>(k.t)), acc(static_cast<size_t>(k.d));
  for (int64_t bi = 0; bi < k.b; ++bi)
    for (int64_t hi = 0; hi < k.h; ++hi) {
      const int64_t vh = k.h + k.g + hi / (k.h / k.g);
      for (int64_t i = 0; i < k.t; ++i) {
        scores(k, qkv, bi, hi, i, s);
        float m = s[0];
        for (int64_t j = 1; j <= i; ++j) m = std::max(m, s[static_cast<size_t>(j)]);
        float l = 0;
        for (int64_t j = 0; j <= i; ++j) l += std::exp(s[static_cast<size_t>(j)] - m);
        const float row_lse = m + std::log(l);
        lse[(bi * k.h + hi) * k.t + i] = row_lse;
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t j = 0; j <= i; ++j) {
          const float p = round_bf16(std::exp(s[static_cast<size_t>(j)] - row_lse));
          for (int64_t dd = 0; dd < k.d; ++dd)
            acc[static_cast<size_t>(dd)] += p * load(qkv, at(k, w, bi, j, vh, dd));
        }
        for (int64_t dd = 0; dd < k.d; ++dd)
          o[(bi * k.t + i) * c + hi * k.d + dd] = to_bf16(acc[static_cast<size_t>(dd)]);
      }
    }
}

void run_backward(const Shape& k, const bf16* dout, const bf16* qkv, const bf16* o,
                  const float* lse, bf16* dqkv) {
  const int64_t w = (k.h + 2 * k.g) * k.d, c = k.h * k.d, per = k.h / k.g;
  const float scale = 1.0f / std::sqrt(static_cast<float>(k.d));
  const size_t td = static_cast<size_t>(k.t * k.d);
  std::vector<float> s(static_cast<size_t>(k.t)), dq(td), dk(td), dv(td);
  for (int64_t bi = 0; bi < k.b; ++bi)
    for (int64_t gi = 0; gi < k.g; ++gi) {
      const int64_t kh = k.h + gi, vh = k.h + k.g + gi;
      std::fill(dk.begin(), dk.end(), 0.0f);
      std::fill(dv.begin(), dv.end(), 0.0f);
      for (int64_t hi = gi * per; hi < (gi + 1) * per; ++hi) {
        std::fill(dq.begin(), dq.end(), 0.0f);
        for (int64_t i = 0; i < k.t; ++i) {
          scores(k, qkv, bi, hi, i, s);
          const float row_lse = lse[(bi * k.h + hi) * k.t + i];
          float d_i = 0;  // dO_i . O_i
          for (int64_t dd = 0; dd < k.d; ++dd) {
            const int64_t e = (bi * k.t + i) * c + hi * k.d + dd;
            d_i += load(dout, e) * load(o, e);
          }
          for (int64_t j = 0; j <= i; ++j) {
            const float p = std::exp(s[static_cast<size_t>(j)] - row_lse);
            float dp = 0;
            for (int64_t dd = 0; dd < k.d; ++dd)
              dp += load(dout, (bi * k.t + i) * c + hi * k.d + dd) *
                    load(qkv, at(k, w, bi, j, vh, dd));
            const float ds = round_bf16(p * (dp - d_i)), pb = round_bf16(p);
            for (int64_t dd = 0; dd < k.d; ++dd) {
              const size_t id = static_cast<size_t>(i * k.d + dd);
              const size_t jd = static_cast<size_t>(j * k.d + dd);
              dq[id] += scale * ds * load(qkv, at(k, w, bi, j, kh, dd));
              dk[jd] += scale * ds * load(qkv, at(k, w, bi, i, hi, dd));
              dv[jd] += pb * load(dout, (bi * k.t + i) * c + hi * k.d + dd);
            }
          }
        }
        for (int64_t i = 0; i < k.t; ++i)
          for (int64_t dd = 0; dd < k.d; ++dd)
            dqkv[at(k, w, bi, i, hi, dd)] = to_bf16(dq[static_cast<size_t>(i * k.d + dd)]);
      }
      for (int64_t j = 0; j < k.t; ++j)
        for (int64_t dd = 0; dd < k.d; ++dd) {
          dqkv[at(k, w, bi, j, kh, dd)] = to_bf16(dk[static_cast<size_t>(j * k.d + dd)]);
          dqkv[at(k, w, bi, j, vh, dd)] = to_bf16(dv[static_cast<size_t>(j * k.d + dd)]);
        }
    }
}

}  // namespace

void forward(Context& ctx, const Shape& k, const bf16* qkv, bf16* o, float* lse) {
  note(ctx, k, false);
  if (!weft_emu::count(weft_emu::Work::kernel)) return;
  weft_emu::enqueue(ctx.compute_stream(), [=] { run_forward(k, qkv, o, lse); });
}

void backward(Context& ctx, const Shape& k, const bf16* dout, const bf16* qkv, const bf16* o,
              const float* lse, bf16* dqkv) {
  check(k.t >= 2, "the fused attention's backward takes T >= 2, not {}", k.t);
  note(ctx, k, true);
  if (!weft_emu::count(weft_emu::Work::kernel)) return;
  weft_emu::enqueue(ctx.compute_stream(), [=] { run_backward(k, dout, qkv, o, lse, dqkv); });
}

size_t graphs(Context& ctx) {
  Seen& s = seen(ctx);
  std::lock_guard lock(s.mu);
  return s.keys.size();
}

}  // namespace weft::cuda::sdpa
