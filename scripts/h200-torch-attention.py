#!/usr/bin/env python3
"""Chunk attention on the torch backend, route by route, on one GPU in one call: what fills
attention.ROUTES (mlxwalk/torch_backend/attention.py) for head dim 256 (Qwen3.5's) and 128.

  env:    torch, the GPU, NVRTC's include folders; the kernels' self-check per head dim (bf16).
  check:  each route against SDPA's math path in float32 on a small case (128 queries over 384
          prefix keys, each head shape): the output and dq, dk, dv, relative L2.
  time:   bf16, B = 1, Qwen3.5-0.8B heads (8 q, 2 kv) and 27B heads (24 q, 4 kv), a chunk of
          q = 4,096 queries over prefixes of 0, 12,288 and 61,440 keys (S = 4,096 / 16,384 /
          65,536), lower-right causal: forward+backward (all three gradients), median of
          --repeats after a warm-up, torch.cuda.synchronize around each; peak = the most
          allocated during the runs less what was allocated before them. Routes:
            flash-op   torch.ops.aten._scaled_dot_product_flash_attention, is_causal (lower
                       right there), K/V heads in place: what walk_attention runs today
            flash, efficient, cudnn, math
                       F.scaled_dot_product_attention under sdpa_kernel(<that backend>),
                       is_causal where S = q, else causal_lower_right's mask; enable_gqa, and
                       K/V repeat_interleave'd per group where the backend refuses it ("rep"
                       in the cell); math only where S <= --math-max
            kernels    the project's tensor-core kernels (attention_kernels.attention)
          A route that refuses a case says "refused: <one line>" in its cell.
Prints the tables last; the log and a JSON of the results go to $OUT when set. --small runs
tiny sizes on the CPU (the kernels skipped there: they need CUDA).

    PYTHONPATH=$PWD python3 scripts/h200-torch-attention.py [--repeats 3] [--budget 500]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from mlxwalk.torch_backend import attention, attention_kernels, nvrtc

HEADS = {"0.8B": (8, 2), "27B": (24, 4)}
DIMS = (256, 128)
CHUNK, PREFIXES = 4096, (0, 12288, 61440)
BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
ROUTES = ("flash-op", *BACKENDS, "kernels")
GRADS = ("out", "dq", "dk", "dv")
LINES: list[str] = []


def say(*parts) -> None:
    line = " ".join(str(p) for p in parts)
    LINES.append(line)
    print(line, flush=True)


def one_line(e: Exception) -> str:
    return f"{type(e).__name__}: {nvrtc.first_error(e)}"[:160]


def sdpa(backend: SDPBackend, query, key, value, repeat: bool):
    """SDPA under one backend, lower-right causal; (B, q, H, D)."""
    groups = query.shape[1] // key.shape[1]
    if repeat and groups > 1:
        key, value = (x.repeat_interleave(groups, dim=1) for x in (key, value))  # (B, H, S, D)
    q, s = query.shape[2], key.shape[2]
    mask = {"is_causal": True} if q == s else {"attn_mask": causal_lower_right(q, s)}
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(
            query, key, value, **mask, enable_gqa=not repeat and groups > 1
        )
    return out.transpose(1, 2)


def route_fn(route: str, repeat: bool = False):
    """The route as fn(query, key, value) -> (B, q, H, D)."""
    if route == "flash-op":
        return lambda q, k, v: attention._flash(q, k, v, None)
    if route == "kernels":
        return lambda q, k, v: attention_kernels.attention(q, k, v)
    return lambda q, k, v: sdpa(BACKENDS[route], q, k, v, repeat)


def fwd_bwd(fn, x, cot):
    """One forward+backward: the output and the three gradients."""
    leaves = [a.detach().requires_grad_() for a in x]
    out = fn(*leaves)
    return [out, *torch.autograd.grad(out, leaves, cot.to(out.dtype))]


def runs(route: str, x, cot):
    """(fn, "rep" or "") of a route that runs on x: SDPA backends first with enable_gqa, then
    with K/V repeated; the refusal's line raised as RuntimeError where neither runs."""
    tries = [False, True] if route in BACKENDS and x[0].shape[1] != x[1].shape[1] else [False]
    why = ""
    for repeat in tries:
        fn = route_fn(route, repeat)
        with warnings.catch_warnings(record=True) as said:  # SDPA warns why it refuses
            warnings.simplefilter("always")
            try:
                fwd_bwd(fn, x, cot)
                return fn, "rep" if repeat else ""
            except Exception as e:  # a backend's refusal, memory
                reasons = [str(w.message).splitlines()[0] for w in said if str(w.message)]
                why = (reasons[-1] + " | " if reasons else "") + one_line(e)
    raise RuntimeError(why[:300])


def check(route: str, dim: int, heads, device) -> dict:
    """A route against the math path in float32 on a small bf16 case: each relative L2."""
    q, k, v, cot = attention_kernels.case(torch.bfloat16, dim, device, 128, 384, heads)
    try:
        fn, how = runs(route, [q, k, v], cot)
        got = fwd_bwd(fn, [q, k, v], cot)
    except Exception as e:
        return {"refused": str(e)}
    want = fwd_bwd(attention_kernels.reference, [a.float() for a in (q, k, v)], cot.float())
    errors = {n: nvrtc.relative_error(a, b) for n, a, b in zip(GRADS, got, want)}
    return {"errors": errors, "how": how}


def timed(fn, x, cot, repeats: int, cuda: bool) -> tuple[float, float | None]:
    """(median ms, peak MiB above the inputs) of forward+backward, after a warm-up."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    fwd_bwd(fn, x, cot)
    sync()
    base = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        out = fwd_bwd(fn, x, cot)
        sync()
        times.append(time.perf_counter() - t0)
        del out
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else None
    return statistics.median(times) * 1e3, peak


def inputs(dim: int, heads, chunk: int, prefix: int, device):
    """bf16 (query, key, value, cotangent) of one timed case."""
    return attention_kernels.case(torch.bfloat16, dim, device, chunk, prefix, heads, seed=prefix)


def time_case(route: str, dim: int, name: str, prefix: int, a, device) -> dict:
    """One cell: {"ms", "peak", "how"} or {"refused": line} or {"skipped": why}."""
    heads, cuda = HEADS[name], device == "cuda"
    if route == "kernels" and not cuda:
        return {"skipped": "kernels need CUDA"}
    if route == "math" and prefix + a.chunk > a.math_max:
        return {"skipped": f"math only where S <= {a.math_max}"}
    x = cot = None
    try:
        q, k, v, cot = inputs(dim, heads, a.chunk, prefix, device)
        x = [q, k, v]
        fn, how = runs(route, x, cot)
        ms, peak = timed(fn, x, cot, a.repeats, cuda)
        return {"ms": ms, "peak": peak, "how": how}
    except Exception as e:
        return {"refused": one_line(e) if not isinstance(e, RuntimeError) else str(e)}
    finally:
        del x, cot
        if cuda:
            torch.cuda.empty_cache()


def self_checks(device) -> dict:
    found = {}
    for dim in DIMS:
        t0 = time.perf_counter()
        try:
            errors = attention_kernels.compare(torch.bfloat16, dim, device)
            why = attention_kernels.self_check(torch.bfloat16, dim, device)
        except Exception as e:
            errors, why = {}, f"raised {one_line(e)}"
        found[dim] = {"errors": errors, "problem": why}
        worst = max(errors.values()) if errors else float("nan")
        took = time.perf_counter() - t0
        say(f"self-check D {dim} bf16: worst {worst:.1e}, {why or 'PASS'} ({took:.1f} s)")
    return found


def cell(r: dict) -> str:
    if "refused" in r:  # (the whole line in the JSON and the log)
        return f"refused: {r['refused'][:70]}"
    if "skipped" in r:
        return f"skipped ({r['skipped']})"
    peak = "" if r["peak"] is None else f" / {r['peak']:.0f} MiB"
    return f"{r['ms']:.1f} ms{peak}" + (" rep" if r["how"] else "")


def tables(checks: list, rows: list) -> None:
    say("\n| D | heads | route | out | dq | dk | dv |")
    say("|---:|---|---|---:|---:|---:|---:|")
    for c in checks:
        e = c["result"].get("errors")
        cells = " | ".join(f"{e[n]:.1e}" for n in GRADS) if e else cell(c["result"]) + " | - " * 3
        say(f"| {c['dim']} | {c['heads']} | {c['route']} | {cells} |")
    say("\n| D | heads | S | " + " | ".join(ROUTES) + " |")
    say("|---:|---|---:|" + "---|" * len(ROUTES))
    keys = sorted({(r["dim"], r["heads"], r["s"]) for r in rows}, key=lambda k: (-k[0], k[1], k[2]))
    for key in keys:
        got = {r["route"]: cell(r["result"]) for r in rows if (r["dim"], r["heads"], r["s"]) == key}
        say(
            f"| {key[0]} | {key[1]} | {key[2]} | "
            + " | ".join(got.get(x, "-") for x in ROUTES)
            + " |"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget", type=float, default=500.0, help="seconds for the timings")
    p.add_argument("--math-max", type=int, default=4096, help="the math path up to this S")
    p.add_argument("--small", action="store_true", help="tiny sizes on the CPU")
    a = p.parse_args()
    device = "cpu" if a.small else "cuda"
    a.chunk, prefixes = (16, (0, 32)) if a.small else (CHUNK, PREFIXES)
    a.math_max = max(a.math_max, 64) if a.small else a.math_max
    start = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU (--small)"
    say(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {where}")
    results: dict = {"self_check": {}, "check": [], "time": []}
    if device == "cuda":
        say("NVRTC include folders:", nvrtc.include_dirs())
        results["self_check"] = self_checks(device)
    else:
        say("kernels skipped: they need CUDA (the CPU emulator runs them in the tests)")
    for dim in DIMS:
        for name, heads in HEADS.items():
            for route in ROUTES:
                if route == "kernels" and device != "cuda":
                    continue
                r = check(route, dim, heads, device)
                results["check"].append({"dim": dim, "heads": name, "route": route, "result": r})
                say("check", json.dumps(results["check"][-1]))
    for dim in DIMS:
        for name in HEADS:
            for prefix in prefixes:
                for route in ROUTES:
                    if time.perf_counter() - start > a.budget:
                        r = {"skipped": "budget"}
                    else:
                        r = time_case(route, dim, name, prefix, a, device)
                    s = prefix + a.chunk
                    row = {"dim": dim, "heads": name, "s": s, "route": route, "result": r}
                    results["time"].append(row)
                    say("time", json.dumps(row))
    tables(results["check"], results["time"])
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"])
        (out / "h200-torch-attention.log").write_text("\n".join(LINES) + "\n")
        (out / "h200-torch-attention.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
