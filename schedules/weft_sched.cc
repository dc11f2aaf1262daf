// weft-sched — look at pipeline schedules without running one.
//
//   weft-sched list
//   weft-sched show --schedule zb-v --pp 4 --micro-batches 8 [--lowered]
//   weft-sched validate --schedule interleaved-1f1b --pp 4 --micro-batches 8 --chunks 2
//   weft-sched csv --schedule 1f1b --pp 4 --micro-batches 8 > 1f1b.csv
//
// Errors print one line naming the value and the rule it broke, and exit 1.
#include <weft/error.h>
#include <weft/schedule.h>

#include <fmt/core.h>
#include <CLI/CLI.hpp>

#include <string>

namespace {

using namespace weft::sched;

struct Request {
  std::string schedule;
  int pp = 1;
  int micro_batches = 1;
  int chunks = 1;
  bool lowered = false;
};

// The options every schedule-taking subcommand shares.
CLI::App* add_schedule_command(CLI::App& app, const std::string& name,
                               const std::string& description, Request& r) {
  CLI::App* cmd = app.add_subcommand(name, description);
  cmd->add_option("--schedule,-s", r.schedule, "schedule name (see `weft-sched list`)")->required();
  cmd->add_option("--pp,--pipeline-model-parallel-size", r.pp, "pipeline ranks")->required();
  cmd->add_option("--micro-batches,-m", r.micro_batches, "micro-batches per step")->required();
  cmd->add_option("--chunks,-v", r.chunks, "model chunks per rank (interleaved-1f1b)");
  cmd->add_flag("--lowered", r.lowered, "add the sends and receives");
  return cmd;
}

Schedule build(const Request& r) {
  Schedule s = make_schedule(r.schedule, r.pp, r.micro_batches, r.chunks);
  return r.lowered ? lower(s) : s;
}

int run(CLI::App& app, CLI::App* show, CLI::App* validate_cmd, CLI::App* csv, const Request& r) {
  if (app.got_subcommand("list")) {
    for (const std::string& name : schedule_names()) fmt::print("{}\n", name);
    return 0;
  }
  const Schedule s = build(r);
  if (show->parsed()) fmt::print("{}", render_grid(s));
  if (csv->parsed()) fmt::print("{}", to_csv(s));
  if (validate_cmd->parsed()) {
    const ValidationResult v = validate(s);
    if (!v.ok) {
      fmt::print("{}", v.message);
      return 1;
    }
    fmt::print("{} (pp {}, chunks {}, micro-batches {}{}): ok\n", s.name, s.pp, s.chunks,
               s.micro_batches, r.lowered ? ", lowered" : "");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"weft-sched: generate, check and print pipeline schedules"};
  app.require_subcommand(1);
  app.add_subcommand("list", "print the schedule names");
  Request r;
  CLI::App* show = add_schedule_command(app, "show", "print the rank x step grid", r);
  CLI::App* check = add_schedule_command(app, "validate", "check a schedule (exit 1 if bad)", r);
  CLI::App* csv = add_schedule_command(app, "csv", "print the schedule as CSV", r);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 1;  // --help is not an error
  }
  try {
    return run(app, show, check, csv, r);
  } catch (const weft::Error& e) {
    fmt::print(stderr, "weft-sched: {}\n", e.what());
    return 1;
  }
}
