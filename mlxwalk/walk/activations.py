"""One chunk's graph in plain numbers: measured on the model at the run's chunk size
(`Activations`, by walk/probe.py on MLX, torch_backend/walk.py's probe on torch), and extrapolated
to any number of tapped and untapped prefix positions (`graph_bytes`). No array framework: both
backends' budgets read it."""

from __future__ import annotations

from dataclasses import dataclass

from ..plan import Footprint


@dataclass(frozen=True)
class Activations:
    """One chunk's graph, measured at the run's chunk size: with no prefix, and what each prefix
    position adds, tapped and untapped, in units of that position's K/V at float32. (Attention
    that is not tiled, such as MLX's unfused backward on CUDA at head dimension 256, holds chunk
    x prefix scores whether or not the prefix is tapped: a narrower horizon doesn't shrink it.)"""

    chunk: int
    graph: float
    tap_factor: float
    prefix_factor: float = 0.0

    def at(self, chunk: int) -> Activations:
        """An estimate of this graph at another chunk size: a chunk's activations (and an
        unfused attention's scores per prefix position) scale with its rows; a tapped
        position's gradient does not. The admission confirms it with a probe at that chunk."""
        r = chunk / self.chunk
        return Activations(chunk, self.graph * r, self.tap_factor, self.prefix_factor * r)


def graph_bytes(acts: Activations, footprint: Footprint, taps: int, prefix: int = 0) -> int:
    """One chunk's graph after `prefix` positions, `taps` of them tapped: linear in both (a tiled
    attention's tile is bounded; the taps' gradient and an unfused attention's scores are not)."""
    width = footprint.kv_width * 4
    return int(acts.graph + (acts.tap_factor * taps + acts.prefix_factor * prefix) * width)
