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


def supports(q: mx.array, k: mx.array, v: mx.array, store_dtype: mx.Dtype | None) -> bool:
    """The shapes and dtypes these kernels take (an 8-bit store, for one, they do not; nor values
    of another head dim than the keys')."""
    floats = (mx.float32, mx.float16, mx.bfloat16)
    hq, hkv, dim = q.shape[1], k.shape[1], q.shape[-1]
    return (
        dim in DIMS
        and k.shape[-1] == dim
        and v.shape[-1] == dim
        and hq % hkv == 0
        and q.dtype in floats
        and k.dtype == q.dtype
        and (store_dtype is None or store_dtype in floats)
    )


def tensor_cores(q: mx.array, backend: str | None) -> bool:
    """Whether the tensor-core variants run: on CUDA, for float16 and bfloat16 inputs."""
    return backend == "cuda" and q.dtype in (mx.float16, mx.bfloat16)


def _warps(kind: str, dim: int) -> int:
    """A tensor-core block's warps: 4, or 2 where shared memory would allow one block per SM."""
    return 2 if dim > 128 and kind != "forward" else 4


def _tc(kind: str, rows: int, dim: int, itemsize: int, heads: int) -> dict:
    """Grid, block, W and shared memory of a tensor-core kernel over `rows` rows per head."""
    w = _warps(kind, dim)
    blocks = -(-rows // (16 * w)) * heads
    return {"grid": (blocks * 32 * w, 1, 1), "threadgroup": (32 * w, 1, 1),
            "shared_memory": _tc_shared(kind, dim, itemsize), "w": w}  # fmt: skip


def _tc_shared(kind: str, dim: int, itemsize: int) -> int:
    """Bytes of shared memory a tensor-core kernel carves (see its source and Pitch in
    common_tc.cuh: rows padded by 8 elements of T or 4 floats; the output tile of the forward
    and dq reuses the space at the end)."""
    r, k = 16 * _warps(kind, dim), BK
    ld, lp, ls, la = dim + 8, k + 8, k + 4, dim + 4
    halves, floats, final = {
        "forward": (r * ld + 2 * k * ld + r * lp, r * ls + r, r * la),
        "dq": (2 * r * ld + 2 * k * ld + r * lp, 2 * r * ls, r * la),
        "dkdv": (2 * r * ld + 2 * k * ld + 2 * r * lp, 2 * r * ls + 2 * k, 0),
    }[kind]
    return max(halves * itemsize + floats * 4, final * 4)


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
        g = _tc("forward", n, dim, q.dtype.size, b * hq)
        return Launch(FORWARD_TC, inputs + extra, shapes, dtypes, g["grid"], g["threadgroup"],
                      template[:3] + [("W", g["w"])], g["shared_memory"])  # fmt: skip
    return Launch(FORWARD, inputs + extra, shapes, dtypes, template=template, **_grid(b * hq * n))


def backward_launches(q, k, v, pk, pv, start, grad_from, scale, lse, delta, d_out, tc=False):
    """(dq's launch, dkdv's launch); dkdv's rows are the taps [grad_from, start) then the own
    (the tensor-core kernel's padded to whole blocks)."""
    inputs, extra, template, taps = _common(q, k, v, pk, pv, start, grad_from, scale)
    inputs = inputs + [d_out, lse, delta] + extra
    b, hq, n, dim = q.shape
    hkv = k.shape[1]
    if tc:
        g = _tc("dq", n, dim, q.dtype.size, b * hq)
        dq = Launch(DQ_TC, inputs, [q.shape], [mx.float32], g["grid"], g["threadgroup"],
                    template[:3] + [("W", g["w"])], g["shared_memory"])  # fmt: skip
        g = _tc("dkdv", taps + n, dim, q.dtype.size, b * hkv)
        padded = -(-(taps + n) // (16 * g["w"])) * 16 * g["w"]
        rows = (b, hkv, padded, dim)
        tct = template[:3] + [("W", g["w"])]
        dkdv = Launch(DKDV_TC, inputs, [rows, rows], [mx.float32] * 2, g["grid"],
                      g["threadgroup"], tct, g["shared_memory"])  # fmt: skip
        return dq, dkdv
    rows = (b, hkv, taps + n, dim)
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
    rows = (start - grad_from if pk is not None else 0) + q.shape[2]  # past them: padding
    dk, dv = run(calls[1])
    return run(calls[0])[0], dk[:, :, :rows], dv[:, :, :rows]
