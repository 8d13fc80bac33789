#!/usr/bin/env python3
"""Recall at a long window: what each trainer costs there, and whether one graph learns it.

The first step towards running `scripts/recall.py` at 16K or more with the fact dozens of
chunks back: before the comparison is worth its hours, one graph (the reference) has to learn the
task at that window. This script, in one process, at `--window` and `--chunk` (the fact in the
first chunk, the question in the last):

  1. times a step of each trainer (one graph, the exact walk, the plain walk) on the same
     windows, after a warm-up, with each step's peak memory;
  2. trains one graph for at most `--budget-s` seconds, scoring held-out exact-match accuracy and
     answer loss every `--eval-every` windows;
  or, with `--pretrain N`, trains one graph on N windows at the short window first (where it
  learns), then each trainer from those weights at the long window.

    scripts/recall-long.py [--window 16384] [--chunk 512] [--budget-s 300] [--eval-every 100]

The model, data and schedule are scripts/recall.py's (docs/RECALL.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("recall_bench", ROOT / "scripts" / "recall.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)  # its model, optimizer, steps and evaluation (first: it sets
# OpenBLAS's threads before MLX loads it, so the imports below wait)

import mlx.core as mx  # noqa: E402
from lib import recall  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from mlxwalk import use_openblas  # noqa: E402
from mlxwalk.walk import WalkConfig  # noqa: E402

use_openblas()  # MLX's CPU matrix products on OpenBLAS (mlxwalk/_blas.py)


def step_costs(a, data: dict) -> list[dict]:
    """Seconds and peak memory of one step of each trainer, on the same windows."""
    rows = []
    for trainer in ("one-graph", "exact", "plain"):
        model = bench.build_model(0, a.width, a.layers)
        optimizer = bench.ClippedAdam(a.clip, learning_rate=a.lr)
        step = bench.make_step(trainer, model, optimizer, WalkConfig(chunk=a.chunk), a)
        step(bench.window_of(data, 0))  # warm-up: compiles and allocates
        mx.reset_peak_memory()
        start = time.perf_counter()
        for i in range(1, a.timed + 1):
            step(bench.window_of(data, i))
        seconds = (time.perf_counter() - start) / a.timed
        rows.append({"trainer": trainer, "s": seconds, "peak": mx.get_peak_memory() / 2**20})
        print(f"  {trainer}: {seconds:.3f} s/window, peak {rows[-1]['peak']:.0f} MiB", flush=True)
    return rows


def fit(a, trainer: str, model, lr, data: dict, valid: dict | None, budget_s: float) -> list:
    """Train `model` on `data`'s windows in order, scoring on `valid` every --eval-every windows
    and at the end; stop at the first score past `budget_s` seconds of training (scoring's time
    and memory left out). Returns (windows, seconds, accuracy, loss) per score."""
    optimizer = bench.ClippedAdam(a.clip, learning_rate=lr)
    step = bench.make_step(trainer, model, optimizer, WalkConfig(chunk=a.chunk), a)
    steps, scores, seconds, peak = len(data["inputs"]), [], 0.0, 0.0
    if valid is not None:
        scores.append((0, 0.0, *bench.evaluate(model, valid, batch=a.eval_batch)[:2]))
    mx.reset_peak_memory()
    for i in range(steps):
        start = time.perf_counter()
        step(bench.window_of(data, i))
        seconds += time.perf_counter() - start
        if valid is None or ((i + 1) % a.eval_every and i + 1 < steps):
            continue
        peak = max(peak, mx.get_peak_memory() / 2**20)
        acc, loss, _ = bench.evaluate(model, valid, batch=a.eval_batch)
        mx.reset_peak_memory()
        scores.append((i + 1, seconds, acc, loss))
        print(
            f"  {trainer} {i + 1} windows ({seconds:.0f} s): acc {acc:.3f} loss {loss:.3f}",
            flush=True,
        )
        if seconds > budget_s:
            break
    if valid is not None:
        print(f"  {trainer}: training's peak {peak:.0f} MiB", flush=True)
    return scores


def pretrain(a) -> list:
    """One graph at the benchmark's short window (scripts/recall.py's point, where it learns):
    the weights a long-window run starts from, as a user's pretrained model would."""
    model = bench.build_model(0, a.width, a.layers)
    short = recall.dataset(1, a.pretrain, recall.WINDOW, recall.CHUNK, a.decoys)
    lr = bench.schedule(a.lr, a.pretrain, a.warmup)
    fit(a, "one-graph", model, lr, short, None, float("inf"))  # one graph: the chunk is unused
    valid = recall.dataset(bench.VALID_SEED, 256, recall.WINDOW, recall.CHUNK, a.decoys)
    acc, loss, _ = bench.evaluate(model, valid)
    print(
        f"  pretrained on {a.pretrain} windows of {recall.WINDOW}: held-out accuracy there "
        f"{acc:.3f}, loss {loss:.3f}",
        flush=True,
    )
    return list(tree_flatten(model.parameters()))


def compare(a, weights: list, train_set: dict, valid_set: dict) -> dict:
    """Each trainer from the same pretrained weights at the long window, at a constant learning
    rate (fine-tuning: no warmup)."""
    runs = {}
    for trainer in ("one-graph", "exact", "plain"):
        model = bench.build_model(0, a.width, a.layers)
        model.load_weights(weights)
        runs[trainer] = fit(a, trainer, model, a.lr, train_set, valid_set, float("inf"))
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--window", type=int, default=16384)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--decoys", type=float, default=recall.DECOY_RATE)
    p.add_argument("--train", type=int, default=4000, help="training conversations (at most)")
    p.add_argument("--valid", type=int, default=64, help="held-out conversations")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--timed", type=int, default=3, help="windows timed per trainer")
    p.add_argument("--budget-s", type=float, default=300, help="one graph's training time")
    p.add_argument("--eval-every", type=int, default=100, help="windows between scores")
    p.add_argument("--eval-batch", type=int, default=8)
    p.add_argument("--skip-costs", action="store_true")
    p.add_argument(
        "--pretrain",
        type=int,
        default=0,
        help="windows of one graph at the short window first; then every trainer from there",
    )
    a = p.parse_args(argv)
    a.tied = False
    start = time.perf_counter()
    train_set = recall.dataset(0, a.train, a.window, a.chunk, a.decoys)
    valid_set = recall.dataset(bench.VALID_SEED, a.valid, a.window, a.chunk, a.decoys)
    print(
        f"recall at window {a.window}, chunk {a.chunk} ({a.window // a.chunk} chunks), "
        f"decoys {a.decoys}; qwen2 {a.layers}x{a.width}; data built in "
        f"{time.perf_counter() - start:.0f} s; {mx.default_device()}",
        flush=True,
    )
    costs = [] if a.skip_costs else step_costs(a, train_set)
    if a.pretrain:
        runs = compare(a, pretrain(a), train_set, valid_set)
        print("\n| trainer | windows | seconds | held-out accuracy | answer loss |")
        print("|---|---:|---:|---:|---:|")
        for trainer, scores in runs.items():
            for n, s, acc, loss in scores:
                print(f"| {trainer} | {n} | {s:.0f} | {acc:.3f} | {loss:.3f} |")
        return 0
    model = bench.build_model(0, a.width, a.layers)
    lr = bench.schedule(a.lr, len(train_set["inputs"]), a.warmup)
    scores = fit(a, "one-graph", model, lr, train_set, valid_set, a.budget_s)
    print("\n| trainer | s/window | peak MiB |\n|---|---:|---:|")
    for r in costs:
        print(f"| {r['trainer']} | {r['s']:.3f} | {r['peak']:.0f} |")
    print(
        "\n| one graph: windows | seconds | held-out accuracy | answer loss |"
        "\n|---:|---:|---:|---:|"
    )
    for n, s, acc, loss in scores:
        print(f"| {n} | {s:.0f} | {acc:.3f} | {loss:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
