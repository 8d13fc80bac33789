"""A faster BLAS for MLX's CPU backend on Linux.

MLX's Linux CPU wheel links the reference BLAS, whose float32 matmul measured ~5 GFLOP/s on a
2-core x86-64 machine against ~130 with OpenBLAS. When an OpenBLAS is installed (Debian:
libopenblas0-pthread) it is loaded into the global symbol scope before MLX loads, so MLX's BLAS
calls bind to it. Only effective when mlxwalk is imported before mlx. MLXWALK_BLAS=off keeps MLX's
own; MLXWALK_BLAS=/path/to/libopenblas.so picks a library.
"""

from __future__ import annotations

import ctypes
import os
import sys

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)

loaded: str | None = None


def use_openblas() -> str | None:
    """Load an OpenBLAS globally if one is found and mlx is not loaded yet; return its path."""
    global loaded
    choice = os.environ.get("MLXWALK_BLAS", "")
    if (
        loaded
        or choice == "off"
        or not sys.platform.startswith("linux")
        or "mlx.core" in sys.modules
    ):
        return loaded
    for path in [choice] if choice else CANDIDATES:
        if os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            loaded = path
            break
    return loaded
