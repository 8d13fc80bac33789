#!/usr/bin/env python3
"""The exact walk's gradient against one graph's on a recall-curriculum trainer's saved model.

Loads `--out/state/TRAINER-seedS/model.safetensors` (scripts/recall-curriculum.py's state), takes
--windows held-out conversations of --window positions (the curriculum's data), and prints per
window the relative L2 error and cosine of the exact walk's gradient against one graph's, and the
plain walk's for contrast (float32). One graph's graph at a long window is large: this is the check
that a stage the exact walk trains slowly is its optimisation, not its gradient.

    scripts/recall-gradient.py --out runs/rc64cap --trainer exact --seed 2 --window 8192 --chunk 64

The model's shape (width, layers, RoPE base) is the run's, from the settings in its JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("recall_bench", ROOT / "scripts" / "recall.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)  # first: it sets OpenBLAS's threads before MLX loads it

import mlx.core as mx  # noqa: E402
from lib import recall  # noqa: E402

from mlxwalk import grading  # noqa: E402
from mlxwalk.training import files  # noqa: E402
from mlxwalk.walk import window_gradient  # noqa: E402


def compare(model, data: dict, i: int, chunk: int) -> dict:
    """Relative L2 and cosine of the exact and plain walks' gradients against one graph's."""
    x, y, w = (data[k][i : i + 1] for k in ("inputs", "targets", "weights"))  # (1, window)
    row = {}
    start = time.perf_counter()
    loss, ref = window_gradient(model, x, y, w, chunk=chunk, walk="one-graph")
    row["one-graph s"] = time.perf_counter() - start
    for walk in ("exact", "plain"):
        start = time.perf_counter()
        walk_loss, got = window_gradient(model, x, y, w, chunk=chunk, walk=walk)
        row[f"{walk} s"] = time.perf_counter() - start
        row[f"{walk} cosine"], row[f"{walk} rel L2"] = grading.compare(got, ref)
        row[f"{walk} loss"] = walk_loss
    row["loss"] = loss
    return row


def run_settings(out: Path, seed: int) -> dict | None:
    """The settings the run under `out` wrote with its table (the seed's own JSON first): the
    model's shape and the chunk it trained with."""
    for name in (f"curriculum-seed{seed}.json", "curriculum.json"):
        if (out / name).exists():
            return json.loads((out / name).read_text())["settings"]
    return None


def run_chunk(settings: dict, window: int) -> int:
    """The chunk the run trained `window` in: its stage's, else its last stage's (a run's
    --chunk is one value or one per stage; older runs saved one number)."""
    chunk = settings["chunk"]
    if isinstance(chunk, int):
        return chunk
    return settings.get("chunks", {}).get(str(window), chunk[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="the curriculum run's --out")
    p.add_argument("--trainer", default="exact")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window", type=int, required=True)
    p.add_argument("--chunk", type=int, help="the walks' chunk (default: the run's)")
    p.add_argument("--windows", type=int, default=2, help="held-out conversations to check")
    a = p.parse_args(argv)
    state = Path(a.out) / "state" / f"{a.trainer}-seed{a.seed}" / "model.safetensors"
    if not state.exists():
        print(f"error: no saved model at {state}", file=sys.stderr)
        return 2
    s = run_settings(Path(a.out), a.seed)
    if s is None:
        print(f"error: no curriculum JSON under {a.out} says the model's shape", file=sys.stderr)
        return 2
    a.chunk = a.chunk or run_chunk(s, a.window)
    model = bench.build_model(a.seed, s["width"], s["layers"], rope_theta=s["rope_theta"])
    model.load_weights(list(files.load_safetensors(state).items()))
    mx.eval(model.parameters())
    data = recall.dataset(bench.VALID_SEED + 99, a.windows, a.window, a.chunk)
    print(f"{state}: window {a.window} in chunks of {a.chunk} ({a.window // a.chunk} chunks)")
    worst = 0.0
    for i in range(a.windows):
        row = compare(model, data, i, a.chunk)
        worst = max(worst, row["exact rel L2"])
        print(
            f"  window {i}: loss {row['loss']:.4f}; exact rel L2 {row['exact rel L2']:.2e} "
            f"cosine {row['exact cosine']:.8f}; plain rel L2 {row['plain rel L2']:.2e} cosine "
            f"{row['plain cosine']:.4f}; seconds one graph {row['one-graph s']:.1f}, exact "
            f"{row['exact s']:.1f}, plain {row['plain s']:.1f}",
            flush=True,
        )
    print(f"worst exact rel L2: {worst:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
