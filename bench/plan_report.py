#!/usr/bin/env python3
"""The planner's predictions against measured runs, and its skill against the simple rules
a user would apply without it, as a markdown report.

bench/plan_validate.sh is the entry point. The protocol is fixed before the run:

1. Calibration, before any row and fitted once: one run at pp 2 (1F1B, the model of
   bench/layouts.sh, 2 ranks) gives the node costs (--profile) and a message's cost; then
   the two calibration layouts, no row, alternate `--runs` times each: dp 4 x pp 2, to
   whose median step the compute scale is fitted (8 processes sharing the cores against
   one profiled alone), and dp 2 x tp 4, to whose median step the wake is fitted (how long
   a rank that waited takes to run again; each round of an all-reduce pays it).
2. Prediction, before any row runs: `weft-sched plan` with those costs ranks every plan for
   the job; each row's prediction (step and bubble) and the planner's top pick are read
   from it.
3. The rows, `--runs` rounds, the order reversed every other round: every plain 8-rank
   layout of bench/layouts.sh (1F1B and ZB-H1 at pp > 1), the options the planner ranks
   (recompute, virtual stages, ZeRO-1, ZeRO-2, sequence parallelism, micro-batch sizes 1
   and 4), and the planner's top pick. A run's step and bubble are the medians of its
   steps after warm-up, a row's the median of its runs.
4. The calibration layouts again, after the rows: how far the machine drifted, reported,
   not used.

The report gives each row's predicted and measured step and bubble with their errors, both
rankings and their Spearman correlation, and the regret (the measured step of a choice over
the best measured row) of the planner's top pick and of three rules: the most tensor
parallelism (tp 8), Megatron's rule of thumb (tp within a node, then pp, then dp: on this
one 8-rank node also tp 8), and the fewest stages (dp 8). Only python3's standard library
is needed.
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sched_report  # noqa: E402  (message_ms, compute_scale, spans, run)

LAYOUTS = [(2, 2, 2), (1, 2, 4), (2, 4, 1), (4, 1, 2), (8, 1, 1), (1, 8, 1), (1, 1, 8)]
SCALE_LAYOUT = (4, 2, 1)
WAKE_LAYOUT = (2, 1, 4)
SHAPE = {"num-layers": 8, "hidden-size": 128, "num-attention-heads": 8, "seq-length": 64,
         "vocab-size": 256}
MICRO_BATCH, GLOBAL = 2, 32


class Row:
    """A layout and the options train_gpt runs it with; key() matches weft-sched plan's JSON."""

    def __init__(self, dp, pp, tp, schedule="1f1b", chunks=1, mb=MICRO_BATCH, recompute=False,
                 zero=0, sp=False, what=""):
        self.dp, self.pp, self.tp, self.chunks, self.mb = dp, pp, tp, chunks, mb
        self.schedule = schedule if pp > 1 else "-"
        self.recompute, self.zero, self.sp, self.what = recompute, zero, sp, what

    @staticmethod
    def of_plan(pl, what=""):
        return Row(pl["dp"], pl["pp"], pl["tp"], pl["schedule"], pl["chunks"],
                   pl["micro_batch"], pl["recompute"],
                   2 if pl["zero2"] else 1 if pl["zero1"] else 0,
                   pl.get("sequence_parallel", False), what)

    def key(self):
        return (self.dp, self.pp, self.tp, self.schedule, self.chunks if self.pp > 1 else 1,
                self.mb, self.recompute, self.zero, self.sp)

    def flags(self):
        f = ["--tp", str(self.tp), "--pp", str(self.pp), "--micro-batch-size", str(self.mb)]
        if self.pp > 1:
            f += ["--schedule", self.schedule, "--virtual-stages", str(self.chunks)]
        if self.recompute:
            f.append("--recompute")
        if self.zero:
            f += ["--data-parallel-sharding-strategy", ["", "optim", "optim_grads"][self.zero]]
        if self.sp:
            f.append("--sequence-parallel")
        return f

    def name(self):
        s = f"({self.dp}, {self.pp}, {self.tp}) {self.schedule}"
        if self.chunks > 1:
            s += f" x{self.chunks}"
        s += f" mb {self.mb}"
        if self.recompute:
            s += " recompute"
        if self.zero:
            s += f" zero-{self.zero}"
        if self.sp:
            s += " sp"
        return s


def rows():
    """The plain layouts of bench/layouts.sh, then the options the planner ranks."""
    out = []
    for dp, pp, tp in LAYOUTS:
        for schedule in (("1f1b", "zb-h1") if pp > 1 else ("1f1b",)):
            out.append(Row(dp, pp, tp, schedule))
    out += [Row(2, 2, 2, "1f1b", recompute=True, what="recompute"),
            Row(2, 4, 1, "interleaved-1f1b", chunks=2, what="virtual stages"),
            Row(8, 1, 1, zero=1, what="ZeRO-1"),
            Row(8, 1, 1, zero=2, what="ZeRO-2"),
            Row(2, 2, 2, "1f1b", sp=True, what="sequence parallelism"),
            Row(8, 1, 1, mb=1, what="micro-batch 1"),
            Row(2, 4, 1, "zb-h1", mb=4, what="micro-batch 4")]
    return out


def model_flags(a):
    flags = []
    for k, v in SHAPE.items():
        if k != "vocab-size":
            flags += [f"--{k}", str(v)]
    return flags + ["--micro-batch-size", str(MICRO_BATCH), "--global-batch-size", str(GLOBAL),
                    "--lr", "1e-3", "--data-path", a.data, "--comm-timeout", "120",
                    "--threads", "1"]


def train(a, ranks, extra, tag, log):
    """(median step ms, median bubble or None, load) after warm-up; extra's flags win."""
    jsonl = os.path.join(a.work, f"{tag}.jsonl")
    cmd = [os.path.join(a.build, "bench", "mpiexec"), "-n", str(ranks),
           os.path.join(a.build, "train_gpt"), *model_flags(a), "--train-iters", str(a.iters),
           "--log-interval", str(a.iters), "--log-jsonl", jsonl, *extra]
    load = os.getloadavg()[0]
    sched_report.run(cmd, log)
    recs = [r for r in map(json.loads, open(jsonl)) if "step" in r][a.warmup:]
    bubbles = [r["bubble_frac"] for r in recs if "bubble_frac" in r]
    return (statistics.median(r["step_ms"] for r in recs),
            statistics.median(bubbles) if bubbles else None, load)


def ranks_of(values):
    """1 for the smallest; ties share the mean rank."""
    order = sorted(range(len(values)), key=lambda k: values[k])
    r = [0.0] * len(values)
    k = 0
    while k < len(order):
        j = k
        while j + 1 < len(order) and values[order[j + 1]] == values[order[k]]:
            j += 1
        for t in range(k, j + 1):
            r[order[t]] = (k + j) / 2 + 1
        k = j + 1
    return r


def spearman(x, y):
    rx, ry = ranks_of(x), ranks_of(y)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    num = sum((p - mx) * (q - my) for p, q in zip(rx, ry))
    den = (sum((p - mx) ** 2 for p in rx) * sum((q - my) ** 2 for q in ry)) ** 0.5
    return num / den if den else 0.0


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", default="build")
    p.add_argument("--out", default="build/plan_validate")
    p.add_argument("--work", required=True)
    p.add_argument("--data", default="data/fortunes.txt")
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--bandwidth", type=float, default=5e9,
                   help="bytes/s between ranks (train_gpt --check-links measured 4.7-7.2 GB/s "
                        "here)")
    p.add_argument("--cores", type=float, default=os.cpu_count())
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    log = os.path.join(a.work, "plan-log.txt")
    started = time.time()
    loads = []

    # 1. Calibration: one traced, profiled run at pp 2, then the two calibration layouts.
    costs = os.path.join(a.work, "plan-cal.costs.json")
    trace = os.path.join(a.work, "plan-cal.trace.json")
    cal_ms, _, cal_load = train(a, 2, ["--pp", "2", "--schedule", "1f1b", "--profile", costs,
                                       "--trace", trace], "plan-cal", log)
    loads.append(cal_load)
    events = sched_report.spans(trace, a.warmup + 1)
    link_ms = sched_report.message_ms(events)
    print(f"calibration: {cal_ms:.0f} ms a step at pp 2; a message {link_ms:.3f} ms", flush=True)

    def plans_of(scale_, wake_s, *fixed):
        cmd = [os.path.join(a.build, "weft-sched"), "plan", "--world-size", "8",
               "--global-batch-size", str(GLOBAL), "--profile", costs, "--link-latency",
               f"{link_ms / 1e3:.9f}", "--bandwidth", str(a.bandwidth), "--cores", str(a.cores),
               "--compute-scale", f"{scale_:.6f}", "--wake", f"{wake_s:.9f}", "--json", "--top",
               "0", *fixed]
        for k, v in SHAPE.items():
            cmd += [f"--{k}", str(v)]
        return json.loads(sched_report.run(cmd, log))

    def layout_ms(layout, scale_, wake_ms_):
        want = Row(*layout).key()
        dp, pp, tp = layout
        fixed = ["--dp", str(dp), "--pp", str(pp), "--tp", str(tp), "--micro-batch-size",
                 str(MICRO_BATCH)]
        return 1e3 * next(pl for pl in plans_of(scale_, wake_ms_ / 1e3, *fixed)
                          if Row.of_plan(pl).key() == want)["step_time"]

    def calibration_runs(tag):
        scale_ms, wake_ms = [], []
        for k in range(a.runs):
            ms, _, load = train(a, 8, Row(*SCALE_LAYOUT).flags(), f"plan-scale-{tag}{k}", log)
            scale_ms.append(ms), loads.append(load)
            ms, _, load = train(a, 8, Row(*WAKE_LAYOUT).flags(), f"plan-wake-{tag}{k}", log)
            wake_ms.append(ms), loads.append(load)
        return scale_ms, wake_ms

    scale_ms, wake_ms = calibration_runs("")
    # The fits, once: the compute scale to the scale layout's median step given the wake, the
    # wake to the wake layout's given the scale; twice, since each moves the other's layout.
    wake = 0.0
    for _ in range(2):
        scale = sched_report.fit(lambda x: layout_ms(SCALE_LAYOUT, x, wake),
                                 statistics.median(scale_ms), 2.0, low=0.05)
        wake = sched_report.fit(lambda w: layout_ms(WAKE_LAYOUT, scale, w),
                                statistics.median(wake_ms), 1.0)
    print(f"8 ranks: F/I/W {scale:.3f}x the profile, fitted to {SCALE_LAYOUT}'s median step "
          f"({statistics.median(scale_ms):.0f} ms); wake {wake:.3f} ms, fitted to "
          f"{WAKE_LAYOUT}'s ({statistics.median(wake_ms):.0f} ms)", flush=True)

    # 2. Prediction, before any row runs.
    plans = plans_of(scale, wake / 1e3)
    by_key = {Row.of_plan(pl).key(): pl for pl in plans}
    table = rows()
    top = Row.of_plan(plans[0], "the planner's top pick")
    top_row = next((r for r in table if r.key() == top.key()), None)
    if top_row is None:
        table.append(top)
        top_row = top
    else:
        top_row.what = (top_row.what + ", " if top_row.what else "") + "the planner's top pick"
    missing = [r.name() for r in table if r.key() not in by_key]
    assert not missing, f"no plan for {missing}"
    # The rules' picks: the most tp (and Megatron's rule of thumb on one node), the fewest
    # stages.
    most_tp = next(r for r in table if r.key() == Row(1, 1, 8).key())
    fewest = next(r for r in table if r.key() == Row(8, 1, 1).key())
    print(f"the planner's top pick: {top_row.name()}", flush=True)

    # 3. The rows.
    measured = {r.key(): [] for r in table}
    bubbles = {r.key(): [] for r in table}
    row_loads = {r.key(): [] for r in table}
    for round_ in range(a.runs):
        order = table if round_ % 2 == 0 else list(reversed(table))
        for n, r in enumerate(order):
            ms, bubble, load = train(a, 8, r.flags(), f"plan-row-{round_}-{n}", log)
            measured[r.key()].append(ms)
            if bubble is not None:
                bubbles[r.key()].append(bubble)
            row_loads[r.key()].append(load)
            loads.append(load)
            print(f"round {round_ + 1}: {r.name()}: {ms:.0f} ms (load {load:.1f})", flush=True)

    # 4. The calibration layouts again: the drift, reported.
    scale_after, wake_after = calibration_runs("after-")

    pred = [1e3 * by_key[r.key()]["step_time"] for r in table]
    meas = [statistics.median(measured[r.key()]) for r in table]
    errors = [(p_ - m_) / m_ for p_, m_ in zip(pred, meas)]
    rp, rm = ranks_of(pred), ranks_of(meas)
    rho = spearman(pred, meas)
    best = min(meas)
    best_row = table[meas.index(best)]

    def regret(r):
        return statistics.median(measured[r.key()]) / best - 1

    out = [
        "<!-- written by bench/plan_validate.sh: change the script, then run it again -->",
        "# The planner against measured runs\n",
        f"`bench/plan_validate.sh` on this machine ({os.cpu_count()} cores, fp32, one thread "
        f"per rank): the model of `bench/layouts.sh` (8 layers, width 128, 8 heads, T = 64, "
        f"vocabulary 256), global batch {GLOBAL}, 8 ranks. One run of a protocol fixed "
        f"before it (`bench/plan_report.py` states it whole): each row ran {a.runs} times "
        f"({a.iters} steps, the first {a.warmup} warm-up; the row order reversed every other "
        f"round); a run's step and bubble are the medians of its steps, a row's the median of "
        f"its runs (fastest and slowest run in brackets). The 1-minute load average read "
        f"{min(loads):.1f}-{max(loads):.1f} at the runs' starts (2 cores: above 2 means "
        f"others were computing too). The script took {(time.time() - started) / 60:.1f} "
        f"minutes.\n",
        f"**Calibrated once, before any row, on no row:** `weft-sched plan --profile` with "
        f"the node costs of one run (1F1B, pp 2, 2 ranks, {cal_ms:.0f} ms a step) and a "
        f"message of {link_ms:.3f} ms from its trace; links of {a.bandwidth / 1e9:g} GB/s "
        f"and {a.cores:g} shared cores; F/I/W at {scale:.3f}x the profile (`--compute-scale`, "
        f"fitted to {SCALE_LAYOUT} 1f1b's median step over {a.runs} runs, "
        f"{statistics.median(scale_ms):.0f} ms) and a wake of {wake:.3f} ms (`--wake`, fitted "
        f"to {WAKE_LAYOUT}'s, {statistics.median(wake_ms):.0f} ms). Every prediction below, "
        f"and the planner's top pick, were fixed before the first row ran. After the rows the "
        f"same two layouts took {statistics.median(scale_after):.0f} and "
        f"{statistics.median(wake_after):.0f} ms: the machine's drift over the run, for "
        f"which no prediction was adjusted.\n",
        "| row | what | predicted ms | measured ms | step error | predicted bubble | measured "
        "bubble | bubble error (points) | predicted rank | measured rank | load |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    bubble_errors = []
    for k, r in enumerate(table):
        ms = measured[r.key()]
        pb = 100 * by_key[r.key()]["bubble"]
        if bubbles[r.key()]:
            mb_ = 100 * statistics.median(bubbles[r.key()])
            bubble_errors.append(pb - mb_)
            btext = f"{pb:.1f}% | {mb_:.1f}% | {pb - mb_:+.1f} |"
        else:
            btext = "- | - | - |"
        out.append(f"| {r.name()} | {r.what or '-'} | {pred[k]:.0f} | {meas[k]:.0f} "
                   f"({min(ms):.0f}-{max(ms):.0f}) | {100 * errors[k]:+.1f}% | {btext} "
                   f"{rp[k]:g} | {rm[k]:g} | "
                   f"{', '.join(f'{x:.1f}' for x in row_loads[r.key()])} |")
    within = sum(abs(e) <= 0.10 for e in errors)
    bubble_within = sum(abs(e) <= 5 for e in bubble_errors)
    out += ["",
            f"Step error mean |{100 * statistics.mean(abs(e) for e in errors):.1f}%|, worst "
            f"{100 * max(abs(e) for e in errors):.1f}%, {within} of {len(errors)} rows within "
            f"the goal of 10%. Bubble error (the pipeline rows) mean "
            f"|{statistics.mean(abs(e) for e in bubble_errors):.1f}| points, worst "
            f"{max(abs(e) for e in bubble_errors):.1f}, {bubble_within} of "
            f"{len(bubble_errors)} within the goal of 5 points. Spearman {rho:.2f} between the "
            f"predicted and measured rankings.\n",
            "**Skill.** Regret: a choice's measured step over the best measured row's "
            f"({best_row.name()}, {best:.0f} ms).\n",
            "| who chooses | choice | measured ms | regret |",
            "|---|---|---:|---:|"]
    for who, r in (("the planner (its top pick)", top_row),
                   ("the most tensor parallelism", most_tp),
                   ("Megatron's rule: tp within a node, then pp, then dp (one 8-rank node: tp 8)",
                    most_tp),
                   ("the fewest stages (pure data parallelism)", fewest)):
        out.append(f"| {who} | {r.name()} | {statistics.median(measured[r.key()]):.0f} | "
                   f"{100 * regret(r):+.1f}% |")
    text = "\n".join(out) + "\n"
    with open(os.path.join(a.out, "plan_validate.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
