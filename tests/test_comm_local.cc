// LocalCommunicator: tag matching, collectives, groups, deadlines and failure.
#include <gtest/gtest.h>
#include <weft/local_communicator.h>
#include <weft/staged_communicator.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "test_util.h"

namespace weft {
namespace {

using namespace std::chrono_literals;
using testing::contains;
using testing::error_message;
using Clock = std::chrono::steady_clock;

Tensor filled(Shape shape, const std::function<float(int64_t)>& value) {
  Tensor t = Tensor::empty(shape);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = value(i);
  return t;
}

std::vector<float> values(const Tensor& t) {
  return std::vector<float>(t.data<float>(), t.data<float>() + t.numel());
}

std::vector<float> expected(int64_t n, const std::function<float(int64_t)>& value) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = value(i);
  return v;
}

MessageTag tag(int mb, MessageTag::Kind kind = MessageTag::Kind::Activation, int index = 0) {
  return MessageTag{kind, mb, 0, index};
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The deadline for tests that must not wait: a bug fails them instead of hanging.
const CommOptions kQuick{std::chrono::milliseconds(5000)};

// --- MessageTag ---

TEST(MessageTag, EncodeDecodeRoundTrip) {
  const std::vector<MessageTag> tags = {
      {},
      {MessageTag::Kind::Activation, 3, 1, 0},
      {MessageTag::Kind::Gradient, MessageTag::kMaxMicroBatch - 1, MessageTag::kMaxChunk - 1,
       MessageTag::kMaxIndex - 1},
      {MessageTag::Kind::Tied, 0, 0, 5},
      {MessageTag::Kind::Data, 17, 2, 3},
  };
  for (const MessageTag& t : tags) {
    const int32_t code = t.encode();
    EXPECT_GE(code, 0);
    EXPECT_LT(code, 1 << 25);
    EXPECT_EQ(MessageTag::decode(code), t) << t.str();
  }
  EXPECT_NE(tags[1].encode(), tags[2].encode());
  EXPECT_EQ(tags[1].str(), "activation mb 3 chunk 1 #0");
}

TEST(MessageTag, OutOfRangeFieldsThrowNamingTheField) {
  MessageTag t;
  t.micro_batch = MessageTag::kMaxMicroBatch;
  EXPECT_TRUE(contains(error_message([&] { t.encode(); }), "micro-batch 4096"));
  t = {};
  t.chunk = -1;
  EXPECT_TRUE(contains(error_message([&] { t.encode(); }), "chunk -1"));
  t = {};
  t.index = MessageTag::kMaxIndex;
  EXPECT_TRUE(contains(error_message([&] { t.encode(); }), "index 16"));
  // A send with a bad tag is refused before anything is queued.
  auto world = make_local_world(1, kQuick);
  Tensor x = Tensor::zeros({1});
  EXPECT_THROW(world[0]->isend(x, 0, t), Error);
}

// --- Per world size ---

// Every test of a world runs twice: on the threads' transport itself, and
// with every tensor staged through HostStagedCommunicator's host buffers over
// it (as device tensors travel when ranks share a GPU): the same results.
class LocalWorld : public ::testing::TestWithParam<std::tuple<int, bool>> {
 protected:
  int n() const { return std::get<0>(GetParam()); }
  void run(const std::function<void(Communicator&)>& fn) {
    run_local(
        n(),
        [&](Communicator& comm) {
          if (!std::get<1>(GetParam())) return fn(comm);
          HostStagedCommunicator staged(comm, HostStagedCommunicator::Stage::All);
          fn(staged);
        },
        kQuick);
  }
};

TEST_P(LocalWorld, RanksAndDescription) {
  run([&](Communicator& comm) {
    EXPECT_EQ(comm.size(), n());
    EXPECT_EQ(comm.world_rank(comm.rank()), comm.rank());
    EXPECT_EQ(comm.describe(), "world");
  });
}

TEST_P(LocalWorld, SendRecvRing) {
  run([&](Communicator& comm) {
    const int r = comm.rank();
    const int next = (r + 1) % n();
    const int prev = (r + n() - 1) % n();
    Tensor out = filled({2, 3}, [&](int64_t i) { return static_cast<float>(r * 100 + i); });
    Tensor in = Tensor::zeros({2, 3});
    // A blocking send first on every rank: sends are buffered, so the ring cannot deadlock.
    comm.send(out, next, tag(0));
    comm.recv(in, prev, tag(0));
    EXPECT_EQ(values(in),
              expected(6, [&](int64_t i) { return static_cast<float>(prev * 100 + i); }));
  });
}

// A p2p step as the pipeline posts it: receives and sends inside one group,
// waited for after group_end. Threads (and staging over them) ignore the
// group; the ring must still deliver.
TEST_P(LocalWorld, SendRecvRingInsideAGroup) {
  run([&](Communicator& comm) {
    const int r = comm.rank();
    const int next = (r + 1) % n();
    const int prev = (r + n() - 1) % n();
    Tensor out = filled({4}, [&](int64_t i) { return static_cast<float>(r * 10 + i); });
    Tensor in = Tensor::zeros({4});
    std::vector<RequestPtr> reqs;
    comm.group_start();
    reqs.push_back(comm.irecv(in, prev, tag(0)));
    reqs.push_back(comm.isend(out, next, tag(0)));
    comm.group_end();
    wait_all(reqs);
    EXPECT_EQ(values(in), values(filled({4}, [&](int64_t i) {
                return static_cast<float>(prev * 10 + i);
              })));
  });
}

TEST_P(LocalWorld, ReceivesPostedOutOfOrderMatchByTag) {
  run([&](Communicator& comm) {
    const int r = comm.rank();
    const int next = (r + 1) % n();
    const int prev = (r + n() - 1) % n();
    const std::vector<MessageTag> tags = {tag(0), tag(1), tag(0, MessageTag::Kind::Gradient),
                                          tag(1, MessageTag::Kind::Activation, 1)};
    std::vector<Tensor> out;
    for (size_t k = 0; k < tags.size(); ++k)
      out.push_back(
          filled({4}, [&](int64_t i) { return static_cast<float>(r * 1000 + k * 10 + i); }));
    // Receives posted in reverse order before anything is sent.
    std::vector<Tensor> in(tags.size());
    std::vector<RequestPtr> recvs(tags.size());
    for (size_t k = tags.size(); k-- > 0;) {
      in[k] = Tensor::zeros({4});
      recvs[k] = comm.irecv(in[k], prev, tags[k]);
    }
    std::vector<RequestPtr> sends;
    for (size_t k = 0; k < tags.size(); ++k) sends.push_back(comm.isend(out[k], next, tags[k]));
    wait_all(sends);
    // Completed in yet another order.
    for (size_t k : {size_t{2}, size_t{0}, size_t{3}, size_t{1}}) {
      recvs[k]->wait();
      EXPECT_TRUE(recvs[k]->test());
      EXPECT_EQ(
          values(in[k]),
          expected(4, [&](int64_t i) { return static_cast<float>(prev * 1000 + k * 10 + i); }))
          << tags[k].str();
    }
  });
}

TEST_P(LocalWorld, EqualTagsArriveInSendOrder) {
  run([&](Communicator& comm) {
    const int next = (comm.rank() + 1) % n();
    const int prev = (comm.rank() + n() - 1) % n();
    for (int k = 0; k < 5; ++k)
      comm.send(filled({1}, [&](int64_t) { return static_cast<float>(k); }), next, tag(7));
    // Three blocking receives in order.
    for (int k = 0; k < 3; ++k) {
      Tensor in = Tensor::zeros({1});
      comm.recv(in, prev, tag(7));
      EXPECT_EQ(in.data<float>()[0], static_cast<float>(k));
    }
    // Two receives posted in order but completed in reverse still get the
    // messages in posting order, as MPI matches them.
    Tensor a = Tensor::zeros({1});
    Tensor b = Tensor::zeros({1});
    RequestPtr ra = comm.irecv(a, prev, tag(7));
    RequestPtr rb = comm.irecv(b, prev, tag(7));
    rb->wait();
    ra->wait();
    EXPECT_EQ(a.data<float>()[0], 3.0f);
    EXPECT_EQ(b.data<float>()[0], 4.0f);
  });
}

TEST_P(LocalWorld, AllReduceSumAndMax) {
  run([&](Communicator& comm) {
    const int r = comm.rank();
    // Small integers: the sums are exact in float.
    Tensor sum = filled({3, 4}, [&](int64_t i) { return static_cast<float>((r + 1) * (i + 1)); });
    comm.all_reduce(sum, ReduceOp::Sum);
    const float ranks_sum = static_cast<float>(n() * (n() + 1) / 2);
    EXPECT_EQ(values(sum),
              expected(12, [&](int64_t i) { return ranks_sum * static_cast<float>(i + 1); }));

    // Each element's maximum sits on a different rank.
    auto v = [&](int rank, int64_t i) { return static_cast<float>((rank + i) % n()) - 3.0f; };
    Tensor max = filled({10}, [&](int64_t i) { return v(r, i); });
    comm.all_reduce(max, ReduceOp::Max);
    EXPECT_EQ(values(max),
              expected(10, [&](int64_t) { return static_cast<float>(n() - 1) - 3.0f; }));

    Tensor ints = Tensor::empty({5}, DType::I32);
    for (int i = 0; i < 5; ++i) ints.data<int32_t>()[i] = r * 1000 + i;
    comm.all_reduce(ints, ReduceOp::Sum);
    for (int i = 0; i < 5; ++i)
      EXPECT_EQ(ints.data<int32_t>()[i], 1000 * n() * (n() - 1) / 2 + n() * i);
  });
}

TEST_P(LocalWorld, AllReduceIsBitwiseIdenticalAndInRankOrder) {
  const int64_t len = 257;
  std::vector<std::vector<float>> results(static_cast<size_t>(n()));
  run([&](Communicator& comm) {
    Tensor t = testing::uniform_tensor({len}, 100 + static_cast<uint64_t>(comm.rank()));
    comm.all_reduce(t, ReduceOp::Sum);
    results[static_cast<size_t>(comm.rank())] = values(t);
  });
  std::vector<float> want(static_cast<size_t>(len), 0.0f);
  for (int r = 0; r < n(); ++r) {
    const std::vector<float> x = testing::uniform(len, 100 + static_cast<uint64_t>(r));
    for (size_t i = 0; i < want.size(); ++i) want[i] = r == 0 ? x[i] : want[i] + x[i];
  }
  for (const auto& got : results)
    EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)), 0);
}

TEST_P(LocalWorld, AllGather) {
  run([&](Communicator& comm) {
    const int r = comm.rank();
    Tensor in = filled({3}, [&](int64_t i) { return static_cast<float>(r * 10 + i); });
    Tensor out = Tensor::zeros({n(), 3});
    comm.all_gather(in, out);
    EXPECT_EQ(values(out), expected(3 * n(), [&](int64_t i) {
                return static_cast<float>((i / 3) * 10 + i % 3);
              }));
  });
}

TEST_P(LocalWorld, ReduceScatterSum) {
  run([&](Communicator& comm) {
    const int r = comm.rank();
    Tensor in = filled({n() * 2}, [&](int64_t j) { return static_cast<float>(r + j); });
    Tensor out = Tensor::zeros({2});
    comm.reduce_scatter(in, out, ReduceOp::Sum);
    // Slice r holds elements 2r and 2r + 1; summing rank + j over the ranks.
    const float ranks = static_cast<float>(n() * (n() - 1) / 2);
    EXPECT_EQ(values(out), expected(2, [&](int64_t k) {
                return ranks + static_cast<float>(n() * (2 * r + k));
              }));
  });
}

TEST_P(LocalWorld, BroadcastFromEveryRoot) {
  run([&](Communicator& comm) {
    for (int root = 0; root < n(); ++root) {
      Tensor t = comm.rank() == root
                     ? filled({2, 2}, [&](int64_t i) { return static_cast<float>(root * 10 + i); })
                     : Tensor::zeros({2, 2});
      comm.broadcast(t, root);
      EXPECT_EQ(values(t),
                expected(4, [&](int64_t i) { return static_cast<float>(root * 10 + i); }))
          << "root " << root;
    }
  });
}

TEST_P(LocalWorld, BarrierHoldsEveryoneUntilAllArrive) {
  std::atomic<int> arrived{0};
  run([&](Communicator& comm) {
    for (int round = 1; round <= 3; ++round) {
      // The last rank dawdles: nobody may pass the barrier before it arrives.
      if (comm.rank() == n() - 1) std::this_thread::sleep_for(5ms);
      arrived.fetch_add(1);
      comm.barrier();
      EXPECT_GE(arrived.load(), round * n());
      comm.barrier();  // so nobody starts the next round's count early
    }
  });
}

// Groups of consecutive world ranks: {0, 1}, {2, 3}, ... (the last may be alone).
std::vector<std::vector<int>> pairs(int n) {
  std::vector<std::vector<int>> groups;
  for (int r = 0; r < n; r += 2)
    groups.push_back(r + 1 < n ? std::vector<int>{r, r + 1} : std::vector<int>{r});
  return groups;
}

// Checks collectives and p2p inside `comm`, whose members are `world_ranks`.
void check_group(Communicator& comm, const std::vector<int>& world_ranks) {
  ASSERT_EQ(comm.size(), static_cast<int>(world_ranks.size()));
  for (int r = 0; r < comm.size(); ++r)
    EXPECT_EQ(comm.world_rank(r), world_ranks[static_cast<size_t>(r)]);
  const float me = static_cast<float>(comm.world_rank(comm.rank()));

  Tensor sum = filled({2}, [&](int64_t i) { return me + static_cast<float>(i); });
  comm.all_reduce(sum, ReduceOp::Sum);
  float want = 0;
  for (int w : world_ranks) want += static_cast<float>(w);
  EXPECT_EQ(values(sum), (std::vector<float>{want, want + static_cast<float>(comm.size())}));

  Tensor gathered = Tensor::zeros({comm.size()});
  comm.all_gather(filled({1}, [&](int64_t) { return me; }), gathered);
  EXPECT_EQ(values(gathered), std::vector<float>(world_ranks.begin(), world_ranks.end()));

  // A message to the next member of the group, with a tag the world also uses.
  const int next = (comm.rank() + 1) % comm.size();
  const int prev = (comm.rank() + comm.size() - 1) % comm.size();
  comm.send(filled({1}, [&](int64_t) { return me; }), next, tag(0));
  Tensor in = Tensor::zeros({1});
  comm.recv(in, prev, tag(0));
  EXPECT_EQ(in.data<float>()[0], static_cast<float>(comm.world_rank(prev)));
}

TEST_P(LocalWorld, SplitIntoPairs) {
  run([&](Communicator& comm) {
    const auto groups = pairs(n());
    auto pair = comm.split(groups, "pair");
    const auto& mine = groups[static_cast<size_t>(comm.rank() / 2)];
    EXPECT_EQ(pair->rank(), comm.rank() % 2);
    EXPECT_EQ(pair->describe(), mine.size() == 2
                                    ? fmt::format("pair [{}, {}]", mine[0], mine[1])
                                    : fmt::format("pair [{}]", mine[0]));
    check_group(*pair, mine);
    // The world still works beside its groups.
    comm.barrier();
  });
}

TEST_P(LocalWorld, SplitIntoOddAndEven) {
  run([&](Communicator& comm) {
    std::vector<std::vector<int>> groups(n() > 1 ? 2 : 1);
    for (int r = 0; r < n(); ++r) groups[static_cast<size_t>(r % 2)].push_back(r);
    // Listed backwards: group ranks follow the order given, not the world order.
    for (auto& g : groups) std::reverse(g.begin(), g.end());
    auto parity = comm.split(groups, "parity");
    const auto& mine = groups[static_cast<size_t>(comm.rank() % 2)];
    EXPECT_EQ(parity->world_rank(parity->rank()), comm.rank());
    EXPECT_EQ(parity->world_rank(0), mine[0]);
    check_group(*parity, mine);
  });
}

TEST_P(LocalWorld, SplitOfASplit) {
  run([&](Communicator& comm) {
    // Halves of the world, then pairs inside each half; world ranks carry through.
    const int half = (n() + 1) / 2;
    std::vector<std::vector<int>> halves(n() > 1 ? 2 : 1);
    for (int r = 0; r < n(); ++r) halves[r < half ? 0 : 1].push_back(r);
    auto h = comm.split(halves, "half");
    const auto& my_half = halves[comm.rank() < half ? 0 : 1];
    check_group(*h, my_half);

    const auto groups = pairs(h->size());
    auto inner = h->split(groups, "inner");
    std::vector<int> members;
    for (int r : groups[static_cast<size_t>(h->rank() / 2)]) members.push_back(h->world_rank(r));
    check_group(*inner, members);
    EXPECT_TRUE(contains(inner->describe(), fmt::format("inner [{}", members[0])));

    // A second split of the same parent makes new groups, not the old ones.
    auto again = h->split(groups, "again");
    check_group(*again, members);
    EXPECT_TRUE(contains(again->describe(), "again ["));
  });
}

std::string size_name(const ::testing::TestParamInfo<std::tuple<int, bool>>& p) {
  return fmt::format("n{}{}", std::get<0>(p.param), std::get<1>(p.param) ? "_staged" : "");
}
INSTANTIATE_TEST_SUITE_P(Sizes, LocalWorld,
                         ::testing::Combine(::testing::Range(1, 9), ::testing::Bool()),
                         size_name);

// --- Host staging ---

// Staging buffers are reused: after the first round of a step's operations
// (sends, receives, blocking and non-blocking collectives, in a group from
// split() too), more rounds take no more host memory.
TEST(HostStaged, BuffersAreReusedAcrossRounds) {
  run_local(
      2,
      [](Communicator& world) {
        HostStagedCommunicator comm(world, HostStagedCommunicator::Stage::All);
        auto group = comm.split({{0, 1}}, "pair");
        size_t after_first = 0;
        for (int round = 0; round < 4; ++round) {
          const int peer = 1 - comm.rank();
          Tensor out = filled({64}, [&](int64_t i) { return static_cast<float>(round + i); });
          Tensor in = Tensor::zeros({64});
          RequestPtr r = comm.irecv(in, peer, tag(round));
          RequestPtr s = comm.isend(out, peer, tag(round));
          s->wait();
          r->wait();
          EXPECT_EQ(values(in), values(out));
          Tensor grads = filled({300}, [&](int64_t i) { return static_cast<float>(i); });
          RequestPtr ar = group->iall_reduce(grads, ReduceOp::Sum);
          Tensor shard = Tensor::zeros({150});
          Tensor full = filled({300}, [&](int64_t i) { return static_cast<float>(i); });
          RequestPtr rs = comm.ireduce_scatter(full, shard, ReduceOp::Sum);
          ar->wait();
          rs->wait();
          EXPECT_EQ(grads.data<float>()[299], 2 * 299.0f);
          EXPECT_EQ(shard.data<float>()[1], 2 * (150.0f * comm.rank() + 1));
          if (round == 0) after_first = comm.staging_bytes();
          EXPECT_EQ(comm.staging_bytes(), after_first) << "round " << round;
        }
        EXPECT_GT(after_first, 0u);
      },
      kQuick);
}

// A receive writes its tensor only when the request completes, and a send
// copies its tensor out when posted, so the sender may overwrite it at once.
TEST(HostStaged, ReceivesLandOnCompletionAndSendsCopyWhenPosted) {
  auto world = make_local_world(2, kQuick);
  HostStagedCommunicator a(*world[0], HostStagedCommunicator::Stage::All);
  HostStagedCommunicator b(*world[1], HostStagedCommunicator::Stage::All);
  Tensor in = Tensor::zeros({3});
  RequestPtr r = b.irecv(in, 0, tag(5));
  Tensor out = filled({3}, [](int64_t i) { return static_cast<float>(7 + i); });
  RequestPtr s = a.isend(out, 1, tag(5));
  out.zero_();
  s->wait();
  EXPECT_EQ(values(in), (std::vector<float>{0, 0, 0}));  // not yet completed here
  EXPECT_TRUE(r->test());
  EXPECT_EQ(values(in), (std::vector<float>{7, 8, 9}));
}

// Errors are the transport's, naming what arrived and what was posted.
TEST(HostStaged, ShapeMismatchNamesBothShapes) {
  auto world = make_local_world(2, kQuick);
  HostStagedCommunicator a(*world[0], HostStagedCommunicator::Stage::All);
  HostStagedCommunicator b(*world[1], HostStagedCommunicator::Stage::All);
  a.send(Tensor::zeros({2, 3}), 1, tag(1));
  Tensor posted = Tensor::zeros({3, 2});
  const std::string msg = error_message([&] { b.recv(posted, 0, tag(1)); });
  EXPECT_TRUE(contains(msg, "[2, 3]")) << msg;
  EXPECT_TRUE(contains(msg, "[3, 2]")) << msg;
}

// Staging device tensors only, host tensors go straight to the transport.
TEST(HostStaged, HostTensorsPassStraightThroughWhenOnlyDevicesAreStaged) {
  run_local(
      2,
      [](Communicator& world) {
        HostStagedCommunicator comm(world);
        Tensor t = filled({100}, [](int64_t i) { return static_cast<float>(i); });
        comm.all_reduce(t, ReduceOp::Sum);
        EXPECT_EQ(t.data<float>()[99], 198.0f);
        EXPECT_EQ(comm.staging_bytes(), 0u);
      },
      kQuick);
}

// --- Errors ---

TEST(LocalErrors, ShapeMismatchNamesBothShapes) {
  auto world = make_local_world(2, kQuick);
  world[0]->send(Tensor::zeros({2, 3}), 1, tag(1));
  Tensor posted = Tensor::zeros({3, 2});
  const std::string msg = error_message([&] { world[1]->recv(posted, 0, tag(1)); });
  EXPECT_TRUE(contains(msg, "[2, 3]")) << msg;
  EXPECT_TRUE(contains(msg, "[3, 2]")) << msg;
  EXPECT_TRUE(contains(msg, "activation mb 1")) << msg;
}

TEST(LocalErrors, DtypeMismatchNamesBothDtypes) {
  auto world = make_local_world(2, kQuick);
  world[0]->send(Tensor::zeros({4}, DType::I32), 1, tag(2));
  Tensor posted = Tensor::zeros({4});
  RequestPtr req = world[1]->irecv(posted, 0, tag(2));
  const std::string msg = error_message([&] { req->test(); });
  EXPECT_TRUE(contains(msg, "received I32 [4]")) << msg;
  EXPECT_TRUE(contains(msg, "posted a receive for F32 [4]")) << msg;
}

TEST(LocalErrors, TestReportsCompletionWithoutBlocking) {
  auto world = make_local_world(2, kQuick);
  Tensor in = Tensor::zeros({1});
  RequestPtr req = world[1]->irecv(in, 0, tag(3));
  EXPECT_FALSE(req->test());
  world[0]->send(filled({1}, [](int64_t) { return 9.0f; }), 1, tag(3));
  EXPECT_TRUE(req->test());
  EXPECT_EQ(in.data<float>()[0], 9.0f);
}

TEST(LocalErrors, ReceiveNobodySendsTimesOut) {
  auto world = make_local_world(2, CommOptions{200ms});
  world[1]->set_step("step 7");
  Tensor in = Tensor::zeros({1});
  const auto start = Clock::now();
  try {
    world[1]->recv(in, 0, MessageTag{MessageTag::Kind::Activation, 3, 1, 2});
    FAIL() << "the receive returned";
  } catch (const CommTimeout& e) {
    const std::string msg = e.what();
    EXPECT_TRUE(contains(msg, "rank 1 (world rank 1) timed out after 200 ms")) << msg;
    EXPECT_TRUE(contains(msg, "recv from rank 0 (world rank 0)")) << msg;
    EXPECT_TRUE(contains(msg, "tag activation mb 3 chunk 1 #2")) << msg;
    EXPECT_TRUE(contains(msg, "at step 7")) << msg;
  }
  const double elapsed = seconds_since(start);
  EXPECT_GE(elapsed, 0.19);
  EXPECT_LT(elapsed, 1.0);
}

TEST(LocalErrors, CollectiveSomeoneNeverJoinsTimesOutNamingTheGroup) {
  const auto start = Clock::now();
  try {
    run_local(3, [](Communicator& comm) {
      auto tp = comm.split({{0, 2}, {1}}, "tp");
      if (comm.rank() == 2) return;  // never joins
      Tensor t = Tensor::zeros({4});
      tp->all_reduce(t, ReduceOp::Sum);
    }, CommOptions{200ms});
    FAIL() << "run_local returned";
  } catch (const CommTimeout& e) {
    const std::string msg = e.what();
    EXPECT_TRUE(contains(msg, "rank 0: rank 0 (world rank 0) timed out after 200 ms")) << msg;
    EXPECT_TRUE(contains(msg, "all_reduce sum #0 (ranks [1] have not arrived) in tp [0, 2]"))
        << msg;
  }
  EXPECT_LT(seconds_since(start), 1.0);
}

TEST(LocalErrors, ARankThatTimedOutHasLeftTheCollective) {
  // Rank 0 gives up first; ranks 1 and 2 must not complete the collective
  // without it (its tensor may be gone), and they report it as missing.
  auto world = make_local_world(3, CommOptions{300ms});
  world[0]->set_timeout(50ms);
  std::string rank1;
  std::thread waiter([&] {
    Tensor t = Tensor::zeros({4});
    rank1 = error_message([&] { world[1]->all_reduce(t, ReduceOp::Sum); });
  });
  {
    Tensor t = Tensor::zeros({4});
    EXPECT_THROW(world[0]->all_reduce(t, ReduceOp::Sum), CommTimeout);
  }
  Tensor t = Tensor::zeros({4});
  EXPECT_THROW(world[2]->all_reduce(t, ReduceOp::Sum), CommTimeout);
  waiter.join();
  EXPECT_TRUE(contains(rank1, "all_reduce sum #0 (ranks [0] have not arrived) in world")) << rank1;
}

// The barrier after a checkpoint: one rank is busy (writing) longer than the
// deadline; the others wait for it without one, and keep their deadline for
// every later wait.
TEST(LocalErrors, BarrierWithoutDeadlineOutlastsTheTimeout) {
  const auto start = Clock::now();
  EXPECT_NO_THROW(run_local(2, [](Communicator& comm) {
    if (comm.rank() == 0) std::this_thread::sleep_for(600ms);
    comm.barrier_without_deadline();
  }, CommOptions{150ms}));
  EXPECT_GE(seconds_since(start), 0.59);
  // Where a plain barrier gives up.
  EXPECT_THROW(run_local(2, [](Communicator& comm) {
    if (comm.rank() == 0) std::this_thread::sleep_for(600ms);
    comm.barrier();
  }, CommOptions{150ms}), CommTimeout);
  // The deadline is back afterwards.
  auto world = make_local_world(2, CommOptions{150ms});
  std::thread late([&] {
    std::this_thread::sleep_for(300ms);
    world[0]->barrier();
  });
  world[1]->barrier_without_deadline();
  late.join();
  EXPECT_EQ(world[1]->options().timeout, 150ms);
  Tensor in = Tensor::zeros({1});
  EXPECT_THROW(world[1]->recv(in, 0, tag(0)), CommTimeout);
}

// A rank that fails while the others wait without a deadline still ends them.
TEST(LocalErrors, BarrierWithoutDeadlineEndsWhenARankFails) {
  const auto start = Clock::now();
  const std::string msg = error_message([] {
    run_local(2, [](Communicator& comm) {
      if (comm.rank() == 0) {
        std::this_thread::sleep_for(50ms);
        throw Error("disk full");
      }
      comm.barrier_without_deadline();
    }, CommOptions{30s});
  });
  EXPECT_EQ(msg, "rank 0: disk full");
  EXPECT_LT(seconds_since(start), 2.0);
}

TEST(LocalErrors, CollectiveCountMismatchNamesBothCountsAndRanks) {
  const std::string msg = error_message([] {
    run_local(2, [](Communicator& comm) {
      Tensor t = Tensor::zeros({comm.rank() == 0 ? 4 : 5});
      comm.all_reduce(t, ReduceOp::Sum);
    }, kQuick);
  });
  EXPECT_TRUE(contains(msg, "all_reduce sum #0 in world")) << msg;
  EXPECT_TRUE(contains(msg, "rank 0 passed 4 elements but rank 1 passed 5")) << msg;
}

TEST(LocalErrors, CollectiveKindMismatchNamesBothCalls) {
  const std::string msg = error_message([] {
    run_local(2, [](Communicator& comm) {
      Tensor t = Tensor::zeros({4});
      if (comm.rank() == 0)
        comm.all_reduce(t, ReduceOp::Sum);
      else
        comm.broadcast(t, 0);
    }, kQuick);
  });
  EXPECT_TRUE(contains(msg, "rank 0 called all_reduce sum but rank 1 called broadcast from rank 0"))
      << msg;
}

// A rank that polls a receive with test() (a parameter server's loop) learns
// of a failed peer as a waiting rank does: PeerFailed, long before the deadline.
TEST(LocalErrors, PollingAReceiveLearnsOfAFailedPeer) {
  std::string polled;
  const auto start = Clock::now();
  EXPECT_THROW(run_local(
                   2,
                   [&](Communicator& comm) {
                     if (comm.rank() == 1) throw Error("worker gone");
                     Tensor in = Tensor::zeros({1});
                     RequestPtr r = comm.irecv(in, 1, tag(0));
                     polled = error_message([&] {
                       while (!r->test()) std::this_thread::sleep_for(1ms);
                     });
                   },
                   CommOptions{30s}),
               Error);
  EXPECT_LT(seconds_since(start), 10.0);
  EXPECT_TRUE(contains(polled, "worker gone")) << polled;
}

TEST(LocalErrors, ThrowingRankEndsTheOthersPromptly) {
  std::mutex mu;
  std::vector<std::string> peer_messages;
  const auto start = Clock::now();
  try {
    run_local(4, [&](Communicator& comm) {
      try {
        switch (comm.rank()) {
          case 2:
            std::this_thread::sleep_for(20ms);  // the others are blocked by now
            throw Error("boom at {}", 42);
          case 0: {
            Tensor in = Tensor::zeros({1});
            comm.recv(in, 2, tag(0));
            break;
          }
          default: {
            Tensor t = Tensor::zeros({8});
            comm.all_reduce(t, ReduceOp::Sum);
          }
        }
      } catch (const PeerFailed& e) {
        std::lock_guard<std::mutex> lock(mu);
        peer_messages.push_back(e.what());
        throw;
      }
    }, CommOptions{30s});
    FAIL() << "run_local returned";
  } catch (const PeerFailed& e) {
    FAIL() << "run_local rethrew a PeerFailed: " << e.what();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "rank 2: boom at 42");
  }
  EXPECT_LT(seconds_since(start), 2.0);
  ASSERT_EQ(peer_messages.size(), 3u);
  for (const auto& m : peer_messages) EXPECT_TRUE(contains(m, "rank 2 failed: boom at 42")) << m;
}

TEST(LocalErrors, NonWeftExceptionsAreReportedToo) {
  const std::string msg = error_message([] {
    run_local(2, [](Communicator& comm) {
      if (comm.rank() == 1) throw std::runtime_error("plain failure");
      comm.barrier();
    }, CommOptions{30s});
  });
  EXPECT_EQ(msg, "rank 1: plain failure");
}

TEST(LocalErrors, SplitRejectsABadPartition) {
  auto world = make_local_world(3, kQuick);
  Communicator& comm = *world[0];
  std::string msg = error_message([&] { comm.split({{0, 1}}, "tp"); });
  EXPECT_TRUE(contains(msg, "split 'tp' of world: rank 2 is in no group")) << msg;
  msg = error_message([&] { comm.split({{0, 1}, {1, 2}}, "tp"); });
  EXPECT_TRUE(contains(msg, "rank 1 is in more than one group")) << msg;
  msg = error_message([&] { comm.split({{0, 3}, {1, 2}}, "tp"); });
  EXPECT_TRUE(contains(msg, "rank 3 is outside [0, 3)")) << msg;
  msg = error_message([&] { comm.split({{0, 1, 2}, {}}, "tp"); });
  EXPECT_TRUE(contains(msg, "group 1 is empty")) << msg;
}

TEST(LocalErrors, BadPeerAndSizesAreRejected) {
  auto world = make_local_world(2, kQuick);
  Tensor t = Tensor::zeros({2});
  EXPECT_TRUE(contains(error_message([&] { world[0]->isend(t, 2, tag(0)); }),
                       "isend peer 2 is outside world of size 2"));
  EXPECT_TRUE(contains(error_message([&] { world[0]->irecv(t, -1, tag(0)); }),
                       "irecv peer -1 is outside world of size 2"));
  Tensor small = Tensor::zeros({3});
  EXPECT_TRUE(contains(error_message([&] { world[0]->all_gather(t, small); }),
                       "must hold 2 x 2 F32 elements"));
  Tensor bf = Tensor::zeros({2}, DType::BF16);
  EXPECT_TRUE(contains(error_message([&] { world[0]->all_reduce(bf, ReduceOp::Max); }),
                       "BF16 tensors is not supported"));
}

// await_setup: the deadline of NCCL's non-blocking communicator creation
// (ncclCommInitRankConfig and ncclCommSplit, polled with
// ncclCommGetAsyncError), here with a plain callback in place of the NCCL state.

TEST(AwaitSetup, ReturnsOnceReadyWithoutAborting) {
  int polls = 0, aborts = 0;
  await_setup("set-up", 0, 2, 5000ms, [&] { return ++polls == 3; }, [&] { ++aborts; });
  EXPECT_EQ(polls, 3);
  EXPECT_EQ(aborts, 0);
}

TEST(AwaitSetup, PastTheDeadlineAbortsOnceAndNamesRankGroupAndTimeout) {
  int polls = 0, aborts = 0;
  const auto start = Clock::now();
  try {
    await_setup("NCCL communicator set-up (ncclCommInitRank)", 1, 4, 100ms,
                [&] { return ++polls < 0; }, [&] { ++aborts; });
    FAIL() << "await_setup returned";
  } catch (const CommTimeout& e) {
    EXPECT_EQ(std::string(e.what()),
              "rank 1 of a group of 4: NCCL communicator set-up (ncclCommInitRank) did not "
              "finish within 100 ms (--comm-timeout); aborted");
  }
  EXPECT_EQ(aborts, 1);
  EXPECT_GT(polls, 1);  // it polled until the deadline, not once
  // Sleeps grow to 1 ms, so the deadline passes by at most one sleep and one
  // poll; the upper bound only catches a wait that ignores the deadline.
  const double elapsed = seconds_since(start);
  EXPECT_GE(elapsed, 0.099);
  EXPECT_LT(elapsed, 2.0);
}

TEST(AwaitSetup, AFailedSetupIsAbortedAndItsErrorRethrown) {
  int aborts = 0;
  const std::string msg = error_message([&] {
    await_setup("set-up", 0, 2, 5000ms, [&]() -> bool { throw Error("init failed: system error"); },
                [&] { ++aborts; });
  });
  EXPECT_EQ(msg, "init failed: system error");
  EXPECT_EQ(aborts, 1);
}

}  // namespace
}  // namespace weft
