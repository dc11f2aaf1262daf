#!/usr/bin/env bash
# scripts/gpu-check.sh's run on a GPU machine, with stand-ins for the machine:
# nvidia-smi says one H200, meson/ninja/nvcc do nothing, the build folder
# holds scripts that play the tests (one of them failing as GoogleTest
# fails), train_gpt, bench_cuda and ncu. Checks what only a GPU machine runs:
# every row of the table, the --bf16-against-fp32 comparison both ways, the
# first GoogleTest failure printed, the kernel profile's table, the logs
# copied to $OUT, the exit status, and the kernel profile left out when the
# deadline leaves it too little time.
set -euo pipefail
src=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d /tmp/weft-gpu-check-test.XXXXXX)
trap 'rm -rf "$work"' EXIT
repo=$work/repo bin=$work/bin
mkdir -p "$repo/scripts" "$repo/bench" "$repo/data" "$repo/third_party/xxhash" "$bin"
cp "$src/scripts/gpu-check.sh" "$repo/scripts/"
cp "$src/bench/cuda_table.py" "$src/bench/kernel_table.py" "$repo/bench/"
echo "A fortune." >"$repo/data/fortunes.txt"
touch "$repo/third_party/xxhash/xxhash.h"

stub() {  # path, body: an executable script
  mkdir -p "$(dirname "$1")"
  printf '#!/bin/sh\n%s\n' "$2" >"$1"
  chmod +x "$1"
}
stub "$bin/nvidia-smi" 'case "$*" in
  -L) echo "GPU 0: NVIDIA H200 (UUID: GPU-0)" ;;
  *compute_cap*) echo "9.0" ;;
  *name*) echo "NVIDIA H200" ;;
esac'
for t in meson ninja nvcc; do stub "$bin/$t" 'exit 0'; done
# ncu: its options, then the program; the CSV of one kernel launch.
stub "$bin/ncu" 'log=""
while [ $# -gt 0 ]; do
  case "$1" in
    --log-file) log=$2; shift 2 ;;
    --metrics|--print-units|--profile-from-start) shift 2 ;;
    --*) shift ;;
    *) break ;;
  esac
done
"$@" >/dev/null || exit $?
{ echo "==PROF== Connected to process 1"
  echo "\"ID\",\"Kernel Name\",\"Metric Name\",\"Metric Unit\",\"Metric Value\""
  echo "\"0\",\"void weft::cuda::gelu<float>(int)\",\"gpu__time_duration.sum\",\"ns\",\"2,000\""
} >"$log"'

build=$repo/build-gpu
mkdir -p "$build/meson-private" "$build/meson-logs"
echo '#define WEFT_CUDNN 1' >"$build/weft_config.h"
touch "$build/meson-logs/meson-log.txt" "$build/bench/mpiexec" 2>/dev/null ||
  { mkdir -p "$build/bench"; touch "$build/bench/mpiexec"; }
for t in tests/test_nccl tests/cuda/test_cuda_allocator tests/cuda/test_cuda_kernels \
         tests/cuda/test_cuda_train tests/cuda/test_cuda_mpi tests/cuda/test_cuda_fused_attention \
         tests/cuda/test_cuda_step_kernels tests/cuda/test_cuda_bf16_kernels \
         tests/cuda/test_cuda_gemm_bias tests/test_parity; do
  stub "$build/$t" 'echo "[  PASSED  ] 2 tests."'
done
stub "$build/tests/cuda/test_cuda_layers" 'echo "[ RUN      ] CudaLayers.Linear"
echo "tests/cuda/test_cuda_layers.cc:120: Failure"
echo "The difference between a and b is 0.5, which exceeds 1e-5"
i=0; while [ $i -lt 60 ]; do echo "[       OK ] CudaLayers.Other$i"; i=$((i + 1)); done
echo "[  FAILED  ] 1 test"; exit 1'
# train_gpt: the last-50 mean of fp32 runs, and of --bf16 ones from $BF16_MEAN.
stub "$build/train_gpt" 'case "$*" in
  *--bf16*) echo "mean loss of the last 50 steps: ${BF16_MEAN} nats" ;;
  *) echo "mean loss of the last 50 steps: 3.0000 nats" ;;
esac'
# bench_cuda; under the kernel profile, one mode and one step whatever
# WEFT_BENCH_ARGS said before them (exit 3 otherwise).
stub "$build/bench/bench_cuda" 'json="" modes="" steps="" kp=0
while [ $# -gt 0 ]; do
  case "$1" in
    --json) json=$2; shift 2 ;;
    --modes) modes=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --kernel-profile) kp=1; shift ;;
    *) shift ;;
  esac
done
if [ "$kp" = 1 ] && { [ "$modes" != bf16+fused ] || [ "$steps" != 1 ]; }; then exit 3; fi
echo "weft bench_cuda | model gpt2"; echo
echo "| mode | step ms |"; echo "|---|---:|"; echo "| bf16+fused | 40.0 |"
if [ -n "$json" ]; then
  echo "{\"framework\": \"weft\", \"mode\": \"bf16+fused\", \"step_ms\": 40.0, \"tokens_per_s\": 409600, \"mfu\": 0.3, \"peak_gib\": 8.0, \"batch\": 16, \"seq_length\": 1024}" >"$json"
fi'

fail=0
expect() {  # description, pattern (grep -E), file
  if ! grep -qE -- "$2" "$3"; then
    echo "FAIL: $1: no line matching '$2' in:"; cat "$3"; fail=1
  fi
}
run_check() {  # output file, out folder, then VAR=value settings
  local out=$1 dir=$2; shift 2
  rc=0
  (cd "$repo" && env PATH="$bin:$PATH" OUT="$dir" WEFT_PYTORCH=0 "$@" scripts/gpu-check.sh) \
    >"$out" 2>&1 || rc=$?
}

mkdir -p "$work/out1"
run_check "$work/run1" "$work/out1" BF16_MEAN=3.0200 WEFT_GPU_DEADLINE=400 \
  WEFT_BENCH_ARGS="--modes tf32,bf16+fused --steps 3"
[ "$rc" = 1 ] || { echo "FAIL: a failing test must fail the check (exit $rc)"; fail=1; }
expect "the failing test's row" '^\| cuda_layers \| FAIL \(exit 1\), expected PASS \|' "$work/run1"
expect "its first GoogleTest failure, though 60 lines came after it" \
  'test_cuda_layers.cc:120: Failure' "$work/run1"
expect "a passing test's row" '^\| cuda_train \| PASS \|' "$work/run1"
expect "the sample job's row" '^\| train_gpt --device cuda, the sample job \(1200 steps\) \| ok: mean loss of the last 50 steps: 3.0000 nats' "$work/run1"
expect "bf16 within 1% of fp32" '\| ok: last 50 steps fp32 3.0000, bf16 3.0200 nats \|' "$work/run1"
expect "the kernel profile's row" '^\| kernel profile \(ncu, not a check\) \| ok: one bf16\+fused step \|' "$work/run1"
expect "the kernel table" '^\| `weft::cuda::gelu<float>` \| 1 \| 0.00 \| 100.0% \|' "$work/run1"
expect "the weft/PyTorch table" '^\| weft \| bf16\+fused \| 409600 \|' "$work/run1"
for f in cuda_layers.out kernels.csv bench_cuda.jsonl mixed_bf16.out; do
  [ -s "$work/out1/gpu-check-logs/$f" ] || { echo "FAIL: $f was not copied to \$OUT"; fail=1; }
done

# --bf16 1.5% from fp32 fails the check; a deadline of 100 s leaves the
# kernel profile less than its 90 s once the 20 s for the report are kept.
mkdir -p "$work/out2"
run_check "$work/run2" "$work/out2" BF16_MEAN=3.0450 WEFT_GPU_DEADLINE=100
expect "bf16 1.5% from fp32 fails" '\| FAIL: last 50 steps fp32 .3.0000., bf16 .3.0450. nats \(more than 1% apart\) \|' "$work/run2"
expect "the kernel profile left out" '^\| kernel profile \(ncu, not a check\) \| skipped: [0-9]+ s left before the deadline, 90 needed' "$work/run2"

if [ "$fail" = 0 ]; then echo "gpu-check's GPU-machine run: every expected row"; fi
exit "$fail"
