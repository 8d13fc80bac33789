#!/usr/bin/env python3
"""The walk against mlx-lm's own trainer on realistic shapes (random weights, bf16), side by side
in one process: tokens/s and peak memory of a full training step (gradient and optimizer update)
at several windows, and the largest window each fits under a memory cap. Written for MLX's CUDA
backend on a large GPU; `--small` shrinks every shape to check the script on a CPU.

    bench-device check                      exactness rows and the op tests on this backend
    bench-device attention [--windows ...]  Qwen2.5-0.5B shape: mlx-lm (+ckpt), exact, plain
    bench-device hybrid [--windows ...]     Qwen3.5-like ~0.8B hybrid: mlx-lm (+ckpt), exact
    bench-device bisect --cap-gib 4         largest window under a cap, each kind
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
from lib import bench

from mlxwalk import use_openblas
from mlxwalk.ops.delta import chunk, chunk_kernel
from mlxwalk.walk import WalkConfig

ROOT = Path(__file__).resolve().parent.parent

use_openblas()  # MLX's CPU matrix products on OpenBLAS (mlxwalk/_blas.py)


def out_dir() -> Path | None:
    out = os.environ.get("OUT")
    return Path(out) if out else None


def save(name: str, payload) -> None:
    if (out := out_dir()) is not None:
        (out / f"{name}.json").write_text(json.dumps(payload, indent=2))


def header(what: str) -> None:
    print(f"# {what}: mlx {mx.__version__} on {mx.default_device()}, {platform.node()}", flush=True)


def steps(model, kinds, windows, config, repeats, name, skip, limit_gib=None):
    rows = []
    for n in windows:
        for kind in kinds:
            if (kind, n) in skip:
                print(f"| {n} | {config.chunk} | {kind} | skipped: {skip[(kind, n)]} |", flush=True)
                continue
            try:
                t = time.perf_counter()
                limit = limit_gib * 1024 if limit_gib and kind in ("exact", "plain") else None
                r = bench.measure_step(model, kind, n, config, repeats, limit)
                rows.append(r)
                print(
                    bench.table([r]).splitlines()[-1] + f"  ({time.perf_counter() - t:.0f} s)",
                    flush=True,
                )
            except RuntimeError as e:
                print(
                    f"| {n} | {config.chunk} | {kind} | failed: {str(e).splitlines()[0]} |",
                    flush=True,
                )
            mx.clear_cache()
        save(name, [r.as_dict() for r in rows])
    print(bench.table(rows))
    print(bench.ratios(rows, against="mlx-lm+ckpt"))
    return rows


def tried(model, kind: str, window: int, config, cap_mib: float) -> bool:
    """bench.fits, with each window's verdict, peak and seconds printed as it is tried."""
    t = time.perf_counter()
    why: list = []
    ok = bench.fits(model, kind, window, config, cap_mib, why)
    print(
        f"  {kind} at {window}: {'fits' if ok else 'does not fit'} (peak "
        f"{mx.get_peak_memory() / 2**30:.2f} GiB, {time.perf_counter() - t:.0f} s)"
        + "".join(f"\n    {w}" for w in why),
        flush=True,
    )
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("what", choices=["check", "attention", "hybrid", "bisect"])
    p.add_argument("--windows", type=int, nargs="+")
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--mlx-lm-windows", type=int, nargs="*", default=[1024])
    p.add_argument("--cap-gib", type=float, default=4.0)
    p.add_argument("--max-window", type=int, default=131072)
    p.add_argument("--model", default="qwen2-0.5b")
    p.add_argument("--kinds", nargs="+")
    p.add_argument("--attention", default="auto")
    p.add_argument("--recompute", action="store_true", help="the walks checkpoint every layer")
    p.add_argument(
        "--keep-inputs",
        default="auto",
        choices=["auto", "on", "off"],
        help="with --recompute: layer inputs kept from the decode",
    )
    p.add_argument("--delta-chunk", type=int, help="the delta rule's chunk (default: by backend)")
    p.add_argument("--limit-gib", type=float, help="the walks run with MLX held to this limit")
    p.add_argument("--bits", type=int, default=0, help="bisect: quantize the base (0 = bf16)")
    p.add_argument("--min-window", type=int, help="bisect: the first window tried (default: chunk)")
    p.add_argument("--cache-type", default="bfloat16")
    p.add_argument(
        "--budget",
        action="store_true",
        help="bisect: the walks run under --memory-budget-mib = the cap, strict exact",
    )
    p.add_argument(
        "--delta-paths",
        nargs="+",
        default=["auto"],
        choices=["auto", "ops", "chunked"],
        help="hybrid: one walk table per path of the delta rule: auto (the routing's choice), ops "
        "(the MLX ops) and chunked (the chunked kernels in half precision on CUDA)",
    )
    p.add_argument("--small", action="store_true")
    a = p.parse_args()
    if a.what == "check":
        header("check")
        tests = ["tests/test_attention.py", "tests/test_delta.py", "-q", "-p", "no:cacheprovider"]
        # float32 products in float32: MLX's CUDA backend runs them in TF32 unless told not to,
        # and the op tests bound relative error at 1e-4
        env = {**os.environ, "MLX_ENABLE_TF32": "0"}
        code = subprocess.call([sys.executable, "-m", "pytest", *tests], cwd=ROOT, env=env)
        code |= subprocess.call(
            [sys.executable, "-m", "mlxwalk", "test-walk-exact"], cwd=ROOT, env=env
        )
        return code
    chunk.CHUNK = a.delta_chunk
    config = WalkConfig(
        chunk=a.chunk,
        cache_type=a.cache_type,
        attention=a.attention,
        recompute=a.recompute,
        keep_inputs=a.keep_inputs,
    )
    if a.what == "attention":
        model, n = bench.shaped("qwen2-0.5b", a.small)
        header(
            f"qwen2-0.5b shape, {n / 1e6:.0f}M parameters, bf16, LoRA r8 on 16 layers, "
            f"chunk {a.chunk}, attention {a.attention}, recompute {a.recompute} (keep inputs "
            f"{a.keep_inputs}), "
            f"walks' memory limit {a.limit_gib} GiB"
        )
        windows = a.windows or [4096, 16384, 65536]
        kinds = a.kinds or ["mlx-lm+ckpt", "mlx-lm", "exact", "plain"]
        skip = {("mlx-lm", w): "no checkpointing at this window" for w in windows if w > 16384}
        steps(model, kinds, windows, config, a.repeats, "attention", skip, a.limit_gib)
    elif a.what == "hybrid":
        model, n = bench.shaped("qwen3_5-0.8b", a.small)
        header(
            f"qwen3_5 hybrid, {n / 1e6:.0f}M parameters, bf16, LoRA r8 on 16 layers, "
            f"chunk {a.chunk}, recompute {a.recompute}, "
            f"delta chunk {chunk.chunk_size()}"
        )
        rows = steps(model, ["mlx-lm+ckpt"], a.mlx_lm_windows, config, 1, "hybrid-mlx-lm", {})
        for path in a.delta_paths:
            if path != "auto":
                chunk_kernel.CUDA_CHUNKED = (mx.bfloat16, mx.float16) if path == "chunked" else ()
            header(f"the walks, delta rule path {path}")
            rows += steps(
                model,
                a.kinds or ["exact", "plain"],
                a.windows or [4096, 16384, 65536],
                config,
                a.repeats,
                f"hybrid-walk-{path}",
                {},
            )
        save("hybrid", [r.as_dict() for r in rows])
    else:
        model, n = bench.shaped(a.model, a.small, a.bits or None)
        cap = a.cap_gib * 1024
        if a.budget:
            config = replace(config, memory_budget_mib=cap, strict_exact=True)
        header(
            f"largest window under {a.cap_gib} GiB, {a.model}, {n / 1e6:.0f}M parameters, "
            f"{a.bits or 16}-bit base, weights {mx.get_active_memory() / 2**30:.2f} GiB, "
            f"steps of {a.chunk} (the walks' chunk), cache {a.cache_type}, recompute "
            f"{a.recompute}, keep inputs {a.keep_inputs}, walks budgeted "
            f"{a.budget}"
        )
        found = {}
        for kind in a.kinds or ["mlx-lm", "mlx-lm+ckpt", "exact", "plain"]:
            t = time.perf_counter()
            found[kind] = bench.largest_window(
                lambda w, k=kind: tried(model, k, w, config, cap),
                a.min_window or a.chunk,
                a.max_window,
                a.chunk,
            )
            print(f"| {kind} | {found[kind]} | ({time.perf_counter() - t:.0f} s)", flush=True)
            save("bisect", found)
    return 0


if __name__ == "__main__":
    sys.exit(main())
