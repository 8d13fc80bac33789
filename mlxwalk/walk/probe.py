"""The memory probe: one chunk's graph measured on the model itself, at the run's chunk size,
since it depends on every layer's implementation. Three walks: a window of one chunk, then one
whose last chunk reads a prefix two attention tiles long, tapped whole and over one chunk only;
their peaks give the graph with no prefix and what each prefix position adds, tapped or not. Run
only under a memory budget (the exact walk's `admit`), cached per `probe_key`."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import numpy as np
from mlx.utils import tree_flatten

from ..ops.attention import TILE
from . import arch
from .budget import Activations

# a walk's peak over ids[:n] at a horizon (0 = whole), less nothing: (ids, n, horizon) -> bytes
Measure = Callable[[np.ndarray, int, int], int]

_probes: dict[tuple, tuple[weakref.ref, Activations]] = {}


def probe_key(model, chunk: int, recompute: bool, attention: str) -> tuple:
    """Everything that changes a probe's result: the model object, the chunk, recompute, the
    attention path, and the trainable parameters (which adapters, at which shapes and dtypes)."""
    trainable = tuple((k, tuple(v.shape), str(v.dtype))
                      for k, v in tree_flatten(model.trainable_parameters()))  # fmt: skip
    return id(model), chunk, recompute, attention, hash(trainable)


def cached(model, chunk: int, recompute: bool, attention: str, peak: Measure) -> Activations:
    """The probe for this key, measured with `peak` the first time (a probe belongs to the model
    object it measured: an id is reused once its model is gone)."""
    key = probe_key(model, chunk, recompute, attention)
    ref, acts = _probes.get(key, (None, None))
    if ref is None or ref() is not model:
        acts = measure(model, chunk, peak)
        _probes[key] = (weakref.ref(model), acts)
    return acts


def measure(model, chunk: int, peak: Measure) -> Activations:
    layout = arch.inspect(model)
    width = layout.footprint().kv_width * 4
    far = chunk * -(-2 * TILE // chunk)  # a prefix well past one attention tile
    ids = np.random.default_rng(0).integers(0, layout.vocab, chunk + far + 1)  # ids the model has

    def graph(n: int, horizon: int = 0) -> float:  # less the store and accumulators of n positions
        return peak(ids, n, horizon) - 2 * n * width

    one, whole, narrow = graph(chunk), graph(chunk + far), graph(chunk + far, chunk)
    tap = max(0.0, (whole - narrow) / ((far - chunk) * width)) if far > chunk else 0.0
    prefix = max(0.0, (narrow - one) / (far * width) - tap * chunk / far)
    if far == chunk:  # one chunk of prefix: taps and prefix can't be told apart
        tap, prefix = max(0.0, (whole - one) / (far * width)), 0.0
    return Activations(chunk, one, tap, prefix)
