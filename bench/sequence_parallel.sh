#!/usr/bin/env bash
# What sequence parallelism saves per rank, and what it costs a step:
# --tp 2 with and without --sequence-parallel, in the same run, on 2 ranks.
#
#   bench/sequence_parallel.sh [build-dir] [rounds]      (defaults: build, 2)
#
# Protocol, fixed before the run: GPT --model small (10.8M parameters),
# micro-batches of 2, a global batch of 8 (4 micro-batches, dp 1, pp 1),
# 8 steps, one thread per rank. The two settings alternate, plain first,
# for `rounds` rounds. Reported per setting: the activations' peak that the
# executor held on rank 0 (train_gpt's "activation memory ... held"), the
# planner's prediction of it for the same layout (weft-sched plan's
# activation_bytes, from a profile of this model that train_gpt --pp 2
# --profile writes first), the planner's memory per rank (state,
# activations and, with sequence parallelism, the layers' shared
# whole-sequence buffers) against rank 0's training state plus the
# activations held, the peak resident memory of the larger rank
# (/usr/bin/time's maximum RSS: everything, the program included) as a
# median over the rounds, and the median step time of steps 2-8 over the
# rounds.
need_time=1
# shellcheck source=bench/preamble.sh
source "$(dirname "$0")/preamble.sh" "$@"
model="--model small --micro-batch-size 2 --global-batch-size 8 --data-path $data --threads 1 \
  --train-iters 8 --log-interval 1 --comm-timeout 120"
shape="--num-layers 6 --hidden-size 384 --num-attention-heads 6 --seq-length 256 --vocab-size 256"

# shellcheck disable=SC2086
"$build/bench/mpiexec" -n 2 "$exe" $model --train-iters 1 --pp 2 --profile "$work/profile.json" \
  >"$work/profile.txt" 2>&1 || { echo "error: the profile run failed:" >&2; cat "$work/profile.txt" >&2; exit 1; }
# shellcheck disable=SC2086
"$build/weft-sched" plan --profile "$work/profile.json" $shape --global-batch-size 8 \
  --world-size 2 --tp 2 --micro-batch-size 2 --top 0 --json >"$work/plans.json"

for round in $(seq "$rounds"); do
  for s in plain sp; do
    flag=""
    [[ $s == sp ]] && flag="--sequence-parallel"
    out="$work/$s-$round.txt"
    # Each rank's maximum RSS into its own file (PMI_RANK: hydra's rank).
    # shellcheck disable=SC2086
    "$build/bench/mpiexec" -n 2 sh -c '/usr/bin/time -f "%M" -o "$0.$PMI_RANK" "$@"' \
      "$work/rss-$s-$round" "$exe" $model --tp 2 $flag \
      --log-jsonl "$work/$s-$round.jsonl" >"$out" 2>&1 ||
      { echo "error: the $s run failed:" >&2; cat "$out" >&2; exit 1; }
  done
done
python3 - "$work" "$rounds" <<'PY'
import json, re, statistics, sys
work, rounds = sys.argv[1], int(sys.argv[2])
units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
def size(text):
    v, u = text.split()
    return float(v) * units[u]
state_line = re.compile(r"training state on rank 0 \([^)]*\): ([^;]*); (\S+ \S+) in all")
rows = {}
for s in ("plain", "sp"):
    rss, steps = [], []
    for r in range(1, rounds + 1):
        text = open(f"{work}/{s}-{r}.txt").read()
        state = size(state_line.search(text)[2])
        act = size(re.search(r"activation memory, peak per pipeline rank: \[([^]]+)\] held", text)[1])
        rss.append(max(int(open(f"{work}/rss-{s}-{r}.{k}").read().split()[-1]) for k in (0, 1))
                   * 1024)
        for l in open(f"{work}/{s}-{r}.jsonl"):
            j = json.loads(l)
            if j.get("step", 0) > 1 and "step_ms" in j:
                steps.append(j["step_ms"])
    rows[s] = (state, act, statistics.median(rss), min(rss), max(rss), statistics.median(steps),
               min(steps), max(steps))
plans = {}
for p in json.load(open(f"{work}/plans.json")):
    if p["dp"] == 1 and p["pp"] == 1 and not p["zero1"]:
        plans["sp" if p["sequence_parallel"] else "plain"] = p
mib = lambda b: f"{b / 2**20:.1f}"
print(f"# sequence parallelism at tp 2 (2 ranks): GPT --model small, {rounds} rounds")
print()
print("| --tp 2 | activations held | planner's activations | predicted / held | "
      "state + activations, held | planner's memory per rank | predicted / held | "
      "peak RSS (median, range) | step ms (median, range) |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
for s, name in (("plain", "plain"), ("sp", "--sequence-parallel")):
    state, act, rss, rlo, rhi, step, slo, shi = rows[s]
    p = plans[s]
    held = state + act
    print(f"| {name} | {mib(act)} | {mib(p['activation_bytes'])} | "
          f"{p['activation_bytes'] / act:.3f} | {mib(held)} | {mib(p['memory_per_rank'])} | "
          f"{p['memory_per_rank'] / held:.3f} | {mib(rss)} ({mib(rlo)}-{mib(rhi)}) | "
          f"{step:.0f} ({slo:.0f}-{shi:.0f}) |")
print()
print("(MiB; the planner's memory per rank with --sequence-parallel includes the shared "
      "whole-sequence buffers, which the executor's activations do not)")
PY
