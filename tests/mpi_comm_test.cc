// MpiCommunicator over real MPI processes: meson runs this binary under
// `mpiexec -n 2`, `-n 4` and `-n 8`, and every rank runs every test for the
// world size it was started with.
//
// Every rank calls every collective in the same order, so the tests use EXPECT
// (never ASSERT, whose early return would skip a collective and hang the
// others) and no test skips on one rank only. Rank 0 prints gtest's report;
// other ranks print only their failures, and main() combines the verdicts so
// every rank exits with the same status.
#include <weft/bf16.h>
#include <weft/mpi_communicator.h>
#include <weft/staged_communicator.h>

#include <gtest/gtest.h>
#include <mpi.h>

#include "test_util.h"

#include <chrono>
#include <cstdio>
#include <numeric>
#include <string_view>
#include <thread>

namespace weft {
namespace {

using std::chrono::milliseconds;
using Kind = MessageTag::Kind;

Communicator* g_world = nullptr;
Communicator& world() { return *g_world; }

MessageTag tag(int micro_batch, Kind kind = Kind::User, int chunk = 0, int index = 0) {
  return MessageTag{kind, micro_batch, chunk, index};
}

// t[i] = base + i: every element distinct, so a misplaced byte shows.
Tensor iota(Shape shape, float base) {
  Tensor t = Tensor::empty(shape);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = base + static_cast<float>(i);
  return t;
}

// Counts the elements where t[i] != base + i (0 when all match).
int64_t iota_mismatches(const Tensor& t, float base) {
  int64_t bad = 0;
  for (int64_t i = 0; i < t.numel(); ++i) bad += t.data<float>()[i] != base + static_cast<float>(i);
  return bad;
}

using testing::contains;
using testing::error_message;

// Restores the world's deadline and step when a test changed them.
struct DeadlineGuard {
  explicit DeadlineGuard(Communicator& c) : comm(c), saved(c.options().timeout) {}
  ~DeadlineGuard() {
    comm.set_timeout(saved);
    comm.set_step("");
  }
  Communicator& comm;
  milliseconds saved;
};

TEST(MessageTagTest, RoundTripsEveryField) {
  std::vector<int32_t> codes;
  for (Kind kind : {Kind::Activation, Kind::Gradient, Kind::Tied, Kind::Data, Kind::User})
    for (int mb : {0, 1, 77, MessageTag::kMaxMicroBatch - 1})
      for (int chunk : {0, 5, MessageTag::kMaxChunk - 1})
        for (int index : {0, 3, MessageTag::kMaxIndex - 1}) {
          MessageTag t{kind, mb, chunk, index};
          const int32_t code = t.encode();
          EXPECT_GE(code, 0);
          EXPECT_LT(code, 1 << 25) << t.str();
          EXPECT_EQ(MessageTag::decode(code), t) << t.str();
          codes.push_back(code);
        }
  std::sort(codes.begin(), codes.end());
  EXPECT_EQ(std::adjacent_find(codes.begin(), codes.end()), codes.end()) << "two tags share a code";
  EXPECT_EQ(tag(3, Kind::Activation, 1).str(), "activation mb 3 chunk 1 #0");
}

TEST(MessageTagTest, OutOfRangeFieldsAreNamed) {
  EXPECT_TRUE(contains(error_message([] { tag(MessageTag::kMaxMicroBatch).encode(); }), "micro-batch 4096"));
  EXPECT_TRUE(contains(error_message([] { tag(0, Kind::User, -1).encode(); }), "chunk -1"));
  EXPECT_TRUE(contains(error_message([] { tag(0, Kind::User, 0, 16).encode(); }), "index 16"));
}

TEST(MpiComm, WorldDescribesItself) {
  int size = 0, rank = -1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  EXPECT_EQ(world().size(), size);
  EXPECT_EQ(world().rank(), rank);
  EXPECT_EQ(world().describe(), "world");
  for (int r = 0; r < size; ++r) EXPECT_EQ(world().world_rank(r), r);
  EXPECT_TRUE(contains(error_message([] { world().world_rank(world().size()); }), "outside"));
}

TEST(MpiComm, RingOfNonBlockingSends) {
  const int n = world().size(), r = world().rank();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  // A small (eager) and a 1 MiB (rendezvous) message: MPI moves them differently.
  for (int64_t rows : {3, 65536}) {
    Tensor out = iota({rows, 4}, 1000.0f * static_cast<float>(r));
    Tensor in = Tensor::zeros({rows, 4});
    auto recv = world().irecv(in, prev, tag(1, Kind::Activation));
    auto send = world().isend(out, next, tag(1, Kind::Activation));
    recv->wait();
    send->wait();
    EXPECT_TRUE(recv->test());
    EXPECT_EQ(iota_mismatches(in, 1000.0f * static_cast<float>(prev)), 0) << rows << " rows";
  }
}

TEST(MpiComm, BlockingSendRecvBetweenPairs) {
  const int n = world().size(), r = world().rank();
  Tensor t = Tensor::zeros({5}, DType::I32);
  // Even ranks send first, odd ranks receive first: blocking calls cannot deadlock.
  const int partner = r % 2 == 0 ? r + 1 : r - 1;
  if (partner < n) {
    for (int round = 0; round < 2; ++round) {
      const bool sending = (r % 2 == 0) == (round == 0);
      if (sending) {
        for (int i = 0; i < 5; ++i) t.data<int32_t>()[i] = 10 * r + i + round;
        world().send(t, partner, tag(round, Kind::Data));
      } else {
        world().recv(t, partner, tag(round, Kind::Data));
        for (int i = 0; i < 5; ++i) EXPECT_EQ(t.data<int32_t>()[i], 10 * partner + i + round);
      }
    }
  }
  world().barrier();
}

TEST(MpiComm, TagsMatchWhateverOrderReceivesArePosted) {
  const int n = world().size(), r = world().rank();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  // Three tags, three different shapes; received in another order than sent.
  std::vector<Tensor> out, in(3);
  std::vector<RequestPtr> sends;
  for (int k = 0; k < 3; ++k) {
    out.push_back(iota({k + 1, 7}, 100.0f * static_cast<float>(r) + 10.0f * k));
    sends.push_back(world().isend(out.back(), next, tag(k, Kind::Gradient, 2, 1)));
  }
  std::vector<RequestPtr> recvs(3);
  for (int k : {2, 0, 1}) {
    in[static_cast<size_t>(k)] = Tensor::zeros({k + 1, 7});
    recvs[static_cast<size_t>(k)] =
        world().irecv(in[static_cast<size_t>(k)], prev, tag(k, Kind::Gradient, 2, 1));
  }
  for (int k : {1, 2, 0}) recvs[static_cast<size_t>(k)]->wait();
  wait_all(sends);
  for (int k = 0; k < 3; ++k)
    EXPECT_EQ(
        iota_mismatches(in[static_cast<size_t>(k)], 100.0f * static_cast<float>(prev) + 10.0f * k),
        0)
        << "tag " << k;
}

TEST(MpiComm, EqualTagsArriveInSendOrder) {
  const int n = world().size(), r = world().rank();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  // Same tag, different sizes (one past MPI's eager limit): the k-th receive
  // must get the k-th send even though the receives are waited for backwards.
  const std::vector<int64_t> rows = {1, 4, 65536, 2, 3, 8};
  std::vector<Tensor> out, in;
  std::vector<RequestPtr> sends, recvs;
  for (size_t k = 0; k < rows.size(); ++k) {
    in.push_back(Tensor::zeros({rows[k], 4}));
    recvs.push_back(world().irecv(in.back(), prev, tag(9)));
  }
  for (size_t k = 0; k < rows.size(); ++k) {
    out.push_back(
        iota({rows[k], 4}, 1e6f * static_cast<float>(r) + 100.0f * static_cast<float>(k)));
    sends.push_back(world().isend(out.back(), next, tag(9)));
  }
  for (size_t k = rows.size(); k-- > 0;) recvs[k]->wait();
  wait_all(sends);
  for (size_t k = 0; k < rows.size(); ++k)
    EXPECT_EQ(
        iota_mismatches(in[k], 1e6f * static_cast<float>(prev) + 100.0f * static_cast<float>(k)), 0)
        << "message " << k;
}

TEST(MpiComm, EmptyTensorsTravel) {
  const int n = world().size(), r = world().rank();
  Tensor empty = Tensor::empty({0, 3});
  auto recv = world().irecv(empty, (r + n - 1) % n, tag(2));
  auto send = world().isend(empty, (r + 1) % n, tag(2));
  recv->wait();
  send->wait();
  world().all_reduce(empty, ReduceOp::Sum);
}

TEST(MpiComm, MismatchedMessagesNameBothSides) {
  const int n = world().size(), r = world().rank();
  // Even rank r sends to r + 1; an odd world size leaves the last rank out.
  if (r % 2 == 0 && r + 1 < n) {
    world().send(iota({2, 3}, 0), r + 1, tag(100));
    world().send(Tensor::zeros({6}, DType::I32), r + 1, tag(101));
    world().send(iota({4, 4}, 0), r + 1, tag(102));  // more bytes than the receiver posted
  } else if (r % 2 == 1) {
    Tensor posted = Tensor::zeros({3, 2});
    std::string shape = error_message([&] { world().recv(posted, r - 1, tag(100)); });
    EXPECT_TRUE(contains(shape, "F32 [2, 3]") && contains(shape, "F32 [3, 2]")) << shape;
    EXPECT_TRUE(contains(shape, fmt::format("from rank {}", r - 1)) && contains(shape, "user mb 100"))
        << shape;
    Tensor six = Tensor::zeros({6});
    std::string dtype = error_message([&] { world().recv(six, r - 1, tag(101)); });
    EXPECT_TRUE(contains(dtype, "I32 [6]") && contains(dtype, "F32 [6]")) << dtype;
    Tensor small = Tensor::zeros({2, 2});
    std::string larger = error_message([&] { world().recv(small, r - 1, tag(102)); });
    EXPECT_TRUE(contains(larger, "F32 [4, 4]") && contains(larger, "F32 [2, 2]")) << larger;
  }
  world().barrier();
}

TEST(MpiComm, RecvPastTheDeadlineNamesWhatItWaitedFor) {
  const int n = world().size(), r = world().rank();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  {
    DeadlineGuard guard(world());
    world().set_timeout(milliseconds(100));
    world().set_step("step 7, action 1F3");
    Tensor t = Tensor::zeros({4});
    const auto start = std::chrono::steady_clock::now();
    std::string msg;
    try {
      world().recv(t, prev, tag(4000, Kind::Activation));
      msg = "(no error)";
    } catch (const CommTimeout& e) {
      msg = e.what();
    }
    const auto waited = std::chrono::steady_clock::now() - start;
    for (std::string part :
         {fmt::format("rank {} (world rank {}) timed out after 100 ms", r, r),
          fmt::format("recv of F32 [4] from rank {} (world rank {})", prev, prev),
          std::string("activation mb 4000"), std::string("step 7, action 1F3")})
      EXPECT_TRUE(contains(msg, part)) << "missing '" << part << "' in: " << msg;
    EXPECT_GE(waited, milliseconds(100));
    EXPECT_LT(waited, milliseconds(1500));
  }
  // Once every rank has given up (so no rank's send below can meet a receive
  // still waiting above), the abandoned receives are cancelled ones: the same
  // tag reaches a new receive.
  world().barrier();
  Tensor out = iota({4}, static_cast<float>(r)), in = Tensor::zeros({4});
  auto recv = world().irecv(in, prev, tag(4000, Kind::Activation));
  auto send = world().isend(out, next, tag(4000, Kind::Activation));
  recv->wait();
  send->wait();
  EXPECT_EQ(iota_mismatches(in, static_cast<float>(prev)), 0);
}

TEST(MpiComm, BadArgumentsAreErrorsWithValues) {
  const int n = world().size();
  Tensor t = Tensor::zeros({4});
  EXPECT_TRUE(contains(error_message([&] { world().isend(t, n, tag(0)); }), fmt::format("peer rank {}", n)));
  EXPECT_TRUE(contains(error_message([&] { world().irecv(t, -1, tag(0)); }), "peer rank -1"));
  EXPECT_TRUE(contains(error_message([&] { world().broadcast(t, n); }), fmt::format("root {}", n)));
  Tensor bf16 = Tensor::zeros({4}, DType::BF16);
  EXPECT_TRUE(contains(error_message([&] { world().all_reduce(bf16, ReduceOp::Max); }), "BF16 [4]"));
  Tensor wrong = Tensor::zeros({4 * n + 1});
  EXPECT_TRUE(contains(error_message([&] { world().all_gather(t, wrong); }),
                  fmt::format("holds {} elements, not size ({}) x input [4] (4)", 4 * n + 1, n)));
  EXPECT_TRUE(contains(error_message([&] { world().reduce_scatter(wrong, t, ReduceOp::Sum); }),
                  fmt::format("holds {} elements, not size ({}) x output [4] (4)", 4 * n + 1, n)));
  Tensor i32 = Tensor::zeros({4 * n}, DType::I32);
  EXPECT_TRUE(contains(error_message([&] { world().all_gather(t, i32); }), "input is F32 but output is I32"));
}

TEST(MpiComm, AllReduceSumAndMax) {
  const int n = world().size(), r = world().rank();
  const float rank_sum = static_cast<float>(n * (n - 1) / 2);
  for (int64_t numel : {1, 1000, 300000}) {
    Tensor sum = Tensor::empty({numel}), max = Tensor::empty({numel});
    Tensor isum = Tensor::empty({numel}, DType::I32);
    for (int64_t i = 0; i < numel; ++i) {
      sum.data<float>()[i] = static_cast<float>(r + i % 7);
      max.data<float>()[i] = static_cast<float>((r * 5 + i) % n);  // each rank holds the max once
      isum.data<int32_t>()[i] = r * 1000 + static_cast<int32_t>(i % 11);
    }
    world().all_reduce(sum, ReduceOp::Sum);
    world().all_reduce(max, ReduceOp::Max);
    world().all_reduce(isum, ReduceOp::Sum);
    int64_t bad = 0;
    for (int64_t i = 0; i < numel; ++i) {
      bad += sum.data<float>()[i] != rank_sum + static_cast<float>(n * (i % 7));
      bad += max.data<float>()[i] != static_cast<float>(n - 1);
      bad += isum.data<int32_t>()[i] != 1000 * n * (n - 1) / 2 + n * static_cast<int32_t>(i % 11);
    }
    EXPECT_EQ(bad, 0) << numel << " elements";
  }
}

// bf16 sums (the user op): small integers add exactly in any order; values
// that need rounding give, on 2 ranks, exactly bf16(bf16(a) + bf16(b)) and,
// on more, the same bits on every rank within one rounding per addition of
// the exact sum. Large counts take MPICH's reduce-scatter based algorithms.
TEST(MpiComm, Bf16SumRoundsEachAdditionAndAgreesOnEveryRank) {
  const int n = world().size(), r = world().rank();
  auto input = [](int rank, int64_t i) {
    return to_bf16(1.0f + static_cast<float>((i * 37 + rank * 11) % 97) / 97.0f);
  };
  for (int64_t numel : {1, 1000, 300000}) {
    Tensor exact = Tensor::empty({numel}, DType::BF16), rounded = Tensor::empty({numel}, DType::BF16);
    for (int64_t i = 0; i < numel; ++i) {
      exact.data<uint16_t>()[i] = to_bf16(static_cast<float>(r + i % 7));
      rounded.data<uint16_t>()[i] = input(r, i);
    }
    world().all_reduce(exact, ReduceOp::Sum);
    world().all_reduce(rounded, ReduceOp::Sum);
    Tensor all = Tensor::empty({n * numel}, DType::BF16);
    world().all_gather(rounded, all);
    int64_t bad_exact = 0, bad_two = 0, far = 0, differ = 0;
    for (int64_t i = 0; i < numel; ++i) {
      const float got = bf16_to_float(rounded.data<uint16_t>()[i]);
      bad_exact += bf16_to_float(exact.data<uint16_t>()[i]) !=
                   static_cast<float>(n * (n - 1) / 2 + n * (i % 7));
      if (n == 2) bad_two += rounded.data<uint16_t>()[i] != bf16_add(input(0, i), input(1, i));
      double sum = 0;  // positive inputs: each rounding errs by at most 2^-8 of the sum
      for (int k = 0; k < n; ++k) sum += bf16_to_float(input(k, i));
      far += std::abs(got - sum) > (n - 1) * sum / 256.0;
      for (int k = 0; k < n; ++k)
        differ += all.data<uint16_t>()[k * numel + i] != rounded.data<uint16_t>()[i];
    }
    EXPECT_EQ(bad_exact, 0) << numel << " elements";
    EXPECT_EQ(bad_two, 0) << numel << " elements";
    EXPECT_EQ(far, 0) << numel << " elements";
    EXPECT_EQ(differ, 0) << numel << " elements: ranks got other bits";

    // reduce_scatter: member r's slice of the same sums as the all-reduce.
    Tensor in = Tensor::empty({n * numel}, DType::BF16), out = Tensor::empty({numel}, DType::BF16);
    for (int64_t i = 0; i < n * numel; ++i) in.data<uint16_t>()[i] = to_bf16(static_cast<float>(r + i % 5));
    world().reduce_scatter(in, out, ReduceOp::Sum);
    int64_t bad_rs = 0;
    for (int64_t i = 0; i < numel; ++i)
      bad_rs += bf16_to_float(out.data<uint16_t>()[i]) !=
                static_cast<float>(n * (n - 1) / 2 + n * ((r * numel + i) % 5));
    EXPECT_EQ(bad_rs, 0) << numel << " elements";
  }
}

TEST(MpiComm, AllGatherPlacesEachMemberAtItsRank) {
  const int n = world().size(), r = world().rank();
  Tensor in = iota({2, 3}, 100.0f * static_cast<float>(r));
  Tensor out = Tensor::zeros({2 * n, 3});
  world().all_gather(in, out);
  for (int k = 0; k < n; ++k)
    EXPECT_EQ(iota_mismatches(out.slice0(2 * k, 2 * k + 2), 100.0f * static_cast<float>(k)), 0)
        << "slot " << k;
  // In place: the input is this member's own slot of the output.
  Tensor buf = Tensor::zeros({2 * n, 3});
  buf.slice0(2 * r, 2 * r + 2).copy_from(in);
  world().all_gather(buf.slice0(2 * r, 2 * r + 2), buf);
  for (int k = 0; k < n; ++k)
    EXPECT_EQ(iota_mismatches(buf.slice0(2 * k, 2 * k + 2), 100.0f * static_cast<float>(k)), 0)
        << "in place, slot " << k;
}

TEST(MpiComm, ReduceScatterGivesEachMemberItsSlice) {
  const int n = world().size(), r = world().rank();
  const int per = 4;
  Tensor in = iota({n * per}, 1000.0f * static_cast<float>(r));
  Tensor out = Tensor::zeros({per});
  world().reduce_scatter(in, out, ReduceOp::Sum);
  // Element k: the sum over members m of (1000 m + r * per + k).
  for (int k = 0; k < per; ++k)
    EXPECT_EQ(out.data<float>()[k], 1000.0f * static_cast<float>(n * (n - 1) / 2) +
                                        static_cast<float>(n * (r * per + k)));
  Tensor imax = Tensor::empty({n * per}, DType::I32), iout = Tensor::zeros({per}, DType::I32);
  for (int j = 0; j < n * per; ++j) imax.data<int32_t>()[j] = (r == j % n) ? 500 + j : j;
  world().reduce_scatter(imax, iout, ReduceOp::Max);
  for (int k = 0; k < per; ++k) {
    const int j = r * per + k;
    EXPECT_EQ(iout.data<int32_t>()[k], 500 + j) << "max, element " << k;
  }
  // Output inside the input (the layout of a sharded gradient buffer).
  Tensor shared = iota({n * per}, 1000.0f * static_cast<float>(r));
  world().reduce_scatter(shared, shared.slice0(r * per, (r + 1) * per), ReduceOp::Sum);
  for (int k = 0; k < per; ++k)
    EXPECT_EQ(shared.data<float>()[r * per + k], 1000.0f * static_cast<float>(n * (n - 1) / 2) +
                                                     static_cast<float>(n * (r * per + k)));
}

TEST(MpiComm, BroadcastFromEachRoot) {
  const int n = world().size(), r = world().rank();
  for (int root = 0; root < n; ++root) {
    Tensor t = root == r ? iota({3, 5}, 10.0f * static_cast<float>(root)) : Tensor::zeros({3, 5});
    world().broadcast(t, root);
    EXPECT_EQ(iota_mismatches(t, 10.0f * static_cast<float>(root)), 0) << "root " << root;
  }
}

TEST(MpiComm, BarrierWaitsForTheLastMember) {
  const int r = world().rank();
  world().barrier();
  const auto start = std::chrono::steady_clock::now();
  if (r == 0) std::this_thread::sleep_for(milliseconds(100));
  world().barrier();
  // Every member leaves the barrier after rank 0 entered it.
  EXPECT_GE(std::chrono::steady_clock::now() - start, milliseconds(90));
}

// Pairs [0, 1] [2, 3] ...: the layout of tensor-parallel groups.
TEST(MpiComm, SplitIntoPairs) {
  const int n = world().size(), r = world().rank();
  if (n % 2 != 0) GTEST_SKIP() << "needs an even world";  // same on every rank
  std::vector<std::vector<int>> groups;
  for (int g = 0; g < n / 2; ++g) groups.push_back({2 * g, 2 * g + 1});
  auto pair = world().split(groups, "tp");
  const int first = r - r % 2;
  EXPECT_EQ(pair->size(), 2);
  EXPECT_EQ(pair->rank(), r % 2);
  EXPECT_EQ(pair->describe(), fmt::format("tp [{}, {}]", first, first + 1));
  EXPECT_EQ(pair->world_rank(0), first);
  EXPECT_EQ(pair->world_rank(1), first + 1);

  Tensor t = Tensor::empty({3});
  for (int i = 0; i < 3; ++i) t.data<float>()[i] = static_cast<float>(r);
  pair->all_reduce(t, ReduceOp::Sum);
  EXPECT_EQ(t.data<float>()[2], static_cast<float>(2 * first + 1));

  // Point-to-point inside the pair, by group rank, with the world's tags in
  // use at the same time: the two communicators' messages never meet.
  const int other = 1 - pair->rank();
  Tensor out = iota({4}, static_cast<float>(r)), in = Tensor::zeros({4});
  Tensor wout = iota({4}, 50.0f + static_cast<float>(r)), win = Tensor::zeros({4});
  auto wrecv = world().irecv(win, (r + n - 1) % n, tag(5));
  auto recv = pair->irecv(in, other, tag(5));
  auto send = pair->isend(out, other, tag(5));
  auto wsend = world().isend(wout, (r + 1) % n, tag(5));
  recv->wait();
  send->wait();
  wrecv->wait();
  wsend->wait();
  EXPECT_EQ(iota_mismatches(in, static_cast<float>(pair->world_rank(other))), 0);
  EXPECT_EQ(iota_mismatches(win, 50.0f + static_cast<float>((r + n - 1) % n)), 0);
}

// Evens in order and odds listed backwards: a member's rank is its position.
TEST(MpiComm, SplitOddEvenAndAgain) {
  const int n = world().size(), r = world().rank();
  std::vector<int> evens, odds;
  for (int k = 0; k < n; ++k) (k % 2 == 0 ? evens : odds).push_back(k);
  std::reverse(odds.begin(), odds.end());
  auto half = world().split({evens, odds}, "parity");
  const std::vector<int>& mine = r % 2 == 0 ? evens : odds;
  const int pos = static_cast<int>(std::find(mine.begin(), mine.end(), r) - mine.begin());
  EXPECT_EQ(half->size(), static_cast<int>(mine.size()));
  EXPECT_EQ(half->rank(), pos);
  EXPECT_EQ(half->describe(), fmt::format("parity [{}]", fmt::join(mine, ", ")));

  // all_gather of world ranks lists the members in group order.
  Tensor me = Tensor::empty({1}, DType::I32);
  me.data<int32_t>()[0] = r;
  Tensor all = Tensor::zeros({half->size()}, DType::I32);
  half->all_gather(me, all);
  for (int k = 0; k < half->size(); ++k) {
    EXPECT_EQ(all.data<int32_t>()[k], mine[static_cast<size_t>(k)]);
    EXPECT_EQ(half->world_rank(k), mine[static_cast<size_t>(k)]);
  }
  Tensor sum = Tensor::empty({1}, DType::I32);
  sum.data<int32_t>()[0] = r;
  half->all_reduce(sum, ReduceOp::Sum);
  EXPECT_EQ(sum.data<int32_t>()[0], std::accumulate(mine.begin(), mine.end(), 0));
  Tensor b = half->rank() == half->size() - 1 ? iota({2}, 7.0f) : Tensor::zeros({2});
  half->broadcast(b, half->size() - 1);
  EXPECT_EQ(iota_mismatches(b, 7.0f), 0);

  // Split the split into singles: names use world ranks at every level.
  std::vector<std::vector<int>> singles;
  for (int k = 0; k < half->size(); ++k) singles.push_back({k});
  auto single = half->split(singles, "one");
  EXPECT_EQ(single->size(), 1);
  EXPECT_EQ(single->describe(), fmt::format("one [{}]", r));
  Tensor t = iota({3}, 1.0f);
  single->all_reduce(t, ReduceOp::Sum);
  EXPECT_EQ(iota_mismatches(t, 1.0f), 0);
  half->barrier();
}

TEST(MpiComm, SplitRejectsBadPartitions) {
  const int n = world().size();
  std::vector<int> all(static_cast<size_t>(n));
  std::iota(all.begin(), all.end(), 0);
  std::vector<int> missing(all.begin(), all.end() - 1);
  std::string msg = error_message([&] { world().split({missing}, "dp"); });
  EXPECT_TRUE(contains(msg, fmt::format("split 'dp' of world: rank {} is in no group", n - 1))) << msg;
  std::vector<int> twice = all;
  twice.push_back(0);
  msg = error_message([&] { world().split({twice}, "dp"); });
  EXPECT_TRUE(contains(msg, "rank 0 is listed twice")) << msg;
  msg = error_message([&] { world().split({all, {n}}, "dp"); });
  EXPECT_TRUE(contains(msg, fmt::format("rank {} in group 1 is outside [0, {})", n, n))) << msg;
  msg = error_message([&] { world().split({all, {}}, "dp"); });
  EXPECT_TRUE(contains(msg, "group 1 is empty")) << msg;
}

TEST(MpiComm, SplitRejectsMembersThatDisagree) {
  const int n = world().size(), r = world().rank();
  std::vector<int> all(static_cast<size_t>(n));
  std::iota(all.begin(), all.end(), 0);
  std::vector<std::vector<int>> groups = {all};
  if (r == n - 1) {  // the last rank alone lists the world backwards
    std::reverse(groups[0].begin(), groups[0].end());
  }
  std::string msg = error_message([&] { world().split(groups, "pp"); });
  EXPECT_TRUE(contains(msg, "every member must pass the same groups")) << msg;
  world().barrier();  // the communicator still works
}

// Prints a non-zero rank's failures, prefixed with its rank; its successes
// stay quiet so the report is rank 0's.
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  // Remembered here: UnitTest::current_test_info() would take the lock that
  // gtest holds while it reports a result.
  void OnTestStart(const ::testing::TestInfo& test) override {
    test_ = fmt::format("{}.{}", test.test_suite_name(), test.name());
  }
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::string line = fmt::format("rank {}: FAILED {} at {}:{}\n{}\n", rank_, test_,
                                   result.file_name() ? result.file_name() : "?",
                                   result.line_number(), result.message());
    std::fwrite(line.data(), 1, line.size(), stdout);
    std::fflush(stdout);
  }

 private:
  int rank_;
  std::string test_;
};

}  // namespace
}  // namespace weft

// With --staged, every test runs through HostStagedCommunicator with all
// tensors staged in host buffers over MPI, as device tensors travel when ranks
// share a GPU.
int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  bool staged = false;
  for (int i = 1; i < argc; ++i) staged |= std::string_view(argv[i]) == "--staged";
  weft::CommOptions options;
  // Far below MPIEXEC_TIMEOUT, so a hang ends with a message naming the wait.
  options.timeout = std::chrono::seconds(30);
  return weft::mpi_main(
      argc, argv,
      [staged](weft::Communicator& mpi) {
        weft::HostStagedCommunicator wrapped(mpi, weft::HostStagedCommunicator::Stage::All);
        weft::Communicator& world = staged ? static_cast<weft::Communicator&>(wrapped) : mpi;
        weft::g_world = &world;
        auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
        if (world.rank() != 0) {
          delete listeners.Release(listeners.default_result_printer());
          listeners.Append(new weft::FailurePrinter(world.rank()));
        }
        // RUN_ALL_TESTS also fails when no test ran or one failed outside a test.
        const int status = RUN_ALL_TESTS();
        const int failed = ::testing::UnitTest::GetInstance()->failed_test_count();
        weft::Tensor verdict = weft::Tensor::empty({2}, weft::DType::I32);
        verdict.data<int32_t>()[0] = failed;
        verdict.data<int32_t>()[1] = status;
        world.all_reduce(verdict, weft::ReduceOp::Max);
        const int most = verdict.data<int32_t>()[0];
        if (world.rank() == 0 && most > failed)
          std::printf("[  FAILED  ] %d tests on another rank (its failures are above)\n", most);
        return most > 0 || verdict.data<int32_t>()[1] != 0 ? 1 : 0;
      },
      options);
}
