#!/usr/bin/env bash
# Sets up, then trains a 4-layer GPT on English text (the fortune cookie files
# Debian ships) and prints a sample. A few minutes on 2 cores.
# Any flag given here is passed on to train_gpt, e.g. --data-path my.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh

mkdir -p data
if [ ! -s data/fortunes.txt ]; then
  # The plain-text fortune files: skip the .dat indexes and the .u8 links.
  find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' \
    -print0 | sort -z | xargs -0 cat > data/fortunes.txt
fi

exec ./build/train_gpt --model mini --data-path data/fortunes.txt \
  --micro-batch-size 16 --global-batch-size 16 --train-iters 400 \
  --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters 20 \
  --log-interval 20 --log-jsonl data/sample.jsonl --save data/checkpoints \
  --sample 400 "$@"
