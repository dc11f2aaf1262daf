// The timed simulator against the closed forms of the pipeline literature
// (F = I = W = 1, free communication), plus communication, memory, errors and
// the trace and SVG writers.
#include <weft/error.h>
#include <weft/simulate.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "test_util.h"

#include <map>
#include <set>

namespace weft::sched {
namespace {

using testing::contains;
using testing::error_message;

SimResult unit(const Schedule& s, double comm = 0) {
  return simulate(s, uniform_cost(s, 1, 1, 1, comm));
}

// Idle time summed over ranks, in cost units.
double idle(const SimResult& r) {
  double busy = 0;
  for (double b : r.busy) busy += b;
  return r.step_time * static_cast<double>(r.busy.size()) - busy;
}

size_t count(const std::string& text, const std::string& part) {
  size_t n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

// --- closed forms ---

TEST(Simulate, GpipeAnd1f1bBubbleIsPpMinus1OverMPlusPpMinus1) {
  for (int p : {1, 2, 3, 4, 8})
    for (int m = 1; m <= 16; ++m)
      for (const Schedule& s : {gpipe(p, m), one_f_one_b(p, m)}) {
        const std::string at = fmt::format("{} p={} m={}", s.name, p, m);
        const SimResult r = unit(s);
        const double expected = (p - 1.0) / (m + p - 1.0);
        EXPECT_DOUBLE_EQ(r.step_time, 3.0 * (m + p - 1)) << at;
        EXPECT_NEAR(r.bubble_fraction, expected, 1e-12) << at;
        // Every rank does the same work, so each idles the same share.
        for (double b : r.rank_bubble) EXPECT_NEAR(b, expected, 1e-12) << at;
        // Free messages change nothing once lowered.
        EXPECT_DOUBLE_EQ(unit(lower(s)).step_time, r.step_time) << at;
      }
}

TEST(Simulate, InterleavedBubbleShrinksByTheChunks) {
  for (int p : {2, 3, 4, 8})
    for (int v : {2, 3})
      for (int m = p; m <= 16; m += p) {
        const std::string at = fmt::format("p={} m={} v={}", p, m, v);
        const SimResult r = unit(interleaved_1f1b(p, m, v));
        EXPECT_NEAR(r.bubble_fraction, (p - 1.0) / (v * m + p - 1.0), 1e-12) << at;
      }
}

// ZB-H1's bubble is (p - 1)(F + I - W) against 1F1B's (p - 1)(F + I + W): a
// third with unit costs. Tolerance: +-0.05 of the ratio of idle times, which
// the exact third meets with room; the fraction itself is compared loosely
// because the step shrinks along with the bubble.
TEST(Simulate, ZbH1BubbleIsAboutAThirdOf1f1bs) {
  for (int p : {2, 3, 4, 8})
    for (int m = p; m <= 16; ++m) {
      const std::string at = fmt::format("p={} m={}", p, m);
      const SimResult h1 = unit(zb_h1(p, m)), one_f = unit(one_f_one_b(p, m));
      EXPECT_NEAR(idle(h1) / idle(one_f), 1.0 / 3.0, 0.05) << at;
      EXPECT_LT(h1.bubble_fraction, 0.5 * one_f.bubble_fraction) << at;
      // Its deferred Ws hold what F saved: every rank reaches 1F1B's rank 0.
      EXPECT_EQ(h1.peak_activations, std::vector<int>(static_cast<size_t>(p), p)) << at;
      EXPECT_EQ(one_f.peak_activations[0], p) << at;
    }
}

TEST(Simulate, ZbVBeatsZbH1) {
  for (int p : {2, 3, 4, 8})
    for (int m = p; m <= 16; ++m)
      EXPECT_LE(unit(zb_v(p, m)).step_time, unit(zb_h1(p, m)).step_time + 1e-12)
          << "p=" << p << " m=" << m;
}

// --- memory ---

TEST(Simulate, PeakActivations1f1bHoldsPpGpipeHoldsM) {
  for (int p : {1, 2, 4, 8})
    for (int m : {1, p, 2 * p + 1}) {
      const std::string at = fmt::format("p={} m={}", p, m);
      const SimResult g = unit(gpipe(p, m)), o = unit(one_f_one_b(p, m));
      EXPECT_EQ(g.peak_activations, std::vector<int>(static_cast<size_t>(p), m)) << at;
      EXPECT_EQ(o.peak_activations[0], std::min(p, m)) << at;
      EXPECT_EQ(o.peak_activations, peak_in_flight(one_f_one_b(p, m))) << at;
      // One byte per stash with uniform_cost's default size.
      EXPECT_DOUBLE_EQ(o.peak_activation_bytes[0], std::min(p, m)) << at;
    }
}

// --- uneven stages and communication ---

TEST(Simulate, TheSlowestStageDominates) {
  for (const char* name : {"gpipe", "1f1b", "zb-h1"})
    for (int slow : {0, 2, 3}) {
      const int p = 4, m = 8;
      const Schedule s = make_schedule(name, p, m);
      SimCost c = uniform_cost(s, 1, 1, 1);
      c.f[static_cast<size_t>(slow)] = 2;
      c.i[static_cast<size_t>(slow)] = 3;
      c.w[static_cast<size_t>(slow)] = 4;
      const SimResult r = simulate(s, c);
      const std::string at = fmt::format("{} slow stage {}", name, slow);
      EXPECT_GE(r.step_time, m * (2.0 + 3.0 + 4.0)) << at;
      EXPECT_LT(r.rank_bubble[static_cast<size_t>(slow)], r.bubble_fraction) << at;
    }
}

TEST(Simulate, LoweredMessagesCostWhatUnloweredLinksCost) {
  for (const std::string& name : schedule_names()) {
    const Schedule s = make_schedule(name, 4, 8, 2);
    const SimResult plain = unit(s, 0.5), lowered = unit(lower(s), 0.5);
    EXPECT_DOUBLE_EQ(lowered.step_time, plain.step_time) << name;
    EXPECT_EQ(lowered.bytes_sent, plain.bytes_sent) << name;
    EXPECT_GT(plain.step_time, unit(s).step_time) << name;
  }
}

TEST(Simulate, GpipePaysTheLinkOncePerHopEachWay) {
  for (int p : {2, 4})
    for (double c : {0.25, 2.0})
      EXPECT_DOUBLE_EQ(unit(lower(gpipe(p, 6)), c).step_time, 3.0 * (6 + p - 1) + 2 * (p - 1) * c)
          << "p=" << p << " c=" << c;
}

// A receive that finds its message not there yet ends a wake after it
// arrives. In GPipe only the first message of each hop, each way, is waited
// for (the rank behind then lags by the wake, so the rest are there in
// time): the link's formula with the wake for the link.
TEST(Simulate, AReceiveThatWaitedCostsAWake) {
  for (int p : {2, 4})
    for (double wake : {0.25, 2.0}) {
      const Schedule s = lower(gpipe(p, 6));
      SimCost c = uniform_cost(s, 1, 1, 1);
      c.wake = wake;
      EXPECT_DOUBLE_EQ(simulate(s, c).step_time, 3.0 * (6 + p - 1) + 2 * (p - 1) * wake)
          << "p=" << p << " wake=" << wake;
    }
}

TEST(Simulate, BytesAndBandwidth) {
  const Schedule s = lower(one_f_one_b(4, 8));
  SimCost c = uniform_cost(s, 1, 1, 1, 0, 3);
  const SimResult r = simulate(s, c);
  // Forward out of every rank but the last, gradients out of all but rank 0.
  EXPECT_EQ(r.bytes_sent, (std::vector<double>{24, 48, 48, 24}));
  EXPECT_EQ(r.messages.size(), 2u * 3 * 8);
  c.bandwidth = 6;  // half a unit per message, as a latency of 0.5 would be
  const SimCost latency = uniform_cost(s, 1, 1, 1, 0.5, 3);
  EXPECT_DOUBLE_EQ(simulate(s, c).step_time, simulate(s, latency).step_time);
}

TEST(Simulate, SendsWithoutOverlapOccupyTheSender) {
  const Schedule s = lower(one_f_one_b(4, 8));
  SimCost c = uniform_cost(s, 1, 1, 1, 0.5);
  const double overlapped = simulate(s, c).step_time;
  c.overlap = false;
  EXPECT_GT(simulate(s, c).step_time, overlapped);
}

// --- the update after the pipeline, stash bytes, measured timelines ---

TEST(Simulate, UpdateIsTheSlowestRanksAfterThePipeline) {
  const Schedule s = lower(interleaved_1f1b(2, 4, 2));  // rank 0: stages 0, 2; rank 1: 1, 3
  SimCost c = uniform_cost(s, 1, 1, 1);
  const SimResult plain = simulate(s, c);
  c.update = {0.5, 2, 1, 0.25};
  const SimResult r = simulate(s, c);
  EXPECT_EQ(r.update, (std::vector<double>{1.5, 2.25}));
  EXPECT_DOUBLE_EQ(r.update_time, 2.25);
  EXPECT_DOUBLE_EQ(r.pipeline_time, plain.step_time);
  EXPECT_DOUBLE_EQ(r.step_time, plain.step_time + 2.25);
  // The bubble is the pipeline's, as the executor measures it.
  EXPECT_DOUBLE_EQ(r.bubble_fraction, plain.bubble_fraction);
  const std::string svg = timeline_svg(s, r);
  EXPECT_EQ(count(svg, "<title>update"), 2u);
  EXPECT_EQ(count(svg, "<rect"), 4u * 2 * 4) << "compute boxes only";
  const nlohmann::json trace = nlohmann::json::parse(chrome_trace(s, r));
  size_t updates = 0;
  for (const auto& e : trace["traceEvents"])
    if (e.value("name", "") == "update") {
      ++updates;
      EXPECT_DOUBLE_EQ(e["ts"].get<double>(), 1000 * r.last_end);
    }
  EXPECT_EQ(updates, 2u);
  c.update = {1, 2};
  EXPECT_TRUE(contains(error_message([&] { simulate(s, c); }),
                       "cost update has 2 entries, not one per stage (4)"));
}

TEST(Simulate, StashBytesAreWhatAStashHoldsNotWhatCrosses) {
  const Schedule s = lower(one_f_one_b(2, 4));
  SimCost c = uniform_cost(s, 1, 1, 1, 0, 3);  // 3 bytes cross each boundary
  c.stash_bytes = {100, 10};
  const SimResult r = simulate(s, c);
  EXPECT_EQ(r.peak_activations, (std::vector<int>{2, 1}));
  EXPECT_EQ(r.peak_activation_bytes, (std::vector<double>{200, 10}));
  EXPECT_EQ(r.bytes_sent, (std::vector<double>{12, 12}));
}

// A measured timeline summarised: the same numbers as the simulation it copies.
TEST(Simulate, SummarizeATimelineAsSimulateDoes) {
  for (const std::string& name : schedule_names()) {
    const Schedule s = lower(make_schedule(name, 4, 8, 2));
    SimCost c = uniform_cost(s, 1, 2, 0.5, 0.25, 4);
    c.update.assign(static_cast<size_t>(s.stages()), 0.125);
    const SimResult sim = simulate(s, c);
    const SimResult r = summarize(s, sim.times, c);
    EXPECT_DOUBLE_EQ(r.step_time, sim.step_time) << name;
    EXPECT_DOUBLE_EQ(r.bubble_fraction, sim.bubble_fraction) << name;
    EXPECT_EQ(r.rank_bubble, sim.rank_bubble) << name;
    EXPECT_EQ(r.peak_activations, sim.peak_activations) << name;
    EXPECT_EQ(r.peak_activation_bytes, sim.peak_activation_bytes) << name;
    EXPECT_EQ(r.bytes_sent, sim.bytes_sent) << name;
  }
  const Schedule s = lower(one_f_one_b(2, 2));
  std::vector<std::vector<ActionTime>> short_times = unit(s).times;
  short_times[1].pop_back();
  EXPECT_TRUE(contains(error_message([&] { summarize(s, short_times); }),
                       "rank 1 has " + std::to_string(s.actions[1].size() - 1) + " times for " +
                           std::to_string(s.actions[1].size()) + " actions"));
}

// --- errors ---

// --- ranks that share cores ---

TEST(SharedCores, EachProcessGetsItsShareOfTheBusiestCore) {
  EXPECT_DOUBLE_EQ(core_share(2, 2), 1);
  EXPECT_DOUBLE_EQ(core_share(3, 2), 0.5);   // 2 on one core, 1 on the other
  EXPECT_DOUBLE_EQ(core_share(4, 2), 0.5);
  EXPECT_DOUBLE_EQ(core_share(5, 2), 1.0 / 3);
  EXPECT_DOUBLE_EQ(core_share(8, 2), 0.25);  // where n divides evenly, cores / n
  EXPECT_DOUBLE_EQ(core_share(8, 0), 1);     // 0: a core each
}

TEST(SharedCores, MakespanClosedForms) {
  EXPECT_DOUBLE_EQ(shared_makespan({1, 1, 1, 1}, 2), 2);  // 4 units of work on 2 cores
  // 1 core: both at half speed until the short job ends at 2, then 1 left alone.
  EXPECT_DOUBLE_EQ(shared_makespan({2, 1}, 1), 3);
  // 2 cores, 3 jobs: the busiest core holds 2, so half speed to t = 2 (job 1
  // done), then a core each: 3, 4.
  EXPECT_DOUBLE_EQ(shared_makespan({1, 2, 3}, 2), 4);
  EXPECT_DOUBLE_EQ(shared_makespan({1, 2, 3}, 3), 3);   // a core each
  EXPECT_DOUBLE_EQ(shared_makespan({1, 2, 3}, 0), 3);   // 0: a core per process
  EXPECT_DOUBLE_EQ(shared_makespan({3, 3}, 0.5), 12);   // half a core for 6 units
  EXPECT_DOUBLE_EQ(shared_makespan({}, 2), 0);
}

// With at least a core per rank nobody slows down: the event loop gives the
// sweep's timeline, lowered or not, with communication.
TEST(SharedCores, EnoughCoresIsTheUnsharedTimeline) {
  for (const std::string& name : schedule_names())
    for (int pp : {2, 4}) {
      const Schedule s = lower(make_schedule(name, pp, 8, default_chunks(name)));
      SimCost c = uniform_cost(s, 1, 1.3, 0.7, 0.25, 1);
      c.update.assign(static_cast<size_t>(s.stages()), 0.5);
      const SimResult base = simulate(s, c);
      c.cores = pp;
      const SimResult shared = simulate(s, c);
      ASSERT_NEAR(shared.step_time, base.step_time, 1e-9 * base.step_time) << name << " pp " << pp;
      for (size_t r = 0; r < base.times.size(); ++r)
        for (size_t i = 0; i < base.times[r].size(); ++i) {
          ASSERT_NEAR(shared.times[r][i].start, base.times[r][i].start, 1e-9) << name;
          ASSERT_NEAR(shared.times[r][i].end, base.times[r][i].end, 1e-9) << name;
        }
    }
}

// One core and free messages: some rank can always compute (a rank waits
// only on another's compute), so the core never idles and the pipeline
// takes exactly the sum of all the work, whatever the schedule.
TEST(SharedCores, OneCoreTakesTheSumOfAllWork) {
  for (const std::string& name : schedule_names())
    for (int pp : {2, 4})
      for (int m : {4, 8}) {
        const Schedule s = lower(make_schedule(name, pp, m, default_chunks(name)));
        SimCost c = uniform_cost(s, 1, 1.5, 0.5);
        c.cores = 1;
        const double total = static_cast<double>(pp * m) * (1 + 1.5 + 0.5);
        EXPECT_NEAR(simulate(s, c).pipeline_time, total, 1e-9 * total)
            << name << " pp " << pp << " m " << m;
      }
}

// A single micro-batch runs one rank at a time: 2 cores are enough for
// pp 4, and 2 processes per rank still fit; on 1 core they take twice as
// long. The update is every process at once.
TEST(SharedCores, OneMicroBatchRunsOneRankAtATime) {
  const Schedule s = gpipe(4, 1);
  SimCost c = uniform_cost(s, 1, 1, 1);
  c.update.assign(4, 1);
  c.cores = 2;
  SimResult r = simulate(s, c);
  EXPECT_DOUBLE_EQ(r.pipeline_time, 4 * 1 + 4 * 2);
  EXPECT_DOUBLE_EQ(r.update_time, 2);  // 4 updates of 1 on 2 cores
  c.processes_per_rank = 2;
  r = simulate(s, c);
  EXPECT_DOUBLE_EQ(r.pipeline_time, 12);
  EXPECT_DOUBLE_EQ(r.update_time, 4);  // 8 updates on 2 cores
  c.cores = 1;
  EXPECT_DOUBLE_EQ(simulate(s, c).pipeline_time, 24);
}

// GPipe at pp 2 on one core, F = 1 and B = 2, 2 micro-batches: F0 runs
// alone (0-1); then rank 0's F1 and rank 1's F0 split the core and both end
// at 3; the whole step is all the work, 2 x 2 x 3.
TEST(SharedCores, TwoRanksOnOneCoreSplitIt) {
  const Schedule s = gpipe(2, 2);
  SimCost c = uniform_cost(s, 1, 1, 1);
  c.cores = 1;
  const SimResult r = simulate(s, c);
  EXPECT_DOUBLE_EQ(r.times[0][0].end, 1);  // 0F0 alone
  EXPECT_DOUBLE_EQ(r.times[0][1].end, 3);  // 0F1 shared with 1F0
  EXPECT_DOUBLE_EQ(r.times[1][0].end, 3);  // 1F0
  EXPECT_DOUBLE_EQ(r.pipeline_time, 2 * 2 * 3);
}

// The wait inside an action (a tensor-parallel collective) takes no core:
// one rank of 2 processes on 1 core, F = 1 + a wait of 0.5, B = I + W = 2
// + a wait of 0.5. Computing, the 2 processes share the core (half speed);
// waiting, they do not slow down.
TEST(SharedCores, WaitsInsideAnActionTakeNoCore) {
  const Schedule s = gpipe(1, 2);
  SimCost c = uniform_cost(s, 1, 1, 1);
  c.f_wait = {0.5};
  c.i_wait = {0.5};
  EXPECT_DOUBLE_EQ(simulate(s, c).pipeline_time, 2 * 1.5 + 2 * 2.5);
  c.cores = 1;
  c.processes_per_rank = 2;
  EXPECT_DOUBLE_EQ(simulate(s, c).pipeline_time, 2 * (2 + 0.5) + 2 * (4 + 0.5));
  c.f_wait = {-1};
  EXPECT_TRUE(contains(error_message([&] { simulate(s, c); }), "f_wait[0] = -1"));
}

TEST(Simulate, ErrorsNameTheValueAndTheRule) {
  const Schedule s = one_f_one_b(2, 2);
  SimCost c = uniform_cost(s, 1, 1, 1);
  c.f.pop_back();
  const std::string sizes = error_message([&] { simulate(s, c); });
  EXPECT_TRUE(contains(sizes, "cost f has 1 entries, not one per stage (2)")) << sizes;
  c = uniform_cost(s, 1, 1, 1);
  c.w[1] = -1;
  EXPECT_TRUE(contains(error_message([&] { simulate(s, c); }), "w[1] = -1"));
  const Schedule stuck = from_csv("0F0,0B0,0F1,0B1\n1F0,1F1,1B0,1B1\n");
  const std::string dead = error_message([&] { unit(stuck); });
  EXPECT_TRUE(contains(dead, "cannot finish") && contains(dead, "0B0")) << dead;
  c = uniform_cost(s, 1, 1, 1);
  c.cores = -1;
  EXPECT_TRUE(contains(error_message([&] { simulate(s, c); }), "cores (-1)"));
  c.cores = 1;
  EXPECT_TRUE(contains(error_message([&] { simulate(stuck, uniform_cost(stuck, 1, 1, 1)); }),
                       "cannot finish"));
  SimCost shared_stuck = uniform_cost(stuck, 1, 1, 1);
  shared_stuck.cores = 1;
  EXPECT_TRUE(contains(error_message([&] { simulate(stuck, shared_stuck); }), "cannot finish"));
}

// --- trace and SVG ---

TEST(Trace, ChromeTraceHasAnEventPerActionAndAFlowPerMessage) {
  const Schedule s = lower(zb_v(4, 8));
  const SimResult r = unit(s, 0.25);
  const nlohmann::json trace = nlohmann::json::parse(chrome_trace(s, r));
  ASSERT_TRUE(trace.contains("traceEvents"));
  size_t actions = 0;
  for (const auto& list : s.actions) actions += list.size();
  size_t complete = 0;
  std::map<int, int> flows;  // id -> starts minus finishes
  std::set<int> named;
  for (const auto& e : trace["traceEvents"]) {
    const std::string ph = e.at("ph");
    EXPECT_EQ(e.at("pid"), 0);
    if (ph == "X") {
      ++complete;
      const int tid = e.at("tid");
      ASSERT_TRUE(tid >= 0 && tid < s.pp);
      EXPECT_NO_THROW(Action::parse(e.at("name").get<std::string>())) << e.dump();
      EXPECT_GE(e.at("dur").get<double>(), 0.0);
      EXPECT_GE(e.at("ts").get<double>(), 0.0);
    } else if (ph == "s") {
      ++flows[e.at("id").get<int>()];
    } else if (ph == "f") {
      --flows[e.at("id").get<int>()];
    } else if (ph == "M" && e.at("name") == "thread_name") {
      named.insert(e.at("tid").get<int>());
      EXPECT_EQ(e["args"]["name"], fmt::format("rank {}", e.at("tid").get<int>()));
    }
  }
  EXPECT_EQ(complete, actions);
  EXPECT_EQ(flows.size(), r.messages.size());
  EXPECT_EQ(flows.size(), (actions - 3u * 8 * 8) / 2) << "one flow per SEND and its RECV";
  for (const auto& [id, balance] : flows) EXPECT_EQ(balance, 0) << "flow " << id;
  EXPECT_EQ(named.size(), static_cast<size_t>(s.pp));
}

TEST(Trace, SvgHasOneBoxPerComputeAction) {
  for (const std::string& name : schedule_names()) {
    const Schedule s = lower(make_schedule(name, 4, 8, 2));
    const std::string svg = timeline_svg(s, unit(s));
    size_t compute = 0;
    for (const auto& list : s.actions)
      for (const Action& a : list)
        compute += a.kind == ActionKind::F || a.kind == ActionKind::B || a.kind == ActionKind::I ||
                   a.kind == ActionKind::W;
    EXPECT_TRUE(svg.starts_with("<svg")) << name;
    EXPECT_TRUE(svg.ends_with("</svg>\n")) << name;
    EXPECT_EQ(count(svg, "<rect"), compute) << name;
    EXPECT_EQ(count(svg, "<rect"), count(svg, "</rect>")) << name;
    EXPECT_EQ(count(svg, "<text class=\"label\""), compute) << name << ": a label per box";
    EXPECT_TRUE(contains(svg, "rank 3")) << name;
  }
}

}  // namespace
}  // namespace weft::sched
