"""How the chunk-attention kernels are called.

A chunk's L queries attend to the cached prefix [0, start), read in place from the walk's K/V
store, then causally to the chunk's own L keys. Three kernels, FlashAttention-2's split without
atomics (Apple GPUs emulate float atomics):
  forward: the output and the log-sum-exp per query row;
  dq:      dQ per query row, scores recomputed from the log-sum-exp, delta = rowsum(dO * O);
  dkdv:    dK/dV per key row, for the tapped prefix [grad_from, start) and the chunk's own keys
           only (the fixed prefix takes no gradient), summed over the grouped query heads.
Accumulation is float32 whatever the inputs' dtype; outputs are float32.

Each has a Metal body and its CUDA twin (the same algorithm, scalar float32 arithmetic with one
simdgroup per row). On CUDA, float16/bfloat16 inputs take tensor-core variants instead
(`*_tc.cu`, CUDA only: nvcuda::wmma products, the same contract and float32 softmax).
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
TC = ("common", "common_tc")
FORWARD_TC = Spec("attention/forward_tc", FORWARD.inputs, FORWARD.outputs, TC, ("cuda",))
DQ_TC = Spec("attention/dq_tc", DQ.inputs, DQ.outputs, TC, ("cuda",))
DKDV_TC = Spec("attention/dkdv_tc", DKDV.inputs, DKDV.outputs, TC, ("cuda",))
BK = 32  # the tensor-core kernels' tile of keys (forward, dq) or queries (dkdv)


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


def tensor_cores(q: mx.array, backend: str | None) -> bool:
    """Whether the tensor-core variants run: on CUDA, for float16 and bfloat16 inputs."""
    return backend == "cuda" and q.dtype in (mx.float16, mx.bfloat16)


def _warps(dim: int) -> int:
    return 2 if dim > 128 else 4  # a block's warps: shared memory stays under 227 KiB


def _tc_grid(rows: int, dim: int) -> dict:
    """Blocks of 16 rows per warp (the tensor-core kernels)."""
    w = _warps(dim)
    blocks = -(-rows // (16 * w))
    return {"grid": (blocks * 32 * w, 1, 1), "threadgroup": (32 * w, 1, 1)}


def _tc_shared(kind: str, dim: int, itemsize: int) -> int:
    """Bytes of shared memory each tensor-core kernel carves (see its source and Pitch in
    common_tc.cuh: rows padded by 8 elements of T or 4 floats)."""
    r, k = 16 * _warps(dim), BK
    ld, lp, ls, la = dim + 8, k + 8, k + 4, dim + 4
    halves, floats = {
        "forward": (r * ld + 2 * k * ld + r * lp, r * ls + r * la + r),
        "dq": (2 * r * ld + 2 * k * ld + r * lp, 2 * r * ls + r * la),
        "dkdv": (2 * r * ld + 2 * k * ld + 2 * r * lp, 2 * r * ls + 2 * r * la + 2 * k),
    }[kind]
    return halves * itemsize + floats * 4


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


def forward_launch(q, k, v, pk, pv, start: int, scale: float, tc: bool = False) -> Launch:
    inputs, extra, template, _ = _common(q, k, v, pk, pv, start, start, scale)
    b, hq, n, dim = q.shape
    shapes, dtypes = [q.shape, (b, hq, n)], [mx.float32] * 2
    if tc:
        grid = _tc_grid(n, dim)
        grid["grid"] = (grid["grid"][0] * b * hq, 1, 1)
        return Launch(FORWARD_TC, inputs + extra, shapes, dtypes, **grid,
                      template=template[:3] + [("W", _warps(dim))],
                      shared_memory=_tc_shared("forward", dim, q.dtype.size))  # fmt: skip
    return Launch(FORWARD, inputs + extra, shapes, dtypes, template=template, **_grid(b * hq * n))


def backward_launches(q, k, v, pk, pv, start, grad_from, scale, lse, delta, d_out, tc=False):
    """(dq's launch, dkdv's launch); dkdv's rows are the taps [grad_from, start) then the own."""
    inputs, extra, template, taps = _common(q, k, v, pk, pv, start, grad_from, scale)
    inputs = inputs + [d_out, lse, delta] + extra
    b, hq, n, dim = q.shape
    hkv = k.shape[1]
    rows = (b, hkv, taps + n, dim)
    if tc:
        tct = template[:3] + [("W", _warps(dim))]
        g_dq, g_kv = _tc_grid(n, dim), _tc_grid(taps + n, dim)
        g_dq["grid"] = (g_dq["grid"][0] * b * hq, 1, 1)
        g_kv["grid"] = (g_kv["grid"][0] * b * hkv, 1, 1)
        size = q.dtype.size
        dq = Launch(DQ_TC, inputs, [q.shape], [mx.float32], **g_dq, template=tct,
                    shared_memory=_tc_shared("dq", dim, size))  # fmt: skip
        dkdv = Launch(DKDV_TC, inputs, [rows, rows], [mx.float32] * 2, **g_kv, template=tct,
                      shared_memory=_tc_shared("dkdv", dim, size))  # fmt: skip
        return dq, dkdv
    dq = Launch(DQ, inputs, [q.shape], [mx.float32], template=template, **_grid(b * hq * n))
    dkdv = Launch(DKDV, inputs, [rows, rows], [mx.float32] * 2, template=template,
                  **_grid(b * hkv * (taps + n)))  # fmt: skip
    return dq, dkdv


def forward(q, k, v, pk, pv, start: int, scale: float, run: Runner = launch, tc: bool = False):
    """(o, lse), both float32: o (B, HQ, L, D), lse (B, HQ, L). `run` launches a call (on the
    GPU by default; the CPU harness in tests); `tc`: the tensor-core variant."""
    return run(forward_launch(q, k, v, pk, pv, start, scale, tc))


def backward(q, k, v, pk, pv, start, grad_from, scale, o, lse, d_out, run=launch, tc=False):
    """(dq, dk, dv) in float32; dk and dv (B, HKV, start - grad_from + L, D), taps first."""
    delta = (d_out.astype(mx.float32) * o.astype(mx.float32)).sum(axis=-1)  # (B, HQ, L)
    calls = backward_launches(q, k, v, pk, pv, start, grad_from, scale, lse, delta, d_out, tc)
    return (*run(calls[0]), *run(calls[1]))
