"""Time and peak memory of the walks and one graph, side by side in one process."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import mlx.core as mx
import numpy as np

from .walk import window_gradient

MIB = 1 << 20


@dataclass
class Measure:
    walk: str
    window: int
    chunk: int
    seconds: float  # median over repeats
    tokens_per_second: float
    peak_mib: float  # mx.get_peak_memory during the call
    over_weights_mib: float  # that peak less what was allocated before the call

    def as_dict(self) -> dict:
        return asdict(self)


def measure(model, walk: str, window: int, chunk: int, repeats: int = 3, **kw) -> Measure:
    rng = np.random.default_rng(window)
    ids = rng.integers(0, 256, window + 1)
    args = (model, ids[:-1], ids[1:], np.ones(window))
    window_gradient(*args, chunk=chunk, walk=walk, **kw)  # warm-up
    times, peaks, base = [], [], 0.0
    for _ in range(repeats):
        mx.clear_cache()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        t = time.perf_counter()
        window_gradient(*args, chunk=chunk, walk=walk, **kw)
        times.append(time.perf_counter() - t)
        peaks.append(mx.get_peak_memory())
    s = float(np.median(times))
    peak = max(peaks)
    return Measure(walk, window, chunk, s, window / s, peak / MIB, (peak - base) / MIB)


def table(rows: list[Measure]) -> str:
    out = [
        "| window | chunk | walk | seconds | tokens/s | peak MiB | over weights MiB |",
        "|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r.window} | {r.chunk} | {r.walk} | {r.seconds:.2f} | {r.tokens_per_second:,.0f}"
            f" | {r.peak_mib:.1f} | {r.over_weights_mib:.1f} |"
        )
    return "\n".join(out)


def ratios(rows: list[Measure]) -> str:
    out = [
        "| window | exact/one-graph time | exact/one-graph peak | plain/one-graph time |"
        " plain/one-graph peak | exact/plain time |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for n in sorted({r.window for r in rows}):
        by = {r.walk: r for r in rows if r.window == n}
        if {"exact", "plain", "one-graph"} <= by.keys():
            e, p, o = by["exact"], by["plain"], by["one-graph"]
            t, m = (lambda a, b: a.seconds / b.seconds), (lambda a, b: a.peak_mib / b.peak_mib)
            out.append(
                f"| {n} | {t(e, o):.2f} | {m(e, o):.2f} | {t(p, o):.2f} | {m(p, o):.2f}"
                f" | {t(e, p):.2f} |"
            )
    return "\n".join(out)
