// weft-sched — look at pipeline schedules without running one.
//
//   weft-sched list
//   weft-sched show --schedule zb-v --pp 4 --micro-batches 8 [--lowered]
//   weft-sched validate --schedule interleaved-1f1b --pp 4 --micro-batches 8 --virtual-stages 3
//   weft-sched csv --schedule 1f1b --pp 4 --micro-batches 8 > 1f1b.csv
//   weft-sched simulate --schedule zb-h1 --pp 4 --micro-batches 8 [--cost-comm 0.1]
//       [--json] [--trace zb-h1.json] [--svg zb-h1.svg]
//   weft-sched compare --pp 4 --micro-batches 8 [--virtual-stages 3] [--cost-f 1 --cost-w 0.5 ...]
//   weft-sched simulate --schedule 1f1b --micro-batches 8 --costs costs.json  # pp from the file
//   weft-sched timeline --from-trace run.json [--step 5] --svg run.svg
//   weft-sched plan --num-layers 48 --hidden-size 1600 --num-attention-heads 25
//       --seq-length 1024 --vocab-size 50304 --global-batch-size 512 --world-size 64
//       --memory 141GiB --link-latency 5e-6 --bandwidth 900e9 --ranks-per-node 8
//       --inter-latency 1e-5 --inter-bandwidth 50e9 (--profile costs.json | --flops 4e14)
//
// plan searches dp x pp x tp, schedule, virtual stages, micro-batch size,
// recompute and ZeRO-1 or 2 (weft/plan.h), refuses what train_gpt would refuse
// or what does not fit --memory, and prints the plans fastest first; the
// layout flags (--tp, --pp, --schedule, ...) fix that dimension.
//
// simulate and compare time the lowered schedule with F, I and W costs per
// rank's share of the model (a chunk gets its share of that) and a fixed
// time per message; or, with --costs, with the per-stage costs that
// `train_gpt --pp P --profile FILE` measured for its plan, in milliseconds,
// at the pp and chunk count the file names where --pp or --virtual-stages
// is not given (a flag that disagrees with the file is an error). Text
// tables print sizes as "176.0 MiB"; --json keeps the exact numbers. show
// prints a legend of the notation under the grid.
// timeline summarises one step of a measured trace (train_gpt --trace) the
// way simulate summarises a simulated one, and draws it.
//
// Flags that train_gpt also has mean what they mean there: --schedule,
// --pp (--pipeline-model-parallel-size), --virtual-stages (model chunks per
// rank; --chunks and -v are its older names), --trace. Without
// --virtual-stages a schedule runs its default chunk count, train_gpt's: 2
// for interleaved-1f1b and zb-v, 1 for the others.
//
// Errors print one line naming the value and the rule it broke, and exit 1.
#include <weft/error.h>
#include <weft/plan.h>
#include <weft/schedule.h>
#include <weft/sharding.h>
#include <weft/simulate.h>
#include <weft/units.h>

#include <fmt/core.h>
#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <thread>

namespace {

using namespace weft::sched;

struct Request {
  std::string schedule;
  std::optional<int> pp;  // simulate and compare may take it from --costs
  int micro_batches = 1;
  std::optional<int> chunks;  // --virtual-stages; unset: the schedule's default
  bool lowered = false;
};

struct Costs {
  double f = 1, i = 1, w = 1, comm = 0, bytes = 1;
  double bandwidth = std::numeric_limits<double>::infinity();
  double compute_scale = 1;  // times F, I and W
  std::string file;          // --costs
  // --cores: unset means the machine's with --costs (profiled here), else
  // a core per rank; 0 is a core per rank.
  std::optional<double> cores;
  double wake = 0;  // --wake
};

// A --costs file: per-stage costs of one micro-batch, as train_gpt --profile
// writes them (seconds there, milliseconds here) for the plan it chose, and
// the layout it was profiled at (absent from a file written by hand).
struct StageCosts {
  std::string path;
  std::optional<int> pp, chunks;
  std::vector<double> f, i, w, update;  // ms
  std::vector<double> boundary_bytes, stash_bytes;
  // What each action adds to memory, per stage ("memory"), when measured.
  std::vector<StageBytes> memory;
  bool recompute = false;
  size_t stages() const { return f.size(); }
};

struct SimOptions {
  bool json = false;
  std::string trace, svg;
};

constexpr const char* kChunksHelp =
    "model chunks per rank, as train_gpt --virtual-stages (default: 2 for interleaved-1f1b and "
    "zb-v, 1 for the others; zb-v runs exactly 2)";

// `pp_required` false: simulate and compare, where a --costs file may say it.
void add_size_options(CLI::App* cmd, Request& r, bool pp_required, const char* chunks_help) {
  CLI::Option* pp = cmd->add_option("--pp,--pipeline-model-parallel-size", r.pp, "pipeline ranks");
  if (pp_required) pp->required();
  cmd->add_option("--micro-batches,-m", r.micro_batches, "micro-batches per step")->required();
  cmd->add_option("--virtual-stages,--chunks,-v", r.chunks, chunks_help);
}

void add_cost_options(CLI::App* cmd, Costs& c) {
  CLI::Option* file = cmd->add_option(
      "--costs", c.file,
      "per-stage costs that `train_gpt --pp P --profile FILE` measured; times are then in ms, "
      "and --pp and --virtual-stages default to the file's");
  for (CLI::Option* o :
       {cmd->add_option("--cost-f", c.f, "forward time of a rank's share of the model"),
        cmd->add_option("--cost-i", c.i, "input-gradient time of a rank's share"),
        cmd->add_option("--cost-w", c.w, "weight-gradient time of a rank's share"),
        cmd->add_option("--bytes", c.bytes, "bytes of a stage's output (message and stash size)")})
    o->excludes(file);
  cmd->add_option("--cost-comm", c.comm,
                  "time a message takes between ranks (ms with --costs), besides its bytes");
  cmd->add_option("--bandwidth", c.bandwidth,
                  "bytes a link carries per time unit (with --costs per ms: 2.5e6 = 2.5 GB/s)");
  cmd->add_option("--compute-scale", c.compute_scale,
                  "multiply every F, I and W time (say 1.05 where ranks that compute at once "
                  "slow each other down by 5%)");
  cmd->add_option("--cores", c.cores,
                  "cores the ranks share: while n ranks compute at once each runs at "
                  "1 / ceil(n / cores) of its profiled speed once n exceeds them (default: this "
                  "machine's with --costs, "
                  "else 0; 0 = a core per rank)");
  cmd->add_option("--wake", c.wake,
                  "time a rank that waited for a message takes to run again once it arrives "
                  "(ms with --costs; measured at the same ranks per core, see "
                  "bench/sched_report.py)");
}

// The --cores a simulation runs with: the flag, or the machine's for costs
// profiled on it, or a core per rank.
double cores_of(const Costs& c, bool profiled) {
  if (c.cores) {
    weft::check(std::isfinite(*c.cores) && *c.cores >= 0,
                "--cores {} must be a number of cores, at least 0 (0 = a core per rank)",
                *c.cores);
    return *c.cores;
  }
  return profiled ? static_cast<double>(std::max(1u, std::thread::hardware_concurrency())) : 0;
}

// The options every schedule-taking subcommand shares.
CLI::App* add_schedule_command(CLI::App& app, const std::string& name,
                               const std::string& description, Request& r) {
  CLI::App* cmd = app.add_subcommand(name, description);
  cmd->add_option("--schedule,-s", r.schedule, "schedule name (see `weft-sched list`)")->required();
  add_size_options(cmd, r, true, kChunksHelp);
  cmd->add_flag("--lowered", r.lowered, "add the sends and receives");
  return cmd;
}

// The chunk count --virtual-stages asks for, or the schedule's default; a
// count the schedule does not run is refused.
int chunks_of(const Request& r) {
  if (!r.chunks) return default_chunks(r.schedule);
  const std::string rule = chunks_rule(r.schedule, *r.chunks);
  weft::check(rule.empty(), "--virtual-stages {}: {}", *r.chunks, rule);
  return *r.chunks;
}

Schedule build(const Request& r) {
  Schedule s = make_schedule(r.schedule, *r.pp, r.micro_batches, chunks_of(r));
  return r.lowered ? lower(s) : s;
}

// --- --costs ---

std::string read_text(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  weft::check(in.good(), "{} {}: cannot open the file", what, path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

nlohmann::json parse_json(const std::string& path, const char* what) {
  try {
    return nlohmann::json::parse(read_text(path, what));
  } catch (const nlohmann::json::exception& e) {
    throw weft::Error("{} {}: not valid JSON ({})", what, path, e.what());
  }
}

// A stage's entry, finite and not negative; `required` false reads a missing one as 0.
double stage_number(const StageCosts& c, const nlohmann::json& stage, size_t index,
                    const char* key, bool required) {
  const auto it = stage.find(key);
  if (it == stage.end() && !required) return 0;
  weft::check(it != stage.end() && it->is_number(), "--costs {}: stages[{}] has no number \"{}\"",
              c.path, index, key);
  const double v = it->get<double>();
  weft::check(std::isfinite(v) && v >= 0,
              "--costs {}: stages[{}].{} = {} must be finite and not negative", c.path, index,
              key, v);
  return v;
}

// The file's "pp" or "chunks", a whole number at least 1 where it is there.
std::optional<int> layout_count(const nlohmann::json& j, const std::string& path,
                                const char* key) {
  const auto it = j.find(key);
  if (it == j.end()) return std::nullopt;
  weft::check(it->is_number_integer() && it->get<int64_t>() >= 1 &&
                  it->get<int64_t>() <= std::numeric_limits<int>::max(),
              "--costs {}: \"{}\" is {}, not a whole number at least 1", path, key, it->dump());
  return it->get<int>();
}

StageCosts read_stage_costs(const std::string& path) {
  StageCosts c;
  c.path = path;
  const nlohmann::json j = parse_json(path, "--costs");
  const auto stages = j.is_object() ? j.find("stages") : j.end();
  weft::check(stages != j.end() && stages->is_array() && !stages->empty(),
              "--costs {}: no \"stages\" list; `train_gpt --pp P --profile FILE` writes one",
              path);
  c.pp = layout_count(j, path, "pp");
  c.chunks = layout_count(j, path, "chunks");
  if (c.pp && c.chunks)
    weft::check(stages->size() == static_cast<size_t>(*c.pp) * static_cast<size_t>(*c.chunks),
                "--costs {}: {} stages, but its pp x chunks = {} x {} = {}", path, stages->size(),
                *c.pp, *c.chunks, *c.pp * *c.chunks);
  for (size_t k = 0; k < stages->size(); ++k) {
    const nlohmann::json& st = (*stages)[k];
    weft::check(st.is_object(), "--costs {}: stages[{}] is not an object", path, k);
    c.f.push_back(1e3 * stage_number(c, st, k, "f", true));
    c.i.push_back(1e3 * stage_number(c, st, k, "i", true));
    c.w.push_back(1e3 * stage_number(c, st, k, "w", true));
    c.update.push_back(1e3 * stage_number(c, st, k, "update", false));
    c.boundary_bytes.push_back(stage_number(c, st, k, "boundary_bytes", false));
    c.stash_bytes.push_back(stage_number(c, st, k, "stash_bytes", false));
    const auto mem = st.find("memory");
    const bool first_has = (*stages)[0].contains("memory");
    weft::check((mem != st.end()) == first_has,
                "--costs {}: stages[{}] {} \"memory\" and stages[0] {}: the bytes each action "
                "adds are given for every stage or for none",
                path, k, mem != st.end() ? "has" : "has no", first_has ? "has" : "has not");
    if (mem == st.end()) continue;
    weft::check(mem->is_object(), "--costs {}: stages[{}].memory is not an object", path, k);
    StageBytes b;
    for (auto [key, field] : {std::pair{"recv_f", &b.recv_f},
                              {"f", &b.f},
                              {"recv_b", &b.recv_b},
                              {"i", &b.i},
                              {"w", &b.w},
                              {"f_work", &b.f_work},
                              {"i_work", &b.i_work},
                              {"i_keep", &b.i_keep},
                              {"i_work_above", &b.i_work_above}})
      *field = stage_number(c, *mem, k, key, false);
    c.memory.push_back(b);
  }
  if (const auto rc = j.find("recompute"); rc != j.end()) {
    weft::check(rc->is_boolean(), "--costs {}: \"recompute\" is {}, not true or false", path,
                rc->dump());
    c.recompute = rc->get<bool>();
  }
  return c;
}

// --pp, or the pipeline ranks the --costs file was profiled at; given both,
// they must agree.
int pipeline_ranks(const Request& r, const std::optional<StageCosts>& p) {
  if (r.pp && p && p->pp)
    weft::check(*r.pp == *p->pp, "--pp {} contradicts --costs {}, which was profiled at pp {}",
                *r.pp, p->path, *p->pp);
  if (r.pp) return *r.pp;
  weft::check(p.has_value(), "--pp (--pipeline-model-parallel-size) is required without --costs");
  weft::check(p->pp.has_value(), "--pp is required: --costs {} does not say the pp it was "
              "profiled at", p->path);
  return *p->pp;
}

// The sizes to simulate: --pp and --virtual-stages, or what the --costs file
// was profiled at where they are not given; a flag that contradicts the file
// is an error naming both.
Request with_profiled_sizes(Request r, const std::optional<StageCosts>& p) {
  r.pp = pipeline_ranks(r, p);
  if (!p || !p->chunks) return r;
  if (r.chunks) {
    chunks_of(r);  // first, whether the schedule runs that count at all
    weft::check(*r.chunks == *p->chunks,
                "--virtual-stages {} contradicts --costs {}, which was profiled at {} chunks "
                "per rank",
                *r.chunks, p->path, *p->chunks);
  } else {
    const std::string rule = chunks_rule(r.schedule, *p->chunks);
    weft::check(rule.empty(), "--costs {} was profiled at {} chunks per rank: {}", p->path,
                *p->chunks, rule);
    r.chunks = p->chunks;
  }
  return r;
}

// The profiled stages are the schedule's stages, in order: their count must match.
SimCost profiled_cost(const Schedule& s, const StageCosts& p) {
  weft::check(p.stages() == static_cast<size_t>(s.stages()),
              "--costs {}: {} stages, but {} at --pp {} runs pp x chunks = {} x {} = {}", p.path,
              p.stages(), s.name, s.pp, s.pp, s.chunks, s.stages());
  SimCost cost;
  cost.f = p.f;
  cost.i = p.i;
  cost.w = p.w;
  cost.update = p.update;
  cost.activation_bytes = p.boundary_bytes;
  cost.stash_bytes = p.stash_bytes;
  cost.memory = p.memory;
  cost.recompute = p.recompute;
  return cost;
}

// --- simulate and compare ---

SimResult time_schedule(const Schedule& s, const Costs& c, const std::optional<StageCosts>& p) {
  weft::check(c.compute_scale > 0 && std::isfinite(c.compute_scale),
              "--compute-scale ({}) must be a positive number", c.compute_scale);
  SimCost cost = p ? profiled_cost(s, *p) : uniform_cost(s, c.f, c.i, c.w, c.comm, c.bytes);
  cost.link_latency = c.comm;
  cost.bandwidth = c.bandwidth;
  cost.cores = cores_of(c, p.has_value());
  weft::check(c.wake >= 0 && std::isfinite(c.wake), "--wake ({}) must be a time, at least 0",
              c.wake);
  cost.wake = c.wake;
  for (std::vector<double>* v : {&cost.f, &cost.i, &cost.w})
    for (double& t : *v) t *= c.compute_scale;
  return simulate(s, cost);
}

template <typename T>
std::string per_rank(const std::vector<T>& v, const char* spec = "{}") {
  std::string out;
  for (const T& x : v) out += (out.empty() ? "" : "/") + fmt::format(fmt::runtime(spec), x);
  return out;
}

constexpr const char* kRowFormat = "{:<18} {:>6} {:>10} {:>8} {:>20} {:>11}\n";

void print_header() {
  fmt::print(kRowFormat, "schedule", "chunks", "step", "bubble", "peak act per rank",
             "bytes sent");
}

void print_row(const Schedule& s, const SimResult& r) {
  const double sent = std::accumulate(r.bytes_sent.begin(), r.bytes_sent.end(), 0.0);
  fmt::print(kRowFormat, s.name, s.chunks, fmt::format("{:.3f}", r.step_time),
             fmt::format("{:.1f}%", 100 * r.bubble_fraction), per_rank(r.peak_activations),
             weft::format_bytes(sent));
}

void print_ranks(const SimResult& r) {
  fmt::print("\n{:>4} {:>10} {:>8} {:>10} {:>9} {:>11} {:>11}\n", "rank", "busy", "bubble",
             "update", "peak act", "peak bytes", "bytes sent");
  for (size_t rank = 0; rank < r.busy.size(); ++rank)
    fmt::print("{:>4} {:>10.3f} {:>7.1f}% {:>10.3f} {:>9} {:>11} {:>11}\n", rank, r.busy[rank],
               100 * r.rank_bubble[rank], r.update[rank], r.peak_activations[rank],
               weft::format_bytes(r.peak_activation_bytes[rank]), weft::format_bytes(r.bytes_sent[rank]));
}

// One JSON object. `unit` is what times are in: "ms" (profiled costs, a
// measured trace) or "cost" (the unit of the --cost-* flags).
std::string to_json(const Schedule& s, const SimResult& r, const char* unit) {
  const nlohmann::json j = {{"schedule", s.name},
                            {"pp", s.pp},
                            {"chunks", s.chunks},
                            {"micro_batches", s.micro_batches},
                            {"unit", unit},
                            {"step_time", r.step_time},
                            {"pipeline_time", r.pipeline_time},
                            {"update_time", r.update_time},
                            {"bubble_fraction", r.bubble_fraction},
                            {"rank_bubble", r.rank_bubble},
                            {"busy", r.busy},
                            {"peak_activations", r.peak_activations},
                            {"peak_activation_bytes", r.peak_activation_bytes},
                            {"bytes_sent", r.bytes_sent}};
  return j.dump() + "\n";
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
  out.close();
  weft::check(out.good(), "cannot write '{}'", path);
}

// Times are milliseconds (`in_ms`: profiled costs, a measured trace) or
// the unit of the --cost-* flags.
void report(const Schedule& s, const SimResult& result, const SimOptions& o, bool in_ms) {
  if (!o.trace.empty()) write_text(o.trace, chrome_trace(s, result));
  if (!o.svg.empty()) write_text(o.svg, timeline_svg(s, result, in_ms ? "ms" : ""));
  if (o.json) {
    fmt::print("{}", to_json(s, result, in_ms ? "ms" : "cost"));
    return;
  }
  print_header();
  print_row(s, result);
  print_ranks(result);
}

std::optional<StageCosts> stage_costs(const Costs& c) {
  if (c.file.empty()) return std::nullopt;
  return read_stage_costs(c.file);
}

int simulate_command(const Request& r, const Costs& c, const SimOptions& o) {
  const std::optional<StageCosts> profiled = stage_costs(c);
  const Schedule s = lower(build(with_profiled_sizes(r, profiled)));
  report(s, time_schedule(s, c, profiled), o, profiled.has_value());
  return 0;
}

// Every schedule at the same sizes; one that cannot be built at them (or
// that the --costs file's stages do not fit) says why in its row instead of
// failing the rest. --virtual-stages, or else the --costs file's chunk
// count where a schedule runs it, is the chunk count of the schedules that
// run several; the others run their one.
int compare_command(const Request& r, const Costs& c) {
  const std::optional<StageCosts> profiled = stage_costs(c);
  Request sizes = r;
  sizes.pp = pipeline_ranks(r, profiled);
  if (r.chunks && profiled && profiled->chunks)
    weft::check(*r.chunks == *profiled->chunks,
                "--virtual-stages {} contradicts --costs {}, which was profiled at {} chunks "
                "per rank",
                *r.chunks, profiled->path, *profiled->chunks);
  print_header();
  for (const std::string& name : schedule_names()) {
    try {
      Request row = sizes;
      row.schedule = name;
      if (default_chunks(name) == 1)
        row.chunks = 1;
      else if (!row.chunks && profiled && profiled->chunks &&
               chunks_rule(name, *profiled->chunks).empty())
        row.chunks = profiled->chunks;
      const Schedule s = lower(build(row));
      print_row(s, time_schedule(s, c, profiled));
    } catch (const weft::Error& e) {
      fmt::print("{:<18} {}\n", name, e.what());
    }
  }
  return 0;
}

// --- timeline: one step of a measured trace ---

struct TimelineRequest {
  std::string from;
  int step = 0;  // 0 = the last step in the trace
};

struct TracedAction {
  Action action;
  ActionTime time;  // ms
};

// The actions of one step of a Chrome trace (train_gpt --trace, or weft-sched
// simulate --trace), per rank in start order, as a schedule and its times.
// Events without a "step" argument belong to step 1.
std::pair<Schedule, std::vector<std::vector<ActionTime>>> read_trace_step(
    const TimelineRequest& t) {
  const nlohmann::json j = parse_json(t.from, "--from-trace");
  const auto events = j.is_object() ? j.find("traceEvents") : j.end();
  weft::check(events != j.end() && events->is_array(),
              "--from-trace {}: no \"traceEvents\" list (is it a Chrome trace?)", t.from);
  std::map<int, std::map<int, std::vector<TracedAction>>> steps;  // step -> rank -> actions
  for (const nlohmann::json& e : *events) {
    // Actions only: a simulated trace's "update" events are not in the schedule.
    if (!e.is_object() || e.value("ph", "") != "X" || e.value("name", "") == "update") continue;
    weft::check(e.contains("tid") && e["tid"].is_number_integer() && e["tid"].get<int>() >= 0 &&
                    e.contains("ts") && e["ts"].is_number() && e.contains("dur") &&
                    e["dur"].is_number() && e.contains("name") && e["name"].is_string(),
                "--from-trace {}: event {} needs a tid >= 0, a ts, a dur and a name", t.from,
                e.dump());
    const nlohmann::json* step = nullptr;
    if (e.contains("args") && e["args"].is_object() && e["args"].contains("step"))
      step = &e["args"]["step"];
    weft::check(step == nullptr || step->is_number_integer(),
                "--from-trace {}: event {} has a step that is not a whole number", t.from,
                e.dump());
    const double start = e["ts"].get<double>() / 1e3;
    const double end = start + e["dur"].get<double>() / 1e3;
    steps[step ? step->get<int>() : 1][e["tid"].get<int>()].push_back(
        {Action::parse(e["name"].get<std::string>()), {start, end}});
  }
  weft::check(!steps.empty(), "--from-trace {}: no complete (\"X\") events", t.from);
  const int step = t.step > 0 ? t.step : steps.rbegin()->first;
  const auto found = steps.find(step);
  weft::check(found != steps.end(), "--from-trace {}: no step {}; it holds steps {} to {}",
              t.from, step, steps.begin()->first, steps.rbegin()->first);
  auto& ranks = found->second;
  const int pp = ranks.rbegin()->first + 1;
  weft::check(static_cast<int>(ranks.size()) == pp,
              "--from-trace {}: step {} has actions on {} ranks, not on every rank 0..{}", t.from,
              step, ranks.size(), pp - 1);
  Schedule s;
  s.name = fmt::format("measured step {}", step);
  s.pp = pp;
  s.actions.resize(static_cast<size_t>(pp));
  std::vector<std::vector<ActionTime>> times(static_cast<size_t>(pp));
  std::map<int, int> stage_rank;
  for (auto& [rank, list] : ranks) {
    std::stable_sort(list.begin(), list.end(), [](const TracedAction& a, const TracedAction& b) {
      return a.time.start < b.time.start;
    });
    for (const TracedAction& a : list) {
      s.actions[static_cast<size_t>(rank)].push_back(a.action);
      times[static_cast<size_t>(rank)].push_back(a.time);
      if (a.action.kind == ActionKind::F) stage_rank[a.action.stage] = rank;
      s.micro_batches = std::max(s.micro_batches, a.action.micro_batch + 1);
    }
  }
  const int stages = stage_rank.empty() ? 0 : stage_rank.rbegin()->first + 1;
  weft::check(stages > 0 && static_cast<int>(stage_rank.size()) == stages && stages % pp == 0,
              "--from-trace {}: step {} runs forwards of {} stages over {} ranks; every stage "
              "0..N-1 needs one, N a multiple of the ranks",
              t.from, step, stage_rank.size(), pp);
  s.chunks = stages / pp;
  for (const auto& [stage, rank] : stage_rank) s.stage_rank.push_back(rank);
  return {std::move(s), std::move(times)};
}

int timeline_command(const TimelineRequest& t, const SimOptions& o) {
  auto [s, times] = read_trace_step(t);
  const SimResult result = summarize(s, std::move(times));
  report(s, result, o, true);
  return 0;
}

// --- plan ---

struct PlanRequest {
  weft::plan::PlanInput in;
  std::string memory, profile;
  double flops = 0, memory_bandwidth = 4.8e12, compute_scale = 1;
  std::optional<double> cores;
  std::optional<int> dp, pp, tp, chunks;
  std::optional<std::string> schedule;
  std::optional<int64_t> micro_batch;
  std::optional<std::string> sharding;  // --data-parallel-sharding-strategy
  bool sequence_parallel = false;       // fixed on; otherwise searched
  bool bf16 = false;                    // --flops: bf16 activations
  std::string attention = "unfused";    // --flops: unfused or fused attention
  size_t top = 10;
  bool json = false;
};

void add_plan_options(CLI::App* cmd, PlanRequest& q) {
  weft::plan::ModelShape& m = q.in.shape;
  cmd->add_option("--num-layers", m.layers, "transformer blocks")->required();
  cmd->add_option("--hidden-size", m.hidden, "model width")->required();
  cmd->add_option("--num-attention-heads", m.heads, "attention heads")->required();
  cmd->add_option("--seq-length", m.seq, "tokens per sequence")->required();
  cmd->add_option("--vocab-size", m.vocab, "vocabulary")->required();
  cmd->add_option("--global-batch-size", q.in.global_batch, "sequences per step")->required();
  cmd->add_option("--world-size", q.in.machine.world, "ranks")->required();
  cmd->add_option("--memory", q.memory, "memory per rank, e.g. 80GiB (default: unlimited)");
  cmd->add_option("--link-latency", q.in.machine.intra.latency,
                  "seconds per message between ranks of a node");
  cmd->add_option("--bandwidth", q.in.machine.intra.bandwidth,
                  "bytes per second between ranks of a node");
  cmd->add_option("--ranks-per-node", q.in.machine.ranks_per_node,
                  "ranks per node (default: all on one)");
  cmd->add_option("--inter-latency", q.in.machine.inter.latency,
                  "seconds per message between nodes");
  cmd->add_option("--inter-bandwidth", q.in.machine.inter.bandwidth,
                  "bytes per second between nodes");
  cmd->add_option("--cores", q.cores,
                  "cores the ranks share (default: this machine's with --profile, else 0 = one "
                  "per rank)");
  cmd->add_option("--wake", q.in.machine.wake,
                  "seconds a rank that waited takes to run again once its message is there: "
                  "after a pipeline receive that waited and each round of an all-reduce "
                  "(where ranks outnumber cores; default 0)");
  CLI::Option* profile = cmd->add_option(
      "--profile", q.profile, "node costs that train_gpt --profile FILE measured on this machine");
  CLI::Option* flops = cmd->add_option(
      "--flops", q.flops, "FLOP/s per rank (peak x assumed efficiency), where no profile exists");
  profile->excludes(flops);
  cmd->add_option("--memory-bandwidth", q.memory_bandwidth,
                  "bytes/s per rank for the optimizer step with --flops (default 4.8e12)")
      ->needs(flops);
  cmd->add_flag("--bf16", q.bf16,
                "with --flops: activations in bf16, as train_gpt --bf16 keeps them (a profile "
                "has its own)")
      ->needs(flops);
  cmd->add_option("--attention-backend", q.attention,
                  "with --flops: unfused (the probabilities kept, fp32) or fused (cuDNN's "
                  "flash attention: a log-sum-exp per row)")
      ->needs(flops);
  cmd->add_option("--compute-scale", q.compute_scale,
                  "multiply every F, I and W time (a calibration, as weft-sched simulate's)");
  cmd->add_option("--tp,--tensor-model-parallel-size", q.tp, "fix the tensor-parallel size");
  cmd->add_option("--pp,--pipeline-model-parallel-size", q.pp, "fix the pipeline size");
  cmd->add_option("--dp", q.dp, "fix the data-parallel size");
  cmd->add_option("--schedule", q.schedule, "fix the schedule");
  cmd->add_option("--virtual-stages", q.chunks, "fix the model chunks per rank");
  cmd->add_option("--micro-batch-size", q.micro_batch, "fix the micro-batch size");
  cmd->add_option("--data-parallel-sharding-strategy", q.sharding,
                  "fix what the replicas shard: no_shard, optim (ZeRO-1), optim_grads (ZeRO-2) "
                  "or optim_grads_params (ZeRO-3)");
  cmd->add_flag("--sequence-parallel", q.sequence_parallel,
                "fix sequence parallelism on (needs tp > 1); otherwise tried at every tp > 1");
  cmd->add_option("--max-micro-batch-size", q.in.fixed.max_micro_batch,
                  "largest micro-batch size searched (powers of 2; default 16)");
  cmd->add_option("--top", q.top, "rows to print (0: all; default 10)");
  cmd->add_flag("--json", q.json, "print every feasible plan as JSON");
}

int plan_command(PlanRequest q) {
  using namespace weft::plan;
  weft::check(!q.profile.empty() || q.flops > 0,
              "plan needs costs: --profile FILE (train_gpt --profile) or --flops FLOP/s");
  weft::check(std::isfinite(q.compute_scale) && q.compute_scale > 0,
              "--compute-scale ({}) must be a positive number", q.compute_scale);
  Machine& m = q.in.machine;
  if (m.ranks_per_node <= 0 || m.ranks_per_node >= m.world) m.inter = m.intra;
  if (!q.memory.empty()) m.memory = weft::parse_bytes("--memory", q.memory);
  Costs c;
  c.cores = q.cores;
  m.cores = cores_of(c, !q.profile.empty());
  weft::check(m.wake >= 0 && std::isfinite(m.wake), "--wake ({}) must be seconds, at least 0",
              m.wake);
  weft::check(q.attention == "unfused" || q.attention == "fused",
              "--attention-backend '{}' is not unfused or fused", q.attention);
  q.in.costs = q.profile.empty() ? flops_costs(q.in.shape, q.flops, q.memory_bandwidth,
                                               {q.bf16 ? 2 : 4, q.attention == "fused"})
                                 : profile_costs(parse_json(q.profile, "--profile"), q.profile);
  q.in.costs.compute_scale = q.compute_scale;
  Constraints& fx = q.in.fixed;
  fx.dp = q.dp;
  fx.pp = q.pp;
  fx.tp = q.tp;
  fx.chunks = q.chunks;
  fx.schedule = q.schedule;
  fx.micro_batch = q.micro_batch;
  if (q.sharding) {
    const weft::ShardingStrategy st = weft::parse_sharding_strategy(*q.sharding);
    fx.zero1 = st != weft::ShardingStrategy::NoShard;
    fx.zero2 =
        st == weft::ShardingStrategy::OptimGrads || st == weft::ShardingStrategy::OptimGradsParams;
    fx.zero3 = st == weft::ShardingStrategy::OptimGradsParams;
  }
  if (q.sequence_parallel) fx.sequence_parallel = true;
  if (q.schedule) default_chunks(*q.schedule);  // an unknown name is refused here
  const PlanResult r = plan(q.in);
  if (q.json) {
    nlohmann::json out = nlohmann::json::array();
    for (const Plan& p : r.plans)
      out.push_back({{"dp", p.layout.dp},
                     {"pp", p.layout.pp},
                     {"tp", p.layout.tp},
                     {"schedule", p.layout.pp > 1 ? p.layout.schedule : "-"},
                     {"chunks", p.layout.chunks},
                     {"micro_batch", p.layout.micro_batch},
                     {"micro_batches", p.micro_batches},
                     {"recompute", p.layout.recompute},
                     {"zero1", p.layout.zero1},
                     {"zero2", p.layout.zero2},
                     {"zero3", p.layout.zero3},
                     {"sequence_parallel", p.layout.sequence_parallel},
                     {"step_time", p.step_time},
                     {"pipeline_time", p.pipeline_time},
                     {"dp_time", p.dp_time},
                     {"update_time", p.update_time},
                     {"bubble", p.bubble},
                     {"memory_per_rank", p.memory_per_rank},
                     {"activation_bytes", p.activation_bytes},
                     {"bytes_per_step", p.bytes_per_step},
                     {"flags", p.layout.flags()}});
    fmt::print("{}\n", out.dump());
    return r.plans.empty() ? 1 : 0;
  }
  fmt::print("{}", plan_table(r, q.top));
  if (r.plans.empty()) {
    fmt::print(stderr, "weft-sched: no plan fits: every layout was refused (reasons above)\n");
    return 1;
  }
  return 0;
}

struct Commands {
  CLI::App *show, *validate, *csv, *simulate, *compare, *timeline, *plan;
};

int run(CLI::App& app, const Commands& cmd, const Request& r, const Request& cr,
        const Costs& costs, const SimOptions& o, const TimelineRequest& t,
        const PlanRequest& q) {
  if (cmd.plan->parsed()) return plan_command(q);
  if (cmd.simulate->parsed()) return simulate_command(r, costs, o);
  if (cmd.compare->parsed()) return compare_command(cr, costs);
  if (cmd.timeline->parsed()) return timeline_command(t, o);
  if (app.got_subcommand("list")) {
    for (const std::string& name : schedule_names()) fmt::print("{}\n", name);
    return 0;
  }
  const Schedule s = build(r);
  if (cmd.show->parsed()) fmt::print("{}\n{}", render_grid(s), render_legend(s));
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
  add_size_options(sim, r, false, kChunksHelp);
  add_cost_options(sim, costs);
  sim->add_flag("--json", o.json, "print one JSON object instead of the table");
  sim->add_option("--trace", o.trace, "write a Chrome trace (Perfetto) to this file");
  sim->add_option("--svg", o.svg, "write an SVG timeline to this file");
  Request cr;
  CLI::App* compare = app.add_subcommand("compare", "time every schedule at the same sizes");
  add_size_options(compare, cr, false,
                   "model chunks per rank of interleaved-1f1b and zb-v, as train_gpt "
                   "--virtual-stages (default 2; zb-v runs exactly 2); the others run one");
  add_cost_options(compare, costs);
  TimelineRequest t;
  CLI::App* timeline = app.add_subcommand(
      "timeline", "summarise and draw one step of a measured trace (train_gpt --trace)");
  timeline->add_option("--from-trace", t.from, "a Chrome trace of pipeline actions")->required();
  timeline->add_option("--step", t.step, "the step to show (default: the last)");
  timeline->add_flag("--json", o.json, "print one JSON object instead of the table");
  timeline->add_option("--svg", o.svg, "write an SVG timeline to this file");
  timeline->add_option("--trace", o.trace, "write the step alone as a Chrome trace");
  PlanRequest q;
  CLI::App* plan = app.add_subcommand(
      "plan", "search layouts (dp, pp, tp, schedule, chunks, micro-batch, recompute, ZeRO-1/2) "
              "and rank them by predicted step time");
  add_plan_options(plan, q);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 1;  // --help is not an error
  }
  try {
    return run(app, {show, check, csv, sim, compare, timeline, plan}, r, cr, costs, o, t, q);
  } catch (const weft::Error& e) {
    fmt::print(stderr, "weft-sched: {}\n", e.what());
    return 1;
  }
}
