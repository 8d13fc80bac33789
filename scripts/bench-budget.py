#!/usr/bin/env python3
"""Does the memory budget hold? One training step of the exact walk per budget, side by side in
one process, on a realistic shape with random weights: the verdict (refused before the window,
or run), the estimate, the measured peak (everything MLX holds, weights included) against the
budget, and what the walk gave up to fit (the horizon, the checkpoint stride).

    bench-budget --shape qwen3_5-27b --bits 4 --window 67584 --chunk 2048 --recompute \\
                 --budgets-gib 31 48 0
    (0 = no budget: the walk as it runs unbudgeted, for comparison)

`--small` shrinks the shape to check the script on a CPU. Rows go to stdout as a Markdown table
and, with $OUT set, to $OUT/budget.json.
"""

import argparse
import gc
import json
import os
import platform
import time
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from lib import bench

from mlxwalk import use_openblas
from mlxwalk.plan import MIB, OutOfMemory
from mlxwalk.walk import ExactWalk, WalkConfig, Window, arch, probe, taps
from mlxwalk.walk.guards import check_finite

ROOT = Path(__file__).resolve().parent.parent

use_openblas()  # MLX's CPU matrix products on OpenBLAS (mlxwalk/_blas.py)

GIB = 1 << 30


def decode_run(walk: ExactWalk) -> str:
    run = walk.run_chunks()
    return "by chunk" if run == 1 else f"in runs of {run * walk.plan.chunk:,}"


def one(model, optimizer, window: Window, config: WalkConfig, profile: bool = False) -> dict:
    budget = config.memory_budget_mib
    row = {"budget_gib": round(budget / 1024, 2) if budget else None}
    gc.collect()  # the previous row's walk: its arrays go before this one measures its start
    mx.clear_cache()
    mx.reset_peak_memory()
    t = time.perf_counter()
    try:
        walk = ExactWalk(model, window, config)
    except OutOfMemory as e:
        return {
            **row,
            "verdict": "refused",
            "message": str(e),
            "seconds": round(time.perf_counter() - t, 1),
        }
    est = walk.estimate
    full = est.total if est else None
    print(  # before the walk: a run cut short by a time limit still tells what was admitted
        f"  admitted in {time.perf_counter() - t:.1f} s: chunk {walk.config.chunk}, stride "
        f"{walk.plan.stride}, store {walk.config.cache_type}, accumulators "
        f"{walk.config.accumulator_dtype}, inputs kept {walk.keep}, decode "
        f"{decode_run(walk)}, head {walk.head_products}, estimate "
        f"{full / GIB if est else 0:.2f} GiB",
        flush=True,
    )
    phases = watch_phases(walk)
    layers = clock(walk, phases) if profile else None
    ran = time.perf_counter()
    loss, grads = walk.run()
    check_finite(loss, grads)
    optimizer.update(model, grads)
    mx.eval(model.parameters(), optimizer.state)
    seconds = time.perf_counter() - t
    stepped = time.perf_counter() - ran  # the window's step: the walk and the update, no probe
    phase_seconds = phases.pop("seconds")
    active = phases.pop("active after")
    peak = max(mx.get_peak_memory(), max(phases.values()) * GIB)
    return {
        **row,
        "verdict": "ran",
        "estimate_gib": round(full / GIB, 2) if est else None,
        "estimate_used_gib": round(
            (
                est.total
                - est.graph
                + walk.graph_bytes(walk.horizon_used or len(window), walk.plan.chunks[-1].start)
            )
            / GIB,
            2,
        )
        if est
        else None,
        "parts_gib": {k: round(v / GIB, 2) for k, v in vars(est).items()} if est else None,
        "peak_gib": round(peak / GIB, 2),
        "peak_over_budget": round(peak / (budget * MIB), 3) if budget else None,
        "horizon_used": walk.horizon_used,
        "stride": walk.plan.stride,
        "head_used": walk.head_products,
        "chunk_used": walk.config.chunk,
        "cache_used": walk.config.cache_type,
        "accumulators_used": walk.config.accumulator_dtype,
        "given_up": [c.said() for c in walk.given_up],
        "keep_used": walk.keep,
        "seconds": round(seconds, 1),
        "tok_s": round(len(window) / seconds),
        "phases_gib": phases,
        "phase_seconds": phase_seconds,
        "active_after_gib": active,
        "walk_seconds": round(stepped, 1),
        "layer_seconds": layers and {k: round(v, 2) for k, v in layers.items()},
    }


def clock(walk, phases: dict) -> dict:
    """Seconds per (phase, layer kind) as the walk's layers are evaluated one at a time: decode,
    re-decode (a chunk between checkpoints, decoded again in the reverse pass), the stem's
    forward, the recorded forward and the backward of the trained layers."""
    seconds: dict = {}

    def add(what: str, s: float) -> None:
        if what.startswith("decode") and "decode" in phases:  # the reverse pass has begun
            what = "re-" + what
        seconds[what] = seconds.get(what, 0.0) + s

    walk.layers.clock = add
    return seconds


def profile_lines(r: dict) -> list[str]:
    """The profile as a table: each phase's layer kinds, and what the layers don't account for."""
    layers, phases = r["layer_seconds"], r["phase_seconds"]
    decode = phases.get("decode", 0.0)
    total = r["walk_seconds"]
    chunks = total - decode  # the reverse pass: its chunks, re-decodes between them, the update
    lines = ["| phase | layer kind | seconds | share of the window |", "|---|---|---:|---:|"]
    for what, s in sorted(layers.items()):
        lines.append(f"| {what.split()[0]} | {what.split()[1]} | {s:.2f} | {s / total:.1%} |")
    in_decode = sum(v for k, v in layers.items() if k.startswith("decode"))
    in_chunks = sum(v for k, v in layers.items() if not k.startswith("decode"))  # re-decodes too
    lines.append(
        f"| decode | other (embedding, store writes, state checkpoints) | "
        f"{decode - in_decode:.2f} | {(decode - in_decode) / total:.1%} |"
    )
    lines.append(
        f"| reverse | other (head and loss, accumulators, update) | "
        f"{chunks - in_chunks:.2f} | {(chunks - in_chunks) / total:.1%} |"
    )
    lines.append(f"| window | all | {total:.2f} | 100% |")
    return lines


def mlx_lm_row(model, window: int, repeats: int) -> dict:
    """mlx-lm's checkpointed step (its trainer's loss, grad_checkpoint on every layer) on one
    sequence of `window` tokens, the median of `repeats` after a warm-up."""
    gc.collect()  # the walks' arrays go first: the peak is mlx-lm's own
    mx.clear_cache()
    m = bench.measure_step(model, "mlx-lm+ckpt", window, WalkConfig(chunk=window), repeats)
    return {
        "walk": "mlx-lm+ckpt",
        "window": window,
        "seconds": round(m.seconds, 2),
        "tok_s": round(m.tokens_per_second),
        "peak_gib": round(m.peak_mib / 1024, 2),
    }


def mlx_lm_rows(model, windows: list[int], when: str, rows: list) -> None:
    """mlx-lm's rows, run both before and after the walks so that a drift of the machine over
    the call shows in its own numbers."""
    for w in windows:
        r = mlx_lm_row(model, w, 3)
        r["when"] = when
        rows.append(r)
        print(
            f"mlx-lm+ckpt at {w} ({when}): {r['seconds']} s, {r['tok_s']} tokens/s, "
            f"peak {r['peak_gib']} GiB",
            flush=True,
        )


def watch_phases(walk) -> dict:
    """The peak of each phase (the decode, then each reverse chunk), recorded as the walk runs."""
    phases: dict = {}
    seconds = phases.setdefault("seconds", {})
    active = phases.setdefault("active after", {})  # what stays allocated past each chunk
    decode, train_chunk = walk.decode_forward, walk.train_chunk
    t0 = time.perf_counter()

    def timed_decode():
        mx.reset_peak_memory()
        t = time.perf_counter()
        decode()
        phases["decode"] = round(mx.get_peak_memory() / GIB, 2)
        phases["after decode (active)"] = round(mx.get_active_memory() / GIB, 2)
        seconds["decode"] = round(time.perf_counter() - t, 1)
        print(f"  decode {seconds['decode']} s, peak {phases['decode']} GiB", flush=True)

    def timed_chunk(chunk, *args):
        mx.reset_peak_memory()
        t = time.perf_counter()
        out = train_chunk(chunk, *args)
        phases[f"chunk {chunk.index}"] = round(mx.get_peak_memory() / GIB, 2)
        seconds[f"chunk {chunk.index}"] = round(time.perf_counter() - t, 2)
        active[f"chunk {chunk.index}"] = round(mx.get_active_memory() / GIB, 2)
        if chunk.index % 32 == 0:  # progress, for a run cut short
            print(f"  chunk {chunk.index} trained, {time.perf_counter() - t0:.1f} s in", flush=True)
        return out

    walk.decode_forward, walk.train_chunk = timed_decode, timed_chunk
    return phases


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3_5-27b", choices=sorted(bench.SHAPES))
    p.add_argument("--bits", type=int, default=4, help="quantize the base (0 = bf16)")
    p.add_argument("--window", type=int, default=67584)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--min-chunk", type=int, default=None, help="the admission's floor (WalkConfig)")
    p.add_argument("--recompute", action="store_true")
    p.add_argument("--cache-type", default="auto")
    p.add_argument(
        "--accumulator-dtype", default="auto", help="K/V gradient accumulators (WalkConfig)"
    )
    p.add_argument("--budgets-gib", type=float, nargs="+", default=[31.0])
    p.add_argument(
        "--attention",
        nargs="+",
        default=["auto"],
        help="one row per budget and attention path (auto, tiled, ...)",
    )
    p.add_argument("--keep-inputs", default="off", choices=["auto", "on", "stem", "off"])
    p.add_argument(
        "--products",
        nargs="+",
        default=["auto"],
        help="one row per budget and product path of the quantized base (ops/products.py)",
    )
    p.add_argument(
        "--head-products",
        nargs="+",
        default=["auto"],
        choices=["auto", "quantized", "dequantized", "sliced"],
        help="one row per budget for each: the untied lm head's products (WalkConfig)",
    )
    p.add_argument(
        "--decode-runs",
        type=int,
        nargs="+",
        default=[WalkConfig.decode_run],
        help="one row per budget for each: positions the decode runs at once (0: by chunk)",
    )
    p.add_argument(
        "--pipeline",
        nargs="+",
        default=["on"],
        choices=["on", "off"],
        help="one row per budget for each: layers evaluated one in flight while the next is "
        "built (walk/taps.py PIPELINE), or each waited for",
    )
    p.add_argument(
        "--probe-share",
        type=float,
        nargs="+",
        default=[probe.LONG_SHARE],
        help="one row per budget for each: the share of the run's prefix the probe reads on "
        "CUDA (walk/probe.py LONG_SHARE)",
    )
    p.add_argument("--profile", action="store_true", help="seconds per phase and layer kind")
    p.add_argument(
        "--mlx-lm-windows",
        type=int,
        nargs="*",
        default=[],
        help="also time mlx-lm's checkpointed step at these windows, in the same process",
    )
    p.add_argument("--small", action="store_true")
    a = p.parse_args()
    t = time.perf_counter()
    model, n = bench.shaped(a.shape, a.small, a.bits or None)
    built = time.perf_counter() - t
    print(
        f"# {a.shape}{' (small)' if a.small else ''}, {n / 1e9:.2f}B parameters, "
        f"{a.bits or 16}-bit base, stem {arch.stem(model)} layers, built in {built:.0f} s, "
        f"weights {mx.get_active_memory() / GIB:.2f} GiB; window {a.window}, chunk {a.chunk}, "
        f"recompute {a.recompute}, keep inputs {a.keep_inputs}, cache {a.cache_type}; "
        f"mlx {mx.__version__} on {mx.default_device()}, {platform.node()}",
        flush=True,
    )
    vocab = arch.inspect(model).vocab
    ids = np.random.default_rng(a.window).integers(0, vocab, a.window + 1)
    window = Window.of(ids[:-1], ids[1:], np.ones(a.window))
    optimizer = optim.Adam(learning_rate=1e-5)
    optimizer.init(model.trainable_parameters())
    rows = []
    print(
        "| budget GiB | verdict | estimate GiB | peak GiB | peak / budget | horizon used | "
        "stride | seconds |\n|---:|---|---:|---:|---:|---:|---:|---:|",
        flush=True,
    )
    mlx_lm_rows(model, a.mlx_lm_windows, "before the walks", rows)
    runs = [
        (at, pr, hd, dr, pl, sh, g)
        for at in a.attention
        for pr in a.products
        for hd in a.head_products
        for dr in a.decode_runs
        for pl in a.pipeline
        for sh in a.probe_share
        for g in a.budgets_gib
    ]
    for attention, products, head, decode_run, pipeline, share, gib in runs:
        taps.PIPELINE = pipeline == "on"
        if share != probe.LONG_SHARE:  # a probe read over another share is not this row's
            probe.LONG_SHARE = share
            probe.forget()
        config = WalkConfig(
            chunk=a.chunk,
            min_chunk=a.min_chunk,
            cache_type=a.cache_type,
            accumulator_dtype=a.accumulator_dtype,
            recompute=a.recompute,
            memory_budget_mib=gib * 1024 if gib else None,
            attention=attention,
            keep_inputs=a.keep_inputs,
            products=products,
            decode_run=decode_run,
            head_products=head,
        )
        print(
            f"attention {attention}, products {products}, head {head}, decode run {decode_run}, "
            f"pipeline {pipeline}, probe share {share}:",
            flush=True,
        )
        r = one(model, optimizer, window, config, a.profile)
        r.update(attention=attention, products=products, head=head, decode_run=decode_run)
        r["pipeline"] = pipeline
        r["probe_share"] = share
        rows.append(r)
        if r["verdict"] == "refused":
            print(
                f"| {r['budget_gib']} | refused | | | | | | {r['seconds']} |\n  {r['message']}",
                flush=True,
            )
        else:
            print(
                f"| {r['budget_gib'] or 'none'} | ran | {r['estimate_gib'] or '-'} | "
                f"{r['peak_gib']} | {r['peak_over_budget'] or '-'} | {r['horizon_used']} | "
                f"{r['stride']} | {r['seconds']} |",
                flush=True,
            )
            print(
                f"  the window's step (the walk and the update, no probe): {r['walk_seconds']} s, "
                f"{round(a.window / r['walk_seconds'])} tokens/s; head {r['head_used']}, inputs "
                f"kept {r['keep_used']}; chunk {r['chunk_used']}, store {r['cache_used']}, "
                f"accumulators {r['accumulators_used']}",
                flush=True,
            )
            for said in r["given_up"]:
                print(f"  given up: {said}", flush=True)
            print(
                f"  estimate at the horizon used: {r['estimate_used_gib']} GiB; parts "
                f"{r['parts_gib']}\n  peaks by phase (GiB): {r['phases_gib']}\n  seconds by "
                f"phase: {r['phase_seconds']}\n  active after each chunk (GiB): "
                f"{r['active_after_gib']}",
                flush=True,
            )
            if a.profile:
                print("\n".join(profile_lines(r)), flush=True)
    mlx_lm_rows(model, a.mlx_lm_windows, "after the walks", rows)
    if out := os.environ.get("OUT"):
        (Path(out) / "budget.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
