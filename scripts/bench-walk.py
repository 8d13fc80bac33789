#!/usr/bin/env python3
"""Time and peak memory of the exact walk, the plain walk and one graph, in one process; with
--vs-mlx-lm, of full training steps (gradient and optimizer update) against mlx-lm's own trainer
step (with and without its grad_checkpoint), and the largest window each fits under a memory cap.

    scripts/bench-walk.py [-m tiny-qwen2] [--windows 2048 4096] [--chunk 256] [--repeats 3]
    scripts/bench-walk.py --vs-mlx-lm [--windows 1024 2048 4096] [--cap-mib 384]
                          [--max-window 16384]
    scripts/bench-walk.py --backend torch attention|hybrid [...]   (scripts/bench-torch.py)
"""

import argparse
import json
import platform
import sys
from pathlib import Path

import mlx.core as mx
from lib import bench

from mlxwalk import use_openblas
from mlxwalk.commands.walk_exact import prepare
from mlxwalk.training import models
from mlxwalk.walk import WalkConfig

use_openblas()  # MLX's CPU matrix products on OpenBLAS (mlxwalk/_blas.py)


def main() -> int:
    if sys.argv[1:3] == ["--backend", "torch"]:  # the torch walk against transformers + PEFT
        import runpy

        sys.argv = [str(Path(__file__).with_name("bench-torch.py")), *sys.argv[3:]]
        runpy.run_path(sys.argv[0], run_name="__main__")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("-m", "--model", default="tiny-qwen2")
    p.add_argument("--windows", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--vs-mlx-lm", action="store_true")
    p.add_argument("--cap-mib", type=float, default=384)
    p.add_argument("--max-window", type=int, default=16384)
    p.add_argument("--bisect-only", action="store_true", help="with --vs-mlx-lm: only the cap")
    p.add_argument("--no-bisect", action="store_true", help="with --vs-mlx-lm: only the table")
    p.add_argument("--json", help="also write the rows to this file")
    a = p.parse_args()
    model, _ = models.load(a.model)
    prepare(model)
    print(
        f"model {a.model}, mlx {mx.__version__} on {mx.default_device()}, "
        f"{platform.machine()} {platform.system()}, float32, LoRA r8 on every layer",
        flush=True,
    )
    if not a.vs_mlx_lm:
        rows = [
            bench.measure(model, w, n, a.chunk, a.repeats) for n in a.windows for w in bench.WALKS
        ]
        print(bench.table(rows))
        print()
        print(bench.ratios(rows))
    else:
        config = WalkConfig(chunk=a.chunk)
        rows = []
        for n in [] if a.bisect_only else a.windows:
            for kind in bench.STEPS:
                rows.append(bench.measure_step(model, kind, n, config, a.repeats))
                print(bench.table(rows[-1:]).splitlines()[-1], flush=True)
        if rows:
            print(bench.table(rows))
            print()
            print(bench.ratios(rows, against="mlx-lm+ckpt"))
        if not a.no_bisect:
            print(
                f"\nlargest window with a measured peak under {a.cap_mib:.0f} MiB (steps of "
                f"{a.chunk}, bisection on the measured peak):"
            )
            for kind in bench.STEPS:
                best = bench.largest_window(
                    lambda n, k=kind: bench.fits(model, k, n, config, a.cap_mib),
                    a.chunk,
                    a.max_window,
                    a.chunk,
                )
                print(f"| {kind} | {best} |", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps([r.as_dict() for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
