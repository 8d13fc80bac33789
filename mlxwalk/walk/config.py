"""A walk's settings: plain values, checked before any array of the window (the window itself:
window.py)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields

import numpy as np

from ..errors import ConfigError
from ..ops.products import HEAD_PRODUCTS, PRODUCTS
from ..plan import MIB
from .accum import ACCUMULATOR_DTYPES
from .store import check_cache_type
from .window import Window  # noqa: F401  (re-exported)

WALKS = ("exact", "plain", "one-graph")
ATTENTIONS = ("auto", "tiled", "fused")
KEEP_INPUTS = ("auto", "on", "stem", "off")
OPTIONAL = ("decode_run", "min_chunk")  # integers that may be None
DECODE_RUN = 8192  # positions (the 8B-shaped decode at 65,536: 5.7 -> 4.5 s on the H200)


@dataclass
class WalkConfig:
    chunk: int
    horizon: int = 0  # 0 = the whole window
    # the K/V store: float32, float16, bfloat16 or q8; auto: the model's K/V precision where that
    # is float16 or bfloat16, else float32 (lossless), 8-bit only where a memory budget needs it
    cache_type: str = "auto"
    recompute: bool = False  # activation checkpointing inside each chunk's graph
    host_budget_mib: float | None = None
    memory_budget_mib: float | None = None  # all MLX holds while a window trains (budget.py)
    seed: int | None = None  # seeds dropout per chunk, identically in the decode and the graph
    # chunks never cross a change of weight (plan.cut); off, as both front ends train, by default
    follow_runs: bool = False
    # the K/V gradient accumulators: float32 or bfloat16; auto: float32, bfloat16 only where a
    # memory budget needs it
    accumulator_dtype: str = "auto"
    # the smallest chunk a memory budget may halve `chunk` to (None: choices.MIN_CHUNK); equal to
    # `chunk`, the chunk is held
    min_chunk: int | None = None
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
    # head dequantized once per chunk and held through its loss, ops.products), "sliced" (its loss
    # dequantizes a slice of the vocabulary at a time: one slice alive), "quantized";
    # auto: dequantized unless a memory budget would not hold it, then sliced with recompute
    # (each slice evaluated alone, layer by layer), quantized without
    head_products: str = "auto"
    # positions the exact walk's decode runs through the model at once, in whole chunks (at least
    # one): larger products for the same store and states. None: DECODE_RUN on CUDA at half
    # precision, where the decode evaluates a layer at a time and attention is fused (a run's
    # graph is one layer's at the run's width), else one chunk at a time; under a memory budget
    # the run is measured and shortened until it fits beside what the decode holds
    # (admission.py `decode_width`), else one chunk at a time
    decode_run: int | None = None

    @classmethod
    def from_fields(cls, source, **overrides) -> WalkConfig:
        """A config of `source`'s attributes named as its fields (a run's settings, a command's
        arguments), then `overrides`; unchecked."""
        given = {f.name: getattr(source, f.name) for f in fields(cls) if hasattr(source, f.name)}
        return cls(**{**given, **overrides})

    def check(self) -> WalkConfig:
        for name in ("chunk", "horizon", "decode_run", "min_chunk"):
            value = getattr(self, name)
            if not (value is None and name in OPTIONAL) and not _integer(value):
                raise ConfigError(f"{name} must be an integer, got {value!r}")
        for name in ("host_budget_mib", "memory_budget_mib"):
            value = getattr(self, name)
            if value is not None and not (_real(value) and math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a positive, finite number, got {value!r}")
        if self.chunk < 1:
            raise ConfigError(f"chunk must be at least 1, got {self.chunk}")
        if self.min_chunk is not None and self.min_chunk < 1:
            raise ConfigError(f"min chunk must be at least 1, got {self.min_chunk}")
        if self.horizon < 0:
            raise ConfigError(
                f"horizon must be 0 (the whole window) or positive, got {self.horizon}"
            )
        check_cache_type(self.cache_type)
        choices = (
            ("attention", self.attention, ATTENTIONS),
            ("keep-inputs", self.keep_inputs, KEEP_INPUTS),
            ("products", self.products, PRODUCTS),
            ("head products", self.head_products, HEAD_PRODUCTS),
            ("accumulator dtype", self.accumulator_dtype, ("auto", *ACCUMULATOR_DTYPES)),
        )
        for what, value, known in choices:
            if value not in known:
                raise ConfigError(f"{what} {value!r} is unknown; choose one of {', '.join(known)}")
        if self.keep_inputs == "on" and not self.recompute:
            raise ConfigError(
                "--keep-inputs on: kept layer inputs serve --recompute's reverse "
                "pass; give --recompute too"
            )
        if self.decode_run is not None and self.decode_run < 0:
            raise ConfigError(f"decode run must be 0 or positive, got {self.decode_run}")
        return self

    @property
    def host_budget(self) -> int | None:
        return None if self.host_budget_mib is None else int(self.host_budget_mib * MIB)

    @property
    def device_budget(self) -> int | None:
        return None if self.memory_budget_mib is None else int(self.memory_budget_mib * MIB)


def _integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
