#!/usr/bin/env bash
# Puts cudnn-frontend's headers (header-only C++ over cuDNN's graph API, for
# the fused attention of src/cuda/fused_attention.cc) into
# third_party/cudnn_frontend/include, which git ignores. They come from the
# PyPI wheel nvidia-cudnn-frontend, whose include/ folder holds them; the
# wheel's compiled Python module is not used. The build finds the folder by
# itself (meson.build, option -Dcudnn). A machine without the network (the
# GPU machine) gets the folder by carrying third_party/ over from one that
# ran this script.
#
#   scripts/cudnn-frontend.sh            # the pinned version below
#   WEFT_CUDNN_FRONTEND=1.32.0 scripts/cudnn-frontend.sh
set -euo pipefail
cd "$(dirname "$0")/.."

version=${WEFT_CUDNN_FRONTEND:-1.32.0}
dest=third_party/cudnn_frontend
tmp=$(mktemp -d /tmp/weft-cudnn-frontend.XXXXXX)
trap 'rm -rf "$tmp"' EXIT

python3 -m pip download --quiet --no-deps --dest "$tmp" "nvidia-cudnn-frontend==$version"
wheel=$(ls "$tmp"/nvidia_cudnn_frontend-*.whl)
# A wheel is a zip file; Python's zipfile needs nothing that may be missing (unzip).
python3 - "$wheel" "$tmp/unpacked" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("include/")])
PY
if ! [ -f "$tmp/unpacked/include/cudnn_frontend.h" ]; then
  echo "cudnn-frontend: $wheel has no include/cudnn_frontend.h" >&2
  exit 1
fi
rm -rf "$dest"
mkdir -p "$dest"
mv "$tmp/unpacked/include" "$dest/include"
echo "$version" >"$dest/VERSION"
echo "cudnn-frontend $version headers in $dest/include"
