#!/usr/bin/env bash
# How long a checkpoint save holds training: synchronous saves against
# --async-save, in the same run, on one process (one writer) and on 2 ranks
# (dp 2: two writers, each writing its own slices).
#
#   bench/save_stall.sh [build-dir] [rounds]      (defaults: build, 2)
#
# Protocol, fixed before the run: GPT --model small (10.8M parameters, a
# 125 MB checkpoint with AdamW's moments), --save-interval 2 over 8 steps (4
# saves a run), one thread per rank. The two sides alternate, sync first,
# for `rounds` rounds; every save's stall (train_gpt's "training stalled X
# ms") is pooled per side and layout, and the median, the range and the
# median step time of the same runs are reported. The stall of an async
# save is the host copies of the rank's slices (plus, for a save that comes
# before the previous one is written, the wait for it).
# shellcheck source=bench/preamble.sh
source "$(dirname "$0")/preamble.sh" "$@"
model="--model small --micro-batch-size 4 --global-batch-size 8 --data-path $data --threads 1 \
  --train-iters 8 --save-interval 2 --comm-timeout 120"

echo "# save stall, on $(getconf _NPROCESSORS_ONLN) cores: GPT --model small, a save every 2 steps"
echo
echo "| ranks | save | saves | stall ms (median) | range | step ms (median) | stall / step |"
echo "|---:|---|---:|---:|---:|---:|---:|"
for ranks in 1 2; do
  for round in $(seq "$rounds"); do
    for side in sync async; do
      flags=""
      [[ $side == async ]] && flags="--async-save"
      out="$work/$ranks-$side-$round.txt"
      # shellcheck disable=SC2086
      "$build/bench/mpiexec" -n "$ranks" "$exe" $model $flags --save "$work/ckpt-$ranks-$side-$round" \
        --log-jsonl "$work/$ranks-$side-$round.jsonl" >"$out" 2>&1 ||
        { echo "error: the $side run failed:" >&2; cat "$out" >&2; exit 1; }
    done
  done
  for side in sync async; do
    python3 - "$work" "$ranks" "$side" <<'EOF'
import glob, json, re, statistics, sys
work, ranks, side = sys.argv[1:]
stalls, steps = [], []
for path in sorted(glob.glob(f"{work}/{ranks}-{side}-*.txt")):
    stalls += [float(m) for m in re.findall(r"training stalled ([0-9.]+) ms", open(path).read())]
for path in sorted(glob.glob(f"{work}/{ranks}-{side}-*.jsonl")):
    for line in open(path):
        r = json.loads(line)
        if "step_ms" in r and r.get("step", 0) > 1:
            steps.append(r["step_ms"])
s, t = statistics.median(stalls), statistics.median(steps)
print(f"| {ranks} | {side} | {len(stalls)} | {s:.1f} | {min(stalls):.1f}-{max(stalls):.1f} | "
      f"{t:.0f} | {s / t:.3f} |")
EOF
  done
done
