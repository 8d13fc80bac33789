"""The `mlxwalk` command's subcommands, a module each, named after them: `train`, `plan`,
`walk_exact` (test-walk-exact's, named so that pytest takes it for no test), `convert_adapter`.
Each has `HELP`, `add_arguments(parser)` and `run(args)`; cli.py builds the parser from them
and maps failures to one line and an exit code."""

from __future__ import annotations

import importlib

from ..errors import ConfigError

NAMES = {
    "train": "train",
    "plan": "plan",
    "test-walk-exact": "walk_exact",
    "convert-adapter": "convert_adapter",
    "kernels": "kernels",
}


def torch_module(name: str):
    """A module of the torch backend, or a refusal naming the extra that brings it."""
    try:
        return importlib.import_module(f"mlxwalk.torch_backend.{name}")
    except ImportError as e:
        raise ConfigError(f"the torch backend needs pip install 'mlxwalk[torch]' ({e})") from None
