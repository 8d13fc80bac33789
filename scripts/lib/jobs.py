"""Benchmark jobs in child processes (scripts/h200-attention.py, h200-delta.py): each job a
fresh process, so one that crashes, runs out of memory or hangs costs its own time and no
other's. A job prints its results as marked JSON lines (`emit`); the parent reads them back
(`run`) and keeps the job's whole output in its log."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

MARK = "RESULT "


def emit(row: dict) -> None:
    """One result of the job under way, for its parent."""
    print(MARK + json.dumps(row), flush=True)


class Log:
    """Lines to stdout (unless echo=False) and to OUT/<name>.log when OUT is given."""

    def __init__(self, out: str | None, name: str):
        self.file = None
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            self.file = open(Path(out) / f"{name}.log", "w")  # noqa: SIM115

    def __call__(self, text: str, echo: bool = True) -> None:
        if echo:
            print(text, flush=True)
        if self.file:
            self.file.write(text + "\n")
            self.file.flush()


def _text(stream) -> str:
    return stream.decode() if isinstance(stream, bytes) else (stream or "")


def run(
    cmd: list[str], spec: dict, timeout: float, log: Log, env: dict | None = None
) -> tuple[list[dict], str]:
    """Run the job `spec` as `cmd`; (its results, '' or why it ended early: its exit status and
    last line of stderr, or the time it ran out of)."""
    t0 = time.perf_counter()
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=max(1.0, timeout), env=env
        )
        out, err, why = done.stdout, done.stderr, ""
        if done.returncode:
            last = (err.strip().splitlines() or ["(no output)"])[-1]
            why = f"exit {done.returncode}: {last[-200:]}"
    except subprocess.TimeoutExpired as e:
        out, err = _text(e.stdout), _text(e.stderr)
        why = f"timed out after {timeout:.0f} s"
    seconds = time.perf_counter() - t0
    log(f"## job {json.dumps(spec)} ({seconds:.1f} s){' ' + why if why else ''}", echo=False)
    log(out + ("\n[stderr]\n" + err[-8000:] if err.strip() else ""), echo=False)
    results = [json.loads(line[len(MARK) :]) for line in out.splitlines() if line.startswith(MARK)]
    return results, why
