"""The plain walk over one window on MLX: the algorithm is algorithm.py's `PlainAlgorithm`
(chunk by chunk, the prefix as constants, the chunk's loss only; with a step per chunk, the chunk
then re-decoded under the new adapter); here are its MLX mechanics."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx.utils import tree_map

from ..plan import Chunk
from .algorithm import PlainAlgorithm
from .guards import check_finite
from .runner import ChunkRunner, State, walking
from .taps import release


class PlainWalk(ChunkRunner, PlainAlgorithm):
    """Chunk by chunk; the gradient stops at every chunk boundary. Built as ExactWalk is
    (model, window, config, layout), with no memory budget's admission."""

    grads: dict | None = None  # the chunks' gradients, summed

    def run(self, step: Callable[[dict], None] | None = None) -> tuple[mx.array, dict]:
        """The window's loss and the sum of its chunks' gradients.

        Args:
            step: called with each labelled chunk's gradient (one optimizer step per chunk);
                None: the adapter stays as it is.

        Returns:
            (loss, grads): sum(w * CE) / sum(w), a scalar array (float32), and the sum of the
            chunks' gradients, each taken at the adapter that chunk saw, a tree shaped as
            `model.trainable_parameters()`.
        """
        self.grads = None
        return self.walk(step)

    def walking(self):
        head = self.config.head_products
        return walking(self.model, self.config.products, "dequantized" if head == "auto" else head)

    def train_plain(self, chunk: Chunk, state: State, step) -> mx.array:
        caches = self.caches(chunk, state)
        loss, g, _ = self.graph(chunk, caches)
        mx.eval(loss, g)
        release(caches)
        if step is not None:
            check_finite(loss, g, f"chunk {chunk.index + 1}'s ")
            step(g)
        self.grads = g if self.grads is None else tree_map(mx.add, self.grads, g)
        return loss

    def finish_plain(self, loss) -> tuple[mx.array, dict]:
        return (mx.array(0.0) if loss is None else loss), self.grads
