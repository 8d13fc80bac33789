#!/usr/bin/env python3
"""The CUDA chunk-attention kernels on one GPU, in one call: first each tensor-core kernel
(metal_kernels/attention/tensor_cores.py) against the float32 ops twin on small shapes, then
forward+backward times at the benchmark shape beside the kernels it replaces and MLX's and
torch's attention, then (time allowing) other block shapes per kernel.

  check:  relative L2 errors of o, lse, dQ, dK, dV and the taps' dK/dV against the twin in
          float32 on the same inputs (mlxwalk/ops/attention/twin.py), beside the twin's own error
          in the inputs' dtype; PASS when every output is within 3x the twin's worst (the kernels
          round P and dS to the dtype before their second products, as FlashAttention does) and
          the log-sum-exp within 1e-4. Cases: no prefix; a prefix with and without taps; GQA 1,
          2, 7, 8; L not a multiple of the blocks; one query; batch 2 with a store per sequence
          or one shared; float16 and bfloat16; a float32 store under bfloat16/float16 queries.
  time:   bf16, B=1, 14 query / 2 kv heads, a 4,096-query chunk over a 61,440-position prefix in
          the walk's store plus the chunk, every prefix key tapped (dK/dV for all 65,536 keys):
            new     the tensor-core kernels: forward, delta = rowsum(dO o), dq, dkdv
            fused   mx.grad of mx.fast.scaled_dot_product_attention on the concatenated K/V
                    (cuDNN where MLX routes it: head dim <= 128), mask "causal" (bottom-right)
            unfused the same with the scores materialized in MLX ops
            torch   torch SDPA, bf16, causal_lower_right (or an explicit bottom-right mask)
          median of --repeats after a warm-up (the warm-up compiles); peak = the allocator's
          peak during a run less what was allocated before it; TFLOP/s counts fwd+bwd as 3.5x
          the forward's 4 HQ D (L prefix + L (L+1) / 2) FLOPs; the new kernels also timed one
          by one (executed FLOPs: forward 2, dq 3, dkdv 4 products).
  sweep:  each kernel alone at the benchmark shape under other block shapes (blocks.CudaBlocks).

Every job runs in a child process with a timeout, so a kernel that fails to compile, faults or
hangs costs its row only; the whole call keeps within --budget seconds (default 330). Prints one
table per part; the full log and a JSON of every result go to $OUT when set.

    export PYTHONPATH=/tmp/site:$PWD; python3 scripts/h200-attention.py
    h200-attention.py --emulate [--dims 64]   the check part on this CPU (the CUDA emulator)
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

from lib import jobs

ROOT = Path(__file__).resolve().parent.parent

GIB = 1024**3
GOALS_MS = {64: 18.0, 128: 25.0, 256: 54.0}  # the new kernels' fwd+bwd at the benchmark shape


# Cases: name, batch, query heads, kv heads, L, start, grad_from, store batch, spare store rows,
# queries' dtype, store's dtype.
CASES = [
    ("no prefix, GQA 1", 1, 2, 2, 40, 0, 0, 1, 0, "bf16", "bf16"),
    ("prefix + taps, GQA 2", 1, 4, 2, 40, 70, 25, 1, 0, "bf16", "bf16"),
    ("prefix, no taps, GQA 7", 1, 14, 2, 40, 64, 64, 1, 0, "bf16", "bf16"),
    ("L 300 + taps, GQA 7, batch 2", 2, 7, 1, 300, 333, 100, 2, 17, "bf16", "bf16"),
    ("batch 2, one shared store", 2, 4, 2, 40, 70, 25, 1, 0, "bf16", "bf16"),
    ("one query, GQA 8", 1, 8, 1, 1, 45, 20, 1, 0, "bf16", "bf16"),
    ("L 129, GQA 8, all tapped", 1, 16, 2, 129, 64, 0, 1, 0, "bf16", "bf16"),
    ("L 512 over 4,096, GQA 7", 1, 14, 2, 512, 4096, 1000, 1, 0, "bf16", "bf16"),
    ("fp16, prefix + taps, GQA 2", 1, 4, 2, 40, 70, 25, 1, 0, "f16", "f16"),
    ("fp16, no prefix, L 150, GQA 7", 1, 7, 1, 150, 0, 0, 1, 0, "f16", "f16"),
    ("fp16, L 300 + taps, batch 2", 2, 4, 2, 300, 200, 77, 2, 0, "f16", "f16"),
    ("f32 store, bf16, taps, GQA 2", 1, 4, 2, 100, 130, 40, 1, 0, "bf16", "f32"),
    ("f32 store, fp16, GQA 7", 1, 14, 2, 40, 70, 0, 1, 5, "f16", "f32"),
    ("f32 store, bf16, L 300, batch 2", 2, 7, 1, 300, 333, 100, 2, 0, "bf16", "f32"),
]
QUICK = (0, 1, 2, 5, 8, 11)  # the cases --emulate runs unless --cases says otherwise
OUTPUTS = ("out", "lse", "dq", "dk", "dv", "dtap_k", "dtap_v")


# ---------------------------------------------------------------------------------------------
# The jobs (each runs in its own process: `--job '<json>'`)


def _mx():
    import mlx.core as mx

    return mx


def _dtypes():
    mx = _mx()
    return {"bf16": mx.bfloat16, "f16": mx.float16, "f32": mx.float32}


def _tc():
    return importlib.import_module("metal_kernels.attention.tensor_cores")


def relative(a, b) -> float:
    mx = _mx()
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.linalg.norm((a - b).reshape(-1)) / (mx.linalg.norm(b.reshape(-1)) + 1e-30)).item()


def kernel_outputs(x: dict, run, blocks=None) -> dict:
    """o, lse, dq, dk, dv (own rows) and the taps' dk, dv through the kernels."""
    mx = _mx()
    mod = _tc()
    extra = {"blocks": (blocks or {}).get("forward")}
    q, k, v, pk, pv, start, gf = (x[n] for n in ("q", "k", "v", "pk", "pv", "start", "gf"))
    if not start:
        pk = pv = None
    o, lse = run(mod.forward_launch(q, k, v, pk, pv, start, x["scale"], **extra))
    delta = (x["d_out"].astype(mx.float32) * o).sum(axis=-1)
    extra = {"blocks": blocks}
    dq_call, dkdv_call = mod.backward_launches(
        q, k, v, pk, pv, start, gf, x["scale"], lse, delta, x["d_out"], **extra
    )
    (dq,) = run(dq_call)
    dk, dv = run(dkdv_call)
    taps = start - gf if start else 0
    rows = taps + q.shape[2]
    dk, dv = dk[:, :, :rows], dv[:, :, :rows]
    return {
        "out": o,
        "lse": lse,
        "dq": dq,
        "dk": dk[:, :, taps:],
        "dv": dv[:, :, taps:],
        "dtap_k": dk[:, :, :taps],
        "dtap_v": dv[:, :, :taps],
    }


def twin_outputs(x: dict, dtype) -> dict:
    """The same through the ops twin, every input read as `dtype` (the store in its own dtype,
    converted per tile as the kernels convert it)."""
    mx = _mx()
    from mlxwalk.ops.attention import check, twin
    from mlxwalk.ops.attention.prefix import Prefix

    q, k, v, d_out = (x[n].astype(dtype) for n in ("q", "k", "v", "d_out"))
    start, gf = x["start"], x["gf"]
    prefix = None
    if start:
        store = check.Store(x["pk"], x["pv"], x["pk"].dtype if dtype != mx.float32 else dtype)
        prefix = Prefix(store, 0, start, dtype)
    out, lse = twin.forward(q, k, v, prefix, gf, x["scale"], twin.TILE)
    grads = twin.backward(q, k, v, prefix, gf, x["scale"], twin.TILE, out, lse, d_out)
    b, hq, n, _ = q.shape
    got = {"out": out, "lse": lse.reshape(b, hq, n), "dq": grads[0], "dk": grads[1], "dv": grads[2]}
    got["dtap_k"], got["dtap_v"] = (grads[3], grads[4]) if len(grads) > 3 else (None, None)
    return got


def case_inputs(case, dim: int, seed: int = 0) -> dict:
    mx = _mx()
    name, b, hq, hkv, n, start, gf, bs, spare, t, s = case
    dt = _dtypes()
    mx.random.seed(seed)

    def normal(*shape, dtype=dt[t]):
        return mx.random.normal(shape).astype(dtype)

    x = {
        "q": normal(b, hq, n, dim),
        "k": normal(b, hkv, n, dim),
        "v": normal(b, hkv, n, dim),
        "d_out": normal(b, hq, n, dim),
        "pk": normal(bs, hkv, start + n + spare, dim, dtype=dt[s]),
        "pv": normal(bs, hkv, start + n + spare, dim, dtype=dt[s]),
        "start": start,
        "gf": gf,
        "scale": dim**-0.5,
    }
    mx.eval(*[a for a in x.values() if isinstance(a, mx.array)])
    return x


def job_check(dim: int, cases: list[int], emulate: bool) -> None:
    """Each case: the kernels' errors and the twin's own against the float32 twin."""
    mx = _mx()
    from metal_kernels import build

    if emulate:
        from metal_kernels import cuda_emulator

        run = cuda_emulator.launch
    else:
        run = build.launch
    for i in cases:
        case = CASES[i]
        row = {"dim": dim, "case": case[0], "T": case[9], "S": case[10]}
        try:
            t0 = time.perf_counter()
            x = case_inputs(case, dim, seed=i)
            want = twin_outputs(x, mx.float32)
            own = twin_outputs(x, _dtypes()[case[9]])
            got = kernel_outputs(x, run)
            errors, twin_errors = {}, {}
            for name in OUTPUTS:
                if want[name] is None or want[name].size == 0:
                    continue
                if got[name].shape != want[name].shape:
                    raise RuntimeError(f"{name}: shape {got[name].shape}, want {want[name].shape}")
                errors[name] = relative(got[name], want[name])
                twin_errors[name] = relative(own[name], want[name])
            worst_twin = max(v for k, v in twin_errors.items() if k != "lse")
            bar = 3 * worst_twin + 1e-6
            bad = [k for k, v in errors.items() if (v > 1e-4 if k == "lse" else v > bar)]
            bad += [k for k, v in errors.items() if v != v]  # NaN
            row.update(
                errors=errors,
                twin=twin_errors,
                bar=bar,
                ok=not bad,
                bad=bad,
                seconds=time.perf_counter() - t0,
            )
        except Exception as e:  # a compile error, a launch failure: this case's row
            row.update(ok=False, error=f"{type(e).__name__}: {str(e).strip()[-300:]}")
            traceback.print_exc()
        jobs.emit({"kind": "check", **row})


def bench_inputs(dim: int, a) -> dict:
    mx = _mx()
    mx.random.seed(0)
    hq, hkv = a.heads
    n, p = a.chunk, a.prefix

    def normal(*shape):
        return mx.random.normal(shape).astype(mx.bfloat16)

    x = {
        "q": normal(1, hq, n, dim),
        "k": normal(1, hkv, n, dim),
        "v": normal(1, hkv, n, dim),
        "d_out": normal(1, hq, n, dim),
        "pk": normal(1, hkv, p + n, dim),
        "pv": normal(1, hkv, p + n, dim),
        "start": p,
        "gf": 0,
        "scale": dim**-0.5,
    }
    mx.eval(*[v for v in x.values() if isinstance(v, mx.array)])
    return x


def forward_flops(dim: int, a) -> float:
    hq, _ = a.heads
    n = a.chunk
    return 4.0 * hq * dim * (n * a.prefix + n * (n + 1) / 2)


def timed(step, repeats: int) -> tuple[float, float]:
    """(median seconds, peak bytes over what was allocated before a run) after one warm-up."""
    mx = _mx()
    step()
    mx.synchronize()
    times, over = [], 0
    for _ in range(repeats):
        mx.clear_cache()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        t = time.perf_counter()
        step()
        mx.synchronize()
        times.append(time.perf_counter() - t)
        over = max(over, mx.get_peak_memory() - base)
    return statistics.median(times), over


def mlx_step(variant: str, x: dict):
    """MLX's attention on the concatenated K/V (prefix through zero taps, as the walk takes its
    gradient), forward and backward with dO as the cotangent."""
    mx = _mx()
    p, scale = x["start"], x["scale"]
    taps = [mx.zeros((1, x["k"].shape[1], p, x["k"].shape[-1]), mx.bfloat16) for _ in range(2)]
    mx.eval(*taps)

    def attend(q, k, v, tk, tv):
        kk = mx.concatenate([x["pk"][:, :, :p] + tk, k], axis=2)
        vv = mx.concatenate([x["pv"][:, :, :p] + tv, v], axis=2)
        if variant == "fused":
            o = mx.fast.scaled_dot_product_attention(q, kk, vv, scale=scale, mask="causal")
        else:
            b, hq, n, d = q.shape
            hkv, m = kk.shape[1], kk.shape[2]
            qs = (q * scale).reshape(b, hkv, hq // hkv, n, d)
            s = qs @ kk[:, :, None].swapaxes(-1, -2)
            mask = (mx.arange(n)[:, None] + m - n) >= mx.arange(m)[None]
            pr = mx.softmax(mx.where(mask, s, -mx.inf), axis=-1, precise=True)
            o = (pr @ vv[:, :, None]).reshape(b, hq, n, d)
        return (o.astype(mx.float32) * x["d_out"].astype(mx.float32)).sum()

    grad = mx.grad(attend, argnums=(0, 1, 2, 3, 4))
    return lambda: mx.eval(grad(x["q"], x["k"], x["v"], *taps))


def kernel_steps(x: dict, blocks=None) -> dict:
    """fwd+bwd through the kernels, and each kernel alone (its inputs evaluated beforehand)."""
    mx = _mx()
    from metal_kernels import build

    mod = _tc()
    q, k, v, pk, pv, p, d_out, scale = (
        x[n] for n in ("q", "k", "v", "pk", "pv", "start", "d_out", "scale")
    )
    fwd_kw = {"blocks": (blocks or {}).get("forward")}
    bwd_kw = {"blocks": blocks}

    def forward():
        return build.launch(mod.forward_launch(q, k, v, pk, pv, p, scale, **fwd_kw))

    def backward(o, lse):
        delta = (d_out.astype(mx.float32) * o).sum(axis=-1)
        return mod.backward_launches(q, k, v, pk, pv, p, 0, scale, lse, delta, d_out, **bwd_kw)

    def both():
        o, lse = forward()
        dq_call, dkdv_call = backward(o, lse)
        mx.eval(o, lse, *build.launch(dq_call), *build.launch(dkdv_call))

    o, lse = forward()
    mx.eval(o, lse)
    calls = backward(o, lse)
    mx.eval(*calls[0].inputs)
    return {
        "fwd+bwd": both,
        "forward": lambda: mx.eval(*forward()),
        "dq": lambda: mx.eval(*build.launch(calls[0])),
        "dkdv": lambda: mx.eval(*build.launch(calls[1])),
    }


def job_time(dim: int, variant: str, a) -> None:
    x = bench_inputs(dim, a)
    flops = forward_flops(dim, a)
    if variant == "new":
        steps = kernel_steps(x)
        executed = {"forward": 2, "dq": 3, "dkdv": 4}
        for part in ("fwd+bwd", "forward", "dq", "dkdv"):
            try:
                s, over = timed(steps[part], a.repeats)
                tf = (3.5 if part == "fwd+bwd" else executed[part] / 2) * flops / s / 1e12
                row = {"ms": s * 1e3, "peak_gib": over / GIB, "tflops": tf}
            except Exception as e:
                row = {"error": f"{type(e).__name__}: {str(e).strip()[-300:]}"}
                traceback.print_exc()
            jobs.emit({"kind": "time", "dim": dim, "variant": variant, "part": part, **row})
            if "error" in row and part == "fwd+bwd":
                break
        return
    s, over = timed(mlx_step(variant, x), a.repeats)
    jobs.emit(
        {
            "kind": "time",
            "dim": dim,
            "variant": variant,
            "part": "fwd+bwd",
            "ms": s * 1e3,
            "peak_gib": over / GIB,
            "tflops": 3.5 * flops / s / 1e12,
        }
    )


def torch_one(dim: int, a) -> dict:
    """torch SDPA forward+backward at the benchmark shape, bottom-right causal, in the first
    form this torch takes."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    hq, hkv = a.heads
    n, m = a.chunk, a.prefix + a.chunk
    dev = torch.device("cuda")
    torch.manual_seed(0)
    q = torch.randn(1, hq, n, dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, hkv, m, dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, hkv, m, dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(1, hq, n, dim, device=dev, dtype=torch.bfloat16)
    bias = causal_lower_right(n, m)

    def gqa():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)

    def expanded():
        kk, vv = (t.repeat_interleave(hq // hkv, dim=1) for t in (k, v))
        return F.scaled_dot_product_attention(q, kk, vv, attn_mask=bias)

    def explicit():
        mask = (torch.arange(n, device=dev)[:, None] + m - n) >= torch.arange(m, device=dev)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    forms = (
        ("causal_lower_right, enable_gqa", gqa),
        ("causal_lower_right, K/V expanded", expanded),
        ("explicit bottom-right mask, enable_gqa", explicit),
    )
    for how, fn in forms:
        try:

            def step(fn=fn):
                q.grad = k.grad = v.grad = None
                fn().backward(g)

            step()
            torch.cuda.synchronize()
            times, over = [], 0
            for _ in range(a.repeats):
                q.grad = k.grad = v.grad = None
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                begin.record()
                step()
                end.record()
                torch.cuda.synchronize()
                times.append(begin.elapsed_time(end) / 1e3)
                over = max(over, torch.cuda.max_memory_allocated() - base)
            s = statistics.median(times)
            return {
                "ms": s * 1e3,
                "peak_gib": over / GIB,
                "tflops": 3.5 * forward_flops(dim, a) / s / 1e12,
                "note": how,
            }
        except Exception as e:
            print(f"torch {dim} {how}: {type(e).__name__}: {e}", flush=True)
    return {"error": "every SDPA form failed (see the log)"}


def job_torch(dims: list[int], a) -> None:
    import torch

    for dim in dims:
        row = torch_one(dim, a)
        torch.cuda.empty_cache()
        jobs.emit({"kind": "time", "dim": dim, "variant": "torch", "part": "fwd+bwd", **row})


def sweep_shapes(dim: int) -> dict:
    """Other block shapes to time per kernel (the table's first)."""
    from metal_kernels.attention import blocks as tables
    from metal_kernels.attention.blocks import CudaBlocks as C

    shapes = {
        64: {
            "forward": [
                C(4, 2, 32, True, 1, ""),
                C(4, 1, 64, True, 1, ""),
                C(8, 1, 64, True, 1, ""),
            ],
            "dq": [C(4, 2, 32, True, 1, ""), C(4, 1, 64, True, 1, ""), C(8, 1, 64, False, 1, "")],
            "dkdv": [C(4, 1, 32, True, 1, ""), C(8, 1, 64, True, 1, ""), C(4, 1, 64, False, 1, "")],
        },
        128: {
            "forward": [
                C(4, 2, 64, False, 1, ""),
                C(4, 1, 64, False, 1, ""),
                C(8, 1, 64, False, 1, ""),
            ],
            "dq": [C(4, 1, 64, False, 1, ""), C(8, 1, 64, False, 1, ""), C(4, 1, 64, True, 1, "")],
            "dkdv": [
                C(4, 1, 64, False, 1, ""),
                C(8, 1, 32, False, 1, ""),
                C(8, 1, 64, False, 2, ""),
            ],
        },
        256: {
            "forward": [
                C(4, 1, 64, False, 1, ""),
                C(8, 1, 32, False, 1, ""),
                C(2, 1, 32, False, 1, ""),
            ],
            "dq": [C(4, 1, 32, False, 1, ""), C(8, 1, 16, False, 1, "")],
            "dkdv": [C(4, 1, 64, False, 2, ""), C(8, 1, 32, False, 2, "")],
        },
    }[dim]
    return {k: [tables.CUDA[(k, dim)], *v] for k, v in shapes.items()}


def job_sweep(dim: int, a) -> None:
    mx = _mx()
    from metal_kernels.attention import blocks as tables

    x = bench_inputs(dim, a)
    flops = forward_flops(dim, a)
    executed = {"forward": 2, "dq": 3, "dkdv": 4}
    for kernel, shapes in sweep_shapes(dim).items():
        for b in shapes:
            label = f"warps {b.warps}, mt {b.mt}, walk {b.walk}, regs {b.regs}, split {b.split}"
            row = {
                "kind": "sweep",
                "dim": dim,
                "kernel": kernel,
                "blocks": label,
                "smem": tables.cuda_shared_bytes(kernel, dim, b),
            }
            try:
                steps = kernel_steps(x, blocks={kernel: b})
                s, _ = timed(steps[kernel], a.repeats)
                row.update(ms=s * 1e3, tflops=executed[kernel] / 2 * flops / s / 1e12)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e).strip()[-200:]}"
            jobs.emit(row)
            mx.clear_cache()


def run_job(spec: dict, a) -> None:
    kind = spec["kind"]
    if kind == "check":
        job_check(spec["dim"], spec["cases"], a.emulate)
    elif kind == "time":
        job_time(spec["dim"], spec["variant"], a)
    elif kind == "torch":
        job_torch(spec["dims"], a)
    elif kind == "sweep":
        job_sweep(spec["dim"], a)


# ---------------------------------------------------------------------------------------------
# The orchestrator


def spawn(spec: dict, a, timeout: float, log: jobs.Log) -> tuple[list[dict], str]:
    """Run one job in a child; (its results, '' or why it ended early)."""
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--job",
        json.dumps(spec),
        "--repeats",
        str(a.repeats),
        "--chunk",
        str(a.chunk),
        "--prefix",
        str(a.prefix),
        "--heads",
        *map(str, a.heads),
    ] + (["--emulate"] if a.emulate else [])
    return jobs.run(cmd, spec, timeout, log)


def check_table(rows: list[dict]) -> list[str]:
    out = [
        "| head dim | case | T/S | " + " | ".join(OUTPUTS) + " | twin's own worst | verdict |",
        "|---:|---|---|" + "---:|" * len(OUTPUTS) + "---:|---|",
    ]
    for r in rows:
        if "errors" not in r:
            out.append(
                f"| {r['dim']} | {r['case']} | {r.get('T')}/{r.get('S')} | "
                + " | ".join("" for _ in OUTPUTS)
                + f" | | FAIL: {r.get('error')} |"
            )
            continue
        cells = [f"{r['errors'][k]:.2e}" if k in r["errors"] else "-" for k in OUTPUTS]
        worst = max(v for k, v in r["twin"].items() if k != "lse")
        verdict = "PASS" if r["ok"] else "FAIL: " + ", ".join(r["bad"])
        out.append(
            f"| {r['dim']} | {r['case']} | {r['T']}/{r['S']} | {' | '.join(cells)} | "
            f"{worst:.2e} | {verdict} |"
        )
    return out


def time_table(rows: list[dict]) -> list[str]:
    out = [
        "| head dim | variant | part | ms | peak GiB over inputs | TFLOP/s | note |",
        "|---:|---|---|---:|---:|---:|---|",
    ]
    for r in rows:
        if "error" in r:
            out.append(
                f"| {r['dim']} | {r['variant']} | {r.get('part', '')} | failed | | | "
                f"{r['error'][:120]} |"
            )
        else:
            peak = f"{r['peak_gib']:.2f}" if "peak_gib" in r else ""
            if r["variant"] == "new" and r["part"] == "fwd+bwd" and r["dim"] in GOALS_MS:
                goal = GOALS_MS[r["dim"]]
                r = {**r, "note": f"goal {goal:.0f} ms: {'met' if r['ms'] <= goal else 'not met'}"}
            out.append(
                f"| {r['dim']} | {r['variant']} | {r['part']} | {r['ms']:.2f} | {peak} | "
                f"{r['tflops']:.0f} | {r.get('note', '')} |"
            )
    return out


def sweep_table(rows: list[dict]) -> list[str]:
    out = [
        "| head dim | kernel | blocks | shared B | ms | TFLOP/s (executed) | note |",
        "|---:|---|---|---:|---:|---:|---|",
    ]
    for r in rows:
        if "error" in r:
            out.append(
                f"| {r['dim']} | {r['kernel']} | {r['blocks']} | {r['smem']} | failed | | "
                f"{r['error'][:100]} |"
            )
        else:
            out.append(
                f"| {r['dim']} | {r['kernel']} | {r['blocks']} | {r['smem']} | "
                f"{r['ms']:.2f} | {r['tflops']:.0f} | |"
            )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--prefix", type=int, default=61440)
    p.add_argument("--heads", type=int, nargs=2, default=[14, 2], metavar=("HQ", "HKV"))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--budget", type=float, default=330.0, help="seconds for the whole call")
    p.add_argument(
        "--parts", nargs="+", default=["check", "time", "sweep"], choices=["check", "time", "sweep"]
    )
    p.add_argument("--variants", nargs="+", default=["new", "fused", "unfused", "torch"])
    p.add_argument(
        "--cases", type=int, nargs="+", help="indices into CASES (default: all; --emulate: a few)"
    )
    p.add_argument("--emulate", action="store_true", help="the check part on the CPU emulator")
    p.add_argument("--job", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.job:
        run_job(json.loads(a.job), a)
        return 0

    t_start = time.perf_counter()
    deadline = t_start + a.budget
    log = jobs.Log(os.environ.get("OUT"), "h200-attention")
    mx = _mx()
    device = "CPU emulator" if a.emulate else str(mx.default_device())
    log(
        f"# h200-attention: mlx {mx.__version__} on {device}; chunk {a.chunk} over prefix "
        f"{a.prefix}, heads {a.heads[0]}/{a.heads[1]}, repeats {a.repeats}"
    )
    if a.emulate:
        a.parts = ["check"]
    cases = (
        a.cases if a.cases is not None else (list(QUICK) if a.emulate else list(range(len(CASES))))
    )
    queue = []
    if "check" in a.parts:
        queue += [
            ({"kind": "check", "dim": d, "cases": cases}, 150.0 if not a.emulate else 3600.0)
            for d in a.dims
        ]
    if "time" in a.parts:
        for d in a.dims:
            queue += [
                ({"kind": "time", "dim": d, "variant": v}, 60.0) for v in a.variants if v != "torch"
            ]
        if "torch" in a.variants:
            queue.append(({"kind": "torch", "dims": a.dims}, 90.0))
    if "sweep" in a.parts:
        queue += [({"kind": "sweep", "dim": d}, 120.0) for d in a.dims]

    results: list[dict] = []
    for spec, limit in queue:
        left = deadline - time.perf_counter()
        if left < 10 and not a.emulate:
            log(f"skipped (time budget): {json.dumps(spec)}")
            results.append({"kind": spec["kind"], "skipped": spec})
            continue
        got, why = spawn(spec, a, min(limit, left - 5) if not a.emulate else limit, log)
        results += got
        if why:
            log(f"job {json.dumps(spec)}: {why}")
            if spec["kind"] == "time":
                results.append(
                    {
                        "kind": "time",
                        "dim": spec["dim"],
                        "variant": spec["variant"],
                        "part": "fwd+bwd",
                        "error": why,
                    }
                )
            elif spec["kind"] == "torch":
                results += [
                    {"kind": "time", "dim": d, "variant": "torch", "part": "fwd+bwd", "error": why}
                    for d in spec["dims"]
                ]
            elif spec["kind"] == "check":
                results.append(
                    {
                        "kind": "check",
                        "dim": spec["dim"],
                        "case": "(job)",
                        "ok": False,
                        "error": why,
                    }
                )
        for r in got:
            if r["kind"] == "check":
                tag = "PASS" if r.get("ok") else f"FAIL {r.get('bad') or r.get('error')}"
                log(f"check {r['dim']} {r['case']} {r['T']}/{r['S']}: {tag}", echo=True)

    checks = [r for r in results if r["kind"] == "check"]
    times = [r for r in results if r["kind"] == "time"]
    sweeps = [r for r in results if r["kind"] == "sweep"]
    if checks:
        log("\n## Checks (relative L2 error against the float32 twin)\n")
        log("\n".join(check_table(checks)))
    if times:
        order = {v: i for i, v in enumerate(["new", "fused", "unfused", "torch"])}
        times.sort(key=lambda r: (r["dim"], order.get(r["variant"], 9), r.get("part") != "fwd+bwd"))
        log(
            f"\n## Forward+backward, bf16, {a.chunk} queries over {a.prefix} + {a.chunk} keys, "
            f"heads {a.heads[0]}/{a.heads[1]}\n"
        )
        log("\n".join(time_table(times)))
    if sweeps:
        log("\n## Block shapes, each kernel alone (the first row per kernel: blocks.CUDA's)\n")
        log("\n".join(sweep_table(sweeps)))
    skipped = [r["skipped"] for r in results if "skipped" in r]
    if skipped:
        log(f"\nskipped for time: {len(skipped)} jobs")
    failed = [r for r in checks if not r.get("ok")]
    log(
        f"\n{len(checks) - len(failed)}/{len(checks)} checks passed; "
        f"{time.perf_counter() - t_start:.0f} s"
    )
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "h200-attention.json").write_text(json.dumps(results, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
