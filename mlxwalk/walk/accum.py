"""The exact walk's accumulators for one window.

dL/d(cached K/V) for every attention layer and computed position (what later chunks send back to
the chunk that made those K/V), dL/d(recurrent state) at the boundary being crossed, and the
adapter's gradient summed over the chunks. Updated in place chunk by chunk: MLX reuses a buffer
for a slice update when the accumulator holds the only reference to it.
"""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_map

ACCUMULATOR_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16}


class Accumulators:
    def __init__(
        self,
        kv_shapes: list[tuple[int, int, int]],
        positions: int,
        dtype: str = "float32",
        tapped: list[bool] | None = None,  # per attention layer (None: all); the rest hold none
    ):
        self.dtype = ACCUMULATOR_DTYPES[dtype]
        tapped = tapped or [True] * len(kv_shapes)
        self.keys = [
            mx.zeros((1, h, positions if t else 0, dk), self.dtype)
            for (h, dk, _), t in zip(kv_shapes, tapped)
        ]
        self.values = [
            mx.zeros((1, h, positions if t else 0, dv), self.dtype)
            for (h, _, dv), t in zip(kv_shapes, tapped)
        ]
        self.state: list[list[mx.array]] | None = None  # per recurrent layer
        self.grads = None  # the adapter's gradient, summed over chunks
        mx.eval(self.keys, self.values)

    def adjoint(self, layer: int, start: int, end: int) -> tuple[mx.array, mx.array]:
        return self.keys[layer][..., start:end, :], self.values[layer][..., start:end, :]

    def add_kv(self, start: int, grads: list[tuple[mx.array, mx.array] | None]) -> None:
        """Add each attention layer's tap gradient (or None) at [start, start + its length).

        The sums are evaluated before they are written back: a slice update whose own graph
        still reads the accumulator can't reuse its buffer, and MLX would copy it whole."""
        sums = {}
        for layer, g in enumerate(grads):
            if g is not None:
                end = start + g[0].shape[2]
                sums[layer] = (
                    end,
                    self.keys[layer][..., start:end, :] + g[0].astype(self.dtype),
                    self.values[layer][..., start:end, :] + g[1].astype(self.dtype),
                )
        mx.eval(sums)
        for layer, (end, k, v) in sums.items():
            self.keys[layer][..., start:end, :] = k
            self.values[layer][..., start:end, :] = v
        del sums
        mx.eval(self.keys, self.values)

    def add_grads(self, grads) -> None:
        self.grads = grads if self.grads is None else tree_map(mx.add, self.grads, grads)

    def arrays(self) -> list:
        return [self.keys, self.values, self.state, self.grads]
