#!/usr/bin/env python3
"""Regenerate the bundled sample data in mlxwalk/data/ (deterministic)."""

import sys
from pathlib import Path

root = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(root))

from mlxwalk.training import samples  # noqa: E402

samples.make(root / "mlxwalk" / "data")
