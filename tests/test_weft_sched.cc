// weft-sched as a user runs it: the JSON, the comparison table, the trace and
// the SVG it writes, one error line for a bad name; per-stage costs from a
// profile (--costs) and the timeline of a trace read back.
#include <weft/local_communicator.h>
#include <weft/partition.h>
#include <weft/pipeline.h>
#include <weft/profile.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "models/gpt.h"
#include "test_util.h"

#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <regex>
#include <sstream>
#include <tuple>

namespace weft {
namespace {

struct Out {
  int code = -1;
  std::string out, err;
};

Out run(const std::string& args) {
  const std::string dir = testing::temp_dir("weft-sched");
  const std::string cmd = std::string(std::getenv("WEFT_SCHED")) + " " + args + " >" + dir +
                          "/out 2>" + dir + "/err";
  const int status = std::system(cmd.c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, testing::read_file(dir + "/out"),
          testing::read_file(dir + "/err")};
}

TEST(WeftSched, SimulateJsonGivesTheClosedForm) {
  Out o = run("simulate --schedule 1f1b --pp 4 --micro-batches 8 --json");
  ASSERT_EQ(o.code, 0) << o.err;
  auto j = nlohmann::json::parse(o.out);
  EXPECT_DOUBLE_EQ(j["step_time"].get<double>(), 3.0 * (8 + 4 - 1));
  EXPECT_NEAR(j["bubble_fraction"].get<double>(), 3.0 / 11.0, 1e-12);
  EXPECT_EQ(j["peak_activations"], nlohmann::json({4, 3, 2, 1}));
}

// plan: the ranked table from FLOPs, fixed dimensions, and one error line
// without costs.
TEST(WeftSched, PlanPrintsTheRankedTable) {
  const std::string shape =
      "plan --num-layers 8 --hidden-size 128 --num-attention-heads 8 --seq-length 64 "
      "--vocab-size 256 --global-batch-size 32 --world-size 8 ";
  Out o = run(shape + "--flops 1e10 --link-latency 1e-4 --bandwidth 5e9 --top 3");
  ASSERT_EQ(o.code, 0) << o.err;
  EXPECT_NE(o.out.find("step ms"), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("(3 shown)"), std::string::npos) << o.out;
  o = run(shape + "--flops 1e10 --tp 2 --pp 2 --schedule zb-h1 --json");
  ASSERT_EQ(o.code, 0) << o.err;
  const auto plans = nlohmann::json::parse(o.out);
  ASSERT_FALSE(plans.empty());
  for (const auto& p : plans) {
    EXPECT_EQ(p["tp"], 2);
    EXPECT_EQ(p["pp"], 2);
    EXPECT_EQ(p["schedule"], "zb-h1");
  }
  // A sharding strategy fixed: every plan runs it (at dp 2 here).
  for (const auto& [strategy, zero1, zero2, zero3] : {std::tuple{"no_shard", false, false, false},
                                                      {"optim", true, false, false},
                                                      {"optim_grads", true, true, false},
                                                      {"optim_grads_params", true, true, true}}) {
    o = run(shape + "--flops 1e10 --tp 2 --pp 2 --json --data-parallel-sharding-strategy " +
            strategy);
    ASSERT_EQ(o.code, 0) << o.err;
    const auto fixed = nlohmann::json::parse(o.out);
    ASSERT_FALSE(fixed.empty()) << strategy;
    for (const auto& p : fixed) {
      EXPECT_EQ(p["zero1"], zero1) << strategy;
      EXPECT_EQ(p["zero2"], zero2) << strategy;
      EXPECT_EQ(p["zero3"], zero3) << strategy;
    }
  }
  // Sequence parallelism: searched at tp > 1, beside each plan without it,
  // with less activation memory; fixed on, every plan runs it; at tp 1 none can.
  bool with = false, without = false;
  for (const auto& p : plans) (p["sequence_parallel"].get<bool>() ? with : without) = true;
  EXPECT_TRUE(with && without);
  for (const auto& p : plans) {
    if (!p["sequence_parallel"].get<bool>()) continue;
    for (const auto& q : plans) {
      if (q["sequence_parallel"].get<bool>() || q["micro_batch"] != p["micro_batch"] ||
          q["recompute"] != p["recompute"] || q["zero1"] != p["zero1"] ||
          q["zero2"] != p["zero2"] || q["zero3"] != p["zero3"])
        continue;
      EXPECT_LT(p["activation_bytes"].get<double>(), q["activation_bytes"].get<double>());
    }
  }
  o = run(shape + "--flops 1e10 --tp 2 --json --sequence-parallel");
  ASSERT_EQ(o.code, 0) << o.err;
  for (const auto& p : nlohmann::json::parse(o.out)) {
    EXPECT_TRUE(p["sequence_parallel"].get<bool>());
    EXPECT_EQ(p["flags"].back(), "--sequence-parallel");
  }
  o = run(shape + "--flops 1e10 --tp 1 --sequence-parallel");
  EXPECT_EQ(o.code, 1);
  EXPECT_NE(o.out.find("--sequence-parallel needs --tensor-model-parallel-size above 1 (got 1)"),
            std::string::npos)
      << o.out;
  o = run(shape + "--flops 1e10 --data-parallel-sharding-strategy zero3");
  EXPECT_EQ(o.code, 1);
  EXPECT_NE(o.err.find("--data-parallel-sharding-strategy 'zero3' must be no_shard, optim, "
                       "optim_grads or optim_grads_params"),
            std::string::npos)
      << o.err;
  // The recipe of --flops: bf16 activations halve the outputs' bytes and
  // add the weights' bf16 copies; fused attention keeps a log-sum-exp, not
  // the T x T probabilities.
  auto one = [&](const std::string& recipe) {
    Out r = run(shape +
                "--flops 1e10 --tp 1 --pp 1 --micro-batch-size 4 "
                "--data-parallel-sharding-strategy no_shard --json " +
                recipe);
    EXPECT_EQ(r.code, 0) << recipe << r.err;
    return r.code == 0 ? nlohmann::json::parse(r.out).at(0) : nlohmann::json::object();
  };
  const auto fp32 = one(""), bf16 = one("--bf16"), fused = one("--bf16 --attention-backend fused");
  EXPECT_LT(bf16["activation_bytes"].get<double>(), fp32["activation_bytes"].get<double>());
  EXPECT_LT(fused["activation_bytes"].get<double>(), bf16["activation_bytes"].get<double>());
  EXPECT_GT(bf16["memory_per_rank"].get<double>() - bf16["activation_bytes"].get<double>(),
            fp32["memory_per_rank"].get<double>() - fp32["activation_bytes"].get<double>());
  o = run(shape + "--flops 1e10 --attention-backend flash");
  EXPECT_EQ(o.code, 1);
  EXPECT_NE(o.err.find("--attention-backend 'flash' is not unfused or fused"), std::string::npos)
      << o.err;
  o = run(shape);
  EXPECT_EQ(o.code, 1);
  EXPECT_NE(o.err.find("plan needs costs: --profile FILE"), std::string::npos) << o.err;
  o = run(shape + "--flops 1e10 --memory 1KiB");
  EXPECT_EQ(o.code, 1);
  EXPECT_NE(o.err.find("no plan fits"), std::string::npos) << o.err;
}

TEST(WeftSched, CompareListsEverySchedule) {
  Out o = run("compare --pp 4 --micro-batches 8");
  ASSERT_EQ(o.code, 0) << o.err;
  for (const char* name : {"gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v"})
    EXPECT_NE(o.out.find(name), std::string::npos) << name << "\n" << o.out;
}

TEST(WeftSched, WritesATraceAndAnSvg) {
  const std::string dir = testing::temp_dir("weft-sched-files");
  Out o = run("simulate --schedule zb-h1 --pp 2 --micro-batches 4 --trace " + dir +
              "/t.json --svg " + dir + "/t.svg");
  ASSERT_EQ(o.code, 0) << o.err;
  auto trace = nlohmann::json::parse(testing::read_file(dir + "/t.json"));
  int complete = 0;
  for (const auto& e : trace["traceEvents"]) complete += e["ph"] == "X";
  EXPECT_GT(complete, 0);
  const std::string svg = testing::read_file(dir + "/t.svg");
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
}

// Every box of a timeline carries its action as a tooltip and as text that
// fits inside it, at sizes people read: at pp 2 and 4 with 8 micro-batches
// (bench/sched_report.py's drawings), 7 px at least even for ZB-V's and
// interleaved 1F1B's half-size chunk boxes.
TEST(WeftSched, EverySvgBoxHasAVisibleLabel) {
  // A box, its tooltip, then its text: x, width, the tooltip's action, the
  // text's x, its font size and its text.
  const std::regex box(
      R"re(<rect class="action [^"]*" x="([0-9.]+)" y="[0-9.]+" width="([0-9.]+)"[^>]*>)re"
      R"re(<title>(\w+) \[[^<]*</title></rect>\n)re"
      R"re(<text class="label" x="([0-9.]+)" y="[0-9.]+" font-size="([0-9.]+)"[^>]*>)re"
      R"re((\w+)</text>)re");
  const std::string dir = testing::temp_dir("weft-sched-labels");
  // Boxes per (stage, micro-batch): F, I and W, or F and B.
  for (const auto& [name, kinds] :
       {std::pair<std::string, int>{"zb-v", 3}, {"interleaved-1f1b", 2}, {"zb-h1", 3},
        {"1f1b", 2}})
    for (int pp : {2, 4}) {
      const std::string at = fmt::format("{} pp {}", name, pp);
      Out o =
          run(fmt::format("simulate --schedule {} --pp {} -m 8 --svg {}/t.svg", name, pp, dir));
      ASSERT_EQ(o.code, 0) << o.err;
      const std::string svg = testing::read_file(dir + "/t.svg");
      const int stages = pp * (name == "zb-v" || name == "interleaved-1f1b" ? 2 : 1);
      const size_t boxes = static_cast<size_t>(8 * stages * kinds);
      size_t rects = 0, labelled = 0;
      for (size_t at_rect = svg.find("<rect"); at_rect != std::string::npos;
           at_rect = svg.find("<rect", at_rect + 1))
        ++rects;
      EXPECT_EQ(rects, boxes) << at;
      const auto end = std::sregex_iterator();
      for (auto it = std::sregex_iterator(svg.begin(), svg.end(), box); it != end; ++it) {
        const std::smatch& m = *it;
        const double x = std::stod(m[1]), width = std::stod(m[2]), text_x = std::stod(m[4]);
        const double font = std::stod(m[5]);
        const std::string action = m[3], label = m[6];
        EXPECT_EQ(label, action) << at;
        EXPECT_GE(font, 7.0) << at << " " << action;
        EXPECT_LE(font, 10.0) << at << " " << action;
        // Sans-serif glyphs: W 0.95 em, digits and other capitals at most 0.62 em.
        double ems = 0;
        for (char ch : label) ems += ch == 'W' ? 0.95 : 0.62;
        EXPECT_LE(font * ems, width) << at << " " << action << " does not fit its box";
        EXPECT_NEAR(text_x, x + width / 2, 0.02) << at << " " << action;
        ++labelled;
      }
      EXPECT_EQ(labelled, boxes) << at;
    }
}

TEST(WeftSched, BadNameIsOneErrorLine) {
  Out o = run("simulate --schedule nope --pp 4 --micro-batches 8");
  EXPECT_EQ(o.code, 1);
  EXPECT_EQ(std::count(o.err.begin(), o.err.end(), '\n'), 1) << o.err;
  EXPECT_NE(o.err.find("'nope'"), std::string::npos) << o.err;
}

// --- train_gpt's vocabulary: --virtual-stages and its defaults ---

nlohmann::json sim_json(const std::string& args) {
  Out o = run("simulate --json " + args);
  EXPECT_EQ(o.code, 0) << args << "\n" << o.err;
  return o.code == 0 ? nlohmann::json::parse(o.out) : nlohmann::json::object();
}

bool one_error_line(const Out& o, const std::string& text) {
  return o.code == 1 && std::count(o.err.begin(), o.err.end(), '\n') == 1 &&
         o.err.find(text) != std::string::npos;
}

// --virtual-stages is train_gpt's name; --chunks and -v still work.
TEST(WeftSched, VirtualStagesAndItsAliases) {
  const std::string base = "--schedule interleaved-1f1b --pp 2 --micro-batches 4 ";
  for (const char* flag : {"--virtual-stages 3", "--chunks 3", "-v 3"}) {
    const auto j = sim_json(base + flag);
    EXPECT_EQ(j["chunks"], 3) << flag;
    Out csv = run("csv " + base + flag);
    ASSERT_EQ(csv.code, 0) << csv.err;
    EXPECT_NE(csv.out.find("5F0"), std::string::npos) << flag << ": stage 5 is chunk 2 of rank 1";
  }
  EXPECT_EQ(sim_json("-s 1f1b --pipeline-model-parallel-size 4 -m 8")["pp"], 4);
  Out v = run("validate " + base + "--virtual-stages 3");
  EXPECT_EQ(v.code, 0) << v.err;
  EXPECT_NE(v.out.find("chunks 3"), std::string::npos) << v.out;
}

// Without --virtual-stages every command runs train_gpt's default: 2 chunks
// for interleaved-1f1b and zb-v, 1 for the others.
TEST(WeftSched, DefaultChunksAreTrainGptsEverywhere) {
  const std::map<std::string, int> chunks = {
      {"gpipe", 1}, {"1f1b", 1}, {"interleaved-1f1b", 2}, {"zb-h1", 1}, {"zb-v", 2}};
  Out compare = run("compare --pp 4 --micro-batches 8");
  ASSERT_EQ(compare.code, 0) << compare.err;
  for (const auto& [name, v] : chunks) {
    EXPECT_EQ(sim_json("--schedule " + name + " --pp 4 --micro-batches 8")["chunks"], v) << name;
    Out check = run("validate --schedule " + name + " --pp 4 --micro-batches 8");
    EXPECT_EQ(check.code, 0) << check.err;
    EXPECT_NE(check.out.find(fmt::format("chunks {},", v)), std::string::npos) << check.out;
    // The compare row: the name, then its chunk count and a step time.
    const size_t row = compare.out.find("\n" + name + " ");
    ASSERT_NE(row, std::string::npos) << compare.out;
    std::istringstream cells(compare.out.substr(row + 1));
    std::string cell_name;
    int cell_chunks = 0;
    cells >> cell_name >> cell_chunks;
    EXPECT_EQ(cell_chunks, v) << compare.out;
  }
  // The same row from simulate and from compare.
  const auto sim = sim_json("--schedule interleaved-1f1b --pp 4 --micro-batches 8");
  EXPECT_NE(compare.out.find(fmt::format("{:.3f}", sim["step_time"].get<double>())),
            std::string::npos)
      << compare.out;
  // compare --virtual-stages sets the chunks of the schedules that run several.
  Out three = run("compare --pp 4 --micro-batches 8 --virtual-stages 3");
  ASSERT_EQ(three.code, 0) << three.err;
  EXPECT_NE(three.out.find("interleaved-1f1b        3"), std::string::npos) << three.out;
  EXPECT_NE(three.out.find("1f1b                    1"), std::string::npos) << three.out;
  EXPECT_NE(three.out.find("zb-v               --virtual-stages 3: zb-v runs exactly 2 chunks"),
            std::string::npos)
      << three.out;
}

TEST(WeftSched, ChunkCountsAScheduleDoesNotRunAreOneErrorLine) {
  for (const char* cmd : {"simulate", "show", "validate", "csv"}) {
    const std::string base = std::string(cmd) + " --pp 2 --micro-batches 4 --schedule ";
    EXPECT_TRUE(one_error_line(run(base + "zb-v --virtual-stages 3"),
                               "--virtual-stages 3: zb-v runs exactly 2 chunks per rank (its V "
                               "shape)"))
        << cmd;
    EXPECT_TRUE(one_error_line(run(base + "zb-v -v 1"), "--virtual-stages 1: zb-v runs exactly 2"))
        << cmd;
    for (const char* name : {"gpipe", "1f1b", "zb-h1"}) {
      EXPECT_TRUE(one_error_line(run(base + name + " --chunks 2"),
                                 fmt::format("--virtual-stages 2: {} runs one chunk per rank",
                                             name)))
          << cmd << " " << name;
      EXPECT_EQ(run(base + name + " --virtual-stages 1").code, 0) << cmd << " " << name;
    }
    EXPECT_TRUE(one_error_line(run(base + "interleaved-1f1b -v 1"),
                               "--virtual-stages 1: interleaved-1f1b runs at least 2 chunks"))
        << cmd;
    EXPECT_TRUE(one_error_line(run(base + "interleaved-1f1b -v 0"),
                               "--virtual-stages 0: chunks per rank must be at least 1"))
        << cmd;
  }
}

// The tables print sizes as people read them; --json keeps exact numbers.
// At 1F1B, pp 2: rank 0 holds 2 micro-batches at most, rank 1 one, and each
// rank sends one message per micro-batch.
TEST(WeftSched, TablesPrintReadableSizes) {
  auto lines = [](const Out& o) {
    std::vector<std::string> out;
    std::istringstream in(o.out);
    for (std::string line; std::getline(in, line);) out.push_back(line);
    return out;
  };
  auto cells = [](const std::string& line) {
    std::vector<std::string> out;
    std::istringstream in(line);
    for (std::string cell; in >> cell;) out.push_back(cell);
    return out;
  };
  struct Case {
    int m;
    double bytes;
    std::string total, peak0, peak1, sent;
  };
  const double mib = 1 << 20;
  for (const Case& c : {Case{4, 88 * mib, "704.0 MiB", "176.0 MiB", "88.0 MiB", "352.0 MiB"},
                        Case{8, 96 * mib, "1.5 GiB", "192.0 MiB", "96.0 MiB", "768.0 MiB"},
                        Case{4, 64, "512 B", "128 B", "64 B", "256 B"},
                        Case{4, 0.5 * 1024, "4.0 KiB", "1.0 KiB", "512 B", "2.0 KiB"}}) {
    const std::string args =
        fmt::format("simulate --schedule 1f1b --pp 2 --micro-batches {} --bytes {}", c.m, c.bytes);
    Out o = run(args);
    ASSERT_EQ(o.code, 0) << o.err;
    EXPECT_EQ(o.out.find("e+"), std::string::npos) << o.out;
    const std::vector<std::string> l = lines(o);
    ASSERT_GE(l.size(), 6u) << o.out;
    // "1f1b 1 <step> <bubble> 2/1 <total>", then the ranks:
    // "<rank> <busy> <bubble> <update> <peak act> <peak bytes> <bytes sent>".
    const auto row = cells(l[1]), rank0 = cells(l[4]), rank1 = cells(l[5]);
    ASSERT_EQ(row.size(), 7u) << l[1];
    EXPECT_EQ(row[5] + " " + row[6], c.total) << o.out;
    ASSERT_EQ(rank0.size(), 9u) << l[4];
    ASSERT_EQ(rank1.size(), 9u) << l[5];
    EXPECT_EQ(rank0[5] + " " + rank0[6], c.peak0) << o.out;
    EXPECT_EQ(rank1[5] + " " + rank1[6], c.peak1) << o.out;
    EXPECT_EQ(rank0[7] + " " + rank0[8], c.sent) << o.out;
    // The JSON is exact.
    const auto j = sim_json(args.substr(std::string("simulate ").size()));
    EXPECT_EQ(j["peak_activation_bytes"], nlohmann::json({2 * c.bytes, c.bytes})) << args;
    EXPECT_EQ(j["bytes_sent"], nlohmann::json({c.m * c.bytes, c.m * c.bytes})) << args;
  }
  // compare's column too.
  Out compare = run(fmt::format("compare --pp 2 --micro-batches 4 --bytes {}", 88 * mib));
  ASSERT_EQ(compare.code, 0) << compare.err;
  EXPECT_NE(compare.out.find("2/1   704.0 MiB\n"), std::string::npos) << compare.out;
}

// show prints the grid, then what its notation means.
TEST(WeftSched, ShowPrintsALegendUnderTheGrid) {
  Out o = run("show --schedule zb-h1 --pp 2 --micro-batches 2");
  ASSERT_EQ(o.code, 0) << o.err;
  const size_t grid = o.out.find("rank 1: "), legend = o.out.find("\n\n2F0 = stage 2");
  ASSERT_NE(legend, std::string::npos) << o.out;
  EXPECT_LT(grid, legend) << o.out;
  for (const char* line : {"  F  forward\n", "  I  backward for the input", "  W  backward for"})
    EXPECT_NE(o.out.find(line, legend), std::string::npos) << line << "\n" << o.out;
  EXPECT_EQ(o.out.find("SEND_F", legend), std::string::npos) << o.out;
  Out lowered = run("show --schedule 1f1b --pp 2 --micro-batches 2 --lowered");
  ASSERT_EQ(lowered.code, 0) << lowered.err;
  for (const char* kind : {"B ", "SEND_F", "RECV_F", "SEND_B", "RECV_B"})
    EXPECT_NE(lowered.out.find(std::string("\n  ") + kind), std::string::npos)
        << kind << "\n" << lowered.out;
}

// --- --costs: per-stage costs as train_gpt --profile writes them ---

// A 2-layer GPT whose embedding skips to the end, cut after block 0 into an
// uneven plan: stage 0 (embed, h.0) is cheap, stage 1 (h.1, ln_f, head)
// dear. Every node costs F 1 ms, I 2 ms and W 0.5 ms, so a stage costs its
// node count times that. The skip makes the boundary two [2, 16, 32] floats.
struct ProfiledPlan {
  nlohmann::json stages;  // stage_costs_json
  std::string path;       // the file --costs reads
};

ProfiledPlan profiled_plan() {
  GptConfig cfg;
  cfg.num_layers = 2, cfg.hidden_size = 32, cfg.num_heads = 4, cfg.seq_length = 16;
  cfg.embedding_skip = true;
  GptModel m = build_gpt(cfg, 2);
  CostModel cost = CostModel::analytic(m.graph);
  for (NodeCost& c : cost.nodes) c.f = 1e-3, c.i = 2e-3, c.w = 0.5e-3;
  int cut = 0;
  while (m.graph.nodes()[static_cast<size_t>(cut)].name != "h.1.ln_1") ++cut;
  PartitionOptions po;
  po.pp = 2;
  const int n = static_cast<int>(m.graph.nodes().size());
  EXPECT_LT(cut, n - cut) << "stage 1 must be the dearer one";
  const StagePlan plan = evaluate_plan(m.graph, cost, po, {0, cut, n}, "by hand");
  ProfiledPlan p;
  p.stages = stage_costs_json(cost, plan, m.graph);
  p.path = testing::temp_dir("weft-sched-costs") + "/costs.json";
  nlohmann::json file = cost_model_json(cost, m.graph);
  file.update(p.stages);
  testing::write_file(p.path, file.dump());
  return p;
}

TEST(WeftSched, StageCostsSumTheNodesOfEachStage) {
  const ProfiledPlan p = profiled_plan();
  const auto& st = p.stages["stages"];
  ASSERT_EQ(st.size(), 2u);
  EXPECT_EQ(p.stages["pp"], 2);
  EXPECT_EQ(p.stages["chunks"], 1);
  EXPECT_EQ(p.stages["partition"], "by hand");
  EXPECT_EQ(st[0]["first"], "embed");
  EXPECT_EQ(st[1]["first"], "h.1.ln_1");
  for (const auto& s : st) {
    const double nodes = s["nodes"].get<double>();
    EXPECT_NEAR(s["f"].get<double>(), nodes * 1e-3, 1e-12);
    EXPECT_NEAR(s["i"].get<double>(), nodes * 2e-3, 1e-12);
    EXPECT_NEAR(s["w"].get<double>(), nodes * 0.5e-3, 1e-12);
    EXPECT_GT(s["stash_bytes"].get<double>(), 0.0);
  }
  // The block's output and the embedding that skips past it: 2 x 2 x 16 x 32 floats.
  EXPECT_EQ(st[0]["boundary_bytes"].get<double>(), 2.0 * 2 * 16 * 32 * 4);
  EXPECT_EQ(st[1]["boundary_bytes"].get<double>(), 0.0);
}

// Timing the update (zero, norm, clip, AdamW at learning rate 0) leaves the
// parameters as they were.
TEST(WeftSched, ProfilingTheUpdateChangesNoParameter) {
  GptConfig cfg;
  cfg.num_layers = 2, cfg.hidden_size = 32, cfg.num_heads = 4, cfg.seq_length = 16;
  GptModel m = build_gpt(cfg, 2);
  init_gpt(m, 7);
  std::vector<std::vector<float>> before;
  for (Param* p : m.graph.params()) {
    before.emplace_back(p->value.data<float>(), p->value.data<float>() + p->value.numel());
    p->grad.data<float>()[0] = 5;  // a stale gradient: the update zeroes it first
  }
  PartitionOptions po;
  po.pp = 2;
  const StagePlan plan = partition(m.graph, CostModel::analytic(m.graph), po);
  const std::vector<double> seconds = profile_updates(m.graph, plan, 2);
  ASSERT_EQ(seconds.size(), 2u);
  for (double t : seconds) EXPECT_GT(t, 0.0);
  const auto params = m.graph.params();
  for (size_t k = 0; k < params.size(); ++k) {
    EXPECT_TRUE(std::equal(before[k].begin(), before[k].end(), params[k]->value.data<float>()))
        << params[k]->name;
    EXPECT_EQ(params[k]->grad.data<float>()[0], 0.0f) << params[k]->name;
  }
}

// The memory a --costs file's "memory" gives (the bytes each action of each
// stage added, measured on one process) is the memory the executor holds
// under any schedule: weft-sched's peak per rank equals the arena bytes two
// pipeline threads held at their peak, byte for byte. ZB-H1 keeps each
// micro-batch until its W, so its rank 1 holds as much as rank 0.
TEST(WeftSched, MemoryFromAProfileIsWhatTheExecutorHolds) {
  GptConfig cfg;
  cfg.num_layers = 4, cfg.hidden_size = 32, cfg.num_heads = 4, cfg.seq_length = 16;
  const int64_t micro = 2, m = 4;
  const TokenData data = testing::best_of_times_tokens(40);
  TokenBatches batches(data, micro * m, cfg.seq_length);
  GptModel model = build_gpt(cfg, micro);
  init_gpt(model, 3);
  PartitionOptions po;
  po.pp = 2;
  const StagePlan plan = partition(model.graph, CostModel::analytic(model.graph), po);
  const std::vector<sched::StageBytes> memory =
      measure_stage_bytes(model.graph, model.io, plan, batches, micro);
  nlohmann::json file = cost_model_json(CostModel::analytic(model.graph), model.graph);
  file.update(stage_costs_json(CostModel::analytic(model.graph), plan, model.graph, {}, memory));
  const std::string path = testing::temp_dir("weft-sched-memory") + "/costs.json";
  testing::write_file(path, file.dump());
  for (const char* name : {"gpipe", "1f1b", "zb-h1"}) {
    Out o = run(fmt::format("simulate --schedule {} --micro-batches {} --costs {} --json", name,
                            m, path));
    ASSERT_EQ(o.code, 0) << o.err;
    const std::vector<double> simulated = nlohmann::json::parse(o.out)["peak_activation_bytes"];
    std::vector<double> held(2);
    const sched::Schedule s = sched::lower(sched::make_schedule(name, 2, static_cast<int>(m)));
    run_local(2, [&](Communicator& comm) {
      GptModel mine = build_gpt(cfg, micro);
      init_gpt(mine, 3);
      TokenBatches b(data, micro * m, cfg.seq_length);
      PipelineExecutor exec(mine.graph, mine.io, plan, s, comm);
      exec.run(b, 0, micro);
      held[static_cast<size_t>(comm.rank())] = exec.peak_bytes();
    });
    EXPECT_EQ(simulated, held) << name;
    if (std::string(name) == "zb-h1") {
      EXPECT_GT(held[1], 1.5 * memory[1].f) << "two held on rank 1";
    }
  }
}

// With stage 1 the bottleneck, 1F1B and GPipe at pp 2 take stage 0's forward,
// then m of stage 1's F + I + W back to back, then stage 0's backward.
TEST(WeftSched, CostsFromAProfileSetTheStepTime) {
  const ProfiledPlan p = profiled_plan();
  const auto& st = p.stages["stages"];
  auto ms = [&](int stage, const char* k) { return 1e3 * st[stage][k].get<double>(); };
  const int m = 4;
  const double expected =
      ms(0, "f") + m * (ms(1, "f") + ms(1, "i") + ms(1, "w")) + ms(0, "i") + ms(0, "w");
  for (const char* name : {"1f1b", "gpipe"}) {
    Out o = run(fmt::format("simulate --schedule {} --pp 2 --micro-batches {} --costs {} --json",
                            name, m, p.path));
    ASSERT_EQ(o.code, 0) << o.err;
    auto j = nlohmann::json::parse(o.out);
    EXPECT_EQ(j["unit"], "ms");
    EXPECT_NEAR(j["step_time"].get<double>(), expected, 1e-9) << name;
    // Forwards out of rank 0, gradients back out of rank 1, one per micro-batch.
    const double boundary = st[0]["boundary_bytes"].get<double>();
    EXPECT_EQ(j["bytes_sent"], nlohmann::json({m * boundary, m * boundary})) << name;
    const bool gpipe = std::string(name) == "gpipe";
    const int held0 = gpipe ? m : 2, held1 = gpipe ? m : 1;
    EXPECT_EQ(j["peak_activation_bytes"],
              nlohmann::json({held0 * st[0]["stash_bytes"].get<double>(),
                              held1 * st[1]["stash_bytes"].get<double>()}))
        << name;
  }
  // The same total work spread evenly runs faster: the uneven cut is what costs.
  const double total = ms(0, "f") + ms(1, "f");
  Out even = run(fmt::format("simulate --schedule 1f1b --pp 2 --micro-batches {} --cost-f {} "
                             "--cost-i {} --cost-w {} --json",
                             m, total / 2, total, total / 4));
  ASSERT_EQ(even.code, 0) << even.err;
  EXPECT_LT(nlohmann::json::parse(even.out)["step_time"].get<double>(), expected - 1.0);
}

// --compute-scale stretches F, I and W, not the update; the update is the
// slowest rank's, paid once after the pipeline.
TEST(WeftSched, ComputeScaleAndUpdate) {
  const ProfiledPlan p = profiled_plan();
  auto stages = p.stages;
  stages["stages"][0]["update"] = 0.003;
  stages["stages"][1]["update"] = 0.005;
  const std::string path = testing::temp_dir("weft-sched-update") + "/costs.json";
  testing::write_file(path, stages.dump());
  auto sim = [&](const std::string& file, const std::string& extra) {
    Out o = run("simulate --schedule zb-h1 --pp 2 --micro-batches 4 --json --costs " + file +
                extra);
    EXPECT_EQ(o.code, 0) << o.err;
    return o.code == 0 ? nlohmann::json::parse(o.out) : nlohmann::json::object();
  };
  const auto plain = sim(p.path, ""), doubled = sim(p.path, " --compute-scale 2");
  const auto updated = sim(path, ""), both = sim(path, " --compute-scale 2");
  EXPECT_NEAR(doubled["step_time"].get<double>(), 2 * plain["step_time"].get<double>(), 1e-9);
  EXPECT_NEAR(doubled["bubble_fraction"].get<double>(), plain["bubble_fraction"].get<double>(),
              1e-12);
  EXPECT_EQ(plain["update_time"], 0.0);
  EXPECT_NEAR(updated["update_time"].get<double>(), 5.0, 1e-12);
  EXPECT_NEAR(updated["pipeline_time"].get<double>(), plain["step_time"].get<double>(), 1e-9);
  EXPECT_NEAR(updated["step_time"].get<double>(), plain["step_time"].get<double>() + 5, 1e-9);
  EXPECT_NEAR(both["step_time"].get<double>(), 2 * plain["step_time"].get<double>() + 5, 1e-9);
  EXPECT_NE(run("simulate --schedule zb-h1 --pp 2 --micro-batches 4 --compute-scale 0").err.find(
                "--compute-scale (0) must be a positive number"),
            std::string::npos);
}

TEST(WeftSched, CostsAddLinkLatencyAndBandwidth) {
  const ProfiledPlan p = profiled_plan();
  const std::string base =
      "simulate --schedule gpipe --pp 2 --micro-batches 4 --json --costs " + p.path;
  auto step = [&](const std::string& extra) {
    Out o = run(base + extra);
    EXPECT_EQ(o.code, 0) << o.err;
    return o.code == 0 ? nlohmann::json::parse(o.out)["step_time"].get<double>() : -1.0;
  };
  const double free = step("");
  const double bytes = p.stages["stages"][0]["boundary_bytes"].get<double>();
  // GPipe pays the link once forward and once back on the critical path.
  EXPECT_NEAR(step(" --cost-comm 0.5"), free + 2 * 0.5, 1e-9);
  EXPECT_NEAR(step(fmt::format(" --bandwidth {}", bytes / 0.25)), free + 2 * 0.25, 1e-9);
  // --wake: only the first receive of each hop waits in GPipe, once each way.
  EXPECT_NEAR(step(" --wake 0.75"), free + 2 * 0.75, 1e-9);
  EXPECT_TRUE(one_error_line(run(base + " --wake -1"), "--wake (-1) must be a time, at least 0"));
}

TEST(WeftSched, CompareWithCostsSaysWhichSchedulesDoNotFit) {
  const ProfiledPlan p = profiled_plan();
  Out o = run("compare --pp 2 --micro-batches 4 --costs " + p.path);
  ASSERT_EQ(o.code, 0) << o.err;
  // 1F1B has the file's two stages; ZB-V has four (two chunks per rank).
  EXPECT_NE(o.out.find("1f1b                    1"), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("2 stages, but zb-v at --pp 2 runs pp x chunks = 2 x 2 = 4"),
            std::string::npos)
      << o.out;
}

TEST(WeftSched, BadCostsAreOneErrorLine) {
  const std::string dir = testing::temp_dir("weft-sched-bad-costs");
  const ProfiledPlan p = profiled_plan();
  auto stages = p.stages;
  stages["stages"][1]["f"] = -1;
  testing::write_file(dir + "/negative.json", stages.dump());
  testing::write_file(dir + "/garbled.json", "{\"stages\": [");
  testing::write_file(dir + "/nodes-only.json", R"({"unit": "seconds", "nodes": []})");
  stages = p.stages;
  stages["stages"][0].erase("i");
  testing::write_file(dir + "/no-i.json", stages.dump());
  const std::pair<std::string, std::string> cases[] = {
      {dir + "/missing.json", "cannot open"},
      {dir + "/garbled.json", "not valid JSON"},
      {dir + "/nodes-only.json", "no \"stages\" list"},
      {dir + "/negative.json", "stages[1].f = -1 must be finite and not negative"},
      {dir + "/no-i.json", "stages[0] has no number \"i\""},
  };
  for (const auto& [file, rule] : cases) {
    Out o = run("simulate --schedule 1f1b --pp 2 --micro-batches 4 --costs " + file);
    EXPECT_EQ(o.code, 1) << file;
    EXPECT_EQ(std::count(o.err.begin(), o.err.end(), '\n'), 1) << o.err;
    EXPECT_NE(o.err.find(file), std::string::npos) << o.err;
    EXPECT_NE(o.err.find(rule), std::string::npos) << o.err;
  }
  // Two stages do not fit four: a file that does not say its layout.
  stages = p.stages;
  stages.erase("pp");
  stages.erase("chunks");
  testing::write_file(dir + "/no-layout.json", stages.dump());
  Out o = run("simulate --schedule 1f1b --pp 4 --micro-batches 4 --costs " + dir +
              "/no-layout.json");
  EXPECT_TRUE(one_error_line(o, "2 stages, but 1f1b at --pp 4 runs pp x chunks = 4 x 1 = 4"))
      << o.err;
  // Nor can a file whose layout is not its stage count.
  stages = p.stages;
  stages["chunks"] = 2;
  testing::write_file(dir + "/two-chunks.json", stages.dump());
  o = run("simulate --schedule 1f1b --pp 2 --micro-batches 4 --costs " + dir + "/two-chunks.json");
  EXPECT_TRUE(one_error_line(o, "2 stages, but its pp x chunks = 2 x 2 = 4")) << o.err;
  stages["chunks"] = 0;
  testing::write_file(dir + "/zero-chunks.json", stages.dump());
  o = run("simulate --schedule 1f1b --pp 2 --micro-batches 4 --costs " + dir + "/zero-chunks.json");
  EXPECT_TRUE(one_error_line(o, "\"chunks\" is 0, not a whole number at least 1")) << o.err;
  // Uniform costs and a profile cannot both say what F costs.
  EXPECT_NE(run("simulate --schedule 1f1b --pp 2 --micro-batches 4 --cost-f 2 --costs " + p.path)
                .code,
            0);
}

// The plan's two stages, repeated to the stages of `pp` ranks x `chunks`,
// as a --costs file that says its layout. Stage k's F is k + 1 ms, so a
// schedule built at other sizes would not take the same time.
std::string costs_file(const ProfiledPlan& p, int pp, int chunks) {
  nlohmann::json file = p.stages;
  file["pp"] = pp;
  file["chunks"] = chunks;
  file["stages"] = nlohmann::json::array();
  for (int k = 0; k < pp * chunks; ++k) {
    nlohmann::json stage = p.stages["stages"][static_cast<size_t>(k % 2)];
    stage["f"] = 1e-3 * (k + 1);
    file["stages"].push_back(stage);
  }
  const std::string path =
      testing::temp_dir(fmt::format("weft-sched-pp{}-v{}", pp, chunks)) + "/costs.json";
  testing::write_file(path, file.dump());
  return path;
}

// Without --pp and --virtual-stages, simulate and compare run the layout the
// costs were profiled at: 3 chunks is not interleaved-1f1b's default.
TEST(WeftSched, CostsFileGivesPpAndChunks) {
  const ProfiledPlan p = profiled_plan();
  const std::string three = costs_file(p, 2, 3);
  const auto j = sim_json("--schedule interleaved-1f1b --micro-batches 4 --costs " + three);
  EXPECT_EQ(j["pp"], 2);
  EXPECT_EQ(j["chunks"], 3);
  // The same as naming the layout, and the file's stage times are in it.
  const auto named =
      sim_json("--schedule interleaved-1f1b --pp 2 -v 3 --micro-batches 4 --costs " + three);
  EXPECT_EQ(j["step_time"], named["step_time"]);
  EXPECT_GT(j["step_time"].get<double>(), 4 * (1.0 + 2 + 3 + 4 + 5 + 6) / 2);
  // zb-v's two chunks from a file at pp 4.
  const auto v = sim_json("--schedule zb-v --micro-batches 8 --costs " + costs_file(p, 4, 2));
  EXPECT_EQ(v["pp"], 4);
  EXPECT_EQ(v["chunks"], 2);

  Out compare = run("compare --micro-batches 4 --costs " + three);
  ASSERT_EQ(compare.code, 0) << compare.err;
  EXPECT_NE(compare.out.find(fmt::format("interleaved-1f1b        3 {:>10.3f}",
                                         j["step_time"].get<double>())),
            std::string::npos)
      << compare.out;
  EXPECT_NE(compare.out.find("6 stages, but 1f1b at --pp 2 runs pp x chunks = 2 x 1 = 2"),
            std::string::npos)
      << compare.out;
}

// A flag that contradicts the file is one error line naming both values.
TEST(WeftSched, CostsFileAndFlagsThatDisagree) {
  const ProfiledPlan p = profiled_plan();
  const std::string three = costs_file(p, 2, 3);
  const std::string base = " --micro-batches 4 --costs " + three;
  for (const char* cmd : {"simulate --schedule interleaved-1f1b", "compare"}) {
    EXPECT_TRUE(one_error_line(run(cmd + base + " --virtual-stages 2"),
                               "--virtual-stages 2 contradicts --costs " + three +
                                   ", which was profiled at 3 chunks per rank"))
        << cmd;
    EXPECT_TRUE(one_error_line(run(cmd + base + " --pp 4"),
                               "--pp 4 contradicts --costs " + three +
                                   ", which was profiled at pp 2"))
        << cmd;
  }
  EXPECT_TRUE(one_error_line(run("simulate --schedule 1f1b" + base),
                             "--costs " + three +
                                 " was profiled at 3 chunks per rank: 1f1b runs one chunk per "
                                 "rank"));
  EXPECT_TRUE(one_error_line(run("simulate --schedule zb-v" + base + " -v 3"),
                             "--virtual-stages 3: zb-v runs exactly 2 chunks per rank"));
  // Without --costs, or with a file that does not say its pp, --pp is needed.
  EXPECT_TRUE(one_error_line(run("simulate --schedule 1f1b --micro-batches 4"),
                             "--pp (--pipeline-model-parallel-size) is required without --costs"));
  nlohmann::json bare = p.stages;
  bare.erase("pp");
  const std::string path = testing::temp_dir("weft-sched-bare") + "/costs.json";
  testing::write_file(path, bare.dump());
  EXPECT_TRUE(one_error_line(run("simulate --schedule 1f1b --micro-batches 4 --costs " + path),
                             "--pp is required: --costs " + path + " does not say the pp"));
  EXPECT_EQ(run("simulate --schedule 1f1b --pp 2 --micro-batches 4 --costs " + path).code, 0);
}

// --- timeline: a trace read back ---

// A simulated trace, read back as if measured, gives the simulation's numbers.
TEST(WeftSched, TimelineOfATraceGivesItsStepAndBubble) {
  const std::string dir = testing::temp_dir("weft-sched-timeline");
  for (const char* name : {"zb-h1", "zb-v", "interleaved-1f1b"}) {
    Out sim = run(fmt::format("simulate --schedule {} --pp 2 --micro-batches 4 "
                              "--cost-f 1 --cost-i 1.5 --cost-w 0.5 --cost-comm 0.25 --json "
                              "--trace {}/t.json",
                              name, dir));
    ASSERT_EQ(sim.code, 0) << sim.err;
    Out back = run("timeline --json --from-trace " + dir + "/t.json --svg " + dir + "/t.svg");
    ASSERT_EQ(back.code, 0) << back.err;
    auto s = nlohmann::json::parse(sim.out), b = nlohmann::json::parse(back.out);
    EXPECT_EQ(b["unit"], "ms");
    EXPECT_EQ(b["chunks"], s["chunks"]) << name;
    EXPECT_EQ(b["micro_batches"], 4) << name;
    EXPECT_NEAR(b["step_time"].get<double>(), s["step_time"].get<double>(), 1e-9) << name;
    EXPECT_NEAR(b["bubble_fraction"].get<double>(), s["bubble_fraction"].get<double>(), 1e-9)
        << name;
    EXPECT_EQ(b["peak_activations"], s["peak_activations"]) << name;
    const std::string svg = testing::read_file(dir + "/t.svg");
    EXPECT_NE(svg.find(" ms, bubble"), std::string::npos) << name;
  }
}

TEST(WeftSched, TimelineErrorsNameTheFileAndTheStep) {
  const std::string dir = testing::temp_dir("weft-sched-timeline-bad");
  ASSERT_EQ(run("simulate --schedule 1f1b --pp 2 --micro-batches 2 --trace " + dir + "/t.json")
                .code,
            0);
  Out o = run("timeline --from-trace " + dir + "/t.json --step 3");
  EXPECT_EQ(o.code, 1);
  EXPECT_NE(o.err.find("no step 3; it holds steps 1 to 1"), std::string::npos) << o.err;
  testing::write_file(dir + "/empty.json", R"({"traceEvents": []})");
  o = run("timeline --from-trace " + dir + "/empty.json");
  EXPECT_EQ(o.code, 1);
  EXPECT_NE(o.err.find("no complete"), std::string::npos) << o.err;
}

}  // namespace
}  // namespace weft
