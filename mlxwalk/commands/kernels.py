"""`mlxwalk kernels`: this machine's device, and every custom kernel at a model's shapes (or a
representative set): whether it builds, its error against its twin, its race against MLX's own
path, what MLXWALK_KERNELS=auto picks (survey.py); a table, and the same as JSON for a bug
report."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HELP = "check and time the custom kernels on this machine (its JSON goes with a bug report)"
JSON = "mlxwalk-kernels.json"
COLUMNS = ("kernel", "case", "build", "vs twin", "kernel race", "twin race", "auto")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-m",
        "--model",
        help="a bundled model, a model folder or a cached hub id: its shapes "
        "(default: Qwen2.5-0.5B-, 8B- and Qwen3.5-27B-like shapes on a GPU, the bundled tiny "
        "models' on the CPU)",
    )
    p.add_argument("--json", default=JSON, help=f"where the JSON goes (default: ./{JSON})")


def _ms(ms: float | None, peak: int | None) -> str:
    if ms is None:
        return "-"
    return f"{ms:.1f} ms, {peak / (1 << 20):.0f} MiB" if peak is not None else f"{ms:.1f} ms"


def table(survey) -> list[str]:
    """The survey's rows as plain aligned text, one line per kernel per case."""
    body = []
    for r in survey.rows:
        error = "-" if r.error is None else f"{r.error:.1e} " + ("ok" if r.passed else "FAIL")
        build = r.build if len(r.build) <= 48 else r.build[:45] + "..."
        body.append(
            (
                r.kernel,
                r.case,
                build,
                error,
                _ms(r.kernel_ms, r.kernel_peak_bytes),
                _ms(r.twin_ms, r.twin_peak_bytes),
                r.auto,
            )
        )
    widths = [max(len(row[i]) for row in [COLUMNS, *body]) for i in range(len(COLUMNS))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [COLUMNS, *body]]


def races(survey) -> list[str]:
    """Each race's size, once."""
    seen = {}
    for r in survey.rows:
        if r.race is not None:
            seen.setdefault(r.op, r.race)
    return [f"race {op}: {size}, forward and backward" for op, size in seen.items()]


def run(args: argparse.Namespace) -> int:
    from .. import survey as kernels
    from ..errors import ConfigError

    def echo(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    folder = Path(args.json).parent
    if not folder.is_dir():  # said before the survey's minute, not after it
        raise ConfigError(f"--json {args.json}: the folder {folder} does not exist")
    found = kernels.survey(args.model, echo=echo)
    print(f"device: {found.device.said()}")
    for note in found.notes:
        print(f"note: {note}")
    for line in [*table(found), *races(found)]:
        print(line)
    path = kernels.write_json(found, args.json)
    print(f"wrote {path}: attach it to your bug report")
    return 0
