#!/usr/bin/env python3
"""The torch backend's route to the chunked delta rule's CUDA kernels
(mlxwalk/torch_backend/delta_kernels.py: NVRTC through torch, no MLX) on one GPU, in one call.

  env:    torch, the GPU, the include folders NVRTC is given; the routing's self-check per
          (dk 128, float32 and bfloat16), each output's relative error.
  check:  Qwen3.5 layer shapes (dk = dv = 128, 16 key heads, 16 and 48 value heads, B = 1,
          T = 4,096 / 16,384 / 65,536, a non-zero float32 state): the kernels against
          delta.gated_delta_chunked (autograd) on the same inputs, y, the final state and all
          six gradients, relative L2: float32 inputs with TF32 off (the routing's tolerance
          2e-5), and bf16 inputs (the ops compute them in float32; 4e-2).
  time:   forward+backward (y and the final state's cotangents), median of --repeats after a
          warm-up, torch.cuda.synchronize around each; peak = torch.cuda.max_memory_allocated
          during a run less what was allocated before it:
            kernels bf16   delta_kernels.kernels_op on bf16 q, k, v
            kernels f32    the same on float32 q, k, v (what the model's route hands it: its
                           layers normalise q and k in float32)
            ops            delta.gated_delta (the torch ops, recomputing backward), bf16 inputs;
                           at 64K only where 16K's time says it fits the budget
Prints the tables last; the log and a JSON of the results go to $OUT when set.

    PYTHONPATH=$PWD python3 scripts/h200-torch-delta.py [--repeats 3] [--budget 150]

First run (an H100, torch 2.11 cu130, --budget 140): every check within its tolerance (float32
at most 1.9e-6; bf16: y, dq, dk, dv 1.7e-3, the bf16 rounding, the rest at most 6e-6); fwd+bwd
ms, kernels bf16 / f32 / ops: 16 value heads 16K 7.6 / 18.1 / 363, 64K 28.9 / 70.5 / 3846; 48
value heads 4K 4.8 / 11.2 / 88, 16K 17.5 / 43.1 / 777, 64K 65.8 / 168.8 / (skipped). The
first kernel calls of that process failed ("invalid device context": no CUDA context current
before any kernel had run); delta_kernels.current_context now makes the primary one current.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from mlxwalk.torch_backend import delta, delta_kernels

LENGTHS = (4096, 16384, 65536)
VALUE_HEADS = (16, 48)
KEY_HEADS, DIM = 16, 128
NAMES = ("y", "final state", "dq", "dk", "dv", "dlog_g", "dbeta", "dstate")
LINES: list[str] = []


def say(*parts) -> None:
    line = " ".join(str(p) for p in parts)
    LINES.append(line)
    print(line, flush=True)


def layer(dtype, hv: int, t: int):
    return delta_kernels.layer(dtype, KEY_HEADS, hv, DIM, t, "cuda", seed=t + hv)


def fwd_bwd(fn, x, cots):
    """One forward+backward; the gradients (for the check)."""
    leaves = [a.detach().requires_grad_() for a in x]
    y, s = fn(*leaves)
    return [y, s, *torch.autograd.grad((y, s), leaves, cots)]


def timed(fn, x, cots, repeats: int) -> tuple[float, float]:
    """(median ms, peak MiB above the inputs) of forward+backward, after a warm-up."""
    fwd_bwd(fn, x, cots)
    torch.cuda.synchronize()
    times = []
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fwd_bwd(fn, x, cots)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        del out
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return statistics.median(times) * 1e3, peak


def check(dtype, hv: int, t: int) -> dict[str, float]:
    """Each output's relative L2, kernels against gated_delta_chunked in float32 (TF32 off)."""
    x, cots = layer(dtype, hv, t)
    got = fwd_bwd(delta_kernels.kernels_op, x, cots)
    up = [a.float() for a in x]
    want = fwd_bwd(delta.gated_delta_chunked, up, [c.float() for c in cots])
    errors = {n: delta_kernels.relative_error(a, b) for n, a, b in zip(NAMES, got, want)}
    del got, want
    torch.cuda.empty_cache()
    return errors


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    p.add_argument("--value-heads", type=int, nargs="+", default=list(VALUE_HEADS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget", type=float, default=150.0, help="seconds for the whole call")
    a = p.parse_args()
    start = time.perf_counter()
    left = lambda: a.budget - (time.perf_counter() - start)  # noqa: E731
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    say(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
    say("NVRTC include folders:", delta_kernels.include_dirs())
    results: dict = {"self_check": {}, "check": [], "time": []}
    for dtype in (torch.float32, torch.bfloat16):
        t0 = time.perf_counter()
        try:
            errors = delta_kernels.compare(dtype, DIM, "cuda")
            why = delta_kernels.self_check(dtype, DIM, "cuda")
        except Exception as e:
            errors, why = {}, f"raised {type(e).__name__}: {str(e)[:400]}"
        results["self_check"][str(dtype)] = {"errors": errors, "problem": why}
        worst = max(errors.values()) if errors else float("nan")
        say(
            f"self-check {dtype}: worst {worst:.1e}, {why or 'PASS'}",
            f"({time.perf_counter() - t0:.1f} s, compiles included)",
        )
    checks, rows = [], []
    ops_16k: dict[int, float | None] = {}  # value heads -> the ops' ms at 16K
    for t in a.lengths:
        for hv in a.value_heads:
            for dtype, limit in ((torch.float32, 2e-5), (torch.bfloat16, 4e-2)):
                if left() < 30:
                    say(f"skip check {dtype} HV {hv} T {t}: budget")
                    continue
                try:
                    errors = check(dtype, hv, t)
                    worst = max(errors, key=errors.get)
                    ok = errors[worst] <= limit
                    row = {"hv": hv, "t": t, "dtype": str(dtype), "errors": errors, "ok": ok}
                except Exception as e:
                    row = {
                        "hv": hv,
                        "t": t,
                        "dtype": str(dtype),
                        "error": str(e)[:300],
                        "ok": False,
                    }
                checks.append(row)
                say("check", json.dumps(row))
            for label, dtype, fn in (
                ("kernels bf16", torch.bfloat16, delta_kernels.kernels_op),
                ("kernels f32", torch.float32, delta_kernels.kernels_op),
                ("ops bf16", torch.bfloat16, delta.gated_delta),
            ):
                need = 10.0
                if label.startswith("ops") and ops_16k.get(hv) and t > 16384:
                    need = ops_16k[hv] * (t / 16384) * (a.repeats + 1) / 1e3 + 20
                if left() < need:
                    say(f"skip {label} HV {hv} T {t}: needs ~{need:.0f} s, {left():.0f} s left")
                    rows.append({"hv": hv, "t": t, "how": label, "ms": None, "peak": None})
                    continue
                try:
                    x, cots = layer(dtype, hv, t)
                    ms, peak = timed(fn, x, cots, a.repeats)
                    del x, cots
                except Exception as e:
                    say(f"{label} HV {hv} T {t} failed: {str(e)[:300]}")
                    ms = peak = None
                torch.cuda.empty_cache()
                if label.startswith("ops") and t == 16384:
                    ops_16k[hv] = ms
                rows.append({"hv": hv, "t": t, "how": label, "ms": ms, "peak": peak})
                say("time", json.dumps(rows[-1]))
    results["check"], results["time"] = checks, rows

    say("\n| HV | T | inputs | y | final state | dq | dk | dv | dlog_g | dbeta | dstate | ok |")
    say("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for c in checks:
        e = c.get("errors", {})
        cells = " | ".join(f"{e[n]:.1e}" if n in e else c.get("error", "?")[:20] for n in NAMES)
        verdict = "PASS" if c["ok"] else "FAIL"
        say(f"| {c['hv']} | {c['t']} | {c['dtype'][6:]} | {cells} | {verdict} |")
    say("\n| HV | T | forward+backward | ms | peak MiB | ops / this |")
    say("|---:|---:|---|---:|---:|---:|")
    ops = {(r["hv"], r["t"]): r["ms"] for r in rows if r["how"].startswith("ops")}
    for r in rows:
        ms, peak, o = r["ms"], r["peak"], ops.get((r["hv"], r["t"]))
        ratio = f"{o / ms:.1f}x" if ms and o else "-"
        ms_s = f"{ms:.2f}" if ms is not None else "skipped"
        peak_s = f"{peak:.0f}" if peak is not None else "-"
        say(f"| {r['hv']} | {r['t']} | {r['how']} | {ms_s} | {peak_s} | {ratio} |")
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"])
        (out / "h200-torch-delta.log").write_text("\n".join(LINES) + "\n")
        (out / "h200-torch-delta.json").write_text(json.dumps(results, indent=1))
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
