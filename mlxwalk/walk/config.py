"""A walk's settings and its window: plain values, checked before any array of the window."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..plan import MIB, PlanError
from .accum import ACCUMULATOR_DTYPES
from .store import check_cache_type

WALKS = ("exact", "plain", "one-graph")
ATTENTIONS = ("auto", "tiled", "fused")
KEEP_INPUTS = ("auto", "on", "off")


@dataclass
class WalkConfig:
    chunk: int
    horizon: int = 0  # 0 = the whole window
    cache_type: str = "float32"
    recompute: bool = False  # activation checkpointing inside each chunk's graph
    host_budget_mib: float | None = None
    memory_budget_mib: float | None = None  # all MLX holds while a window trains (budget.py)
    seed: int | None = None  # seeds dropout per chunk, identically in the decode and the graph
    follow_runs: bool = True  # chunks never cross a change of weight (see plan.cut)
    accumulator_dtype: str = "float32"
    attention: str = "auto"  # "tiled" (chunk_attention), "fused" (mlx-lm's); auto: ops.attention
    strict_exact: bool = False  # refuse a window the memory budget would narrow the horizon of
    # with recompute: each layer's input, kept from the decode, replaces the recorded forward of
    # the reverse pass (layerwise.py); auto: when they fit the memory budget (or there is none)
    keep_inputs: str = "auto"

    def check(self) -> WalkConfig:
        if self.chunk < 1:
            raise PlanError(f"chunk must be at least 1, got {self.chunk}")
        if self.horizon < 0:
            raise PlanError(f"horizon must be 0 (the whole window) or positive, got {self.horizon}")
        check_cache_type(self.cache_type)
        if self.attention not in ATTENTIONS:
            raise PlanError(
                f"attention {self.attention!r} is unknown; choose one of {', '.join(ATTENTIONS)}"
            )
        if self.keep_inputs not in KEEP_INPUTS:
            raise PlanError(
                f"keep-inputs {self.keep_inputs!r} is unknown; choose one of "
                f"{', '.join(KEEP_INPUTS)}"
            )
        if self.keep_inputs == "on" and not self.recompute:
            raise PlanError("--keep-inputs on: kept layer inputs serve --recompute's reverse "
                            "pass; give --recompute too")  # fmt: skip
        if self.accumulator_dtype not in ACCUMULATOR_DTYPES:
            raise PlanError(
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
        x, y = np.asarray(inputs).reshape(-1), np.asarray(targets).reshape(-1)
        w = np.asarray(weights, dtype=np.float32).reshape(-1)
        if not (len(x) == len(y) == len(w)):
            raise PlanError(
                f"inputs, targets and weights differ in length ({len(x)}, {len(y)}, {len(w)})"
            )
        if (w < 0).any():
            raise PlanError("weights must not be negative")
        if not (w > 0).any():
            raise PlanError("the window has no labelled position (every weight is 0)")
        return cls(x.astype(np.int32), y.astype(np.int32), w)

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
