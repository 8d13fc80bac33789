"""mlxwalk: LoRA fine-tuning on very long windows with MLX, one chunk's graph at a time.

Importing the package does nothing else: no array library is loaded until a name that needs one
is used, and MLX's CPU matrix products move to OpenBLAS at the first use of an entry point (a
command, or a function of the Python API such as `window_gradient`), or when `use_openblas()` is
called."""

from __future__ import annotations

import importlib

from ._blas import use_openblas

_LAZY = {
    "train": ".dropin.trainer",
    "WalkConfig": ".walk",
    "Window": ".walk",
    "one_graph": ".walk",
    "train_window": ".walk",
    "window_gradient": ".walk",
}

__all__ = [*_LAZY, "use_openblas"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'mlxwalk' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name], __name__), name)
