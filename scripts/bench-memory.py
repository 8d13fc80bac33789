#!/usr/bin/env python3
"""Peak memory of the exact walk as the window grows, at a fixed chunk: the tiled chunk attention
(reads the cache in place, tiled backward) against the fused path (the prefix concatenated with the
chunk's K/V and MLX's scaled_dot_product_attention, whose CPU/Metal VJP is unfused). One process.

    scripts/bench-memory.py [-m tiny-qwen2] [--windows 1024 4096 16384] [--chunk 512]

Peaks are live sets: MLX is given a memory limit it always exceeds, so its scheduler waits for
each task and frees as it goes (see mlxwalk/walk/budget.py); without it, MLX's CPU backend
allocates ahead of execution and the peak depends on scheduling.
"""

import argparse
import platform
import sys
import time

import mlx.core as mx
import numpy as np

from mlxwalk import use_openblas
from mlxwalk.commands.walk_exact import prepare
from mlxwalk.training import models
from mlxwalk.walk import ExactWalk, WalkConfig, Window, budget

use_openblas()  # MLX's CPU matrix products on OpenBLAS (mlxwalk/_blas.py)

MIB = 1 << 20


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("-m", "--model", default="tiny-qwen2")
    p.add_argument("--windows", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--chunk", type=int, default=512)
    a = p.parse_args()
    model, _ = models.load(a.model)
    prepare(model)
    print(
        f"model {a.model}, chunk {a.chunk}, float32 cache and accumulators, every position "
        f"labelled; mlx {mx.__version__} on {mx.default_device()}, {platform.machine()}"
    )
    print(
        "| window | attention | peak MiB | K/V store MiB | accumulators MiB | rest MiB | seconds |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|")
    for n in a.windows:
        ids = np.random.default_rng(n).integers(0, 256, n + 1)
        window = Window.of(ids[:-1], ids[1:], np.ones(n))
        for attention in ("fused", "tiled"):
            walk = ExactWalk(model, window, WalkConfig(chunk=a.chunk, attention=attention))
            t = time.perf_counter()
            peak = budget.live_peak(walk.run)
            s = time.perf_counter() - t
            store = budget.store_bytes(walk.layout, walk.plan.computed, "float32")
            acc = walk.plan.accumulator_bytes
            print(
                f"| {n} | {attention} | {peak / MIB:.1f} | {store / MIB:.1f} | {acc / MIB:.1f} |"
                f" {(peak - store - acc) / MIB:.1f} | {s:.0f} |",
                flush=True,
            )
            del walk
    return 0


if __name__ == "__main__":
    sys.exit(main())
