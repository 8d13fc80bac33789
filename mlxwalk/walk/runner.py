"""What both walks do with a chunk: its caches (taps, prefix, state), its decode into the K/V
store, its graph; the dropout seed that makes a chunk draw the same masks wherever it runs."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import mlx.core as mx
from mlx import nn

from ..errors import ConfigError
from ..ops.attention import Prefix, tiled_attention
from ..ops.delta import fast_recurrence
from ..ops.products import dequantized_products
from ..plan import Chunk
from . import arch, choices, layerwise
from .accum import Accumulators
from .config import WalkConfig
from .guards import check_ids
from .loss import head_loss, weighted_loss
from .store import KVStore, check_cache_type
from .taps import ChunkKV, ChunkState, Layers, layers_of, release, walk_layers
from .window import Window

log = logging.getLogger("mlxwalk")

State = list[list[mx.array]] | None  # per recurrent layer, its state arrays


def dropout(model: nn.Module) -> float:
    """The largest dropout probability among the model's dropout layers (LoRA's), 0 if none."""
    return max(
        (1.0 - m._p_1 for _, m in model.named_modules() if isinstance(m, nn.Dropout)), default=0.0
    )


def window_arrays(window: Window, start: int, end: int) -> tuple[mx.array, mx.array, mx.array]:
    """Positions [start, end) of the window's inputs, targets and weights, each (1, end - start)."""
    return (
        mx.array(window.inputs[start:end])[None],
        mx.array(window.targets[start:end])[None],
        mx.array(window.weights[start:end])[None],
    )


def _zeros(shape: tuple[int, ...]) -> mx.array:
    """Zeros that hold no memory (a broadcast scalar): the taps' values are never read."""
    return mx.broadcast_to(mx.zeros((1,) * len(shape), mx.float32), shape)


@contextmanager
def walking(model: nn.Module, products: str = "auto", head: str = "dequantized") -> Iterator[None]:
    """The model as the walk runs it: taps through every layer, the chunked delta rule, a
    quantized base's products on its dequantized weights where that is faster (ops.products;
    an untied quantized head's too, held whole or sliced as `head` says)."""
    with (
        walk_layers(model),
        fast_recurrence(model),
        tiled_attention(model),
        dequantized_products(model, products, head),
    ):
        yield


class ChunkRunner:
    """What both walks do with a chunk: build its caches, decode it, run its graph."""

    def __init__(self, model: nn.Module, window: Window, config: WalkConfig, layout=None):
        self.model = model
        self.window = window
        self.asked = config.check()  # as given: "auto" marks what a memory budget may change
        self.layout = layout or arch.inspect(model)
        check_ids(window, self.layout.vocab)
        check_cache_type(self.asked.cache_type, self.layout.head_dims)
        self.config = choices.lossless(self.asked, choices.dtype_name(self.layout.dtype))
        self.head = arch.head(model)
        self.stem = arch.stem(model)  # the frozen layers the reverse pass never differentiates
        self.layers: Layers = layers_of(model, self.config.recompute, self.stem)
        self.store: KVStore | None = None
        self.seed = self._dropout_seed()
        self.on_chunk: Callable[[str, int, int], None] | None = None  # (phase, done, of)
        self.per_target = False  # a decode's loss per target column (api.target_scores)

    def _dropout_seed(self) -> int | None:
        """With dropout, the walk's seed: the configured one, or one drawn for this walk. Refuses
        recompute with dropout: a checkpointed layer would redraw its masks in the backward."""
        if not dropout(self.model):
            return self.config.seed
        if self.config.recompute:
            raise ConfigError(
                "recompute with LoRA dropout > 0 is refused: recomputing a layer would draw new "
                "dropout masks, and the gradient would not be the window's; use one or the other"
            )
        if self.config.seed is not None:
            return self.config.seed
        return int(mx.random.randint(0, 1 << 30, ()).item())

    def _seed(self, chunk: Chunk) -> None:
        """Dropout draws the same masks for a chunk wherever the chunk runs: in its decode, its
        graph and any re-decode from a checkpoint, so the surrogates pair equal K/V and states."""
        if self.seed is not None:
            mx.random.seed(self.seed * 1_000_003 + chunk.index)

    def new_store(self, positions: int) -> None:
        lay = self.layout
        self.store = KVStore(list(lay.kv_shapes), positions, self.config.cache_type, lay.dtype)

    def zero_state(self) -> State:
        lay = self.layout
        if not lay.recurrent:
            return None
        return [
            [mx.zeros(s, d) for s, d in zip(shapes, dtypes)]
            for shapes, dtypes in zip(lay.state_shapes, lay.state_dtypes)
        ]

    def caches(
        self,
        chunk: Chunk,
        entry: State,
        *,
        grad_from: int | None = None,  # None: the prefix is constant
        tap_state: bool = False,
        acc: Accumulators | None = None,
    ) -> list:
        """One cache per layer for `chunk`; taps on [grad_from, start) and, if asked, the state."""
        out, a, r, dtype = [], 0, 0, self.layout.dtype
        s = chunk.start
        for i, kind in enumerate(self.layout.kinds):
            graded = i >= self.stem  # below the stem's top nothing trains: no taps, no adjoint
            if kind == "attention":
                prefix = Prefix(self.store, a, s, dtype) if s > 0 else None
                taps = None
                if graded and grad_from is not None and grad_from < s:
                    h, dk, dv = self.layout.kv_shapes[a]
                    taps = (_zeros((1, h, s - grad_from, dk)), _zeros((1, h, s - grad_from, dv)))
                adjoint = acc.adjoint(a, s, chunk.end) if graded and acc is not None else None
                out.append(
                    ChunkKV(s, prefix, grad_from, taps, adjoint, self.config.attention, self.layers)
                )
                a += 1
            else:
                adjoint = None
                if graded and acc is not None and acc.state is not None:
                    adjoint = acc.state[r]
                tapped = graded and tap_state
                out.append(ChunkState(entry[r], tapped, adjoint, self.layers))
                r += 1
        return out

    def run_chunk(self, x, caches: list, y, w, scored: bool) -> mx.array:
        """The model over a chunk through its caches; the chunk's loss share if `scored` (its
        logits in blocks, see head_loss), else 0 and no logits at all."""
        total, per = self.window.total, self.per_target
        if self.head is None:
            logits = self.model(x, cache=caches)
            return weighted_loss(logits, y, w, total, per) if scored else mx.array(0.0)
        h = self.head.body(x, caches)
        return head_loss(self.head, h, y, w, total, per) if scored else mx.array(0.0)

    def graph_by_layer(self, chunk: Chunk, caches: list, sink=None):
        """`graph` with recompute, one layer at a time (see layerwise.gradient)."""
        x, y, w = window_arrays(self.window, chunk.start, chunk.end)
        self._seed(chunk)
        scored = chunk.labelled
        kept = self.kept_inputs(chunk)
        return layerwise.gradient(
            self.model,
            self.head,
            caches,
            x,
            y,
            w,
            self.window.total,
            scored,
            kept,
            sink,
            self.layers,
        )

    def kept_inputs(self, chunk: Chunk) -> list | None:
        """The chunk's layer inputs kept from its decode (ExactWalk), else None."""
        return None

    def decode(self, chunk: Chunk, entry: State, write: bool = True, losses: list | None = None):
        """Run `chunk` with no gradient; write its K/V to the store; return its exit state.
        With `losses`, the chunk's loss share is appended to it."""
        caches = self.caches(chunk, entry)
        x, y, w = window_arrays(self.window, chunk.start, chunk.end)
        self._seed(chunk)
        scored = losses is not None and chunk.labelled
        # On CUDA a layer at a time (freed buffers return only once the GPU has run the graph);
        # so too under a profile's clock, which times each layer
        eager = mx.cuda.is_available() or self.layers.clock is not None
        with self.layers.eager_layers() if eager else nullcontext():
            loss = self.run_chunk(x, caches, y, w, scored)  # the logits only if scored
        exit_state = [c.produced() for c in caches if isinstance(c, ChunkState)] or None
        kv = [c.produced() for c in caches if isinstance(c, ChunkKV)] if write else []
        if scored:
            losses.append(loss)
        # Evaluate before writing: the graph reads the store, and a store still referenced by a
        # pending read can't be updated in place (MLX would copy it, a window-sized copy).
        mx.eval(kv, exit_state, losses)
        release(caches)
        for a, (k, v) in enumerate(kv):
            self.store.write(a, chunk.start, k, v)
        mx.eval(self.store.arrays())
        return exit_state

    def graph(self, chunk: Chunk, caches: list, sink=None):
        """The chunk's loss share plus its surrogates, differentiated in the adapter and taps.
        With recompute, `sink` takes each layer's taps' gradient as it comes (layerwise.gradient);
        without, they all come back together, since the chunk is one graph."""
        if self.config.recompute and self.head is not None:
            return self.graph_by_layer(chunk, caches, sink)
        model = self.model
        x, y, w = window_arrays(self.window, chunk.start, chunk.end)
        self._seed(chunk)

        def objective(params, inputs):
            model.update(params)
            for c, i in zip(caches, inputs):
                c.bind(i)
            # A context chunk's logits stay out of the graph: it trains through its surrogate.
            loss = self.run_chunk(x, caches, y, w, chunk.labelled)
            return loss + sum(c.surrogate_value for c in caches), loss

        (_, loss), (g_params, g_inputs) = mx.value_and_grad(objective, argnums=(0, 1))(
            model.trainable_parameters(), [c.inputs() for c in caches]
        )
        return loss, g_params, g_inputs
