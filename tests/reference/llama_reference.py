#!/usr/bin/env python3
"""Reference Llama-style decoder in plain PyTorch, and the golden fixtures.

The C++ tests compare weft's Llama family (models/llama.cc) against the files
this script writes into tests/reference/fixtures/: llama_tiny_* (multi-head
attention) and llama_gqa_* (grouped-query attention, 4 query heads sharing 2
key/value heads). Running it needs PyTorch and numpy; the tests only read the
committed files.

    python3 tests/reference/llama_reference.py

The model, with weft's parameter names and [in, out] linear weights:
  * token embedding wte [V, C], no learned positions
  * L pre-RMSNorm blocks: x = x + o(attn(rope(qkv(norm(x)))));
    qkv packs [q (H D) | k (G D) | v (G D)], query head i reading key/value
    head i // (H / G) (G = H without grouped-query attention)
                          x = x + down(silu(gate) * up), [gate | up] = gate_up(norm(x))
  * rotary embedding on q and k: pairs (i, i + D/2) of each head rotated by
    t * base^(-2i/D) (the rotate-half convention); no biases anywhere
  * final RMSNorm, an untied LM head [V, C]: logits = x @ lm_head^T
  * loss = mean cross-entropy over all tokens
"""

import math
import os
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_reference import param_groups, read_safetensors, to_np, write_safetensors  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "fixtures")


@dataclass
class LlamaConfig:
    vocab_size: int = 64
    num_layers: int = 2
    hidden_size: int = 32
    num_heads: int = 4
    num_query_groups: int = 0  # 0: one key/value head per query head
    ffn_hidden_size: int = 48
    rope_base: float = 10000.0
    eps: float = 1e-5


class Linear(nn.Module):
    """No bias; weight [in, out], y = x @ W."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))

    def forward(self, x):
        return x @ self.weight


class RMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x, heads, base):
    """x (B, T, C): rotate each head's pairs (i, i + D/2) by t * base^(-2i/D).

    The angle is computed in float64 and rounded to float32 before cos/sin,
    as weft does, so both sides round the same angle.
    """
    B, T, C = x.shape
    D = C // heads
    half = D // 2
    t = torch.arange(T, dtype=torch.float64)[:, None]
    i = torch.arange(half, dtype=torch.float64)[None, :]
    angle = (t * base ** (-2.0 * i / D)).to(x.dtype)
    cos, sin = torch.cos(angle)[None, :, None, :], torch.sin(angle)[None, :, None, :]
    x = x.view(B, T, heads, D)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).view(B, T, C)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        C, H = cfg.hidden_size, cfg.num_heads
        self.groups = cfg.num_query_groups or H
        self.qkv = Linear(C, C + 2 * self.groups * (C // H))
        self.o = Linear(C, C)

    def forward(self, x):
        B, T, C = x.shape
        H, G = self.cfg.num_heads, self.groups
        D = C // H
        q, k, v = self.qkv(x).split([C, G * D, G * D], dim=-1)
        q, k = rope(q, H, self.cfg.rope_base), rope(k, G, self.cfg.rope_base)
        q = q.view(B, T, H, D).transpose(1, 2)
        # Each key/value head serves H / G consecutive query heads.
        k, v = (z.view(B, T, G, D).repeat_interleave(H // G, dim=2).transpose(1, 2)
                for z in (k, v))
        s = (q @ k.transpose(-2, -1)) / math.sqrt(D)
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
        p = F.softmax(s.masked_fill(mask, float("-inf")), dim=-1)
        return self.o((p @ v).transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_up = Linear(cfg.hidden_size, 2 * cfg.ffn_hidden_size)
        self.down = Linear(cfg.ffn_hidden_size, cfg.hidden_size)

    def forward(self, x):
        g, u = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(g) * u)


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.eps)
        self.attn = Attention(cfg)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.eps)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.input_norm(x))
        return x + self.mlp(self.post_attn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.h = nn.ModuleList([Block(cfg) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)  # replaced below: [V, C]
        self.lm_head.weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))

    def forward(self, idx):
        x = self.wte(idx.long())
        for block in self.h:
            x = block(x)
        return self.norm(x) @ self.lm_head.weight.t()


@torch.no_grad()
def init_weights(model, std=0.02):
    """Matrices and embeddings ~ N(0, std); norm weights ~ 1 + N(0, 0.1), so
    that their gradients are exercised."""
    for name, p in model.named_parameters():
        if "norm" in name:
            p.normal_(0.0, 0.1).add_(1.0)
        else:
            p.normal_(0.0, std)


CASES = {"llama_tiny": LlamaConfig(), "llama_gqa": LlamaConfig(num_query_groups=2)}
SEQ_LENGTH = 12
BATCH = 4
STEPS = 5
SEED = 4321
LR = 3e-3
BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.1
CLIP_GRAD = 0.5


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).long())


def write_case(name, cfg):
    init_path = os.path.join(FIXTURES, name + "_init.safetensors")
    golden_path = os.path.join(FIXTURES, name + "_golden.safetensors")
    torch.manual_seed(SEED)
    model = Llama(cfg)
    init_weights(model)
    init_params = [(n, to_np(p).copy()) for n, p in model.named_parameters()]
    T, G, V = SEQ_LENGTH, BATCH, cfg.vocab_size
    tokens = torch.randint(0, V, (STEPS, G, T + 1), dtype=torch.int32)
    opt = torch.optim.AdamW(param_groups(model, WEIGHT_DECAY), lr=LR, betas=BETAS, eps=EPS)
    losses, norms = [], []
    logits0 = grads0 = loss0 = None
    for s in range(STEPS):
        opt.zero_grad(set_to_none=True)
        logits = model(tokens[s][:, :T])
        loss = loss_fn(logits, tokens[s][:, 1:])
        loss.backward()
        if s == 0:
            logits0, loss0 = to_np(logits).copy(), float(loss.item())
            grads0 = [(n, to_np(p.grad).copy()) for n, p in model.named_parameters()]
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_GRAD)
        losses.append(float(loss.item()))
        norms.append(float(norm.item()))
        print(f"step {s}: loss {losses[-1]:.6f} grad_norm {norms[-1]:.6f}")
        opt.step()
    assert norms[0] > CLIP_GRAD, "clipping must act"
    meta = {"vocab_size": V, "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
            "num_heads": cfg.num_heads, "ffn_hidden_size": cfg.ffn_hidden_size,
            **({"num_query_groups": cfg.num_query_groups} if cfg.num_query_groups else {}),
            "rope_base": repr(cfg.rope_base), "seq_length": T, "batch": G}
    os.makedirs(FIXTURES, exist_ok=True)
    write_safetensors(init_path, init_params, meta)
    golden = [("tokens", to_np(tokens)), ("loss0", np.array([loss0], dtype=np.float32)),
              ("logits0", logits0)]
    golden += [("grad." + n, g) for n, g in grads0]
    golden += [("losses", np.array(losses, dtype=np.float32)),
               ("grad_norms", np.array(norms, dtype=np.float32))]
    golden += [("final." + n, to_np(p).copy()) for n, p in model.named_parameters()]
    train = {"lr": repr(LR), "beta1": repr(BETAS[0]), "beta2": repr(BETAS[1]), "eps": repr(EPS),
             "weight_decay": repr(WEIGHT_DECAY), "clip_grad": repr(CLIP_GRAD), "steps": STEPS,
             "seed": SEED, "torch_version": torch.__version__}
    write_safetensors(golden_path, golden, {**meta, **train})
    for path, written in ((init_path, init_params), (golden_path, golden)):
        order, read, _ = read_safetensors(path)
        assert order == [n for n, _ in written], path
        for n, arr in written:
            assert np.array_equal(read[n], arr), f"{path}:{n}"
    print(f"wrote {init_path} and {golden_path}")


def main():
    torch.set_num_threads(1)
    for name, cfg in CASES.items():
        write_case(name, cfg)


if __name__ == "__main__":
    main()
