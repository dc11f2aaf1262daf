#!/usr/bin/env bash
# The deepest GPT each data-parallel sharding strategy trains on this
# machine's 2 ranks: --data-parallel-sharding-strategy no_shard, optim
# (ZeRO-1), optim_grads (ZeRO-2) and optim_grads_params (ZeRO-3) at dp 2.
#
#   bench/largest_gpt.sh [build-dir] [hidden-size]     (defaults: build, 1024)
#
# Protocol, fixed before the run: GPT of width `hidden-size` (64-wide heads,
# sequences of 128 tokens, the byte vocabulary of 256), one sequence a
# micro-batch, a global batch of 2 (one micro-batch per replica), fp32, one
# thread per rank. The memory per rank is half of MemAvailable less 2 GiB
# (the program, MPI and the data's pages). For each strategy the planner
# (weft-sched plan, with the FLOP model's costs, whose activation bytes equal
# the executor's: Plan.FlopsCostsHoldTheActivationsTheArenasHold) gives the
# most layers whose plan fits that memory; train_gpt then trains that depth
# for 2 steps. Reported: the depth, the parameters, rank 0's training state
# as train_gpt prints it, the planner's memory per rank, the peak resident
# memory of the larger rank (/usr/bin/time), and the second step's time.
# One run; a strategy whose depth does not train says so.
set -euo pipefail
build=${1:-build}
hidden=${2:-1024}
exe="$build/train_gpt"
[[ -x "$exe" ]] || { echo "error: $exe not found; build first: ./scripts/setup.sh" >&2; exit 1; }
[[ -x /usr/bin/time ]] || { echo "error: /usr/bin/time not found (apt-get install time)" >&2; exit 1; }
export MPIEXEC_TIMEOUT=1200 OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
heads=$((hidden / 64))
available_kib=$(awk '/MemAvailable/ {print $2}' /proc/meminfo)
per_rank=$(((available_kib * 1024 - 2 * 1024 * 1024 * 1024) / 2))
python3 -c "print('It is a truth universally acknowledged, that a single man. ' * 400)" >"$work/text.txt"
shape="--hidden-size $hidden --num-attention-heads $heads --seq-length 128 --vocab-size 256"

# The planner's verdict for `layers` under strategy $1: its memory per rank,
# or nothing when no plan fits.
planned() {
  # shellcheck disable=SC2086
  "$build/weft-sched" plan $shape --num-layers "$2" --global-batch-size 2 --world-size 2 \
    --dp 2 --micro-batch-size 1 --flops 1e11 --memory "$per_rank" \
    --data-parallel-sharding-strategy "$1" --json 2>/dev/null |
    python3 -c "import json, sys; p = json.load(sys.stdin); print(p[0]['memory_per_rank'] if p else '')"
}

printf '# the deepest GPT each sharding strategy trains at dp 2 (2 ranks): width %s, %s heads, T 128\n\n' \
  "$hidden" "$heads"
awk -v b="$per_rank" 'BEGIN { printf "memory per rank: %.1f GiB\n\n", b / 2^30 }'
echo "| strategy | layers | parameters | training state on rank 0 | planner's memory per rank | peak RSS | step 2 ms | trained |"
echo "|---|---:|---:|---|---:|---:|---:|---|"
for s in no_shard optim optim_grads optim_grads_params; do
  lo=1 hi=1024  # the deepest that fits lies in [lo, hi)
  [[ -n $(planned "$s" "$lo") ]] || { echo "| $s | none fits | | | | | | |"; continue; }
  while ((hi - lo > 1)); do
    mid=$(((lo + hi) / 2))
    if [[ -n $(planned "$s" "$mid") ]]; then lo=$mid; else hi=$mid; fi
  done
  predicted=$(planned "$s" "$lo")
  out="$work/$s.txt"
  ok=yes
  # shellcheck disable=SC2086
  "$build/bench/mpiexec" -n 2 sh -c '/usr/bin/time -f "%M" -o "$0.$PMI_RANK" "$@"' \
    "$work/rss-$s" "$exe" $shape --num-layers "$lo" --micro-batch-size 1 --global-batch-size 2 \
    --train-iters 2 --lr 1e-4 --threads 1 --comm-timeout 900 --data-path "$work/text.txt" \
    --data-parallel-sharding-strategy "$s" --log-jsonl "$work/$s.jsonl" >"$out" 2>&1 || ok=no
  params=$(sed -n 's/.*| params \([0-9]*\) |.*/\1/p' "$out" | head -1)
  state=$(sed -n 's/.*training state on rank 0 ([^)]*): .*; \(.*\) in all/\1/p' "$out" | head -1)
  rss=$(cat "$work"/rss-"$s".* 2>/dev/null | awk '{ if ($NF > m) m = $NF } END { printf "%.1f GiB", m / 2^20 }')
  step=$(python3 -c "
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '\"step_ms\"' in l]
print(f\"{rows[-1]['step_ms']:.0f}\" if len(rows) >= 2 else '')" "$work/$s.jsonl" 2>/dev/null || true)
  printf '| %s | %s | %s | %s | %s | %s | %s | %s |\n' "$s" "$lo" "${params:-}" "${state:-}" \
    "$(awk -v b="$predicted" 'BEGIN { printf "%.1f GiB", b / 2^30 }')" "$rss" "${step:-}" "$ok"
  [[ $ok == yes ]] || tail -n 5 "$out" >&2
done
