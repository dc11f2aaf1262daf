#!/usr/bin/env python3
"""Pipeline schedules measured against simulated, as a markdown report.

bench/schedules.sh is the entry point. For every (pp, schedule, micro-batches)
it runs train_gpt under mpiexec with --trace, --log-jsonl and --profile (the
median step after warm-up, the memory peaks, and its plan: which nodes each
stage holds and the bytes each action adds).

The simulator is calibrated on runs that are no row (1F1B with 6
micro-batches at every pp, where the rows have 2, 4 and 8), and every
row is a prediction of a run it never saw: other schedules, micro-batch
counts and pp. From the first (medians over their runs) come each graph
node's F, I and W time (--profile), the update's time per parameter byte and
the time of a message already sent when its receive starts. Each calibration
run gives a compute scale: how much slower F, I and W ran than those node
costs say (`--compute-scale`; at pp 2 its actions summed over the profile's,
at every other pp fitted to its step, since ranks that outnumber cores also
slow each other down beyond sharing them).

The calibration is fitted once per pp: its compute scale is the median
over all its calibration runs, and every row at that pp is predicted with
it. The machine's speed drifts within minutes by more than the goal, so
the runs go in --runs rounds; in each, every pp's rows run in pairs with a
calibration run before, between and after them: the calibration's median
sees the whole run's drift, and no row is fitted to the runs beside it.
Each row's bubble error is reported beside its step error. A row's stage costs are the calibration's
node costs summed over the row's stages; its own profile supplies only the
layout and bytes. `weft-sched simulate --cores` (this machine's cores)
shares the cores among the ranks that compute at once, which is what pp 4
on 2 cores does. Each row's trace is summarised and drawn with
`weft-sched timeline`.

It writes schedules.md and the SVG timelines next to it into --docs (by
default build/schedules; bench/schedules.sh --out docs updates the tracked
page), and renders one of them to PNG with rsvg-convert (librsvg2-bin) when
that is installed.
Only python3's standard library is needed.
"""
import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v"]
TWO_CHUNKS = {"interleaved-1f1b", "zb-v"}
COMPUTE = {"F", "I", "W", "B"}
CALIBRATION = ("1f1b", 2, 6)  # schedule, pp, micro-batches: the run the costs come from
# Where ranks outnumber cores, F, I and W run at another speed than the
# profile's, beyond the share of a core each gets (switching processes,
# caches shared among more of them). That depends on how many processes
# share a core, so at every other pp the calibration runs are 1F1B with 6
# micro-batches too (the rows have 2, 4 and 8: no calibration run is a
# row), and the compute scale is fitted to their steps.
SCALE_MICRO_BATCHES = 6


class Failed(RuntimeError):
    pass


def run(cmd, log, timeout=900):
    """Runs cmd, appending its output to log; raises Failed naming its first error line."""
    start = time.time()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=timeout)
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n{p.stdout}\n[{time.time() - start:.1f} s, "
                f"exit {p.returncode}]\n")
    if p.returncode != 0:
        errors = [line for line in p.stdout.splitlines() if "error" in line]
        raise Failed(errors[0] if errors else f"{cmd[0]}: exit {p.returncode}")
    return p.stdout


# --- sharing the machine ---
# Other people's builds on these two cores would slow part of a run down: the
# profile and not the steps, or the other way round. Before each run the
# script waits for the machine to go quiet; during it, it counts the CPU time
# that was not its own, and runs again (a few times at most) when that
# exceeds a share.

def busy_cpu_seconds():
    """CPU seconds every process on the machine has used since boot."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def wait_for_quiet(a):
    """Waits (up to --max-wait seconds) for 3 s in a row in which others use < 10% of the CPUs."""
    deadline, quiet = time.time() + a.max_wait, 0
    while quiet < 3 and time.time() < deadline:
        before = busy_cpu_seconds()
        time.sleep(1)
        quiet = quiet + 1 if (busy_cpu_seconds() - before) / os.cpu_count() < 0.1 else 0


def quiet_run(a, cmd, log):
    """run() on a quiet machine; returns its output and the share of the CPUs others used."""
    for attempt in range(a.retries + 1):
        wait_for_quiet(a)
        start, busy, own = time.time(), busy_cpu_seconds(), own_cpu_seconds()
        out = run(cmd, log)
        wall = time.time() - start
        others = max(0.0, (busy_cpu_seconds() - busy) - (own_cpu_seconds() - own))
        others /= wall * os.cpu_count()
        if others <= a.max_others:
            break
        with open(log, "a") as f:
            f.write(f"[others used {100 * others:.0f}% of the CPUs: again]\n")
    return out, others


def chunks_of(name):
    return 2 if name in TWO_CHUNKS else 1


def train_cmd(a, pp, name, m, *extra):
    return [os.path.join(a.build, "bench", "mpiexec"), "-n", str(pp), a.train_gpt,
            "--model", a.model, "--num-layers", str(a.layers), "--data-path", a.data, "--pp", str(pp), "--schedule", name,
            "--virtual-stages", str(chunks_of(name)), "--micro-batch-size", str(a.micro_batch),
            "--global-batch-size", str(a.micro_batch * m), "--threads", "1",
            "--comm-timeout", str(a.comm_timeout), *extra]


# --- reading a run ---

def spans(trace_path, first_step):
    """Complete events of the steps from first_step on."""
    return [e for e in json.load(open(trace_path))["traceEvents"]
            if e.get("ph") == "X" and e["args"]["step"] >= first_step]


def parse_action(name):
    """'2SEND_F0' -> ('SEND_F', 2, 0); 'STEP' -> ('STEP', -1, -1)."""
    i = 0
    while i < len(name) and name[i].isdigit():
        i += 1
    j = len(name)
    while j > i and name[j - 1].isdigit():
        j -= 1
    return name[i:j], int(name[:i] or -1), int(name[j:] or -1)


def message_ms(events):
    """Median time of a receive whose send had started before it: a message's cost here."""
    sent = {}
    for e in events:
        kind, stage, mb = parse_action(e["name"])
        if kind.startswith("SEND_"):
            sent[(e["args"]["step"], kind[-1], stage, mb)] = e["ts"]
    times = []
    for e in events:
        kind, stage, mb = parse_action(e["name"])
        if not kind.startswith("RECV_"):
            continue
        src = stage - 1 if kind == "RECV_F" else stage + 1
        t = sent.get((e["args"]["step"], kind[-1], src, mb))
        if t is not None and t <= e["ts"]:
            times.append(e["dur"] / 1e3)
    return statistics.median(times) if times else 0.0


def compute_scale(events, costs):
    """The F/I/W/B actions' measured time over what the profile says they take, summed.

    A sum, not a typical action: a step lasts as long as all of its actions,
    the few that a descheduled rank stretched included."""
    stages = json.load(open(costs))["stages"]
    measured = profiled = 0.0
    for e in events:
        kind, stage, _ = parse_action(e["name"])
        if kind not in COMPUTE:
            continue
        s = stages[stage]
        measured += e["dur"] / 1e6
        profiled += s["i"] + s["w"] if kind == "B" else s[kind.lower()]
    return measured / profiled


# --- one row ---

def pooled_costs(a, runs):
    """A costs file whose node F, I and W times and stage updates are the medians over
    runs of the same layout (the calibration runs); its path."""
    first = json.load(open(runs[0]["costs"]))
    every = [json.load(open(r["costs"])) for r in runs]
    for k, node in enumerate(first["nodes"]):
        for key in ("f", "i", "w"):
            node[key] = statistics.median(c["nodes"][k][key] for c in every)
    for k, st in enumerate(first["stages"]):
        for key in ("f", "i", "w", "update"):
            st[key] = statistics.median(c["stages"][k][key] for c in every)
    path = os.path.join(a.work, "calibration.pooled.json")
    with open(path, "w") as f:
        json.dump(first, f, indent=1)
    return path


def calibrated_costs(a, calibration, row):
    """The row's stages with the calibration run's node costs: a --costs file.

    Per stage: F, I and W summed over the calibration profile's nodes from the
    stage's first to its last; the update at the calibration's seconds per
    parameter byte. Only the layout and bytes come from the row's own profile."""
    cal = json.load(open(calibration["costs"]))
    nodes = {n["name"]: k for k, n in enumerate(cal["nodes"])}
    cal_params = cal_update = 0.0
    for st in cal["stages"]:
        span = cal["nodes"][nodes[st["first"]]:nodes[st["last"]] + 1]
        cal_params += sum(n["param_bytes"] for n in span)
        cal_update += st["update"]
    per_byte = cal_update / cal_params
    out = json.load(open(row["costs"]))
    out.pop("nodes", None)
    for st in out["stages"]:
        span = cal["nodes"][nodes[st["first"]]:nodes[st["last"]] + 1]
        for key in ("f", "i", "w"):
            st[key] = sum(n[key] for n in span)
        st["update"] = per_byte * sum(n["param_bytes"] for n in span)
    path = row["costs"][:-len(".json")] + ".calibrated.json"
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    return path


def median_run(runs):
    """Of a row's runs, the one whose median step is the median one (its trace, profile,
    bubble and peaks), with the runs' fastest and slowest median step."""
    ranked = sorted(runs, key=lambda r: r["step_ms"])
    mid = dict(ranked[len(ranked) // 2])
    mid["spread"] = (ranked[0]["step_ms"], ranked[-1]["step_ms"])
    mid["others"] = max(r["others"] for r in runs)
    return mid


def measure_once(a, pp, name, m, log, run_index):
    """One traced and profiled run: median step and bubble after warm-up, memory peaks."""
    tag = f"{name}-pp{pp}-m{m}-{run_index}"
    jsonl, trace, costs = (os.path.join(a.work, f"{tag}.{ext}")
                           for ext in ("jsonl", "trace.json", "costs.json"))
    steps = a.warmup + a.steps
    out, others = quiet_run(a, train_cmd(a, pp, name, m, "--train-iters", str(steps),
                                         "--log-interval", str(steps), "--log-jsonl", jsonl,
                                         "--trace", trace, "--profile", costs), log)
    records = [r for r in map(json.loads, open(jsonl)) if "step" in r][a.warmup:]
    step_ms = [r["step_ms"] for r in records]
    # The step whose time is the median one (the upper middle of an even count) is drawn.
    drawn = sorted(records, key=lambda r: r["step_ms"])[len(records) // 2]["step"]
    peaks = ""
    for line in out.splitlines():
        if line.startswith("activation memory, peak per pipeline rank"):
            peaks = line.split("[", 1)[1].split("]", 1)[0].replace(", ", ",")
    return {"others": others, "step_ms": statistics.median(step_ms),
            "spread": (min(step_ms), max(step_ms)),
            "bubble": statistics.median(r["bubble_frac"] for r in records), "peaks": peaks,
            "trace": trace, "costs": costs, "drawn_step": drawn}


def simulate(a, pp, name, m, costs, svg, log, scale):
    cmd = [a.weft_sched, "simulate", "--schedule", name, "--pp", str(pp), "--micro-batches",
           str(m), "--virtual-stages", str(chunks_of(name)), "--costs", costs, "--cost-comm",
           f"{a.link_ms:.6f}", "--compute-scale", f"{scale:.6f}", "--cores", str(a.cores),
           "--json", "--svg", svg]
    return json.loads(run(cmd, log))


def fit(predict, measured, high, low=0.0):
    """The x in [low, high] where predict(x), increasing, meets measured (low if it starts
    above; high doubles until predict reaches measured)."""
    if predict(low) >= measured:
        return low
    while predict(high) < measured and high < 1e6:
        high *= 2
    for _ in range(30):
        mid = (low + high) / 2
        low, high = (mid, high) if predict(mid) < measured else (low, mid)
    return (low + high) / 2


def fit_scale(a, calibration, pp, name, m, meas, log):
    """The compute scale with which the simulator gives this run's measured step."""
    costs = calibrated_costs(a, calibration, meas)
    svg = os.path.join(a.work, f"fit-{name}-pp{pp}-m{m}.svg")
    return fit(lambda x: simulate(a, pp, name, m, costs, svg, log, x)["step_time"],
               meas["step_ms"], 2.0, low=0.05)


def timeline(a, trace, step, svg, log):
    cmd = [a.weft_sched, "timeline", "--from-trace", trace, "--step", str(step), "--json",
           "--svg", svg]
    return json.loads(run(cmd, log))


def format_bytes(b):
    """As weft::format_bytes prints sizes (weft/units.h)."""
    if b < 1024:
        return f"{b:g} B"
    units, value, unit = ["KiB", "MiB", "GiB", "TiB", "PiB"], b / 1024, 0
    while value >= 1023.95 and unit + 1 < len(units):
        value, unit = value / 1024, unit + 1
    return f"{value:.1f} {units[unit]}"


def sim_held(sim):
    return ",".join(format_bytes(b) for b in sim["peak_activation_bytes"])


HEADER = ["pp", "schedule", "m", "step ms", "sim ms", "error", "span ms", "sim span", "error",
          "bubble", "sim bubble", "held", "sim held", "sim stash", "actions", "scale", "others",
          "bubble error"]


def pct(x):
    return f"{100 * x:+.1f}%"


def row_markdown(r):
    """One table row; a row whose run or simulation failed says why in its step cell."""
    sim, meas = r.get("sim"), r.get("meas")
    cells = [str(r["pp"]), r["schedule"], str(r["m"])] + [""] * (len(HEADER) - 3)
    if meas:
        lo, hi = meas["spread"]
        cells[3] = f"{meas['step_ms']:.0f} ({lo:.0f}-{hi:.0f})"
        cells[9] = f"{100 * meas['bubble']:.1f}%"
        cells[11] = meas["peaks"]
        cells[16] = f"{100 * meas['others']:.0f}%"
    if "failed" in r:
        cells[3] = (cells[3] + " " if meas else "") + "failed: " + r["failed"].replace("|", "/")
    if sim:
        cells[4] = f"{sim['step_time']:.0f}"
        cells[7] = f"{sim['pipeline_time']:.0f}"
        cells[10] = f"{100 * sim['bubble_fraction']:.1f}%"
        cells[12] = sim_held(sim)
        cells[13] = ",".join(str(p) for p in sim["peak_activations"])
    if "error" in r:
        cells[5] = pct(r["error"])
        cells[6] = f"{r['span']:.0f}"
        cells[8] = pct((sim["pipeline_time"] - r["span"]) / r["span"])
        cells[14] = f"{meas['actions']:.2f}x"
        cells[15] = f"{r['scale']:.2f}x"
        cells[17] = f"{100 * (sim['bubble_fraction'] - meas['bubble']):+.1f}"
    return "| " + " | ".join(cells) + " |"


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", default="build")
    p.add_argument("--docs", default="build/schedules",
                   help="where schedules.md and the timelines go (docs: the tracked page)")
    p.add_argument("--work", required=True)
    p.add_argument("--model", default="mini")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--data", default="data/fortunes.txt")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--pp2", default="2,4,8", help="micro-batch counts at pp 2")
    p.add_argument("--pp4", default="4,8", help="micro-batch counts at pp 4 ('' to skip)")
    p.add_argument("--draw", default="8", help="micro-batch count whose timelines go in docs")
    p.add_argument("--comm-timeout", type=int, default=30,
                   help="seconds train_gpt waits for a message before failing")
    p.add_argument("--max-wait", type=float, default=120,
                   help="seconds to wait for a quiet machine before each run")
    p.add_argument("--max-others", type=float, default=0.05,
                   help="share of the CPUs others may use during a run before it is run again")
    p.add_argument("--retries", type=int, default=2)
    p.add_argument("--runs", type=int, default=3,
                   help="runs of each row (and of each calibration run); the median counts")
    p.add_argument("--cores", type=float, default=os.cpu_count(),
                   help="cores the simulated ranks share (default: this machine's)")
    a = p.parse_args()
    a.train_gpt = os.path.join(a.build, "train_gpt")
    a.weft_sched = os.path.join(a.build, "weft-sched")
    log = os.path.join(a.work, "log.txt")
    os.makedirs(a.docs, exist_ok=True)
    grid = [(2, int(m)) for m in a.pp2.split(",") if m] + \
           [(4, int(m)) for m in a.pp4.split(",") if m]
    started = time.time()

    # Measure everything first (every run also profiles its plan), in --runs rounds. In
    # each round, each pp's rows run in pairs with a calibration run between the pairs
    # and at both ends: C R R C R R ... C. This machine's speed drifts by more than the
    # goal within minutes (one run's actions ran 1.00x-0.85x the profile over 5
    # minutes), so a row's compute scale is the mean of the two calibration runs of its
    # round that bracket it, measured within a minute of it.
    cal_name, cal_pp, cal_m = CALIBRATION
    cal_m_at = {cal_pp: cal_m, **{pp: SCALE_MICRO_BATCHES for pp, _ in grid if pp != cal_pp}}
    a.load = [os.getloadavg()[0]]
    rows = [{"pp": pp, "schedule": name, "m": m, "drawn": str(m) == a.draw,
             "prefix": f"sched-{name}-pp{pp}-m{m}", "runs": []}
            for pp, m in grid for name in SCHEDULES]
    cal_runs = {pp: [] for pp in cal_m_at}  # (sequence number, run), in time order
    seq = 0

    def calibrate(pp):
        nonlocal seq
        cal_runs[pp].append((seq, measure_once(a, pp, cal_name, cal_m_at[pp], log,
                                               f"cal{len(cal_runs[pp])}")))
        seq += 1

    for k in range(a.runs):
        for pp in sorted(cal_m_at):
            calibrate(pp)
            mine = [r for r in rows if r["pp"] == pp]
            for i, r in enumerate(mine):
                if "failed" not in r:
                    try:
                        run = measure_once(a, pp, r["schedule"], r["m"], log, k)
                        run["seq"] = seq
                        r["runs"].append(run)
                    except (Failed, subprocess.TimeoutExpired) as e:
                        r["failed"] = str(e)
                    seq += 1
                    a.load.append(os.getloadavg()[0])
                if i % 2 == 1 or i == len(mine) - 1:
                    calibrate(pp)
            print(f"round {k + 1} of {a.runs} measured at pp {pp}", flush=True)

    # The node costs, update and message cost: the medians over every run at the
    # calibration's pp. Each calibration run's compute scale is then its actions against
    # those node costs (at the calibration's pp), or the scale with which the simulator
    # gives its step (at every other pp).
    calibration = {"costs": pooled_costs(a, [run for _, run in cal_runs[cal_pp]])}
    a.link_ms = statistics.median(
        message_ms(spans(run["trace"], a.warmup + 1)) for _, run in cal_runs[cal_pp])
    scales = {}
    for pp, runs in cal_runs.items():
        for at, run in runs:
            if pp == cal_pp:
                costs = calibrated_costs(a, calibration, run)
                x = compute_scale(spans(run["trace"], a.warmup + 1), costs)
            else:
                x = fit_scale(a, calibration, pp, cal_name, cal_m_at[pp], run, log)
            scales.setdefault(pp, []).append((at, x))
    a.scale = {pp: (min(x for _, x in xs), statistics.median(x for _, x in xs),
                    max(x for _, x in xs)) for pp, xs in scales.items()}
    print(f"calibration: a message takes {a.link_ms:.3f} ms; F/I/W run " +
          ", ".join(f"{lo:.3f}x-{hi:.3f}x the profile at pp {pp}"
                    for pp, (lo, _, hi) in sorted(a.scale.items())), flush=True)

    for r in rows:
        pp, name, m = r["pp"], r["schedule"], r["m"]
        prefix = os.path.join(a.docs if r["drawn"] else a.work, r["prefix"])
        try:
            if not r["runs"]:
                raise Failed("not measured")
            meas = r["meas"] = median_run(r["runs"])
            costs = calibrated_costs(a, calibration, meas)
            # The pp's one scale, fitted once to all its calibration runs.
            r["scale"] = a.scale[pp][1]
            r["sim"] = simulate(a, pp, name, m, costs, prefix + "-simulated.svg", log,
                                r["scale"])
            tl = timeline(a, meas["trace"], meas["drawn_step"], prefix + "-measured.svg", log)
            r["span"] = tl["step_time"]
            meas["actions"] = compute_scale(spans(meas["trace"], a.warmup + 1), costs)
            r["error"] = (r["sim"]["step_time"] - meas["step_ms"]) / meas["step_ms"]
        except (Failed, KeyError) as e:
            r["failed"] = str(e)
        print(row_markdown(r), flush=True)
    png = render_png(a, rows, log)
    write_report(a, rows, time.time() - started, png)


def render_png(a, rows, log):
    """ZB-H1's measured timeline at pp 2 as a PNG, when rsvg-convert is here; its name or None."""
    for r in rows:
        if r["drawn"] and r["pp"] == 2 and r["schedule"] == "zb-h1" and "meas" in r:
            if not shutil.which("rsvg-convert"):
                return None
            svg = os.path.join(a.docs, r["prefix"] + "-measured.svg")
            run(["rsvg-convert", "--background-color=white", svg, "-o", svg[:-4] + ".png"], log)
            return os.path.basename(svg[:-4] + ".png")
    return None


def write_report(a, rows, seconds, png):
    ok = [r for r in rows if "sim" in r and "meas" in r and "error" in r]
    load = f"{min(a.load):.1f}-{max(a.load):.1f}"
    cal_name, cal_pp, cal_m = CALIBRATION
    out = [
        "<!-- written by bench/schedules.sh --out docs: change the script, then run it again -->",
        "# Pipeline schedules: measured against simulated\n",
        *([f"![ZB-H1 on two ranks, measured: forward blue, input gradient green, weight "
           f"gradient orange, idle white]({png})\n"] if png else []),
        f"`bench/schedules.sh` on this machine ({os.cpu_count()} cores, fp32, one thread per "
        f"rank): GPT `--model {a.model} --num-layers {a.layers}` ({a.layers} blocks of width "
        f"256, T = 128), micro-batches of {a.micro_batch} sequences, uniform partition. Each "
        f"row is `mpiexec -n pp train_gpt --pp pp --schedule S --trace --log-jsonl --profile "
        f"costs.json`, {a.warmup} warm-up and {a.steps} measured steps, against `weft-sched "
        f"simulate --costs --cores {a.cores:g}`. The whole script took {seconds / 60:.1f} "
        f"minutes, waits for a quiet machine included; the 1-minute load average "
        f"(`/proc/loadavg`) read {load} between runs.\n",
        f"**Out of sample.** The simulator is calibrated on runs that are no row: {cal_name} "
        f"at pp {cal_pp} with {cal_m} micro-batches, and at every other pp {cal_name} with "
        f"{SCALE_MICRO_BATCHES}. From the first come each graph node's F, I and W time (its "
        f"`--profile`, the median over those runs), summed over each row's stages (the row's "
        f"own profile gives only which nodes a stage holds and the bytes); the parameter "
        f"update at their seconds per parameter byte; and a message's cost, "
        f"{a.link_ms:.3f} ms (`--cost-comm`; the median receive whose send had already "
        f"started). A calibration run's **compute scale** (`--compute-scale`) is how much "
        f"slower F, I and W ran than those node costs say: at pp {cal_pp} the sum of its "
        f"actions over the profile's, which absorbs the difference between timing layers "
        f"with rank 0 alone and running both ranks at once; at every other pp the one value "
        f"with which the simulator gives its step, since ranks that outnumber cores slow each "
        f"other beyond sharing them. Ranks share the {a.cores:g} cores: while n ranks compute "
        f"at once, each runs at 1 / ceil(n / {a.cores:g}) of its profiled speed once n "
        f"exceeds them (the share of the busiest core; waiting and messages take no core), "
        f"which matters at pp 4.\n",
        f"**Fitted once.** This VM's speed wanders by more than the goal within minutes, so "
        f"the calibration runs are spread through the measurement: each of the {a.runs} "
        f"rounds runs each pp's rows in pairs, with a calibration run before, between and "
        f"after the pairs. Each pp's compute scale is the median over all its calibration "
        f"runs, and every row at that pp is predicted with that one value (its **scale**): "
        f"no row is fitted to the runs beside it. Over this script the calibration runs' "
        f"scales ranged " +
        ", ".join(f"{lo:.3f}x-{hi:.3f}x (median {mid:.3f}x) at pp {pp}"
                  for pp, (lo, mid, hi) in sorted(a.scale.items())) + ".\n",
        f"Columns: **step** is train_gpt's `step_ms`, the median of {a.runs} runs' median "
        "measured step (the fastest and slowest run's in brackets), update included; "
        "**sim** the simulated step; "
        "**span** the pipeline alone, first action to last, in the trace of the median step "
        "(`weft-sched timeline`) of the median run, and **sim span** the simulator's; each **error** is "
        "simulated against measured. **bubble**: idle share of all ranks during the "
        "pipeline (measured: the median `bubble_frac` of the JSONL). **held**: the most "
        "activation bytes each rank's arenas held at once (measured by the executor), and "
        "**sim held** the simulator's, from the bytes each action added in the profile; "
        "**sim stash**: the most micro-batch stages each rank holds at once. **actions**: the run's F, I, W and B summed "
        "against their profiled time (what `--compute-scale` would have to be for this row), "
        "and **scale** the one it was predicted with. "
        "**bubble error**: the simulated bubble less the measured, in points (the goal: "
        "within 5). **others**: the share of the machine's CPU time "
        "that other processes used during the run (the script waits for a quiet machine "
        f"and runs a row again, up to {a.retries} times, when others took more than "
        f"{100 * a.max_others:.0f}%).\n",
        "| " + " | ".join(HEADER) + " |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|---:|---:|---:|---:|",
    ]
    out.extend(row_markdown(r) for r in rows)
    out.append("")
    for pp in sorted({r["pp"] for r in ok}):
        errs = [abs(r["error"]) for r in ok if r["pp"] == pp]
        berrs = [abs(r["sim"]["bubble_fraction"] - r["meas"]["bubble"]) for r in ok
                 if r["pp"] == pp]
        out.append(f"pp {pp}: mean |error| {100 * statistics.mean(errs):.1f}%, worst "
                   f"{100 * max(errs):.1f}%, {sum(e <= 0.10 for e in errs)} of {len(errs)} "
                   f"measured rows within 10%; bubble error mean "
                   f"{100 * statistics.mean(berrs):.1f} points, worst {100 * max(berrs):.1f}, "
                   f"{sum(e <= 0.05 for e in berrs)} of {len(berrs)} within 5.\n")
    stash_ok = sum(r["meas"]["peaks"] == sim_held(r["sim"]) for r in ok)
    out.append("## Reading the numbers\n")
    out.append(
        "- At pp 2 every rank has a core of its own; at pp 4 four ranks share "
        f"{os.cpu_count()} cores, and the simulator shares them as the machine does "
        "(**actions** shows how much slower F, I and W ran than profiled).")
    out.append(
        f"- The held bytes agree in {stash_ok} of {len(ok)} rows: the simulator and the "
        f"executor free a micro-batch's memory at the same action.")
    out.append(
        "- Other people's processes on the machine slow a run down as extra ranks would; "
        "the **others** column and the load average say how much there was.")
    out.append(
        "- The bubble columns count the pipeline only, as train_gpt's `bubble_frac` does; the "
        "step columns include each rank's parameter update, which the simulator adds after "
        "the pipeline drains (grey in the simulated timelines).\n")
    out.append("## Timelines\n")
    out.append(f"{a.draw} micro-batches. Measured (the median step of the trace, drawn by "
               "`weft-sched timeline`) above simulated (`weft-sched simulate --svg`). Blue: "
               "forward; green: input gradient; orange: weight gradient; teal: full backward "
               "(I + W); grey: the parameter update; white: idle.\n")
    for r in rows:
        if not r["drawn"] or "sim" not in r:
            continue
        out.append(f"### {r['schedule']}, pp {r['pp']}\n")
        if "meas" in r:
            out.append(f"![{r['schedule']} measured]({r['prefix']}-measured.svg)\n")
        out.append(f"![{r['schedule']} simulated]({r['prefix']}-simulated.svg)\n")
    with open(os.path.join(a.docs, "schedules.md"), "w") as f:
        f.write("\n".join(out))


if __name__ == "__main__":
    sys.exit(main())
