#!/usr/bin/env python3
"""The GPU PyTorch baseline's parts that run on a CPU.

bench/pytorch_gpt_cuda.py on a tiny model with --device cpu (the modes this
PyTorch can run, and the one-line skip of those it cannot), its FLOP count
against the model's own parameters, its refusals, the reference model's
bench kernels (bias inside the GEMM, SDPA) against its explicit forms, and
bench/cuda_table.py's merged table. Run by tests/pytorch_bench.sh, which
finds a python with torch (SKIP, 77, without one).
"""

import json
import math
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
BENCH = os.path.join(ROOT, "bench", "pytorch_gpt_cuda.py")
TABLE = os.path.join(ROOT, "bench", "cuda_table.py")
sys.path.insert(0, HERE)

import torch  # noqa: E402

from gpt_reference import GPT, GPTConfig, init_weights, loss_fn  # noqa: E402

TINY = ["--device", "cpu", "--num-layers", "2", "--hidden-size", "32", "--num-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--steps", "2", "--warmup", "1",
        "--threads", "1"]


def run(args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300)


class PytorchBench(unittest.TestCase):
    def test_cpu_smoke_rows_flops_and_skip(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "rows.jsonl")
            # vocab 250 padded to a multiple of 128: 256 rows, as weft pads it.
            p = run([BENCH, *TINY, "--vocab-size", "250", "--modes", "eager-fp32,compile-bf16",
                     "--json", path])
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            self.assertNotIn("Traceback", p.stderr)
            with open(path) as f:
                rows = [json.loads(line) for line in f]
            stdout_rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
            self.assertEqual(rows, stdout_rows)
            self.assertEqual([r["mode"] for r in rows], ["eager-fp32", "compile-bf16"])
            r = rows[0]
            self.assertEqual(r["vocab_rows"], 256)
            self.assertGreater(r["step_ms"], 0)
            self.assertTrue(r["step_ms_min"] <= r["step_ms"] <= r["step_ms_max"])
            self.assertAlmostEqual(r["tokens_per_s"], 2 * 16 / (r["step_ms"] / 1e3), delta=1e-6 * r["tokens_per_s"])
            # bench_cuda's count from the model's own parameters: without wpe
            # (T x C) and the padding rows ((256 - 250) x C).
            L, C, T = 2, 32, 16
            n = r["params"] - T * C - (256 - 250) * C
            self.assertEqual(r["flops_per_token"], 6 * n + 12 * L * T * C)
            self.assertAlmostEqual(r["mfu"], r["tflops"] / 989.0, delta=1e-12)
            # Random tokens of 250: the loss starts near ln(250). The init's
            # logits have a spread of about 0.02 sqrt(C) ~ 0.1 (LayerNorm'd
            # inputs, wte ~ N(0, 0.02)), adding ~0.01 nats; three AdamW steps
            # at lr 6e-4 move it by less than 0.5.
            self.assertLess(abs(r["loss"] - math.log(250)), 0.5)
            c = rows[1]
            if hasattr(torch, "compile"):
                self.assertIn("compile_s", c)
                self.assertIn("compile (the first step) took", p.stdout)
            else:
                self.assertIn("torch.compile", c["skipped"])
                skips = [line for line in p.stdout.splitlines() if line.startswith("compile-bf16: skipped")]
                self.assertEqual(len(skips), 1, p.stdout)

    def test_refusals_are_one_line(self):
        for args, words in ((["--modes", "eager-tf32"], "TF32"),
                            (["--modes", "jit-bf16"], "jit-bf16"),
                            (["--hidden-size", "30"], "divisible"),
                            (["--warmup", "0"], "--warmup (0)")):
            p = run([BENCH, *TINY, *args])
            self.assertEqual(p.returncode, 2, args)
            self.assertIn(words, p.stderr)
            self.assertNotIn("Traceback", p.stderr)

    def test_bench_kernels_compute_the_reference_math(self):
        """addmm and SDPA against the explicit forms, in fp64: both sum the
        same products (at most 4C = 128 per output) in another order, so they
        differ by a few ulps of fp64 per element (128 x 2^-53 ~ 1.4e-14
        relative), carried through 2 layers and the loss; 1e-10 is far above
        that and far below any real difference (a missing bias, a wrong mask:
        1e-3 and up)."""
        variants = [("explicit", "addmm")]
        if hasattr(torch.nn.functional, "scaled_dot_product_attention"):
            variants.append(("sdpa", "addmm"))
        base = dict(vocab_size=64, n_positions=16, num_layers=2, hidden_size=32, num_heads=4)
        tokens = torch.randint(0, 64, (3, 13), generator=torch.Generator().manual_seed(5))

        def loss_and_grads(attention, linear):
            torch.manual_seed(11)
            m = GPT(GPTConfig(**base, attention=attention, linear=linear))
            init_weights(m)
            m = m.double()
            loss = loss_fn(m(tokens[:, :12]), tokens[:, 1:])
            loss.backward()
            return loss.item(), {n: p.grad.clone() for n, p in m.named_parameters()}

        ref_loss, ref_grads = loss_and_grads("explicit", "matmul")
        for attention, linear in variants:
            loss, grads = loss_and_grads(attention, linear)
            self.assertLess(abs(loss - ref_loss), 1e-10 * ref_loss, (attention, linear))
            for name, g in ref_grads.items():
                err = (grads[name] - g).abs().max().item() / max(g.abs().max().item(), 1e-30)
                self.assertLess(err, 1e-10, (attention, linear, name))


class CudaTable(unittest.TestCase):
    SHAPE = {"layers": 12, "hidden": 768, "heads": 12, "vocab": 50257, "vocab_rows": 50304,
             "batch": 16, "seq_length": 1024, "flops_per_token": 1.0, "peak_tflops": 989.0}

    def write(self, d, name, rows):
        path = os.path.join(d, name)
        with open(path, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        return path

    def test_rows_side_by_side_with_ratios(self):
        weft = [{**self.SHAPE, "framework": "weft", "mode": "tf32", "tokens_per_s": 1000.0,
                 "step_ms": 16384.0, "mfu": 0.1, "peak_gib": 30.0}]
        torch_rows = [{**self.SHAPE, "mode": "eager-bf16", "tokens_per_s": 2000.0, "step_ms": 8192.0,
                       "mfu": 0.2, "peak_gib": 20.0},
                      {**self.SHAPE, "mode": "compile-bf16", "tokens_per_s": 4000.0, "step_ms": 4096.0,
                       "mfu": 0.4, "peak_gib": 10.0}]
        with tempfile.TemporaryDirectory() as d:
            p = run([TABLE, "--weft", self.write(d, "w.jsonl", weft),
                     "--pytorch", self.write(d, "p.jsonl", torch_rows)])
        self.assertEqual(p.returncode, 0, p.stderr)
        lines = p.stdout.splitlines()
        self.assertIn("| weft | tf32 | 1000 | 16384.0 | 10.0% | 30.0 | 0.25x |", lines)
        self.assertIn("| pytorch | eager-bf16 | 2000 | 8192.0 | 20.0% | 20.0 | 0.50x |", lines)
        self.assertIn("| pytorch | compile-bf16 | 4000 | 4096.0 | 40.0% | 10.0 | 1.00x |", lines)
        self.assertFalse(any("do not compare" in line for line in lines), p.stdout)

    def test_skipped_pytorch_and_other_shapes_are_said(self):
        weft = [{**self.SHAPE, "framework": "weft", "mode": "tf32", "tokens_per_s": 1000.0,
                 "step_ms": 1.0, "mfu": 0.1, "peak_gib": 30.0},
                {**self.SHAPE, "framework": "weft", "mode": "fp32", "batch": 8, "tokens_per_s": 500.0,
                 "step_ms": 1.0, "mfu": 0.05, "peak_gib": 30.0}]
        with tempfile.TemporaryDirectory() as d:
            p = run([TABLE, "--weft", self.write(d, "w.jsonl", weft),
                     "--pytorch-note", "skipped (no CUDA PyTorch)"])
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("| pytorch | | skipped (no CUDA PyTorch) | | | | |", p.stdout)
        self.assertIn("n/a", p.stdout)
        self.assertIn("weft fp32 differs from weft tf32 in batch", p.stdout)
        self.assertIn("no timed PyTorch compile-bf16 row", p.stdout)


if __name__ == "__main__":
    unittest.main()
