"""The kernel path: chunk attention through metal_kernels/attention, the store read in place.
Same contract as the twin's forward and backward (the log-sum-exp in the kernels' layout)."""

from __future__ import annotations

import metal_kernels.attention as attention_kernels

from .. import routing
from .prefix import Prefix


def _store(prefix: Prefix | None):
    if prefix is None:
        return None, None, 0
    return (*prefix.in_place(), prefix.end)


def forward(q, k, v, prefix, grad_from, scale, tile):
    pk, pv, start = _store(prefix)
    tc = attention_kernels.tensor_cores(q, routing.backend())
    o, lse = attention_kernels.forward(q, k, v, pk, pv, start, scale, run=routing.launch, tc=tc)
    return o.astype(q.dtype), lse


def backward(q, k, v, prefix, grad_from, scale, tile, out, lse, d_out):
    pk, pv, start = _store(prefix)
    tc = attention_kernels.tensor_cores(q, routing.backend())
    dq, dk, dv = attention_kernels.backward(
        q, k, v, pk, pv, start, grad_from, scale, out, lse, d_out, run=routing.launch, tc=tc
    )
    taps = start - grad_from
    grads = [dq.astype(q.dtype), dk[:, :, taps:].astype(k.dtype), dv[:, :, taps:].astype(v.dtype)]
    if taps:
        grads += [dk[:, :, :taps], dv[:, :, :taps]]
    return grads
