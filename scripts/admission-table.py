#!/usr/bin/env python3
"""What the exact walk's admission chooses for the 27B-shaped 4-bit hybrid under a memory budget,
and what it costs in layers forwarded again (re-decodes from checkpoints, inputs not kept),
computed on any machine: the model is built without evaluating a weight, and one chunk's graph is
the one the planner's probe measured on the H200 (scripts/mac-table.py PROBES), so no walk runs.

    python scripts/admission-table.py                       the rows of docs/BENCHMARKS.md
    python scripts/admission-table.py --affordable 1e9      exact fits first, whatever they cost
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from mlxwalk.errors import OutOfMemory  # noqa: E402
from mlxwalk.walk import ExactWalk, WalkConfig, Window, admission, arch  # noqa: E402
from mlxwalk.walk.activations import Activations  # noqa: E402

GIB = 1 << 30
ROWS = ((67584, 21.0), (67584, 32.0), (131072, 32.0))


def mac_table():
    spec = importlib.util.spec_from_file_location("mac_table", HERE / "mac-table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(model, layout, window: int, gib: float, keep: str) -> str:
    graphs = admission.Graphs(0, {"quantized": Activations(**mac_table().PROBES["qwen3_5-27b"])})
    config = WalkConfig(
        chunk=2048,
        recompute=True,
        keep_inputs=keep,
        head_products="quantized",
        memory_budget_mib=gib * 1024,
    )
    try:
        w = ExactWalk(model, Window.labelled(window), config, layout, graphs)
    except OutOfMemory as e:
        return f"| {window:,} | {gib:g} | {keep} | refused: {e} |||||"
    p = w.plan
    again, windows = w.forwards_again(), w.windows_again()
    lossy = ", ".join(f"{c.setting} {c.chosen}" for c in w.given_up if c.lossy) or "none"
    return (
        f"| {window:,} | {gib:g} | {keep} | {w.config.chunk} | {w.keep} | {p.stride} | "
        f"{again:,} ({windows:.1f}) | {w.estimate.total / GIB:.2f} | {lossy} |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--affordable", type=float, default=admission.AFFORDABLE)
    p.add_argument("--keep-inputs", nargs="+", default=["stem", "auto"])
    a = p.parse_args()
    admission.AFFORDABLE = a.affordable
    model = mac_table().model_of("qwen3_5-27b", 4)
    layout = arch.inspect(model)
    print(f"AFFORDABLE = {a.affordable:g} windows' decode")
    print(
        "| window | budget GiB | --keep-inputs | chunk | inputs kept | stride | "
        "layer forwards again (windows) | estimate GiB | lossy choices |\n"
        "|---:|---:|---|---:|---|---:|---:|---:|---|"
    )
    for window, gib in ROWS:
        for keep in a.keep_inputs:
            print(row(model, layout, window, gib, keep), flush=True)


if __name__ == "__main__":
    main()
