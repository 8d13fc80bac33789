#!/usr/bin/env python3
"""One chunk's attention, forward and backward, side by side in one process: the attention
kernel (metal_kernels/attention), MLX's fused sdpa (cuDNN where it applies), the unfused
computation in MLX ops, and the ops twin (chunk_attention's tiled path). bf16, the prefix in a
bf16 store, the gradient taken for the queries and every key and value (the prefix's through the
taps, as the exact walk takes it). Time is the median of several runs after a warm-up; peak is
MLX's peak memory during a run less what was allocated before it (the inputs).

    bench-attention.py [--chunk 4096] [--prefixes 0 16384 61440] [--dims 64 128 256]
"""

import argparse
import os
import platform
import sys

import mlx.core as mx
from lib import bench

from mlxwalk import use_openblas
from mlxwalk.ops.attention import Prefix, check, chunk_attention, path

use_openblas()  # MLX's CPU matrix products on OpenBLAS (mlxwalk/_blas.py)

HEADS = {7: (14, 2), 4: (8, 2)}  # GQA ratio: (query heads, key/value heads)


def inputs(dim: int, hq: int, hkv: int, chunk: int, prefix: int):
    mx.random.seed(0)
    q = mx.random.normal((1, hq, chunk, dim)).astype(mx.bfloat16)
    k, v = (mx.random.normal((1, hkv, chunk, dim)).astype(mx.bfloat16) for _ in range(2))
    pk, pv = (mx.random.normal((1, hkv, prefix + chunk, dim)) for _ in range(2))
    store = check.Store(pk, pv, mx.bfloat16)  # window-sized, as the walk's store
    taps = tuple(mx.zeros((1, hkv, prefix, dim), mx.bfloat16) for _ in range(2))
    mx.eval(q, k, v, store.keys, store.values)
    return q, k, v, store, taps


def variants(q, k, v, store, taps, prefix: int):
    scale = q.shape[-1] ** -0.5
    pre = Prefix(store, 0, prefix, mx.bfloat16) if prefix else None

    def walked(q, k, v, tk, tv):
        return chunk_attention(q, k, v, pre, 0, (tk, tv) if prefix else None, scale)

    def concatenated(q, k, v, tk, tv):
        if not prefix:
            return q, k, v
        pk, pv = store.read(0, 0, prefix, mx.bfloat16)
        return q, mx.concatenate([pk + tk, k], axis=2), mx.concatenate([pv + tv, v], axis=2)

    def fused(*a):
        q, kk, vv = concatenated(*a)
        return mx.fast.scaled_dot_product_attention(q, kk, vv, scale=scale, mask="causal")

    def unfused(*a):
        q, kk, vv = concatenated(*a)
        b, hq, n, d = q.shape
        hkv = kk.shape[1]
        qs = (q * scale).reshape(b, hkv, hq // hkv, n, d)
        s = qs @ kk[:, :, None].swapaxes(-1, -2)  # (B, HKV, R, L, prefix + L)
        m = kk.shape[2]
        mask = (mx.arange(n)[:, None] + m - n) >= mx.arange(m)[None]
        p = mx.softmax(mx.where(mask, s, -mx.inf), axis=-1, precise=True)
        return (p @ vv[:, :, None]).reshape(b, hq, n, d)

    return {"kernel": walked, "fused sdpa": fused, "unfused": unfused, "ops twin": walked}


def run(fn, q, k, v, taps, repeats: int):
    grad = mx.grad(lambda *a: (fn(*a).astype(mx.float32) ** 2).sum(), argnums=(0, 1, 2, 3, 4))

    def step():
        mx.eval(grad(q, k, v, *taps))

    return bench.timed(step, repeats)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--prefixes", type=int, nargs="+", default=[0, 16384, 61440])
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--gqa", type=int, nargs="+", default=[7, 4])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", nargs="+", default=["kernel", "fused sdpa", "unfused", "ops twin"])
    a = p.parse_args()
    print(
        f"# one chunk's attention forward+backward, bf16: mlx {mx.__version__} on "
        f"{mx.default_device()}, {platform.node()}, chunk {a.chunk}"
    )
    print("| head dim | GQA (heads) | prefix | variant | ms | peak over inputs GiB |")
    print("|---:|---|---:|---|---:|---:|")
    for dim in a.dims:
        for g in a.gqa:
            hq, hkv = HEADS[g]
            for prefix in a.prefixes:
                q, k, v, store, taps = inputs(dim, hq, hkv, a.chunk, prefix)
                fns = variants(q, k, v, store, taps, prefix)
                for name in a.variants:
                    os.environ["MLXWALK_KERNELS"] = "off" if name == "ops twin" else "auto"
                    if name == "kernel" and path(q, k, None) != "kernel":
                        print(
                            f"| {dim} | {g} ({hq}/{hkv}) | {prefix} | {name} | no kernel here | |"
                        )
                        continue
                    try:
                        seconds, _, over = run(fns[name], q, k, v, taps, a.repeats)
                        cell = f"{seconds * 1e3:.1f} | {over / 1024:.2f}"
                    except (RuntimeError, ValueError) as e:
                        cell = f"failed: {str(e).splitlines()[0][:60]} |"
                    print(f"| {dim} | {g} ({hq}/{hkv}) | {prefix} | {name} | {cell} |", flush=True)
                    mx.clear_cache()
                del q, k, v, store, taps
                mx.clear_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
