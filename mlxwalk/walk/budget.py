"""Memory an exact walk needs, estimated before a window's arrays exist, and the admission check.

Two budgets:
  memory (device): everything MLX holds while a window trains, as its peak-memory counter sees it:
          the weights, the adapter and its optimizer state, the K/V store, the accumulators and
          checkpoints, and one chunk's graph. MLX keeps all of them in one memory (unified on
          Apple Silicon, the GPU's on CUDA), so this is the number that has to fit.
  host:   the K/V gradient accumulators plus the recurrent checkpoints (sized by the plan); within
          a memory budget and unless given, it is what the rest leaves over.

A chunk graph's activations are measured on the model (probe.py), since they depend on every
layer's implementation; what grows with the window (the K/V store, the accumulators, the
taps' gradient) is computed from the layout and the probe's slope in the tapped positions.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_flatten

from ..plan import MIB, OutOfMemory, memory_lines, mib, model_rows
from . import store as kvstore
from .activations import Activations, graph_bytes


@dataclass(frozen=True)
class Estimate:
    weights: int
    adapter: int  # trainable parameters, their gradient sum and the optimizer's state
    store: int
    accumulators: int
    checkpoints: int
    graph: int
    resident: int = 0  # what else MLX holds when the walk starts (measured at its start)
    inputs: int = 0  # the decoder layers' inputs kept from the decode (--keep-inputs)
    # the stem's attention layers' K/V, held through the decode alone where the reverse pass runs
    # no stem layer (the stem's output kept: walk/exact.py `drop_stem_store`); `store` is the rest
    stem_store: int = 0
    # one decode run's own memory, where the decode runs several chunks at once under the budget
    # (admission.py `decode_width`; 0: chunk by chunk, whose own memory is under the graph's)
    run: int = 0

    @property
    def device(self) -> int:
        """What one chunk's reverse step works on: its graph, the K/V store, kept inputs."""
        return self.graph + self.store + self.inputs

    @property
    def host(self) -> int:
        return self.accumulators + self.checkpoints

    @property
    def reversing(self) -> int:
        """The reverse pass's memory, at its first chunk."""
        return self.weights + self.adapter + self.resident + self.device + self.host

    @property
    def decoding(self) -> int:
        """The decode's memory at its end (no accumulators yet), with one run's own memory
        where it runs several chunks at once (one chunk's is not counted, as it never was)."""
        held = self.store + self.stem_store + self.inputs + self.checkpoints
        return self.weights + self.adapter + self.resident + held + self.run

    @property
    def total(self) -> int:
        return max(self.reversing, self.decoding)

    def phases(self) -> list[tuple[str, int, str]]:
        """The two phases' sums, shown where the stem's K/V is held through the decode alone."""
        return [
            ("decode's end", self.decoding, "all but the graph and accumulators, one run's"),
            ("reverse pass", self.reversing, "everything but the stem's K/V"),
            ("total", self.total, "the larger of the two"),
        ]

    def lines(self) -> list[str]:
        inputs = [("device: inputs", self.inputs, "layer inputs kept from the decode")]
        rows = [
            *model_rows(self, "other arrays"),
            ("device: graph", self.graph, "one chunk, at the last chunk's taps"),
            ("device: K/V store", self.store, ""),
            *(
                [("device: stem K/V", self.stem_store, "the decode's alone")]
                if self.stem_store
                else []
            ),
            *(inputs if self.inputs else []),
            *([("device: decode run", self.run, "the decode's alone")] if self.run else []),
            ("host: accumulators", self.accumulators, ""),
            ("host: checkpoints", self.checkpoints, ""),
            *(self.phases() if self.stem_store or self.run else [("total", self.total, "")]),
        ]
        return memory_lines(rows, 19)


def nbytes(tree) -> int:
    return sum(v.nbytes for _, v in tree_flatten(tree))


def store_bytes(layout, positions: int, cache_type: str, layers=None) -> int:
    """The K/V store's bytes; `layers`: only the attention layers (model indices) it holds."""
    return int(
        sum(
            h * (dk + dv) * kvstore.element_bytes(cache_type, dk, layout.dtype) * positions
            for i, (h, dk, dv) in zip(layout.attention, layout.kv_shapes)
            if layers is None or i in layers
        )
    )


def estimate(
    model,
    layout,
    acts: Activations,
    plan,
    cache_type: str,
    optimizer_factor: int = 4,  # the adapter, its gradient and Adam's two moments
    skipped: int = 0,
) -> Estimate:
    """The walk's memory for `plan`, at its last chunk (the one with the most taps). `skipped`:
    the stem's layers, which the reverse pass never runs (their K/V held through the decode)."""
    last = plan.chunks[-1]
    taps = last.start - last.grad_from
    trainable = nbytes(model.trainable_parameters())
    layers = len(layout.kinds)
    return Estimate(
        weights=nbytes(model.parameters()) - trainable,
        adapter=trainable * optimizer_factor,
        stem_store=store_bytes(layout, plan.computed, cache_type, range(skipped)),
        store=store_bytes(layout, plan.computed, cache_type, range(skipped, layers)),
        accumulators=plan.accumulator_bytes,
        checkpoints=plan.checkpoint_bytes,
        graph=graph_bytes(acts, layout.footprint(), taps, last.start),
    )


def inputs_bytes(layout, plan, stem: int = 0, stem_only: bool = False, last: bool = False) -> int:
    """The inputs of the decoder layers above the stem (and the last one's output) over every
    decoded chunk; `stem_only`: the stem's output alone; `last`: the last chunk is decoded too."""
    decoded = plan.chunks[-1].end if last else plan.chunks[-1].start
    arrays = 1 if stem_only else len(layout.kinds) - stem + 1
    return arrays * layout.hidden * decoded * layout.dtype.size


def what_fits(layout, cache_type: str) -> str:
    """What would need less memory, for a refusal: q8 only where the model's heads allow it."""
    offers = ["a shorter window", "a smaller chunk"]
    if cache_type != "q8" and kvstore.q8_fits(layout.head_dims):
        offers.append("an 8-bit cache (--cache-type q8)")
    return f"{', '.join(offers[:-1])} or {offers[-1]} would need less"


def admit(est: Estimate, budget_bytes: int | None, what: str) -> None:
    """Refuse, naming device memory and each part, when the walk's memory exceeds the budget;
    when the model alone does, no setting of the walk can help, and the refusal says so."""
    if budget_bytes is not None and est.weights + est.adapter > budget_bytes:
        raise OutOfMemory(
            f"device memory: the model's weights ({mib(est.weights)}) and the adapter with its "
            f"optimizer state ({mib(est.adapter)}) alone exceed the memory budget of "
            f"{mib(budget_bytes)}, before any window; a larger budget, or a smaller or quantized "
            "model, would be needed"
        )
    if budget_bytes is not None and est.total > budget_bytes:
        raise OutOfMemory(
            f"device memory: the walk needs {mib(est.total)} at least (weights "
            f"{mib(est.weights)}, adapter and optimizer {mib(est.adapter)}, K/V store "
            f"{mib(est.store)}, accumulators {mib(est.accumulators)}, checkpoints "
            f"{mib(est.checkpoints)}, one chunk's graph "
            + (mib(est.graph) if est.graph else "not counted")
            + (f", other arrays {mib(est.resident)}" if est.resident else "")
            + (f", kept layer inputs {mib(est.inputs)}" if est.inputs else "")
            + f") but the memory budget is {mib(budget_bytes)}; {what}"
        )


def live_peak(fn) -> int:
    """Peak memory `fn` adds, with MLX made to free as it goes (a memory limit it always exceeds,
    so its scheduler waits for each task): the live set, not what an eager scheduler reserves.
    Garbage is collected first: arrays held only by cycles (earlier walks' caches) freed during
    `fn` would lower the measured peak below `fn`'s own."""
    gc.collect()
    mx.eval()
    mx.clear_cache()
    # On CUDA a limit doesn't make MLX wait (its allocator only returns cached buffers): there
    # the peak is measured as the walk will run, the backend's late frees included.
    previous = mx.set_memory_limit(mx.get_memory_limit() if mx.cuda.is_available() else 1)
    try:
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        out = fn()
        mx.eval(out)
        return mx.get_peak_memory() - base
    finally:
        mx.set_memory_limit(previous)


__all__ = [
    "Activations",
    "Estimate",
    "MIB",
    "admit",
    "estimate",
    "graph_bytes",
    "live_peak",
    "what_fits",
]
