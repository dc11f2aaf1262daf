#!/usr/bin/env python3
"""GPT-2's byte-level BPE, as Hugging Face's `tokenizers` runs it: the fixtures
that weft's BpeTokenizer (src/io/bpe.cc) is checked against, token for token.

Trains a small byte-level BPE (vocabulary 640, `<|endoftext|>` its one special
token) on the text below, saves it the two ways weft loads one, and encodes a
corpus of awkward cases with it:

    fixtures/bpe_vocab.json       GPT-2's vocab.json: byte-level token -> id
    fixtures/bpe_merges.txt       GPT-2's merges.txt: "#version" line, one merge a line
    fixtures/bpe_tokenizer.json   the same tokenizer as tokenizers saves it
    fixtures/bpe_cases.json       {"tokenizers_version", "cases": [{"name", "text", "ids"}]}

The expected ids come from a tokenizer loaded back from vocab.json and
merges.txt alone, as Megatron's GPT2BPETokenizer loads them: special tokens
are vocabulary entries, never parsed out of the text, so "<|endoftext|>"
inside a text is encoded as ordinary characters (the trained tokenizer with
`encode_special_tokens = True` is checked to agree). tokenizers takes Python
strings, so no case holds invalid UTF-8; the C++ test covers that alone.

    python3 -m venv /tmp/tokvenv && /tmp/tokvenv/bin/pip install tokenizers
    /tmp/tokvenv/bin/python tests/reference/bpe_reference.py          # regenerate + verify
    /tmp/tokvenv/bin/python tests/reference/bpe_reference.py --check  # verify the existing files

The files were produced with tokenizers 0.23.3 (recorded in bpe_cases.json).
Training is deterministic for a given tokenizers version.
"""

import argparse
import json
import os
import sys

import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
VOCAB_PATH = os.path.join(FIXTURES, "bpe_vocab.json")
MERGES_PATH = os.path.join(FIXTURES, "bpe_merges.txt")
TOKENIZER_PATH = os.path.join(FIXTURES, "bpe_tokenizer.json")
CASES_PATH = os.path.join(FIXTURES, "bpe_cases.json")
VOCAB_SIZE = 640
EOD = "<|endoftext|>"

TRAINING_TEXT = """\
A loom holds two sets of threads. The warp runs the length of the cloth and is
stretched tight before weaving starts; the weft is carried across it, over and
under, one pass at a time. Every pass is called a pick. A weaver who counts
picks per inch knows how dense the cloth will be, and a weaver who loses count
finds out when the pattern drifts. The shuttle carries the weft; the reed beats
each pick into place; the heddles lift the warp threads that the pattern asks
for. Plain weave lifts every other thread. Twill shifts the lift by one thread
on each pick, and the cloth shows diagonal ridges. Satin floats the weft over
four or more warp threads, so the face is smooth and catches the light.

Weavers have kept records of their drafts for centuries. A draft is a grid:
threading along the top, treadling down the side, tie-up in the corner, and the
drawdown in the middle shows what the cloth will look like. It's a small
program, and it's run by hand. They'd write drafts in notebooks, they'll share
them in guilds, and we've found drafts from 1790, 1842 and 1911 that still weave
true. I'm told the oldest surviving ones are older still. You're welcome to
check: the numbers 12, 24, 48 and 96 come up often, because ends per inch are
chosen to divide evenly.

Le tisserand règle la chaîne avant de commencer ; la trame passe ensuite, duite
après duite. Ein Webstuhl hält die Kette gespannt, während der Schuss
eingetragen wird. Tejer es contar: cada pasada cuenta, y el diseño se repite.
Ткань получается из основы и утка. 織物は経糸と緯糸でできている。布是由经线和
纬线织成的。 베틀에서 씨실이 날실 사이를 지나간다. النسيج يتكون من السدى واللحمة.
האריג נוצר מחוטי שתי וערב. Ο αργαλειός κρατά το στημόνι τεντωμένο.

Counting matters: 3 picks, 30 picks, 300 picks! Is the pattern right? Check it
again... and again -- then weave. (Mistakes show up later, never sooner.)
"""

# Cases: (name, text). Each one aims at a rule of the pre-tokenization regex
# 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
# or of the byte-level alphabet.
CASES = [
    ("empty", ""),
    ("one_letter", "a"),
    ("one_space", " "),
    ("sentence", "The weaver counts picks per inch before the pattern drifts."),
    ("training_paragraph", TRAINING_TEXT.split("\n\n")[0]),
    ("contractions", "it's, don't, we're, you've, I'm, they'll, she'd"),
    ("contractions_upper", "IT'S, DON'T, WE'RE, YOU'VE, I'M, THEY'LL, SHE'D"),
    ("contractions_mixed", "It'S 'sound' 'tis 'rest ''s '' 'll'm 've've"),
    ("apostrophe_alone", "' '' ''' rock 'n' roll"),
    ("curly_apostrophe", "it\u2019s don\u2019t \u2018quoted\u2019"),
    ("numbers", "1 12 123 1234567890 3.14159 1,000,000 x2 v1.2.3 -7 +8 1e-5"),
    ("other_digits", "\u0663\u0664\u0665 \u096a\u096b \uff11\uff12 \u2167 \u00bd \u00b2 \u2460"),
    ("punctuation_runs", "!!! ??? ... --- ()[]{} <<>> @#$%^&*_+=|\\/~` ;;:: ,,"),
    ("punctuation_space", "a ! b ?! c ... d"),
    ("double_spaces", "a  b   c    d"),
    ("tabs", "a\tb\t\tc \t d\t"),
    ("newlines", "line one\nline two\n\nline four\n\n\n"),
    ("crlf", "one\r\ntwo\r\n\r\nthree"),
    ("leading_spaces", "   leading"),
    ("trailing_spaces", "trailing   "),
    ("only_spaces", "     "),
    ("only_newlines", "\n\n\n"),
    ("mixed_whitespace", " \t\n \n\t x \n\n y\t\t\n"),
    ("space_before_digits", "a   12   b  ,  c"),
    ("vertical_and_form_feed", "a\x0bb\x0cc \x0b\x0c d"),
    ("nbsp_and_wide_spaces", "a\u00a0b\u00a0\u00a0c\u3000d\u2003e\u2028f\u2029g"),
    ("nel", "a\u0085b\u0085\u0085c"),
    ("not_whitespace", "a\u200bb\ufeffc\u180ed\x1ce\x1ff"),
    ("control_bytes", "nul\x00here del\x7f bell\x07 esc\x1b[0m"),
    ("accents", "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00e0 \u00c5ngstr\u00f6m \u0141\u00f3d\u017a"),
    ("combining_marks", "cafe\u0301 n\u0303o e\u0301\u0301\u0301 a\u0308b"),
    ("cjk", "\u7e54\u7269\u306f\u7d4c\u7cf8\u3068\u7def\u7cf8\u3067\u3067\u304d\u3066\u3044\u308b\u3002"
            "\u6771\u4eac\u306f\u96e8\u3067\u3059\u3002"),
    ("korean", "\ubca0\ud2c0\uc5d0\uc11c \uc528\uc2e4\uc774 \uc9c0\ub098\uac04\ub2e4."),
    ("hebrew_rtl", "\u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd, \u05e9\u05ea\u05d9 \u05d5\u05e2\u05e8\u05d1"),
    ("arabic_rtl", "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645\u061f "
                   "\u0627\u0644\u0633\u062f\u0649"),
    ("rtl_marks", "abc \u200f\u05d0\u05d1\u200e def \u202bx\u202c"),
    ("devanagari", "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e"),
    ("thai", "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35\u0e04\u0e23\u0e31\u0e1a"),
    ("greek_cyrillic", "\u039f \u03b1\u03c1\u03b3\u03b1\u03bb\u03b5\u03b9\u03cc\u03c2 "
                       "\u0422\u043a\u0430\u043d\u044c \u0443\u0442\u043a\u0430"),
    ("emoji", "ok \U0001f44d \U0001f44d\U0001f3fd \U0001f468\u200d\U0001f469\u200d\U0001f467 "
              "\U0001f1eb\U0001f1f7 \u2764\ufe0f!"),
    ("astral_letters", "\U0001d49c\U0001d4b7\U0001d4b8 \U00010330\U00010331 \U00020000"),
    ("private_and_unassigned", "a\ue000b \u0378 \U0010fffd"),
    ("special_token_in_text", "one" + EOD + "two " + EOD + " <|endoftext"),
    ("byte_level_lookalikes", "\u0120\u0121 \u010a \u00c4\u00a0"),
    ("long_word", "a" * 300),
    ("long_space_run", " " * 100 + "x" + "\n" * 50),
    ("mixed_paragraph", "Le tisserand r\u00e8gle la cha\u00eene ; 3 picks, 30 picks!\n"
                        "\u7e54\u7269 \u2014 \u201cdone\u201d\t(\U0001f9f5)  it's 1842's."),
]


def train():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=1, special_tokens=[EOD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([TRAINING_TEXT], trainer=trainer)
    return tok


def from_files():
    """A tokenizer from vocab.json and merges.txt alone, as Megatron loads GPT-2's."""
    tok = Tokenizer(models.BPE.from_file(VOCAB_PATH, MERGES_PATH))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def write_files(tok):
    os.makedirs(FIXTURES, exist_ok=True)
    folder, prefix = FIXTURES, "bpe"
    vocab_file, merges_file = tok.model.save(folder, prefix)
    os.replace(vocab_file, VOCAB_PATH)
    os.replace(merges_file, MERGES_PATH)
    tok.save(TOKENIZER_PATH, pretty=False)
    plain = from_files()
    tok.encode_special_tokens = True
    cases = []
    for name, text in CASES:
        ids = plain.encode(text, add_special_tokens=False).ids
        trained = tok.encode(text, add_special_tokens=False).ids
        if ids != trained:
            sys.exit(f"{name}: the tokenizer loaded from the files gives {ids}, "
                     f"the trained one {trained}")
        cases.append({"name": name, "text": text, "ids": ids})
    meta = {"tokenizers_version": tokenizers.__version__, "vocab_size": plain.get_vocab_size(),
            "eod": plain.token_to_id(EOD), "cases": cases}
    with open(CASES_PATH, "w", encoding="utf-8") as f:
        json.dump(meta, f, ensure_ascii=False, indent=1)
        f.write("\n")


def check():
    with open(CASES_PATH, encoding="utf-8") as f:
        meta = json.load(f)
    plain = from_files()
    from_json = Tokenizer.from_file(TOKENIZER_PATH)
    from_json.encode_special_tokens = True
    if [n for n, _ in CASES] != [c["name"] for c in meta["cases"]]:
        sys.exit("bpe_cases.json holds other cases than this script: regenerate it")
    bad = 0
    for (name, text), case in zip(CASES, meta["cases"]):
        for label, tok in (("vocab.json + merges.txt", plain), ("tokenizer.json", from_json)):
            ids = tok.encode(text, add_special_tokens=False).ids
            if ids != case["ids"] or case["text"] != text:
                print(f"{name}: {label} gives {ids}, the fixture holds {case['ids']}")
                bad += 1
        if plain.decode(case["ids"], skip_special_tokens=False) != text:
            print(f"{name}: decoding the ids does not give the text back")
            bad += 1
    if bad:
        sys.exit(f"{bad} mismatches")
    sizes = {os.path.basename(p): os.path.getsize(p)
             for p in (VOCAB_PATH, MERGES_PATH, TOKENIZER_PATH, CASES_PATH)}
    print(f"bpe fixtures: {len(meta['cases'])} cases, vocabulary {meta['vocab_size']} "
          f"(<|endoftext|> = {meta['eod']}), tokenizers {meta['tokenizers_version']}; "
          + ", ".join(f"{k} {v} B" for k, v in sizes.items()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only verify the existing files")
    args = parser.parse_args()
    if not args.check:
        write_files(train())
    check()


if __name__ == "__main__":
    main()
