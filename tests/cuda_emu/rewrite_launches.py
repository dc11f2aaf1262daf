#!/usr/bin/env python3
"""GPU emulator (tests/cuda_emu): makes a .cu file plain C++.

Rewrites each kernel launch `name<targs><<<grid, block, shared, stream>>>(args)`
into `::weft_emu::launch([&](auto&&... a) { name<targs>(a...); }, grid, block,
shared, stream)(args)`, which include/weft_emu_device.h runs on the CPU (the
lambda lets a kernel template deduce its arguments, as a launch does).
Usage: INPUT OUTPUT.
"""
import sys


def kernel_start(text, end):
    """Start of the kernel expression that ends just before `end` (<<<)."""
    i = end
    while i > 0 and text[i - 1].isspace():
        i -= 1
    if text[i - 1] == ">":  # template arguments
        depth = 0
        while True:
            i -= 1
            if text[i] == ">":
                depth += 1
            elif text[i] == "<":
                depth -= 1
                if depth == 0:
                    break
    while i > 0 and (text[i - 1].isalnum() or text[i - 1] in "_:"):
        i -= 1
    return i


def rewrite(text):
    out = []
    pos = 0
    while True:
        open_at = text.find("<<<", pos)
        if open_at < 0:
            out.append(text[pos:])
            return "".join(out)
        close_at = text.index(">>>", open_at)
        start = kernel_start(text, open_at)
        kernel = text[start:open_at].strip()
        config = text[open_at + 3:close_at]
        out.append(text[pos:start])
        out.append("::weft_emu::launch([&](auto&&... weft_emu_args) { "
                   f"{kernel}(weft_emu_args...); }}, {config})")
        pos = close_at + 3


def main():
    src, dst = sys.argv[1], sys.argv[2]
    with open(src) as f:
        text = f.read()
    with open(dst, "w") as f:
        f.write(f"// Generated from {src} by tests/cuda_emu/rewrite_launches.py\n")
        f.write(rewrite(text))


if __name__ == "__main__":
    main()
