#!/usr/bin/env python3
"""PyTorch's GPT training step on one GPU: the baseline for bench_cuda.

The same step as bench_cuda times: GPT-2 124M by default (12 x 768, 12 heads,
T 1024, B 16), its vocabulary of 50257 padded as weft pads it (a multiple of
--make-vocab-size-divisible-by, default 128: 50304 rows), random tokens, the
same batch every step. A step is: zero the gradients, forward, backward,
clip the gradients' global norm at 1.0, AdamW (fused=True where PyTorch has
it). The model is tests/reference/gpt_reference.py's, with its GPU kernels for
the same math: F.scaled_dot_product_attention(is_causal=True) and the bias
inside the GEMM (where the PyTorch has no SDPA, as 1.13, the explicit
attention, and a note).

A mode is "<eager|compile>-<fp32|tf32|bf16>": eager PyTorch or torch.compile
of the forward and loss (compile time printed: the first step's time); fp32,
TF32 GEMMs, or bf16 autocast (parameters, gradients and AdamW in fp32).
Default on a GPU: eager-bf16, eager-tf32, compile-bf16 (the eager ones first:
their rows are written even if compiling runs out of time); on the CPU:
eager-fp32. A mode this PyTorch cannot run (torch.compile before 2.0) is
skipped with one line. tf32 needs --device cuda.

Each timed step runs between two synchronizes; "step ms" is the median of
--steps timed steps after --warmup untimed ones. FLOPs per token are
bench_cuda's: 6 x (parameters without wpe, vocabulary unpadded) + 12 x L x T
x C; MFU is against --peak-tflops (989: H100/H200 SXM dense bf16). Peak GiB is
torch.cuda.max_memory_allocated over the mode (model, optimizer, activations).

Prints one JSON object per mode as it finishes (a line starting with "{"; also
into --json FILE), then a table. Exits 1 when a mode failed (its JSON line has
"error"), 2 on bad flags.

    python3 bench/pytorch_gpt_cuda.py                       # the GPU baseline
    python3 bench/pytorch_gpt_cuda.py --device cpu --num-layers 2 --hidden-size 64 \\
        --num-heads 4 --seq-length 32 --micro-batch-size 2 --vocab-size 256 \\
        --steps 2 --warmup 1 --modes eager-fp32,compile-bf16      # the CPU smoke test
"""

import argparse
import contextlib
import gc
import inspect
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "reference"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gpt_reference import GPT, GPTConfig, init_weights, loss_fn, param_groups  # noqa: E402

PRECISIONS = ("fp32", "tf32", "bf16")
RUNNERS = ("eager", "compile")


def parse_mode(name):
    runner, _, precision = name.partition("-")
    if runner not in RUNNERS or precision not in PRECISIONS:
        raise ValueError(f"--modes: '{name}' is not <eager|compile>-<fp32|tf32|bf16>")
    return runner, precision


def flops_per_token(vocab, C, L, T):
    """bench_cuda's count (GptConfig::train_flops_per_token): wpe and vocabulary padding left out."""
    per_layer = 2 * C + (3 * C * C + 3 * C) + (C * C + C) + 2 * C + (4 * C * C + 4 * C) + (4 * C * C + C)
    params = vocab * C + L * per_layer + 2 * C
    return 6 * params + 12 * L * T * C


def args_parser():
    ap = argparse.ArgumentParser(description="PyTorch GPT training throughput on one GPU (bench_cuda's baseline)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--num-layers", type=int, default=12)
    ap.add_argument("--hidden-size", type=int, default=768)
    ap.add_argument("--num-heads", type=int, default=12)
    ap.add_argument("--seq-length", type=int, default=1024)
    ap.add_argument("--micro-batch-size", type=int, default=16)
    ap.add_argument("--vocab-size", type=int, default=50257)
    ap.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                    help="pad the vocabulary's rows to a multiple of this (1: no padding), as weft does")
    ap.add_argument("--modes", default=None,
                    help="comma-separated <eager|compile>-<fp32|tf32|bf16> (default: eager-bf16,"
                         "eager-tf32,compile-bf16 on cuda, eager-fp32 on cpu)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (compiling is in the first)")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--json", default=None, help="also write the JSON lines to this file")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip-grad", type=float, default=1.0, help="max grad norm; 0 disables clipping")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: PyTorch's default)")
    return ap


def check_args(ap, a):
    for name in ("num_layers", "hidden_size", "num_heads", "seq_length", "micro_batch_size",
                 "vocab_size", "make_vocab_size_divisible_by", "steps"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} ({getattr(a, name)}) must be at least 1")
    if a.warmup < 1:
        ap.error(f"--warmup ({a.warmup}) must be at least 1: the first step compiles and allocates")
    if a.hidden_size % a.num_heads:
        ap.error(f"--hidden-size ({a.hidden_size}) must be divisible by --num-heads ({a.num_heads})")
    if not a.peak_tflops > 0:
        ap.error(f"--peak-tflops ({a.peak_tflops}) must be positive")
    if a.clip_grad < 0:
        ap.error(f"--clip-grad ({a.clip_grad}) must not be negative (0 disables clipping)")
    if a.modes is None:
        a.modes = "eager-bf16,eager-tf32,compile-bf16" if a.device == "cuda" else "eager-fp32"
    modes = [m for m in a.modes.split(",") if m]
    if not modes:
        ap.error("--modes is empty")
    for m in modes:
        try:
            _, precision = parse_mode(m)
        except ValueError as e:
            ap.error(str(e))
        if precision == "tf32" and a.device != "cuda":
            ap.error(f"--modes {m}: TF32 is a GPU's tensor-core format; the CPU computes in fp32")
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: this PyTorch sees no CUDA device (torch.cuda.is_available() is False)")
    return modes


class Bench:
    def __init__(self, a):
        self.a = a
        self.dev = torch.device(a.device)
        self.cuda = self.dev.type == "cuda"
        self.rows = -(-a.vocab_size // a.make_vocab_size_divisible_by) * a.make_vocab_size_divisible_by
        self.tokens = a.micro_batch_size * a.seq_length
        self.flops_per_token = flops_per_token(a.vocab_size, a.hidden_size, a.num_layers, a.seq_length)
        self.sdpa = hasattr(F, "scaled_dot_product_attention")
        self.fused_adamw = self.cuda and "fused" in inspect.signature(torch.optim.AdamW.__init__).parameters

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def common(self):
        a = self.a
        return {"framework": "pytorch", "torch_version": torch.__version__,
                "device": torch.cuda.get_device_name(self.dev) if self.cuda else "cpu",
                "layers": a.num_layers, "hidden": a.hidden_size, "heads": a.num_heads,
                "vocab": a.vocab_size, "vocab_rows": self.rows, "batch": a.micro_batch_size,
                "seq_length": a.seq_length, "flops_per_token": self.flops_per_token,
                "peak_tflops": a.peak_tflops, "warmup": a.warmup, "steps": a.steps}

    def run(self, mode):
        a = self.a
        runner, precision = parse_mode(mode)
        row = {**self.common(), "mode": mode}
        if runner == "compile" and not hasattr(torch, "compile"):
            row["skipped"] = f"PyTorch {torch.__version__} has no torch.compile (2.0 on)"
            return row
        # TF32 through the long-standing global setter: PyTorch 2.9 on also
        # has per-backend fp32_precision flags, but a write through those makes
        # inductor's reads of the global one fail ("mix of the legacy and new
        # APIs"), which would break the compile modes after a tf32 one.
        torch.set_float32_matmul_precision("high" if precision == "tf32" else "highest")
        if self.cuda:
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.dev)
        torch.manual_seed(a.seed)
        cfg = GPTConfig(vocab_size=self.rows, n_positions=a.seq_length, num_layers=a.num_layers,
                        hidden_size=a.hidden_size, num_heads=a.num_heads,
                        attention="sdpa" if self.sdpa else "explicit", linear="addmm")
        model = GPT(cfg).to(self.dev)
        init_weights(model)
        model.train()
        extra = {"fused": True} if self.fused_adamw else {}
        opt = torch.optim.AdamW(param_groups(model, a.weight_decay), lr=a.lr, betas=(0.9, 0.95),
                                eps=1e-8, **extra)
        # Tokens of the true vocabulary only; the same batch every step, as bench_cuda's.
        g = torch.Generator().manual_seed(a.seed)
        data = torch.randint(0, a.vocab_size, (a.micro_batch_size, a.seq_length + 1), generator=g)
        inputs = data[:, :-1].contiguous().to(self.dev)
        targets = data[:, 1:].contiguous().to(self.dev)

        def forward_loss(idx, tgt):
            return loss_fn(model(idx), tgt)

        fn = torch.compile(forward_loss) if runner == "compile" else forward_loss
        autocast = (torch.autocast(device_type=self.dev.type, dtype=torch.bfloat16)
                    if precision == "bf16" else contextlib.nullcontext())

        def step():
            opt.zero_grad(set_to_none=True)
            with autocast:
                loss = fn(inputs, targets)
            loss.backward()
            if a.clip_grad > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip_grad)
            opt.step()
            return loss

        def timed():
            self.sync()
            t0 = time.perf_counter()
            loss = step()
            self.sync()
            return time.perf_counter() - t0, loss

        first, _ = timed()  # compiles under torch.compile
        for _ in range(a.warmup - 1):
            timed()
        times, loss = [], None
        for _ in range(a.steps):
            t, loss = timed()
            times.append(t)
        step_s = statistics.median(times)
        tok_s = self.tokens / step_s
        tflops = self.flops_per_token * tok_s / 1e12
        row.update({
            "precision": precision, "runner": runner,
            "attention": "sdpa" if self.sdpa else f"explicit (PyTorch {torch.__version__} has no SDPA)",
            "adamw": "fused" if self.fused_adamw else "default (no fused AdamW here)",
            "params": sum(p.numel() for p in model.parameters()),
            "step_ms": step_s * 1e3, "step_ms_min": min(times) * 1e3, "step_ms_max": max(times) * 1e3,
            "first_step_s": first, "tokens_per_s": tok_s, "tflops": tflops,
            "mfu": tflops / a.peak_tflops, "loss": float(loss.item()),
            "peak_gib": torch.cuda.max_memory_allocated(self.dev) / 2**30 if self.cuda else None,
        })
        if runner == "compile":
            row["compile_s"] = first  # the first step: tracing and compiling, then running it
        del model, opt, fn, step, timed
        if runner == "compile":
            torch._dynamo.reset()
        return row


def cell(v, fmt):
    return "" if v is None else format(v, fmt)


def table(rows):
    out = ["| mode | step ms | tokens/s | TFLOP/s | MFU | loss | peak GiB | compile s |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "skipped" in r or "error" in r:
            why = f"skipped: {r['skipped']}" if "skipped" in r else f"error: {r['error']}"
            out.append(f"| {r['mode']} | {why} | | | | | | |")
            continue
        out.append(f"| {r['mode']} | {r['step_ms']:.1f} | {r['tokens_per_s']:.0f} | {r['tflops']:.1f} | "
                   f"{100 * r['mfu']:.1f}% | {r['loss']:.4f} | {cell(r['peak_gib'], '.1f')} | "
                   f"{cell(r.get('compile_s'), '.1f')} |")
    return "\n".join(out)


def main():
    ap = args_parser()
    a = ap.parse_args()
    modes = check_args(ap, a)
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    b = Bench(a)
    print(f"pytorch_gpt_cuda | torch {torch.__version__} on {b.common()['device']} | "
          f"{a.num_layers} x {a.hidden_size}, {a.num_heads} heads, vocab {a.vocab_size} in {b.rows} rows | "
          f"B {a.micro_batch_size} T {a.seq_length} | MFU against {a.peak_tflops} TFLOP/s", flush=True)
    if not b.sdpa:
        print(f"note: PyTorch {torch.__version__} has no F.scaled_dot_product_attention; "
              "attention is the explicit scores, mask and softmax", flush=True)
    out = open(a.json, "w") if a.json else None
    rows, failed = [], False
    for mode in modes:
        try:
            row = b.run(mode)
        except Exception as e:  # one mode's failure (out of memory, a compiler error) is its row
            msg = str(e).strip().splitlines()
            row = {**b.common(), "mode": mode, "error": f"{type(e).__name__}: {msg[0] if msg else ''}"}
            failed = True
            gc.collect()
            if b.cuda:
                torch.cuda.empty_cache()
        if "skipped" in row:
            print(f"{mode}: skipped ({row['skipped']})", flush=True)
        if "error" in row:
            print(f"{mode}: {row['error']}", file=sys.stderr, flush=True)
        if "compile_s" in row:
            print(f"{mode}: compile (the first step) took {row['compile_s']:.1f} s", flush=True)
        line = json.dumps(row)
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()
        rows.append(row)
    if out:
        out.close()
    print()
    print(table(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
