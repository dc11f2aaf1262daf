#!/usr/bin/env bash
# weft against a current PyTorch on the same GPT, same machine, same threads.
#
#   bench/compare_pytorch.sh [rounds] [threads]        (default 5 rounds, 2 threads)
#
# PyTorch comes from PyPI, in a virtual environment at $TORCH_VENV (default
# .torch-venv, ignored by git), made on the first run with `pip install torch`
# (a download of several GiB). Debian's python3-torch (1.13) is not used: it
# has neither fused AdamW nor a compiler, and runs its GEMMs slower.
#
# Engines, each a fresh process per round (median of 10 steps after 3
# warm-up steps; torch.compile's compilation falls in its warm-up):
#   weft fp32       bench_train: fp32, GEMMs on the library the build chose
#   weft bf16       bench_train --bf16: train_gpt --bf16's recipe
#   PyTorch eager   fp32, SDPA attention, bias inside the GEMM (addmm), fused AdamW
#   PyTorch compile the same under torch.compile
#   PyTorch bf16    eager under torch.autocast("cpu", bfloat16)
# The order of the engines turns by one each round, so no engine always runs
# first or after the same neighbour. Each round's ratio pairs weft with
# PyTorch from the same round; the report gives medians with their spread,
# and checks that both sides built the same model (parameter count) and
# started from the same loss (the first step's, before any update).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
threads=${2:-2}
venv=${TORCH_VENV:-.torch-venv}
if ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
  echo "compare_pytorch: installing PyTorch from PyPI into $venv (several GiB)" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet torch numpy
fi
py="$venv/bin/python"
[ -x build/bench/bench_train ] || ./scripts/setup.sh >/dev/null
export OMP_WAIT_POLICY=PASSIVE
out=$(mktemp /tmp/compare_pytorch.XXXXXX.jsonl)
trap 'rm -f "$out"' EXIT

declare -A shape=([mini]="4 256 4 128" [small]="6 384 6 256")
engines=("weft fp32" "PyTorch eager" "weft bf16" "PyTorch compile" "PyTorch bf16")
run() {  # run MODEL ROUND ENGINE: one JSON line, tagged, into $out
  local model=$1 round=$2 engine=$3 L C H T line
  read -r L C H T <<<"${shape[$model]}"
  case $engine in
    "weft fp32") line=$(build/bench/bench_train --model "$model" --micro-batch-size 8 \
        --threads "$threads" --warmup 3 --steps 10 --json --no-gemm | tail -n 1) ;;
    "weft bf16") line=$(build/bench/bench_train --model "$model" --micro-batch-size 8 \
        --threads "$threads" --warmup 3 --steps 10 --json --no-gemm --bf16 | tail -n 1) ;;
    *)
      local mode=eager precision=fp32
      [ "$engine" = "PyTorch compile" ] && mode=compile
      [ "$engine" = "PyTorch bf16" ] && precision=bf16
      line=$("$py" bench/pytorch_gpt.py --num-layers "$L" --hidden-size "$C" --num-heads "$H" \
        --seq-length "$T" --micro-batch-size 8 --threads "$threads" --warmup 3 --steps 10 \
        --mode "$mode" --precision "$precision" 2>/dev/null | tail -n 1) ;;
  esac
  "$py" -c 'import json, sys; d = json.loads(sys.argv[1]); d.update(model=sys.argv[2], round=int(sys.argv[3]), engine=sys.argv[4]); print(json.dumps(d))' \
    "$line" "$model" "$round" "$engine" >>"$out"
}
for ((r = 0; r < rounds; ++r)); do
  for model in mini small; do
    for ((i = 0; i < ${#engines[@]}; ++i)); do
      run "$model" "$r" "${engines[(i + r) % ${#engines[@]}]}"
    done
  done
  echo "compare_pytorch: round $((r + 1))/$rounds done" >&2
done
"$py" bench/compare_report.py "$out"
