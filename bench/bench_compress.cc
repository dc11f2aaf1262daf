// bench_compress — data-parallel gradient compression, measured: the same GPT
// trained from the same start on the same batches with the fp32 all-reduce,
// the bf16 one and PowerSGD, one after the other in one MPI job.
//
//   mpiexec -n 2 bench_compress --data-path data/fortunes.txt --csv losses.csv
//   bench/compress.sh build     # the table in docs/performance.md
//
// Prints a markdown table (bytes this rank sends per step, as GradSync counts
// a ring reduction's share: the mean over the run and the last step's, which
// is compressed once PowerSGD has started; losses; speed; time finish()
// waited) and writes every step's loss per configuration as CSV:
// step,<config>,<config>,... PowerSGD starts after the LR warmup unless
// --powersgd-start-iter says otherwise.
#include <weft/grad_sync.h>
#include <weft/layout.h>
#include <weft/mpi_communicator.h>
#include <weft/threads.h>

#include "models/gpt.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

namespace {

using namespace weft;

struct Config {
  std::string name;
  GradSyncOptions sync;
};

struct Result {
  std::vector<double> losses;
  double bytes = 0;       // mean per step, this rank
  double last_bytes = 0;  // the last step's (compressed, once compression has started)
  int collectives = 0;
  double tokens_per_s = 0;
  double wait_ms = 0;  // mean per step
};

double mean(const std::vector<double>& v, size_t from, size_t to) {
  return std::accumulate(v.begin() + static_cast<long>(from), v.begin() + static_cast<long>(to),
                         0.0) /
         static_cast<double>(to - from);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Args {
  std::string model = "mini", data_path = "data/fortunes.txt", csv;
  int64_t seq_length = 64, micro_batch = 8, global_batch = 16, steps = 150;
  float lr = 2e-3f;
  int powersgd_rank = 8;
  int64_t powersgd_start_iter = -1;  // -1: the LR warmup, steps / 10
};

Result train(Communicator& world, const Args& a, const GptConfig& cfg, const BatchSource& data,
             const GradSyncOptions& sync) {
  GptModel model = build_gpt(cfg, a.micro_batch);
  TrainOptions opt;
  opt.micro_batch = a.micro_batch;
  opt.global_batch = a.global_batch;
  opt.lr.lr = a.lr;
  opt.lr.min_lr = a.lr / 10;
  opt.lr.decay = LrDecay::Cosine;
  opt.lr.warmup_iters = a.steps / 10;
  opt.lr.decay_iters = a.steps;
  opt.adam.weight_decay = 0.1f;
  LayoutOptions lo;
  lo.sync = sync;
  RankLayout layout(&world, model.graph, model.io, data, opt, lo, /*seed=*/1234);
  Result r;
  std::vector<double> ms;
  double wait = 0;
  for (int64_t s = 0; s < a.steps; ++s) {
    const StepRecord rec = layout.trainer().train_step();
    r.losses.push_back(rec.loss);
    if (s >= 2) ms.push_back(rec.step_ms);  // the first steps allocate and warm caches
    const GradSync::Stats& st = layout.trainer().grad_sync().stats();
    r.bytes += st.bytes_sent / static_cast<double>(a.steps);
    r.last_bytes = st.bytes_sent;
    r.collectives = st.collectives;
    wait += st.wait_ms;
  }
  r.tokens_per_s = static_cast<double>(a.global_batch * cfg.seq_length) / (median(ms) / 1e3);
  r.wait_ms = wait / static_cast<double>(a.steps);
  return r;
}

std::string bytes_str(double b) {
  if (b >= 1 << 20) return fmt::format("{:.2f} MiB", b / (1 << 20));
  return fmt::format("{:.1f} KiB", b / (1 << 10));
}

int run(Communicator& world, const Args& a) {
  set_threads(1);
  GptConfig cfg = gpt_preset(a.model);
  cfg.seq_length = a.seq_length;
  const TokenData tokens = TokenData::load(a.data_path);
  const TokenBatches batches(tokens, a.global_batch, cfg.seq_length);

  std::vector<Config> configs(3);
  configs[0].name = "fp32";
  configs[1].name = "bf16";
  configs[1].sync.reduce_dtype = DType::BF16;
  configs[2].name = fmt::format("powersgd-r{}", a.powersgd_rank);
  configs[2].sync.compression = GradCompression::PowerSgd;
  configs[2].sync.powersgd_rank = a.powersgd_rank;
  configs[2].sync.powersgd_start_iter =
      a.powersgd_start_iter >= 0 ? a.powersgd_start_iter : a.steps / 10;
  if (configs[2].sync.powersgd_start_iter > 0)
    configs[2].name += fmt::format("-from-{}", configs[2].sync.powersgd_start_iter);

  const bool rank0 = world.rank() == 0;
  if (rank0)
    fmt::print("bench_compress | {} ({} x {}, T {}, {:.2f}M params) | dp {} | micro-batch {} | "
               "global {} | {} steps | lr {} cosine | data {}\n\n",
               a.model, cfg.num_layers, cfg.hidden_size, cfg.seq_length,
               static_cast<double>(cfg.param_count()) / 1e6, world.size(), a.micro_batch,
               a.global_batch, a.steps, a.lr, a.data_path);
  std::vector<Result> results;
  for (const Config& c : configs) {
    results.push_back(train(world, a, cfg, batches, c.sync));
    if (rank0) std::fprintf(stderr, "%s done\n", c.name.c_str());
  }
  if (!rank0) return 0;

  const size_t n = results[0].losses.size(), tail = std::min<size_t>(20, n);
  fmt::print("| reduction | sent / step / rank, mean | last step | vs fp32 | collectives / step "
             "| loss, first 10 | loss, last {} | loss, mean | tokens/s | dp wait ms / step |\n"
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
             tail);
  for (size_t k = 0; k < configs.size(); ++k) {
    const Result& r = results[k];
    fmt::print("| {} | {} | {} | {:.3f} | {} | {:.4f} | {:.4f} | {:.4f} | {:.0f} | {:.1f} |\n",
               configs[k].name, bytes_str(r.bytes), bytes_str(r.last_bytes),
               r.last_bytes / results[0].last_bytes, r.collectives,
               mean(r.losses, 0, std::min<size_t>(10, n)), mean(r.losses, n - tail, n),
               mean(r.losses, 0, n), r.tokens_per_s, r.wait_ms);
  }
  if (!a.csv.empty()) {
    std::ofstream f(a.csv, std::ios::trunc);
    f << "step";
    for (const Config& c : configs) f << ',' << c.name;
    f << '\n';
    for (size_t s = 0; s < n; ++s) {
      f << s;
      for (const Result& r : results) f << ',' << fmt::format("{:.6f}", r.losses[s]);
      f << '\n';
    }
    check(f.good(), "--csv {}: cannot write", a.csv);
    fmt::print("\nloss curves: {}\n", a.csv);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_compress: %s needs a value\n", flag.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (flag == "--model") a.model = next();
    else if (flag == "--data-path") a.data_path = next();
    else if (flag == "--csv") a.csv = next();
    else if (flag == "--seq-length") a.seq_length = std::stoll(next());
    else if (flag == "--micro-batch-size") a.micro_batch = std::stoll(next());
    else if (flag == "--global-batch-size") a.global_batch = std::stoll(next());
    else if (flag == "--steps") a.steps = std::stoll(next());
    else if (flag == "--lr") a.lr = std::stof(next());
    else if (flag == "--powersgd-rank") a.powersgd_rank = std::stoi(next());
    else if (flag == "--powersgd-start-iter") a.powersgd_start_iter = std::stoll(next());
    else {
      std::fprintf(stderr,
                   "usage: mpiexec -n DP bench_compress [--model toy|mini|small] [--data-path F] "
                   "[--csv F] [--seq-length T] [--micro-batch-size B] [--global-batch-size G] "
                   "[--steps N] [--lr LR] [--powersgd-rank R] [--powersgd-start-iter S]\n");
      return 2;
    }
  }
  return mpi_main(argc, argv, [&](Communicator& world) { return run(world, a); });
}
