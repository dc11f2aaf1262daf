#!/usr/bin/env python3
"""Hugging Face transformers' own GPT-2 and Llama, for weft-hf's tests.

Builds two tiny models with transformers, saves them as transformers saves
any model, and writes the logits transformers computes for a batch of tokens,
into tests/reference/fixtures/hf/:

  gpt2_tiny/       config.json, model.safetensors: GPT2LMHeadModel (width 16), F32
  llama_gqa_tiny/  config.json, model.safetensors: LlamaForCausalLM (width 32), 4 query
                   heads sharing 2 key/value heads, rope_theta 500, BF16
  logits.safetensors  "tokens" I32 [2, 16]; "<case>.logits" F32 [2, 16, 96]:
                   each model reloaded with from_pretrained in float32 (the
                   Llama's bf16 weights become fp32 exactly), eager attention,
                   on the CPU

tests/test_hf.cc imports each folder with weft-hf, runs weft's forward on the
tokens and compares the logits; it exports the import again and compares the
tensors with these files bit for bit. CI needs neither PyTorch nor
transformers: it reads the committed files.

    /tmp/hfvenv/bin/python tests/reference/hf_reference.py          # regenerate, then verify
    /tmp/hfvenv/bin/python tests/reference/hf_reference.py --check  # verify the files only
    /tmp/hfvenv/bin/python tests/reference/hf_reference.py --check --weft-build build

With --weft-build, the verification goes round weft too: weft-hf import of
each folder, the result as a weft checkpoint folder (iter_0000000 with its
meta.json and no optimizer state; unverified: no manifest), weft-hf export of that, and
from_pretrained of the export, whose logits must equal those of the fixture
folder bit for bit (the same fp32 weights, the same transformers).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "fixtures", "hf")
LOGITS = os.path.join(FIXTURES, "logits.safetensors")
BATCH, SEQ, VOCAB = 2, 16, 96
SEED = 2024


def gpt2_config():
    return GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=2, n_head=4,
                      activation_function="gelu_new", layer_norm_epsilon=1e-5,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                      bos_token_id=0, eos_token_id=0)  # GPT-2's 50256 is past this vocabulary


def llama_config():
    # rope_theta other than the default, so that a base that did not reach
    # weft shows in the logits.
    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=SEQ, rms_norm_eps=1e-5, rope_theta=500.0,
                       tie_word_embeddings=False, hidden_act="silu")


# name: (model class, config, dtype it is saved in, weft's meta.json config)
CASES = {
    "gpt2_tiny": (GPT2LMHeadModel, gpt2_config, torch.float32,
                  {"arch": "gpt2", "num_layers": 2, "hidden_size": 16, "num_heads": 4,
                   "vocab_size": VOCAB, "max_positions": SEQ}),
    "llama_gqa_tiny": (LlamaForCausalLM, llama_config, torch.bfloat16,
                       {"arch": "llama", "num_layers": 2, "hidden_size": 32, "num_heads": 4,
                        "num_query_groups": 2, "ffn_hidden_size": 48, "rotary_base": 500.0,
                        "vocab_size": VOCAB, "max_positions": SEQ}),
}


def perturb(model, gen):
    """transformers initialises matrices N(0, 0.02), norm weights to 1 and biases
    to 0; make every parameter matter: matrices 5 times as large (sharper
    attention, so that positions and rotary angles show in the logits), norm
    weights 1 + N(0, 0.1), biases N(0, 0.02)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() != 1:
                p.mul_(5.0)
                continue
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("bias"):
                p.copy_(0.02 * noise)
            else:
                p.copy_(1.0 + 0.1 * noise)


def load(case, folder):
    cls = CASES[case][0]
    model = cls.from_pretrained(folder, torch_dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def logits_of(model, tokens):
    with torch.no_grad():
        return model(tokens.long()).logits.float().contiguous()


def generate():
    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED)
    os.makedirs(FIXTURES, exist_ok=True)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen, dtype=torch.int32)
    out = {"tokens": tokens}
    meta = {"transformers_version": transformers.__version__, "torch_version": torch.__version__,
            "seed": str(SEED)}
    for case, (cls, config, dtype, _) in CASES.items():
        model = cls(config())
        perturb(model, gen)
        folder = os.path.join(FIXTURES, case)
        shutil.rmtree(folder, ignore_errors=True)
        model.to(dtype).save_pretrained(folder, safe_serialization=True)
        for extra in os.listdir(folder):  # generation_config.json: nothing weft reads
            if extra not in ("config.json", "model.safetensors"):
                os.remove(os.path.join(folder, extra))
        reloaded = load(case, folder)
        logits = logits_of(reloaded, tokens)
        out[case + ".logits"] = logits
        # transformers' own fp32 rounding: the same model in fp64.
        exact = logits_of(reloaded.double(), tokens).double()
        err = ((logits.double() - exact).norm() / exact.norm()).item()
        meta[case + ".fp32_vs_fp64"] = f"{err:.3e}"
        print(f"{case}: saved {dtype} to {folder}; fp32 logits vs fp64: {err:.3e} relative")
    save_file(out, LOGITS, metadata=meta)
    print(f"wrote {LOGITS} (transformers {transformers.__version__}, torch {torch.__version__})")


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout}{r.stderr}")
    return r.stdout


def check(weft_build):
    fixture = load_file(LOGITS)
    tokens = fixture["tokens"]
    ok = True
    for case, (_, _, _, weft_config) in CASES.items():
        folder = os.path.join(FIXTURES, case)
        want = fixture[case + ".logits"]
        got = logits_of(load(case, folder), tokens)
        err = ((got - want).norm() / want.norm()).item()
        print(f"{case}: transformers {transformers.__version__} logits vs the fixture's: "
              f"{err:.3e} relative")
        ok &= err < 1e-6
        if not weft_build:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            imported = os.path.join(tmp, "weft.safetensors")
            print("  " + run([os.path.join(weft_build, "weft-hf"), "import", "--input", folder,
                              "--output", imported]).replace("\n", "\n  ").rstrip())
            iter_dir = os.path.join(tmp, "ckpt", "iter_0000000")
            os.makedirs(iter_dir)
            shutil.copy(imported, os.path.join(iter_dir, "model.safetensors"))
            save_file({}, os.path.join(iter_dir, "optimizer.safetensors"))  # no state
            with open(os.path.join(iter_dir, "meta.json"), "w") as f:
                json.dump({"format_version": 1, "step": 0, "consumed_samples": 0,
                           "optimizer_steps": 0, "config": weft_config}, f)
            exported = os.path.join(tmp, "export")
            print("  " + run([os.path.join(weft_build, "weft-hf"), "export", "--load", iter_dir,
                              "--load-unverified", "--output", exported]).rstrip())
            back = logits_of(load(case, exported), tokens)
            same = torch.equal(back, got)
            verdict = "equal the fixture folder's bit for bit" if same else "DIFFER"
            print(f"  from_pretrained of weft-hf's export: logits {verdict} "
                  f"(max |difference| {(back - got).abs().max().item():.3e})")
            ok &= same
    if not ok:
        sys.exit("hf_reference: FAILED")
    print("hf_reference: OK")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="verify the existing files only")
    ap.add_argument("--weft-build", help="a build folder holding weft-hf: check its import "
                    "and export against transformers too")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if not args.check:
        generate()
    check(args.weft_build)


if __name__ == "__main__":
    main()
