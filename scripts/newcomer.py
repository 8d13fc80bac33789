#!/usr/bin/env python3
"""A newcomer's first ten minutes, timed: the README's two commands on a fresh virtual environment
(pip's cache bypassed, so every wheel is fetched) and a fresh model folder.

    scripts/newcomer.py [--blas wheel|system|off] [--skip-tests] [--keep]

--blas picks what MLX's CPU GEMMs run on (mlxwalk/_blas.py): the scipy-openblas32 wheel pip
installs (the default), a system OpenBLAS (libopenblas0-pthread), or MLX's reference BLAS (what a
machine without either gets). Prints one markdown row of the docs/BENCHMARKS.md table.
"""

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SYSTEM = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"


def timed(command: list[str], env: dict, cwd: Path, log: Path) -> float:
    tic = time.perf_counter()
    with open(log, "w") as out:
        done = subprocess.run(command, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - tic
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({done.returncode}); see {log}")
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blas", choices=("wheel", "system", "off"), default="wheel")
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--keep", action="store_true", help="keep the scratch folder")
    a = p.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="mlxwalk-newcomer-"))
    venv = scratch / "venv"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLXWALK_", "VIRTUAL_ENV"))}
    env.update(
        PATH=f"{venv / 'bin'}:{env['PATH']}",
        MLXWALK_HOME=str(scratch / "home"),
        PIP_NO_CACHE_DIR="1",
    )
    if a.blas != "wheel":
        env["MLXWALK_BLAS"] = SYSTEM if a.blas == "system" else "off"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    install = timed(["pip", "install", "-q", "-e", ".[test]"], env, ROOT, scratch / "install.log")
    train = timed(
        ["mlxwalk", "train", "--no-progress", "--adapter-path", str(scratch / "run")],
        env,
        ROOT,
        scratch / "train.log",
    )
    tests = (
        None
        if a.skip_tests
        else timed(
            ["python", "-m", "pytest", "-p", "no:cacheprovider"], env, ROOT, scratch / "tests.log"
        )
    )
    lines = (scratch / "train.log").read_text().splitlines()
    epochs = [line for line in lines if line.startswith("epoch ")]
    print("\n".join(epochs))
    shown = "not run" if tests is None else f"{tests:.0f} s"
    print(
        f"| {platform.machine()}, {os.cpu_count()} cores | {a.blas} | {install:.0f} s | "
        f"{train:.0f} s | {install + train:.0f} s | {shown} |"
    )
    print(f"logs: {scratch}" if a.keep else "")
    if not a.keep:
        subprocess.run(["rm", "-rf", str(scratch)])


if __name__ == "__main__":
    main()
