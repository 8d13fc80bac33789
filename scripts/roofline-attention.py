#!/usr/bin/env python3
"""Roofline estimates for the Metal attention kernels at the benchmark's shape (bench-attention's:
one chunk of 4,096 queries over a 61,440-key prefix and the chunk's own keys, 14 query and 2 K/V
heads, bf16 with a bf16 store, the gradient taken for every key). Nothing here runs on a GPU:
every number is an estimate.

Per kernel and head dim: the 8x8x8 simdgroup products the design issues (traffic.py, the same
loops as the bodies; each product 1,024 FLOPs, masked tiles at the causal diagonal included), the
bytes it reads and writes in device memory (each walked block once per threadgroup: an upper
bound on DRAM traffic, which caches shared by concurrent threadgroups cut further), arithmetic
intensity, and time = max(FLOPs / peak, bytes / bandwidth). The products run in float32 (the
operands converted from bf16 lane by lane), so the FP32 peak bounds them. tests/test_kernels.py
checks traffic.py's bytes, products and barriers against the CPU harness's counters.

Published figures (third-party where Apple publishes none):
  M4 Max (40-core GPU): 546 GB/s (Apple, at the M4 Max's launch; e.g. notebookcheck.net,
    "Apple M4 Max official with incremental upgrades over the M3 Max"). FP32 = FP16 peak:
    hmc-tech.com lists the 32-core M4 Max at 13.74 TFLOPS (4,096 ALUs at 1,678 MHz,
    hmc-tech.com/gpu/apple-32-core-m4-max-vs-apple-40-core-m3-max); 40 cores at that clock:
    5,120 x 2 x 1.678 GHz = 17.18 TFLOPS (scaled here).
  M5 (10-core GPU): 153 GB/s (Apple, at the M5's launch; e.g. tomshardware.com, "Apple unveils
    M5 chip with 10-core CPU and 10-core GPU"). FP32 4.45 TFLOPS, FP16 8.91 TFLOPS at 1,740 MHz
    (hmc-tech.com/gpu/apple-10-core-m4-fl-vs-apple-10-core-m5-fl); a measured roofline of a
    fanless M5 reached 3.76 TFLOPS FP32 at 1,578 MHz (michaelstinkerings.org, "Apple M5 GPU
    Roofline Analysis"). The M5's neural accelerators (Metal 4 tensor ops) are not used here.
  metal-flash-attention's ALU utilization (github.com/philipturner/metal-flash-attention
    README, "M3 Architecture, FP16", D = 64 / 128 / 256): forward 94 / 91 / 82 %, forward +
    backward 71 / 69 / 61 %; the last column prices each kernel's products at that share of the
    FP32 peak (the forward's for the forward, forward + backward's for dQ and dK/dV).

    roofline-attention.py [--chunk 4096] [--prefix 61440] [--heads 14 2] [--dims 64 128 256]
"""

import argparse
import sys

import mlx.core as mx

from metal_kernels.attention import blocks, traffic

# (name, FP32 FLOP/s, bytes/s): see the docstring
GPUS = (("M4 Max", 17.18e12, 546e9), ("M5", 4.45e12, 153e9))
MFA = {"forward": {64: 0.94, 128: 0.91, 256: 0.82}, "backward": {64: 0.71, 128: 0.69, 256: 0.61}}


def ms(flops: float, bytes_: float, peak: float, bandwidth: float, util: float = 1.0) -> float:
    return 1e3 * max(flops / (peak * util), bytes_ / bandwidth)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--prefix", type=int, default=61440)
    p.add_argument("--heads", type=int, nargs=2, default=[14, 2], metavar=("QUERY", "KV"))
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256])
    a = p.parse_args()
    heads = f"{a.heads[0]}/{a.heads[1]} heads"
    print(
        f"# Metal attention roofline (estimates): {a.chunk:,} queries over {a.prefix:,} + "
        f"{a.chunk:,} keys, {heads}, bf16, every key's gradient\n"
    )
    names = [f"{n} ms" for n, _, _ in GPUS] + [f"{n} at MFA util ms" for n, _, _ in GPUS]
    print(
        "| kernel | D | block (rows x walk) | GFLOP | device GB | FLOP/B | "
        + " | ".join(names)
        + " |\n|---|---:|---|---:|---:|---:|"
        + "---:|" * len(names)
    )
    for dim in a.dims:
        shape = traffic.Shape(
            1, a.heads[0], a.heads[1], a.chunk, a.prefix, 0, dim, mx.bfloat16, mx.bfloat16
        )
        totals = [0.0] * (3 + len(names))
        for kind in blocks.KERNELS:
            t = traffic.traffic(kind, shape)
            moved = t.device_read_bytes + t.device_write_bytes
            util = MFA["forward" if kind == "forward" else "backward"][dim]
            times = [ms(t.flops, moved, f, b) for _, f, b in GPUS]
            times += [ms(t.flops, moved, f, b, util) for _, f, b in GPUS]
            g = blocks.metal(kind, dim, mx.bfloat16)
            split = f", split {g.split}" if g.split > 1 else ""
            row = [
                kind,
                dim,
                f"{g.rows} x {g.walk}{split}",
                t.flops / 1e9,
                moved / 1e9,
                t.flops / moved,
                *times,
            ]
            print("| " + " | ".join(_cell(x) for x in row) + " |")
            for i, x in enumerate([t.flops / 1e9, moved / 1e9, 0.0, *times]):
                totals[i] += x
        total = ["all three", dim, "", totals[0], totals[1], totals[0] / totals[1], *totals[3:]]
        print("| " + " | ".join(_cell(x) for x in total) + " |")
    print(
        "\nms: max(FLOPs / FP32 peak, bytes / bandwidth); at MFA util: FLOPs at "
        "metal-flash-attention's published M3 utilization. Estimates, not measurements."
    )
    return 0


def _cell(x) -> str:
    if isinstance(x, float):
        return f"{x:,.1f}" if x >= 10 else f"{x:.2f}"
    return str(x)


if __name__ == "__main__":
    sys.exit(main())
