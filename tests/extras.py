"""Optional dependencies: a test that needs one is skipped, with the install that brings it, on a
machine that lacks it (the README's `pip install -e ".[test]"` brings no torch and no clang for
the Metal proxy)."""

from __future__ import annotations

import importlib.util

import pytest

TORCH = ("torch", "transformers", "peft")
PROXY = ("ziglang",)  # clang for the Metal proxy (metal_kernels/harness/proxy.py)


def missing(*names: str) -> list[str]:
    return [n for n in names if importlib.util.find_spec(n) is None]


def why_torch() -> str:
    gone = ", ".join(missing(*TORCH))
    return f"the torch backend's tests need {gone}: pip install -e '.[torch]'"


def needs_torch() -> None:
    """Skip the calling test module unless the torch extra is installed."""
    if missing(*TORCH):
        pytest.skip(why_torch(), allow_module_level=True)


def torch(test):
    """A test that needs the torch extra (`needs_torch` for whole files); `-m torch` runs them."""
    return pytest.mark.torch(pytest.mark.skipif(bool(missing(*TORCH)), reason=why_torch())(test))


def why_proxy() -> str:
    return "the Metal proxy's tests need ziglang (clang): pip install -e '.[proxy]'"


def proxy(test):
    """A test that needs the proxy extra (a whole file: as `pytestmark`); `-m proxy` runs them."""
    return pytest.mark.proxy(pytest.mark.skipif(bool(missing(*PROXY)), reason=why_proxy())(test))
