"""A walk's settings and its window: plain values, checked before any array of the window."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from functools import cached_property

import mlx.core as mx
import numpy as np

from ..errors import ConfigError, DataError
from ..ops.products import HEAD_PRODUCTS, PRODUCTS
from ..plan import MIB, Labels
from .accum import ACCUMULATOR_DTYPES
from .store import check_cache_type

WALKS = ("exact", "plain", "one-graph")
ATTENTIONS = ("auto", "tiled", "fused")
KEEP_INPUTS = ("auto", "on", "stem", "off")
DECODE_RUN = 8192  # positions (the 8B-shaped decode at 65,536: 5.7 -> 4.5 s on the H200)


@dataclass
class WalkConfig:
    chunk: int
    horizon: int = 0  # 0 = the whole window
    cache_type: str = "float32"
    recompute: bool = False  # activation checkpointing inside each chunk's graph
    host_budget_mib: float | None = None
    memory_budget_mib: float | None = None  # all MLX holds while a window trains (budget.py)
    seed: int | None = None  # seeds dropout per chunk, identically in the decode and the graph
    # chunks never cross a change of weight (plan.cut); off, as both front ends train, by default
    follow_runs: bool = False
    accumulator_dtype: str = "float32"
    attention: str = "auto"  # "tiled" (chunk_attention), "fused" (mlx-lm's); auto: ops.attention
    strict_exact: bool = False  # refuse a window the memory budget would narrow the horizon of
    # with recompute: each layer's input, kept from the decode, replaces the recorded forward of
    # the reverse pass (layerwise.py); auto: when they fit the memory budget (or there is none),
    # else the frozen stem's output alone ("stem": no stem layer runs in the reverse pass)
    keep_inputs: str = "auto"
    # a quantized base's decoder products: "dequantized" (dequantize, then multiply: faster at a
    # chunk's rows on CUDA and the CPU), "quantized" (MLX's quantized product); auto: by backend
    products: str = "auto"
    # an untied quantized lm head's products, when `products` dequantizes: "dequantized" (the
    # head dequantized once per chunk and held through its loss, ops.products), "quantized";
    # auto: dequantized unless a memory budget would not hold it
    head_products: str = "auto"
    # positions the exact walk's decode runs through the model at once, in whole chunks (at least
    # one): larger products for the same store and states. None: DECODE_RUN on CUDA at half
    # precision, where the decode evaluates a layer at a time and attention is fused (a run's
    # graph is one layer's at the run's width), else one chunk at a time
    decode_run: int | None = None

    def check(self) -> WalkConfig:
        for name in ("chunk", "horizon", "decode_run"):
            value = getattr(self, name)
            if not (value is None and name == "decode_run") and not _integer(value):
                raise ConfigError(f"{name} must be an integer, got {value!r}")
        for name in ("host_budget_mib", "memory_budget_mib"):
            value = getattr(self, name)
            if value is not None and not (_real(value) and math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a positive, finite number, got {value!r}")
        if self.chunk < 1:
            raise ConfigError(f"chunk must be at least 1, got {self.chunk}")
        if self.horizon < 0:
            raise ConfigError(
                f"horizon must be 0 (the whole window) or positive, got {self.horizon}"
            )
        check_cache_type(self.cache_type)
        if self.attention not in ATTENTIONS:
            raise ConfigError(
                f"attention {self.attention!r} is unknown; choose one of {', '.join(ATTENTIONS)}"
            )
        if self.keep_inputs not in KEEP_INPUTS:
            raise ConfigError(
                f"keep-inputs {self.keep_inputs!r} is unknown; choose one of "
                f"{', '.join(KEEP_INPUTS)}"
            )
        if self.keep_inputs == "on" and not self.recompute:
            raise ConfigError(
                "--keep-inputs on: kept layer inputs serve --recompute's reverse "
                "pass; give --recompute too"
            )
        if self.decode_run is not None and self.decode_run < 0:
            raise ConfigError(f"decode run must be 0 or positive, got {self.decode_run}")
        if self.products not in PRODUCTS:
            raise ConfigError(
                f"products {self.products!r} is unknown; choose one of {', '.join(PRODUCTS)}"
            )
        if self.head_products not in HEAD_PRODUCTS:
            raise ConfigError(
                f"head products {self.head_products!r} is unknown; choose one of "
                f"{', '.join(HEAD_PRODUCTS)}"
            )
        if self.accumulator_dtype not in ACCUMULATOR_DTYPES:
            raise ConfigError(
                f"accumulator dtype {self.accumulator_dtype!r} is unknown; "
                f"choose one of {', '.join(ACCUMULATOR_DTYPES)}"
            )
        return self

    @property
    def host_budget(self) -> int | None:
        return None if self.host_budget_mib is None else int(self.host_budget_mib * MIB)

    @property
    def device_budget(self) -> int | None:
        return None if self.memory_budget_mib is None else int(self.memory_budget_mib * MIB)


@dataclass(frozen=True)
class Window:
    inputs: np.ndarray  # int, length n
    targets: np.ndarray  # int, length n
    weights: np.ndarray  # float, length n; 0 = context

    @classmethod
    def of(cls, inputs, targets, weights) -> Window:
        """One window from three sequences of equal length (or rows of one), refusing what the
        walk would get wrong: ids that are not integers or not int32, a batch of several rows,
        negative or non-finite weights, nothing labelled."""
        x, y = _ids("input", inputs), _ids("target", targets)
        w = _row("weights", np.asarray(weights))
        if not np.issubdtype(w.dtype, np.number) or np.issubdtype(w.dtype, np.complexfloating):
            raise DataError(f"weights must be real numbers, got {w.dtype}")
        w = w.astype(np.float32)
        if not (len(x) == len(y) == len(w)):
            raise DataError(
                f"inputs, targets and weights differ in length ({len(x)}, {len(y)}, {len(w)})"
            )
        if not np.isfinite(w).all():
            raise DataError("weights must be finite (a NaN or infinite weight makes the loss NaN)")
        if (w < 0).any():
            raise DataError("weights must not be negative")
        if not (w > 0).any():
            raise DataError("the window has no labelled position (every weight is 0)")
        return cls(x, y, w)

    @classmethod
    def labelled(cls, length: int) -> Window:
        """A window of `length` positions, every one labelled, that holds no array of its length
        (broadcast views): what `mlxwalk plan` and the budget's admission plan for."""
        ids = np.broadcast_to(np.zeros((), np.int32), (length,))
        window = cls(ids, ids, np.broadcast_to(np.ones((), np.float32), (length,)))
        window.__dict__["labels"] = Labels.labelled(length)
        return window

    @cached_property
    def labels(self) -> Labels:
        """The weights as runs (the plan reads these, never a value per position)."""
        w = self.weights
        cuts = (np.flatnonzero(w[1:] != w[:-1]) + 1).tolist()
        bounds = [0, *cuts, len(w)]
        return Labels(len(w), tuple((a, b, float(w[a])) for a, b in zip(bounds, bounds[1:])))

    def __len__(self) -> int:
        return len(self.inputs)

    @property
    def total(self) -> float:
        return float(self.weights.sum())

    def arrays(self, start: int, end: int) -> tuple[mx.array, mx.array, mx.array]:
        return (
            mx.array(self.inputs[start:end])[None],
            mx.array(self.targets[start:end])[None],
            mx.array(self.weights[start:end])[None],
        )


def _integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _row(name: str, values: np.ndarray) -> np.ndarray:
    """A window's sequence as one row: 1-D, or a batch of exactly one row."""
    if values.ndim == 2 and values.shape[0] == 1:
        return values[0]
    if values.ndim != 1:
        raise DataError(
            f"{name} must be one window (1-D, or one row), got shape {tuple(values.shape)}; "
            "walk a batch's rows as windows of their own"
        )
    return values


def _ids(name: str, values) -> np.ndarray:
    """Token ids as int32, refused (as given) when not integers or beyond any vocabulary."""
    ids = _row(f"{name}s", np.asarray(values))
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise DataError(f"{name} token ids must be integers, got {ids.dtype}")
    if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(np.int32).max):
        bad = ids[(ids < 0) | (ids > np.iinfo(np.int32).max)][0]
        raise DataError(f"{name} token id {int(bad)} is outside any vocabulary")
    return ids.astype(np.int32)
