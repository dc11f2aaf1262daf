#!/usr/bin/env python3
"""The planner's predictions against measured runs, as a markdown report.

bench/plan_validate.sh is the entry point. One calibration run (1F1B, pp 2,
the model of bench/layouts.sh) gives the node costs (--profile), a message's
cost and the compute scale, as bench/sched_report.py measures them; two more
8-rank runs that are no row give two values fitted to their steps: the
compute scale of 8 processes sharing the cores (dp 4 x pp 2), and the wake
(dp 2 x tp 4: how long a rank that waited takes to run again; each round of
an all-reduce pays it). Those two layouts run inside every round of the
measurement, since the machine's speed drifts within minutes: a row's run is
predicted with the median compute scale of the four runs nearest it. Then
`weft-sched plan` predicts every 8-rank layout of bench/layouts.sh (the same
model, micro-batch size and global batch, on this machine's cores), and each
layout runs `--runs` times under mpiexec; a run's step is the median step
after warm-up, a layout's the median of its runs. The report gives each
layout's predicted and measured step, the error, both rankings and their
Spearman correlation, and the 1-minute load average (/proc/loadavg) beside
every run. Only python3's standard library is needed.
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
# Two values are fitted to 8-rank runs that are no row, each to its layout's
# step: the compute scale (how much slower F, I and W run while 8 processes
# share the cores than the profile, timed alone, says) to dp 4 x pp 2, which
# has no tensor parallelism; then the wake (how long a rank that waited takes
# to run again; every round of an all-reduce pays it) to dp 2 x tp 4.
SCALE_LAYOUT = (4, 2, 1)
WAKE_LAYOUT = (2, 1, 4)
SHAPE = {"num-layers": 8, "hidden-size": 128, "num-attention-heads": 8, "seq-length": 64,
         "vocab-size": 256}
MICRO_BATCH, GLOBAL = 2, 32


def rows():
    """(dp, pp, tp, schedule) as bench/layouts.sh runs them."""
    for dp, pp, tp in LAYOUTS:
        for schedule in ("1f1b", "zb-h1"):
            if pp == 1 and schedule != "1f1b":
                continue
            yield dp, pp, tp, schedule if pp > 1 else "-"


def model_flags(a):
    flags = []
    for k, v in SHAPE.items():
        if k != "vocab-size":
            flags += [f"--{k}", str(v)]
    return flags + ["--micro-batch-size", str(MICRO_BATCH), "--global-batch-size", str(GLOBAL),
                    "--lr", "1e-3", "--data-path", a.data, "--comm-timeout", "120",
                    "--threads", "1"]


def train(a, ranks, extra, tag, log):
    jsonl = os.path.join(a.work, f"{tag}.jsonl")
    cmd = [os.path.join(a.build, "bench", "mpiexec"), "-n", str(ranks),
           os.path.join(a.build, "train_gpt"), *model_flags(a), "--train-iters", str(a.iters),
           "--log-interval", str(a.iters), "--log-jsonl", jsonl, *extra]
    load = os.getloadavg()[0]
    sched_report.run(cmd, log)
    steps = [r["step_ms"] for r in map(json.loads, open(jsonl)) if "step" in r][a.warmup:]
    return statistics.median(steps), load


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

    # Calibration: one traced, profiled run at pp 2.
    costs = os.path.join(a.work, "plan-cal.costs.json")
    trace = os.path.join(a.work, "plan-cal.trace.json")
    cal_ms, cal_load = train(a, 2, ["--pp", "2", "--schedule", "1f1b", "--profile", costs,
                                    "--trace", trace], "plan-cal", log)
    events = sched_report.spans(trace, a.warmup + 1)
    link_ms = sched_report.message_ms(events)
    scale = sched_report.compute_scale(events, costs)
    print(f"calibration: {cal_ms:.0f} ms a step at pp 2; a message {link_ms:.3f} ms; F/I/W "
          f"{scale:.3f}x the profile", flush=True)

    def plans_of(scale_, wake_s, *fixed):
        cmd = [os.path.join(a.build, "weft-sched"), "plan", "--world-size", "8",
               "--global-batch-size", str(GLOBAL), "--micro-batch-size", str(MICRO_BATCH),
               "--profile", costs, "--link-latency", f"{link_ms / 1e3:.9f}", "--bandwidth",
               str(a.bandwidth), "--cores", str(a.cores), "--compute-scale", f"{scale_:.6f}",
               "--wake", f"{wake_s:.9f}", "--json", "--top", "0", *fixed]
        for k, v in SHAPE.items():
            cmd += [f"--{k}", str(v)]
        return json.loads(sched_report.run(cmd, log))

    def plain(pl):
        return not pl["recompute"] and not pl["zero1"] and pl["chunks"] == 1

    def layout_ms(layout, scale_, wake_ms_):
        dp, pp, tp = layout
        fixed = ["--dp", str(dp), "--pp", str(pp), "--tp", str(tp)]
        if pp > 1:
            fixed += ["--schedule", "1f1b"]
        return 1e3 * next(pl for pl in plans_of(scale_, wake_ms_ / 1e3, *fixed)
                          if plain(pl))["step_time"]

    # Measurement, in --runs rounds over every layout. This machine's speed drifts by more
    # than the goal within minutes, so each round also runs the two calibration layouts:
    # the compute-scale layout before, between and after pairs of rows (S W R R S R R S
    # ... S), the wake layout once after the first. A row's run is predicted with the median
    # compute scale of the four scale runs nearest it (two before, two after: it follows
    # the drift, and one run that went slow does not move it); the wake is the median of
    # the rounds'.
    table = list(rows())
    measured = {r: [] for r in table}
    loads = {r: [] for r in table}
    scale_runs, wake_runs = [], []  # (sequence number, ms, load); (round, ms, load)
    seq = 0

    def extra_of(dp, pp, tp, schedule):
        return ["--tp", str(tp), "--pp", str(pp)] + (["--schedule", schedule] if pp > 1 else [])

    def scale_run():
        nonlocal seq
        ms, load = train(a, 8, extra_of(*SCALE_LAYOUT, "1f1b"), f"plan-scale-{seq}", log)
        scale_runs.append((seq, ms, load))
        seq += 1

    for round_ in range(a.runs):
        scale_run()
        ms, load = train(a, 8, extra_of(*WAKE_LAYOUT, "-"), f"plan-wake-{round_}", log)
        wake_runs.append((seq, ms, load))
        seq += 1
        for i, r in enumerate(table):
            dp, pp, tp, schedule = r
            ms, load = train(a, 8, extra_of(dp, pp, tp, schedule),
                             f"plan-{dp}{pp}{tp}{schedule}-{round_}", log)
            measured[r].append((seq, ms))
            loads[r].append(load)
            seq += 1
            print(f"round {round_ + 1}: ({dp}, {pp}, {tp}) {schedule}: {ms:.0f} ms (load "
                  f"{load:.1f})", flush=True)
            if i % 2 == 1 or i == len(table) - 1:
                scale_run()

    def near(at):
        """The two scale runs before sequence number at and the two after."""
        before = [k for k, (t, _, _) in enumerate(scale_runs) if t < at]
        after = [k for k, (t, _, _) in enumerate(scale_runs) if t > at]
        return before[-2:] + after[:2]

    # The fits: each scale run's compute scale given the wake, then each round's wake given
    # the scales nearest its wake run; twice, since each moves the other's layout a little.
    wake = 0.0
    for _ in range(2):
        scales = [sched_report.fit(lambda x: layout_ms(SCALE_LAYOUT, x, wake), ms, 2.0, low=0.05)
                  for _, ms, _ in scale_runs]
        wakes = []
        for at, ms, _ in wake_runs:
            x = statistics.median(scales[k] for k in near(at))
            wakes.append(sched_report.fit(lambda w: layout_ms(WAKE_LAYOUT, x, w), ms, 1.0))
        wake = statistics.median(wakes)
    scale8 = statistics.median(scales)
    print(f"8 ranks: F/I/W {min(scales):.3f}x-{max(scales):.3f}x the profile (median "
          f"{scale8:.3f}x), fitted to {SCALE_LAYOUT}'s steps; wake {wake:.3f} ms, fitted to "
          f"{WAKE_LAYOUT}'s", flush=True)

    # Prediction: each row run's layout at its scale, at the bench's micro-batch size, no
    # recompute or ZeRO-1; a row's prediction is the median of its runs'.
    best = plans_of(scale8, wake / 1e3)[0]
    predicted = {}
    for r in table:
        dp, pp, tp, schedule = r
        fixed = ["--dp", str(dp), "--pp", str(pp), "--tp", str(tp)]
        if pp > 1:
            fixed += ["--schedule", schedule]
        runs = []
        for at, _ in measured[r]:
            x = statistics.median(scales[k] for k in near(at))
            runs.append(1e3 * next(pl for pl in plans_of(x, wake / 1e3, *fixed)
                                   if plain(pl))["step_time"])
        predicted[r] = statistics.median(runs)
    measured = {r: [ms for _, ms in runs] for r, runs in measured.items()}
    scale_ms = statistics.median(ms for _, ms, _ in scale_runs)
    wake_ms = statistics.median(ms for _, ms, _ in wake_runs)
    scale_loads = [load for _, _, load in scale_runs]
    wake_loads = [load for _, _, load in wake_runs]

    pred = [predicted[r] for r in table]
    meas = [statistics.median(measured[r]) for r in table]
    errors = [(p_ - m_) / m_ for p_, m_ in zip(pred, meas)]
    rp, rm = ranks_of(pred), ranks_of(meas)
    rho = spearman(pred, meas)
    all_loads = [x for r in table for x in loads[r]] + [cal_load] + scale_loads + wake_loads
    out = [
        "<!-- written by bench/plan_validate.sh: change the script, then run it again -->",
        "# The planner against measured runs\n",
        f"`bench/plan_validate.sh` on this machine ({os.cpu_count()} cores, fp32, one thread "
        f"per rank): the model of `bench/layouts.sh` (8 layers, width 128, 8 heads, T = 64, "
        f"vocabulary 256), micro-batches of {MICRO_BATCH}, global batch {GLOBAL}, 8 ranks. "
        f"Each layout ran {a.runs} times ({a.iters} steps, the first {a.warmup} warm-up); a "
        f"run's step is the median of its steps, a layout's the median of its runs (fastest "
        f"and slowest run in brackets). The 1-minute load average read "
        f"{min(all_loads):.1f}-{max(all_loads):.1f} at the runs' starts (2 cores: above 2 "
        f"means others were computing too). The script took {(time.time() - started) / 60:.1f} "
        f"minutes.\n",
        f"**Predicted** by `weft-sched plan --profile` from one calibration run (1F1B, pp 2, "
        f"{cal_ms:.0f} ms a step): its node costs and a message of {link_ms:.3f} ms; links "
        f"of {a.bandwidth / 1e9:g} GB/s and {a.cores:g} shared cores; and two values fitted "
        f"to the steps of two more 8-rank layouts that are no row: F/I/W at "
        f"{min(scales):.3f}x-{max(scales):.3f}x the profile (median {scale8:.3f}x; "
        f"`--compute-scale`, what 8 processes sharing the cores cost against one profiled "
        f"alone) to {SCALE_LAYOUT} 1f1b's steps (median {scale_ms:.0f} ms), and a wake of "
        f"{wake:.3f} ms (`--wake`: the time a rank that waited takes to run again, paid by "
        f"every round of an all-reduce) to {WAKE_LAYOUT}'s (median {wake_ms:.0f} ms). No "
        f"measured row below was used to calibrate.\n",
        f"**The machine drifts.** This VM's speed wanders by more than the goal within "
        f"minutes, so the calibration layouts run inside every round: {SCALE_LAYOUT} before, "
        f"between and after each pair of rows, {WAKE_LAYOUT} once after the first. A row's "
        f"run is predicted with the median compute scale of the four {SCALE_LAYOUT} runs "
        f"nearest it (two before, two after), and a row's prediction is the median of its runs'; the wake is the median of "
        f"the rounds'.\n",
        "| layout (dp, pp, tp) | schedule | predicted ms | measured ms | error | predicted rank "
        "| measured rank | load |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for k, r in enumerate(table):
        dp, pp, tp, schedule = r
        lo, hi = min(measured[r]), max(measured[r])
        out.append(f"| ({dp}, {pp}, {tp}) | {schedule} | {pred[k]:.0f} | {meas[k]:.0f} "
                   f"({lo:.0f}-{hi:.0f}) | {100 * errors[k]:+.1f}% | {rp[k]:g} | {rm[k]:g} | "
                   f"{', '.join(f'{x:.1f}' for x in loads[r])} |")
    within = sum(abs(e) <= 0.15 for e in errors)
    summary = (f"Spearman {rho:.2f} between the predicted and measured rankings; step error mean "
               f"|{100 * statistics.mean(abs(e) for e in errors):.1f}%|, worst "
               f"{100 * max(abs(e) for e in errors):.1f}%, {within} of {len(errors)} layouts "
               f"within 15%.")
    out += ["", summary + "\n",
            f"The planner's own choice over every layout, schedule, chunk count, micro-batch "
            f"size, recompute and ZeRO-1 for this job: {' '.join(best['flags'])} (predicted "
            f"{1e3 * best['step_time']:.0f} ms).\n"]
    text = "\n".join(out)
    with open(os.path.join(a.out, "plan_validate.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
