// Pipeline schedules: every generator over a grid of sizes validates before
// and after lowering, runs each (stage, micro-batch) once, round-trips through
// text and CSV, matches its committed golden CSV, holds the memory it
// promises and, in unit time, has the bubble its paper promises. The
// validator rejects broken schedules with the failing action marked.
//
// WEFT_UPDATE_GOLDEN=1 rewrites tests/schedules/*.csv from the generators.
#include <weft/error.h>
#include <weft/schedule.h>

#include <gtest/gtest.h>

#include "test_util.h"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <tuple>

namespace weft::sched {
namespace {

using testing::contains;
using testing::error_message;

struct Config {
  std::string name;
  int pp, m, chunks;
  std::string label() const { return fmt::format("{} pp={} m={} v={}", name, pp, m, chunks); }
};

// Every (schedule, pp, m, v) the grid covers: pp in {1,2,3,4,8}, m in 1..16
// where the schedule allows it, v in {2,3} for interleaved 1F1B.
std::vector<Config> grid_configs() {
  std::vector<Config> out;
  for (int pp : {1, 2, 3, 4, 8})
    for (int m = 1; m <= 16; ++m) {
      out.push_back({"gpipe", pp, m, 1});
      out.push_back({"1f1b", pp, m, 1});
      out.push_back({"zb-h1", pp, m, 1});
      if (m >= pp) out.push_back({"zb-v", pp, m, 2});
      if (m % pp == 0)
        for (int v : {2, 3}) out.push_back({"interleaved-1f1b", pp, m, v});
    }
  return out;
}

Schedule make(const Config& c) { return make_schedule(c.name, c.pp, c.m, c.chunks); }

bool is_message(ActionKind k) {
  return k == ActionKind::SEND_F || k == ActionKind::RECV_F || k == ActionKind::SEND_B ||
         k == ActionKind::RECV_B;
}

void expect_same(const Schedule& a, const Schedule& b, const std::string& what) {
  EXPECT_EQ(a.pp, b.pp) << what;
  EXPECT_EQ(a.chunks, b.chunks) << what;
  EXPECT_EQ(a.micro_batches, b.micro_batches) << what;
  EXPECT_EQ(a.stage_rank, b.stage_rank) << what;
  EXPECT_EQ(a.actions, b.actions) << what;
}

// --- generation and lowering ---

TEST(Schedules, GeneratedAndLoweredValidateOverTheGrid) {
  for (const Config& c : grid_configs()) {
    const Schedule s = make(c);
    const ValidationResult v = validate(s);
    ASSERT_TRUE(v.ok) << c.label() << "\n" << v.message;
    const ValidationResult lv = validate(lower(s));
    ASSERT_TRUE(lv.ok) << c.label() << " lowered\n" << lv.message;
  }
}

// On NCCL a p2p step is a rendezvous (weft/schedule.h). GPipe, 1F1B and
// ZB-H1 complete that way over the whole grid; interleaved 1F1B does not
// (its lowering has a rank send in one step what the peer receives only
// after sending in its own step what this rank receives later), so
// train_gpt refuses it with NCCL. The stuck steps are named.
TEST(Schedules, GpipeOneFOneBAndZbH1CompleteWithGroupedP2pSteps) {
  for (const Config& c : grid_configs()) {
    if (c.name == "gpipe" || c.name == "1f1b" || c.name == "zb-h1") {
      EXPECT_EQ(check_grouped_p2p(lower(make(c))), "") << c.label();
    }
  }
}

TEST(Schedules, GroupedP2pCheckNamesWhereInterleavedOneFOneBSticks) {
  EXPECT_EQ(check_grouped_p2p(lower(interleaved_1f1b(2, 4, 2))),
            "rank 0 stuck in step 5 (2SEND_B0), rank 1 stuck in step 4 (3SEND_B1 1RECV_F2)");
}

TEST(Schedules, P2pStepsAreTheRunsOfMessages) {
  const std::vector<Action> a = {Action::parse("0F0"), Action::parse("0SEND_F0"),
                                 Action::parse("0RECV_B1"), Action::parse("0B0"),
                                 Action::parse("0SEND_F1"), Action::parse("STEP")};
  EXPECT_EQ(p2p_steps(a), (std::vector<P2pStep>{{1, 3}, {4, 5}}));
  EXPECT_TRUE(p2p_steps({Action::parse("0F0")}).empty());
}

// The check finds the deadlock that grouping prevents: each rank sends
// first and receives in a later step, so on a rendezvous transport each
// rank's send waits for a receive the peer posts only after its own send.
// The same messages in one step per rank complete.
TEST(Schedules, GroupedP2pCheckFindsARendezvousDeadlock) {
  Schedule s = empty_schedule("hand-made", 2, 1);
  s.actions[0] = {Action::parse("0F0"), Action::parse("0SEND_F0"), Action::parse("0F1"),
                  Action::parse("0RECV_B0")};
  s.actions[1] = {Action::parse("1SEND_B0"), Action::parse("1F0"), Action::parse("1RECV_F0")};
  const std::string stuck = check_grouped_p2p(s);
  EXPECT_TRUE(contains(stuck, "rank 0 stuck in step 0 (0SEND_F0)")) << stuck;
  EXPECT_TRUE(contains(stuck, "rank 1 stuck in step 0 (1SEND_B0)")) << stuck;
  s.actions[0].erase(s.actions[0].begin() + 2);
  s.actions[1].erase(s.actions[1].begin() + 1);
  EXPECT_EQ(check_grouped_p2p(s), "");
}

TEST(Schedules, EveryStageAndMicroBatchRunsOncePerKindOnItsRank) {
  for (const Config& c : grid_configs()) {
    const Schedule s = make(c);
    ASSERT_EQ(static_cast<int>(s.stage_rank.size()), s.stages()) << c.label();
    ASSERT_EQ(static_cast<int>(s.actions.size()), c.pp) << c.label();
    std::map<std::tuple<ActionKind, int, int>, int> seen;
    for (int r = 0; r < s.pp; ++r)
      for (const Action& a : s.actions[static_cast<size_t>(r)]) {
        ASSERT_FALSE(is_message(a.kind)) << c.label() << ": generators emit compute only";
        ASSERT_EQ(s.stage_rank[static_cast<size_t>(a.stage)], r) << c.label() << " " << a.str();
        ++seen[{a.kind, a.stage, a.micro_batch}];
      }
    const bool split = c.name == "zb-h1" || c.name == "zb-v";
    for (int st = 0; st < s.stages(); ++st)
      for (int mb = 0; mb < c.m; ++mb) {
        const std::string at = fmt::format("{} stage {} mb {}", c.label(), st, mb);
        EXPECT_EQ((seen[{ActionKind::F, st, mb}]), 1) << at;
        EXPECT_EQ((seen[{ActionKind::B, st, mb}]), split ? 0 : 1) << at;
        EXPECT_EQ((seen[{ActionKind::I, st, mb}]), split ? 1 : 0) << at;
        EXPECT_EQ((seen[{ActionKind::W, st, mb}]), split ? 1 : 0) << at;
      }
    size_t total = 0;
    for (const auto& list : s.actions) total += list.size();
    EXPECT_EQ(total, static_cast<size_t>(s.stages() * c.m * (split ? 3 : 2))) << c.label();
  }
}

TEST(Schedules, StagePlacement) {
  EXPECT_EQ(one_f_one_b(4, 8).stage_rank, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(interleaved_1f1b(2, 4, 3).stage_rank, (std::vector<int>{0, 1, 0, 1, 0, 1}));
  EXPECT_EQ(zb_v(3, 6).stage_rank, (std::vector<int>{0, 1, 2, 2, 1, 0}));
}

TEST(Schedules, LoweringAddsOneMessagePairPerCrossRankBoundary) {
  for (const Config& c : grid_configs()) {
    const Schedule s = make(c);
    const Schedule l = lower(s);
    int crossing = 0;
    for (int st = 0; st + 1 < s.stages(); ++st)
      crossing +=
          s.stage_rank[static_cast<size_t>(st)] != s.stage_rank[static_cast<size_t>(st + 1)];
    size_t compute = 0, messages = 0;
    for (const auto& list : l.actions)
      for (const Action& a : list) (is_message(a.kind) ? messages : compute)++;
    // Forward and gradient, each a send and a receive.
    EXPECT_EQ(messages, static_cast<size_t>(4 * crossing * c.m)) << c.label();
    EXPECT_EQ(compute, static_cast<size_t>(s.stages() * c.m * (c.name.starts_with("zb") ? 3 : 2)))
        << c.label();
  }
}

TEST(Schedules, OneRankNeedsNoMessages) {
  for (const Config& c : grid_configs())
    if (c.pp == 1) expect_same(lower(make(c)), make(c), c.label());
}

TEST(Schedules, LoweringPutsReceivesRightBeforeTheirCompute) {
  const Schedule l = lower(one_f_one_b(4, 8));
  for (const auto& list : l.actions)
    for (size_t i = 0; i < list.size(); ++i) {
      if (list[i].kind != ActionKind::RECV_F && list[i].kind != ActionKind::RECV_B) continue;
      ASSERT_LT(i + 1, list.size());
      const ActionKind consumer =
          list[i].kind == ActionKind::RECV_F ? ActionKind::F : ActionKind::B;
      EXPECT_EQ(list[i + 1], (Action{consumer, list[i].stage, list[i].micro_batch}))
          << list[i].str();
    }
}

TEST(Schedules, LoweringRefusesAScheduleThatHasMessages) {
  const Schedule l = lower(one_f_one_b(2, 2));
  EXPECT_TRUE(contains(error_message([&] { lower(l); }), "already has the message"));
}

// --- text and CSV ---

TEST(Schedules, ActionTextRoundTripsForEveryKind) {
  const std::vector<Action> all = {
      {ActionKind::F, 2, 0},
      {ActionKind::B, 1, 3},
      {ActionKind::I, 0, 1},
      {ActionKind::W, 0, 1},
      {ActionKind::SEND_F, 1, 0},
      {ActionKind::RECV_F, 2, 0},
      {ActionKind::SEND_B, 1, 3},
      {ActionKind::RECV_B, 2, 4},
      {ActionKind::REDUCE_GRAD, 0, -1},
      {ActionKind::REDUCE_TIED, 7, -1},
      {ActionKind::STEP, -1, -1},
      {ActionKind::F, 15, 127},
  };
  for (const Action& a : all) EXPECT_EQ(Action::parse(a.str()), a) << a.str();
  EXPECT_EQ((Action{ActionKind::F, 2, 0}).str(), "2F0");
  EXPECT_EQ((Action{ActionKind::SEND_B, 1, 3}).str(), "1SEND_B3");
  EXPECT_EQ((Action{ActionKind::REDUCE_GRAD, 0, -1}).str(), "0REDUCE_GRAD");
  EXPECT_EQ((Action{ActionKind::STEP, -1, -1}).str(), "STEP");
  EXPECT_EQ(Action::parse("2RECV_B4"), (Action{ActionKind::RECV_B, 2, 4}));
}

TEST(Schedules, ActionParseNamesTheBadText) {
  for (const char* bad : {"", "F0", "2F", "2X0", "2F0x", "2f0", "0STEP", "0REDUCE_GRAD1", "2SEND0",
                          "99999999999F0"}) {
    const std::string msg = error_message([&] { Action::parse(bad); });
    EXPECT_TRUE(contains(msg, fmt::format("'{}'", bad))) << bad << ": " << msg;
  }
}

TEST(Schedules, CsvRoundTripsEverySchedule) {
  for (const Config& c : grid_configs()) {
    const Schedule s = make(c);
    expect_same(from_csv(to_csv(s), s.name), s, c.label());
    const Schedule l = lower(s);
    expect_same(from_csv(to_csv(l), s.name), l, c.label() + " lowered");
  }
}

TEST(Schedules, CsvErrorsNameTheLineAndCell) {
  const std::string bad_cell = error_message([] { from_csv("0F0,0B0\n1F0,1Q0\n"); });
  EXPECT_TRUE(contains(bad_cell, "line 2, cell 2")) << bad_cell;
  EXPECT_TRUE(contains(bad_cell, "1Q0")) << bad_cell;
  const std::string two_ranks = error_message([] { from_csv("0F0,0B0\n0F1,0B1\n"); });
  EXPECT_TRUE(contains(two_ranks, "line 2, cell 1")) << two_ranks;
  EXPECT_TRUE(contains(two_ranks, "stage 0")) << two_ranks;
  const std::string uneven = error_message([] { from_csv("0F0,2F0\n1F0\n"); });
  EXPECT_TRUE(contains(uneven, "3 stages")) << uneven;
  EXPECT_TRUE(contains(error_message([] { from_csv(""); }), "no lines"));
}

// --- golden files ---

bool update_golden() {
  const char* env = std::getenv("WEFT_UPDATE_GOLDEN");
  return env != nullptr && std::string(env) == "1";
}

void expect_golden(const std::string& file, const Schedule& s) {
  const std::string path = testing::source_path("tests/schedules/" + file);
  const std::string now = to_csv(s);
  if (update_golden()) {
    testing::write_file(path, now);
    return;
  }
  EXPECT_EQ(testing::read_file(path), now)
      << file << " differs from the generator; if the change is intended, rerun with "
      << "WEFT_UPDATE_GOLDEN=1 and review the diff";
}

TEST(Schedules, GoldenCsvs) {
  expect_golden("gpipe_pp4_m8.csv", gpipe(4, 8));
  expect_golden("1f1b_pp4_m8.csv", one_f_one_b(4, 8));
  expect_golden("interleaved-1f1b_pp4_m8_v2.csv", interleaved_1f1b(4, 8, 2));
  expect_golden("zb-h1_pp4_m8.csv", zb_h1(4, 8));
  expect_golden("zb-v_pp4_m8.csv", zb_v(4, 8));
  expect_golden("1f1b_pp4_m8_lowered.csv", lower(one_f_one_b(4, 8)));
  expect_golden("zb-v_pp4_m8_lowered.csv", lower(zb_v(4, 8)));
}

// --- memory ---

TEST(Schedules, PeakInFlight) {
  for (int pp : {1, 2, 3, 4, 8})
    for (int m = 1; m <= 16; ++m) {
      const std::string at = fmt::format("pp={} m={}", pp, m);
      const std::vector<int> one_f = peak_in_flight(one_f_one_b(pp, m));
      EXPECT_EQ(peak_in_flight(gpipe(pp, m)), std::vector<int>(static_cast<size_t>(pp), m)) << at;
      for (int r = 0; r < pp; ++r)
        EXPECT_EQ(one_f[static_cast<size_t>(r)], std::min(pp - r, m)) << at;
      // A (stage, micro-batch) is held until its W: ZB-H1's deferred Ws fill
      // every rank up to rank 0's 1F1B peak (and no further, see below).
      EXPECT_EQ(peak_in_flight(zb_h1(pp, m)),
                std::vector<int>(static_cast<size_t>(pp), std::min(pp, m)))
          << at;
      // Recompute keeps a split backward's W apart (folds_weights): the same count.
      EXPECT_FALSE(folds_weights(zb_h1(pp, m), true)) << at;
      EXPECT_TRUE(folds_weights(one_f_one_b(pp, m), true)) << at;
      EXPECT_EQ(peak_in_flight(zb_h1(pp, m), /*recompute=*/true), peak_in_flight(zb_h1(pp, m)))
          << at;
      // With W folded into I, 1F1B's order holds 1F1B's stash.
      EXPECT_EQ(peak_in_flight(one_f_one_b(pp, m), /*recompute=*/true), one_f) << at;
      if (m < pp) continue;
      // Two half-size chunks per rank: 2pp chunk stashes is 1F1B's rank 0.
      for (int peak : peak_in_flight(zb_v(pp, m))) EXPECT_LE(peak, 2 * pp) << at;
    }
}

// ZB-H1 holds back at most r weight gradients on rank r, so forwards whose W
// has not run stay within 1F1B's peak of pp.
TEST(Schedules, ZbH1DefersNoMoreWeightGradientsThanRank0Holds) {
  for (int pp : {2, 4, 8})
    for (int m : {1, pp, 2 * pp + 1}) {
      const Schedule s = zb_h1(pp, m);
      for (int r = 0; r < pp; ++r) {
        int held = 0, peak = 0;
        for (const Action& a : s.actions[static_cast<size_t>(r)]) {
          if (a.kind == ActionKind::F) peak = std::max(peak, ++held);
          if (a.kind == ActionKind::W) --held;
        }
        EXPECT_LE(peak, std::min(pp, m)) << "pp=" << pp << " m=" << m << " rank " << r;
      }
    }
}

// --- validator rejections ---

Schedule without(Schedule s, const std::string& text) {
  for (auto& list : s.actions) std::erase(list, Action::parse(text));
  return s;
}

// Moves `text` on `rank` to just before `before` (or to the front).
Schedule moved(Schedule s, int rank, const std::string& text, const std::string& before = "") {
  auto& list = s.actions[static_cast<size_t>(rank)];
  const Action a = Action::parse(text);
  auto it = std::find(list.begin(), list.end(), a);
  EXPECT_NE(it, list.end()) << text;
  list.erase(it);
  auto at =
      before.empty() ? list.begin() : std::find(list.begin(), list.end(), Action::parse(before));
  list.insert(at, a);
  return s;
}

void expect_rejected(const Schedule& s, const std::vector<std::string>& names) {
  const ValidationResult v = validate(s);
  ASSERT_FALSE(v.ok);
  EXPECT_TRUE(contains(v.message, "<-- ERROR HERE")) << v.message;
  for (const std::string& n : names) EXPECT_TRUE(contains(v.message, n)) << n << "\n" << v.message;
  // The marked cell in the grid is the action the result points at.
  const Action& marked = s.actions[static_cast<size_t>(v.rank)][static_cast<size_t>(v.index)];
  EXPECT_TRUE(contains(v.message, fmt::format("[{}]", marked.str()))) << v.message;
}

TEST(Validate, RejectsAMissingForward) {
  expect_rejected(without(one_f_one_b(2, 4), "1F2"), {"1F2 is missing"});
}

TEST(Validate, RejectsADuplicate) {
  Schedule s = gpipe(2, 2);
  s.actions[1].push_back({ActionKind::B, 1, 0});
  expect_rejected(s, {"1B0 appears 2 times"});
}

TEST(Validate, RejectsAnActionOnTheWrongRank) {
  Schedule s = gpipe(2, 2);
  s.actions[0].push_back({ActionKind::F, 1, 0});
  expect_rejected(s, {"1F0 on rank 0", "held by rank 1"});
}

TEST(Validate, RejectsAWeightGradientBeforeItsInputGradient) {
  expect_rejected(moved(zb_h1(2, 4), 1, "1W0", "1I0"), {"1W0 needs 1I0", "comes later"});
}

TEST(Validate, RejectsABackwardBeforeTheNextStagesBackwardOnOneRank) {
  // Two chunks on one rank: stage 0's backward needs stage 1's, run later.
  expect_rejected(from_csv("0F0,1F0,0B0,1B0\n"), {"0B0 needs 1B0", "comes later"});
}

TEST(Validate, RejectsABackwardBeforeTheNextStagesBackwardAcrossRanks) {
  // Rank 0 wants 1B0 before running 0F1; rank 1 wants 0F1 before 1B0.
  expect_rejected(from_csv("0F0,0B0,0F1,0B1\n1F0,1F1,1B0,1B1\n"),
                  {"deadlock", "rank 0 waits at 0B0", "rank 1 waits at 1F1"});
}

TEST(Validate, RejectsReceivesThatDeadlock) {
  // Both ranks start by receiving: each waits for a send the other never reaches.
  const Schedule s = moved(lower(one_f_one_b(2, 2)), 0, "0RECV_B0");
  ASSERT_EQ(s.actions[1].front(), Action::parse("1RECV_F0"));
  expect_rejected(s, {"deadlock", "rank 0 waits at 0RECV_B0 for 1SEND_B0",
                      "rank 1 waits at 1RECV_F0 for 0SEND_F0"});
  const ValidationResult v = validate(s);
  EXPECT_EQ(std::count(v.message.begin(), v.message.end(), '['), 2) << "both ranks marked";
}

TEST(Validate, RejectsReceivesOutOfTheSendersOrder) {
  expect_rejected(moved(lower(gpipe(2, 3)), 1, "1RECV_F1", "1RECV_F0"),
                  {"1RECV_F1 is rank 1's receive #0", "0SEND_F0", "same order"});
}

TEST(Validate, RejectsAMissingMessage) {
  expect_rejected(without(lower(one_f_one_b(3, 3)), "2SEND_B1"), {"2B1", "no 2SEND_B1"});
}

TEST(Validate, RejectsAMessageBetweenStagesOnOneRank) {
  Schedule s = lower(zb_v(2, 2));
  s.actions[1].insert(s.actions[1].begin() + 2, Action::parse("1SEND_F0"));
  expect_rejected(s, {"1SEND_F0", "no message is needed"});
}

TEST(Validate, RejectsBadSizes) {
  Schedule s = gpipe(2, 2);
  s.stage_rank.pop_back();
  const ValidationResult v = validate(s);
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(contains(v.message, "places 1 stages")) << v.message;
}

TEST(Validate, RenderGridMarksOneAction) {
  const std::string g = render_grid(one_f_one_b(2, 2), 1, 2);
  // Columns line up across ranks: step 2 is as wide as its marked cell.
  EXPECT_TRUE(contains(g, "rank 0: 0F0 0F1 0B0   0B1\n")) << g;
  EXPECT_TRUE(contains(g, "rank 1: 1F0 1B0 [1F1] 1B1  <-- ERROR HERE\n")) << g;
}

// The key printed under the grid names the kinds that appear, and only those.
TEST(Validate, RenderLegendNamesTheKindsThatAppear) {
  const std::string plain = render_legend(one_f_one_b(2, 2));
  EXPECT_TRUE(contains(plain, "2F0 = stage 2 (of pp x chunks, from 0), kind F, micro-batch 0"))
      << plain;
  EXPECT_TRUE(contains(plain, "\n  F  forward\n  B  full backward (I then W)\n")) << plain;
  for (const char* absent : {"  I ", "  W ", "SEND", "RECV"})
    EXPECT_FALSE(contains(plain, absent)) << absent << "\n" << plain;

  const std::string v = render_legend(lower(zb_v(2, 2)));
  for (const char* line :
       {"\n  F       forward\n", "\n  I       backward for the input (the activation gradient)\n",
        "\n  W       backward for the weights\n",
        "\n  SEND_F  send the stage's output to the next stage's rank\n",
        "\n  RECV_F  receive the stage's input from the previous stage's rank\n",
        "\n  SEND_B  send the stage's input gradient to the previous stage's rank\n",
        "\n  RECV_B  receive the stage's output gradient from the next stage's rank\n"})
    EXPECT_TRUE(contains(v, line)) << line << "\n" << v;
  EXPECT_FALSE(contains(v, "  B ")) << v;

  // The names line up under the longest one used.
  Schedule s = empty_schedule("by hand", 1, 1);
  s.actions[0] = {Action::parse("0F0"), Action::parse("0REDUCE_GRAD"), Action::parse("STEP")};
  const std::string wide = render_legend(s);
  EXPECT_TRUE(contains(wide, "\n  F            forward\n")) << wide;
  EXPECT_TRUE(contains(wide, "\n  STEP         optimizer step\n")) << wide;
  EXPECT_TRUE(contains(wide, "\n  REDUCE_GRAD  reduce")) << wide;
}

// --- make_schedule ---

TEST(Registry, NamesAndErrors) {
  EXPECT_EQ(schedule_names(),
            (std::vector<std::string>{"gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v"}));
  for (const std::string& name : schedule_names())
    EXPECT_EQ(make_schedule(name, 2, 4, 2).name, name);

  const std::string unknown = error_message([] { make_schedule("zb-h3", 2, 4); });
  EXPECT_TRUE(contains(unknown, "'zb-h3'")) << unknown;
  EXPECT_TRUE(contains(unknown, "gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-v")) << unknown;
  EXPECT_TRUE(contains(error_message([] { make_schedule("1f1b", 0, 4); }), "pp = 0"));
  EXPECT_TRUE(contains(error_message([] { make_schedule("gpipe", 2, 0); }), "micro-batches (0)"));
  const std::string ragged = error_message([] { make_schedule("interleaved-1f1b", 4, 6, 2); });
  EXPECT_TRUE(contains(ragged, "micro-batches (6)") && contains(ragged, "multiple of pp (4)"))
      << ragged;
  const std::string one_chunk = error_message([] { make_schedule("interleaved-1f1b", 4, 8, 1); });
  EXPECT_TRUE(contains(one_chunk, "chunks per rank (1)")) << one_chunk;
  const std::string few = error_message([] { make_schedule("zb-v", 4, 3); });
  EXPECT_TRUE(contains(few, "micro-batches (3)") && contains(few, "pp (4)")) << few;
  // Schedules with a fixed number of chunks ignore the argument.
  EXPECT_EQ(make_schedule("zb-v", 2, 4, 5).chunks, 2);
  EXPECT_EQ(make_schedule("1f1b", 2, 4, 3).chunks, 1);
}

// The chunk counts weft-sched and train_gpt accept: the default is one the
// generator builds, and every count the rule lets through builds with
// exactly that many chunks.
TEST(Registry, ChunksPerRank) {
  const std::map<std::string, int> defaults = {
      {"gpipe", 1}, {"1f1b", 1}, {"interleaved-1f1b", 2}, {"zb-h1", 1}, {"zb-v", 2}};
  for (const std::string& name : schedule_names()) {
    EXPECT_EQ(default_chunks(name), defaults.at(name)) << name;
    EXPECT_EQ(chunks_rule(name, default_chunks(name)), "") << name;
    EXPECT_EQ(chunks_rule(name, 0), "chunks per rank must be at least 1") << name;
    for (int v = 1; v <= 4; ++v) {
      if (chunks_rule(name, v).empty()) {
        EXPECT_EQ(make_schedule(name, 2, 4, v).chunks, v) << name << " v=" << v;
      }
    }
  }
  EXPECT_EQ(chunks_rule("zb-v", 3), "zb-v runs exactly 2 chunks per rank (its V shape)");
  EXPECT_EQ(chunks_rule("zb-v", 1), "zb-v runs exactly 2 chunks per rank (its V shape)");
  EXPECT_EQ(chunks_rule("interleaved-1f1b", 3), "");
  EXPECT_TRUE(contains(chunks_rule("interleaved-1f1b", 1), "at least 2 chunks per rank"));
  for (const char* name : {"gpipe", "1f1b", "zb-h1"})
    EXPECT_EQ(chunks_rule(name, 2),
              fmt::format("{} runs one chunk per rank; only interleaved-1f1b and zb-v run several",
                          name));
  EXPECT_TRUE(contains(error_message([] { default_chunks("zb-h3"); }), "unknown schedule 'zb-h3'"));
  EXPECT_TRUE(contains(error_message([] { chunks_rule("zb-h3", 1); }), "unknown schedule 'zb-h3'"));
}

// --- unit-time bubbles ---

// Step time with F = I = W = 1 and B = 2 per full stage (a chunk of v costs
// 1/v of that) and free communication: each action starts when its rank is
// free and what it needs is done.
double unit_time(const Schedule& s) {
  const double scale = 1.0 / s.chunks;
  auto cost = [&](ActionKind k) {
    if (k == ActionKind::B) return 2 * scale;
    return k == ActionKind::F || k == ActionKind::I || k == ActionKind::W ? scale : 0.0;
  };
  // End times by (F = 0, B or I = 1, W = 2, stage, micro-batch).
  std::map<std::tuple<int, int, int>, double> end;
  std::vector<size_t> next(s.actions.size(), 0);
  std::vector<double> free(s.actions.size(), 0);
  for (bool moved = true; moved;) {
    moved = false;
    for (size_t r = 0; r < s.actions.size(); ++r)
      for (; next[r] < s.actions[r].size(); ++next[r], moved = true) {
        const Action& a = s.actions[r][next[r]];
        double start = free[r];
        bool ready = true;
        auto need = [&](int kind, int stage, int mb) {
          auto it = end.find({kind, stage, mb});
          if (it == end.end())
            ready = false;
          else
            start = std::max(start, it->second);
        };
        const bool backward = a.kind == ActionKind::B || a.kind == ActionKind::I;
        if (a.kind == ActionKind::F && a.stage > 0) need(0, a.stage - 1, a.micro_batch);
        if (backward) need(0, a.stage, a.micro_batch);
        if (backward && a.stage + 1 < s.stages()) need(1, a.stage + 1, a.micro_batch);
        if (a.kind == ActionKind::W) need(1, a.stage, a.micro_batch);
        if (!ready) break;
        free[r] = start + cost(a.kind);
        const int kind = a.kind == ActionKind::F ? 0 : a.kind == ActionKind::W ? 2 : 1;
        end[{kind, a.stage, a.micro_batch}] = free[r];
      }
  }
  for (size_t r = 0; r < s.actions.size(); ++r)
    EXPECT_EQ(next[r], s.actions[r].size()) << s.name << " stuck on rank " << r;
  return *std::max_element(free.begin(), free.end());
}

// Time a rank spends idle: the step minus its 3 units per micro-batch.
double bubble(const Schedule& s) { return unit_time(s) - 3.0 * s.micro_batches; }

TEST(UnitTime, GpipeAnd1f1bTakeMPlusPpMinus1TimesThree) {
  for (int pp : {1, 2, 3, 4, 8})
    for (int m = 1; m <= 16; ++m) {
      EXPECT_DOUBLE_EQ(unit_time(gpipe(pp, m)), (m + pp - 1) * 3.0) << pp << " " << m;
      EXPECT_DOUBLE_EQ(unit_time(one_f_one_b(pp, m)), (m + pp - 1) * 3.0) << pp << " " << m;
    }
}

TEST(UnitTime, ZbH1CutsTheBubbleToAboutAThird) {
  const double one_f = bubble(one_f_one_b(4, 8)), h1 = bubble(zb_h1(4, 8));
  EXPECT_DOUBLE_EQ(one_f, 9.0);
  EXPECT_LT(unit_time(zb_h1(4, 8)), unit_time(one_f_one_b(4, 8)));
  EXPECT_LT(h1, 0.5 * one_f);
  EXPECT_DOUBLE_EQ(h1, 3.0);  // (pp - 1) x (F + I - W)
  for (int pp : {2, 3, 4, 8})
    for (int m = pp; m <= 16; ++m)
      EXPECT_LT(unit_time(zb_h1(pp, m)), unit_time(one_f_one_b(pp, m))) << pp << " " << m;
}

TEST(UnitTime, InterleavingAndTheVShrinkTheBubbleFurther) {
  const double one_f = bubble(one_f_one_b(4, 8));
  EXPECT_DOUBLE_EQ(bubble(interleaved_1f1b(4, 8, 2)), one_f / 2);
  EXPECT_LT(bubble(zb_v(4, 8)), bubble(zb_h1(4, 8)));
  for (int pp : {2, 3, 4, 8})
    for (int m = pp; m <= 16; ++m)
      EXPECT_LE(unit_time(zb_v(pp, m)), unit_time(zb_h1(pp, m))) << pp << " " << m;
}

}  // namespace
}  // namespace weft::sched
