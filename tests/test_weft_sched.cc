// weft-sched as a user runs it: the JSON, the comparison table, the trace and
// the SVG it writes, and one error line for a bad name.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "test_util.h"

#include <sys/wait.h>

#include <cmath>
#include <cstdlib>

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

TEST(WeftSched, BadNameIsOneErrorLine) {
  Out o = run("simulate --schedule nope --pp 4 --micro-batches 8");
  EXPECT_EQ(o.code, 1);
  EXPECT_EQ(std::count(o.err.begin(), o.err.end(), '\n'), 1) << o.err;
  EXPECT_NE(o.err.find("'nope'"), std::string::npos) << o.err;
}

}  // namespace
}  // namespace weft
