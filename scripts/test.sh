#!/usr/bin/env bash
# Sets up (scripts/setup.sh), then builds and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
meson test -C build --print-errorlogs "$@"
