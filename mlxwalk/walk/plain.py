"""The plain walk: chunk by chunk, the prefix as constants, the chunk's loss only; with a step per
chunk, the chunk is then re-decoded under the new adapter so later chunks read what it now
produces."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from ..plan import cut
from .guards import check_finite
from .runner import ChunkRunner, walking
from .taps import release


class PlainWalk(ChunkRunner):
    """Chunk by chunk; the gradient stops at every chunk boundary."""

    def run(self, step: Callable[[dict], None] | None = None) -> tuple[mx.array, dict]:
        """With `step`, one optimizer step per labelled chunk; the result's gradient is the sum of
        the chunks' gradients, each taken at the adapter that chunk saw."""
        chunks = cut(self.window.labels, self.config.chunk, self.config.follow_runs)
        loss, grads = mx.array(0.0), None
        with walking(self.model, self.config.products, self.config.head_products != "quantized"):
            self._new_store(chunks[-1].end)
            state = self.zero_state()
            for chunk in chunks:
                if chunk.labelled:
                    caches = self.caches(chunk, state)
                    chunk_loss, g, _ = self.graph(chunk, caches)
                    mx.eval(chunk_loss, g)
                    release(caches)
                    if step is not None:
                        check_finite(chunk_loss, g, f"chunk {chunk.index + 1}'s ")
                        step(g)
                    loss = loss + chunk_loss
                    grads = g if grads is None else _tree_add(grads, g)
                if chunk is not chunks[-1]:  # no later chunk reads the last one's K/V
                    state = self.decode(chunk, state)
                self._tick("train", chunk.index + 1, len(chunks))
        return loss, grads


def _tree_add(a, b):
    from mlx.utils import tree_map

    return tree_map(mx.add, a, b)
