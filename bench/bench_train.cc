// bench_train — training throughput of GPT presets on one process, and GEMM
// speed against this machine's FMA peak, as a table (or JSON lines).
//
//   bench_train                          # the default table
//   bench_train --model small --steps 5 --json
//
// FLOPs per step = 6 x (parameters without wpe) x tokens + 12 x L x T x C x
// tokens, the same formula bench/pytorch_gpt.py uses, so GFLOP/s compare.
#include <weft/cpu_kernels.h>
#include <weft/threads.h>
#include <weft/trainer.h>

#include "models/gpt.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Peak fp32 FMA throughput: independent FMA chains in registers, every thread,
// in the widest vectors the host runs (AVX-512 where it has them, asked at run
// time: a build for AVX2 on an AVX-512 host would otherwise read half its
// peak, and a GEMM "over 100%" of it). 12 chains hide the FMA latency (4
// cycles) on two FMA ports.
struct FmaProbe {
  double gflops = 0;
  const char* vectors = "none";
};

template <typename V, int Lanes, V (*Set1)(float), V (*Fma)(V, V, V), V (*Add)(V, V),
          void (*Store)(float*, V)>
[[gnu::always_inline]] inline double fma_seconds(long iters, float& sink) {
  auto t0 = Clock::now();
  float total = 0;
#pragma omp parallel reduction(+ : total)
  {
    V a[12];
    for (int i = 0; i < 12; ++i) a[i] = Set1(1.0f + 1e-7f * static_cast<float>(i));
    const V m = Set1(0.9999999f), c = Set1(1e-7f);
    for (long it = 0; it < iters; ++it)
      for (int i = 0; i < 12; ++i) a[i] = Fma(a[i], m, c);
    V s = a[0];
    for (int i = 1; i < 12; ++i) s = Add(s, a[i]);
    float out[Lanes];
    Store(out, s);
    total += out[0];
  }
  sink += total;
  return seconds_since(t0);
}

[[gnu::target("avx512f")]] __m512 set1_512(float x) { return _mm512_set1_ps(x); }
[[gnu::target("avx512f")]] __m512 fma_512(__m512 a, __m512 b, __m512 c) {
  return _mm512_fmadd_ps(a, b, c);
}
[[gnu::target("avx512f")]] __m512 add_512(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
[[gnu::target("avx512f")]] void store_512(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
[[gnu::target("avx2,fma")]] __m256 set1_256(float x) { return _mm256_set1_ps(x); }
[[gnu::target("avx2,fma")]] __m256 fma_256(__m256 a, __m256 b, __m256 c) {
  return _mm256_fmadd_ps(a, b, c);
}
[[gnu::target("avx2,fma")]] __m256 add_256(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
[[gnu::target("avx2,fma")]] void store_256(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

[[gnu::target("avx512f")]] double fma_seconds_512(long iters, float& sink) {
  return fma_seconds<__m512, 16, set1_512, fma_512, add_512, store_512>(iters, sink);
}
[[gnu::target("avx2,fma")]] double fma_seconds_256(long iters, float& sink) {
  return fma_seconds<__m256, 8, set1_256, fma_256, add_256, store_256>(iters, sink);
}

FmaProbe fma_peak() {
  FmaProbe probe;
  int lanes = 0;
  if (__builtin_cpu_supports("avx512f")) {
    lanes = 16;
    probe.vectors = "AVX-512";
  } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    lanes = 8;
    probe.vectors = "AVX2";
  } else {
    return probe;
  }
  const long iters = 20'000'000;
  float sink = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const double s = lanes == 16 ? fma_seconds_512(iters, sink) : fma_seconds_256(iters, sink);
    const double flops = 2.0 * lanes * 12 * static_cast<double>(iters) * omp_get_max_threads();
    probe.gflops = std::max(probe.gflops, flops / s / 1e9 + 0.0f * sink);
  }
  return probe;
}

double gemm_gflops(int64_t n) {
  std::vector<float> a(static_cast<size_t>(n * n), 0.5f), b(a), c(a);
  weft::cpu::gemm(false, false, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
  std::vector<double> t;
  const int reps = n <= 512 ? 20 : 4;
  for (int r = 0; r < reps; ++r) {
    auto t0 = Clock::now();
    weft::cpu::gemm(false, false, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
    t.push_back(seconds_since(t0));
  }
  return 2.0 * static_cast<double>(n * n * n) / median(t) / 1e9;
}

struct TrainResult {
  std::string model;
  weft::GptConfig cfg;
  int64_t batch = 0;
  double step_ms = 0, tokens_per_s = 0, gflops = 0;
  double first_loss = 0;  // the first step's, before any update
};

// bf16: train_gpt --bf16's recipe on the CPU (GEMM inputs rounded to bf16,
// activations stored in bf16; fp32 weights, gradients and AdamW).
TrainResult train_throughput(const std::string& preset, int64_t batch, int steps, int warmup,
                             bool bf16) {
  using namespace weft;
  TrainResult r;
  r.model = preset;
  r.cfg = gpt_preset(preset);
  r.batch = batch;
  std::mt19937 rng(1);
  std::vector<int32_t> tokens(static_cast<size_t>(batch * (r.cfg.seq_length + 1) * (steps + warmup)));
  for (auto& t : tokens) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(r.cfg.vocab_size));
  TokenData data = TokenData::from_tokens(tokens, static_cast<int32_t>(r.cfg.vocab_size));
  GptModel m = build_gpt(r.cfg, batch);
  init_gpt(m, 1);
  ops::set_matmul_precision(Device::cpu(),
                            bf16 ? ops::MatmulPrecision::Bf16 : ops::MatmulPrecision::Fp32);
  if (bf16) m.graph.set_activation_dtype(DType::BF16);
  TokenBatches batches(data, batch, r.cfg.seq_length);
  TrainOptions opt;
  opt.micro_batch = opt.global_batch = batch;
  opt.adam.weight_decay = 0.1f;
  Trainer trainer(m.io, batches, opt);
  std::vector<double> ms;
  for (int s = 0; s < warmup + steps; ++s) {
    StepRecord rec = trainer.train_step();
    if (s == 0) r.first_loss = rec.loss;
    if (s >= warmup) ms.push_back(rec.step_ms);
  }
  r.step_ms = median(ms);
  const double tokens_per_step = static_cast<double>(batch * r.cfg.seq_length);
  r.tokens_per_s = tokens_per_step / (r.step_ms / 1e3);
  r.gflops = r.cfg.train_flops_per_token() * r.tokens_per_s / 1e9;
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> models;
  int64_t batch = 0;
  int steps = 5, warmup = 2, threads = weft::default_threads();
  bool json = false, skip_gemm = false, bf16 = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        fmt::print(stderr, "bench_train: {} needs a value\n", a);
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--model") models.push_back(next());
    else if (a == "--micro-batch-size") batch = std::stoll(next());
    else if (a == "--steps") steps = std::stoi(next());
    else if (a == "--warmup") warmup = std::stoi(next());
    else if (a == "--threads") threads = std::stoi(next());
    else if (a == "--json") json = true;
    else if (a == "--no-gemm") skip_gemm = true;
    else if (a == "--bf16") bf16 = true;
    else {
      fmt::print(stderr,
                 "usage: bench_train [--model toy|mini|small|gpt2]... [--micro-batch-size B] "
                 "[--steps N] [--warmup N] [--threads N] [--bf16] [--json] [--no-gemm]\n");
      return 2;
    }
  }
  if (models.empty()) models = {"toy", "mini", "small"};
  weft::set_threads(threads);

  try {
    double peak = 0;
    if (!skip_gemm) {
      const FmaProbe probe = fma_peak();
      peak = probe.gflops;
      const std::string library = weft::cpu::describe_gemm_library(weft::cpu::gemm_library());
      if (json) {
        fmt::print(
            "{{\"kind\": \"fma_peak\", \"threads\": {}, \"vectors\": \"{}\", \"gflops\": "
            "{:.1f}, \"gemm_library\": \"{}\"}}\n",
            threads, probe.vectors, peak, library);
      } else {
        fmt::print("threads {}: FMA peak {:.0f} GFLOP/s ({} FMAs); GEMM {}\n\n", threads, peak,
                   probe.vectors, library);
        fmt::print("| sgemm n | GFLOP/s | of FMA peak |\n|---:|---:|---:|\n");
      }
      for (int64_t n : {256, 512, 1024, 2048}) {
        const double g = gemm_gflops(n);
        if (json)
          fmt::print("{{\"kind\": \"gemm\", \"n\": {}, \"gflops\": {:.1f}}}\n", n, g);
        else
          fmt::print("| {} | {:.0f} | {:.0f}% |\n", n, g, 100 * g / peak);
      }
      if (!json) fmt::print("\n");
    }
    if (!json)
      fmt::print("| model | layers x width | T | B | params | step ms | tokens/s | GFLOP/s |\n"
                 "|---|---|---:|---:|---:|---:|---:|---:|\n");
    for (const auto& name : models) {
      const int64_t b = batch > 0 ? batch : (name == "gpt2" ? 1 : 8);
      TrainResult r = train_throughput(name, b, steps, warmup, bf16);
      if (json) {
        fmt::print("{{\"kind\": \"train\", \"framework\": \"weft\", \"model\": \"{}\", \"num_layers\": {}, "
                   "\"hidden_size\": {}, \"seq_length\": {}, \"micro_batch_size\": {}, "
                   "\"params\": {}, \"threads\": {}, \"precision\": \"{}\", \"gemm_library\": "
                   "\"{}\", \"first_loss\": {:.6f}, \"step_ms\": {:.1f}, \"tokens_per_s\": "
                   "{:.1f}, \"gflops\": {:.2f}}}\n",
                   r.model, r.cfg.num_layers, r.cfg.hidden_size, r.cfg.seq_length, r.batch,
                   r.cfg.param_count(), threads, bf16 ? "bf16" : "fp32",
                   weft::cpu::describe_gemm_library(weft::cpu::gemm_library()), r.first_loss,
                   r.step_ms, r.tokens_per_s, r.gflops);
      } else {
        fmt::print("| {} | {} x {} | {} | {} | {:.1f}M | {:.0f} | {:.0f} | {:.1f} |\n", r.model,
                   r.cfg.num_layers, r.cfg.hidden_size, r.cfg.seq_length, r.batch,
                   static_cast<double>(r.cfg.param_count()) / 1e6, r.step_ms, r.tokens_per_s,
                   r.gflops);
      }
      std::fflush(stdout);
    }
  } catch (const weft::Error& e) {
    fmt::print(stderr, "bench_train: error: {}\n", e.what());
    return 1;
  }
  return 0;
}
