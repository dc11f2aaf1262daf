// weft-sched — look at pipeline schedules without running one.
//
//   weft-sched list
//   weft-sched show --schedule zb-v --pp 4 --micro-batches 8 [--lowered]
//   weft-sched validate --schedule interleaved-1f1b --pp 4 --micro-batches 8 --chunks 2
//   weft-sched csv --schedule 1f1b --pp 4 --micro-batches 8 > 1f1b.csv
//   weft-sched simulate --schedule zb-h1 --pp 4 --micro-batches 8 [--cost-comm 0.1]
//       [--json] [--trace zb-h1.json] [--svg zb-h1.svg]
//   weft-sched compare --pp 4 --micro-batches 8 [--chunks 2] [--cost-f 1 --cost-w 0.5 ...]
//
// simulate and compare time the lowered schedule with F, I and W costs per
// rank's share of the model (a chunk gets its share of that) and a fixed
// time per message.
//
// Errors print one line naming the value and the rule it broke, and exit 1.
#include <weft/error.h>
#include <weft/schedule.h>
#include <weft/simulate.h>

#include <fmt/core.h>
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <fstream>
#include <numeric>
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

struct Costs {
  double f = 1, i = 1, w = 1, comm = 0, bytes = 1;
};

struct SimOptions {
  bool json = false;
  std::string trace, svg;
};

void add_size_options(CLI::App* cmd, Request& r) {
  cmd->add_option("--pp,--pipeline-model-parallel-size", r.pp, "pipeline ranks")->required();
  cmd->add_option("--micro-batches,-m", r.micro_batches, "micro-batches per step")->required();
  cmd->add_option("--chunks,-v", r.chunks, "model chunks per rank (interleaved-1f1b)");
}

void add_cost_options(CLI::App* cmd, Costs& c) {
  cmd->add_option("--cost-f", c.f, "forward time of a rank's share of the model");
  cmd->add_option("--cost-i", c.i, "input-gradient time of a rank's share");
  cmd->add_option("--cost-w", c.w, "weight-gradient time of a rank's share");
  cmd->add_option("--cost-comm", c.comm, "time a message takes between ranks");
  cmd->add_option("--bytes", c.bytes, "bytes of a stage's output (message and stash size)");
}

// The options every schedule-taking subcommand shares.
CLI::App* add_schedule_command(CLI::App& app, const std::string& name,
                               const std::string& description, Request& r) {
  CLI::App* cmd = app.add_subcommand(name, description);
  cmd->add_option("--schedule,-s", r.schedule, "schedule name (see `weft-sched list`)")->required();
  add_size_options(cmd, r);
  cmd->add_flag("--lowered", r.lowered, "add the sends and receives");
  return cmd;
}

Schedule build(const Request& r) {
  Schedule s = make_schedule(r.schedule, r.pp, r.micro_batches, r.chunks);
  return r.lowered ? lower(s) : s;
}

// --- simulate and compare ---

SimResult time_schedule(const Schedule& s, const Costs& c) {
  return simulate(s, uniform_cost(s, c.f, c.i, c.w, c.comm, c.bytes));
}

template <typename T>
std::string per_rank(const std::vector<T>& v, const char* spec = "{}") {
  std::string out;
  for (const T& x : v) out += (out.empty() ? "" : "/") + fmt::format(fmt::runtime(spec), x);
  return out;
}

constexpr const char* kRowFormat = "{:<18} {:>6} {:>10} {:>8} {:>20} {:>10}\n";

void print_header() {
  fmt::print(kRowFormat, "schedule", "chunks", "step", "bubble", "peak act per rank",
             "bytes sent");
}

void print_row(const Schedule& s, const SimResult& r) {
  const double sent = std::accumulate(r.bytes_sent.begin(), r.bytes_sent.end(), 0.0);
  fmt::print(kRowFormat, s.name, s.chunks, fmt::format("{:.3f}", r.step_time),
             fmt::format("{:.1f}%", 100 * r.bubble_fraction), per_rank(r.peak_activations),
             fmt::format("{:g}", sent));
}

void print_ranks(const SimResult& r) {
  fmt::print("\n{:>4} {:>10} {:>8} {:>9} {:>11} {:>10}\n", "rank", "busy", "bubble", "peak act",
             "peak bytes", "bytes sent");
  for (size_t rank = 0; rank < r.busy.size(); ++rank)
    fmt::print("{:>4} {:>10.3f} {:>7.1f}% {:>9} {:>11g} {:>10g}\n", rank, r.busy[rank],
               100 * r.rank_bubble[rank], r.peak_activations[rank],
               r.peak_activation_bytes[rank], r.bytes_sent[rank]);
}

// One JSON object; names come from the registry, so they need no escaping.
std::string to_json(const Schedule& s, const SimResult& r) {
  return fmt::format(
      "{{\"schedule\": \"{}\", \"pp\": {}, \"chunks\": {}, \"micro_batches\": {}, "
      "\"step_time\": {}, \"bubble_fraction\": {}, \"rank_bubble\": [{}], \"busy\": [{}], "
      "\"peak_activations\": [{}], \"peak_activation_bytes\": [{}], \"bytes_sent\": [{}]}}\n",
      s.name, s.pp, s.chunks, s.micro_batches, r.step_time, r.bubble_fraction,
      fmt::join(r.rank_bubble, ", "), fmt::join(r.busy, ", "), fmt::join(r.peak_activations, ", "),
      fmt::join(r.peak_activation_bytes, ", "), fmt::join(r.bytes_sent, ", "));
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
  out.close();
  weft::check(out.good(), "cannot write '{}'", path);
}

int simulate_command(const Request& r, const Costs& c, const SimOptions& o) {
  const Schedule s = lower(make_schedule(r.schedule, r.pp, r.micro_batches, r.chunks));
  const SimResult result = time_schedule(s, c);
  if (!o.trace.empty()) write_text(o.trace, chrome_trace(s, result));
  if (!o.svg.empty()) write_text(o.svg, timeline_svg(s, result));
  if (o.json) {
    fmt::print("{}", to_json(s, result));
    return 0;
  }
  print_header();
  print_row(s, result);
  print_ranks(result);
  return 0;
}

// Every schedule at the same sizes; one that cannot be built at them says
// why in its row instead of failing the rest.
int compare_command(const Request& r, const Costs& c) {
  print_header();
  for (const std::string& name : schedule_names()) {
    try {
      const Schedule s = lower(make_schedule(name, r.pp, r.micro_batches, r.chunks));
      print_row(s, time_schedule(s, c));
    } catch (const weft::Error& e) {
      fmt::print("{:<18} {}\n", name, e.what());
    }
  }
  return 0;
}

struct Commands {
  CLI::App *show, *validate, *csv, *simulate, *compare;
};

int run(CLI::App& app, const Commands& cmd, const Request& r, const Request& cr,
        const Costs& costs, const SimOptions& o) {
  if (cmd.simulate->parsed()) return simulate_command(r, costs, o);
  if (cmd.compare->parsed()) return compare_command(cr, costs);
  if (app.got_subcommand("list")) {
    for (const std::string& name : schedule_names()) fmt::print("{}\n", name);
    return 0;
  }
  const Schedule s = build(r);
  if (cmd.show->parsed()) fmt::print("{}", render_grid(s));
  if (cmd.csv->parsed()) fmt::print("{}", to_csv(s));
  if (cmd.validate->parsed()) {
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
  Costs costs;
  SimOptions o;
  CLI::App* sim = app.add_subcommand("simulate", "time a schedule: step, bubble, memory");
  sim->add_option("--schedule,-s", r.schedule, "schedule name (see `weft-sched list`)")
      ->required();
  add_size_options(sim, r);
  add_cost_options(sim, costs);
  sim->add_flag("--json", o.json, "print one JSON object instead of the table");
  sim->add_option("--trace", o.trace, "write a Chrome trace (Perfetto) to this file");
  sim->add_option("--svg", o.svg, "write an SVG timeline to this file");
  // interleaved-1f1b needs two chunks at least; the others ignore the count.
  Request cr;
  cr.chunks = 2;
  CLI::App* compare = app.add_subcommand("compare", "time every schedule at the same sizes");
  add_size_options(compare, cr);
  add_cost_options(compare, costs);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 1;  // --help is not an error
  }
  try {
    return run(app, {show, check, csv, sim, compare}, r, cr, costs, o);
  } catch (const weft::Error& e) {
    fmt::print(stderr, "weft-sched: {}\n", e.what());
    return 1;
  }
}
