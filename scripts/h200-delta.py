#!/usr/bin/env python3
"""The chunked gated delta rule's CUDA kernels (metal_kernels/delta/*.cu, run by chunked.py) on one
GPU, in one call: first each kernel against the float32 ops twin on small shapes, then forward and
forward+backward times at the Qwen3.5 layer shape beside the other ways to run the op, then (time
allowing) other block shapes per kernel.

  check:  per case, one row per kernel fed the twin's own intermediates (so a failure names its
          kernel): prepare (cum, w, u, T), states (h, v_new, the final state), output (y),
          states_back (dh, dv_new, the initial state's gradient), grads (dq, dk's part, dw,
          dcum), prepare_back (dk, dv, dlog_g, dbeta); then the whole op (chunked.op: forward
          and VJP) against mx.vjp of mlxwalk.ops.delta.gated_delta_chunked. The twin runs with
          MLX_ENABLE_TF32=0 (float32 products in float32). PASS: float32 inputs within 1e-5
          (relative L2, every output); float16/bfloat16 inputs: the kernels' float32 results
          within 1e-4 of the twin's on the same rounded inputs (a derived operand enters the
          products as hi + lo halves: tiles.cuh), the op's outputs rounded to the dtype (y, dq,
          dk, dv) within 1.5x the twin's own rounding plus 1e-4.
  time:   one layer at Qwen3.5's shape, bf16 (16 key heads, 32 value heads, head dim 128), a
          non-zero state, T = 4,096 / 16,384 / 65,536; forward, and forward+backward (mx.vjp with
          cotangents for y and the final state):
            new       the chunked CUDA kernels (chunked.op); each kernel alone at 16K and 64K too
            ops       the ops twin, mlxwalk.ops.delta.gated_delta (MLXWALK_KERNELS=off)
            scans     the same with its recurrence on today's scan kernels (MLXWALK_KERNELS=on,
                      mlxwalk/ops/delta/scan.py)
            mlx-fast  mx.fast.gated_delta_update (ops fallback on CUDA: 4K only)
            fla       flash-linear-attention's chunk_gated_delta_rule (torch, Triton) where it
                      imports: its forward, and its backward, which refuses on Hopper under
                      Triton 3.4-3.7.0 (the refusal is the row)
          median of --repeats after a warm-up (the warm-up compiles); peak = the allocator's
          peak during a run less what was allocated before it. The goal: the new kernels'
          forward+backward at 16K within 3x of flash-linear-attention's published H200
          figures (forward 0.47 / 1.89 ms at 8K / 32K, backward 1.44 / 5.70 ms: ~3.8 ms at 16K),
          at most 12 ms.
  sweep:  each kernel alone at 16K under other block shapes (blocks.CUDA's entry replaced).

Every job runs in a child process with a timeout, so a kernel that fails to compile, faults or
hangs costs its rows only; the whole call keeps within --budget seconds (default 300). Prints one
table per part; the full log and a JSON of every result go to $OUT when set.

    export PYTHONPATH=/tmp/site:$PWD; python3 scripts/h200-delta.py [--budget 300]
    h200-delta.py --emulate            the check part on this CPU (the CUDA emulator, g++)

flash-linear-attention is not on the H200 machine; to time it there, carry the wheels fla-core
0.6.0 (its kernels: fla/ops, fla/modules, fla/utils) and einops 0.8.2 (fla-core's one
requirement besides torch/triton), plus flash-linear-attention 0.6.0 if `import fla` wants
fla.layers (transformers, which it needs, is installed there); all pure Python. Without them its
rows say it is not importable.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

from lib import jobs

GIB = 1024**3
LAYER = {"hk": 16, "hv": 32, "dim": 128}  # Qwen3.5's gated delta-net layer
LENGTHS = (4096, 16384, 65536)
GOAL_MS = 12.0  # the new kernels' forward+backward at 16K
F32, HALF = 1e-5, 1e-4
KERNELS = ("prepare", "states", "output", "states_back", "grads", "prepare_back")
NAMES = ("y", "final_state", "dq", "dk", "dv", "dlog_g", "dbeta", "dstate")

# name, batch, T, key heads, value heads, head dim, dtype
CASES = [
    ("bf16 128, 2 value heads a key head", 1, 150, 2, 4, 128, "bf16"),
    ("bf16 128, 1,000 positions (16 chunks)", 1, 1000, 1, 2, 128, "bf16"),
    ("f16 64, batch 2, GQA 1", 2, 100, 2, 2, 64, "f16"),
    ("f16 64, one position", 1, 1, 1, 2, 64, "f16"),
    ("f32 128, 2 value heads a key head", 1, 130, 1, 2, 128, "f32"),
    ("f32 64, exactly 2 chunks, batch 2", 2, 128, 1, 1, 64, "f32"),
]
QUICK = (2, 3, 5)  # --emulate's cases unless --cases says otherwise


# ---------------------------------------------------------------------------------------------
# The jobs (each runs in its own process: `--job '<json>'`)


def _mx():
    import mlx.core as mx

    return mx


def _dtypes():
    mx = _mx()
    return {"bf16": mx.bfloat16, "f16": mx.float16, "f32": mx.float32}


def relative(a, b) -> float:
    """Relative L2 error in float64 on the host; anything not finite is infinite."""
    import numpy as np

    mx = _mx()
    a, b = (np.array(x.astype(mx.float32), np.float64) for x in (a, b))
    if not np.isfinite(a).all():
        return float("inf")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def inputs(batch: int, t: int, hk: int, hv: int, dim: int, dtype: str, seed: int = 0) -> dict:
    """q, k (unit rows, q scaled by dim^-1/2, as the layer feeds them), v, log_g, beta, a
    non-zero initial state, and the cotangents dy (in the dtype) and dstate."""
    import numpy as np

    mx = _mx()
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=1.0):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    q, k = normal(batch, t, hk, dim), normal(batch, t, hk, dim)
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) * dim**-0.5
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    dt = _dtypes()[dtype]
    x = {
        "q": mx.array(q).astype(dt),
        "k": mx.array(k).astype(dt),
        "v": mx.array(normal(batch, t, hv, dim)).astype(dt),
        "log_g": mx.array(-rng.uniform(0.001, 0.7, (batch, t, hv)).astype(np.float32)),
        "beta": mx.array((1 / (1 + np.exp(-rng.standard_normal((batch, t, hv))))).astype("f4")),
        "state": mx.array(normal(batch, hv, dim, dim, scale=0.3)),
        "dy": mx.array(normal(batch, t, hv, dim)).astype(dt),
        "dstate": mx.array(normal(batch, hv, dim, dim)),
    }
    mx.eval(*x.values())
    return x


PRIMALS = ("q", "k", "v", "log_g", "beta", "state")


def twin_parts(x: dict) -> dict:
    """Every kernel's outputs by the ops twin's own pieces (mlxwalk/ops/delta/chunk.py: its
    chunking, unit_lower_inverse, its recurrence), float32, in chunked.py's layouts."""
    mx = _mx()
    from mlxwalk.ops.delta import unit_lower_inverse

    f32, c = mx.float32, 64
    q, k, v, lg, beta, s0, dy, dfin = (x[n].astype(f32) for n in (*PRIMALS, "dy", "dstate"))
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2:]
    r, n = hv // hk, -(-t // c)
    np_ = n * c

    def pad(a):
        return mx.pad(a, [(0, 0), (0, np_ - t)] + [(0, 0)] * (a.ndim - 2))

    def chunks(a):  # (B, NP, H, ...) -> (B, H, N, C, ...)
        rest = a.shape[3:]
        a = a.reshape(b, n, c, a.shape[2], *rest)
        return a.transpose(0, 3, 1, 2, *range(4, 4 + len(rest)))

    qq, kk = (chunks(mx.repeat(pad(a), r, axis=2)) for a in (q, k))
    vv, dyy, g, bt = (chunks(pad(a)) for a in (v, dy, lg, beta))
    cum = mx.cumsum(g, axis=-1)
    gam = mx.exp(cum)
    causal = mx.tril(mx.ones((c, c), dtype=mx.bool_))
    strict = mx.tril(mx.ones((c, c), dtype=mx.bool_), -1)
    diff = cum[..., :, None] - cum[..., None, :]
    decay = mx.where(causal, mx.exp(mx.where(causal, diff, 0.0)), 0.0)
    kt = kk.swapaxes(-1, -2)
    tri = unit_lower_inverse(bt[..., None] * (kk @ kt) * mx.where(strict, decay, 0.0))
    w = tri @ ((bt * gam)[..., None] * kk)
    u = tri @ (bt[..., None] * vv)
    last = gam[..., -1][..., None, None]  # (B, HV, N, 1, 1)
    d = mx.exp(cum[..., -1:] - cum)  # (B, HV, N, C)
    s, hs, vns = s0, [], []
    for i in range(n):
        hs.append(s)
        vn = u[:, :, i] - w[:, :, i] @ s.swapaxes(-1, -2)
        vns.append(vn)
        s = last[:, :, i] * s + vn.swapaxes(-1, -2) @ (d[:, :, i][..., None] * kk[:, :, i])
    h, vnew = mx.stack(hs, axis=1), mx.stack(vns, axis=2)  # (B, N, HV, DV, DK), (B, HV, N, C, DV)
    p = (qq @ kt) * decay
    hh = h.transpose(0, 2, 1, 3, 4)  # (B, HV, N, DV, DK)
    o = gam[..., None] * (qq @ hh.swapaxes(-1, -2)) + p @ vnew
    y = o.reshape(b, hv, np_, dv).transpose(0, 2, 1, 3)[:, :t]
    ds, dhs, dvs = dfin, [None] * n, [None] * n
    qg = gam[..., None] * qq
    for i in reversed(range(n)):
        dhs[i] = ds
        dvn = p[:, :, i].swapaxes(-1, -2) @ dyy[:, :, i] + d[:, :, i][..., None] * (
            kk[:, :, i] @ ds.swapaxes(-1, -2)
        )
        dvs[i] = dvn
        ds = (
            last[:, :, i] * ds
            + dyy[:, :, i].swapaxes(-1, -2) @ qg[:, :, i]
            - dvn.swapaxes(-1, -2) @ w[:, :, i]
        )
    dh, dvnew = mx.stack(dhs, axis=1), mx.stack(dvs, axis=2)
    dhh = dh.transpose(0, 2, 1, 3, 4)
    dp = (dyy @ vnew.swapaxes(-1, -2)) * decay
    dq = gam[..., None] * (dyy @ hh) + dp @ kk
    vdh = d[..., None] * (vnew @ dhh)
    dkp = dp.swapaxes(-1, -2) @ qq + vdh
    dc = (qq * dq).sum(-1) - (kk * dkp).sum(-1)
    end = (kk * vdh).sum((-1, -2)) + gam[..., -1] * (dhh * hh).sum((-1, -2))
    dc = mx.concatenate([dc[..., :-1], dc[..., -1:] + end[..., None]], axis=-1)

    def per_key(a):  # (B, HV, N, C, D) -> (B, T, HK, D), summed over the key head's value heads
        a = a.reshape(b, hv, np_, -1).transpose(0, 2, 1, 3)[:, :t]
        return a.reshape(b, t, hk, r, -1).sum(axis=3)

    flat = {"cum": cum, "w": w, "u": u, "v_new": vnew, "dv_new": dvnew, "dw": -(dvnew @ hh)}
    out = {name: a.reshape(b, hv, np_, *a.shape[4:]) for name, a in flat.items()}
    out.update(
        tri=tri, h=h, final_state=s, y=y, dh=dh, d_state=ds, dq=per_key(dq), dk_part=per_key(dkp)
    )
    out["dcum"] = dc.reshape(b, hv, 1, np_)
    mx.eval(*out.values())
    return out


def kernel_rows(x: dict, run, half: bool) -> list[dict]:
    """Each kernel fed the twin's intermediates: {kernel, errors by output}."""
    mx = _mx()
    from metal_kernels.delta import chunked
    from mlxwalk.ops.delta import gated_delta_chunked

    tw = twin_parts(x)
    q, k, v, lg, beta, state = (x[n] for n in PRIMALS)
    up = [x[n].astype(mx.float32) for n in PRIMALS]
    _, grads = mx.vjp(gated_delta_chunked, up, [x["dy"].astype(mx.float32), x["dstate"]])
    final = dict(zip(("dq", "dk", "dv", "dlog_g", "dbeta", "dstate"), grads))
    s = chunked.Sizes.of(q, v)
    cu = "cuda"
    rows = []

    def row(kernel, got: dict, want: dict):
        rows.append({"kernel": kernel, "errors": {n: relative(got[n], want[n]) for n in got}})

    cum, w, u, tri = run(chunked.prepare_launch(s, k, v, lg, beta, True, cu))
    row("prepare", {"cum": cum, "w": w, "u": u, "tri": tri}, tw)
    h, vn, fin = run(chunked.states_launch(s, k, tw["w"], tw["u"], tw["cum"], state, cu))
    row("states", {"h": h, "v_new": vn, "final_state": fin}, tw)
    (y,) = run(chunked.output_launch(s, q, k, tw["cum"], tw["h"], tw["v_new"], cu))
    row("output", {"y": y}, tw)
    dh, dvn, dst = run(
        chunked.states_back_launch(s, q, k, tw["w"], tw["cum"], x["dy"], x["dstate"], cu)
    )
    row("states_back", {"dh": dh, "dv_new": dvn, "d_state": dst}, tw)
    args = (tw["cum"], tw["h"], tw["v_new"], tw["dh"], tw["dv_new"], x["dy"])
    dq, dkp, dw, dcum = run(chunked.grads_launch(s, q, k, *args, cu))
    got = {"dq": dq, "dk_part": dkp, "dw": dw, "dcum": dcum.sum(axis=2, keepdims=True)}
    row("grads", got, tw)
    dk, dv, dlog_g, dbeta = run(
        chunked.prepare_back_launch(
            s,
            k,
            v,
            beta,
            tw["cum"],
            tw["tri"],
            tw["dw"],
            tw["dv_new"],
            tw["dk_part"],
            tw["dcum"],
            cu,
        )
    )
    row("prepare_back", {"dk": dk, "dv": dv, "dlog_g": dlog_g, "dbeta": dbeta}, final)
    for r in rows:
        r["bar"] = HALF if half else F32
        r["ok"] = all(e <= r["bar"] for e in r["errors"].values())
    return rows


def op_row(x: dict, run, half: bool) -> dict:
    """The whole op (forward and VJP through chunked.op) against mx.vjp of the twin."""
    mx = _mx()
    from metal_kernels.delta import chunked
    from mlxwalk.ops.delta import gated_delta_chunked

    prim = [x[n] for n in PRIMALS]
    cots = [x["dy"], x["dstate"]]
    up = [a.astype(mx.float32) for a in prim]
    upc = [a.astype(mx.float32) for a in cots]

    def through(fn, p, c):
        outputs, grads = mx.vjp(fn, p, c)
        return dict(zip(NAMES, [*outputs, *grads]))

    got = through(chunked.op(run=run, backend="cuda"), prim, cots)
    ref = through(gated_delta_chunked, up, upc)
    errors = {n: relative(got[n], ref[n]) for n in NAMES}
    row = {"kernel": "the op", "errors": errors, "bar": HALF if half else F32}
    if half:
        own = through(gated_delta_chunked, prim, cots)
        twin = {n: relative(own[n], ref[n]) for n in NAMES}
        row["twin"] = twin
        row["ok"] = all(errors[n] <= 1.5 * twin[n] + HALF for n in NAMES)
    else:
        row["ok"] = all(e <= F32 for e in errors.values())
    return row


def job_check(cases: list[int], emulate: bool) -> None:
    from metal_kernels import build

    if emulate:
        from metal_kernels import cuda_emulator

        run = cuda_emulator.launch
    else:
        run = build.launch
    for i in cases:
        name, batch, t, hk, hv, dim, dtype = CASES[i]
        base = {"kind": "check", "case": name, "dtype": dtype, "dim": dim}
        t0 = time.perf_counter()
        try:
            x = inputs(batch, t, hk, hv, dim, dtype, seed=i)
            half = dtype != "f32"
            for r in [*kernel_rows(x, run, half), op_row(x, run, half)]:
                jobs.emit({**base, **r})
        except Exception as e:  # a compile error, a launch failure: this case's row
            traceback.print_exc()
            row = {**base, "kernel": "(case)", "ok": False, "error": f"{type(e).__name__}: {e}"}
            jobs.emit(row)
        print(f"case {name}: {time.perf_counter() - t0:.1f} s", flush=True)


def layer_inputs(t: int) -> dict:
    return inputs(1, t, LAYER["hk"], LAYER["hv"], LAYER["dim"], "bf16")


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


def op_steps(variant: str, x: dict):
    """(forward, forward+backward) steps of one way to run the op."""
    mx = _mx()
    prim = [x[n] for n in PRIMALS]
    cots = [x["dy"], x["dstate"]]
    if variant == "new":
        from metal_kernels import build
        from metal_kernels.delta import chunked

        fn = chunked.op(run=build.launch, backend="cuda")
    elif variant == "mlx-fast":
        from mlxwalk.ops.delta.mlx_fast import gated_delta as fn
    else:  # ops, scans: the environment routes the recurrence
        from mlxwalk.ops.delta import gated_delta as fn
    return (
        lambda: mx.eval(fn(*prim)),
        lambda: mx.eval(mx.vjp(fn, prim, cots)),
    )


def kernel_steps(x: dict) -> dict:
    """Each CUDA kernel alone on its real inputs (evaluated beforehand)."""
    mx = _mx()
    from metal_kernels import build
    from metal_kernels.delta import chunked

    q, k, v, lg, beta, state = (x[n] for n in PRIMALS)
    s, cu = chunked.Sizes.of(q, v), "cuda"
    cum, w, u, tri = build.launch(chunked.prepare_launch(s, k, v, lg, beta, True, cu))
    h, vn, _ = build.launch(chunked.states_launch(s, k, w, u, cum, state, cu))
    mx.eval(cum, w, u, tri, h, vn)
    dh, dvn, _ = build.launch(chunked.states_back_launch(s, q, k, w, cum, x["dy"], x["dstate"], cu))
    mx.eval(dh, dvn)
    dq, dk, dw, dcum = build.launch(chunked.grads_launch(s, q, k, cum, h, vn, dh, dvn, x["dy"], cu))
    mx.eval(dq, dk, dw, dcum)
    calls = {
        "prepare": chunked.prepare_launch(s, k, v, lg, beta, False, cu),
        "states": chunked.states_launch(s, k, w, u, cum, state, cu),
        "output": chunked.output_launch(s, q, k, cum, h, vn, cu),
        "states_back": chunked.states_back_launch(s, q, k, w, cum, x["dy"], x["dstate"], cu),
        "grads": chunked.grads_launch(s, q, k, cum, h, vn, dh, dvn, x["dy"], cu),
        "prepare_back": chunked.prepare_back_launch(s, k, v, beta, cum, tri, dw, dvn, dk, dcum, cu),
    }
    return {name: (lambda c=c: mx.eval(*build.launch(c))) for name, c in calls.items()}


def job_time(variant: str, lengths: list[int], repeats: int, alone: list[int]) -> None:
    mx = _mx()
    for t in lengths:
        base = {"kind": "time", "variant": variant, "T": t}
        try:
            x = layer_inputs(t)
            forward, both = op_steps(variant, x)
            for part, step in (("forward", forward), ("fwd+bwd", both)):
                sec, over = timed(step, repeats)
                row = {**base, "part": part, "ms": sec * 1e3, "peak_gib": over / GIB}
                jobs.emit(row)
            if variant == "new" and t in alone:
                for name, step in kernel_steps(x).items():
                    sec, _ = timed(step, repeats)
                    row = {**base, "part": f"  {name}", "ms": sec * 1e3}
                    jobs.emit(row)
        except Exception as e:
            traceback.print_exc()
            row = {**base, "part": "fwd+bwd", "error": f"{type(e).__name__}: {str(e)[:300]}"}
            jobs.emit(row)
        mx.clear_cache()


def job_fla(lengths: list[int], repeats: int) -> None:
    """flash-linear-attention's chunk_gated_delta_rule: forward, and its backward if it runs."""
    try:
        import fla
        import torch
        import triton
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        note = f"fla {fla.__version__}, torch {torch.__version__}, triton {triton.__version__}"
    except Exception as e:
        for t in lengths:
            row = {"kind": "time", "variant": "fla", "T": t, "part": "fwd+bwd"}
            jobs.emit({**row, "error": f"not importable: {e}"})
        return

    def native(q, k, v, g, beta, s0):
        try:  # the state as (B, HV, DV, DK), as here
            return chunk_gated_delta_rule(
                q,
                k,
                v,
                g,
                beta,
                scale=1.0,
                initial_state=s0,
                output_final_state=True,
                state_v_first=True,
            )
        except TypeError:  # a version without state_v_first: (B, HV, DK, DV)
            y, s = chunk_gated_delta_rule(
                q,
                k,
                v,
                g,
                beta,
                scale=1.0,
                initial_state=s0.transpose(-1, -2).contiguous(),
                output_final_state=True,
            )
            return y, s.transpose(-1, -2)

    forms = ["value heads", "q, k repeated"]  # its grouped value heads, else q, k per value head

    def call(q, k, v, g, beta, s0):
        while True:
            try:
                if forms[0] == "value heads":
                    return native(q, k, v, g, beta, s0)
                r = v.shape[2] // q.shape[2]
                qr, kr = (a.repeat_interleave(r, dim=2) for a in (q, k))
                return native(qr, kr, v, g, beta, s0)
            except Exception:
                if len(forms) == 1:
                    raise
                forms.pop(0)

    def ms(step) -> float:
        step()
        torch.cuda.synchronize()
        out = []
        for _ in range(repeats):
            begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            begin.record()
            step()
            end.record()
            torch.cuda.synchronize()
            out.append(begin.elapsed_time(end))
        return statistics.median(out)

    for t in lengths:
        for row in fla_length(t, call, ms, forms, note):
            jobs.emit(row)
        torch.cuda.empty_cache()


def fla_length(t: int, call, ms, forms: list[str], note: str) -> list[dict]:
    """flash-linear-attention's rows at one length: its forward, then forward+backward."""
    import numpy as np
    import torch

    mx = _mx()
    base = {"kind": "time", "variant": "fla", "T": t}
    x = layer_inputs(t)
    dev, bf = torch.device("cuda"), torch.bfloat16

    def tensor(a, dtype=None):
        a = torch.from_numpy(np.array(a.astype(mx.float32))).to(dev)
        return a.to(dtype) if dtype is not None else a

    q, k, v = (tensor(x[n], bf).requires_grad_() for n in ("q", "k", "v"))
    g, s0 = tensor(x["log_g"]).requires_grad_(), tensor(x["state"]).requires_grad_()
    beta = tensor(x["beta"], bf).requires_grad_()
    dy, ds = tensor(x["dy"], bf), tensor(x["dstate"])
    primals = (q, k, v, g, beta, s0)
    try:
        with torch.no_grad():
            rows = [{**base, "part": "forward", "ms": ms(lambda: call(*primals))}]
        rows[0]["note"] = f"{note}; {forms[0]}"
    except Exception as e:
        return [{**base, "part": "forward", "error": str(e)[:300]}]

    def both():
        y, s = call(*primals)
        torch.autograd.grad((y, s), primals, (dy, ds))

    try:
        rows.append({**base, "part": "fwd+bwd", "ms": ms(both), "note": forms[0]})
    except Exception as e:  # the Hopper/Triton refusal lands here
        rows.append({**base, "part": "fwd+bwd", "error": f"refused: {str(e)[:240]}"})
    return rows


def sweep_shapes() -> dict:
    """Other CUDA block shapes per kernel at head dim 128, bf16 (blocks.CUDA's first)."""
    from metal_kernels.delta import blocks

    def c(warps: int, **template: int):
        return blocks.CudaBlocks(warps, tuple(template.items()), "")

    table = {
        "states": [c(4, BV=64, DKS=1), c(8, BV=64, DKS=2), c(2, BV=16, DKS=2)],
        "output": [c(4, BV=32), c(4, BV=128)],
        "states_back": [
            c(4, BV=64, DKS=1, STAGES=2),
            c(4, BV=32, DKS=2, STAGES=1),
            c(2, BV=16, DKS=2, STAGES=2),
        ],
        "grads": [c(4, KB=32), c(4, KB=128)],
    }
    return {k: [blocks.CUDA[(k, 128, "half")], *v] for k, v in table.items()}


def job_sweep(t: int, repeats: int) -> None:
    mx = _mx()
    from metal_kernels.delta import blocks

    x = layer_inputs(t)
    for kernel, shapes in sweep_shapes().items():
        for b in shapes:
            row = {"kind": "sweep", "T": t, "kernel": kernel, "blocks": dict(b.template)}
            try:
                blocks.CUDA[(kernel, 128, "half")] = b
                row["smem"] = blocks.cuda_shared_bytes(kernel, 128, 128, mx.bfloat16, b)
                sec, _ = timed(kernel_steps(x)[kernel], repeats)
                row["ms"] = sec * 1e3
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            jobs.emit(row)
        blocks.CUDA[(kernel, 128, "half")] = shapes[0]
        mx.clear_cache()


def run_job(spec: dict, a) -> None:
    kind = spec["kind"]
    if kind == "check":
        job_check(spec["cases"], a.emulate)
    elif kind == "time":
        job_time(spec["variant"], spec["lengths"], a.repeats, spec.get("alone", []))
    elif kind == "fla":
        job_fla(spec["lengths"], a.repeats)
    elif kind == "sweep":
        job_sweep(spec["T"], a.repeats)


# ---------------------------------------------------------------------------------------------
# The orchestrator


ENV = {  # per job kind and variant: the environment its child runs in
    "check": {"MLX_ENABLE_TF32": "0", "MLXWALK_KERNELS": "off"},
    "new": {"MLXWALK_KERNELS": "off"},
    "ops": {"MLXWALK_KERNELS": "off"},
    "scans": {"MLXWALK_KERNELS": "on"},
    "mlx-fast": {"MLXWALK_KERNELS": "off"},
}


def spawn(spec: dict, a, timeout: float, log: jobs.Log) -> tuple[list[dict], str]:
    """Run one job in a child; (its results, '' or why it ended early)."""
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--job",
        json.dumps(spec),
        "--repeats",
        str(a.repeats),
    ] + (["--emulate"] if a.emulate else [])
    env = dict(os.environ, **ENV.get(spec.get("variant", spec["kind"]), {}))
    return jobs.run(cmd, spec, timeout, log, env)


def check_table(rows: list[dict]) -> list[str]:
    out = [
        "| case | kernel | worst output | error | bar | verdict |",
        "|---|---|---|---:|---:|---|",
    ]
    for r in rows:
        if "errors" not in r:
            out.append(f"| {r['case']} | {r['kernel']} | | | | FAIL: {r.get('error', '')[:150]} |")
            continue
        bars = {n: r["bar"] + 1.5 * r.get("twin", {}).get(n, 0.0) for n in r["errors"]}
        worst = max(r["errors"], key=lambda n: r["errors"][n] / bars[n])  # the nearest its bar
        own = " (1e-4 + 1.5x the twin's own)" if "twin" in r else ""
        out.append(
            f"| {r['case']} | {r['kernel']} | {worst} | {r['errors'][worst]:.2e} | "
            f"{bars[worst]:.2e}{own} | {'PASS' if r['ok'] else 'FAIL'} |"
        )
    return out


def time_table(rows: list[dict]) -> list[str]:
    out = [
        "| T | variant | part | ms | peak GiB over inputs | note |",
        "|---:|---|---|---:|---:|---|",
    ]
    for r in rows:
        if "error" in r:
            out.append(
                f"| {r['T']} | {r['variant']} | {r.get('part', '')} | failed | | "
                f"{r['error'][:140]} |"
            )
            continue
        note = r.get("note", "")
        if r["variant"] == "new" and r["part"] == "fwd+bwd" and r["T"] == 16384:
            note = f"goal {GOAL_MS:.0f} ms: {'met' if r['ms'] <= GOAL_MS else 'not met'}"
        peak = f"{r['peak_gib']:.2f}" if "peak_gib" in r else ""
        out.append(f"| {r['T']} | {r['variant']} | {r['part']} | {r['ms']:.3f} | {peak} | {note} |")
    return out


def sweep_table(rows: list[dict]) -> list[str]:
    out = ["| T | kernel | blocks | shared B | ms | note |", "|---:|---|---|---:|---:|---|"]
    for r in rows:
        ms = f"{r['ms']:.3f}" if "ms" in r else "failed"
        out.append(
            f"| {r['T']} | {r['kernel']} | {r['blocks']} | {r.get('smem', '')} | {ms} | "
            f"{r.get('error', '')[:100]} |"
        )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--budget", type=float, default=300.0, help="seconds for the whole call")
    p.add_argument(
        "--parts", nargs="+", default=["check", "time", "sweep"], choices=["check", "time", "sweep"]
    )
    p.add_argument(
        "--variants",
        nargs="+",
        default=["new", "ops", "fla", "scans", "mlx-fast"],
        choices=["new", "ops", "fla", "scans", "mlx-fast"],
    )
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
    log = jobs.Log(os.environ.get("OUT"), "h200-delta")
    mx = _mx()
    device = "CPU emulator" if a.emulate else str(mx.default_device())
    log(
        f"# h200-delta: mlx {mx.__version__} on {device}; layer {LAYER['hk']}/{LAYER['hv']} "
        f"heads, dim {LAYER['dim']}, bf16; lengths {a.lengths}; repeats {a.repeats}"
    )
    if a.emulate:
        a.parts = ["check"]
    cases = (
        a.cases if a.cases is not None else (list(QUICK) if a.emulate else list(range(len(CASES))))
    )
    lengths = a.lengths
    queue = []  # (spec, timeout), in priority order
    if "check" in a.parts:
        queue.append(({"kind": "check", "cases": cases}, 3600.0 if a.emulate else 180.0))
    if "time" in a.parts:
        alone = [t for t in (16384, 65536) if t in lengths]
        order = {"new": 0, "ops": 1, "fla": 2, "scans": 3, "mlx-fast": 4}
        for v in sorted(a.variants, key=order.get):
            if v == "fla":
                queue.append(({"kind": "fla", "lengths": lengths}, 120.0))
            elif v == "mlx-fast":  # ops on CUDA: 3.5 s and 63 GB at 4K, past that out of reach
                queue.append(({"kind": "time", "variant": v, "lengths": lengths[:1]}, 90.0))
            elif v == "new":
                queue.append(
                    ({"kind": "time", "variant": v, "lengths": lengths, "alone": alone}, 150.0)
                )
            else:
                queue += [({"kind": "time", "variant": v, "lengths": [t]}, 60.0) for t in lengths]
    if "sweep" in a.parts:
        queue.append(({"kind": "sweep", "T": 16384}, 120.0))

    results: list[dict] = []
    for spec, limit in queue:
        left = deadline - time.perf_counter()
        if left < 15 and not a.emulate:
            log(f"skipped (time budget): {json.dumps(spec)}")
            results.append({"kind": "skipped", "spec": spec})
            continue
        got, why = spawn(spec, a, limit if a.emulate else min(limit, left - 5), log)
        results += got
        if why:
            log(f"job {json.dumps(spec)}: {why}")
            if spec["kind"] == "check" and not any(r["kind"] == "check" for r in got):
                results.append(
                    {"kind": "check", "case": "(job)", "kernel": "", "ok": False, "error": why}
                )
            elif spec["kind"] in ("time", "fla"):
                variant = spec.get("variant", "fla")
                done = {r["T"] for r in got if r.get("part") == "fwd+bwd"}
                results += [
                    {"kind": "time", "variant": variant, "T": t, "part": "fwd+bwd", "error": why}
                    for t in spec["lengths"]
                    if t not in done
                ]
        for r in got:
            if r["kind"] == "check":
                tag = "PASS" if r.get("ok") else f"FAIL {r.get('errors') or r.get('error')}"
                log(f"check {r['case']} / {r['kernel']}: {tag}")
            elif r["kind"] == "time" and "ms" in r:
                log(f"time {r['variant']} T={r['T']} {r['part'].strip()}: {r['ms']:.3f} ms")

    checks = [r for r in results if r["kind"] == "check"]
    times = [r for r in results if r["kind"] == "time"]
    sweeps = [r for r in results if r["kind"] == "sweep"]
    if checks:
        log("\n## Checks (relative L2 error against the float32 ops twin)\n")
        log("\n".join(check_table(checks)))
    if times:
        order = {"new": 0, "ops": 1, "scans": 2, "mlx-fast": 3, "fla": 4}
        times.sort(key=lambda r: (r["T"], order.get(r["variant"], 9)))
        log(
            f"\n## One Qwen3.5 gated delta-net layer ({LAYER['hk']}/{LAYER['hv']} heads, dim "
            f"{LAYER['dim']}, bf16, a non-zero state)\n"
        )
        log("\n".join(time_table(times)))
        log(
            "\nflash-linear-attention's published H200 figures at this shape: forward 0.47 ms "
            "(8K), 1.89 ms (32K); backward 1.44 ms (8K), 5.70 ms (32K): ~3.8 ms fwd+bwd at 16K, "
            f"so the goal, 3x: {GOAL_MS:.0f} ms."
        )
    if sweeps:
        log(
            "\n## Block shapes, each kernel alone at 16K (the first row per kernel: "
            "blocks.CUDA's)\n"
        )
        log("\n".join(sweep_table(sweeps)))
    skipped = [r for r in results if r["kind"] == "skipped"]
    if skipped:
        log(f"\nskipped for time: {len(skipped)} jobs")
    failed = [r for r in checks if not r.get("ok")]
    log(
        f"\n{len(checks) - len(failed)}/{len(checks)} checks passed; "
        f"{time.perf_counter() - t_start:.0f} s"
    )
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "h200-delta.json").write_text(json.dumps(results, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
