#!/usr/bin/env bash
# The GPU tests on this machine's CPU, through the GPU emulator
# (tests/cuda_emu/README.md): builds build-emu with -Dgpu_emulator=true (only
# the library, train_gpt and the GPU tests' binaries) and runs the 'gpu' and
# 'cuda' suites. No GPU is needed or used. Arguments go to `meson test`.
# WEFT_WERROR=1 turns warnings into errors, as CI does.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/packages.sh

build=${WEFT_EMU_BUILD:-build-emu}
if [ ! -f /usr/include/boost/context/fiber.hpp ]; then
  install_packages "Boost.Context (the emulator's fibers)" libboost-context-dev
fi
opts=(-Dgpu_emulator=true -Dcudnn=enabled)  # cuDNN: the emulator's stand-in
if [ "${WEFT_WERROR:-0}" = 1 ]; then opts+=(-Dwerror=true); fi
if [ -f "$build/build.ninja" ]; then
  meson setup --reconfigure "$build" "${opts[@]}" >/dev/null
else
  rm -rf "$build"
  meson setup "$build" "${opts[@]}" >/dev/null
fi
# The executables of the two suites, as meson lists them.
mapfile -t targets < <(meson introspect "$build" --tests | python3 -c '
import json, os, sys
build = sys.argv[1]
seen = set()
for t in json.load(sys.stdin):
    if set(t["suite"]) & {"weft:gpu", "weft:cuda"}:
        # The binary, or for a test run by mpiexec the binary among its arguments.
        for arg in t["cmd"]:
            exe = os.path.relpath(arg, os.path.abspath(build))
            if exe.startswith("..") or not os.path.isabs(arg):
                continue
            if exe not in seen:
                seen.add(exe)
                print(exe)
            break
print("train_gpt")
' "$build")
ninja -C "$build" "${targets[@]}"
meson test -C "$build" --no-rebuild --suite gpu --suite cuda --print-errorlogs \
  --timeout-multiplier 4 "$@"
