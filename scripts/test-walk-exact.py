#!/usr/bin/env python3
"""The exactness table: `scripts/test-walk-exact.py [-m MODEL] [--json]`, the same as
`mlxwalk test-walk-exact`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlxwalk import use_openblas  # noqa: E402
from mlxwalk.cli import main  # noqa: E402

use_openblas()  # MLX's CPU matrix products on OpenBLAS (mlxwalk/_blas.py)

sys.exit(main(["test-walk-exact", *sys.argv[1:]]))
