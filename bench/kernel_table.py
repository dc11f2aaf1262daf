#!/usr/bin/env python3
"""Where one GPU training step's time goes, kernel by kernel.

Reads the CSV that Nsight Compute writes for

    ncu --profile-from-start off --metrics gpu__time_duration.sum --csv \
        --print-units base --log-file step.csv \
        bench_cuda --modes bf16+fused --steps 1 --kernel-profile

(one row per kernel launch of one step; bench_cuda opens the profiler's
range around that step alone) and prints a markdown table: kernels grouped
by name (parameter lists dropped; each template instantiation is a row of
its own), their launches, summed GPU time
and share, largest first, then the totals. A kernel's time here is its own
duration with nothing else running beside it (the profiler serialises
launches), so the sum is the step's GPU work, not its wall time: gaps, host
waits and overlap are not in it. Needs only the standard library.

    bench/kernel_table.py step.csv [--top 30]
"""

import argparse
import csv
import sys

SCALE = {"ns": 1e-9, "nsecond": 1e-9, "us": 1e-6, "usecond": 1e-6, "ms": 1e-3,
         "msecond": 1e-3, "s": 1.0, "second": 1.0}


def short_name(name, width=110):
    """A kernel's name without its parameter list: template arguments stay
    (cuBLAS's CUTLASS kernels are named by them), so each instantiation of a
    kernel body is a row of its own."""
    name = name.replace("(anonymous namespace)::", "")
    if name.startswith("void "):
        name = name[len("void "):]
    # Drop the last top-level "(...)": the parameter list.
    depth, cut = 0, len(name)
    for i, ch in enumerate(name):
        if ch in "<(":
            if ch == "(" and depth == 0:
                cut = i
            depth += 1
        elif ch in ">)":
            depth = max(0, depth - 1)
    short = name[:cut].strip() or name
    return short if len(short) <= width else short[:width - 3] + "..."


def read_launches(path):
    """(kernel name, seconds) for every launch in an ncu --csv log."""
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    # ncu's own messages (==PROF==, ==WARNING==) come before the CSV's header.
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if start is None:
        raise SystemExit(f"kernel_table: {path}: no CSV header (a line starting \"ID\"): "
                         "did ncu record any kernel? (bench_cuda --kernel-profile, "
                         "ncu --profile-from-start off --csv)")
    launches = []
    for n, row in enumerate(csv.DictReader(lines[start:]), start + 2):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = (row.get("Metric Unit") or "").strip()
        if unit not in SCALE:
            raise SystemExit(f"kernel_table: {path}:{n}: unit '{unit}' is not one of "
                             f"{', '.join(sorted(SCALE))}")
        try:
            value = float((row.get("Metric Value") or "").replace(",", ""))
        except ValueError:
            raise SystemExit(f"kernel_table: {path}:{n}: metric value "
                             f"'{row.get('Metric Value')}' is not a number")
        launches.append((row.get("Kernel Name") or "?", value * SCALE[unit]))
    if not launches:
        raise SystemExit(f"kernel_table: {path}: no gpu__time_duration.sum rows")
    return launches


def table(launches, top):
    groups = {}
    for name, seconds in launches:
        g = groups.setdefault(short_name(name), [0, 0.0])
        g[0] += 1
        g[1] += seconds
    total = sum(s for _, s in launches)
    rows = sorted(groups.items(), key=lambda kv: -kv[1][1])
    out = ["| kernel | launches | ms | share |", "|---|---:|---:|---:|"]
    for name, (count, seconds) in rows[:top]:
        out.append(f"| `{name}` | {count} | {seconds * 1e3:.2f} | {100 * seconds / total:.1f}% |")
    if len(rows) > top:
        rest = rows[top:]
        count = sum(c for _, (c, _) in rest)
        seconds = sum(s for _, (_, s) in rest)
        out.append(f"| {len(rest)} other kernels | {count} | {seconds * 1e3:.2f} | "
                   f"{100 * seconds / total:.1f}% |")
    out.append(f"| **all kernels of the step** | **{len(launches)}** | **{total * 1e3:.2f}** | "
               "**100%** |")
    return "\n".join(out)


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv", help="ncu --csv --log-file output")
    p.add_argument("--top", type=int, default=30, help="rows before the rest (default 30)")
    a = p.parse_args(argv)
    if a.top < 1:
        raise SystemExit(f"kernel_table: --top ({a.top}) must be at least 1")
    print(table(read_launches(a.csv), a.top))


if __name__ == "__main__":
    main(sys.argv[1:])
