"""mlxwalk: LoRA fine-tuning on very long windows with MLX, one chunk's graph at a time."""

from ._blas import use_openblas

use_openblas()  # MLX's CPU GEMMs on OpenBLAS where pip installed it (see _blas.py)

from .plugin.trainer import train  # noqa: E402
from .walk import WalkConfig, Window, one_graph, train_window, window_gradient  # noqa: E402

__all__ = ["WalkConfig", "Window", "one_graph", "train", "train_window", "window_gradient"]
__version__ = "0.1.0"
