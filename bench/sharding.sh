#!/usr/bin/env bash
# What each data-parallel sharding strategy keeps per rank, and what it costs
# a step: --data-parallel-sharding-strategy no_shard, optim (ZeRO-1),
# optim_grads (ZeRO-2) and optim_grads_params (ZeRO-3), in the same run, at
# dp 2 on 2 ranks.
#
#   bench/sharding.sh [build-dir] [rounds]      (defaults: build, 2)
#
# Protocol, fixed before the run: GPT --model small (10.8M parameters),
# micro-batches of 2, a global batch of 8 (2 micro-batches per replica), 8
# steps, one thread per rank, the default buckets (2^20 elements). The four
# strategies alternate, in that order, for `rounds` rounds. Reported per
# strategy: rank 0's training state as train_gpt prints it (GradSync's
# bytes: values, the gathered-parameter buffers of sharded parameters,
# gradients, the micro-batch buffers of sharded gradients, optimizer
# state), the same from the formula each strategy stands for (P = the
# parameters' fp32 bytes on a rank, as the no_shard run prints them;
# sharded gradients and parameters add their pools, measured), the peak resident memory of
# the larger rank (/usr/bin/time's maximum RSS: everything, activations and
# the program included) as a median over the rounds, and the median step
# time of steps 2-8 over the rounds. Beside them, the planner's prediction
# for the same layout and strategy (weft-sched plan's memory per rank, from a
# profile of this model that train_gpt --pp 2 --profile writes first)
# against what the engine held: the training state plus the activations'
# measured peak (train_gpt's "activation memory ... held").
need_time=1
# shellcheck source=bench/preamble.sh
source "$(dirname "$0")/preamble.sh" "$@"
model="--model small --micro-batch-size 2 --global-batch-size 8 --data-path $data --threads 1 \
  --train-iters 8 --log-interval 1 --comm-timeout 120"
strategies="no_shard optim optim_grads optim_grads_params"
shape="--num-layers 6 --hidden-size 384 --num-attention-heads 6 --seq-length 256 --vocab-size 256"

# shellcheck disable=SC2086
"$build/bench/mpiexec" -n 2 "$exe" $model --train-iters 1 --pp 2 --profile "$work/profile.json" \
  >"$work/profile.txt" 2>&1 || { echo "error: the profile run failed:" >&2; cat "$work/profile.txt" >&2; exit 1; }
# shellcheck disable=SC2086
"$build/weft-sched" plan --profile "$work/profile.json" $shape --global-batch-size 8 \
  --world-size 2 --dp 2 --micro-batch-size 2 --top 0 --json >"$work/plans.json"

for round in $(seq "$rounds"); do
  for s in $strategies; do
    out="$work/$s-$round.txt"
    # shellcheck disable=SC2086
    # Each rank's maximum RSS into its own file (PMI_RANK: hydra's rank).
    "$build/bench/mpiexec" -n 2 sh -c '/usr/bin/time -f "%M" -o "$0.$PMI_RANK" "$@"' \
      "$work/rss-$s-$round" "$exe" $model --data-parallel-sharding-strategy "$s" \
      --log-jsonl "$work/$s-$round.jsonl" >"$out" 2>&1 ||
      { echo "error: the $s run failed:" >&2; cat "$out" >&2; exit 1; }
  done
done
python3 - "$work" "$rounds" $strategies <<'PY'
import json, re, statistics, sys
work, rounds, strategies = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
def size(text):
    v, u = text.split()
    return float(v) * units[u]
line = re.compile(r"training state on rank 0 \([^)]*\): (\S+ \S+) of values"
                  r"(?: \+ (\S+ \S+) of gathered-parameter buffers)?, (\S+ \S+) of gradients"
                  r"(?: \+ (\S+ \S+) of micro-batch gradient buffers)?, (\S+ \S+) of optimizer state")
rows = {}
for s in strategies:
    state, rss, steps = None, [], []
    for r in range(1, rounds + 1):
        text = open(f"{work}/{s}-{r}.txt").read()
        m = line.search(text)
        assert m, f"{s}: no training-state line"
        state = [size(x) if x else 0.0 for x in m.groups()]
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
    name = ("optim_grads_params" if p["zero3"] else "optim_grads" if p["zero2"] else
            "optim" if p["zero1"] else "no_shard")
    plans[name] = p["memory_per_rank"]
P = rows["no_shard"][0][0]  # a rank's parameters, fp32 bytes
dp = 2
formula = {"no_shard": 4 * P, "optim": P + P * (1 + 1 / dp) + 2 * P / dp,
           "optim_grads": P + P / dp + 2 * P / dp, "optim_grads_params": 4 * P / dp}
mib = lambda b: f"{b / 2**20:.1f}"
print(f"# data-parallel sharding at dp 2 (2 ranks): GPT --model small, {rounds} rounds")
print()
print("| strategy | values | gathered buffers | gradients | micro-batch buffers | optimizer state | "
      "state, measured | state, formula | state + activations, held | planner's prediction | "
      "predicted / held | peak RSS (median, range) | step ms (median, range) |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for s in strategies:
    (v, gv, g, b, o), act, rss, rlo, rhi, step, slo, shi = rows[s]
    f = formula[s] + gv + b
    held = v + gv + g + b + o + act
    print(f"| {s} | {mib(v)} | {mib(gv)} | {mib(g)} | {mib(b)} | {mib(o)} | {mib(v + gv + g + b + o)} | {mib(f)} | "
          f"{mib(held)} | {mib(plans[s])} | {plans[s] / held:.3f} | {mib(rss)} ({mib(rlo)}-{mib(rhi)}) | "
          f"{step:.0f} ({slo:.0f}-{shi:.0f}) |")
print()
print("(MiB; the activations' peak held: " + mib(rows[strategies[0]][1]) + " MiB under each strategy)")
PY
