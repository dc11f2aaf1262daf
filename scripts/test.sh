#!/usr/bin/env bash
# Sets up (scripts/setup.sh), then builds and runs the whole test suite.
# Arguments go to `meson test` (e.g. --suite mpi, or a test's name).
# WEFT_WERROR=1 turns warnings into errors, as CI does.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
meson test -C "${WEFT_BUILD:-build}" --print-errorlogs "$@"
