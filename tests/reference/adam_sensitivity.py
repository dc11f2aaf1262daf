#!/usr/bin/env python3
"""How much AdamW amplifies gradient noise on the parity fixture.

Reruns gpt_reference.py's five clipped AdamW steps with noise added to every
nonzero gradient element (Gaussian, `eta` times its tensor's RMS: the shape
of reduction-order noise, which elements with no terms do not get), and
prints the largest relative change of each final weight tensor over a few
noise draws. test_parity.cc's final-weights tolerance comes from it.

    python3 tests/reference/adam_sensitivity.py   # Debian's python3-torch
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt_reference as R  # noqa: E402


def final_weights(eta, seed):
    torch.set_num_threads(1)
    torch.manual_seed(R.SEED)
    model = R.GPT(R.CFG)
    R.init_weights(model)
    T, G, V = R.SEQ_LENGTH, R.BATCH, R.CFG.vocab_size
    tokens = torch.randint(0, V, (R.STEPS, G, T + 1), dtype=torch.int32)
    opt = torch.optim.AdamW(R.param_groups(model, R.WEIGHT_DECAY), lr=R.LR, betas=R.BETAS,
                            eps=R.EPS)
    gen = torch.Generator().manual_seed(seed)
    for s in range(R.STEPS):
        opt.zero_grad(set_to_none=True)
        R.loss_fn(model(tokens[s][:, :T]), tokens[s][:, 1:]).backward()
        if eta:
            for p in model.parameters():
                g = p.grad
                noise = torch.randn(g.shape, generator=gen) * eta * g.pow(2).mean().sqrt()
                p.grad = g + (g != 0) * noise
        torch.nn.utils.clip_grad_norm_(model.parameters(), R.CLIP_GRAD)
        opt.step()
    return {n: p.detach().double().clone() for n, p in model.named_parameters()}


def main():
    base = final_weights(0, 0)
    for eta in (1e-7, 1e-6):
        worst = {}
        for seed in range(1, 6):
            moved = final_weights(eta, seed)
            for n, w in base.items():
                if "c_attn.bias" in n:  # the key bias: zero true gradient (test_parity.cc)
                    continue
                rel = ((moved[n] - w).norm() / w.norm()).item()
                worst[n] = max(worst.get(n, 0.0), rel)
        top = sorted(worst.items(), key=lambda kv: -kv[1])
        print(f"noise {eta:g} of each tensor's RMS: worst final-weight change "
              f"{top[0][1]:.3g} ({top[0][1] / eta:.0f}x)")
        for n, v in top[:4]:
            print(f"  {n}: {v:.3g}")


if __name__ == "__main__":
    main()
