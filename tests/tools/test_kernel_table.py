#!/usr/bin/env python3
"""bench/kernel_table.py on a small Nsight Compute CSV: launches grouped by
kernel name (parameter lists dropped, template arguments kept), times in
mixed units summed exactly, largest first, the rows past --top summed into
one, and one clear error for a log with no kernels or an unknown unit."""

import os
import subprocess
import sys
import tempfile
import unittest

TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench",
                     "kernel_table.py")
HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
          '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
          '"Metric Value"')


def row(i, name, unit, value):
    return (f'"{i}","7","bench_cuda","localhost","{name}","1","13","(256, 1, 1)",'
            f'"(64, 1, 1)","0","9.0","Command line profiler metrics",'
            f'"gpu__time_duration.sum","{unit}","{value}"')


LN = "void weft::cuda::(anonymous namespace)::layernorm<float, __nv_bfloat16>(const float *, int)"
GEMM = "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_128x64_tn_align8>(T1::Params)"
XMMA = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_cublas"


def run(*args):
    return subprocess.run([sys.executable, TABLE, *args], capture_output=True, text=True,
                          timeout=60)


class KernelTable(unittest.TestCase):
    def write(self, d, lines):
        path = os.path.join(d, "k.csv")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        return path

    def test_groups_sums_and_orders(self):
        with tempfile.TemporaryDirectory() as d:
            path = self.write(d, [
                "==PROF== Connected to process 7 (bench_cuda)",
                HEADER,
                row(0, LN, "nsecond", "1,500"),
                row(1, GEMM, "usecond", "2.5"),
                row(2, LN, "ns", "500"),
                row(3, XMMA, "msecond", "0.004"),
            ])
            p = run(path)
            self.assertEqual(p.returncode, 0, p.stderr)
            lines = p.stdout.splitlines()
            body = [l for l in lines if l.startswith("| `")]
            # 4 us, 2.5 us, then the two layernorm launches' 2 us together.
            self.assertEqual(len(body), 3, p.stdout)
            self.assertIn(f"`{XMMA}` | 1 | 0.00 | 47.1% |", body[0])
            self.assertIn("`cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_128x64_tn_align8>` "
                          "| 1 |", body[1])
            self.assertIn("`weft::cuda::layernorm<float, __nv_bfloat16>` | 2 |", body[2])
            self.assertIn("23.5%", body[2])  # 2 of 8.5 us
            self.assertIn("**4**", lines[-1])
            p = run(path, "--top", "1")
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertIn("| 2 other kernels | 3 |", p.stdout)
            self.assertIn("52.9%", p.stdout)  # 4.5 of 8.5 us

    def test_refusals(self):
        with tempfile.TemporaryDirectory() as d:
            p = run(self.write(d, ["==PROF== No kernels were profiled."]))
            self.assertEqual(p.returncode, 1)
            self.assertIn("no CSV header", p.stderr)
            p = run(self.write(d, [HEADER, row(0, LN, "cycle", "12")]))
            self.assertEqual(p.returncode, 1)
            self.assertIn("unit 'cycle'", p.stderr)
            p = run(self.write(d, [HEADER, row(0, LN, "ns", "12")]), "--top", "0")
            self.assertNotEqual(p.returncode, 0)
            self.assertIn("--top (0)", p.stderr)


if __name__ == "__main__":
    unittest.main()
