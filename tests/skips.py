"""Under MLXWALK_NO_SKIPS=1 (CI sets it), a run in which any test but an optional extra's (the
torch backend's, the Metal proxy's) is skipped fails, naming each: a test that skips where it
should run (a missing g++, say) guards nothing. The torch- and proxy-marked tests skip by design
until their extra is installed."""

from __future__ import annotations

import os

import pytest

_skipped: list[str] = []


TORCH_EXTRA = "pip install -e '.[torch]'"  # what the torch backend's skips say (tests/extras.py)
PROXY_EXTRA = "pip install -e '.[proxy]'"  # the Metal proxy's
EXTRAS = {"torch": TORCH_EXTRA, "proxy": PROXY_EXTRA}  # marker -> the install its skips name


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not any(marker in report.keywords for marker in EXTRAS):
        _skipped.append(report.nodeid)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A whole file skipped as it is collected: allowed only for an extra's reason."""
    if report.skipped and not any(e in str(report.longrepr) for e in EXTRAS.values()):
        _skipped.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("MLXWALK_NO_SKIPS") == "1" and _skipped and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter) -> None:
    if os.environ.get("MLXWALK_NO_SKIPS") == "1" and _skipped:
        terminalreporter.write_line(
            f"MLXWALK_NO_SKIPS=1: {len(_skipped)} test(s) skipped outside an optional extra's, "
            "which fails the run: " + ", ".join(_skipped),
            red=True,
        )
