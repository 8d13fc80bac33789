#!/usr/bin/env python3
"""The exact walk of a hybrid with few recurrent checkpoints, in one process: the binomial
schedule (mlxwalk/checkpoints.py) against the even one it replaced (each entry state decoded from
the checkpoint before it), per number of slots: chunks decoded again, seconds, and the gradient's
relative L2 difference between the two (the same states, rebuilt by other paths).

    scripts/bench-checkpoints.py [-m tiny-qwen3_5] [--window 16384] [--chunk 256]
                                 [--slots 1 3 7] [--repeats 2]
"""

import argparse
import math
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlxwalk import use_openblas  # noqa: E402
from mlxwalk.checkpoints import by_stride  # noqa: E402
from mlxwalk.commands.walk_exact import prepare  # noqa: E402
from mlxwalk.grading import compare  # noqa: E402
from mlxwalk.training import models  # noqa: E402
from mlxwalk.walk import ExactWalk, WalkConfig, Window  # noqa: E402

use_openblas()


def walked(model, window: Window, chunk: int, slots: int, even: bool):
    """(seconds, chunks decoded again, gradient) of one exact walk with `slots` checkpoints."""
    walk = ExactWalk(model, window, WalkConfig(chunk=chunk))
    n = len(walk.plan.chunks)
    stride = math.ceil(n / (slots + 1))
    walk.plan = replace(walk.plan, stride=stride)
    if even:  # the plan's cached schedule, replaced by the even one
        walk.plan.__dict__["schedule"] = by_stride(n, stride)
    again, decode = [0], walk.decode

    def counted(c, state, write=True):
        again[0] += not write
        return decode(c, state, write)

    walk.decode = counted
    start = time.perf_counter()
    _, grads = walk.run()
    mx.eval(grads)
    return time.perf_counter() - start, again[0], grads, walk.plan.slots


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("-m", "--model", default="tiny-qwen3_5")
    p.add_argument("--window", type=int, default=16384)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--slots", type=int, nargs="+", default=[1, 3, 7])
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    model, _ = models.load(a.model)
    prepare(model)
    ids = np.random.default_rng(0).integers(0, 256, a.window + 1)
    window = Window.of(ids[:-1], ids[1:], np.ones(a.window))
    print(
        f"model {a.model}, window {a.window}, chunk {a.chunk} ({a.window // a.chunk} chunks), "
        f"mlx {mx.__version__} on {mx.default_device()}, {platform.machine()} "
        f"{platform.system()}; seconds: the median of {a.repeats}",
        flush=True,
    )
    print(
        "| slots | schedule | chunks decoded again | walk s | gradient vs the other |\n"
        "|---:|---|---:|---:|---:|",
        flush=True,
    )
    for slots in a.slots:
        runs = {}
        for even in (True, False):
            times = []
            for _ in range(a.repeats):
                seconds, again, grads, held = walked(model, window, a.chunk, slots, even)
                times.append(seconds)
            runs[even] = (float(np.median(times)), again, grads, held)
        rel = compare(runs[True][2], runs[False][2])[1]
        for even, name in ((True, "even (before)"), (False, "binomial")):
            seconds, again, _, held = runs[even]
            print(f"| {held} | {name} | {again:,} | {seconds:.2f} | {rel:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
