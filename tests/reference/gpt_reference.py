#!/usr/bin/env python3
"""Reference GPT-2 in plain PyTorch, and the golden fixtures derived from it.

The C++ tests compare weft's GPT implementation against the files this script
writes into tests/reference/fixtures/. Running it needs PyTorch and numpy;
the tests themselves only read the committed fixture files.

    python3 tests/reference/gpt_reference.py          # regenerate + verify
    python3 tests/reference/gpt_reference.py --check  # verify existing files

The model follows the GPT-2 / Hugging Face conventions:
  * token embedding wte [V, C] plus learned position embedding wpe [P, C]
  * L pre-LayerNorm blocks: x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))
  * final LayerNorm ln_f, LM head tied to wte (logits = x @ wte^T, no bias)
  * linear layers in Conv1D layout: weight [in, out], y = x @ weight + bias
  * GELU with the tanh approximation, no dropout
  * loss = mean cross-entropy over all tokens

bench/pytorch_gpt.py (CPU) and bench/pytorch_gpt_cuda.py (GPU) import GPT,
GPTConfig and init_weights from here, so the model is defined in exactly one
place.
"""

import argparse
import json
import math
import os
import struct
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "fixtures")
INIT_PATH = os.path.join(FIXTURES, "gpt_tiny_init.safetensors")
GOLDEN_PATH = os.path.join(FIXTURES, "gpt_tiny_golden.safetensors")
GOLDEN_JSON_PATH = os.path.join(FIXTURES, "gpt_tiny_golden.json")


# --------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------

@dataclass
class GPTConfig:
    vocab_size: int = 64      # V
    n_positions: int = 16     # P, rows of the position table
    num_layers: int = 2       # L
    hidden_size: int = 32     # C
    num_heads: int = 4        # H
    ln_eps: float = 1e-5
    # The GPU bench's kernels for the same math (bench/pytorch_gpt_cuda.py):
    # "sdpa" attention is F.scaled_dot_product_attention(is_causal=True) (PyTorch
    # 2.0 on) instead of the explicit scores, mask and softmax; "addmm" linear
    # layers add the bias inside the GEMM, so that under autocast their outputs
    # stay bf16. The fixtures use the defaults.
    attention: str = "explicit"   # or "sdpa"
    linear: str = "matmul"        # or "addmm"


class Conv1D(nn.Module):
    """Hugging Face style linear layer: weight [in, out], y = x @ W + b."""

    def __init__(self, n_in, n_out, addmm=False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.empty(n_out))
        self.addmm = addmm

    def forward(self, x):
        if self.addmm:
            y = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight)
            return y.view(*x.shape[:-1], y.shape[-1])
        return x @ self.weight + self.bias


class LayerNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n))
        self.bias = nn.Parameter(torch.empty(n))
        self.eps = eps

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C = cfg.hidden_size
        assert C % cfg.num_heads == 0
        assert cfg.attention in ("explicit", "sdpa") and cfg.linear in ("matmul", "addmm")
        self.num_heads = cfg.num_heads
        self.sdpa = cfg.attention == "sdpa"
        self.c_attn = Conv1D(C, 3 * C, cfg.linear == "addmm")
        self.c_proj = Conv1D(C, C, cfg.linear == "addmm")

    def forward(self, x):
        B, T, C = x.shape
        H = self.num_heads
        D = C // H
        qkv = self.c_attn(x)                       # [B, T, 3C]
        q, k, v = qkv.split(C, dim=-1)             # three consecutive C-wide blocks

        def heads(t):                              # [B, T, C] -> [B, H, T, D]
            return t.view(B, T, H, D).transpose(1, 2)

        q, k, v = heads(q), heads(k), heads(v)
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)     # [B, H, T, D]
            return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(D)          # [B, H, T, T]
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        att = torch.softmax(scores, dim=-1)
        y = att @ v                                                  # [B, H, T, D]
        y = y.transpose(1, 2).contiguous().view(B, T, C)            # heads back in order
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C = cfg.hidden_size
        self.c_fc = Conv1D(C, 4 * C, cfg.linear == "addmm")
        self.c_proj = Conv1D(4 * C, C, cfg.linear == "addmm")

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = LayerNorm(cfg.hidden_size, cfg.ln_eps)
        self.attn = Attention(cfg)
        self.ln_2 = LayerNorm(cfg.hidden_size, cfg.ln_eps)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """Parameter names match Hugging Face GPT-2 without the "transformer." prefix."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.hidden_size)
        self.h = nn.ModuleList([Block(cfg) for _ in range(cfg.num_layers)])
        self.ln_f = LayerNorm(cfg.hidden_size, cfg.ln_eps)

    def forward(self, idx):
        """idx: integer tokens [B, T] -> logits [B, T, V]."""
        B, T = idx.shape
        assert T <= self.cfg.n_positions
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx.long()) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        return x @ self.wte.weight.t()            # tied LM head, no bias


def loss_fn(logits, targets):
    """Mean cross-entropy over all B*T tokens."""
    V = logits.shape[-1]
    return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1).long())


@torch.no_grad()
def init_weights(model, std=0.02):
    """Initialise in named_parameters() order (deterministic under a seed).

    Matrices and embeddings ~ N(0, std); c_proj weights ~ N(0, std/sqrt(2L)).
    Biases ~ N(0, 0.02), LayerNorm weights ~ 1 + N(0, 0.1), LayerNorm biases
    ~ N(0, 0.1): non-trivial values so that their gradients are exercised.
    """
    L = model.cfg.num_layers
    for name, p in model.named_parameters():
        is_ln = ".ln_" in name or name.startswith("ln_")
        if is_ln and name.endswith(".weight"):
            p.normal_(0.0, 0.1).add_(1.0)
        elif is_ln and name.endswith(".bias"):
            p.normal_(0.0, 0.1)
        elif name.endswith(".bias"):
            p.normal_(0.0, 0.02)
        elif name.endswith("c_proj.weight"):
            p.normal_(0.0, std / math.sqrt(2 * L))
        else:
            p.normal_(0.0, std)


def param_groups(model, weight_decay):
    """AdamW groups: decay on tensors with >= 2 dims, none on the rest."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


# --------------------------------------------------------------------------
# safetensors, by hand
# --------------------------------------------------------------------------

_DTYPES = {"F32": np.float32, "I32": np.int32}


def write_safetensors(path, tensors, metadata):
    """tensors: list of (name, np.ndarray) in file order; metadata: str -> str."""
    header = {}
    blobs = []
    offset = 0
    for name, arr in tensors:
        if arr.dtype == np.float32:
            dtype = "F32"
        elif arr.dtype == np.int32:
            dtype = "I32"
        else:
            raise TypeError(f"{name}: unsupported dtype {arr.dtype}")
        data = np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    hbytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hbytes += b" " * ((-(8 + len(hbytes))) % 8)     # data section 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hbytes)))
        f.write(hbytes)
        for b in blobs:
            f.write(b)


def read_safetensors(path):
    """Independent minimal reader. Returns (names in offset order, dict, metadata).

    Validates: header length, JSON, 8-byte alignment of the data section,
    offsets contiguous from 0, byte size = numel * 4, file fully consumed.
    """
    with open(path, "rb") as f:
        raw = f.read()
    assert len(raw) >= 8, "file too short"
    (n,) = struct.unpack("<Q", raw[:8])
    assert 8 + n <= len(raw), "header length past end of file"
    assert (8 + n) % 8 == 0, "data section not 8-byte aligned"
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    meta = header.pop("__metadata__", {})
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())
    data = raw[8 + n:]
    entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    out = {}
    expected_begin = 0
    for name, info in entries:
        begin, end = info["data_offsets"]
        assert begin == expected_begin, f"{name}: offsets not contiguous"
        numel = 1
        for d in info["shape"]:
            numel *= d
        assert end - begin == numel * 4, f"{name}: size != numel*4"
        dt = np.dtype(_DTYPES[info["dtype"]]).newbyteorder("<")
        out[name] = np.frombuffer(data[begin:end], dtype=dt).reshape(info["shape"])
        expected_begin = end
    assert expected_begin == len(data), "trailing bytes after last tensor"
    return [name for name, _ in entries], out, meta


# --------------------------------------------------------------------------
# Fixture generation
# --------------------------------------------------------------------------

CFG = GPTConfig(vocab_size=64, n_positions=16, num_layers=2, hidden_size=32, num_heads=4)
SEQ_LENGTH = 12        # T
BATCH = 4              # G sequences per step
STEPS = 5
SEED = 1234
LR = 3e-3
BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.1
# The step-0 total grad norm is ~1.45 (printed when this script runs); 0.75,
# about half of it, makes clipping active on step 0 (in fact on all 5 steps).
CLIP_GRAD = 0.75


def to_np(t):
    return t.detach().cpu().contiguous().numpy()


def generate():
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    torch.set_default_dtype(torch.float32)

    model = GPT(CFG)
    init_weights(model)
    names = [n for n, _ in model.named_parameters()]
    init_params = [(n, to_np(p).copy()) for n, p in model.named_parameters()]

    T, G, V = SEQ_LENGTH, BATCH, CFG.vocab_size
    tokens = torch.randint(0, V, (STEPS, G, T + 1), dtype=torch.int32)

    opt = torch.optim.AdamW(param_groups(model, WEIGHT_DECAY), lr=LR, betas=BETAS, eps=EPS)

    losses, grad_norms = [], []
    logits0 = loss0 = None
    grads0 = None
    for s in range(STEPS):
        inputs, targets = tokens[s][:, :T], tokens[s][:, 1:]
        opt.zero_grad(set_to_none=True)
        logits = model(inputs)
        loss = loss_fn(logits, targets)
        loss.backward()
        if s == 0:
            logits0 = to_np(logits).copy()
            loss0 = float(loss.item())
            grads0 = [(n, to_np(p.grad).copy()) for n, p in model.named_parameters()]
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_GRAD)
        losses.append(float(loss.item()))
        grad_norms.append(float(norm.item()))
        print(f"step {s}: loss {losses[-1]:.6f}  grad_norm {grad_norms[-1]:.6f}"
              f"  clipped={grad_norms[-1] > CLIP_GRAD}")
        opt.step()

    assert grad_norms[0] > CLIP_GRAD, "clip value must make clipping active on step 0"

    # Each step sees a fresh batch of uniformly random tokens, so the per-step
    # loss can only drift slightly below ln(V). As a sanity check that the
    # updates do train, compare the mean loss over all 5 (seen) batches
    # before and after training.
    with torch.no_grad():
        init_model = GPT(CFG)
        for (n, p), (_, arr) in zip(init_model.named_parameters(), init_params):
            p.copy_(torch.from_numpy(arr))
        def mean_loss(m):
            return sum(loss_fn(m(tokens[s][:, :T]), tokens[s][:, 1:]).item()
                       for s in range(STEPS)) / STEPS
        before, after = mean_loss(init_model), mean_loss(model)
    print(f"ln(V) = {math.log(V):.6f}; mean loss over the {STEPS} batches: "
          f"{before:.6f} before training, {after:.6f} after")
    assert after < before, "training did not reduce the loss on the seen batches"
    final_params = [(n, to_np(p).copy()) for n, p in model.named_parameters()]

    os.makedirs(FIXTURES, exist_ok=True)
    config_meta = {
        "vocab_size": CFG.vocab_size,
        "n_positions": CFG.n_positions,
        "num_layers": CFG.num_layers,
        "hidden_size": CFG.hidden_size,
        "num_heads": CFG.num_heads,
        "seq_length": T,
        "batch": G,
    }
    write_safetensors(INIT_PATH, init_params, config_meta)

    golden = [("tokens", to_np(tokens)),
              ("loss0", np.array([loss0], dtype=np.float32)),
              ("logits0", logits0)]
    golden += [("grad." + n, g) for n, g in grads0]
    golden += [("losses", np.array(losses, dtype=np.float32)),
               ("grad_norms", np.array(grad_norms, dtype=np.float32))]
    golden += [("final." + n, p) for n, p in final_params]
    train_meta = {
        "lr": repr(LR),
        "beta1": repr(BETAS[0]),
        "beta2": repr(BETAS[1]),
        "eps": repr(EPS),
        "weight_decay": repr(WEIGHT_DECAY),
        "clip_grad": repr(CLIP_GRAD),
        "steps": STEPS,
        "seed": SEED,
        "torch_version": torch.__version__,
    }
    write_safetensors(GOLDEN_PATH, golden, {**config_meta, **train_meta})

    summary = {
        "config": config_meta,
        "optimizer": {
            "type": "AdamW",
            "lr": LR, "beta1": BETAS[0], "beta2": BETAS[1], "eps": EPS,
            "weight_decay": WEIGHT_DECAY,
            "weight_decay_applies_to": "parameters with >= 2 dims",
            "clip_grad": CLIP_GRAD,
        },
        "steps": STEPS,
        "seed": SEED,
        "torch_version": torch.__version__,
        "loss0": loss0,
        "losses": losses,
        "grad_norms": grad_norms,
        "parameters": names,
    }
    with open(GOLDEN_JSON_PATH, "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")

    # Read everything back and compare bit-for-bit with what was written.
    for path, written in ((INIT_PATH, init_params), (GOLDEN_PATH, golden)):
        order, read, _ = read_safetensors(path)
        assert order == [n for n, _ in written], f"{path}: tensor order differs"
        for n, arr in written:
            assert read[n].shape == arr.shape and np.array_equal(read[n], arr), f"{path}:{n}"

    float64_crosscheck(init_params, tokens, logits0, loss0, grads0)


def float64_crosscheck(init_params, tokens, logits0, loss0, grads0):
    """Recompute step 0 in float64 and report the fp32 error of the fixtures.

    Gives an idea of the noise floor the C++ tolerances have to live with.
    """
    model = GPT(CFG).double()
    with torch.no_grad():
        for (n, p), (n2, arr) in zip(model.named_parameters(), init_params):
            assert n == n2
            p.copy_(torch.from_numpy(arr).double())
    T = SEQ_LENGTH
    logits = model(tokens[0][:, :T])
    loss = loss_fn(logits, tokens[0][:, 1:])
    loss.backward()

    def rel(a, b):
        return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))

    print(f"fp32 vs fp64, step 0: loss rel err {abs(loss0 - loss.item()) / loss.item():.2e}, "
          f"logits max-rel err {rel(logits0, to_np(logits)):.2e}")
    worst = max((rel(g, to_np(p.grad)), n)
                for (n, g), (_, p) in zip(grads0, model.named_parameters()))
    print(f"fp32 vs fp64, step 0: worst grad (max-abs err / max-abs value) {worst[0]:.2e} ({worst[1]})")


def check():
    """Validate the committed fixture files (format + consistency)."""
    names_init, init, meta_init = read_safetensors(INIT_PATH)
    names_gold, gold, meta_gold = read_safetensors(GOLDEN_PATH)
    V = int(meta_init["vocab_size"])
    C = int(meta_init["hidden_size"])
    P = int(meta_init["n_positions"])
    L = int(meta_init["num_layers"])
    T = int(meta_init["seq_length"])
    G = int(meta_init["batch"])
    steps = int(meta_gold["steps"])
    expected = {"wte.weight": [V, C], "wpe.weight": [P, C], "ln_f.weight": [C], "ln_f.bias": [C]}
    for i in range(L):
        p = f"h.{i}."
        expected.update({
            p + "ln_1.weight": [C], p + "ln_1.bias": [C],
            p + "attn.c_attn.weight": [C, 3 * C], p + "attn.c_attn.bias": [3 * C],
            p + "attn.c_proj.weight": [C, C], p + "attn.c_proj.bias": [C],
            p + "ln_2.weight": [C], p + "ln_2.bias": [C],
            p + "mlp.c_fc.weight": [C, 4 * C], p + "mlp.c_fc.bias": [4 * C],
            p + "mlp.c_proj.weight": [4 * C, C], p + "mlp.c_proj.bias": [C],
        })
    assert set(names_init) == set(expected), "init parameter names"
    for n, shape in expected.items():
        assert list(init[n].shape) == shape, n
        assert init[n].dtype == np.float32, n
        assert list(gold["grad." + n].shape) == shape, n
        assert list(gold["final." + n].shape) == shape, n
    assert list(gold["tokens"].shape) == [steps, G, T + 1] and gold["tokens"].dtype == np.int32
    assert gold["tokens"].min() >= 0 and gold["tokens"].max() < V
    assert list(gold["logits0"].shape) == [G, T, V]
    assert list(gold["losses"].shape) == [steps] and list(gold["grad_norms"].shape) == [steps]
    assert gold["loss0"][0] == gold["losses"][0]
    with open(GOLDEN_JSON_PATH) as f:
        summary = json.load(f)
    assert np.allclose(summary["losses"], gold["losses"], rtol=1e-6)
    size = sum(os.path.getsize(p) for p in (INIT_PATH, GOLDEN_PATH, GOLDEN_JSON_PATH))
    print(f"fixtures OK ({len(names_init)} parameters, {size} bytes total)")
    print("losses    ", " ".join(f"{x:.6f}" for x in gold["losses"]))
    print("grad_norms", " ".join(f"{x:.6f}" for x in gold["grad_norms"]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="only validate the existing fixture files")
    args = ap.parse_args()
    if not args.check:
        generate()
    check()


if __name__ == "__main__":
    sys.exit(main())
