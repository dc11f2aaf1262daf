#!/usr/bin/env bash
# What each recompute option costs in step time and saves in activation
# memory, against keeping every activation, in the same run: one process
# (pp 1) and pp 2 with 1F1B, one thread per rank.
#
#   bench/recompute.sh [build-dir]      (default: build)
#
# The options alternate over three rounds; the steps after the first two of
# each run are pooled and their median (and the range of the three runs'
# medians) is reported. The memory is the run's peak of activation bytes on
# pipeline rank 0 as train_gpt prints it (the arenas' bytes, which the
# schedule's memory model equals): the same in every round.
set -euo pipefail
build=${1:-build}
exe="$build/train_gpt"
[[ -x "$exe" ]] || { echo "error: $exe not found; build first: ./scripts/setup.sh" >&2; exit 1; }
data=/usr/share/games/fortunes/fortunes
[[ -f $data ]] || { echo "error: $data not found (apt-get install fortunes)" >&2; exit 1; }
export MPIEXEC_TIMEOUT=600 OMP_WAIT_POLICY=PASSIVE
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
model="--num-layers 8 --hidden-size 128 --num-attention-heads 8 --seq-length 128 \
  --micro-batch-size 4 --global-batch-size 16 --lr 1e-3 --data-path $data --comm-timeout 120 \
  --threads 1 --train-iters 10"
options=("none|" "uniform 1|--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
  "uniform 2|--recompute-granularity full --recompute-method uniform --recompute-num-layers 2"
  "block 2|--recompute-granularity full --recompute-method block --recompute-num-layers 2"
  "selective|--recompute-granularity selective")

echo "# recompute options, on $(getconf _NPROCESSORS_ONLN) cores (8 x 128 GPT, T 128, 4 micro-batches of 4)"
echo
echo "| pp | recompute | activation peak, rank 0 | vs none | step ms (median, range of 3 runs) | vs none |"
echo "|---:|---|---:|---:|---:|---:|"
for pp in 1 2; do
  for round in 1 2 3; do
    for k in "${!options[@]}"; do
      flags=${options[$k]#*|}
      name="$pp-$k-$round"
      # shellcheck disable=SC2086
      "$build/bench/mpiexec" -n "$pp" "$exe" $model --pp "$pp" $flags \
        --log-jsonl "$work/$name.jsonl" >"$work/$name.log" 2>&1 ||
        { echo "error: $name failed:"; tail -5 "$work/$name.log"; exit 1; }
    done
  done
  labels=$(printf '%s\n' "${options[@]}" | cut -d'|' -f1 | paste -sd,)
  python3 - "$pp" "$work" "$labels" "${#options[@]}" <<'PY'
import glob, json, re, statistics, sys
pp, work, labels, n = sys.argv[1], sys.argv[2], sys.argv[3].split(","), int(sys.argv[4])
units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
def peak(k):
    text = open(f"{work}/{pp}-{k}-1.log").read()
    m = re.search(r"activation memory, peak per pipeline rank: \[([0-9.]+) (\w+)", text)
    return float(m.group(1)) * units[m.group(2)]
def steps(k):
    pooled, medians = [], []
    for f in sorted(glob.glob(f"{work}/{pp}-{k}-*.jsonl")):
        ms = [r["step_ms"] for r in map(json.loads, open(f)) if "step" in r][2:]
        pooled += ms
        medians.append(statistics.median(ms))
    return statistics.median(pooled), min(medians), max(medians)
base_mem, (base_ms, _, _) = peak(0), steps(0)
for k in range(n):
    mem, (ms, lo, hi) = peak(k), steps(k)
    print(f"| {pp} | {labels[k]} | {mem / 2**20:.2f} MiB | {mem / base_mem:.2f} | "
          f"{ms:.1f} ({lo:.1f}-{hi:.1f}) | {ms / base_ms:.2f} |")
PY
done
