"""A chunk's attention: its queries over the cached prefix and its own K/V, never concatenated.

MLX's `scaled_dot_product_attention` VJP on CPU and Metal materializes chunk x window x heads
scores per layer, and feeding it means concatenating the prefix with the chunk's K/V, a
window-sized copy per layer per chunk. `chunk_attention` instead walks the window in tiles:
  forward:  online softmax over the prefix tiles (read from the K/V store in its own format,
            8-bit dequantized tile by tile) and the chunk's causal block; returns the output and
            the log-sum-exp;
  backward: per tile, scores recomputed from the saved log-sum-exp, dQ accumulated, dK/dV of the
            tile summed over grouped-query heads, for the taps (the horizon) and the chunk only.
The taps enter as zero-valued deltas (broadcast, so they hold no memory): their gradient is the
gradient of the cached K/V they stand on. Pure MLX ops: it runs on every backend.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

TILE = 1024


@dataclass(frozen=True)
class Prefix:
    """One attention layer's cached K/V on [0, end), read tile by tile from the store."""

    store: object  # store.KVStore
    layer: int
    end: int
    dtype: mx.Dtype

    def read(self, start: int, end: int) -> tuple[mx.array, mx.array]:
        return self.store.read(self.layer, start, end, self.dtype)


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


def _forward(q, k, v, prefix, grad_from, scale, tile):
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


def _backward(q, k, v, prefix, grad_from, scale, tile, out, lse, d_out):
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


def chunk_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    prefix: Prefix | None,
    grad_from: int,
    taps: tuple[mx.array, mx.array] | None,
    scale: float,
    tile: int = TILE,
) -> mx.array:
    """softmax(q [prefix; k]^T * scale, causal in the chunk) [prefix; v], shape of q.

    q (B, Hq, L, D), k and v (B, Hkv, L, D) are the chunk's own; prefix the cached [0, start);
    taps, if given, are zero deltas on [grad_from, start) whose gradient is dL/d(cached K/V)."""
    gf = grad_from if taps is not None else (prefix.end if prefix is not None else 0)

    @mx.custom_function
    def attend(*inputs):
        return _forward(inputs[0], inputs[1], inputs[2], prefix, gf, scale, tile)

    @attend.vjp
    def attend_vjp(primals, cotangents, outputs):
        q, k, v = primals[:3]
        return tuple(
            _backward(q, k, v, prefix, gf, scale, tile, outputs[0], outputs[1], cotangents[0])
        )

    inputs = (q, k, v) if taps is None else (q, k, v, *taps)
    return attend(*inputs)[0]


def _attend(queries, keys, values, cache, scale, mask, sinks=None):
    """mlx-lm's `scaled_dot_product_attention`, routed to `chunk_attention` for walk caches."""
    # A walk's ChunkKV says whether it is tiled; mlx-lm's own caches have no such attribute.
    tiled = getattr(cache, "tiled", False) is True and sinks is None
    if tiled and (mask is None or isinstance(mask, str)):
        return chunk_attention(
            queries, cache.keys, cache.values, cache.prefix, cache.grad_from, cache.taps, scale
        )
    return _original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)


def _original(*args, **kwargs):
    from mlx_lm.models import base

    return base.scaled_dot_product_attention(*args, **kwargs)


@contextmanager
def tiled_attention(model: nn.Module) -> Iterator[None]:
    """Within the block, the model's attention layers call `_attend`."""
    patched = {}
    for _, m in model.named_modules():
        module = sys.modules.get(type(m).__module__)
        if module is not None and hasattr(module, "scaled_dot_product_attention"):
            if module.__name__ != "mlx_lm.models.base" and module not in patched:
                patched[module] = module.scaled_dot_product_attention
                module.scaled_dot_product_attention = _attend
    try:
        yield
    finally:
        for module, original in patched.items():
            module.scaled_dot_product_attention = original
