#!/usr/bin/env python3
"""Where a 4-bit base's matrix products go at a chunk's size: MLX's quantized product against
the same weights dequantized then multiplied (the walk's product, mlxwalk/ops/products.py) and a
bf16 product of the same shape, forward and forward + the input's gradient (what a frozen base's
layer costs in the walk), side by side in one process. Shapes: the projections of the
Qwen3.5-27B and Llama-3-8B shapes (mlxwalk.shapes).

    bench-qmm --tokens 2048 4096 --repeats 10

Each row's rel diff: its largest difference from the float32 product of the same weights,
over that product's largest value.
"""

import argparse
import platform
import time

import mlx.core as mx
import numpy as np

from mlxwalk.ops.products import dequantized_matmul

# (name, in features, out features)
PROJECTIONS = {
    "qwen3_5-27b": [
        ("mlp gate/up", 5120, 17408),
        ("mlp down", 17408, 5120),
        ("delta in_proj_qkvz", 5120, 16384),
        ("delta out_proj", 6144, 5120),
        ("attention q", 5120, 12288),
        ("attention o", 6144, 5120),
    ],
    "llama3-8b": [
        ("mlp gate/up", 4096, 14336),
        ("mlp down", 14336, 4096),
        ("attention q/o", 4096, 4096),
        ("attention k/v", 4096, 1024),
    ],
}


def median_ms(fn, repeats: int) -> float:
    mx.eval(fn())
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times))


def variants(w, scales, biases, dense, bits: int, group: int) -> dict:
    walk_product = dequantized_matmul(group, bits)

    def qmm(x):
        return mx.quantized_matmul(x, w, scales, biases, True, group, bits)

    def deq(x):
        return walk_product(x, w, scales, biases)

    def bf16(x):
        return x @ dense.T

    return {"quantized": qmm, "dequantized": deq, "bf16": bf16}


def row(f, x, dy, ref, repeats: int) -> tuple[float, float, float]:
    """(forward ms, forward + dx ms, largest difference from the float32 product / its max)."""
    fwd = median_ms(lambda: f(x), repeats)
    both = median_ms(lambda: mx.vjp(f, [x], [dy]), repeats)
    diff = (mx.abs(f(x).astype(mx.float32) - ref).max() / mx.abs(ref).max()).item()
    return fwd, both, diff


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--shapes", nargs="+", default=sorted(PROJECTIONS))
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--small", action="store_true", help="every dimension / 16: checks the script")
    a = p.parse_args()
    div = 16 if a.small else 1
    print(
        f"# mlx {mx.__version__} on {mx.default_device()}, {platform.node()}; "
        f"{a.bits}-bit, group 64; rel diff: against the float32 product of the same weights"
    )
    print("| shape | projection | tokens | path | forward ms | TFLOP/s | fwd + dx ms | rel diff |")
    print("|---|---|---:|---|---:|---:|---:|---:|")
    for shape in a.shapes:
        for name, n_in, n_out in PROJECTIONS[shape]:
            n_in, n_out = n_in // div, n_out // div
            dense = (0.02 * mx.random.normal((n_out, n_in))).astype(mx.bfloat16)
            w, scales, biases = mx.quantize(dense, 64, a.bits)
            paths = variants(w, scales, biases, dense, a.bits, 64)
            for t in a.tokens:
                x = mx.random.normal((1, t, n_in)).astype(mx.bfloat16)
                dy = mx.random.normal((1, t, n_out)).astype(mx.bfloat16)
                deq = mx.dequantize(w, scales, biases, 64, a.bits).astype(mx.float32)
                ref = x.astype(mx.float32) @ deq.T
                for path, f in paths.items():
                    fwd, both, diff = row(f, x, dy, ref, a.repeats)
                    said = "-" if path == "bf16" else f"{diff:.1e}"  # other weights
                    flops = 2 * t * n_in * n_out / (fwd * 1e-3) / 1e12
                    print(
                        f"| {shape} | {name} | {t} | {path} | {fwd:.3f} | {flops:.0f} | "
                        f"{both:.3f} | {said} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
