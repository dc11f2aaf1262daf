#!/usr/bin/env python3
"""Five Lion steps of the tiny GPT of gpt_reference.py, in PyTorch: the
fixture that weft's Lion (src/runtime/lion.cc) is checked against.

Starts from gpt_tiny_init.safetensors and reads the batches of
gpt_tiny_golden.safetensors, so it shares the AdamW fixture's model and data;
writes fixtures/gpt_tiny_lion.safetensors (losses, gradient norms, final
weights). Needs PyTorch and numpy; the C++ tests only read the file.

    python3 tests/reference/lion_reference.py          # regenerate + verify
    python3 tests/reference/lion_reference.py --check  # verify the existing file

Lion as Chen et al. 2023 give it (and lion-pytorch's update): with g the
clipped gradient, p *= 1 - lr wd (tensors of >= 2 dims); c = b1 m + (1 - b1) g;
p -= lr sign(c); m = b2 m + (1 - b2) g.
"""

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt_reference as ref  # noqa: E402

LION_PATH = os.path.join(ref.FIXTURES, "gpt_tiny_lion.safetensors")
LR = 1e-3          # Lion's steps are lr-sized: a third of the AdamW fixture's 3e-3
BETAS = (0.9, 0.99)
WEIGHT_DECAY = 0.3


@torch.no_grad()
def lion_step(params, moments, lr):
    for p, m in zip(params, moments):
        g = p.grad
        if p.dim() >= 2:
            p.mul_(1 - lr * WEIGHT_DECAY)
        c = m * BETAS[0] + g * (1 - BETAS[0])
        p.add_(torch.sign(c), alpha=-lr)
        m.mul_(BETAS[1]).add_(g, alpha=1 - BETAS[1])


def generate():
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    _, init, _ = ref.read_safetensors(ref.INIT_PATH)
    _, golden, _ = ref.read_safetensors(ref.GOLDEN_PATH)
    model = ref.GPT(ref.CFG)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(torch.from_numpy(init[n]))
    params = list(model.parameters())
    moments = [torch.zeros_like(p) for p in params]
    tokens = torch.from_numpy(golden["tokens"])
    T = ref.SEQ_LENGTH
    losses, norms = [], []
    for s in range(ref.STEPS):
        inputs, targets = tokens[s][:, :T], tokens[s][:, 1:]
        for p in params:
            p.grad = None
        loss = ref.loss_fn(model(inputs), targets)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, ref.CLIP_GRAD)
        losses.append(float(loss.item()))
        norms.append(float(norm.item()))
        print(f"step {s}: loss {losses[-1]:.6f}  grad_norm {norms[-1]:.6f}")
        lion_step(params, moments, LR)
    out = [("losses", np.array(losses, dtype=np.float32)),
           ("grad_norms", np.array(norms, dtype=np.float32))]
    out += [("final." + n, ref.to_np(p).copy()) for n, p in model.named_parameters()]
    meta = {"lr": repr(LR), "beta1": repr(BETAS[0]), "beta2": repr(BETAS[1]),
            "weight_decay": repr(WEIGHT_DECAY), "clip_grad": repr(ref.CLIP_GRAD),
            "steps": str(ref.STEPS), "torch_version": torch.__version__}
    ref.write_safetensors(LION_PATH, out, meta)
    _, back, _ = ref.read_safetensors(LION_PATH)
    for n, a in out:
        assert np.array_equal(back[n], a), n
    print(f"wrote {LION_PATH}")


def check():
    _, f, meta = ref.read_safetensors(LION_PATH)
    assert list(f["losses"].shape) == [ref.STEPS] and list(f["grad_norms"].shape) == [ref.STEPS]
    assert float(meta["lr"]) == LR
    print("losses    ", " ".join(f"{x:.6f}" for x in f["losses"]))
    print("grad_norms", " ".join(f"{x:.6f}" for x in f["grad_norms"]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="only verify the existing file")
    args = ap.parse_args()
    if not args.check:
        generate()
    check()


if __name__ == "__main__":
    main()
