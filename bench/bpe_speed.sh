#!/usr/bin/env bash
# weft's GPT-2 BPE (weft/bpe.h) against Hugging Face's tokenizers: the same
# documents encoded by both, one call per document, one thread, no batching.
#
#   bench/bpe_speed.sh [build-dir]                            (default: build)
#   PYTHON=/tmp/tokvenv/bin/python bench/bpe_speed.sh build   (a python with tokenizers)
#
# Text: the fortune files Debian ships (apt-get install fortunes), one
# document per fortune, about 2.5 MB. Vocabulary: GPT-2's own vocab.json and
# merges.txt where BPE_VOCAB and BPE_MERGES name them, else a byte-level BPE
# of GPT-2's size (50257 tokens, <|endoftext|> among them) that tokenizers
# trains on the same text first. Three rounds, each running both sides in a
# fresh process (the order alternating), each timing one pass over all the
# documents after loading, from empty caches; the table gives the median MB/s
# (10^6 bytes) of the rounds and their range, and the ratio of the medians.
# Both sides' ids are compared, every round: the bench fails if they differ.
set -euo pipefail
build=${1:-build}
exe="$build/bench/bench_bpe"
python=${PYTHON:-python3}
here=$(cd "$(dirname "$0")" && pwd)
[[ -x "$exe" ]] || { echo "error: $exe not found; build first: ./scripts/setup.sh" >&2; exit 1; }
fortunes=/usr/share/games/fortunes
[[ -d $fortunes ]] || { echo "error: $fortunes not found (apt-get install fortunes)" >&2; exit 1; }
"$python" -c "import tokenizers" 2>/dev/null || {
  echo "error: $python has no tokenizers: python3 -m venv /tmp/tokvenv &&" \
    "/tmp/tokvenv/bin/pip install tokenizers, then PYTHON=/tmp/tokvenv/bin/python $0" >&2
  exit 1
}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

vocab=${BPE_VOCAB:-$work/vocab.json}
merges=${BPE_MERGES:-$work/merges.txt}
"$python" - "$fortunes" "$work" "${BPE_VOCAB:-}" <<'PY'
import glob, json, os, sys
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
fortunes, work, given = sys.argv[1:4]
docs = []
for path in sorted(glob.glob(os.path.join(fortunes, "*"))):
    if path.endswith((".dat", ".u8")) or not os.path.isfile(path):
        continue
    text = open(path, "rb").read().decode("utf-8", errors="replace")
    docs += [d for d in text.split("\n%\n") if d.strip()]
with open(os.path.join(work, "docs.jsonl"), "w", encoding="utf-8") as f:
    for d in docs:
        f.write(json.dumps(d) + "\n")
if not given:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=50257, min_frequency=2,
                                  special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(docs, trainer=trainer)
    tok.model.save(work)
PY
size=$(stat -c %s "$work/docs.jsonl")
ntok=$("$python" -c "import json,sys; print(len(json.load(open(sys.argv[1]))))" "$vocab")

run_side() {  # side round
  if [[ $1 == weft ]]; then
    "$exe" --vocab "$vocab" --merges "$merges" --docs "$work/docs.jsonl" --ids "$work/$1.ids"
  else
    "$python" "$here/bpe_tokenizers.py" --vocab "$vocab" --merges "$merges" \
      --docs "$work/docs.jsonl" --ids "$work/$1.ids"
  fi >>"$work/results.jsonl"
}
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
for round in 1 2 3; do
  if ((round % 2)); then sides=(weft tokenizers); else sides=(tokenizers weft); fi
  for side in "${sides[@]}"; do run_side "$side"; done
  cmp -s "$work/weft.ids" "$work/tokenizers.ids" ||
    { echo "error: round $round: weft's ids differ from tokenizers'" >&2; exit 1; }
done

echo "# GPT-2 BPE encoding, one thread, one call per document ($(nproc) cores," \
  "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'))"
echo "# vocabulary: ${BPE_VOCAB:-a byte-level BPE tokenizers trained on the text}, $ntok tokens;" \
  "docs.jsonl $size bytes; ids identical on both sides in every round"
echo "# load average before and after: $load_before; $(cut -d' ' -f1-3 /proc/loadavg)"
echo
"$python" - "$work/results.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
r0 = rows[0]
print(f"{r0['documents']} documents, {r0['bytes'] / 1e6:.2f} MB of UTF-8, {r0['tokens']} tokens\n")
print("| side | MB/s, median of 3 | range | rounds |")
print("|---|---:|---:|---|")
med = {}
for side in ("weft", "tokenizers"):
    v = [r["mb_per_s"] for r in rows if r["side"] == side]
    med[side] = statistics.median(v)
    print(f"| {side} | {med[side]:.2f} | {min(v):.2f}-{max(v):.2f} | "
          + ", ".join(f"{x:.2f}" for x in v) + " |")
print(f"\nweft / tokenizers: {med['weft'] / med['tokenizers']:.2f}x")
PY
