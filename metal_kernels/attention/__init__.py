"""How the chunk-attention kernels are called.

A chunk's L queries attend to the cached prefix [0, start), read in place from the walk's K/V
store, then causally to the chunk's own L keys. Three kernels, FlashAttention-2's split without
atomics (Apple GPUs emulate float atomics):
  forward: the output and the log-sum-exp per query row;
  dq:      dQ per query row, scores recomputed from the log-sum-exp, delta = rowsum(dO * O);
  dkdv:    dK/dV per key row, for the tapped prefix [grad_from, start) and the chunk's own keys
           only (the fixed prefix takes no gradient), summed over the grouped query heads.
Accumulation is float32 whatever the inputs' dtype; outputs are float32.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from ..build import Launch, Spec, launch

Runner = Callable[[Launch], list[mx.array]]

ROWS = 4  # rows (simdgroups of 32 threads) per threadgroup
DIMS = tuple(range(32, 257, 32))  # head dims the kernels take: D / 32 per lane
INPUTS = ("q", "k", "v", "pk", "pv", "params", "scale")
FORWARD = Spec("attention/forward", INPUTS, ("o", "lse"))
DQ = Spec("attention/dq", (*INPUTS[:5], "d_out", "lse", "delta", *INPUTS[5:]), ("dq",))
DKDV = Spec("attention/dkdv", DQ.inputs, ("dk", "dv"))


def supports(q: mx.array, k: mx.array, store_dtype: mx.Dtype | None) -> bool:
    """The shapes and dtypes these kernels take (an 8-bit store, for one, they do not)."""
    floats = (mx.float32, mx.float16, mx.bfloat16)
    hq, hkv, dim = q.shape[1], k.shape[1], q.shape[-1]
    return (
        dim in DIMS
        and hq % hkv == 0
        and q.dtype in floats
        and k.dtype == q.dtype
        and (store_dtype is None or store_dtype in floats)
    )


def _common(q, k, v, pk, pv, start, grad_from, scale):
    """Inputs (no prefix: the chunk's own K/V stand in for an empty store) and template."""
    if pk is None:
        pk, pv, start, grad_from = k, v, 0, 0
    b, hq, n, dim = q.shape
    params = [b, hq, k.shape[1], n, pk.shape[2], start, grad_from, pk.shape[0]]
    inputs = [q, k, v, pk, pv]
    extra = [mx.array(params, mx.int32), mx.array([scale], mx.float32)]
    template = [("T", q.dtype), ("S", pk.dtype), ("D", dim), ("ROWS", ROWS)]
    return inputs, extra, template, start - grad_from


def _grid(rows: int) -> dict:
    groups = -(-rows // ROWS)
    return {"grid": (groups * 32 * ROWS, 1, 1), "threadgroup": (32 * ROWS, 1, 1)}


def forward_launch(q, k, v, pk, pv, start: int, scale: float) -> Launch:
    inputs, extra, template, _ = _common(q, k, v, pk, pv, start, start, scale)
    b, hq, n, dim = q.shape
    shapes = [q.shape, (b, hq, n)]
    return Launch(FORWARD, inputs + extra, shapes, [mx.float32] * 2, template=template,
                  **_grid(b * hq * n))  # fmt: skip


def backward_launches(q, k, v, pk, pv, start, grad_from, scale, lse, delta, d_out):
    """(dq's launch, dkdv's launch); dkdv's rows are the taps [grad_from, start) then the own."""
    inputs, extra, template, taps = _common(q, k, v, pk, pv, start, grad_from, scale)
    inputs = inputs + [d_out, lse, delta] + extra
    b, hq, n, dim = q.shape
    hkv = k.shape[1]
    dq = Launch(DQ, inputs, [q.shape], [mx.float32], template=template, **_grid(b * hq * n))
    rows = (b, hkv, taps + n, dim)
    dkdv = Launch(DKDV, inputs, [rows, rows], [mx.float32] * 2, template=template,
                  **_grid(b * hkv * (taps + n)))  # fmt: skip
    return dq, dkdv


def forward(q, k, v, pk, pv, start: int, scale: float, run: Runner = launch):
    """(o, lse), both float32: o (B, HQ, L, D), lse (B, HQ, L). `run` launches a call (on the
    GPU by default; the CPU harness in tests)."""
    return run(forward_launch(q, k, v, pk, pv, start, scale))


def backward(q, k, v, pk, pv, start, grad_from, scale, o, lse, d_out, run: Runner = launch):
    """(dq, dk, dv) in float32; dk and dv (B, HKV, start - grad_from + L, D), taps first."""
    delta = (d_out.astype(mx.float32) * o.astype(mx.float32)).sum(axis=-1)  # (B, HQ, L)
    dq, dkdv = backward_launches(q, k, v, pk, pv, start, grad_from, scale, lse, delta, d_out)
    return (*run(dq), *run(dkdv))
