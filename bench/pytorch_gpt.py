#!/usr/bin/env python3
"""PyTorch CPU throughput for weft's GPT, as a current PyTorch runs it best.

The model is tests/reference/gpt_reference.py's (the definition the test
fixtures come from), by default with F.scaled_dot_product_attention and the
bias added inside the GEMM (torch.addmm), so that nothing is slower than
PyTorch's own recipe. A step is forward, backward, gradient clipping and
AdamW (fused, PyTorch 2.4 on); the token batches are made before the timed
steps, as weft's bench_train makes its data. Recipes:

  --mode eager|compile     torch.compile(model) for compile
  --precision fp32|bf16    bf16: torch.autocast("cpu", torch.bfloat16) around
                           forward and loss (fp32 weights, gradients, AdamW)

Prints one JSON line, with the first step's loss (before any update) and the
parameter count, so the caller can check both sides ran the same model.

The caller is expected to export OMP_WAIT_POLICY=PASSIVE before starting
python (OpenMP reads it at start-up, so setting it from here is too late).

Example:
    OMP_WAIT_POLICY=PASSIVE python3 bench/pytorch_gpt.py --num-layers 6 \
        --hidden-size 384 --num-heads 6 --seq-length 256 --micro-batch-size 8
"""

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "reference"))

import torch  # noqa: E402

from gpt_reference import GPT, GPTConfig, init_weights, loss_fn, param_groups  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description="PyTorch GPT training throughput baseline")
    ap.add_argument("--num-layers", type=int, required=True)
    ap.add_argument("--hidden-size", type=int, required=True)
    ap.add_argument("--num-heads", type=int, required=True)
    ap.add_argument("--seq-length", type=int, required=True)
    ap.add_argument("--micro-batch-size", type=int, required=True)
    ap.add_argument("--vocab-size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before timing")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip-grad", type=float, default=1.0, help="max grad norm; 0 disables clipping")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--mode", choices=["eager", "compile"], default="eager")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--attention", choices=["sdpa", "explicit"], default="sdpa")
    ap.add_argument("--linear", choices=["addmm", "matmul"], default="addmm")
    args = ap.parse_args()

    if os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE":
        print("warning: OMP_WAIT_POLICY is not PASSIVE; spinning OpenMP threads can "
              "distort the timing (export OMP_WAIT_POLICY=PASSIVE before starting python)",
              file=sys.stderr)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    L, C, T, B = args.num_layers, args.hidden_size, args.seq_length, args.micro_batch_size
    cfg = GPTConfig(vocab_size=args.vocab_size, n_positions=T, num_layers=L,
                    hidden_size=C, num_heads=args.num_heads, attention=args.attention,
                    linear=args.linear)
    model = GPT(cfg)
    init_weights(model)
    model.train()
    fused = {"fused": True} if tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 4) else {}
    opt = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr,
                            betas=(0.9, 0.95), eps=1e-8, **fused)
    forward = torch.compile(model) if args.mode == "compile" else model
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if args.precision == "bf16" \
        else contextlib.nullcontext

    params = sum(p.numel() for p in model.parameters())       # wte counted once (tied)
    params_nonpos = params - model.wpe.weight.numel()
    tokens_per_step = B * T
    flops_per_step = 6 * params_nonpos * tokens_per_step + 12 * L * T * C * tokens_per_step

    batches = [torch.randint(0, args.vocab_size, (B, T + 1))
               for _ in range(args.warmup + args.steps)]

    def step(data):
        opt.zero_grad(set_to_none=True)
        with autocast():
            loss = loss_fn(forward(data[:, :T]), data[:, 1:])
        loss.backward()
        if args.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        opt.step()
        return loss.item()

    first_loss = None
    for i in range(args.warmup):
        loss = step(batches[i])
        first_loss = loss if first_loss is None else first_loss
    times = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        loss = step(batches[args.warmup + i])
        times.append(time.perf_counter() - t0)
        first_loss = loss if first_loss is None else first_loss

    step_s = statistics.median(times)
    print(json.dumps({
        "framework": "pytorch",
        "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
        "mode": args.mode,
        "precision": args.precision,
        "attention": args.attention,
        "linear": args.linear,
        "fused_adamw": bool(fused),
        "cpu_capability": torch.backends.cpu.get_cpu_capability()
        if hasattr(torch.backends, "cpu") else "",
        "first_loss": round(first_loss, 6),
        "num_layers": L,
        "hidden_size": C,
        "num_heads": args.num_heads,
        "seq_length": T,
        "micro_batch_size": B,
        "vocab_size": args.vocab_size,
        "params": params,
        "step_ms": round(step_s * 1e3, 3),
        "tokens_per_s": round(tokens_per_step / step_s, 2),
        "gflops": round(flops_per_step / step_s / 1e9, 3),
    }))


if __name__ == "__main__":
    main()
