#!/usr/bin/env bash
# The simulator and the planner, validated strictly out of sample on this
# machine, in one script, each to a protocol fixed before the run:
#   1. the timed simulator (bench/sched_report.py): its costs come from
#      1F1B runs at pp 2 with 6 micro-batches, and its compute scale at pp 4
#      (how much slower ranks that outnumber cores run) from 1F1B runs at
#      pp 4 with 6; no row has 6 micro-batches. Those calibration runs go
#      between the rows, and each pp's scale is their median, fitted once;
#      it predicts every schedule at pp 2 and pp 4 with 4 and 8
#      micro-batches, sharing this machine's cores among the ranks that
#      compute at once, step and bubble; each row runs RUNS times; writes
#      schedules.md and its timelines;
#   2. the planner (bench/plan_report.py): its costs come from one run at
#      pp 2, its compute scale and its wake from two 8-rank layouts that are
#      no row (dp 4 x pp 2, dp 2 x tp 4), RUNS runs each, fitted once before
#      any row runs; every prediction and the planner's top pick are fixed
#      then. The rows: every 8-rank layout of bench/layouts.sh, the options
#      the planner ranks (recompute, virtual stages, ZeRO-1 and 2, sequence
#      parallelism, micro-batch sizes) and the top pick, each RUNS times;
#      writes plan_validate.md with step and bubble errors, Spearman, and the
#      regret of the planner's pick against simple rules' picks.
# It prints both tables, and the load average beside the runs.
#
#   bench/plan_validate.sh [build-dir] [--out DIR]   (default: build, and
#                                                     build-dir/plan_validate)
#
# The tracked pages in docs/ (schedules.md, its SVGs, plan_validate.md) are
# updated only on purpose: --out docs. About 42 minutes on 2 cores with
# RUNS=3 (the default); timings are only worth reading on an otherwise idle
# machine, and the README quotes one run, never the best of several.
set -euo pipefail
cd "$(dirname "$0")/.."
build=build
out=
while [[ $# -gt 0 ]]; do
  case $1 in
    --out) out=${2:?--out needs a directory}; shift 2 ;;
    --out=*) out=${1#--out=}; shift ;;
    *) build=$1; shift ;;
  esac
done
out=${out:-$build/plan_validate}
for exe in train_gpt weft-sched bench/mpiexec; do
  if [[ ! -x "$build/$exe" ]]; then
    echo "plan_validate.sh: $build/$exe not found; build first:" \
      "meson setup $build && ninja -C $build" >&2
    exit 1
  fi
done
if [[ ! -s data/fortunes.txt ]]; then
  echo "plan_validate.sh: data/fortunes.txt not found: scripts/sample.sh makes it" >&2
  exit 1
fi
runs=${RUNS:-3}
mkdir -p "$out"
work=$(mktemp -d /tmp/weft-plan-validate.XXXXXX)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE MPIEXEC_TIMEOUT=600
echo "load average at the start: $(cat /proc/loadavg)"
python3 bench/sched_report.py --build "$build" --docs "$out" --work "$work" --runs "$runs" \
  --pp2 4,8 --pp4 4,8 --max-wait 5 --retries 0
echo "wrote $out/schedules.md"
grep -E '^pp [0-9]: mean' "$out/schedules.md" || true
python3 bench/plan_report.py --build "$build" --out "$out" --work "$work" --runs "$runs"
echo "wrote $out/plan_validate.md"
echo "load average at the end: $(cat /proc/loadavg)"
