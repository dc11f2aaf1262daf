#!/usr/bin/env python3
"""The table and the picture of bench/local_sgd.sh, from its runs' JSONL logs.

    python3 bench/local_sgd_report.py OUT STEPS RUN.jsonl...

Each run's name is its file name. The table gives the mean training loss of
the last 20 steps, the validation loss at the end, this rank's data-parallel
bytes over the run (train_gpt's dp_bytes: a ring all-reduce's share, or a
parameter-server worker's pushed gradients), the median step, and for
parameter servers rank 0's median wait for the parameters and the mean
staleness of its updates. A parameter server's training loss at S > 0 is
worker 0's share scaled to the batch, a noisier estimate. The picture draws the training loss (a 20-step moving mean)
against steps and against bytes. Only python3's standard library is needed.
"""

import json
import os
import statistics
import sys

COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2",
           "#7f7f7f", "#17becf", "#bcbd22", "#393b79", "#ad494a"]


def load(path):
    steps = [r for r in map(json.loads, open(path)) if "step" in r]
    return os.path.splitext(os.path.basename(path))[0], steps


def smooth(values, k=20):
    out, acc = [], []
    for v in values:
        acc.append(v)
        if len(acc) > k:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


def human(b):
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= size:
            return f"{b / size:.1f} {unit}"
    return f"{b:.0f} B"


def panel(x0, series, xlabel, xmax, ymin, ymax, w=420, h=300):
    """One plot at x offset x0: series is [(name, colour, xs, ys)]; values
    outside [ymin, ymax] are drawn at the edge."""
    left, top, pw, ph = x0 + 55, 40, w - 75, h - 90
    sx = lambda x: left + pw * x / xmax  # noqa: E731
    sy = lambda y: top + ph * (1 - (min(max(y, ymin), ymax) - ymin) / (ymax - ymin))  # noqa: E731
    parts = [f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#888"/>']
    for k in range(5):
        y = ymin + (ymax - ymin) * k / 4
        parts.append(f'<text x="{left - 6}" y="{sy(y) + 4:.1f}" text-anchor="end" '
                     f'font-size="11">{y:.2f}</text>')
        xv = xmax * k / 4
        label = human(xv) if "bytes" in xlabel else f"{xv:.0f}"
        parts.append(f'<text x="{sx(xv):.1f}" y="{top + ph + 16}" text-anchor="middle" '
                     f'font-size="11">{label}</text>')
    parts.append(f'<text x="{left + pw / 2}" y="{top + ph + 36}" text-anchor="middle" '
                 f'font-size="12">{xlabel}</text>')
    for name, colour, xs, ys in series:
        pts = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in zip(xs, ys))
        parts.append(f'<polyline points="{pts}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
    return parts


def main():
    out, steps, paths = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    runs = [load(p) for p in paths]
    rows = ["| run | train loss (last 20 steps) | validation loss | dp bytes per rank | "
            "vs sync | median step ms | median wait ms | mean staleness |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    sync_bytes = None
    series_steps, series_bytes = [], []
    lo, hi = float("inf"), 0.0
    for i, (name, recs) in enumerate(runs):
        losses = [r["loss"] for r in recs]
        total = sum(r.get("dp_bytes", 0) for r in recs)
        if sync_bytes is None:
            sync_bytes = total
        val = next((r["val_loss"] for r in reversed(recs) if "val_loss" in r), float("nan"))
        ps = [r for r in recs if "ps_wait_ms" in r]
        wait = f"{statistics.median(r['ps_wait_ms'] for r in ps):.1f}" if ps else "-"
        stale = f"{statistics.mean(r['ps_staleness'] for r in ps):.2f}" if ps else "-"
        rows.append(f"| {name} | {statistics.mean(losses[-20:]):.4f} | {val:.4f} | {human(total)} | "
                    f"{total / sync_bytes:.3f} | {statistics.median(r['step_ms'] for r in recs):.0f} | "
                    f"{wait} | {stale} |")
        sm = smooth(losses)
        cum, acc = [], 0.0
        for r in recs:
            acc += r.get("dp_bytes", 0)
            cum.append(acc)
        colour = COLOURS[i % len(COLOURS)]
        series_steps.append((name, colour, [r["step"] for r in recs], sm))
        series_bytes.append((name, colour, cum, sm))
        tail = sm[len(sm) // 10:] or sm  # the first tenth falls steeply: leave it off the scale
        lo, hi = min(lo, min(tail)), max(hi, max(tail))
    max_bytes = max(s[2][-1] for s in series_bytes) or 1
    height = 314 + 18 * ((len(series_steps) + 4) // 5) + 8  # the legend: five names a row
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="860" height="{height}" '
           'font-family="sans-serif">', f'<rect width="860" height="{height}" fill="white"/>',
           '<text x="430" y="20" text-anchor="middle" font-size="13">training loss (20-step mean),'
           ' dp 2: against steps and against this rank\'s data-parallel bytes</text>']
    svg += panel(0, series_steps, "step", steps, lo, hi)
    svg += panel(430, series_bytes, "bytes sent", max_bytes, lo, hi)
    for i, (name, colour, _, _) in enumerate(series_steps):
        svg.append(f'<text x="{60 + 160 * (i % 5)}" y="{322 + 18 * (i // 5)}" font-size="12" '
                   f'fill="{colour}">{name}</text>')
    svg.append("</svg>")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "local_sgd.svg"), "w") as f:
        f.write("\n".join(svg) + "\n")
    with open(os.path.join(out, "local_sgd.md"), "w") as f:
        f.write("\n".join(rows) + "\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
