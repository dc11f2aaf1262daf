#!/usr/bin/env bash
# Configures and builds weft in ./build, installing what the build says is
# missing. Safe to run again: it installs nothing that is there and only
# rebuilds what changed.
#
# The build is asked, not a list of package names: `meson setup` names every
# missing dependency by its Debian/Ubuntu package on one line ("weft-setup
# missing packages: ..."), and the optional ones on another. Where meson finds
# everything (an offline machine with the libraries installed), no package
# manager is touched. Where something is missing, it is installed with apt
# when apt can be used (root, or sudo), else named, and set-up stops.
#
# Environment:
#   WEFT_WERROR=1      build with -Dwerror=true (CI does; a user's build never
#                      fails on a warning)
#   WEFT_MESON_ARGS    more `meson setup` options, e.g. "-Dcuda=disabled -Dmpi=openmpi"
#   WEFT_BUILD         the build directory (default: build)
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/packages.sh
source scripts/packages.sh

build=${WEFT_BUILD:-build}

# Tools meson needs before it can be asked anything.
tools=()
command -v meson >/dev/null || tools+=(meson)
command -v ninja >/dev/null || tools+=(ninja-build)
command -v pkg-config >/dev/null || tools+=(pkg-config)
command -v c++ >/dev/null || tools+=(build-essential)
if ((${#tools[@]})); then
  install_packages "the build tools" "${tools[@]}"
fi
# ccache only makes rebuilds faster: installed where apt can, never required.
command -v ccache >/dev/null || try_install_packages ccache || true

opts=(-Dcuda=auto)
if [ "${WEFT_WERROR:-0}" = 1 ]; then opts+=(-Dwerror=true); fi
# shellcheck disable=SC2206
opts+=(${WEFT_MESON_ARGS:-})

# meson setup, then the packages it names as missing, then set up again: at
# most twice, since the first failure names every missing package at once.
configure() {
  local log=$1
  if [ -f "$build/build.ninja" ]; then
    meson setup --reconfigure "$build" "${opts[@]}" >"$log" 2>&1
  else
    rm -rf "$build"
    meson setup "$build" "${opts[@]}" >"$log" 2>&1
  fi
}
log=$(mktemp /tmp/weft-setup.XXXXXX)
for attempt in 1 2; do
  if configure "$log"; then break; fi
  missing=$(sed -n 's/.*weft-setup missing packages: \([^(]*\).*/\1/p' "$log" | tail -n 1)
  if [ -z "$missing" ] || [ "$attempt" = 2 ]; then
    tail -n 30 "$log" >&2
    echo "setup: meson setup failed (full log: $log)" >&2
    exit 1
  fi
  # shellcheck disable=SC2086
  install_packages "what the build needs" $missing
done
optional=$(sed -n 's/.*weft-setup optional packages: \(.*\)$/\1/p' "$log" | tail -n 1)
if [ -n "$optional" ]; then
  # shellcheck disable=SC2086
  if try_install_packages $optional; then
    configure "$log" || { tail -n 30 "$log" >&2; exit 1; }
  else
    echo "setup: optional packages missing, building without them: $optional" >&2
  fi
fi
grep -E "WARNING" "$log" >&2 || true
rm -f "$log"

ninja -C "$build"
