# Sourced by the bench scripts that time train_gpt on the fortunes file:
#   source "$(dirname "$0")/preamble.sh" "$@"      (optionally need_time=1 before it)
# sets build (the first argument, default build), rounds (the second,
# default 2), exe, data and work (a temporary folder, removed on exit), and
# stops with one line naming what is missing.
set -euo pipefail
build=${1:-build}
rounds=${2:-2}
exe="$build/train_gpt"
[[ -x "$exe" ]] || { echo "error: $exe not found; build first: ./scripts/setup.sh" >&2; exit 1; }
data=/usr/share/games/fortunes/fortunes
[[ -f $data ]] || { echo "error: $data not found (apt-get install fortunes)" >&2; exit 1; }
if [[ ${need_time:-0} == 1 && ! -x /usr/bin/time ]]; then
  echo "error: /usr/bin/time not found (apt-get install time)" >&2
  exit 1
fi
export MPIEXEC_TIMEOUT=600 OMP_WAIT_POLICY=PASSIVE
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
