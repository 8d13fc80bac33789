#!/usr/bin/env python3
"""The gated delta rule's forward+backward: mlxwalk's chunked op against mlx-lm's per-token path,
then the exact walk against one graph on the bundled hybrid. One process, side by side.

    scripts/bench-delta.py [--lengths 512 1024 2048] [--key-heads 16 --value-heads 32 --dim 128]
    scripts/bench-delta.py --chunks 64 128 256 [--lengths 2048]   the op's chunk size only
    scripts/bench-delta.py --kernels [--lengths 4096 16384] [--chunks 64 256]
        the op on the scan kernels against the ops twin (and MLX's gated_delta_update, which
        falls back to ops on CUDA, up to --fast-max positions; mlx-lm's per-token loop up to
        --per-token-max), on this machine's GPU
    scripts/bench-delta.py --compiled [--lengths 1024] [--key-heads 1 --value-heads 2 --dim 64]
        the op's gradient as is against it under mx.compile (the shapes static), alternated
"""

import argparse
import os
import platform
import sys
import time

import mlx.core as mx
from lib import bench
from mlx_lm.models.gated_delta import gated_delta_ops

from mlxwalk import use_openblas
from mlxwalk.commands.walk_exact import prepare
from mlxwalk.ops import delta
from mlxwalk.ops.delta import chunk, gated_delta, scan
from mlxwalk.training import models

use_openblas()  # MLX's CPU matrix products on OpenBLAS (mlxwalk/_blas.py)

MIB = 1 << 20


def layer_inputs(t, hk, hv, d):
    mx.random.seed(0)
    q = 0.01 * mx.random.normal((1, t, hk, d))
    k = mx.random.normal((1, t, hk, d))
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = mx.random.normal((1, t, hv, d))
    log_g = -mx.random.uniform(0.001, 0.5, (1, t, hv))
    beta = mx.sigmoid(mx.random.normal((1, t, hv)))
    xs = [q, k, v, log_g, beta, mx.zeros((1, hv, d, d))]
    mx.eval(xs)
    return xs


def per_token(q, k, v, log_g, beta, s):
    return gated_delta_ops(q, k, v, mx.exp(log_g), beta, s)


def fwd_bwd(fn, xs, repeats):
    def loss(*a):
        y, s = fn(*a)
        return y.sum() + s.sum()

    grad = mx.grad(loss, argnums=list(range(6)))
    mx.eval(grad(*xs))  # warm-up
    times, peak = [], 0
    for _ in range(repeats):
        mx.clear_cache()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        t = time.perf_counter()
        mx.eval(grad(*xs))
        times.append(time.perf_counter() - t)
        peak = max(peak, mx.get_peak_memory() - base)
    return sorted(times)[len(times) // 2], peak / MIB


def chunk_sizes(a) -> int:
    """The chunked op's forward+backward at each chunk size (see chunk.chunk_size)."""
    print(
        f"mlx {mx.__version__} on {mx.default_device()}, {platform.machine()}; gated delta "
        f"layer {a.key_heads}/{a.value_heads} heads, dim {a.dim}, float32, forward+backward"
    )
    print("| T | chunk | seconds | peak MiB |\n|---:|---:|---:|---:|")
    for t in a.lengths:
        xs = layer_inputs(t, a.key_heads, a.value_heads, a.dim)
        for c in a.chunks:
            chunk.CHUNK = c
            s, m = fwd_bwd(gated_delta, xs, max(2, a.repeats))
            print(f"| {t} | {c} | {s:.3f} | {m:,.0f} |", flush=True)
    return 0


def mlx_fast(q, k, v, log_g, beta, s):
    return mx.fast.gated_delta_update(q, k, v, mx.exp(log_g), beta, initial_state=s)


def compiled(a) -> int:
    """The ops twin's forward+backward with and without mx.compile, alternated, one process."""
    print(
        f"mlx {mx.__version__} on {mx.default_device()}, {platform.machine()}; gated delta "
        f"layer {a.key_heads}/{a.value_heads} heads, dim {a.dim}, float32, fwd+bwd"
    )
    print("| T | as is s | mx.compile s |\n|---:|---:|---:|")
    for t in a.lengths:
        xs = layer_inputs(t, a.key_heads, a.value_heads, a.dim)

        def loss(*x):
            y, s = gated_delta(*x)
            return y.sum() + s.sum()

        plain = mx.grad(loss, argnums=list(range(6)))
        fns = {"as is": plain, "compiled": mx.compile(plain)}
        times = {k: [] for k in fns}
        for _ in range(max(3, a.repeats)):
            for name, fn in fns.items():
                mx.eval(fn(*xs))  # warm-up (and the compile) before each timed run
                start = time.perf_counter()
                mx.eval(fn(*xs))
                times[name].append(time.perf_counter() - start)
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        print(f"| {t} | {med['as is']:.4f} | {med['compiled']:.4f} |", flush=True)
    model, _ = models.load("tiny-qwen3_5")
    prepare(model)
    print(f"\nthe exact walk on tiny-qwen3_5, window {a.walk_window}, chunk 256 (median of 3)")
    print("| round | as is s | mx.compile s |\n|---:|---:|---:|")
    for i in range(2):
        row = []
        for on in (False, True):
            delta.CPU_COMPILE = on  # the layers' op under mx.compile on the CPU, or not
            row.append(bench.measure(model, "exact", a.walk_window, 256, 3).seconds)
        print(f"| {i + 1} | {row[0]:.3f} | {row[1]:.3f} |", flush=True)
    return 0


def kernels(a) -> int:
    """The chunked op with its recurrence on the scan kernels against the ops twin, one process."""
    print(
        f"mlx {mx.__version__} on {mx.default_device()}, {platform.node()}; gated delta "
        f"layer {a.key_heads}/{a.value_heads} heads, dim {a.dim}, float32, fwd+bwd"
    )
    print("| T | chunk | path | seconds | peak MiB |\n|---:|---:|---|---:|---:|")
    for t in a.lengths:
        xs = layer_inputs(t, a.key_heads, a.value_heads, a.dim)
        for c in a.chunks or [64, 256]:
            chunk.CHUNK = c
            for path, mode in (("ops twin", "off"), ("scan kernels", "on")):
                os.environ["MLXWALK_KERNELS"] = mode
                if mode == "on" and not scan.use_kernel(a.dim, min(c, t)):
                    print(f"| {t} | {c} | {path} | no kernel here | |", flush=True)
                    continue
                s, m = fwd_bwd(gated_delta, xs, max(2, a.repeats))
                print(f"| {t} | {c} | {path} | {s:.3f} | {m:,.0f} |", flush=True)
        if t <= a.fast_max:
            s, m = fwd_bwd(mlx_fast, xs, max(2, a.repeats))
            print(f"| {t} | - | mx.fast.gated_delta_update | {s:.3f} | {m:,.0f} |", flush=True)
        if t <= a.per_token_max:
            s, m = fwd_bwd(per_token, xs, 1)
            print(f"| {t} | - | mlx-lm per-token ops | {s:.3f} | {m:,.0f} |", flush=True)
        del xs
        mx.clear_cache()
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--key-heads", type=int, default=16)
    p.add_argument("--value-heads", type=int, default=32)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--walk-window", type=int, default=2048)
    p.add_argument("--chunks", type=int, nargs="+", help="time the op at these chunk sizes only")
    p.add_argument("--kernels", action="store_true", help="the scan kernels against the ops")
    p.add_argument("--fast-max", type=int, default=4096, help="MLX's op up to this T")
    p.add_argument("--per-token-max", type=int, default=0, help="mlx-lm's loop up to this T")
    p.add_argument("--compiled", action="store_true", help="the ops under mx.compile")
    a = p.parse_args()
    if a.compiled:
        return compiled(a)
    if a.kernels:
        return kernels(a)
    if a.chunks:
        return chunk_sizes(a)
    print(
        f"mlx {mx.__version__} on {mx.default_device()}, {platform.machine()} {platform.system()}"
    )
    print(
        f"gated delta layer: {a.key_heads} key heads, {a.value_heads} value heads, head dim "
        f"{a.dim}, float32, forward+backward (grad of every input)"
    )
    print(
        "| T | per-token s | chunked s | speed-up | per-token peak MiB | chunked peak MiB |"
        " memory ratio |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for t in a.lengths:
        xs = layer_inputs(t, a.key_heads, a.value_heads, a.dim)
        ts, ms = fwd_bwd(per_token, xs, a.repeats)
        tc, mc = fwd_bwd(gated_delta, xs, a.repeats)
        print(
            f"| {t} | {ts:.2f} | {tc:.3f} | {ts / tc:.1f}x | {ms:,.0f} | {mc:,.0f} |"
            f" {ms / mc:.1f}x |",
            flush=True,
        )
    model, _ = models.load("tiny-qwen3_5")
    prepare(model)
    rows = [bench.measure(model, w, a.walk_window, 256, 2) for w in ("one-graph", "exact", "plain")]
    print(f"\nbundled tiny-qwen3_5, window {a.walk_window}, chunk 256")
    print(bench.table(rows))
    print()
    print(bench.ratios(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
