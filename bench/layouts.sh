#!/usr/bin/env bash
# Tokens/s of train_gpt in every dp x pp x tp layout of 8 ranks, against one
# process on the same machine in the same run, and how much of the
# data-parallel gradient reduction the bucket overlap hides behind the
# backward pass.
#
#   bench/layouts.sh [build-dir]      (default: build)
#
# Each figure is the median over the steps after the first two (warm-up).
# On a machine with fewer cores than ranks the ranks share cores, so the
# table measures the engine's overheads under oversubscription, not a
# speed-up: read the ratios against the one-process baseline.
set -euo pipefail
build=${1:-build}
exe="$build/train_gpt"
if [[ ! -x "$exe" ]]; then
  echo "error: $exe not found; build first: meson setup $build && ninja -C $build" >&2
  exit 1
fi
export MPIEXEC_TIMEOUT=600 OMP_WAIT_POLICY=PASSIVE
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
data=/usr/share/games/fortunes/fortunes
[[ -f $data ]] || { echo "error: $data not found (apt-get install fortunes)" >&2; exit 1; }
cores=$(getconf _NPROCESSORS_ONLN)
model="--num-layers 8 --hidden-size 128 --num-attention-heads 8 --seq-length 64 \
  --micro-batch-size 2 --global-batch-size 32 --lr 1e-3 --data-path $data --comm-timeout 120"
iters=8

# run NAME RANKS FLAGS...: one JSONL per configuration.
run() {
  local name=$1 ranks=$2
  shift 2
  local cmd=("$exe" $model --train-iters $iters --log-jsonl "$work/$name.jsonl" "$@")
  if ((ranks > 1)); then cmd=("$build/bench/mpiexec" -n "$ranks" "${cmd[@]}"); fi
  "${cmd[@]}" >"$work/$name.log" 2>&1 || { echo "error: $name failed:"; tail -5 "$work/$name.log"; exit 1; }
}

# median FIELD NAME: the median of FIELD over steps 3.. of NAME's log.
median() {
  python3 - "$work/$2.jsonl" "$1" <<'EOF'
import json, statistics, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if "step" in r][2:]
vals = [r[sys.argv[2]] for r in rows if sys.argv[2] in r]
print(f"{statistics.median(vals):.1f}" if vals else "-")
EOF
}

echo "# train_gpt layouts on $cores cores (8 x 128 GPT, T 64, global batch 32)"
echo
run single 1 --threads "$cores"
base=$(median tokens_per_s single)
echo "| layout (dp, pp, tp) | schedule | tokens/s | vs one process | step ms |"
echo "|---|---|---:|---:|---:|"
echo "| one process, $cores threads | - | $base | 1.00 | $(median step_ms single) |"
for layout in "2 2 2" "1 2 4" "2 4 1" "4 1 2" "8 1 1" "1 8 1" "1 1 8"; do
  read -r dp pp tp <<<"$layout"
  for schedule in 1f1b zb-h1; do
    ((pp == 1)) && [[ $schedule != 1f1b ]] && continue
    name="l${dp}${pp}${tp}$schedule"
    # shellcheck disable=SC2046
    run "$name" 8 --tp "$tp" --pp "$pp" $( ((pp > 1)) && echo --schedule "$schedule") --threads 1
    tps=$(median tokens_per_s "$name")
    ratio=$(python3 -c "print(f'{$tps / $base:.2f}')")
    echo "| ($dp, $pp, $tp) | $( ((pp > 1)) && echo "$schedule" || echo -) | $tps | $ratio | $(median step_ms "$name") |"
  done
done

echo
echo "# data-parallel bucket overlap (dp 2, one thread per rank, 64k-element buckets)"
echo
# Three alternating rounds each, pooled: two ranks on two cores are noisy.
for round in 1 2 3; do
  for mode in no-overlap-grad-reduce overlap-grad-reduce; do
    run "dp-$mode-$round" 2 --threads 1 --ddp-bucket-size 65536 "--$mode" --train-iters 14
  done
done
echo "| overlap | step ms | waiting for the reduction after the backward, ms |"
echo "|---|---:|---:|"
for mode in no-overlap-grad-reduce overlap-grad-reduce; do
  python3 - "$mode" "$work"/dp-"$mode"-*.jsonl <<'EOF'
import json, statistics, sys
rows = [r for f in sys.argv[2:]
        for r in [r for r in map(json.loads, open(f)) if "step" in r][2:]]
step = statistics.median(r["step_ms"] for r in rows)
wait = statistics.median(r["dp_wait_ms"] for r in rows)
print(f"| {sys.argv[1]} | {step:.1f} | {wait:.1f} |")
EOF
done
