"""Memory an exact walk needs, estimated before a window's arrays exist, and the admission check.

Two budgets, after the reference system:
  device: one chunk's graph plus the K/V store (the working set of the reverse pass);
  host:   the K/V gradient accumulators plus the recurrent checkpoints (sized by the plan).
On Apple Silicon both live in the same unified memory; they are kept apart because they answer
different questions (how long a chunk, how long a window). The model's weights and the adapter's
state come on top of both and are reported beside them.

A chunk graph's activations are measured once per model and chunk size on a probe (a window of
one chunk, then one whose last chunk taps a prefix two attention tiles long), since they depend on
every layer's implementation; what grows with the window (the K/V store, the accumulators, the
taps' gradient) is computed from the layout and the probe's slope in the tapped positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from . import store as kvstore
from .attention import TILE
from .plan import MIB, Footprint, OutOfMemory, mib


@dataclass(frozen=True)
class Activations:
    """One chunk's graph, measured at the run's chunk size: with no prefix, and what each tapped
    prefix position adds, in units of that position's K/V at float32."""

    chunk: int
    graph: float
    tap_factor: float


@dataclass(frozen=True)
class Estimate:
    weights: int
    adapter: int  # trainable parameters, their gradient sum and the optimizer's state
    store: int
    accumulators: int
    checkpoints: int
    graph: int

    @property
    def device(self) -> int:
        return self.graph + self.store

    @property
    def host(self) -> int:
        return self.accumulators + self.checkpoints

    @property
    def total(self) -> int:
        return self.weights + self.adapter + self.device + self.host

    def lines(self) -> list[str]:
        return [
            f"  weights            {mib(self.weights):>12}",
            f"  adapter + state    {mib(self.adapter):>12}",
            f"  device: graph      {mib(self.graph):>12}   (one chunk, at the last chunk's taps)",
            f"  device: K/V store  {mib(self.store):>12}",
            f"  host: accumulators {mib(self.accumulators):>12}",
            f"  host: checkpoints  {mib(self.checkpoints):>12}",
            f"  total              {mib(self.total):>12}",
        ]


def nbytes(tree) -> int:
    return sum(v.nbytes for _, v in tree_flatten(tree))


def store_bytes(layout, positions: int, cache_type: str) -> int:
    return int(
        sum(
            h * (dk + dv) * kvstore.element_bytes(cache_type, dk, layout.dtype) * positions
            for h, dk, dv in layout.kv_shapes
        )
    )


def graph_bytes(acts: Activations, footprint: Footprint, taps: int) -> int:
    """One chunk's graph with `taps` tapped prefix positions: linear in them (the attention tile
    is bounded; the taps' gradient and its pieces are not)."""
    return int(acts.graph + acts.tap_factor * taps * footprint.kv_width * 4)


def estimate(
    model,
    layout,
    acts: Activations,
    plan,
    cache_type: str,
    optimizer_factor: int = 4,  # the adapter, its gradient and Adam's two moments
) -> Estimate:
    """The walk's memory for `plan`, at its last chunk (the one with the most taps)."""
    last = plan.chunks[-1]
    taps = last.start - last.grad_from
    trainable = nbytes(model.trainable_parameters())
    return Estimate(
        weights=nbytes(model.parameters()) - trainable,
        adapter=trainable * optimizer_factor,
        store=store_bytes(layout, plan.computed, cache_type),
        accumulators=plan.accumulator_bytes,
        checkpoints=plan.checkpoint_bytes,
        graph=graph_bytes(acts, layout.footprint(), taps),
    )


WHAT_FITS = "a smaller chunk, a horizon, or an 8-bit cache (--cache-type q8) would need less"


def admit(est: Estimate, device_budget: int | None, what_fits: str = WHAT_FITS) -> None:
    """Refuse, naming device memory, when one chunk's graph and the store exceed the budget."""
    if device_budget is not None and est.device > device_budget:
        raise OutOfMemory(
            f"device memory: one chunk's graph and the K/V store need {mib(est.device)} "
            f"(graph {mib(est.graph)}, store {mib(est.store)}) but the device budget is "
            f"{mib(device_budget)}; {what_fits}"
        )


_probes: dict[tuple[int, int, bool], Activations] = {}


def probe(model, chunk: int, recompute: bool = False) -> Activations:
    """Measure one chunk's graph at this chunk size: a window of one chunk (no prefix), then one
    whose last chunk taps a prefix two attention tiles long. Cached per model, chunk and
    recompute (a model is keyed by identity: a probe belongs to the model object it measured)."""
    key = (id(model), chunk, recompute)
    if key not in _probes:
        from . import arch
        from .walk import window_gradient

        layout = arch.inspect(model)
        width = layout.footprint().kv_width
        ids = np.random.default_rng(0).integers(0, 256, chunk * (2 + 2 * TILE // chunk) + 1)

        def graph(n):  # the walk's peak less the store and accumulators of n positions
            peak = live_peak(
                lambda: window_gradient(
                    model, ids[:n], ids[1 : n + 1], np.ones(n), chunk=chunk, recompute=recompute
                )
            )
            return peak - 2 * n * width * 4

        far = chunk * -(-2 * TILE // chunk)  # taps well past one attention tile
        one, two = graph(chunk), graph(chunk + far)
        extra = two - one
        _probes[key] = Activations(chunk, one, max(0.0, extra / (far * width * 4)))
    return _probes[key]


def live_peak(fn) -> int:
    """Peak memory `fn` adds, with MLX made to free as it goes (a memory limit it always exceeds,
    so its scheduler waits for each task): the live set, not what an eager scheduler reserves."""
    mx.eval()
    mx.clear_cache()
    previous = mx.set_memory_limit(1)
    try:
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        out = fn()
        mx.eval(out)
        return mx.get_peak_memory() - base
    finally:
        mx.set_memory_limit(previous)


__all__ = ["Activations", "Estimate", "MIB", "admit", "estimate", "live_peak", "probe"]
