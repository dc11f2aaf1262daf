#!/usr/bin/env bash
# Data-parallel gradient compression at dp 2 (two MPI processes, one thread
# each): the mini GPT (T 64) trained for 150 steps with the fp32 all-reduce,
# the bf16 one and PowerSGD (rank 8, from the end of the LR warmup), from the
# same start on the same batches (~2 minutes). Prints a markdown table and
# writes the loss curves as CSV (step,fp32,bf16,powersgd-r8-from-15) to
# $WEFT_COMPRESS_CSV, by default <build-dir>/compress_losses.csv.
#
#   bench/compress.sh [build-dir] [extra bench_compress flags...]   (default: build)
set -euo pipefail
build=${1:-build}
shift || true
exe="$build/bench/bench_compress"
if [[ ! -x "$exe" ]]; then
  echo "error: $exe not found; build first: meson setup $build && ninja -C $build" >&2
  exit 1
fi
data=data/fortunes.txt
if [[ ! -s "$data" ]]; then  # as scripts/sample.sh makes it
  mkdir -p data
  find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' \
    -print0 | sort -z | xargs -0 cat > "$data"
fi
out=${WEFT_COMPRESS_CSV:-$build/compress_losses.csv}
# A hung job ends instead of hanging the script; idle OpenMP threads sleep.
export MPIEXEC_TIMEOUT=600 OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
"$build/bench/mpiexec" -n 2 "$exe" --data-path "$data" --csv "$out" "$@"
