"""The caches a chunk's graph runs through: the training graph is the serving graph.

mlx-lm models read and write their attention K/V through `cache.update_and_fetch` and their
recurrent state through an `ArraysCache`. A chunk of the walk hands each layer a cache object that
looks like those, but whose prefix (K/V of earlier positions, or the state entering the chunk) is a
differentiable input, a tap, and which records what the chunk itself produces (its K/V, its exit
state) so the chunk's objective can add the surrogate <produced, adjoint> for the later chunks.

`walk_layers` wraps each decoder layer for the duration of a walk so that the taps enter the layer
as explicit inputs: that is what lets `mx.checkpoint` (recompute) carry their gradient, since a
checkpointed function treats arrays it closes over as constants. How the wrapped layer runs is
the walk's `Layers`, which every cache carries: within `Layers.recording` (layerwise.py) it runs
with no gradient and keeps what it needs to run it again alone; within `keeping` (the decode) it
keeps its input; within `replaying` it hands back a kept input instead of running.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import mlx.core as mx
from mlx import nn
from mlx_lm.models.cache import create_attention_mask

from ..ops.attention import Prefix

# Layers evaluated one in flight while the next is built (Layers.timed); False: each waited for
# (scripts/bench-budget.py --pipeline compares the two in one process)
PIPELINE = True


def inner(a: mx.array, b: mx.array) -> mx.array:
    """<a, b> in float32."""
    return (a.astype(mx.float32) * b.astype(mx.float32)).sum()


class ChunkKV:
    """An attention layer's cache for one chunk starting at `offset`.

    `prefix` reads the cached K/V of [0, offset) from the store. `taps`, when given, are zero
    deltas on [grad_from, offset): the chunk's graph is differentiated in them, which is
    differentiating in the cached K/V they stand on. `adjoint` is dL/d(this chunk's K/V) from
    later chunks. `attention` names the path the model's attention call takes (ops.attention's
    `_attend`): `chunk_attention` reads the prefix in place, tile by tile or in a kernel; mlx-lm's
    fused path gets the concatenation from `update_and_fetch` (built lazily, so the other path
    never computes it).
    """

    def __init__(
        self,
        offset: int,
        prefix: Prefix | None = None,
        grad_from: int | None = None,
        taps: tuple[mx.array, mx.array] | None = None,
        adjoint: tuple[mx.array, mx.array] | None = None,
        attention: str = "tiled",
        layers: Layers | None = None,
    ):
        self.offset = offset
        self.prefix = prefix
        self.grad_from = offset if grad_from is None else grad_from
        self.taps = taps
        self.adjoint = adjoint
        self.attention = attention
        self.layers = layers or Layers()  # how the layer reading this cache runs
        self.keys: mx.array | None = None  # the chunk's own K/V, once the layer ran
        self.values: mx.array | None = None
        self.surrogate_value: mx.array = mx.array(0.0)

    def inputs(self) -> list[mx.array]:
        return list(self.taps) if self.taps is not None else []

    def bind(self, inputs: list[mx.array]) -> None:
        if inputs:
            self.taps = (inputs[0], inputs[1])

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys, self.values = keys, values
        if self.prefix is None:
            return keys, values
        pk, pv = self.prefix.read(0, self.offset)
        if self.taps is not None:
            gf = self.grad_from
            pk = mx.concatenate([pk[..., :gf, :], pk[..., gf:, :] + self.taps[0]], axis=2)
            pv = mx.concatenate([pv[..., :gf, :], pv[..., gf:, :] + self.taps[1]], axis=2)
        return (
            mx.concatenate([pk.astype(keys.dtype), keys], axis=2),
            mx.concatenate([pv.astype(values.dtype), values], axis=2),
        )

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        return create_attention_mask(n, self.offset, return_array, window_size)

    def surrogate(self) -> mx.array:
        if self.adjoint is None:
            return mx.array(0.0)
        return inner(self.keys, self.adjoint[0]) + inner(self.values, self.adjoint[1])

    def produced(self) -> tuple[mx.array, mx.array]:
        return self.keys, self.values


class ChunkState:
    """A recurrent layer's cache for one chunk, shaped like mlx-lm's ArraysCache.

    `entry` is the state entering the chunk (a tap when `tapped`); after the layer runs, the
    cache holds the chunk's exit state, and `adjoint` is dL/d(exit state) from the next chunk.
    `entry` None: a stem layer's state that the reverse pass never reads (the stem's output is
    kept), so its layer never runs on this cache.
    """

    lengths = None
    left_padding = None

    def __init__(
        self,
        entry: list[mx.array],
        tapped: bool = False,
        adjoint: list[mx.array] | None = None,
        layers: Layers | None = None,
    ):
        self.layers = layers or Layers()  # how the layer reading this cache runs
        self.entry = None if entry is None else list(entry)
        self.cache = self.entry and list(self.entry)
        self.tapped = tapped
        self.adjoint = adjoint
        self.surrogate_value: mx.array = mx.array(0.0)

    def __getitem__(self, i: int) -> mx.array:
        return self.cache[i]

    def __setitem__(self, i: int, value: mx.array) -> None:
        self.cache[i] = value

    def inputs(self) -> list[mx.array]:
        return list(self.entry) if self.tapped else []

    def bind(self, inputs: list[mx.array]) -> None:
        # Every call starts from the entry state: a recomputed layer must not see its own exit.
        if inputs:
            self.entry = list(inputs)
        self.cache = self.entry and list(self.entry)

    def advance(self, n: int) -> None:
        pass

    def make_mask(self, n: int):
        return None

    def surrogate(self) -> mx.array:
        if self.adjoint is None:
            return mx.array(0.0)
        return sum((inner(s, g) for s, g in zip(self.cache, self.adjoint)), mx.array(0.0))

    def produced(self) -> list[mx.array] | None:
        return self.cache and list(self.cache)


ChunkCache = (ChunkKV, ChunkState)


def release(caches: list) -> None:
    """Drop every array a chunk's caches hold. Arrays traced under `mx.grad` keep the traced
    function, and through it these caches, alive from C++, where Python's collector can't see
    the cycle: without this a window's caches (and the K/V store they read) outlive it."""
    for cache in caches:
        cache.__dict__.clear()


def _find_cache(args: tuple, kwargs: dict):
    for a in (*args, *kwargs.values()):
        if isinstance(a, ChunkCache):
            return a
    return None


@dataclass
class LayerCall:
    """One decoder layer's call in a recorded forward: enough to run it again on its own."""

    layer: nn.Module
    call: Callable
    x: mx.array
    out: mx.array | None
    args: tuple
    kwargs: dict
    cache: ChunkKV | ChunkState

    def forward(self) -> mx.array:
        """The layer on `x`, through its cache, as it was called."""
        return self.call(self.layer, self.x, *self.args, **self.kwargs)

    def objective(self, params: dict, x: mx.array, taps: list, dy: mx.array) -> mx.array:
        """<the layer's output, dy> + its surrogate: differentiated, the layer's VJP at dy."""
        self.layer.update(params)
        self.cache.bind(taps)
        y = self.call(self.layer, x, *self.args, **self.kwargs)
        return inner(y, dy) + self.cache.surrogate()


# How a wrapped decoder layer runs under one of the walk's caches: one object per mode, the one
# its `Layers` holds for the block it is in (`Layers.mode`). `frozen`: a stem layer, run but
# never differentiated, kept or recorded.


class Direct:
    """In the chunk's graph, its taps bound (no recompute, or a decode)."""

    def run(self, layers: Layers, c: LayerCall, frozen: bool) -> mx.array:
        y = c.forward()
        c.cache.surrogate_value = c.cache.surrogate()
        return y

    def eager(self) -> Mode:
        return Eager()


class Checkpointed(Direct):
    """In the chunk's graph, recomputed in the backward (mx.checkpoint): the taps enter as
    explicit inputs, since a checkpointed function treats arrays it closes over as constants."""

    def run(self, layers: Layers, c: LayerCall, frozen: bool) -> mx.array:
        def layer(params, x, taps):
            c.layer.update(params)
            c.cache.bind(taps)
            return c.call(c.layer, x, *c.args, **c.kwargs), c.cache.surrogate()

        y, c.cache.surrogate_value = mx.checkpoint(layer)(
            c.layer.trainable_parameters(), c.x, c.cache.inputs()
        )
        return y


class Eager(Direct):
    """No gradient (a decode), each layer's output evaluated as it is made: one layer's graph at
    a time."""

    def run(self, layers: Layers, c: LayerCall, frozen: bool) -> mx.array:
        y = c.forward()
        layers.timed("decode", c.cache, y)
        return y


@dataclass
class Recording(Direct):
    """Each layer run with no gradient, evaluated (its graph freed before the next is built) and
    recorded; with `stem_output`, the stem's layers don't run and the first trained one reads it."""

    recorded: list[LayerCall]
    stem_output: mx.array | None = None

    def run(self, layers: Layers, c: LayerCall, frozen: bool) -> mx.array:
        if frozen and self.stem_output is not None:
            return self.stem_output
        c.out = c.forward()
        layers.timed("stem" if frozen else "forward", c.cache, [c.x, c.out])
        if not frozen:
            self.recorded.append(c)
        return c.out


@dataclass
class Replaying(Direct):
    """As Recording, with no layer run: each call recorded with its kept input, returning the next
    layer's (the body's other work, its masks, is cheap)."""

    recorded: list[LayerCall]
    kept: list

    def run(self, layers: Layers, c: LayerCall, frozen: bool) -> mx.array:
        c.x, c.out = self.kept[0], self.kept[1]
        del self.kept[0]
        if not frozen:
            self.recorded.append(c)
        return c.out

    def eager(self) -> Mode:
        return self  # nothing runs to evaluate


@dataclass
class Resuming(Direct):
    """A re-decode from the stem's kept output: the stem's layers don't run (their states are
    never read again) and the trained layers run as `then` says."""

    stem_output: mx.array
    then: Direct = field(default_factory=Direct)

    def run(self, layers: Layers, c: LayerCall, frozen: bool) -> mx.array:
        if frozen:
            return self.stem_output
        return self.then.run(layers, c, frozen)

    def eager(self) -> Mode:
        return replace(self, then=Eager())


@dataclass
class Keeping:
    """A decode that keeps each layer's input, and the last layer's output after them, while
    `then` runs the layer (never checkpointed: the decode has no gradient); `stem_only`: the
    stem's output alone (the first trained layer's input)."""

    kept: list
    stem_only: bool = False
    then: Direct = field(default_factory=Direct)

    def run(self, layers: Layers, c: LayerCall, frozen: bool) -> mx.array:
        if self.stem_only:
            if not frozen and not self.kept:
                self.kept.append(c.x)
            return self.then.run(layers, c, frozen)
        # (the previous layer's output, when it is this one's input)
        self.kept[-1:] = [None if frozen else c.x]
        y = self.then.run(layers, c, frozen)
        self.kept.append(y)
        return y

    def eager(self) -> Mode:
        return replace(self, then=Eager())


Mode = Direct | Keeping


@dataclass
class Layers:
    """How a walk's decoder layers run: one object per walk, carried by every cache the walk
    builds (`cache.layers`), where each layer's call reads it. Its mode holds for a block (the
    context managers below) and no longer."""

    stem: frozenset[int] = frozenset()  # ids of the frozen layers beneath every trainable one
    recompute: bool = False  # activation checkpointing of each layer (mx.checkpoint)
    clock: Callable[[str, float], None] | None = None  # (what, seconds) per evaluated layer
    pending: list | None = None  # the layer whose evaluation is in flight (see `timed`)
    mode: Mode | None = None  # None: the walk's own, Direct or Checkpointed

    def __post_init__(self):
        if self.mode is None:
            self.mode = Checkpointed() if self.recompute else Direct()

    def timed(self, what: str, cache, arrays) -> None:
        """Evaluate `arrays`, a layer's: the layer before is waited for, this one is started and
        not waited for, so the next layer's graph is built while this one runs (the two are
        never both in flight: a layer's buffers are allocated once the one before is done).
        With a clock, each layer is waited for, and the clock told its seconds under `what` and
        the layer's kind (a profile: scripts/bench-budget.py --profile)."""
        self.settle()
        if self.clock is None:
            if PIPELINE:
                mx.async_eval(arrays)
                self.pending = arrays
            else:
                mx.eval(arrays)
            return
        t = time.perf_counter()
        mx.eval(arrays)
        kind = "attention" if isinstance(cache, ChunkKV) else "recurrent"
        self.clock(f"{what} {kind}", time.perf_counter() - t)

    def settle(self) -> None:
        """Wait for the layer in flight, if any."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            mx.eval(pending)

    @contextmanager
    def _use(self, mode: Mode) -> Iterator[Mode]:
        previous, self.mode = self.mode, mode
        try:
            yield mode
        finally:
            self.settle()  # nothing of the block's layers is left in flight
            self.mode = previous

    def eager_layers(self):
        """Within the block (no gradient), each layer's output is evaluated as it is made."""
        return self._use(self.mode.eager())

    @contextmanager
    def recording(self, stem_output: mx.array | None = None) -> Iterator[list[LayerCall]]:
        """Within the block, each layer's call is run with no gradient, evaluated, and recorded;
        with `stem_output`, the stem's layers don't run and the first trained layer reads it."""
        with self._use(Recording([], stem_output)) as mode:
            yield mode.recorded

    @contextmanager
    def keeping(self, stem_only: bool = False) -> Iterator[list]:
        """Within the block (a decode), each layer's input is kept, and the last layer's output
        after them: the list the reverse pass replays. `stem_only`: the stem's output alone."""
        with self._use(Keeping([], stem_only)) as mode:
            yield mode.kept

    def resuming(self, stem_output: mx.array):
        """Within the block (a re-decode), the stem's layers don't run: the first trained layer
        reads `stem_output`, the stem's output kept from the decode."""
        return self._use(Resuming(stem_output))

    @contextmanager
    def replaying(self, kept: list) -> Iterator[list[LayerCall]]:
        """As `recording`, with no layer run: each layer's call is recorded with its kept input
        and returns the next layer's (the body's other work, its masks, is cheap)."""
        with self._use(Replaying([], list(kept))) as mode:
            yield mode.recorded


_walk_classes: dict[type, type] = {}


def own_call(base: type):
    """The class's `__call__` from beneath mlx-lm's `grad_checkpoint` patches, if any: that patch
    replaces it with a `checkpointed_fn` closing over the call it replaced."""
    call = base.__call__
    while getattr(call, "__qualname__", "") == "grad_checkpoint.<locals>.checkpointed_fn":
        inner = [c.cell_contents for c in call.__closure__ or () if callable(c.cell_contents)]
        if len(inner) != 1:
            raise RuntimeError(
                f"{base.__name__}.__call__ is patched by mlx-lm's grad_checkpoint in a way the "
                "walk can't undo; the taps' gradient would be lost"
            )
        call = inner[0]
    return call


def _walk_class(base: type) -> type:
    """A subclass of a decoder layer whose call takes the layer's taps as explicit inputs and
    runs as its cache's `Layers` say (their mode)."""
    if base in _walk_classes:
        return _walk_classes[base]

    # The layer's own call, taken once: a patch of the class (mlx-lm's grad_checkpoint, which
    # would close over the taps as constants and lose their gradient) must not reach the walk.
    call = own_call(base)

    def __call__(self, x, *args, **kwargs):
        cache = _find_cache(args, kwargs)
        if cache is None:
            return call(self, x, *args, **kwargs)
        layers = cache.layers
        c = LayerCall(self, call, x, None, args, kwargs, cache)
        return layers.mode.run(layers, c, id(self) in layers.stem)

    cls = type(f"Walk{base.__name__}", (base,), {"__call__": __call__})
    _walk_classes[base] = cls
    return cls


@contextmanager
def walk_layers(model: nn.Module) -> Iterator[None]:
    """Within the block, the model's decoder layers take their taps as inputs (see module doc)
    and run as their caches' `Layers` say."""
    layers = list(model.layers)
    bases = [layer.__class__ for layer in layers]
    try:
        for layer, base in zip(layers, bases):
            layer.__class__ = _walk_class(base)
        yield
    finally:
        for layer, base in zip(layers, bases):
            layer.__class__ = base


def layers_of(model: nn.Module, recompute: bool = False, stem: int = 0) -> Layers:
    """A walk's `Layers` for `model`: the first `stem` decoder layers (arch.stem) are run but
    never recorded or kept."""
    frozen = frozenset(id(layer) for layer in list(model.layers)[:stem])
    return Layers(stem=frozen, recompute=recompute)
