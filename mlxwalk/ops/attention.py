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
gradient of the cached K/V they stand on.

Two implementations of the same contract: the kernels of metal_kernels/attention (Metal, CUDA),
reading the store in place, and their twin here in pure MLX ops, which runs on every backend and
is the reference, the fallback and the CPU path. `kernels.py` routes between them.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

import metal_kernels.attention as attention_kernels

from . import kernels

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

    def in_place(self) -> tuple[mx.array, mx.array] | None:
        """The layer's whole store arrays (B, H, window, D), which the kernels read in place, or
        None for a format they do not take (8-bit)."""
        if self.store.cache_type == "q8":
            return None
        return self.store.keys[self.layer], self.store.values[self.layer]


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


def _twin_forward(q, k, v, prefix, grad_from, scale, tile):
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


def _twin_backward(q, k, v, prefix, grad_from, scale, tile, out, lse, d_out):
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


def _store(prefix: Prefix | None):
    if prefix is None:
        return None, None, 0
    return (*prefix.in_place(), prefix.end)


def _kernel_forward(q, k, v, prefix, grad_from, scale, tile):
    pk, pv, start = _store(prefix)
    o, lse = attention_kernels.forward(q, k, v, pk, pv, start, scale, run=kernels.launch)
    return o.astype(q.dtype), lse


def _kernel_backward(q, k, v, prefix, grad_from, scale, tile, out, lse, d_out):
    pk, pv, start = _store(prefix)
    dq, dk, dv = attention_kernels.backward(
        q, k, v, pk, pv, start, grad_from, scale, out, lse, d_out, run=kernels.launch
    )
    taps = start - grad_from
    grads = [dq.astype(q.dtype), dk[:, :, taps:].astype(k.dtype), dv[:, :, taps:].astype(v.dtype)]
    if taps:
        grads += [dk[:, :, :taps], dv[:, :, :taps]]
    return grads


def _checked_forward(q, k, v, prefix, grad_from, scale, tile):
    """MLXWALK_KERNELS=check: both paths, compared; the twin's result goes on."""
    out, lse = _twin_forward(q, k, v, prefix, grad_from, scale, tile)
    got, _ = _kernel_forward(q, k, v, prefix, grad_from, scale, tile)
    _compare("attention/forward", q, k, [got], [out])
    return out, lse


def _checked_backward(q, k, v, prefix, grad_from, scale, tile, out, lse, d_out):
    want = _twin_backward(q, k, v, prefix, grad_from, scale, tile, out, lse, d_out)
    k_out, k_lse = _kernel_forward(q, k, v, prefix, grad_from, scale, tile)
    got = _kernel_backward(q, k, v, prefix, grad_from, scale, tile, k_out, k_lse, d_out)
    _compare("attention/dq, dkdv", q, k, got, want)
    return want


def relative_error(a: mx.array, b: mx.array) -> float:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.linalg.norm((a - b).reshape(-1)) / (mx.linalg.norm(b.reshape(-1)) + 1e-30)).item()


def _compare(kernel: str, q, k, got, want) -> None:
    case = kernels.case_of(q, k)
    error = max(relative_error(a, b) for a, b in zip(got, want))
    if error > kernels.TOLERANCE[q.dtype]:
        kernels.report(kernel, case, f"disagrees with the ops twin (relative error {error:.1e})")
        kernels.disable(case)


PATHS = {
    "kernel": (_kernel_forward, _kernel_backward),
    "twin": (_twin_forward, _twin_backward),
    "check": (_checked_forward, _checked_backward),
}


def path(q: mx.array, k: mx.array, prefix: Prefix | None, auto: bool = False) -> str:
    """Which implementation runs: the kernels where they apply and passed the self-check."""
    arrays = prefix.in_place() if prefix is not None else (k, k)
    if arrays is None or not kernels.use_kernel(q, k, arrays[0].dtype, auto, kernel_vs_twin):
        return "twin"
    return "check" if kernels.mode() == "check" else "kernel"


def chunk_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    prefix: Prefix | None,
    grad_from: int,
    taps: tuple[mx.array, mx.array] | None,
    scale: float,
    tile: int = TILE,
    auto: bool = False,
) -> mx.array:
    """softmax(q [prefix; k]^T * scale, causal in the chunk) [prefix; v], shape of q.

    q (B, Hq, L, D), k and v (B, Hkv, L, D) are the chunk's own; prefix the cached [0, start);
    taps, if given, are zero deltas on [grad_from, start) whose gradient is dL/d(cached K/V)."""
    gf = grad_from if taps is not None else (prefix.end if prefix is not None else 0)
    forward, backward = PATHS[path(q, k, prefix, auto)]

    @mx.custom_function
    def attend(*inputs):
        return forward(inputs[0], inputs[1], inputs[2], prefix, gf, scale, tile)

    @attend.vjp
    def attend_vjp(primals, cotangents, outputs):
        q, k, v = primals[:3]
        out, lse = outputs
        return tuple(backward(q, k, v, prefix, gf, scale, tile, out, lse, cotangents[0]))

    inputs = (q, k, v) if taps is None else (q, k, v, *taps)
    return attend(*inputs)[0]


class _Store:
    """A float32 store of one layer, as walk.store.KVStore holds it (the self-check's)."""

    cache_type = "float32"

    def __init__(self, keys: mx.array, values: mx.array):
        self.keys, self.values = [keys.astype(mx.float32)], [values.astype(mx.float32)]

    def read(self, layer: int, start: int, end: int, dtype: mx.Dtype):
        return tuple(a[layer][..., start:end, :].astype(dtype) for a in (self.keys, self.values))


def kernel_vs_twin(case: kernels.Case) -> dict[str, float]:
    """The self-check: relative errors of the kernels against the twin on a small case (a
    prefix of 80 positions in a float32 store, 50 of them tapped; a causal chunk of 48)."""
    rng = np.random.default_rng(0)
    hkv, n, start, gf = 2, 48, 80, 30

    def normal(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(case.dtype)

    q = normal(1, hkv * case.groups, n, case.dim)
    k, v, d_out = normal(1, hkv, n, case.dim), normal(1, hkv, n, case.dim), normal(*q.shape)
    store = _Store(normal(1, hkv, start + n, case.dim), normal(1, hkv, start + n, case.dim))
    prefix = Prefix(store, 0, start, case.dtype)
    scale = case.dim**-0.5
    got, k_lse = _kernel_forward(q, k, v, prefix, gf, scale, TILE)
    want, lse = _twin_forward(q, k, v, prefix, gf, scale, TILE)
    dgot = _kernel_backward(q, k, v, prefix, gf, scale, TILE, got, k_lse, d_out)
    dwant = _twin_backward(q, k, v, prefix, gf, scale, TILE, want, lse, d_out)
    errors = [relative_error(a, b) for a, b in zip(dgot, dwant)]
    return {
        "attention/forward": relative_error(got, want),
        "attention/dq": errors[0],
        "attention/dkdv": max(errors[1:]),
    }


def _attend(queries, keys, values, cache, scale, mask, sinks=None):
    """mlx-lm's `scaled_dot_product_attention`, routed to `chunk_attention` for walk caches.

    A walk's ChunkKV names its attention: "tiled" (chunk_attention: a kernel or its twin),
    "fused" (mlx-lm's), "auto" (a kernel where one is routed, else mlx-lm's fused path on CUDA
    and the twin elsewhere). mlx-lm's own caches have no such attribute."""
    how = getattr(cache, "attention", None)
    if how in ("tiled", "auto") and sinks is None and (mask is None or isinstance(mask, str)):
        args = (queries, cache.keys, cache.values, cache.prefix, cache.grad_from, cache.taps)
        if how == "tiled" or not mx.cuda.is_available():
            return chunk_attention(*args, scale)
        if path(queries, cache.keys, cache.prefix, auto=True) != "twin":
            return chunk_attention(*args, scale, auto=True)
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
