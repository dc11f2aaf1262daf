#!/bin/sh
# tests/reference/test_pytorch_bench.py under a python that has torch (Debian:
# python3-torch); SKIP (77) where none has.
here=$(dirname "$0")
for py in ${PYTHON:-} python3 /usr/bin/python3; do
  if command -v "$py" >/dev/null && "$py" -c 'import torch' 2>/dev/null; then
    exec "$py" "$here/reference/test_pytorch_bench.py"
  fi
done
echo "SKIP: no python3 with torch (apt-get install python3-torch)"
exit 77
