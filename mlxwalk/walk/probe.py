"""The memory probe: one chunk's graph measured on the model itself, at the run's chunk size, since
it depends on every layer's implementation. Three walks: a window of one chunk, then one whose last
chunk reads a prefix two attention tiles long (or as long as the run's longest, if shorter), tapped
whole and over one chunk only; their peaks give the graph with no prefix and what each prefix
position adds, tapped or not. A run whose chunks read no prefix takes the first walk only. Each walk
trains its last chunk only, the one that holds its largest graph, over a store allocated but not
decoded (`filled`, walk/algorithm.py): a prefix's length sizes the graph, not its values, so a probe
costs three chunks' training, not two whole-window decodes. Run only under a memory budget (the
exact walk's `admit`), cached per `probe_key`: a probe over a longer prefix serves every run that
reads a shorter one. The walks take the run's store type and kept inputs (a float32 store under a
bfloat16 model, for one, adds casts of the prefix to the graph that a bfloat16 store does not), and
what they hold besides the graph is subtracted as the estimate counts it apart."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..ops.attention import TILE
from . import arch
from .budget import Activations

# the graph of a walk over ids[:n] at a horizon (0 = whole): its peak less what the walk holds
# besides (its store, accumulators, checkpoints, kept inputs): (ids, n, horizon) -> bytes
Measure = Callable[[np.ndarray, int, int], int]

_probes: dict[tuple, tuple[weakref.ref, int, Activations]] = {}
# a decode run's own memory: (probe key, width) -> (model, prefix measured after, bytes)
_runs: dict[tuple, tuple[weakref.ref, int, int]] = {}


def kept_for(config) -> str:
    """The kept inputs a probe measures with: `auto` is measured as `on` (its first choice)."""
    return {"auto": "on"}.get(config.keep_inputs, config.keep_inputs) if config.recompute else "off"


def probe_key(model, config) -> tuple:
    """Everything that changes a probe's result: the model object, the chunk, recompute, the
    attention path, the store's type, the base's and the head's products, the decode's runs,
    kept inputs, and the trainable parameters (which adapters, at which shapes and dtypes)."""
    trainable = tuple(
        (k, tuple(v.shape), str(v.dtype)) for k, v in tree_flatten(model.trainable_parameters())
    )
    return (
        id(model),
        config.chunk,
        config.recompute,
        config.attention,
        config.cache_type,
        config.products,
        config.head_products,
        config.decode_run,
        kept_for(config),
        hash(trainable),
    )


LONG_SHARE = 1.0  # the share of the run's reach a long probe reads (0.5: half the prefix)


def prefix_for(chunk: int, reach: int, long: bool | None = None) -> int:
    """The prefix the probe's longer walks read: two attention tiles, rounded up to whole
    chunks, or the run's longest prefix `reach` (in whole chunks) when that is shorter. `long`
    (default: on CUDA) reads LONG_SHARE of the run's reach: there a chunk's peak grows faster
    with the prefix than a short prefix's slope says (the 27B-shaped hybrid: estimated 37.9 GiB
    from two tiles, peaked 50.45). Half the reach still under-read the 8B shape by 1.8-2.3 GiB
    (its chunks past 43K of prefix peak 2 GiB higher while what stays live between chunks is
    flat; which buffers is not measured); the whole reach reads it (estimate 23.40 GiB, peak
    23.37; docs/BENCHMARKS.md). Its walks then hold about what the run's last chunk does: where
    that would not fit the device, the probe fails first, and exact.probe refuses the window."""
    long = mx.cuda.is_available() if long is None else long
    far = chunk * -(-2 * TILE // chunk)
    if long:
        far = max(far, int(reach * LONG_SHARE))
    return min(far, reach) // chunk * chunk


def out_of_device_memory(error: RuntimeError) -> bool:
    """Whether MLX's error is a failed device allocation (CUDA's `cudaMalloc*`, Metal's
    resource limit), not a fault of the walk."""
    text = str(error).lower()
    return "out of memory" in text or "resource limit" in text or "malloc" in text


def forget() -> None:
    """Drop every cached probe (a benchmark that changes LONG_SHARE between its rows)."""
    _probes.clear()
    _runs.clear()


def run_cached(model, config, width: int, prefix: int, peak: Callable[[int, int], int]) -> int:
    """A decode run's own memory at `width` positions after `prefix`, measured with
    `peak(width, prefix)` the first time per probe key and width, or again where the cached one
    read a shorter prefix."""
    key = (*probe_key(model, config), width)
    ref, measured, nbytes = _runs.get(key, (None, -1, 0))
    if ref is None or ref() is not model or measured < prefix:
        nbytes = peak(width, prefix)
        _runs[key] = (weakref.ref(model), prefix, nbytes)
    return nbytes


def cached(model, config, reach: int, peak: Measure, echo=None) -> Activations:
    """The probe for this key, measured with `peak` the first time or when the cached one read a
    shorter prefix than this run reaches (a probe belongs to the model object it measured: an id
    is reused once its model is gone). `echo` hears each walk as it starts."""
    key = probe_key(model, config)
    far = prefix_for(config.chunk, reach)
    ref, measured, acts = _probes.get(key, (None, -1, None))
    if ref is None or ref() is not model or measured < far:
        acts = measure(model, config.chunk, far, peak, echo)
        _probes[key] = (weakref.ref(model), far, acts)
    return acts


def measure(model, chunk: int, far: int, peak: Measure, echo=None) -> Activations:
    layout = arch.inspect(model)
    width = layout.footprint().kv_width * 4
    ids = np.random.default_rng(0).integers(0, layout.vocab, chunk + far + 1)  # ids the model has
    walks = [(chunk, 0)] + ([(chunk + far, 0), (chunk + far, chunk)] if far else [])

    def graph(i: int) -> float:
        n, horizon = walks[i]
        if echo is not None:
            echo(f"  measuring one chunk's graph: walk {i + 1} of {len(walks)}, {n:,} positions")
        return peak(ids, n, horizon)

    one = graph(0)
    if not far:  # no chunk of the run reads a prefix
        return Activations(chunk, one, 0.0, 0.0)
    whole, narrow = graph(1), graph(2)
    tap = max(0.0, (whole - narrow) / ((far - chunk) * width)) if far > chunk else 0.0
    prefix = max(0.0, (narrow - one) / (far * width) - tap * chunk / far)
    if far == chunk:  # one chunk of prefix: taps and prefix can't be told apart
        tap, prefix = max(0.0, (whole - one) / (far * width)), 0.0
    return Activations(chunk, one, tap, prefix)
