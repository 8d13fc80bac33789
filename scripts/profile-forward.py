#!/usr/bin/env python3
"""Peak memory of single calls on one chunk of the device's attention shape (Qwen2.5-0.5B, bf16):
mlx-lm's own forward and step, the walk's decode and one-chunk step, one graph. It separates what
the walk holds from what the backend holds while it runs a graph (on CUDA, memory freed by the
host returns only once the GPU has run the work that used it).

    scripts/profile-forward.py [--chunk 8192] [--small]
"""

import argparse
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from lib import bench

from mlxwalk import use_openblas
from mlxwalk.plan import cut
from mlxwalk.walk import ChunkRunner, ExactWalk, WalkConfig, Window, one_graph, walking
from mlxwalk.walk.taps import ChunkKV

ROOT = Path(__file__).resolve().parent.parent

use_openblas()  # MLX's CPU matrix products on OpenBLAS (mlxwalk/_blas.py)

MIB = 1 << 20


def peak(label: str, fn) -> None:
    seconds, _, over = bench.timed(fn, 1)  # after a warm-up, from a cleared cache
    print(f"{label}: peak over base {over:.0f} MiB, {seconds:.3f} s", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--small", action="store_true")
    a = p.parse_args()
    n = 256 if a.small else a.chunk
    model, _ = bench.shaped("qwen2-0.5b", a.small)
    ids = bench.ids_for(4 * n)
    win = Window.of(ids[:-1], ids[1:], [1.0] * 4 * n)
    chunks = cut(win.labels, n, True)
    x = mx.array(ids[:n])[None]
    print(f"# mlx {mx.__version__} on {mx.default_device()}, chunk {n}")
    peak("mlx-lm forward, hidden only", lambda: mx.eval(model.model(x)))
    peak("mlx-lm forward, logits", lambda: mx.eval(model(x)))
    for recompute in (False, True):
        for attention in ("fused", "tiled"):
            config = WalkConfig(
                chunk=n, cache_type="bfloat16", recompute=recompute, attention=attention
            )
            runner = ChunkRunner(model, win, config)

            def decode(k, runner=runner):
                with walking(model):
                    runner._new_store(4 * n)
                    state = None
                    for chunk in chunks[:k]:
                        state = runner.decode(chunk, state)

            for k in (1, 2):
                peak(
                    f"decode {k} chunk(s), recompute {recompute}, {attention}",
                    lambda k=k: decode(k),
                )
    with walking(model):
        caches = [ChunkKV(0, attention="fused") for _ in model.layers]
        peak(
            "model with ChunkKV caches (no prefix), K/V only",
            lambda: (model(x, cache=caches), mx.eval([c.keys for c in caches])),
        )
    one = Window.of(ids[:n], ids[1 : n + 1], [1.0] * n)
    for recompute in (False, True):
        config = WalkConfig(chunk=n, cache_type="bfloat16", recompute=recompute)
        peak(
            f"exact walk, one chunk of {n}, recompute {recompute}",
            lambda config=config: mx.eval(ExactWalk(model, one, config).run()),
        )
    peak("one graph gradient", lambda: mx.eval(one_graph(model, one)))
    run = bench.step_for(model, "mlx-lm", n, WalkConfig(chunk=n))
    peak("mlx-lm step", run)
    with bench.grad_checkpoint(model):
        peak("mlx-lm+ckpt step", run)
    from mlx_lm.tuner.trainer import default_loss

    batch, lengths = mx.array(ids[: n + 1])[None], mx.array([[0, n]])
    grad = nn.value_and_grad(model, default_loss)
    peak("mlx-lm value_and_grad only", lambda: mx.eval(grad(model, batch, lengths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
