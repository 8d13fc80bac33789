"""How many MLX arrays with their own allocation an exact walk holds at its peak, part by part.

Metal caps the buffers a process holds at once (`mx.device_info()["resource_limit"]`, 499,000 on
the Macs mlx-lm's users report): past it an allocation fails whatever memory is free. The count
comes from the plan and the model's layout, like the memory estimate (budget.py), and holds for
the reverse pass's second chunk, where every part is at its most: the kept inputs of every
decoded chunk, the summed gradient beside the chunk's own, the state adjoints.

  weights       every frozen parameter array (a quantized linear holds weight, scales, biases)
  adapter       the trainable arrays; optimizer: Adam's two moments each, its step and rate
  gradients     the sum over chunks and the chunk's own
  store         K and V per attention layer, each one array over the window (q8: three each)
  accumulators  K and V per tapped attention layer; the state adjoints of the recurrent layers
                above the stem, those the chunk was given and those it sends back
  checkpoints   every recurrent layer's state arrays, at every chunk boundary the checkpoint
                schedule holds while the second chunk trains
  inputs        kept layer inputs: one array per decoded chunk (the stem's output), or one per
                trained layer and the last output
  graph         one chunk's graph: the recorded layer inputs and an upper bound on what the layer
                in flight allocates (every array its graph computes; views and donated buffers
                make the real count smaller), measured on the CPU's graph (tests/test_buffers.py)

An array that is a view (a slice) shares its base's buffer, so the count is an upper bound on the
buffers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from mlx.utils import tree_flatten

from ..plan import Plan

LIMIT = 499_000  # Metal's resource limit as MLX reports it (docs/MAC.md cites where)
ADAM = (2, 2)  # per trainable array, per optimizer: arrays (m, v) and scalars (step, rate)

# The arrays one layer's backward computes on the CPU's pure-MLX twins, by kind: a fixed part and
# a part per 64-position block of the chunk (the gated delta rule's blocks) or per 1,024-position
# tile of the prefix (attention); measured on a qwen3_5 hybrid at chunks of 256-2,048 and prefixes
# of 1-4 tiles, which they bound to within 1% (tests/test_buffers.py). The count depends on
# the ops, not the widths. The Metal kernels replace a twin's many ops with a few launches, so on
# a Mac these bound the graph from above.
RECURRENT = (1_085, 97)  # fixed, per block
ATTENTION = (550, 51)  # fixed, per tile


@dataclass(frozen=True)
class Buffers:
    weights: int = 0
    adapter: int = 0
    optimizer: int = 0
    gradients: int = 0
    store: int = 0
    accumulators: int = 0
    checkpoints: int = 0
    inputs: int = 0
    graph: int = 0

    @property
    def held(self) -> int:
        """Everything but the graph: what the walk's objects hold between evaluations."""
        return self.total - self.graph

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def line(self, limit: int = LIMIT) -> str:
        return f"buffers alive at the peak: {self.total:,} (Metal's limit ~{limit:,})"


def arrays(tree) -> int:
    """Arrays in a tree that hold memory (an empty one allocates nothing)."""
    return sum(1 for _, v in tree_flatten(tree) if v.size > 0)


def layer_bound(kind: str, chunk: int, prefix: int) -> int:
    """The arrays one layer's backward computes: "attention" or "recurrent"."""
    if kind == "attention":
        return ATTENTION[0] + ATTENTION[1] * math.ceil(prefix / 1024)
    return RECURRENT[0] + RECURRENT[1] * math.ceil(chunk / 64)


def graph_bound(layout, chunk: int, prefix: int, stem: int = 0) -> int:
    """One chunk's graph: the recorded inputs of the trained layers and the last output, and the
    larger layer graph of the kinds the trained layers have (one layer is evaluated at a time)."""
    kinds = set(layout.kinds[stem:])
    trained = len(layout.kinds) - stem
    return trained + 1 + max(layer_bound(k, chunk, prefix) for k in kinds)


def count(
    model,
    layout,
    plan: Plan,
    cache_type: str,
    stem: int = 0,
    keep: str = "off",
    optimizer: tuple[int, int] = ADAM,
    graph: int | None = None,
) -> Buffers:
    """The arrays an exact walk holds at its peak. `keep`: the walk's kept inputs ("all",
    "stem", "off"); `graph`: one chunk's graph if measured (else `graph_bound`)."""
    trainable = arrays(model.trainable_parameters())
    attention = len(layout.attention)
    tapped = sum(1 for i in layout.attention if i >= stem)
    states = [len(shapes) for shapes in layout.state_shapes]  # arrays per recurrent layer
    above = sum(n for i, n in zip(layout.recurrent, states) if i >= stem)
    # inputs kept at the second chunk: every chunk's but the last's (never decoded, or decoded
    # for its stem output and let go once trained)
    decoded = len(plan.chunks) - 1
    per_chunk = {"all": len(layout.kinds) - stem + 1, "stem": 1}.get(keep, 0)
    # the states held while the second chunk trains (the last's is let go), the schedule's count
    second = [c.index for c in plan.reverse()][:2]
    kept = plan.schedule.walk(second)[-1][2] if layout.recurrent else 0
    last = plan.chunks[-1]
    return Buffers(
        weights=arrays(model.parameters()) - trainable,
        adapter=trainable,
        optimizer=optimizer[0] * trainable + optimizer[1],
        gradients=2 * trainable if len(plan.chunks) > 1 else trainable,
        # (with the stem's output kept, the stem's K/V go after the decode: walk/exact.py)
        store=2 * (attention if keep == "off" else tapped) * (3 if cache_type == "q8" else 1),
        # the state adjoints entering the chunk and those it makes (the first chunk takes none)
        accumulators=2 * tapped + above * min(len(plan.chunks) - 1, 2),
        # (with the stem's output kept, the trained layers' states alone: walk/exact.py `to_hold`)
        checkpoints=kept * (above if keep in ("all", "stem") else sum(states)),
        inputs=per_chunk * decoded,
        graph=graph_bound(layout, plan.chunk, last.start, stem) if graph is None else graph,
    )
