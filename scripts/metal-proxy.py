#!/usr/bin/env python3
"""A static proxy of Apple's compiler for the Metal kernels: each instantiation MLX renders,
compiled by clang at -O2 to LLVM IR (metal_kernels/harness/proxy.py says how). Prints, per
kernel, head dim and dtype: threadgroup bytes, threads a threadgroup, simdgroups a GPU core keeps
(threadgroup memory and the ALU's saturation), the floats a lane holds live (an estimate), and
the per-lane arrays left in private memory, each with the lines that index it at run time.

    pip install -e '.[proxy]'   # clang, from the ziglang wheel
    python scripts/metal-proxy.py [--kernels attention/forward delta/grads] [--check]

docs/KERNEL-PROXY.md carries its output.
"""

import sys

from metal_kernels.harness.proxy import main

if __name__ == "__main__":
    sys.exit(main())
