#!/usr/bin/env bash
# weft against PyTorch on the same GPT, same machine, same threads, in one run.
# Prints a markdown table. Needs python3 with torch (Debian: python3-torch).
# Each runs as it runs best: weft with its defaults (one OpenMP pool shared with
# OpenBLAS), PyTorch with set_num_threads and OMP_WAIT_POLICY=PASSIVE, without
# which its OpenMP threads spin against its BLAS threads.
#   bench/compare_pytorch.sh [threads]
set -euo pipefail
cd "$(dirname "$0")/.."
threads=${1:-2}
py=${PYTHON:-python3}
if ! "$py" -c 'import torch' 2>/dev/null; then
  if /usr/bin/python3 -c 'import torch' 2>/dev/null; then py=/usr/bin/python3; else
    echo "compare_pytorch: needs torch (apt-get install python3-torch)" >&2; exit 1; fi
fi
[ -x build/bench/bench_train ] || ./scripts/setup.sh >/dev/null

declare -A shape=([mini]="4 256 4 128" [small]="6 384 6 256")
echo "| model | layers x width | T | B | weft tokens/s | weft GFLOP/s | PyTorch tokens/s | PyTorch GFLOP/s | weft / PyTorch |"
echo "|---|---|---:|---:|---:|---:|---:|---:|---:|"
for model in mini small; do
  read -r L C H T <<<"${shape[$model]}"
  B=8
  w=$(build/bench/bench_train --model "$model" --micro-batch-size $B \
        --threads "$threads" --steps 5 --json --no-gemm | tail -n 1)
  p=$(OMP_WAIT_POLICY=PASSIVE "$py" bench/pytorch_gpt.py --num-layers "$L" --hidden-size "$C" \
        --num-heads "$H" --seq-length "$T" --micro-batch-size $B --threads "$threads" --steps 5)
  "$py" - "$model" "$L" "$C" "$T" "$B" "$w" "$p" <<'PY'
import json, sys
model, L, C, T, B, w, p = sys.argv[1:]
w, p = json.loads(w), json.loads(p)
print(f"| {model} | {L} x {C} | {T} | {B} | {w['tokens_per_s']:.0f} | {w['gflops']:.1f} | "
      f"{p['tokens_per_s']:.0f} | {p['gflops']:.1f} | {w['tokens_per_s'] / p['tokens_per_s']:.2f}x |")
PY
done
