"""The chunked rule's sequential part in MLX ops: the state carried from chunk to chunk, and its
adjoint walked in reverse. The reference and the fallback of the scan kernels (scan.py), and the
CPU path; chunk.py builds the chunk factors it consumes."""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx


class Factors(NamedTuple):
    """The chunk factors chunk.py builds and the sequential part consumes, each
    (n chunks, B, Hk, r, c, ...): r value heads per key head, c positions per chunk."""

    u0: mx.array  # (..., c, Dv): the chunk's writes T diag(beta) V, before the state's share
    w: mx.array  # (..., c, Dk): T diag(beta gamma) K, what the entering state takes from u0
    qg: mx.array  # (..., c, Dk): the queries, decayed from the chunk's start
    p: mx.array  # (..., c, c): (Q K^T) times the decay, causal
    kd: mx.array  # (..., c, Dk): the keys, decayed to the chunk's end
    g_end: mx.array  # (..., 1, 1): the chunk's whole decay


def walk(f: Factors, s: mx.array, keep: bool = True):
    """The sequential part in MLX ops, no gradient: (outputs, exit state, entry states if
    `keep`)."""
    return _walk_chunks(*f, s, keep)


def recurrence(f: Factors, s: mx.array):
    """The same, differentiable: its VJP walks the adjoint in reverse from the entry states it
    keeps. (outputs, exit state, entry states)."""
    return _recurrence_with_states(*f, s)


def _walk_chunks(u0, w, qg, p, kd, g_end, s, keep: bool = True):
    """The sequential part: carry the state through the chunks; (outputs, exit, entry states),
    the entry states only if `keep` (the VJP's)."""
    outs, entries = [], []
    for i in range(u0.shape[0]):
        if keep:
            entries.append(s)
        st = s.swapaxes(-1, -2)  # (B, H, Dk, Dv)
        u = u0[i] - w[i] @ st
        outs.append(qg[i] @ st + p[i] @ u)
        s = g_end[i] * s + u.swapaxes(-1, -2) @ kd[i]
    return mx.stack(outs), s, (mx.stack(entries) if keep else None)


@mx.custom_function
def _recurrence_with_states(u0, w, qg, p, kd, g_end, s):
    return _walk_chunks(u0, w, qg, p, kd, g_end, s)


@_recurrence_with_states.vjp
def _recurrence_vjp(primals, cotangents, outputs):
    """The chunk recurrence's adjoint, walked in reverse; per-chunk gradients are stacked
    (differentiating slices instead would scatter each into a full-size zero array)."""
    u0, w, qg, p, kd, g_end, _ = primals
    d_out, ds = cotangents[0], cotangents[1]
    entries = outputs[2]
    grads = {k: [] for k in ("u0", "w", "qg", "p", "kd", "g")}
    for i in reversed(range(u0.shape[0])):
        s, do = entries[i], d_out[i]
        u = u0[i] - w[i] @ s.swapaxes(-1, -2)
        du = p[i].swapaxes(-1, -2) @ do + kd[i] @ ds.swapaxes(-1, -2)
        grads["p"].append(do @ u.swapaxes(-1, -2))
        grads["qg"].append(do @ s)
        grads["kd"].append(u @ ds)
        grads["g"].append((ds * s).sum(axis=(-1, -2), keepdims=True))
        grads["u0"].append(du)
        grads["w"].append(-(du @ s))
        ds = g_end[i] * ds + do.swapaxes(-1, -2) @ qg[i] - du.swapaxes(-1, -2) @ w[i]
    g = {k: mx.stack(v[::-1]) for k, v in grads.items()}
    return g["u0"], g["w"], g["qg"], g["p"], g["kd"], g["g"], ds
