#!/usr/bin/env bash
# What posting pipeline receives ahead (--overlap-p2p-comm) does to the step,
# against posting each receive when its action comes (the default), in the
# same run: pp 2 and 4, 1F1B, ZB-H1 and
# interleaved 1F1B, 8 micro-batches, one thread per rank.
#
#   bench/p2p_overlap.sh [build-dir]      (default: build)
#
# Modes alternate over three rounds and the steps after the first two of
# each run are pooled: the median step and the median idle share of the
# pipeline (bubble_frac). On a machine with fewer cores than ranks the ranks
# share cores, and a receive that waits gives its core to a rank that computes.
set -euo pipefail
build=${1:-build}
exe="$build/train_gpt"
[[ -x "$exe" ]] || { echo "error: $exe not found; build first: ./scripts/setup.sh" >&2; exit 1; }
data=/usr/share/games/fortunes/fortunes
[[ -f $data ]] || { echo "error: $data not found (apt-get install fortunes)" >&2; exit 1; }
export MPIEXEC_TIMEOUT=600 OMP_WAIT_POLICY=PASSIVE
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
model="--num-layers 8 --hidden-size 128 --num-attention-heads 8 --seq-length 64 \
  --micro-batch-size 2 --global-batch-size 16 --lr 1e-3 --data-path $data --comm-timeout 120 \
  --threads 1 --train-iters 12"

echo "# pipeline receives posted ahead, on $(getconf _NPROCESSORS_ONLN) cores (8 x 128 GPT, T 64, 8 micro-batches)"
echo
echo "| pp | schedule | step ms, ahead | step ms, in place | ratio | bubble, ahead | bubble, in place |"
echo "|---:|---|---:|---:|---:|---:|---:|"
for pp in 2 4; do
  for schedule in 1f1b zb-h1 interleaved-1f1b; do
    for round in 1 2 3; do
      for mode in ahead in-place; do
        name="$pp-$schedule-$mode-$round"
        flag=$([[ $mode == ahead ]] && echo --overlap-p2p-comm || true)
        # shellcheck disable=SC2086
        "$build/bench/mpiexec" -n "$pp" "$exe" $model --pp "$pp" --schedule "$schedule" \
          $flag --log-jsonl "$work/$name.jsonl" >"$work/$name.log" 2>&1 ||
          { echo "error: $name failed:"; tail -5 "$work/$name.log"; exit 1; }
      done
    done
    python3 - "$pp" "$schedule" "$work" <<'PY'
import glob, json, statistics, sys
pp, schedule, work = sys.argv[1:]
def pooled(mode):
    rows = [r for f in glob.glob(f"{work}/{pp}-{schedule}-{mode}-*.jsonl")
            for r in [r for r in map(json.loads, open(f)) if "step" in r][2:]]
    return (statistics.median(r["step_ms"] for r in rows),
            statistics.median(r["bubble_frac"] for r in rows))
(a, ba), (b, bb) = pooled("ahead"), pooled("in-place")
print(f"| {pp} | {schedule} | {a:.1f} | {b:.1f} | {a / b:.3f} | {100 * ba:.1f}% | {100 * bb:.1f}% |")
PY
  done
done
