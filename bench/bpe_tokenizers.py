#!/usr/bin/env python3
"""Hugging Face's tokenizers encoding documents with GPT-2's byte-level BPE,
the other side of bench/bpe_speed.sh (bench_bpe is weft's): one encode() call
per document, no batch, on one thread.

    python3 bench/bpe_tokenizers.py --vocab vocab.json --merges merges.txt --docs docs.jsonl [--ids ids.bin]

Prints one JSON line as bench_bpe does; --ids writes every id as int32.
"""

import argparse
import array
import json
import os
import sys
import time

os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["RAYON_NUM_THREADS"] = "1"
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", required=True)
    parser.add_argument("--merges", required=True)
    parser.add_argument("--docs", required=True)
    parser.add_argument("--ids")
    args = parser.parse_args()
    with open(args.docs, encoding="utf-8") as f:
        docs = [json.loads(line) for line in f]
    size = sum(len(d.encode("utf-8")) for d in docs)
    tok = Tokenizer(models.BPE.from_file(args.vocab, args.merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    ids = array.array("i")
    start = time.perf_counter()
    for d in docs:
        ids.extend(tok.encode(d, add_special_tokens=False).ids)
    seconds = time.perf_counter() - start
    if args.ids:
        with open(args.ids, "wb") as f:
            ids.tofile(f)
    print(json.dumps({"side": "tokenizers", "documents": len(docs), "bytes": size,
                      "tokens": len(ids), "seconds": round(seconds, 4),
                      "mb_per_s": round(size / seconds / 1e6, 3)}))


if __name__ == "__main__":
    sys.exit(main())
