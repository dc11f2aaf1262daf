// Gradient compression for the data-parallel reduction: bf16 rounding and
// reductions (LocalCommunicator), bf16 gradient buckets, PowerSGD's math and
// error feedback, compressed training at dp 2, and the flags' errors.
#include <weft/bf16.h>
#include <weft/compress.h>
#include <weft/grad_sync.h>
#include <weft/layout.h>
#include <weft/local_communicator.h>

#include <gtest/gtest.h>

#include "models/gpt.h"
#include "test_util.h"

#include <sys/wait.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>

namespace weft {
namespace {

using testing::contains;
using testing::error_message;
using testing::rel_error;

size_t z(int64_t i) { return static_cast<size_t>(i); }

CommOptions quick() {
  CommOptions o;
  o.timeout = std::chrono::seconds(60);
  return o;
}

// ---------------------------------------------------------------- bf16

TEST(Bf16, RoundsToNearestEven) {
  EXPECT_EQ(to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(to_bf16(-2.0f), 0xc000);
  auto from_bits = [](uint32_t u) { return std::bit_cast<float>(u); };
  EXPECT_EQ(to_bf16(from_bits(0x3f807fffu)), 0x3f80);  // below half: down
  EXPECT_EQ(to_bf16(from_bits(0x3f808001u)), 0x3f81);  // above half: up
  EXPECT_EQ(to_bf16(from_bits(0x3f808000u)), 0x3f80);  // a tie, kept part even: down
  EXPECT_EQ(to_bf16(from_bits(0x3f818000u)), 0x3f82);  // a tie, kept part odd: up
  EXPECT_EQ(to_bf16(from_bits(0x7f7fffffu)), 0x7f80);  // the largest float rounds to inf
  EXPECT_EQ(to_bf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(to_bf16(std::nanf("")), 0x7fff);
  EXPECT_EQ(bf16_to_float(0x3eab), 0.333984375f);
  EXPECT_EQ(round_to_bf16(1.0f / 3.0f), 0.333984375f);
  // The sum of two bf16 values is rounded once: 1 + 2^-8 is a tie, to even.
  EXPECT_EQ(bf16_add(to_bf16(1.0f), to_bf16(0.00390625f)), 0x3f80);
  EXPECT_EQ(bf16_add(to_bf16(1.0078125f), to_bf16(0.00390625f)), 0x3f82);
}

// Inputs that need rounding: member r's element i, already a bf16 value.
uint16_t bf16_input(int r, int64_t i) {
  const float x = 1.0f + static_cast<float>((i * 37 + r * 11) % 97) / 97.0f;
  return to_bf16((i + r) % 3 == 0 ? -x : x);
}

// The documented bf16 sum of LocalCommunicator: members folded in rank
// order, ((x0 + x1) + x2) + ..., each addition in fp32 and rounded once.
uint16_t expected_fold(int n, int64_t i) {
  uint16_t acc = bf16_input(0, i);
  for (int r = 1; r < n; ++r) acc = bf16_add(acc, bf16_input(r, i));
  return acc;
}

class LocalBf16 : public ::testing::TestWithParam<int> {};

TEST_P(LocalBf16, AllReduceRoundsEachAdditionInRankOrder) {
  const int n = GetParam();
  constexpr int64_t kN = 1000;
  std::vector<std::vector<uint16_t>> got(z(n));
  run_local(
      n,
      [&](Communicator& comm) {
        Tensor t = Tensor::empty({kN}, DType::BF16);
        for (int64_t i = 0; i < kN; ++i) t.data<uint16_t>()[i] = bf16_input(comm.rank(), i);
        comm.all_reduce(t, ReduceOp::Sum);
        got[z(comm.rank())].assign(t.data<uint16_t>(), t.data<uint16_t>() + kN);
      },
      quick());
  int64_t bad = 0, once_differs = 0;
  for (int64_t i = 0; i < kN; ++i) {
    bad += got[0][z(i)] != expected_fold(n, i);
    float exact = 0;  // fp32 holds these sums of a few bf16 values exactly
    for (int r = 0; r < n; ++r) exact += bf16_to_float(bf16_input(r, i));
    once_differs += got[0][z(i)] != to_bf16(exact);
  }
  EXPECT_EQ(bad, 0);
  for (int r = 1; r < n; ++r) EXPECT_EQ(got[z(r)], got[0]) << "rank " << r << " got other bits";
  // With 3 or more members, rounding per addition is not rounding the exact
  // sum once: these inputs tell the two apart.
  if (n >= 3) {
    EXPECT_GT(once_differs, 0);
  }
}

TEST_P(LocalBf16, ReduceScatterGivesEachMemberItsSliceOfTheSum) {
  const int n = GetParam();
  constexpr int64_t kSlice = 100;
  std::vector<std::vector<uint16_t>> got(z(n));
  run_local(
      n,
      [&](Communicator& comm) {
        Tensor in = Tensor::empty({n * kSlice}, DType::BF16);
        Tensor out = Tensor::empty({kSlice}, DType::BF16);
        for (int64_t i = 0; i < in.numel(); ++i) in.data<uint16_t>()[i] = bf16_input(comm.rank(), i);
        comm.reduce_scatter(in, out, ReduceOp::Sum);
        got[z(comm.rank())].assign(out.data<uint16_t>(), out.data<uint16_t>() + kSlice);
      },
      quick());
  for (int r = 0; r < n; ++r) {
    int64_t bad = 0;
    for (int64_t i = 0; i < kSlice; ++i) bad += got[z(r)][z(i)] != expected_fold(n, r * kSlice + i);
    EXPECT_EQ(bad, 0) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, LocalBf16, ::testing::Values(2, 3, 4));

TEST(LocalBf16Errors, MaxIsNotABf16Reduction) {
  std::string msg;
  run_local(2, [&](Communicator& comm) {
    Tensor t = Tensor::zeros({2}, DType::BF16);
    const std::string m = error_message([&] { comm.all_reduce(t, ReduceOp::Max); });
    if (comm.rank() == 0) msg = m;
  });
  EXPECT_TRUE(contains(msg, "all_reduce (max)") && contains(msg, "BF16")) << msg;
}

// ---------------------------------------------------------------- PowerSGD math

Tensor random_matrix(int64_t rows, int64_t cols, uint64_t seed) {
  return testing::uniform_tensor({rows, cols}, seed);
}

// a (n, k) b^T (k, m): a matrix of rank k.
Tensor low_rank(int64_t n, int64_t m, int64_t k, uint64_t seed) {
  Tensor a = random_matrix(n, k, seed), b = random_matrix(m, k, seed + 1);
  Tensor out = Tensor::zeros({n, m});
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < m; ++j)
      for (int64_t t = 0; t < k; ++t)
        out.data<float>()[i * m + j] += a.data<float>()[i * k + t] * b.data<float>()[j * k + t];
  return out;
}

TEST(PowerSgdMath, OrthonormalizesColumnsAndZeroesDependentOnes) {
  constexpr int64_t n = 50, r = 4;
  Tensor p = random_matrix(n, r, 3);
  // Column 2 = column 0 + column 1: dependent.
  for (int64_t i = 0; i < n; ++i)
    p.data<float>()[i * r + 2] = p.data<float>()[i * r] + p.data<float>()[i * r + 1];
  const Tensor before = p.clone();
  orthonormalize_columns(p.data<float>(), n, r);
  const float* q = p.data<float>();
  for (int64_t a = 0; a < r; ++a)
    for (int64_t b = 0; b < r; ++b) {
      double dot = 0;
      for (int64_t i = 0; i < n; ++i) dot += static_cast<double>(q[i * r + a]) * q[i * r + b];
      const double want = (a == b && a != 2) ? 1.0 : 0.0;
      EXPECT_NEAR(dot, want, 1e-5) << "columns " << a << ", " << b;
    }
  // Gram-Schmidt keeps the first column's direction.
  double cos = 0, len = 0;
  for (int64_t i = 0; i < n; ++i) {
    cos += static_cast<double>(q[i * r]) * before.data<float>()[i * r];
    len += static_cast<double>(before.data<float>()[i * r]) * before.data<float>()[i * r];
  }
  EXPECT_NEAR(cos / std::sqrt(len), 1.0, 1e-5);
}

TEST(PowerSgdMath, CompressesOnlyMatricesWhereTheFactorsAreSmall) {
  EXPECT_FALSE(PowerSgd::compressible({1000}, 1));         // a vector
  EXPECT_TRUE(PowerSgd::compressible({64, 64}, 4));        // 2 (128) 4 < 4096
  EXPECT_FALSE(PowerSgd::compressible({8, 8}, 4));         // 2 (16) 4 = 128 >= 64
  EXPECT_TRUE(PowerSgd::compressible({2, 16, 64}, 4));     // seen as (32, 64)
  EXPECT_FALSE(PowerSgd::compressible({64, 64}, 16));      // 2 (128) 16 = 4096: no saving
}

// One replica, an exactly rank-r matrix: one power step finds its column
// space, so the update is the matrix and nothing is left over.
TEST(PowerSgdMath, RecoversAnExactlyRankRMatrix) {
  constexpr int64_t n = 40, m = 30, r = 3;
  const Tensor g = low_rank(n, m, r, 11);
  Tensor grad = g.clone();
  PowerSgd c({{"w", 0, {n, m}}}, r);
  ASSERT_EQ(c.matrices(), 1);
  EXPECT_EQ(c.sent_elements(), (n + m) * r);
  c.compress(grad.data<float>());
  c.project(grad.data<float>());
  c.decompress(grad.data<float>(), 1);
  EXPECT_LT(rel_error(grad, g), 1e-5);
  double res = 0;
  for (int64_t i = 0; i < n * m; ++i)
    res = std::max(res, std::abs(double{c.residual(0).data<float>()[i]}));
  EXPECT_LT(res, 1e-5) << "an exact approximation leaves no residual";
}

// Two replicas with the all-reduces done by hand: buffers summed elementwise.
struct TwoReplicas {
  std::vector<PowerSgd::Piece> pieces;
  PowerSgd a, b;
  TwoReplicas(std::vector<PowerSgd::Piece> p, int rank)
      : pieces(p), a(pieces, rank), b(pieces, rank) {}

  static void sum_into_both(const Tensor& x, const Tensor& y) {
    for (int64_t i = 0; i < x.numel(); ++i)
      x.data<float>()[i] = y.data<float>()[i] = x.data<float>()[i] + y.data<float>()[i];
  }
  // One step: ga and gb become the update both replicas apply.
  void step(Tensor& ga, Tensor& gb) {
    sum_into_both(a.compress(ga.data<float>()), b.compress(gb.data<float>()));
    sum_into_both(a.project(ga.data<float>()), b.project(gb.data<float>()));
    a.decompress(ga.data<float>(), 2);
    b.decompress(gb.data<float>(), 2);
  }
};

// The replicas' matrices are full rank but their sum has rank r: the update
// is the sum, on both replicas; vectors and small matrices are summed exactly.
TEST(PowerSgdMath, TwoReplicasRecoverARankRSumAndSumTheRestExactly) {
  constexpr int64_t n = 40, m = 30, r = 2;
  // Flat buffer: a vector (5), the matrix (n, m), a 3x3 matrix sent whole.
  const int64_t vec_at = 0, mat_at = 5, small_at = 5 + n * m, total = small_at + 9;
  TwoReplicas rep({{"v", vec_at, {5}}, {"w", mat_at, {n, m}}, {"s", small_at, {3, 3}}}, r);
  EXPECT_EQ(rep.a.matrices(), 1);
  EXPECT_EQ(rep.a.sent_elements(), (n + m) * r + 5 + 9);

  const Tensor sum = low_rank(n, m, r, 5), noise = random_matrix(n, m, 9);
  Tensor ga = testing::uniform_tensor({total}, 21), gb = testing::uniform_tensor({total}, 22);
  Tensor want = Tensor::zeros({total});
  for (int64_t i = 0; i < total; ++i)
    want.data<float>()[i] = ga.data<float>()[i] + gb.data<float>()[i];
  for (int64_t i = 0; i < n * m; ++i) {
    ga.data<float>()[mat_at + i] = sum.data<float>()[i] + noise.data<float>()[i];
    gb.data<float>()[mat_at + i] = -noise.data<float>()[i];
    want.data<float>()[mat_at + i] = sum.data<float>()[i];
  }
  rep.step(ga, gb);
  EXPECT_EQ(std::memcmp(ga.raw(), gb.raw(), ga.nbytes()), 0) << "the replicas' updates differ";
  EXPECT_LT(rel_error(ga.data<float>() + mat_at, want.data<float>() + mat_at, n * m), 1e-5);
  for (int64_t i : {0, 1, 2, 3, 4})
    EXPECT_EQ(ga.data<float>()[vec_at + i], want.data<float>()[vec_at + i]);
  for (int64_t i = 0; i < 9; ++i)
    EXPECT_EQ(ga.data<float>()[small_at + i], want.data<float>()[small_at + i]);
}

// Error feedback: what each step drops is carried, so the updates applied so
// far plus the replicas' residuals are the true gradients summed. With a
// constant gradient the residual stops growing (here at ~11 gradients) and
// the applied sum closes in on the true one like 1/steps; without the
// feedback its relative error would stay at the rank-1 approximation's (0.95).
TEST(PowerSgdMath, ErrorFeedbackCarriesWhatCompressionDrops) {
  constexpr int64_t n = 24, m = 20, r = 1, kSteps = 200;
  TwoReplicas rep({{"w", 0, {n, m}}}, r);
  const Tensor g0 = random_matrix(n, m, 31), g1 = random_matrix(n, m, 32);
  std::vector<double> applied(z(n * m), 0), truth(z(n * m), 0);
  std::vector<double> rel;
  for (int64_t t = 0; t < kSteps; ++t) {
    Tensor ga = g0.clone(), gb = g1.clone();
    rep.step(ga, gb);
    double num = 0, den = 0, inv = 0, inv_den = 0;
    for (int64_t i = 0; i < n * m; ++i) {
      applied[z(i)] += ga.data<float>()[i];
      truth[z(i)] += double{g0.data<float>()[i]} + g1.data<float>()[i];
      const double carried = applied[z(i)] + rep.a.residual(0).data<float>()[i] +
                             rep.b.residual(0).data<float>()[i];
      inv += (carried - truth[z(i)]) * (carried - truth[z(i)]);
      inv_den += truth[z(i)] * truth[z(i)];
      num += (applied[z(i)] - truth[z(i)]) * (applied[z(i)] - truth[z(i)]);
      den += truth[z(i)] * truth[z(i)];
    }
    EXPECT_LT(std::sqrt(inv / inv_den), 1e-5) << "step " << t << ": updates + residuals != gradients";
    rel.push_back(std::sqrt(num / den));
  }
  EXPECT_GT(rel.front(), 0.5) << "a rank-1 approximation of a random matrix should drop much";
  EXPECT_LT(rel.back(), 0.1) << "the applied sum does not approach the true sum";
  // The residual (rel x steps gradients) is bounded: no larger at the end than at step 50.
  EXPECT_LT(rel.back() * kSteps, 1.5 * rel[49] * 50);
}

// ---------------------------------------------------------------- training at dp 2

constexpr uint64_t kSeed = 7;
constexpr int64_t kMicro = 2, kGlobal = 8;

GptConfig tiny_gpt() {
  GptConfig c;
  c.vocab_size = 256, c.num_layers = 2, c.hidden_size = 32, c.num_heads = 4, c.seq_length = 16;
  return c;
}

TokenData text() {
  const std::string s = testing::read_file(testing::source_path("docs/design.md"));
  std::vector<int32_t> tokens;
  for (unsigned char ch : s) tokens.push_back(ch);
  return TokenData::from_tokens(std::move(tokens), 256);
}

TrainOptions train_options(int64_t global = kGlobal) {
  TrainOptions o;
  o.micro_batch = kMicro;
  o.global_batch = global;
  o.lr.lr = 1e-2f;
  o.clip_grad = 1.0;
  return o;
}

struct DpRun {
  std::vector<double> losses;
  std::vector<GradSync::Stats> stats;  // rank 0's, per step
  bool replicas_agree = true;          // every parameter, bit for bit, at the end
};

DpRun train_dp(const GradSyncOptions& sync, int64_t steps, int dp = 2) {
  const TokenData data = text();
  const TokenBatches batches(data, kGlobal, tiny_gpt().seq_length);
  DpRun run;
  std::vector<std::vector<float>> values(z(dp));
  run_local(
      dp,
      [&](Communicator& world) {
        GptModel m = build_gpt(tiny_gpt(), kMicro);
        LayoutOptions lo;
        lo.sync = sync;
        RankLayout layout(&world, m.graph, m.io, batches, train_options(), lo, kSeed);
        for (int64_t s = 0; s < steps; ++s) {
          const StepRecord r = layout.trainer().train_step();
          if (world.rank() != 0) continue;
          run.losses.push_back(r.loss);
          run.stats.push_back(layout.trainer().grad_sync().stats());
        }
        for (Param* p : layout.trainer().params())
          values[z(world.rank())].insert(values[z(world.rank())].end(), p->value.data<float>(),
                                         p->value.data<float>() + p->value.numel());
      },
      quick());
  for (int r = 1; r < dp; ++r) run.replicas_agree = run.replicas_agree && values[z(r)] == values[0];
  return run;
}

GradSyncOptions bf16_sync(bool distributed, bool shard_grads = false) {
  GradSyncOptions o;
  o.reduce_dtype = DType::BF16;
  o.distributed_optimizer = distributed;
  o.shard_grads = shard_grads;
  return o;
}

// The reduced gradient is, element for element, the bf16 sum of the two
// replicas' gradients rounded to bf16: bf16(bf16(g0) + bf16(g1)), widened to
// fp32. Each replica's own gradient is found on one process: the gradient of
// its half of the batch alone is exactly twice its share (the loss seed
// doubles, and scaling by 2 commutes with rounding).
TEST(Bf16Reduction, GradientsAreTheBf16SumOfTheReplicasRoundedGradients) {
  const TokenData data = text();
  const TokenBatches batches(data, kGlobal, tiny_gpt().seq_length);
  std::map<std::string, std::vector<float>> local[2];
  for (int r = 0; r < 2; ++r) {
    GptModel m = build_gpt(tiny_gpt(), kMicro);
    init_gpt(m, kSeed);
    const ReplicaBatches half(batches, r * kGlobal / 2);
    Trainer t(m.io, half, train_options(kGlobal / 2));
    t.compute_gradients(0);
    for (Param* p : m.graph.params())
      for (int64_t i = 0; i < p->grad.numel(); ++i)
        local[r][p->name].push_back(0.5f * p->grad.data<float>()[i]);
  }
  std::vector<std::map<std::string, std::vector<float>>> reduced(2);
  run_local(
      2,
      [&](Communicator& world) {
        GptModel m = build_gpt(tiny_gpt(), kMicro);
        LayoutOptions lo;
        lo.sync = bf16_sync(false);
        RankLayout layout(&world, m.graph, m.io, batches, train_options(), lo, kSeed);
        layout.trainer().compute_gradients(0);
        for (Param* p : layout.trainer().params())
          reduced[z(world.rank())][p->name].assign(p->grad.data<float>(),
                                                   p->grad.data<float>() + p->grad.numel());
      },
      quick());
  int64_t bad = 0, checked = 0, rounded = 0;
  ASSERT_EQ(reduced[0].size(), local[0].size());
  for (const auto& [name, got] : reduced[0]) {
    const std::vector<float>&g0 = local[0].at(name), &g1 = local[1].at(name);
    ASSERT_EQ(got.size(), g0.size()) << name;
    for (size_t i = 0; i < got.size(); ++i, ++checked) {
      bad += got[i] != bf16_to_float(bf16_add(to_bf16(g0[i]), to_bf16(g1[i])));
      rounded += got[i] != g0[i] + g1[i];
    }
    EXPECT_EQ(reduced[1].at(name), got) << name << ": the replicas hold other gradients";
  }
  EXPECT_EQ(bad, 0) << "of " << checked;
  EXPECT_GT(rounded, checked / 2) << "most fp32 sums are not bf16 values";
}

// bf16 training follows fp32 to bf16's precision but is not the same run,
// sends half the bytes, and keeps the replicas identical.
TEST(Bf16Reduction, TrainsLikeFp32WithHalfTheBytes) {
  for (bool distributed : {false, true}) {
    GradSyncOptions fp32;
    fp32.distributed_optimizer = distributed;
    const DpRun a = train_dp(fp32, 5), b = train_dp(bf16_sync(distributed), 5);
    const std::string what = distributed ? "distributed optimizer" : "plain";
    bool identical = true;
    for (size_t s = 0; s < a.losses.size(); ++s) {
      EXPECT_NEAR(b.losses[s], a.losses[s], 1e-2 * a.losses[s]) << what << " step " << s;
      identical = identical && b.losses[s] == a.losses[s];
    }
    EXPECT_EQ(b.losses[0], a.losses[0]) << "the first loss comes before any update";
    EXPECT_FALSE(identical) << what << ": bf16 gave the fp32 losses bit for bit: not used?";
    EXPECT_GT(a.stats.back().bytes_sent, 0);
    EXPECT_EQ(b.stats.back().bytes_sent, a.stats.back().bytes_sent / 2) << what;
    EXPECT_EQ(b.stats.back().collectives, a.stats.back().collectives) << what;
    EXPECT_TRUE(a.replicas_agree && b.replicas_agree) << what;
  }
  // Sharded gradients (ZeRO-2) round and reduce each micro-batch's gradients
  // (2 per replica here) in bf16 and add the widened sums in fp32: half
  // their fp32 bytes, the same messages, within bf16's precision of the fp32
  // run, and not ZeRO-1's bf16 run (one rounding of the step's sum, not two).
  {
    GradSyncOptions fp32;
    fp32.distributed_optimizer = fp32.shard_grads = true;
    const DpRun a = train_dp(fp32, 5), b = train_dp(bf16_sync(true, true), 5);
    const DpRun zero1 = train_dp(bf16_sync(true), 5);
    bool identical = true, as_zero1 = true;
    for (size_t s = 0; s < a.losses.size(); ++s) {
      EXPECT_NEAR(b.losses[s], a.losses[s], 1e-2 * a.losses[s]) << "zero2 step " << s;
      identical = identical && b.losses[s] == a.losses[s];
      as_zero1 = as_zero1 && b.losses[s] == zero1.losses[s];
    }
    EXPECT_FALSE(identical) << "zero2: bf16 gave the fp32 losses bit for bit: not used?";
    EXPECT_FALSE(as_zero1) << "zero2: each micro-batch was not rounded on its own";
    EXPECT_EQ(b.stats.back().bytes_sent, a.stats.back().bytes_sent / 2);
    EXPECT_EQ(b.stats.back().collectives, a.stats.back().collectives);
    EXPECT_EQ(b.stats.back().collectives, 2 * zero1.stats.back().collectives);
    EXPECT_TRUE(a.replicas_agree && b.replicas_agree);
  }
  // The distributed optimizer reduce-scatters the same bf16 sums that plain
  // data parallelism all-reduces (LocalCommunicator folds both in rank order).
  const DpRun plain = train_dp(bf16_sync(false), 3), sharded = train_dp(bf16_sync(true), 3);
  for (size_t s = 0; s < plain.losses.size(); ++s)
    EXPECT_NEAR(sharded.losses[s], plain.losses[s], 1e-6 * plain.losses[s]) << "step " << s;
}

GradSyncOptions powersgd(int rank) {
  GradSyncOptions o;
  o.compression = GradCompression::PowerSgd;
  o.powersgd_rank = rank;
  return o;
}

// PowerSGD at dp 2 still trains: the loss falls far below where it started
// and stays near the uncompressed run's, with a fraction of the bytes; both
// replicas apply the same update, so they stay identical.
TEST(PowerSgdTraining, ReducesTheLossWithAFractionOfTheBytes) {
  constexpr int64_t kSteps = 30;
  const DpRun plain = train_dp(GradSyncOptions{}, kSteps), c = train_dp(powersgd(4), kSteps);
  auto tail_mean = [](const std::vector<double>& l) {
    return std::accumulate(l.end() - 5, l.end(), 0.0) / 5;
  };
  const double first = c.losses.front(), end = tail_mean(c.losses), ref = tail_mean(plain.losses);
  EXPECT_EQ(c.losses.front(), plain.losses.front());
  EXPECT_LT(end, first - 1.0) << "PowerSGD training did not learn";
  EXPECT_LT(end, ref * 1.15) << "PowerSGD ends far above the uncompressed run (" << ref << ")";
  EXPECT_NE(end, ref);
  EXPECT_LT(c.stats.back().bytes_sent, 0.3 * plain.stats.back().bytes_sent);
  EXPECT_EQ(c.stats.back().collectives, 2 * plain.stats.back().collectives);
  EXPECT_TRUE(c.replicas_agree) << "the replicas' parameters drifted apart";
}

// Before --powersgd-start-iter the reduction is the uncompressed one: the
// same losses bit for bit, one collective per bucket; from it on, two.
TEST(PowerSgdTraining, StartsAtTheStartIteration) {
  GradSyncOptions late = powersgd(4);
  late.powersgd_start_iter = 3;
  const DpRun plain = train_dp(GradSyncOptions{}, 6), c = train_dp(late, 6);
  for (size_t s = 0; s <= 3; ++s) EXPECT_EQ(c.losses[s], plain.losses[s]) << "step " << s;
  EXPECT_NE(c.losses[4], plain.losses[4]);
  for (size_t s = 0; s < 6; ++s) {
    const int want = (s < 3 ? 1 : 2) * plain.stats[s].collectives;
    EXPECT_EQ(c.stats[s].collectives, want) << "step " << s;
  }
  EXPECT_TRUE(c.replicas_agree);
}

// ---------------------------------------------------------------- errors

TEST(CompressionOptions, ImpossibleCombinationsNameTheFlags) {
  EXPECT_EQ(parse_grad_reduce_dtype("bf16"), DType::BF16);
  EXPECT_EQ(parse_grad_reduce_dtype("fp32"), DType::F32);
  EXPECT_EQ(parse_grad_compression("powersgd"), GradCompression::PowerSgd);
  std::string msg = error_message([] { parse_grad_reduce_dtype("fp16"); });
  EXPECT_TRUE(contains(msg, "--grad-reduce-dtype 'fp16' must be fp32 or bf16")) << msg;
  msg = error_message([] { parse_grad_compression("topk"); });
  EXPECT_TRUE(contains(msg, "--grad-compression 'topk' must be none or powersgd")) << msg;
  msg = error_message([] { check_grad_sync_options(powersgd(0)); });
  EXPECT_TRUE(contains(msg, "--powersgd-rank (0) must be at least 1")) << msg;
  GradSyncOptions o = powersgd(2);
  o.powersgd_start_iter = -1;
  msg = error_message([&] { check_grad_sync_options(o); });
  EXPECT_TRUE(contains(msg, "--powersgd-start-iter (-1) must not be negative")) << msg;
  o = powersgd(2);
  o.distributed_optimizer = true;
  msg = error_message([&] { check_grad_sync_options(o); });
  EXPECT_TRUE(contains(msg, "--grad-compression powersgd") &&
              contains(msg, "--use-distributed-optimizer"))
      << msg;
  o = powersgd(2);
  o.reduce_dtype = DType::BF16;
  msg = error_message([&] { check_grad_sync_options(o); });
  EXPECT_TRUE(contains(msg, "--grad-reduce-dtype bf16")) << msg;
  o = GradSyncOptions{};
  o.reduce_dtype = DType::I32;
  msg = error_message([&] { check_grad_sync_options(o); });
  EXPECT_TRUE(contains(msg, "--grad-reduce-dtype I32")) << msg;
  // Sharded gradients: with the optimizer's state sharded, in fp32.
  o = GradSyncOptions{};
  o.shard_grads = true;
  msg = error_message([&] { check_grad_sync_options(o); });
  EXPECT_TRUE(contains(msg, "need the distributed optimizer")) << msg;
  o = GradSyncOptions{};
  o.distributed_optimizer = o.shard_params = true;
  msg = error_message([&] { check_grad_sync_options(o); });
  EXPECT_TRUE(contains(msg, "sharded parameters (optim_grads_params)")) << msg;
  msg = error_message([] { parse_sharding_strategy("zero3"); });
  EXPECT_TRUE(contains(msg,
                       "--data-parallel-sharding-strategy 'zero3' must be no_shard, optim, "
                       "optim_grads or optim_grads_params"))
      << msg;
  for (ShardingStrategy s : {ShardingStrategy::NoShard, ShardingStrategy::Optim,
                             ShardingStrategy::OptimGrads, ShardingStrategy::OptimGradsParams})
    EXPECT_EQ(parse_sharding_strategy(sharding_strategy_name(s)), s);
}

// train_gpt checks the flags before anything else, on one line.
TEST(CompressionOptions, TrainGptRejectsBadFlagsWithOneLine) {
  const char* exe = std::getenv("WEFT_TRAIN_GPT");
  ASSERT_NE(exe, nullptr) << "WEFT_TRAIN_GPT is set by meson test";
  const std::string dir = testing::temp_dir("compress_cli");
  testing::write_file(dir + "/text.txt", std::string(2000, 'a'));
  const std::pair<const char*, const char*> cases[] = {
      {"--grad-reduce-dtype fp16", "--grad-reduce-dtype 'fp16' must be fp32 or bf16"},
      {"--grad-compression topk", "--grad-compression 'topk' must be none or powersgd"},
      {"--grad-compression powersgd --powersgd-rank 0", "--powersgd-rank (0) must be at least 1"},
      {"--grad-compression powersgd --use-distributed-optimizer",
       "cannot be combined with --use-distributed-optimizer"},
      {"--data-parallel-sharding-strategy zero2",
       "--data-parallel-sharding-strategy 'zero2' must be no_shard, optim, optim_grads or "
       "optim_grads_params"},
      {"--use-distributed-optimizer --data-parallel-sharding-strategy no_shard",
       "--use-distributed-optimizer shards the optimizer state, and "
       "--data-parallel-sharding-strategy no_shard says not to"},
  };
  for (const auto& [flags, want] : cases) {
    const std::string cmd = std::string(exe) + " --device cpu --model toy --train-iters 1 --data-path " + dir +
                            "/text.txt " + flags + " >" + dir + "/out.txt 2>" + dir + "/err.txt";
    const int status = std::system(cmd.c_str());
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << flags;
    const std::string err = testing::read_file(dir + "/err.txt");
    EXPECT_TRUE(contains(err, want)) << flags << ": " << err;
    EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
  }
}

}  // namespace
}  // namespace weft
