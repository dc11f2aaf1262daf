#!/usr/bin/env bash
# Sets up, then trains a small GPT (4 layers, width 128, 0.8M parameters) on
# English text (the fortune cookie files Debian ships), with a validation loss
# on 2% of it held out, draws the loss curves (data/loss.svg) and prints a
# sample.
# About 3 minutes on 2 cores.
# Any flag given here is passed on to train_gpt, e.g. --data-path my.txt.
# Each run trains afresh (--no-load --overwrite-checkpoints); resume a saved
# run with ./build/train_gpt ... --load data/checkpoints.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh

# shellcheck source=scripts/packages.sh
source scripts/packages.sh
make_sample_text

exec ./build/train_gpt --num-layers 4 --hidden-size 128 --num-attention-heads 4 \
  --seq-length 64 --data-path data/fortunes.txt \
  --micro-batch-size 32 --global-batch-size 32 --train-iters 1200 \
  --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 30 \
  --split 98,2,0 --eval-interval 200 --eval-iters 10 \
  --log-interval 100 --log-jsonl data/sample.jsonl --loss-plot data/loss.svg \
  --save data/checkpoints --no-load --overwrite-checkpoints --sample 400 "$@"
