#!/usr/bin/env bash
# Pipeline schedules, measured and simulated. For every schedule at pp 2 and 4
# and a few micro-batch counts runs train_gpt under mpiexec (--trace,
# --log-jsonl, --profile) and `weft-sched simulate --costs`, calibrated on
# 1F1B runs that are no row and run between the rows (the machine's speed
# drifts), and writes schedules.md with the table and the SVG timelines
# (sched-*.svg), plus one PNG when rsvg-convert is installed (apt-get install
# librsvg2-bin), into OUT. Details: bench/sched_report.py.
#
#   bench/schedules.sh [build-dir] [--out DIR]   (default: build, and
#                                                  build-dir/schedules; about 20 minutes idle,
#                                                  3 runs of each row)
#
# The tracked page in docs/ is updated only on purpose: --out docs.
#
# PP2 and PP4 choose the micro-batch counts (PP4= skips pp 4), e.g.
#   PP2=4 PP4= bench/schedules.sh build
# Times are only worth reading on an otherwise idle machine: the script waits
# for one before each run, runs a row again when other processes took CPU
# time during it, and reports their share.
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
out=${out:-$build/schedules}
for exe in train_gpt weft-sched; do
  if [[ ! -x "$build/$exe" ]]; then
    echo "schedules.sh: $build/$exe not found; build first:" \
      "meson setup $build && ninja -C $build" >&2
    exit 1
  fi
done
work=$(mktemp -d /tmp/weft-schedules.XXXXXX)
trap 'rm -rf "$work"' EXIT
# One thread per rank; idle OpenMP threads sleep; a hung job ends.
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE MPIEXEC_TIMEOUT=600
python3 bench/sched_report.py --build "$build" --docs "$out" --work "$work" \
  --pp2 "${PP2-2,4,8}" --pp4 "${PP4-4,8}"
echo "wrote $out/schedules.md"
