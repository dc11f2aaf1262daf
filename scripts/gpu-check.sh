#!/usr/bin/env bash
# The CUDA backend's check, on a machine with a GPU: build with -Dcuda=enabled,
# run the GPU tests (NCCL, every kernel against the CPU, every layer class
# through weft/ops.h on the GPU against the CPU, cuDNN's fused attention
# against the CPU's, train_gpt --device cuda against --device cpu and the
# PyTorch fixtures, the allocator, the fused classifier and the multi-tensor
# AdamW), train the sample job on the GPU when
# data/fortunes.txt is there (carry it), and --bf16 against fp32 on it (200
# steps each, last-50 means within 1%), and the
# throughput bench of the same step (bench_cuda --profile: each mode's time
# per node kind), then PyTorch's same step (bench/pytorch_gpt_cuda.py: eager
# bf16, eager tf32, torch.compile bf16) where a python3 with CUDA PyTorch is
# found, and print one table of both (bench/cuda_table.py). Budget: 5 minutes
# on a 16-core H100/H200 machine, and 3 more for PyTorch (timeout 200 s).
# PyTorch's run is a baseline, not a check of weft: when it fails, its row
# says so and the check's result does not change.
#
#   scripts/gpu-check.sh             # on a GPU machine: every test must pass
#   scripts/gpu-check.sh --dry-run   # anywhere with nvcc: the same build, and
#                                    # every GPU test must SKIP cleanly (exit 77)
#   scripts/gpu-check.sh --emulate   # anywhere: every step on the GPU emulator
#                                    # (tests/cuda_emu, build-emu), so that the
#                                    # check itself has run before a GPU run
#
# --emulate builds with -Dgpu_emulator=true and runs what a GPU run runs,
# each test expected to PASS (cuDNN's fused attention is the emulator's
# stand-in, tests/cuda_emu/sdpa.cc; its NCCL a stand-in across processes, with
# the ranks on devices of their own or, as on one GPU, each its own NCCL host), with meson's
# GTEST_FILTER for a test where it sets one; only the sizes shrink to what a
# CPU emulating a GPU does in minutes: the sample job runs 3 steps,
# bench_cuda the mini model at B 2 with 2 warm-up and 2 timed steps
# (WEFT_BENCH_ARGS replaces that), PyTorch's script runs the same shape on
# the CPU where a python3 has torch, and there is no kernel profile and no
# deadline. Its speeds are the emulator's, not a GPU's: it checks the
# check's plumbing (every step, every row, both tables), not the hardware.
#
# The GPU machine has no xxHash package: carry third_party/ (make it here with
# `mkdir -p third_party/xxhash && cp /usr/include/xxhash.h third_party/xxhash/`),
# and the build uses that header alone. The same folder carries cuDNN's
# fused attention headers (make them here with scripts/cudnn-frontend.sh):
# without them, or without cuDNN under /usr/local/cuda, the build leaves the
# fused attention out, its test SKIPs and the table says so.
#
# Environment: WEFT_GPU_BUILD (build directory, default build-gpu),
# WEFT_GPU_ARCH (default: the first GPU's compute capability, else 90),
# WEFT_BENCH_ARGS (extra bench_cuda flags, e.g. "--batch 8 --modes tf32"; a
# shape given there is not passed on to PyTorch, and the table notes that the
# shapes differ), WEFT_PYTHON (the python with CUDA PyTorch; default: the first
# of python3 and /opt/torch/.venv/bin/python3 whose torch sees a GPU),
# WEFT_PYTORCH (0: leave PyTorch's baseline out, e.g. for a quick second try),
# WEFT_GPU_DEADLINE (seconds, default 540: the whole check's deadline; steps
# are cut to it and the table still prints, so run it in a call of 10 minutes),
# WEFT_KERNEL_PROFILE (0: no kernel profile; otherwise, where Nsight Compute's
# ncu is found and at least 90 s of the deadline are left after PyTorch, one
# --bf16 step of bench_cuda runs under ncu and bench/kernel_table.py prints its
# kernels by GPU time: not a check, a row says what happened),
# WEFT_GPU_LOGS_TO (a folder; default $OUT where that is set: every log of the
# check, the kernel profile's CSV and the bench's JSON lines are copied there
# when the check ends, however it ends).
# Each row is also printed as it completes.
set -euo pipefail
cd "$(dirname "$0")/.."

dry_run=0 emulate=0
case "${1:-}" in
  --dry-run) dry_run=1 ;;
  --emulate) emulate=1 ;;
  "") ;;
  *) echo "usage: $0 [--dry-run | --emulate]" >&2; exit 2 ;;
esac

if [ "$emulate" = 1 ]; then build=${WEFT_GPU_BUILD:-build-emu}; else build=${WEFT_GPU_BUILD:-build-gpu}; fi
logs=$(mktemp -d /tmp/weft-gpu-check.XXXXXX)  # every command's output
# Whole logs outlive the machine when they are copied where its caller
# collects files: a failing test's first assertion is often far above the
# lines printed here.
logs_to=${WEFT_GPU_LOGS_TO:-${OUT:-}}
copy_logs() {
  if [ -n "$logs_to" ] && mkdir -p "$logs_to/gpu-check-logs" 2>/dev/null; then
    cp -r "$logs"/. "$logs_to/gpu-check-logs/" 2>/dev/null || true
  fi
}
trap copy_logs EXIT
start=$(date +%s)
# One deadline for the whole check, WEFT_GPU_DEADLINE seconds from its start
# (default 540): each step's time limit is cut to what is left of it, less
# 20 s for the report, and a step with nothing left is not run (and fails
# the check). So the table prints inside a 10-minute call even when steps
# hang or run long. A dry or emulated run has no deadline (CI machines may
# have 2 cores), and an emulated run's steps get 4 times their limits.
case "${WEFT_GPU_DEADLINE:-540}" in
  ''|*[!0-9]*) echo "gpu-check: WEFT_GPU_DEADLINE '${WEFT_GPU_DEADLINE}' must be a whole number of seconds" >&2
               exit 2 ;;
esac
deadline=$(( start + ${WEFT_GPU_DEADLINE:-540} ))
results=()   # "name|result|seconds" rows of the table
add_row() {  # "name|result|seconds": a row of the table, also printed as it comes
  results+=("$1")
  local name result secs
  IFS='|' read -r name result secs <<<"$1"
  echo "gpu-check: $name: $result ($secs s)"
}
# The limit (seconds) for a step that would take at most $1: $1, or what is
# left before the deadline, less the report's 20 s; 0 when nothing is left.
limit_for() {
  local own=$1 rest
  if [ "$dry_run" = 1 ]; then echo "$own"; return; fi
  if [ "$emulate" = 1 ]; then echo $(( 4 * own )); return; fi
  rest=$(( deadline - 20 - $(date +%s) ))
  if [ "$rest" -lt 1 ]; then echo 0; elif [ "$rest" -lt "$own" ]; then echo "$rest"; else echo "$own"; fi
}
out_of_time() {  # name: the row of a step the deadline left no time for
  add_row "$1|not run: past the deadline (WEFT_GPU_DEADLINE ${WEFT_GPU_DEADLINE:-540} s)|0"
  failed=1
}
failed=0
# The machine's cores (nproc alone counts OMP_NUM_THREADS, which the tests set).
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)

# The GPU machine keeps meson and ninja in PyTorch's virtual environment.
for dir in /usr/local/cuda/bin /opt/torch/.venv/bin; do
  if [ -d "$dir" ]; then export PATH="$PATH:$dir"; fi
done
# Open MPI (the GPU machine's MPI) refuses root unless told.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
if ! pkg-config --exists libxxhash 2>/dev/null && ! [ -f third_party/xxhash/xxhash.h ]; then
  echo "gpu-check: no xxHash here: carry third_party/ (see the top of this script)" >&2
  exit 1
fi
tools=(meson ninja nvcc)
if [ "$emulate" = 1 ]; then
  tools=(meson ninja)
  # shellcheck source=scripts/packages.sh
  source scripts/packages.sh
  if [ ! -f /usr/include/boost/context/fiber.hpp ]; then
    install_packages "Boost.Context (the GPU emulator's fibers)" libboost-context-dev
  fi
  make_sample_text  # what a GPU run carries, made here
fi
for tool in "${tools[@]}"; do
  if ! command -v "$tool" >/dev/null && ! [ -x "/usr/local/cuda/bin/$tool" ]; then
    echo "gpu-check: $tool not found (nvcc is expected in PATH or /usr/local/cuda/bin)" >&2
    exit 1
  fi
done

gpus=0
if [ "$emulate" = 1 ]; then
  gpus=1  # the emulated one; a real GPU here is not used
elif command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L | grep -c '^GPU' || true)
fi
arch=${WEFT_GPU_ARCH:-}
if [ -z "$arch" ] && [ "$gpus" -gt 0 ] && [ "$emulate" = 0 ]; then
  arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '. ')
fi
arch=${arch:-90}
if [ "$dry_run" = 0 ] && [ "$gpus" = 0 ]; then
  echo "gpu-check: no GPU visible (nvidia-smi -L); use --dry-run to check the build and the skips" >&2
  exit 1
fi

# --- build: only what the check runs (no time limit in a dry run: CI
# machines may have 2 cores) ---
t0=$(date +%s)
log="$logs/build.log"
setup_rc=0
config=(-Dcuda=enabled -Dgpu_arch="$arch")
if [ "$emulate" = 1 ]; then
  config=(-Dgpu_emulator=true -Dcudnn=enabled)
  if [ "${WEFT_WERROR:-0}" = 1 ]; then config+=(-Dwerror=true); fi
fi
if [ -d "$build/meson-private" ]; then
  meson configure "$build" "${config[@]}" >"$log" 2>&1 || setup_rc=$?
else
  meson setup "$build" "${config[@]}" >"$log" 2>&1 || setup_rc=$?
fi
if [ "$setup_rc" != 0 ]; then
  tail -n 40 "$log"
  echo "gpu-check: meson setup failed (exit $setup_rc; log: $log)" >&2
  exit 1
fi
targets=(tests/test_nccl tests/cuda/test_cuda_allocator tests/cuda/test_cuda_kernels
         tests/cuda/test_cuda_layers tests/cuda/test_cuda_train tests/cuda/test_cuda_mpi
         tests/cuda/test_cuda_nccl
         tests/cuda/test_cuda_fused_attention tests/cuda/test_cuda_step_kernels
         tests/cuda/test_cuda_bf16_kernels tests/cuda/test_cuda_gemm_bias tests/test_parity
         train_gpt bench/bench_cuda)
if [ "$emulate" = 1 ]; then
  targets+=(tests/cuda_emu/test_cuda_emulator tests/cuda_emu/test_emulator_nccl)
fi
if [ "$dry_run" = 1 ] || [ "$emulate" = 1 ]; then build_limit=3600; else build_limit=$(limit_for 360); fi
if ! timeout "$build_limit" ninja -C "$build" -j"$cores" "${targets[@]}" >>"$log" 2>&1; then
  tail -n 40 "$log"
  echo "gpu-check: the build failed (log: $log)" >&2
  exit 1
fi
fused=no
if grep -q '#define WEFT_CUDNN 1' "$build/weft_config.h"; then fused=yes; fi
fused_note=$(grep -o 'cuDNN fused attention: not built ([^)]*)' "$build/meson-logs/meson-log.txt" \
  | tail -n 1 || true)
if [ "$emulate" = 1 ]; then
  add_row "build (-Dgpu_emulator=true, $cores cores, cuDNN fused attention: the emulator's stand-in)|ok|$(( $(date +%s) - t0 ))"
  # The GoogleTest filters meson gives a test under the emulator, by name.
  meson introspect "$build" --tests | python3 -c '
import json, sys
for t in json.load(sys.stdin):
    f = t.get("env", {}).get("GTEST_FILTER")
    if f:
        print(t["name"], f)' >"$logs/filters.txt"
else
  add_row "build (-Dcuda=enabled, sm_$arch, $cores cores, cuDNN fused attention: $fused)|ok|$(( $(date +%s) - t0 ))"
fi

# --- tests: each must pass on a GPU; in a dry run, SKIP (77), except the
# allocator's host-side test, which runs without a GPU ---
export WEFT_SOURCE_DIR="$PWD" OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
export WEFT_TRAIN_GPT="$PWD/$build/train_gpt"
# The launcher of the MPI the build links (meson writes it), for ranks that
# share the GPU; Open MPI needs oversubscription for 8 ranks on fewer slots.
export WEFT_MPIEXEC="$PWD/$build/bench/mpiexec" OMPI_MCA_rmaps_base_oversubscribe=1
run_test() {  # name binary needs_gpu [timeout seconds, default 240] [ranks]
  # needs_gpu: 1, or "fused": a GPU and a build with cuDNN fused attention.
  # ranks: run the binary as that many ranks under mpiexec, each its own NCCL
  # host (WEFT_NCCL_ONE_GPU=1), so that one GPU runs NCCL between them.
  local name=$1 bin=$2 needs_gpu=$3 limit want=0 rc=0 t0 ms filter="" launch=()
  limit=$(limit_for "${4:-240}")
  if [ "$limit" = 0 ]; then out_of_time "$name"; return; fi
  if [ "$emulate" = 1 ]; then
    filter=$(sed -n "s/^$name //p" "$logs/filters.txt")
  fi
  if [ -n "${5:-}" ]; then launch=(env WEFT_NCCL_ONE_GPU=1 "$WEFT_MPIEXEC" -n "$5"); fi
  t0=$(date +%s%N)
  GTEST_FILTER=${filter:-${GTEST_FILTER:-*}} timeout "$limit" "${launch[@]}" "$build/$bin" \
    >"$logs/$name.out" 2>&1 || rc=$?
  ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  if [ "$dry_run" = 1 ] && [ "$needs_gpu" != 0 ]; then want=77; fi
  if [ "$needs_gpu" = fused ] && [ "$fused" = no ]; then want=77; fi
  local result
  case "$rc" in
    0) result=PASS ;;
    77) result=SKIP ;;
    124) result="TIMEOUT ($limit s)" ;;
    *) result="FAIL (exit $rc)" ;;
  esac
  if [ "$rc" != "$want" ]; then
    result="$result, expected $([ "$want" = 77 ] && echo SKIP || echo PASS)"
    failed=1
    # GoogleTest's first failures (file:line and the values), then the end.
    if grep -q ': Failure$' "$logs/$name.out"; then
      echo "---- $name: its first failures ----"
      grep -A 6 -m 4 ': Failure$' "$logs/$name.out" | cut -c 1-400
    fi
    echo "---- $name: last lines of $logs/$name.out ----"
    tail -n 25 "$logs/$name.out" | cut -c 1-400
  fi
  add_row "$name|$result|$((ms / 1000)).$(((ms % 1000) / 100))"
}
# NCCL at world size 1: every collective, p2p to itself in a group, split,
# the deadline (about 1 s of it), stream-ordered reuse; seconds, so a hang
# gets 60 s, not 240. Then the same between 2 and 3 ranks, each its own
# NCCL host on the GPU (NCCL's socket transport over loopback), and
# train_gpt's layouts over NCCL against one process (tests/cuda/test_cuda_nccl).
run_test nccl tests/test_nccl 1 60
run_test nccl_2_ranks tests/test_nccl 1 90 2
run_test nccl_3_ranks tests/test_nccl 1 90 3
run_test cuda_nccl tests/cuda/test_cuda_nccl 1 420
run_test cuda_allocator tests/cuda/test_cuda_allocator 0
run_test cuda_kernels tests/cuda/test_cuda_kernels 1
run_test cuda_layers tests/cuda/test_cuda_layers 1
run_test cuda_train tests/cuda/test_cuda_train 1
# the fused classifier at every T up to 1024 and the multi-tensor AdamW
run_test cuda_step_kernels tests/cuda/test_cuda_step_kernels 1
# the bf16-activation kernels against their fp32 twins (fused attention with cuDNN)
run_test cuda_bf16_kernels tests/cuda/test_cuda_bf16_kernels 1
# cuBLASLt's bias, GELU and bias-gradient epilogues against the separate steps and
# fp64 (a FAIL that says no algorithm or a fallback was counted is a missed
# speed-up: the engine then runs the separate steps, with the same results)
run_test cuda_gemm_bias tests/cuda/test_cuda_gemm_bias 1
run_test cuda_mpi tests/cuda/test_cuda_mpi 1   # several ranks sharing the GPU (host-staged)
# cuDNN's fused attention against the CPU (SKIP in a build without it)
run_test cuda_fused_attention tests/cuda/test_cuda_fused_attention fused
run_test parity tests/test_parity 0   # its cuda cases run where a GPU is visible
if [ "$emulate" = 1 ]; then  # the emulator's own tests
  run_test cuda_emulator tests/cuda_emu/test_cuda_emulator 1
  run_test cuda_emulator_nccl tests/cuda_emu/test_emulator_nccl 1
fi

# --- the sample job on the GPU (scripts/sample.sh's model and flags), when
# its text is here: data/fortunes.txt travels with the checkout; 3 steps of
# it on the emulator, where one takes seconds ---
sample_iters=1200
if [ "$emulate" = 1 ]; then sample_iters=3; fi
if [ -s data/fortunes.txt ] && [ "$dry_run" = 0 ] && [ "$(limit_for 240)" = 0 ]; then
  out_of_time "train_gpt --device cuda, the sample job"
elif [ -s data/fortunes.txt ] && [ "$dry_run" = 0 ]; then
  t0=$(date +%s)
  sample_rc=0
  timeout "$(limit_for 240)" "$build/train_gpt" --device cuda --num-layers 4 --hidden-size 128 \
    --num-attention-heads 4 --seq-length 64 --data-path data/fortunes.txt \
    --micro-batch-size 32 --global-batch-size 32 --train-iters "$sample_iters" --lr 3e-3 --min-lr 3e-4 \
    --lr-decay-style cosine --lr-warmup-iters 30 --log-interval 200 \
    >"$logs/sample_cuda.out" 2>&1 || sample_rc=$?
  if [ "$sample_rc" = 0 ]; then
    sample_result="ok: $(grep -o 'mean loss of the last [0-9]* steps: [0-9.]* nats' "$logs/sample_cuda.out")"
  else
    sample_result="FAIL (exit $sample_rc)"
    failed=1
    tail -n 20 "$logs/sample_cuda.out"
  fi
  add_row "train_gpt --device cuda, the sample job ($sample_iters steps)|$sample_result|$(( $(date +%s) - t0 ))"

  # --bf16 against fp32 on the same text: 200 steps each, the mean loss of
  # the last 50 within 1% (issue 11's acceptance test for mixed precision).
  # A 2-layer model of width 32: the sample job's model leaves its loss
  # plateau between steps 100 and 200 at a step that any perturbation moves
  # (on the CPU its last-50 mean moved by 2.2% under bf16, 4.9% under fp16
  # and 2.6% under another seed), while this one's stays put (bf16 0.1%,
  # fp16 0.0%; docs/training.md, Mixed precision).
  # The two runs at once (each a small fraction of the GPU, or one of an
  # emulating CPU's cores).
  t0=$(date +%s)
  mixed_result=""
  limit=$(limit_for 120)
  if [ "$limit" = 0 ]; then
    mixed_result="FAIL: not run, past the deadline"
  else
    pids=()
    for precision in fp32 bf16; do
      flag=""
      if [ "$precision" = bf16 ]; then flag=--bf16; fi
      # shellcheck disable=SC2086
      timeout "$limit" "$build/train_gpt" --device cuda $flag --num-layers 2 --hidden-size 32 \
        --num-attention-heads 4 --seq-length 32 --data-path data/fortunes.txt \
        --micro-batch-size 8 --global-batch-size 8 --train-iters 200 --lr 3e-3 \
        --log-interval 100 >"$logs/mixed_$precision.out" 2>&1 &
      pids+=($!)
    done
    mixed_failed=()
    for i in 0 1; do
      wait "${pids[$i]}" || mixed_failed+=("$([ "$i" = 0 ] && echo fp32 || echo bf16)")
    done
    if [ "${#mixed_failed[@]}" -gt 0 ]; then
      mixed_result="FAIL (${mixed_failed[*]}): see $logs/mixed_*.out"
      for p in "${mixed_failed[@]}"; do tail -n 10 "$logs/mixed_$p.out"; done
    fi
  fi
  if [ -z "$mixed_result" ]; then
    tail_mean() { sed -n 's/.*mean loss of the last 50 steps: \([0-9.]*\) nats.*/\1/p' "$1"; }
    fp32=$(tail_mean "$logs/mixed_fp32.out") bf16=$(tail_mean "$logs/mixed_bf16.out")
    if [ -n "$fp32" ] && [ -n "$bf16" ] &&
       awk -v a="$bf16" -v b="$fp32" \
         'BEGIN { d = a - b; exit !(d < 0.01 * b && -d < 0.01 * b) }'; then
      mixed_result="ok: last 50 steps fp32 $fp32, bf16 $bf16 nats"
    else
      mixed_result="FAIL: last 50 steps fp32 '$fp32', bf16 '$bf16' nats (more than 1% apart)"
    fi
  fi
  case "$mixed_result" in FAIL*) failed=1 ;; esac
  add_row "train_gpt --device cuda --bf16 vs fp32, 200 steps|$mixed_result|$(( $(date +%s) - t0 ))"
fi

# --- throughput: weft's step, where its time goes, and PyTorch's step ---
# On the emulator: bench_cuda's mini model at B 2, and PyTorch's script on
# the CPU at that shape (the same model: bench/cuda_table.py notes shapes
# that differ).
bench_args=${WEFT_BENCH_ARGS:-}
py_args=()
if [ "$emulate" = 1 ]; then
  bench_args=${WEFT_BENCH_ARGS:---model mini --batch 2 --steps 2 --warmup 2}
  py_args=(--device cpu --num-layers 4 --hidden-size 256 --num-heads 4 --seq-length 128
           --micro-batch-size 2 --vocab-size 256 --steps 2 --warmup 2)
fi
bench_rc=0
t0=$(date +%s)
bench_limit=$(limit_for 240)
if [ "$bench_limit" = 0 ]; then
  bench_rc=124
  : >"$logs/bench_cuda.out"
else
  # shellcheck disable=SC2086
  timeout "$bench_limit" "$build/bench/bench_cuda" --profile --json "$logs/bench_cuda.jsonl" \
    $bench_args >"$logs/bench_cuda.out" 2>&1 || bench_rc=$?
fi
case "$bench_rc" in
  0) bench_result=ok ;;
  77) bench_result=SKIP ;;
  124) bench_result="TIMEOUT ($bench_limit s)" ;;
  *) bench_result="FAIL (exit $bench_rc)" ;;
esac
if { [ "$dry_run" = 1 ] && [ "$bench_rc" != 77 ]; } || { [ "$dry_run" = 0 ] && [ "$bench_rc" != 0 ]; }; then
  failed=1
  tail -n 20 "$logs/bench_cuda.out"
fi
add_row "bench_cuda --profile|$bench_result|$(( $(date +%s) - t0 ))"

# PyTorch's same step, where a python3 has a torch that sees the GPU (any
# torch on the emulator) and WEFT_PYTORCH is not 0.
py=""
needs="torch.cuda.is_available()"
if [ "$emulate" = 1 ]; then needs=True; fi
for candidate in ${WEFT_PYTHON:-} python3 /opt/torch/.venv/bin/python3; do
  if [ "${WEFT_PYTORCH:-1}" = 0 ]; then break; fi
  if command -v "$candidate" >/dev/null &&
     "$candidate" -c "import sys, torch; sys.exit(0 if $needs else 1)" >/dev/null 2>&1; then
    py=$candidate
    break
  fi
done
pytorch_note=""
if [ "${WEFT_PYTORCH:-1}" = 0 ]; then
  pytorch_note="skipped (WEFT_PYTORCH=0)"
  add_row "pytorch_gpt_cuda|$pytorch_note|0"
elif [ -z "$py" ]; then
  pytorch_note="skipped (no $([ "$emulate" = 1 ] || echo 'CUDA ')PyTorch)"
  add_row "pytorch_gpt_cuda|$pytorch_note|0"
else
  t0=$(date +%s)
  py_rc=0
  py_limit=$(limit_for 200)
  if [ "$py_limit" = 0 ]; then py_limit=1; fi  # past the deadline: a TIMEOUT row at once
  timeout "$py_limit" "$py" bench/pytorch_gpt_cuda.py --json "$logs/pytorch_gpt_cuda.jsonl" \
    "${py_args[@]}" >"$logs/pytorch_gpt_cuda.out" 2>&1 || py_rc=$?
  case "$py_rc" in
    0) py_result="ok (torch $(sed -n 's/.*"torch_version": "\([^"]*\)".*/\1/p' \
                               "$logs/pytorch_gpt_cuda.jsonl" | head -n 1))" ;;
    124) py_result="TIMEOUT ($py_limit s)"; pytorch_note="timed out after $py_limit s (rows before it are kept)" ;;
    *) py_result="FAIL (exit $py_rc)"; pytorch_note="failed (exit $py_rc): see above" ;;
  esac
  if [ "$py_rc" != 0 ]; then
    echo "---- pytorch_gpt_cuda: last lines of $logs/pytorch_gpt_cuda.out ----"
    tail -n 20 "$logs/pytorch_gpt_cuda.out"
  fi
  add_row "pytorch_gpt_cuda (baseline, not a check)|$py_result|$(( $(date +%s) - t0 ))"
fi

# --- where the --bf16 step's GPU time goes, kernel by kernel (not a check) ---
ncu_bin=""
for candidate in ncu /usr/local/cuda/bin/ncu; do
  if command -v "$candidate" >/dev/null; then ncu_bin=$(command -v "$candidate"); break; fi
done
kernel_table=""
if [ "$dry_run" = 1 ]; then
  :
elif [ "$emulate" = 1 ]; then
  add_row "kernel profile (ncu, not a check)|skipped (emulated: no GPU kernels)|0"
elif [ "${WEFT_KERNEL_PROFILE:-1}" = 0 ]; then
  add_row "kernel profile (ncu, not a check)|skipped (WEFT_KERNEL_PROFILE=0)|0"
elif [ -z "$ncu_bin" ]; then
  add_row "kernel profile (ncu, not a check)|skipped (no ncu)|0"
elif [ "$(limit_for 90)" -lt 90 ]; then
  add_row "kernel profile (ncu, not a check)|skipped: $(limit_for 90) s left before the deadline, 90 needed (rerun with WEFT_PYTORCH=0)|0"
else
  t0=$(date +%s)
  kmode=bf16
  if [ "$fused" = yes ]; then kmode=bf16+fused; fi
  ncu_rc=0
  # WEFT_BENCH_ARGS's shape, with this one mode and step (the last flag wins).
  # shellcheck disable=SC2086
  timeout "$(limit_for 150)" "$ncu_bin" --profile-from-start off --metrics gpu__time_duration.sum \
    --csv --print-units base --log-file "$logs/kernels.csv" \
    "$build/bench/bench_cuda" $bench_args --modes "$kmode" --warmup 1 --steps 1 \
    --kernel-profile >"$logs/kernel_profile.out" 2>&1 || ncu_rc=$?
  if [ "$ncu_rc" = 0 ] && kernel_table=$("${py:-python3}" bench/kernel_table.py "$logs/kernels.csv" 2>&1); then
    add_row "kernel profile (ncu, not a check)|ok: one $kmode step|$(( $(date +%s) - t0 ))"
  else
    add_row "kernel profile (ncu, not a check)|failed (ncu exit $ncu_rc): see $logs/kernel_profile.out|$(( $(date +%s) - t0 ))"
    tail -n 15 "$logs/kernel_profile.out"
    [ -n "$kernel_table" ] && echo "$kernel_table" | tail -n 5
    kernel_table=""
  fi
fi

# --- report ---
echo
if [ "$emulate" = 1 ]; then
  echo "weft gpu-check --emulate | GPUs: none used: the GPU emulator on the CPU ($cores cores; its times are not a GPU's)"
else
  echo "weft gpu-check$([ "$dry_run" = 1 ] && echo ' --dry-run') | GPUs: $gpus$([ "$gpus" -gt 0 ] && echo " ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1))")"
fi
echo
echo "| check | result | seconds |"
echo "|---|---|---:|"
for row in "${results[@]}"; do
  IFS='|' read -r name result secs <<<"$row"
  echo "| $name | $result | $secs |"
done
if [ "$bench_rc" != 77 ] && [ -s "$logs/bench_cuda.out" ]; then  # all it printed, if it ran
  echo
  # Its header lines, each table, the list of operations widened to fp32
  # per mode, and the blank lines between them.
  awk '/^(weft bench_cuda|profile of)/ { print; print ""; next } /^\|/ { print; table = 1; next }
       /^widened to fp32/ { print; next } /^- / { print; list = 1; next }
       table { print ""; table = 0 } list { print ""; list = 0 }' "$logs/bench_cuda.out"
fi
if [ -s "$logs/bench_cuda.jsonl" ]; then
  echo
  echo "weft and PyTorch, the same step (tokens/s over PyTorch's torch.compile bf16 in the last column):"
  echo
  table_args=(--weft "$logs/bench_cuda.jsonl")
  if [ -s "$logs/pytorch_gpt_cuda.jsonl" ]; then table_args+=(--pytorch "$logs/pytorch_gpt_cuda.jsonl"); fi
  if [ -n "$pytorch_note" ]; then table_args+=(--pytorch-note "$pytorch_note"); fi
  if [ -z "$pytorch_note" ] && ! [ -s "$logs/pytorch_gpt_cuda.jsonl" ]; then
    table_args+=(--pytorch-note "no rows written")
  fi
  "${py:-python3}" bench/cuda_table.py "${table_args[@]}" || echo "gpu-check: bench/cuda_table.py failed" >&2
fi
if [ -n "$kernel_table" ]; then
  echo
  echo "one ${kmode} step's kernels by GPU time (ncu, launches serialised; the sum is GPU work, not the step's wall time):"
  echo
  echo "$kernel_table"
fi
if [ "$fused" = no ]; then
  echo
  echo "note: cuDNN fused attention was not built${fused_note:+: $fused_note}"
fi
total=$(( $(date +%s) - start ))
echo
echo "total: ${total} s (budget on a GPU machine: 300 s, and 180 s more for PyTorch); logs in $logs"
if [ "$failed" = 1 ]; then
  echo "gpu-check: FAILED" >&2
  exit 1
fi
if [ "$dry_run" = 1 ]; then
  echo "gpu-check: dry run ok: the CUDA build links and every GPU test skips cleanly"
elif [ "$emulate" = 1 ]; then
  echo "gpu-check: emulated run ok: every step of the check ran on the GPU emulator (not a GPU)"
else
  echo "gpu-check: ok"
fi
