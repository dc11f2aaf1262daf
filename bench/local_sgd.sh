#!/usr/bin/env bash
# Communication-light data parallelism, measured: the sample job's GPT
# (4 x 128, T 64) on the fortunes text at dp 2 (two ranks under mpiexec, one
# thread each, global batch 32), trained the same number of steps with
#   sync      AdamW, gradients all-reduced every step
#   local-4   local SGD with AdamW inside, averaged every 4 steps
#   local-16  the same, every 16 steps
#   diloco-16 DiLoCo: AdamW inside, every 16 steps a Nesterov outer step
#             (outer lr 0.7, momentum 0.9) on start - average
#   local-16-bf16       local-16, each average's deltas and moments in bf16
#   diloco-16-bf16      diloco-16, the same in bf16
#   diloco-16-powersgd  diloco-16, the deltas as rank-4 PowerSGD factors
#                       (error feedback), the moments in fp32
#   ps-s0     parameter server: 2 workers and 1 server (3 ranks), --max-staleness 0
#   ps-s1     the same, --max-staleness 1 (each push an update of its own)
#   ps-s4     the same, --max-staleness 4
#   ps-s4-slow  ps-s4 with worker 1 computing 3x slower (--slow-rank 1 --slow-factor 3)
#   ps-s0-slow  ps-s0 with the same slow worker
# It writes a table (final training and validation loss, this rank's
# data-parallel bytes, median step) and a picture of the loss against steps
# and against bytes into OUT.
#
#   bench/local_sgd.sh [build-dir] [--out DIR] [--steps N] [--only "NAME..."]
#       (default: build, build/local_sgd, 640 steps; about 15 minutes here)
#
# --only runs just the runs named (the others' logs, where an earlier run left
# them in the build directory, join the table as they are).
# The tracked copies in docs/ are updated only on purpose: --out docs.
set -euo pipefail
cd "$(dirname "$0")/.."
build=build
out=
only=
steps=640
while [[ $# -gt 0 ]]; do
  case $1 in
    --out) out=${2:?--out needs a directory}; shift 2 ;;
    --steps) steps=${2:?--steps needs a number}; shift 2 ;;
    --only) only=" ${2:?--only needs run names} "; shift 2 ;;
    *) build=$1; shift ;;
  esac
done
out=${out:-$build/local_sgd}
for exe in train_gpt bench/mpiexec; do
  [[ -x "$build/$exe" ]] || { echo "local_sgd.sh: $build/$exe not found; build first" >&2; exit 1; }
done
if [ ! -s data/fortunes.txt ]; then
  mkdir -p data
  find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' \
    -print0 | sort -z | xargs -0 cat > data/fortunes.txt
fi
[ -s data/fortunes.txt ] || { echo "local_sgd.sh: no fortunes (apt-get install fortunes)" >&2; exit 1; }
mkdir -p "$out"
# The runs' logs stay in the build directory, to draw again without running.
work=$build/local_sgd-runs
mkdir -p "$work"
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE MPIEXEC_TIMEOUT=1200

run() {
  local name=$1 ranks=2
  shift
  [[ -z $only || $only == *" $name "* ]] || return 0
  [[ $name == ps-* ]] && ranks=3
  "$build/bench/mpiexec" -n "$ranks" "$build/train_gpt" --device cpu --threads 1 \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 64 \
    --data-path data/fortunes.txt --micro-batch-size 16 --global-batch-size 32 \
    --train-iters "$steps" --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine \
    --lr-warmup-iters 30 --split 98,2,0 --eval-interval "$steps" --eval-iters 10 \
    --log-interval "$steps" --log-jsonl "$work/$name.jsonl" "$@" >"$work/$name.log" 2>&1 ||
    { echo "local_sgd.sh: $name failed:"; tail -5 "$work/$name.log"; exit 1; }
  echo "ran $name"
}

run sync
run local-4 --local-steps 4
run local-16 --local-steps 16
run diloco-16 --local-steps 16 --outer-optimizer nesterov --outer-lr 0.7 --outer-momentum 0.9
run local-16-bf16 --local-steps 16 --grad-reduce-dtype bf16
diloco=(--local-steps 16 --outer-optimizer nesterov --outer-lr 0.7 --outer-momentum 0.9)
run diloco-16-bf16 "${diloco[@]}" --grad-reduce-dtype bf16
run diloco-16-powersgd "${diloco[@]}" --grad-compression powersgd --powersgd-rank 4
run ps-s0 --ps-ranks 1
run ps-s1 --ps-ranks 1 --max-staleness 1
run ps-s4 --ps-ranks 1 --max-staleness 4
run ps-s0-slow --ps-ranks 1 --slow-rank 1 --slow-factor 3
run ps-s4-slow --ps-ranks 1 --max-staleness 4 --slow-rank 1 --slow-factor 3

logs=()
for name in sync local-4 local-16 diloco-16 local-16-bf16 diloco-16-bf16 diloco-16-powersgd \
  ps-s0 ps-s1 ps-s4 ps-s0-slow ps-s4-slow; do
  [[ -s $work/$name.jsonl ]] && logs+=("$work/$name.jsonl")
done
python3 bench/local_sgd_report.py "$out" "$steps" "${logs[@]}"
echo "wrote $out/local_sgd.md and $out/local_sgd.svg"
