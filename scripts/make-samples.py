#!/usr/bin/env python3
"""Regenerate the bundled sample data in mlxwalk/data/ (deterministic)."""

from pathlib import Path

from mlxwalk import use_openblas
from mlxwalk.preference import samples as preference
from mlxwalk.training import samples

root = Path(__file__).resolve().parent.parent

use_openblas()  # MLX's CPU matrix products on OpenBLAS (mlxwalk/_blas.py)

samples.make(root / "mlxwalk" / "data")
preference.make(root / "mlxwalk" / "data")
