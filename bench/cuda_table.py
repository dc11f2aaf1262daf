#!/usr/bin/env python3
"""One table of weft's and PyTorch's GPU training steps, side by side.

Reads the JSON lines of `bench_cuda --json FILE` and of
`bench/pytorch_gpt_cuda.py --json FILE` (one object per mode) and prints a
markdown table: tokens/s, step ms, MFU, peak GiB, and each row's tokens/s over
torch.compile bf16's (PyTorch's mode "compile-bf16"; "n/a" without it).
Both count FLOPs alike (6 x parameters without wpe + 12 x L x T x C per
token); a note says so when the rows' shapes differ, since then they do not
compare. Needs only the standard library.

    bench/cuda_table.py --weft weft.jsonl --pytorch pytorch.jsonl
    bench/cuda_table.py --weft weft.jsonl --pytorch-note "skipped (no CUDA PyTorch)"
"""

import argparse
import json
import sys

REFERENCE = "compile-bf16"
# What must agree between rows for their speeds to compare.
SHAPE = ("layers", "hidden", "heads", "vocab", "vocab_rows", "batch", "seq_length", "flops_per_token")


def read_rows(path, framework):
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"cuda_table: {path}:{n}: not JSON ({e})")
            if not isinstance(row, dict) or "mode" not in row:
                raise SystemExit(f"cuda_table: {path}:{n}: a row needs a \"mode\"")
            row.setdefault("framework", framework)
            rows.append(row)
    return rows


def table(rows, note=None):
    ref = next((r for r in rows if r.get("framework") == "pytorch" and r.get("mode") == REFERENCE
                and "tokens_per_s" in r), None)
    out = ["| framework | mode | tokens/s | step ms | MFU | peak GiB | tokens/s / torch.compile bf16 |",
           "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        name = r["framework"]
        if "tokens_per_s" not in r:
            why = r.get("skipped") and f"skipped: {r['skipped']}" or r.get("error") and f"error: {r['error']}"
            out.append(f"| {name} | {r['mode']} | {why or 'no result'} | | | | |")
            continue
        peak = r.get("peak_gib")
        ratio = f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}x" if ref else "n/a"
        out.append(f"| {name} | {r['mode']} | {r['tokens_per_s']:.0f} | {r['step_ms']:.1f} | "
                   f"{100 * r['mfu']:.1f}% | {'' if peak is None else format(peak, '.1f')} | {ratio} |")
    if note:
        out.append(f"| pytorch | | {note} | | | | |")
    return "\n".join(out)


def notes(rows):
    timed = [r for r in rows if "tokens_per_s" in r]
    lines = []
    if timed:
        first = timed[0]
        shape = ", ".join(f"{k} {first.get(k)}" for k in SHAPE)
        lines.append(f"shape: {shape}; MFU against {first.get('peak_tflops')} TFLOP/s")
        for r in timed[1:]:
            diff = [k for k in SHAPE if r.get(k) != first.get(k)]
            if diff:
                lines.append(f"note: {r['framework']} {r['mode']} differs from {first['framework']} "
                             f"{first['mode']} in {', '.join(diff)}: these rows do not compare")
    if not any(r.get("framework") == "pytorch" and r.get("mode") == REFERENCE and "tokens_per_s" in r
               for r in rows):
        lines.append(f"note: no timed PyTorch {REFERENCE} row, so no ratios")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--weft", required=True, help="bench_cuda --json's file")
    ap.add_argument("--pytorch", help="bench/pytorch_gpt_cuda.py --json's file")
    ap.add_argument("--pytorch-note",
                    help="one more PyTorch row saying what happened to its run (skipped, timed out)")
    a = ap.parse_args()
    if not a.pytorch and not a.pytorch_note:
        ap.error("give --pytorch FILE, --pytorch-note TEXT, or both")
    rows = read_rows(a.weft, "weft")
    if a.pytorch:
        rows += read_rows(a.pytorch, "pytorch")
    print(table(rows, a.pytorch_note))
    for line in notes(rows):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
