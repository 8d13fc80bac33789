#!/usr/bin/env python3
"""One rank against several: the same training windows walked by `mlxwalk train` in one
process and under `mlx.launch` (tokens/s over the run's windows, and the seconds its steps
spent in their reduction, the wait for the slowest rank included). Each run trains the same
number of windows, one window per rank per step.

    scripts/bench-ranks.py [-m tiny-qwen2] [--ranks 1 2] [--windows 8] [--window 2048]
                           [--chunk 512] [--backend ring]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = Path(sys.executable).parent / "mlx.launch"
SCRIPT = Path(sys.executable).parent / "mlxwalk"  # the environment's script: a file to launch


def train(ranks: int, backend: str, args: list[str], out: Path) -> dict:
    cmd = [sys.executable, str(SCRIPT), *args, "--adapter-path", str(out)]
    if ranks > 1:  # ranks on one machine share its cores: OpenBLAS's threads split between them
        threads = max(1, (os.cpu_count() or 1) // ranks)
        cmd = [
            str(LAUNCH),
            "-n",
            str(ranks),
            "--backend",
            backend,
            "--python",
            sys.executable,
            "--env",
            f"OPENBLAS_NUM_THREADS={threads}",
            *cmd[1:],
        ]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if "error" in done.stderr or not (out / "report.json").exists():
        sys.exit(f"{ranks} rank(s): {done.stderr.strip()[-500:]}")
    return json.loads((out / "report.json").read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("-m", "--model", default="tiny-qwen2")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--window", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--backend", default="ring")
    a = p.parse_args()
    args = [
        "train",
        "--model",
        a.model,
        "--iters",
        str(a.windows),
        "--epochs",
        "1",
        "--window",
        str(a.window),
        "--chunk",
        str(a.chunk),
        "--no-progress",
    ]
    print(
        f"model {a.model}, {a.windows} windows of up to {a.window} tokens, chunk {a.chunk}, "
        f"{platform.machine()} {platform.system()}, mlx.launch --backend {a.backend}",
        flush=True,
    )
    print("| ranks | steps | seconds | tokens/s | vs one rank | reduction s per step |")
    print("|---:|---:|---:|---:|---:|---:|")
    base = None
    with tempfile.TemporaryDirectory() as tmp:
        for n in a.ranks:
            r = train(n, a.backend, args, Path(tmp) / f"r{n}")
            epoch = r["epochs"][-1]
            steps = -(-r["windows"] // n)
            base = base or epoch["train_tok_s"]
            print(
                f"| {n} | {steps} | {epoch['seconds']:.1f} | {epoch['train_tok_s']:,.0f} | "
                f"{epoch['train_tok_s'] / base:.2f}x | {r['reduce_seconds'] / steps:.4f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
