"""What a window may hold and what a step may apply: token ids the model has (MLX would read or
write out of bounds with others), and a finite loss and gradient (checked before the step)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..errors import DataError, NonFinite, Refusal  # noqa: F401  (NonFinite re-exported)


def check_ids(window, vocab: int) -> None:
    """Refuse ids the model does not have: MLX would read (or write) out of bounds with them."""
    for name, ids in (("input", window.inputs), ("target", window.targets)):
        if len(ids) and (ids.min() < 0 or ids.max() >= vocab):
            bad = int(ids[(ids < 0) | (ids >= vocab)][0])
            raise DataError(
                f"{name} token id {bad} is outside the model's vocabulary of {vocab} ids"
            )


def check_finite(loss: mx.array, grads: dict, what: str = "") -> None:
    """Refuse to step on a NaN or infinite loss or gradient, naming which."""
    value = loss.item()
    if not np.isfinite(value):
        raise NonFinite(f"{what}loss is {value}")
    leaves = tree_flatten(grads)
    if not mx.all(mx.stack([mx.isfinite(g).all() for _, g in leaves])).item():
        name = next(k for k, g in leaves if not mx.isfinite(g).all().item())
        raise NonFinite(f"{what}gradient of {name} is not finite (loss {value:.4f})")
