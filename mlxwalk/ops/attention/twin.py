"""The ops twin: chunk attention in pure MLX ops, walked in tiles. It runs on every backend and
is the reference the kernels are checked against, the fallback, and the CPU path.

  forward:  online softmax over the prefix tiles (read from the K/V store in its own format,
            8-bit dequantized tile by tile) and the chunk's causal block; returns the output and
            the log-sum-exp;
  backward: per tile, scores recomputed from the saved log-sum-exp, dQ accumulated, dK/dV of the
            tile summed over grouped-query heads, for the taps (the horizon) and the chunk only.
"""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx

TILE = 1024


def _tiles(start: int, end: int, tile: int) -> Iterator[tuple[int, int]]:
    for a in range(start, end, tile):
        yield a, min(a + tile, end)


def _segments(prefix, grad_from, k, v, tile):
    """(keys, values, kind, start) over the window: fixed prefix, tapped prefix, own block."""
    if prefix is not None:
        for a, b in _tiles(0, grad_from, tile):
            yield (*prefix.read(a, b), "fixed", a)
        for a, b in _tiles(grad_from, prefix.end, tile):
            yield (*prefix.read(a, b), "tap", a)
    yield k, v, "own", None


def _scores(qs, kt, own):
    """(B, Hkv, r, L, T) scores of scaled queries against a key tile; own = causal block."""
    s = qs @ kt.astype(mx.float32)[:, :, None].swapaxes(-1, -2)
    if own:
        n = s.shape[-1]
        s = mx.where(mx.tril(mx.ones((n, n), dtype=mx.bool_)), s, -mx.inf)
    return s


def forward(q, k, v, prefix, grad_from, scale, tile):
    b, hq, n, _ = q.shape
    hkv = k.shape[1]
    qs = (q.astype(mx.float32) * scale).reshape(b, hkv, hq // hkv, n, -1)
    m = mx.full((*qs.shape[:-1], 1), -mx.inf)
    denom = mx.zeros_like(m)
    acc = mx.zeros((*qs.shape[:-1], v.shape[-1]), mx.float32)
    for kt, vt, kind, _ in _segments(prefix, grad_from, k, v, tile):
        # the tile's scores only after the previous tile is folded in: one tile alive at a time
        qs = mx.depends(qs, [acc, denom])
        s = _scores(qs, kt, kind == "own")
        m_new = mx.maximum(m, s.max(axis=-1, keepdims=True))
        p = mx.exp(s - m_new)
        corr = mx.exp(m - m_new)
        denom = denom * corr + p.sum(axis=-1, keepdims=True)
        acc = acc * corr + p @ vt.astype(mx.float32)[:, :, None]
        m = m_new
    out = (acc / denom).reshape(b, hq, n, -1).astype(q.dtype)
    return out, m + mx.log(denom)


def backward(q, k, v, prefix, grad_from, scale, tile, out, lse, d_out):
    b, hq, n, _ = q.shape
    hkv = k.shape[1]
    shape5 = (b, hkv, hq // hkv, n, -1)
    qs = (q.astype(mx.float32) * scale).reshape(shape5)
    do = d_out.astype(mx.float32).reshape(shape5)
    delta = (do * out.astype(mx.float32).reshape(shape5)).sum(axis=-1, keepdims=True)
    dq = mx.zeros(qs.shape, mx.float32)
    taps_k, taps_v, own = [], [], None
    for kt, vt, kind, _ in _segments(prefix, grad_from, k, v, tile):
        kt32, vt32 = kt.astype(mx.float32)[:, :, None], vt.astype(mx.float32)[:, :, None]
        # this tile's scores only once the previous tile is folded into dq (see _forward)
        p = mx.exp(_scores(mx.depends(qs, [dq]), kt, kind == "own") - lse)
        ds = p * (do @ vt32.swapaxes(-1, -2) - delta)
        dq = dq + ds @ kt32
        if kind == "fixed":
            continue
        dk = (ds.swapaxes(-1, -2) @ qs).sum(axis=2)  # summed over the grouped query heads
        dv = (p.swapaxes(-1, -2) @ do).sum(axis=2)
        # each tile's dK/dV before the next tile's scores: one tile's graph alive at a time
        dq = mx.depends(dq, [dk, dv])
        if kind == "tap":
            taps_k.append(dk)
            taps_v.append(dv)
        else:
            own = (dk, dv)
    dq = (dq * scale).reshape(b, hq, n, -1).astype(q.dtype)
    grads = [dq, own[0].astype(k.dtype), own[1].astype(v.dtype)]
    if taps_k:
        grads += [mx.concatenate(taps_k, axis=2), mx.concatenate(taps_v, axis=2)]
    return grads
