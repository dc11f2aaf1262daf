#!/usr/bin/env bash
# Installs what a fresh Debian 12 machine lacks, then configures and builds weft
# in ./build. Safe to run again: it only installs missing packages and only
# rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(build-essential meson ninja-build pkg-config ccache mpich libmpich-dev
  libeigen3-dev libgtest-dev libgmock-dev libbenchmark-dev libopenblas-dev
  libopenblas-openmp-dev libcli11-dev nlohmann-json3-dev libfmt-dev fortunes-min fortunes)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=()
  [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -q
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends \
    -o DPkg::Lock::Timeout=600 "${missing[@]}"
fi

if [ ! -f build/build.ninja ]; then
  meson setup build -Dcuda=auto
fi
ninja -C build
