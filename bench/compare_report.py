#!/usr/bin/env python3
"""The table of bench/compare_pytorch.sh, from its JSON lines (one per engine,
model and round): tokens/s per engine as the median over rounds with the
lowest and highest, and weft over PyTorch as the median of the rounds' paired
ratios, with their spread. Exits 1 when the two sides did not build the same
model (parameter count) or did not start from the same loss."""

import json
import math
import statistics
import sys

PAIRS = [("weft fp32", "PyTorch eager"), ("weft fp32", "PyTorch compile"),
         ("weft bf16", "PyTorch bf16")]


def spread(values, fmt):
    return f"{fmt(statistics.median(values))} [{fmt(min(values))}, {fmt(max(values))}]"


def main():
    rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
    by = {}
    for r in rows:
        by.setdefault((r["model"], r["engine"]), {})[r["round"]] = r
    models = sorted({r["model"] for r in rows}, key=lambda m: [r["model"] for r in rows].index(m))
    ok = True
    first = rows[0]
    torch_row = next(r for r in rows if r.get("framework") == "pytorch")
    weft_row = next(r for r in rows if r.get("framework") == "weft")
    print(f"threads {first['threads']}; weft GEMMs on {weft_row['gemm_library']}; "
          f"PyTorch {torch_row['torch_version']} ({torch_row['cpu_capability']} kernels); "
          f"{len({r['round'] for r in rows})} rounds, engines alternated\n")
    print("| model | engine | tokens/s: median [min, max] | params | first loss |")
    print("|---|---|---:|---:|---:|")
    for m in models:
        engines = [e for (mm, e) in by if mm == m]
        params = {by[(m, e)][k]["params"] for e in engines for k in by[(m, e)]}
        if len(params) != 1:
            print(f"error: {m}: the engines built models of {sorted(params)} parameters",
                  file=sys.stderr)
            ok = False
        for e in engines:
            runs = by[(m, e)]
            tps = [runs[k]["tokens_per_s"] for k in sorted(runs)]
            losses = [runs[k]["first_loss"] for k in sorted(runs)]
            print(f"| {m} | {e} | {spread(tps, lambda v: f'{v:,.0f}')} | "
                  f"{runs[min(runs)]['params']:,} | {statistics.median(losses):.4f} |")
        # The first loss is ln(V) plus about half the logits' variance at
        # initialisation (under 0.1 nats for either side's init at V = 256)
        # plus the noise of one batch's mean: the two sides' must agree within
        # 0.1 nats, where a wrong model (a missing block, a head left untied)
        # starts far from ln(V).
        firsts = [by[(m, e)][k]["first_loss"] for e in engines for k in by[(m, e)]]
        if max(firsts) - min(firsts) > 0.1 or abs(statistics.median(firsts) - math.log(256)) > 0.15:
            print(f"error: {m}: first losses {min(firsts):.4f}..{max(firsts):.4f} do not agree "
                  f"with each other and ln(256) = {math.log(256):.4f}", file=sys.stderr)
            ok = False
    print("\n| model | weft / PyTorch | paired ratio: median [min, max] |")
    print("|---|---|---:|")
    for m in models:
        for w, p in PAIRS:
            if (m, w) not in by or (m, p) not in by:
                continue
            rounds = sorted(set(by[(m, w)]) & set(by[(m, p)]))
            ratios = [by[(m, w)][k]["tokens_per_s"] / by[(m, p)][k]["tokens_per_s"] for k in rounds]
            print(f"| {m} | {w} / {p} | {spread(ratios, lambda v: f'{v:.2f}x')} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
