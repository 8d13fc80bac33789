"""mlxwalk: LoRA fine-tuning on very long windows with MLX, one chunk's graph at a time."""

from .walk import WalkConfig, Window, one_graph, train_window, window_gradient

__all__ = ["WalkConfig", "Window", "one_graph", "train_window", "window_gradient"]
__version__ = "0.1.0"
