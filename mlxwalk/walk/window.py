"""A window: its token ids and weights as NumPy arrays, checked before the walk reads them. No
array framework: both backends' walks take it."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..errors import DataError
from ..plan import Labels


@dataclass(frozen=True)
class Window:
    inputs: np.ndarray  # int, length n
    targets: np.ndarray  # int, length n
    weights: np.ndarray  # float, length n; 0 = context

    @classmethod
    def of(cls, inputs, targets, weights) -> Window:
        """One window from three sequences of equal length, refusing what the walk would get
        wrong: ids that are not integers or not int32, a batch of several rows, negative or
        non-finite weights, nothing labelled.

        Args:
            inputs: token ids, shape (n,) or (1, n), integers (NumPy, list, mx.array).
            targets: the next token at each position, shape as `inputs`.
            weights: each position's weight in the loss, shape as `inputs`, real, >= 0.

        Returns:
            The Window: inputs, targets int32 (n,); weights float32 (n,).

        Raises:
            DataError naming the sequence at fault.
        """
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
    def of_targets(cls, inputs, targets, weights) -> Window:
        """A window with several targets at each position, each with a signed weight: the loss
        is sum(w * CE) over positions and targets, over sum(|w|). Answers that share every
        input and differ in a one-token answer (a preference group's chosen and rejected
        answers) are one window this way, walked once (preference/groups.py).

        Args:
            inputs: token ids, shape (n,).
            targets: shape (n, T): T candidate next tokens at each position.
            weights: shape (n, T), real and finite, of any sign, not all 0.

        Raises:
            DataError naming the sequence at fault.
        """
        x = _ids("input", inputs)
        y, w = np.asarray(targets), np.asarray(weights, np.float64)
        if y.ndim != 2 or w.shape != y.shape or len(y) != len(x):
            raise DataError(
                f"targets and weights of several targets a position must both be (n, T) with "
                f"n = {len(x)} inputs, got {tuple(y.shape)} and {tuple(w.shape)}"
            )
        if y.size and not np.issubdtype(y.dtype, np.integer):
            raise DataError(f"target token ids must be integers, got {y.dtype}")
        if y.size and (y.min() < 0 or y.max() > np.iinfo(np.int32).max):
            bad = y[(y < 0) | (y > np.iinfo(np.int32).max)][0]
            raise DataError(f"target token id {int(bad)} is outside any vocabulary")
        if not np.isfinite(w).all():
            raise DataError("weights must be finite (a NaN or infinite weight makes the loss NaN)")
        if not (w != 0).any():
            raise DataError("the window has no labelled position (every weight is 0)")
        return cls(x, y.astype(np.int32), w.astype(np.float32))

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
        w = self.weights if self.weights.ndim == 1 else np.abs(self.weights).sum(axis=1)
        cuts = (np.flatnonzero(w[1:] != w[:-1]) + 1).tolist()
        bounds = [0, *cuts, len(w)]
        return Labels(len(w), tuple((a, b, float(w[a])) for a, b in zip(bounds, bounds[1:])))

    def __len__(self) -> int:
        return len(self.inputs)

    @property
    def total(self) -> float:
        """sum(w); with several targets a position, sum(|w|)."""
        w = self.weights
        return float(w.sum() if w.ndim == 1 else np.abs(w).sum())

    @property
    def targets_per_position(self) -> int:
        """T: 1 for a plain window, else its targets' second dimension."""
        return 1 if self.targets.ndim == 1 else self.targets.shape[1]


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
