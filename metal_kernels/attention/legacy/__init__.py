"""The first tensor-core attention kernels (nvcuda::wmma 16x16x16 products, operands staged in
shared memory, one barrier pair per 32-key tile), kept so that a benchmark can time them beside
their replacement (metal_kernels/attention/tensor_cores.py). CUDA only; float16/bfloat16 inputs;
the contract of metal_kernels/attention (dkdv's rows padded to whole blocks)."""

from __future__ import annotations

import mlx.core as mx

from ...build import Launch, Spec

INPUTS = ("q", "k", "v", "pk", "pv", "params", "scale")
BACKWARD_INPUTS = (*INPUTS[:5], "d_out", "lse", "delta", *INPUTS[5:])
HEADERS = ("common", "common_tc")
FORWARD = Spec("attention/legacy/forward_tc", INPUTS, ("o", "lse"), HEADERS, ("cuda",))
DQ = Spec("attention/legacy/dq_tc", BACKWARD_INPUTS, ("dq",), HEADERS, ("cuda",))
DKDV = Spec("attention/legacy/dkdv_tc", BACKWARD_INPUTS, ("dk", "dv"), HEADERS, ("cuda",))
BK = 32  # the tile of keys (forward, dq) or queries (dkdv)


def _warps(kind: str, dim: int) -> int:
    return 2 if dim > 128 and kind != "forward" else 4


def _shared(kind: str, dim: int, itemsize: int) -> int:
    r, k = 16 * _warps(kind, dim), BK
    ld, lp, ls, la = dim + 8, k + 8, k + 4, dim + 4
    halves, floats, final = {
        "forward": (r * ld + 2 * k * ld + r * lp, r * ls + r, r * la),
        "dq": (2 * r * ld + 2 * k * ld + r * lp, 2 * r * ls, r * la),
        "dkdv": (2 * r * ld + 2 * k * ld + 2 * r * lp, 2 * r * ls + 2 * k, 0),
    }[kind]
    return max(halves * itemsize + floats * 4, final * 4)


def _geometry(kind: str, rows: int, dim: int, itemsize: int, heads: int) -> dict:
    w = _warps(kind, dim)
    blocks = -(-rows // (16 * w)) * heads
    return {
        "grid": (blocks * 32 * w, 1, 1),
        "threadgroup": (32 * w, 1, 1),
        "shared_memory": _shared(kind, dim, itemsize),
        "w": w,
    }


def _common(q, k, v, pk, pv, start, grad_from, scale):
    if pk is None:
        pk, pv, start, grad_from = k, v, 0, 0
    b, hq, n, dim = q.shape
    params = [b, hq, k.shape[1], n, pk.shape[2], start, grad_from, pk.shape[0]]
    extra = [mx.array(params, mx.int32), mx.array([scale], mx.float32)]
    template = [("T", q.dtype), ("S", pk.dtype), ("D", dim)]
    return [q, k, v, pk, pv], extra, template, start - grad_from


def forward_launch(q, k, v, pk, pv, start: int, scale: float) -> Launch:
    inputs, extra, template, _ = _common(q, k, v, pk, pv, start, start, scale)
    b, hq, n, dim = q.shape
    g = _geometry("forward", n, dim, q.dtype.size, b * hq)
    return Launch(
        FORWARD,
        inputs + extra,
        [q.shape, (b, hq, n)],
        [mx.float32] * 2,
        g["grid"],
        g["threadgroup"],
        template + [("W", g["w"])],
        g["shared_memory"],
    )


def backward_launches(q, k, v, pk, pv, start, grad_from, scale, lse, delta, d_out):
    """(dq's launch, dkdv's launch); dkdv's rows padded to whole blocks."""
    inputs, extra, template, taps = _common(q, k, v, pk, pv, start, grad_from, scale)
    inputs = inputs + [d_out, lse, delta] + extra
    b, hq, n, dim = q.shape
    hkv = k.shape[1]
    g = _geometry("dq", n, dim, q.dtype.size, b * hq)
    dq = Launch(
        DQ,
        inputs,
        [q.shape],
        [mx.float32],
        g["grid"],
        g["threadgroup"],
        template + [("W", g["w"])],
        g["shared_memory"],
    )
    g = _geometry("dkdv", taps + n, dim, q.dtype.size, b * hkv)
    padded = -(-(taps + n) // (16 * g["w"])) * 16 * g["w"]
    rows = (b, hkv, padded, dim)
    dkdv = Launch(
        DKDV,
        inputs,
        [rows, rows],
        [mx.float32] * 2,
        g["grid"],
        g["threadgroup"],
        template + [("W", g["w"])],
        g["shared_memory"],
    )
    return dq, dkdv
