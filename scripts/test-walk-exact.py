#!/usr/bin/env python3
"""The exactness table: `scripts/test-walk-exact.py [-m MODEL] [--json]`, the same as
`mlxwalk test-walk-exact`."""

import sys

from mlxwalk import use_openblas
from mlxwalk.cli import main

use_openblas()  # MLX's CPU matrix products on OpenBLAS (mlxwalk/_blas.py)

sys.exit(main(["test-walk-exact", *sys.argv[1:]]))
