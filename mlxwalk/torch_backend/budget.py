"""The torch walk's GPU memory, estimated before a window's tensors exist, and its placement.

The memory budget counts what torch's CUDA allocator holds while a window trains (its
`max_memory_allocated`): the weights, the adapter with its gradient and Adam's two moments, the
recurrent checkpoints, one chunk's graph, and the K/V store and accumulators while they are on
the GPU. One chunk's graph is measured on the model (`fit`, from the peaks of four walks of its
own, as torch's allocator counts them); the rest is computed from the plan.

Under a budget the walk places its parts: everything on the GPU when the whole horizon fits
there; else the accumulators in pinned host memory; else the store too. When even that does not
fit the whole horizon, late chunks narrow theirs (the walk says so); a walk that would not fit
with one chunk of taps is refused before any tensor of the window.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..plan import OutOfMemory, Plan, memory_lines, mib, model_rows
from ..walk.activations import Activations, graph_bytes

# (store, accumulators), least host memory first
PLACEMENTS = (("device", "device"), ("device", "host"), ("host", "host"))


@dataclass(frozen=True)
class Estimate:
    weights: int
    adapter: int  # trainable parameters, their gradient and Adam's two moments
    store: int
    accumulators: int
    checkpoints: int
    graph: int
    taps: int = 0  # the last chunk's tapped K/V, copied up into its graph from a host store
    resident: int = 0  # what else the allocator holds when the walk starts
    store_at: str = "device"
    accumulators_at: str = "device"

    @property
    def chunk_graph(self) -> int:
        """One chunk's graph as placed: a store on the device lends its taps in place."""
        return self.graph + (self.taps if self.store_at == "host" else 0)

    @property
    def gpu(self) -> int:
        on_gpu = self.weights + self.adapter + self.resident + self.checkpoints + self.chunk_graph
        if self.store_at == "device":
            on_gpu += self.store
        if self.accumulators_at == "device":
            on_gpu += self.accumulators
        return on_gpu

    @property
    def host(self) -> int:
        return (self.store if self.store_at == "host" else 0) + (
            self.accumulators if self.accumulators_at == "host" else 0
        )

    def lines(self) -> list[str]:
        rows = [
            *model_rows(self, "other tensors"),
            ("graph", self.chunk_graph, "the last chunk's"),
            ("K/V store", self.store, self.store_at),
            ("K/V accumulators", self.accumulators, self.accumulators_at),
            ("recurrent checkpoints", self.checkpoints, "device"),
            ("GPU total", self.gpu, ""),
            ("pinned host total", self.host, ""),
        ]
        return memory_lines(rows, 21)


def fit(chunk: int, width: int, graph) -> Activations:
    """One chunk's graph from four walks' (`graph(n, horizon)`: a walk's peak less what it
    holds beside its graph; `width`: bytes of one position's K/V at float32): one chunk alone,
    and a last chunk with one or two chunks of prefix, all tapped or one chunk tapped. A chunk
    with any prefix costs more than the first chunk by a step (its attention and surrogate
    paths) that a line through the first chunk would spread over the taps; so the line is
    fitted through the chunks with a prefix, and never below the first chunk's graph."""
    one = graph(chunk, 0)
    a, b, c = graph(2 * chunk, 0), graph(3 * chunk, 0), graph(3 * chunk, chunk)
    unit = chunk * width
    tap = max(0.0, (b - c) / unit)
    prefix = max(0.0, (c - a) / unit)
    return Activations(chunk, max(one, a - (tap + prefix) * unit), tap, prefix)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def estimate(
    model, plan: Plan, acts: Activations, store_element: int, resident: int = 0
) -> Estimate:
    """The walk's memory for `plan` at its last chunk (the one with the most taps), on the GPU."""
    from .model import footprint

    params = list(model.parameters())
    trainable = tensor_bytes(p for p in params if p.requires_grad)
    foot = footprint(model)
    last = plan.chunks[-1]
    taps = last.start - last.grad_from
    return Estimate(
        weights=tensor_bytes(params) - trainable,
        adapter=4 * trainable,
        store=plan.computed * foot.kv_width * store_element,
        accumulators=plan.accumulator_bytes,
        checkpoints=plan.checkpoint_bytes,
        graph=graph_bytes(acts, foot, taps, last.start),
        taps=taps * foot.kv_width * store_element,
        resident=resident,
    )


def place(est: Estimate, least: Estimate, budget: int, first: tuple[str, str]) -> Estimate:
    """The placement that fits the whole horizon with the least in host memory, from `first`
    on; else everything placeable on the host, if one chunk of taps fits it (`least`: the
    estimate then); else a refusal naming each part."""
    options = [replace(est, store_at=s, accumulators_at=a) for s, a in PLACEMENTS]
    options = options[PLACEMENTS.index(first) :]
    for option in options:
        if option.gpu <= budget:
            return option
    least = replace(least, store_at=options[-1].store_at, accumulators_at="host")
    if least.gpu <= budget:
        return options[-1]
    raise OutOfMemory(
        f"GPU memory: the walk needs {mib(least.gpu)} at least (weights {mib(least.weights)}, "
        f"adapter and optimizer {mib(least.adapter)}, checkpoints {mib(least.checkpoints)}, one "
        f"chunk's graph {mib(least.chunk_graph)}"
        + (f", other tensors {mib(least.resident)}" if least.resident else "")
        + f"; the K/V store and accumulators in host memory) but the memory budget is "
        f"{mib(budget)}; a shorter window or a smaller chunk would need less"
    )


__all__ = ["Estimate", "PLACEMENTS", "estimate", "fit", "place"]
