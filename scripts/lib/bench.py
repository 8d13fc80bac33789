"""Measurements side by side in one process: the walks, one graph, and mlx-lm's own training step
(`default_loss` through `nn.value_and_grad`, with and without its `grad_checkpoint`); random
models of mlxwalk.shapes' shapes (`shaped`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from mlxwalk.shapes import SHAPES, SMALL  # the scripts read them as bench.SHAPES, bench.SMALL
from mlxwalk.walk import WalkConfig, Window, train_window, window_gradient

MIB = 1 << 20
WALKS = ("one-graph", "exact", "plain")
STEPS = ("mlx-lm", "mlx-lm+ckpt", "one-graph", "exact", "plain")


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


def ids_for(window: int) -> np.ndarray:
    return np.random.default_rng(window).integers(0, 256, window + 1)


def timed(fn: Callable[[], object], repeats: int) -> tuple[float, float, float]:
    """(median seconds, peak MiB, peak over the starting allocation MiB), after a warm-up."""
    fn()
    times, peak, over = [], 0.0, 0.0
    for _ in range(repeats):
        mx.clear_cache()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        peak = max(peak, mx.get_peak_memory())
        over = max(over, mx.get_peak_memory() - base)
    return float(np.median(times)), peak / MIB, over / MIB


def measure(model, walk: str, window: int, chunk: int, repeats: int = 3, **kw) -> Measure:
    """window_gradient: the gradient only, no optimizer step."""
    ids = ids_for(window)

    def run():
        window_gradient(model, ids[:-1], ids[1:], np.ones(window), chunk=chunk, walk=walk, **kw)

    s, peak, over = timed(run, repeats)
    return Measure(walk, window, chunk, s, window / s, peak, over)


class grad_checkpoint:
    """mlx-lm's grad_checkpoint patches the layer class itself; this undoes it on exit."""

    def __init__(self, model):
        self.layer = model.layers[0]
        self.cls = type(self.layer)

    def __enter__(self):
        from mlx_lm.tuner.trainer import grad_checkpoint as patch

        self.original = self.cls.__call__
        patch(self.layer)
        return self

    def __exit__(self, *exc):
        self.cls.__call__ = self.original


@contextmanager
def memory_limit(mib: float | None) -> Iterator[None]:
    """MLX held to `mib` within the block (none if None): its allocator then waits for pending
    work to free memory rather than grow (on CUDA, frees take effect only once the GPU has run
    the work)."""
    previous = mx.set_memory_limit(int(mib * MIB)) if mib else None
    try:
        yield
    finally:
        if previous is not None:
            mx.set_memory_limit(previous)


def stepping(model, kind: str):
    """mlx-lm's grad_checkpoint for the `+ckpt` step, nothing for the others."""
    return grad_checkpoint(model) if kind == "mlx-lm+ckpt" else nullcontext()


def mlx_lm_step(model, optimizer, window: int) -> Callable[[], None]:
    """One step of mlx-lm's trainer on one sequence of `window` tokens, every position trained."""
    from mlx_lm.tuner.trainer import default_loss

    batch = mx.array(ids_for(window)[None])
    lengths = mx.array([[0, window]])
    step = nn.value_and_grad(model, default_loss)

    def run():
        (loss, _), grads = step(model, batch, lengths)
        optimizer.update(model, grads)
        mx.eval(loss, model.parameters(), optimizer.state)

    return run


def walk_step(model, optimizer, window: int, walk: str, config: WalkConfig) -> Callable[[], None]:
    ids = ids_for(window)
    win = Window.of(ids[:-1], ids[1:], np.ones(window))
    return lambda: train_window(model, optimizer, win, config, walk)


def one_graph_step(model, optimizer, window: int) -> Callable[[], None]:
    ids = ids_for(window)
    win = Window.of(ids[:-1], ids[1:], np.ones(window))

    def run():
        from mlxwalk.walk import one_graph

        _, grads = one_graph(model, win)
        optimizer.update(model, grads)
        mx.eval(model.parameters(), optimizer.state)

    return run


def step_for(model, kind: str, window: int, config: WalkConfig):
    optimizer = optim.Adam(learning_rate=1e-5)
    if kind.startswith("mlx-lm"):
        return mlx_lm_step(model, optimizer, window)
    if kind == "one-graph":
        return one_graph_step(model, optimizer, window)
    return walk_step(model, optimizer, window, kind, config)


def measure_step(
    model, kind: str, window: int, config: WalkConfig, repeats: int = 2, limit_mib=None
) -> Measure:
    """A training step (gradient and optimizer update) of `kind` on one window; with `limit_mib`,
    MLX held to that memory limit (see memory_limit)."""
    run = step_for(model, kind, window, config)
    with memory_limit(limit_mib), stepping(model, kind):
        s, peak, over = timed(run, repeats)
    return Measure(kind, window, config.chunk, s, window / s, peak, over)


def fits(
    model, kind: str, window: int, config: WalkConfig, cap_mib: float, why: list | None = None
) -> bool:
    """Whether one step at `window` runs with a measured peak under the cap (MLX held to it,
    except on CUDA, where a limit only makes the allocator hand buffers back: see ExactWalk.run).
    """
    try:
        with memory_limit(None if mx.cuda.is_available() else cap_mib), stepping(model, kind):
            run = step_for(model, kind, window, config)
            mx.clear_cache()
            mx.reset_peak_memory()
            run()
        return mx.get_peak_memory() <= cap_mib * MIB
    except (RuntimeError, MemoryError, ValueError) as e:
        if why is not None:
            why.append(str(e).splitlines()[0])
        return False
    finally:
        mx.clear_cache()


def largest_window(ok: Callable[[int], bool], lo: int, hi: int, step: int) -> int:
    """The largest multiple of `step` in [lo, hi] for which `ok` holds (ok assumed monotone):
    doubling from `lo` until a window fails, then bisection, so no window far past the answer is
    ever tried (one that far past could take the machine's memory). lo - step if lo fails."""
    if not ok(lo):
        return lo - step
    good = lo
    while good < hi:
        probe = min(hi, good * 2)
        if not ok(probe):
            bad = probe
            break
        good = probe
    else:
        return good
    while bad - good > step:
        mid = (good + bad) // 2 // step * step
        if mid <= good:
            break
        good, bad = (mid, bad) if ok(mid) else (good, mid)
    return good


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


def ratios(rows: list[Measure], against: str = "one-graph") -> str:
    kinds = [k for k in dict.fromkeys(r.walk for r in rows) if k != against]
    head = " | ".join(f"{k} time | {k} peak" for k in kinds)
    out = [f"| window | {head} |", "|---:|" + "---:|" * (2 * len(kinds))]
    for n in sorted({r.window for r in rows}):
        by = {r.walk: r for r in rows if r.window == n}
        if against not in by:
            continue
        ref = by[against]
        cells = []
        for k in kinds:
            if k in by:
                cells.append(
                    f"{by[k].seconds / ref.seconds:.2f} | {by[k].peak_mib / ref.peak_mib:.2f}"
                )
            else:
                cells.append("- | -")
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    return f"ratios against {against} (time, peak):\n" + "\n".join(out)


def random_bf16(p: mx.array) -> mx.array:
    return (
        (0.02 * mx.random.normal(p.shape)).astype(mx.bfloat16)
        if p.ndim > 1
        else p.astype(mx.bfloat16)
    )


# Realistic shapes (mlxwalk/shapes.py) with random weights, for the device measurements
# (scripts/bench-device.py, scripts/profile-*); `small` shrinks every dimension (SMALL) to check
# a script on a CPU.


def shaped(name: str, small: bool = False, bits: int | None = None):
    """A random model of the named shape in bf16 (quantized to `bits`, layer by layer so the
    bf16 copy never exists whole), with LoRA r8 on its last 16 layers."""
    import importlib

    from mlx.utils import tree_flatten, tree_map

    from mlxwalk.training import adapters

    cfg = dict(SHAPES[name])
    if small:
        cfg.update(SMALL)
        if cfg["model_type"] == "qwen3_5":
            cfg.update(
                num_attention_heads=4,
                head_dim=64,
                linear_num_key_heads=2,
                linear_num_value_heads=4,
                linear_key_head_dim=64,
                linear_value_head_dim=64,
            )
        else:
            cfg.update(num_attention_heads=4, num_key_value_heads=2)
    arch = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")
    mx.random.seed(0)
    model = arch.Model(arch.ModelArgs.from_dict(cfg))

    def randomize(module):
        module.update(tree_map(random_bf16, module.parameters()))
        if bits:
            nn.quantize(module, group_size=64, bits=bits)
        mx.eval(module.parameters())

    for layer in model.layers:
        randomize(layer)
    rest = [(k, random_bf16(v)) for k, v in tree_flatten(model.parameters()) if ".layers." not in k]
    model.load_weights(rest, strict=False)
    if bits:
        nn.quantize(
            model,
            group_size=64,
            bits=bits,
            class_predicate=lambda _, m: (
                hasattr(m, "to_quantized")
                and not isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
            ),
        )
    adapters.apply(model, adapters.LoraConfig(rank=8, scale=20.0, num_layers=16))
    mx.eval(model.parameters())
    n = sum(v.size for _, v in tree_flatten(model.parameters()))
    return model, n
