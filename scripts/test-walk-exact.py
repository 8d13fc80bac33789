#!/usr/bin/env python3
"""The exactness table: `scripts/test-walk-exact.py [-m MODEL] [--json]`, the same as
`mlxwalk test-walk-exact`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlxwalk.cli import main  # noqa: E402

sys.exit(main(["test-walk-exact", *sys.argv[1:]]))
