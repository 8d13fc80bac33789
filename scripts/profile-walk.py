#!/usr/bin/env python3
"""Where one exact walk's memory goes, chunk by chunk, on the device's shapes: the peak of every
decode and train step of a window, and the isolated peaks of the chunk graph's two largest parts
(attention's backward over the prefix, the cross-entropy's backward over the vocabulary).

    scripts/profile-walk.py [--window 65536] [--chunk 8192] [--recompute] [--small]
                            [--keep-inputs auto|on|off]
Each decode and train step's seconds are printed beside its peak (each step ends in an
evaluation, so its time is the device's).
"""

import argparse
import sys
import time

import mlx.core as mx
from lib import bench

from mlxwalk import use_openblas
from mlxwalk.walk import ExactWalk, WalkConfig, Window

use_openblas()  # MLX's CPU matrix products on OpenBLAS (mlxwalk/_blas.py)

MIB = 1 << 20


def peak_of(fn) -> tuple[float, float]:
    mx.eval(fn())  # warm-up
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    t = time.perf_counter()
    mx.eval(fn())
    return (mx.get_peak_memory() - base) / MIB, time.perf_counter() - t


def attention_vjp(q_len, k_len, heads=14, kv_heads=2, dim=64):
    q = mx.random.normal((1, heads, q_len, dim)).astype(mx.bfloat16)
    k = mx.random.normal((1, kv_heads, k_len, dim)).astype(mx.bfloat16)
    v = mx.random.normal((1, kv_heads, k_len, dim)).astype(mx.bfloat16)
    mx.eval(q, k, v)

    def loss(q, k, v):
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
        return o.astype(mx.float32).sum()

    return lambda: mx.grad(loss, argnums=(0, 1, 2))(q, k, v)


def cross_entropy_vjp(n, vocab=151936):
    logits = mx.random.normal((n, vocab)).astype(mx.bfloat16)
    y = mx.random.randint(0, vocab, (n,))
    mx.eval(logits, y)
    return lambda: mx.grad(lambda z: mx.fast.cross_entropy(z, y).sum())(logits)


def compare(model, a) -> int:
    """The exact walk's peak and time: no recompute, one checkpointed graph (the model run whole,
    as for a model the walk cannot split at its head), recompute by layer."""
    ids = bench.ids_for(a.window)
    win = Window.of(ids[:-1], ids[1:], [1.0] * a.window)
    print(f"| recompute | peak MiB | seconds |   (window {a.window}, chunk {a.chunk})")
    print("|---|---:|---:|")
    for name, recompute, whole in [
        ("none", False, False),
        ("one checkpointed graph", True, True),
        ("by layer", True, False),
    ]:
        config = WalkConfig(chunk=a.chunk, cache_type="bfloat16", recompute=recompute)

        def run(config=config, whole=whole):
            walk = ExactWalk(model, win, config)
            if whole:
                walk.head = None
            mx.eval(walk.run())

        took, _, over = bench.timed(run, 1)  # after a warm-up, from a cleared cache
        print(f"| {name} | {over:.1f} | {took:.2f} |", flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--window", type=int, default=65536)
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--recompute", action="store_true")
    p.add_argument("--keep-inputs", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--small", action="store_true")
    p.add_argument(
        "--compare",
        action="store_true",
        help="only the walk's peak without recompute, with one checkpointed graph per "
        "chunk, and with recompute by layer",
    )
    a = p.parse_args()
    print(f"# mlx {mx.__version__} on {mx.default_device()}")
    if not a.small:
        for q_len, k_len in [(a.chunk, a.chunk), (a.chunk, a.window)]:
            mib, s = peak_of(attention_vjp(q_len, k_len))
            print(f"attention vjp q {q_len} k {k_len}: {mib:.0f} MiB over inputs, {s:.3f} s")
        mib, s = peak_of(cross_entropy_vjp(a.chunk))
        print(f"cross-entropy vjp {a.chunk} x 151936: {mib:.0f} MiB over inputs, {s:.3f} s")
    model, _ = bench.shaped("qwen2-0.5b", a.small)
    if a.compare:
        return compare(model, a)
    ids = bench.ids_for(a.window)
    win = Window.of(ids[:-1], ids[1:], [1.0] * a.window)
    config = WalkConfig(
        chunk=a.chunk, cache_type="bfloat16", recompute=a.recompute, keep_inputs=a.keep_inputs
    )
    for _ in range(2):  # the first compiles kernels and fills caches
        mx.clear_cache()
        mx.reset_peak_memory()
        rows, last = [], [time.perf_counter()]

        def tick(phase, done, of, rows=rows, last=last):
            now = time.perf_counter()
            rows.append(
                (
                    phase,
                    done,
                    mx.get_peak_memory() / MIB,
                    mx.get_active_memory() / MIB,
                    now - last[0],
                )
            )
            last[0] = now
            mx.reset_peak_memory()

        walk = ExactWalk(model, win, config)
        walk.on_chunk = tick
        t = last[0] = time.perf_counter()
        loss, grads = walk.run()
        mx.eval(loss, grads)
        took = time.perf_counter() - t
    print(
        f"exact walk, window {a.window}, chunk {a.chunk}, recompute {a.recompute} (keep inputs "
        f"{a.keep_inputs}: {'kept' if walk.keep else 'not kept'}): {took:.2f} s"
    )
    print("| phase | chunk | peak MiB | active after MiB | seconds |\n|---|---:|---:|---:|---:|")
    for phase, done, peak, active, seconds in rows:
        print(f"| {phase} | {done} | {peak:.0f} | {active:.0f} | {seconds:.3f} |")
    for phase in ("decode", "train"):
        print(f"{phase}: {sum(r[4] for r in rows if r[0] == phase):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
