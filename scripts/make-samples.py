#!/usr/bin/env python3
"""Regenerate the bundled sample data in mlxwalk/data/ (deterministic)."""

import sys
from pathlib import Path

root = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(root))

from mlxwalk import use_openblas  # noqa: E402
from mlxwalk.training import samples  # noqa: E402

use_openblas()  # MLX's CPU matrix products on OpenBLAS (mlxwalk/_blas.py)

samples.make(root / "mlxwalk" / "data")
