"""The kernel path: chunk attention through metal_kernels/attention, the store read in place.
Same contract as the twin's forward and backward (the log-sum-exp in the kernels' layout).

On Metal a layer's launch is split over its K/V heads where one launch would run past
roofline.LIMIT_S on the smallest M-series GPU (macOS ends a GPU command that runs too long): the
27B shape's dq and dkdv at 64K in four, the 8B's in two (docs/MAC.md). Every head is computed
alone in either case, so a split changes no bit of the result."""

from __future__ import annotations

import math

import mlx.core as mx

import metal_kernels.attention as attention_kernels
from metal_kernels import roofline
from metal_kernels.attention import Q8

from .. import routing
from .prefix import Prefix


def _store(prefix: Prefix | None):
    if prefix is None:
        return None, None, 0
    return (*prefix.in_place(), prefix.end)


def launches_needed(
    kernels: tuple[str, ...],
    batch: int,
    heads: int,
    kv_heads: int,
    dim: int,
    chunk: int,
    start: int,
    grad_from: int,
    dtype: mx.Dtype,
    store: mx.Dtype,
) -> int:
    """How many launches over groups of K/V heads keep each of `kernels` ("forward", "dq",
    "dkdv") under roofline.LIMIT_S on the smallest M-series GPU; at most one per K/V head."""
    layer = roofline.attention(heads, kv_heads, dim, chunk, start, grad_from, dtype, store)
    worst = max(x.seconds(roofline.M1_7CORE) for x in layer if x.kernel.split("/")[1] in kernels)
    return min(kv_heads, max(1, math.ceil(batch * worst / roofline.LIMIT_S)))


def head_groups(kernels: tuple[str, ...], q, k, pk, start: int, grad_from: int) -> list[slice]:
    """The K/V heads in the groups a launch each takes: one group off Metal."""
    b, hq, n, dim = q.shape  # (B, HQ, L, D)
    hkv = k.shape[1]  # k: (B, HKV, L, D)
    if routing.backend() != "metal":
        return [slice(0, hkv)]
    # an 8-bit store's bytes taken as its scales' dtype's: more than it reads (a split too many)
    store = k.dtype if pk is None else (pk.scales.dtype if isinstance(pk, Q8) else pk.dtype)
    groups = launches_needed(kernels, b, hq, hkv, dim, n, start, grad_from, q.dtype, store)
    bounds = [i * hkv // groups for i in range(groups + 1)]
    return [slice(a, z) for a, z in zip(bounds, bounds[1:])]


def _heads(group: slice, ratio: int, query_side: list, kv_side: list) -> list:
    """The arrays of one group: query-head arrays (axis 1 HQ) and K/V-head arrays (axis 1 HKV)."""
    q_heads = slice(group.start * ratio, group.stop * ratio)
    return [None if a is None else a[:, q_heads] for a in query_side] + [
        None if a is None else a[:, group] for a in kv_side
    ]


def _joined(parts: list[tuple]) -> list:
    """Each output's parts along the head axis (the parts themselves when there is one group)."""
    if len(parts) == 1:
        return list(parts[0])
    return [mx.concatenate(outs, axis=1) for outs in zip(*parts)]


def forward(q, k, v, prefix, grad_from, scale, tile):
    pk, pv, start = _store(prefix)
    tc = attention_kernels.tensor_cores(q, routing.backend())
    groups = head_groups(("forward",), q, k, pk, start, grad_from)
    ratio = q.shape[1] // k.shape[1]
    parts = []
    for g in groups:
        qg, kg, vg, pkg, pvg = (
            _heads(g, ratio, [q], [k, v, pk, pv]) if len(groups) > 1 else (q, k, v, pk, pv)
        )
        parts.append(
            attention_kernels.forward(qg, kg, vg, pkg, pvg, start, scale, run=routing.launch, tc=tc)
        )
    o, lse = _joined(parts)  # o (B, HQ, L, D), lse (B, HQ, L), float32
    return o.astype(q.dtype), lse


def backward(q, k, v, prefix, grad_from, scale, tile, out, lse, d_out):
    pk, pv, start = _store(prefix)
    tc = attention_kernels.tensor_cores(q, routing.backend())
    groups = head_groups(("dq", "dkdv"), q, k, pk, start, grad_from)
    ratio = q.shape[1] // k.shape[1]
    parts = []
    for g in groups:
        arrays = (q, out, lse, d_out, k, v, pk, pv)
        if len(groups) > 1:
            arrays = _heads(g, ratio, [q, out, lse, d_out], [k, v, pk, pv])
        qg, og, lg, dg, kg, vg, pkg, pvg = arrays
        parts.append(
            attention_kernels.backward(
                qg, kg, vg, pkg, pvg, start, grad_from, scale, og, lg, dg, run=routing.launch, tc=tc
            )
        )
    dq, dk, dv = _joined(parts)  # dq (B, HQ, L, D); dk, dv (B, HKV, taps + L, D), float32
    taps = start - grad_from
    grads = [dq.astype(q.dtype), dk[:, :, taps:].astype(k.dtype), dv[:, :, taps:].astype(v.dtype)]
    if taps:
        grads += [dk[:, :, :taps], dv[:, :, :taps]]
    return grads
