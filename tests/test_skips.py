"""CI's rule on skips (tests/skips.py): under MLXWALK_NO_SKIPS=1 a skip outside an optional
extra's tests (the torch backend's, the Metal proxy's) fails the run and names the test; a
torch- or proxy-marked skip does not."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .extras import why_proxy, why_torch

ROOT = Path(__file__).resolve().parent.parent
BODY = """
import pytest

def test_runs():
    pass

@pytest.mark.torch
def test_needs_the_torch_extra():
    pytest.skip("no torch here")

@pytest.mark.proxy
def test_needs_the_proxy_extra():
    pytest.skip("no clang here")
{extra}
"""
SKIPPING = """
def test_needs_a_compiler():
    pytest.skip("g++ is not on PATH")
"""


WHOLE_FILE = """
import pytest

pytest.skip("{reason}", allow_module_level=True)
"""


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("extra", ["", SKIPPING])
def test_a_skip_outside_torchs_fails_a_strict_run(tmp_path, strict, extra):
    (tmp_path / "test_some.py").write_text(BODY.format(extra=extra))
    if extra:  # and a whole file skipped for a compiler, beside ones skipped for an extra
        (tmp_path / "test_compiler.py").write_text(WHOLE_FILE.format(reason="no g++ here"))
        (tmp_path / "test_torch_side.py").write_text(WHOLE_FILE.format(reason=why_torch()))
        (tmp_path / "test_proxy_side.py").write_text(WHOLE_FILE.format(reason=why_proxy()))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLXWALK_NO_SKIPS": "1" if strict else "0"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "tests.skips",
            "-p",
            "no:cacheprovider",
            "-c",
            os.devnull,
            "--rootdir",
            str(tmp_path),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    fails = strict and bool(extra)
    assert out.returncode == (1 if fails else 0), out.stdout[-1500:]
    named = out.stdout.split("which fails the run")[-1]
    assert ("test_needs_a_compiler" in named) == fails and ("test_compiler.py" in named) == fails
    assert "test_torch_side.py" not in named and "test_proxy_side.py" not in named
    assert "test_needs_the_proxy_extra" not in named and "test_needs_the_torch_extra" not in named


def test_a_plain_run_says_why_each_test_was_skipped(tmp_path):
    """`python -m pytest` with the project's settings names each skip's reason in its summary
    (the torch extra's install), not only a count."""
    (tmp_path / "test_some.py").write_text(BODY.format(extra=""))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-c",
            str(ROOT / "pyproject.toml"),
            "--rootdir",
            str(tmp_path),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-1500:]
    assert "SKIPPED [1] test_some.py:9: no torch here" in out.stdout, out.stdout[-1500:]
    assert "SKIPPED [1] test_some.py:13: no clang here" in out.stdout, out.stdout[-1500:]
