#!/usr/bin/env bash
# MpiCommunicator against raw MPI: ping-pong on 2 ranks, all_reduce on 2, 4
# and 8 ranks (more ranks than cores is the case the polite wait is for).
#
#   bench/comm.sh [build-dir]      (default: build)
set -euo pipefail
build=${1:-build}
exe="$build/bench/bench_comm"
if [[ ! -x "$exe" ]]; then
  echo "error: $exe not found; build first: meson setup $build && ninja -C $build" >&2
  exit 1
fi
# A hung job ends instead of hanging the script; one thread per rank.
export MPIEXEC_TIMEOUT=600 OMP_NUM_THREADS=1
echo "# bench_comm on $(getconf _NPROCESSORS_ONLN) cores"
echo
for n in 2 4 8; do
  "$build/bench/mpiexec" -n "$n" "$exe"
done
