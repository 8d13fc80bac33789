"""A chunk's attention: its queries over the cached prefix and its own K/V, never concatenated.

MLX's `scaled_dot_product_attention` VJP on CPU and Metal materializes chunk x window x heads
scores per layer, and feeding it means concatenating the prefix with the chunk's K/V, a
window-sized copy per layer per chunk. `chunk_attention` reads the prefix in place instead and
keeps the log-sum-exp for its backward, which recomputes the scores. The taps enter as
zero-valued deltas (broadcast, so they hold no memory): their gradient is the gradient of the
cached K/V they stand on.

  twin.py    the pure-MLX implementation, tiled: every backend; the reference and the fallback
  kernel.py  the same contract through metal_kernels/attention (Metal, CUDA)
  check.py   the two compared: MLXWALK_KERNELS=check, the self-check, the tests' cases
`path` picks one per call (ops/routing.py decides where a kernel may run).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn

import metal_kernels.attention as attention_kernels

from .. import routing
from . import check, kernel, twin
from .prefix import Prefix
from .twin import TILE

__all__ = ["TILE", "Prefix", "chunk_attention", "path", "tiled_attention"]

PATHS = {
    "kernel": (kernel.forward, kernel.backward),
    "twin": (twin.forward, twin.backward),
    "check": (check.checked_forward, check.checked_backward),
}


# The head dims at which `auto` routes half-precision attention to the CUDA tensor-core kernels,
# by the H200's table (scripts/h200-attention.py, docs/BENCHMARKS.md; bf16 forward+backward, 4,096
# queries over 61,440 + 4,096 keys, 14/2 heads): at 256 the kernels take 64.3 ms and 0.41 GiB
# against MLX's unfused path's 79.1 ms and 23 GiB (cuDNN stops at 128); at 64 and 128 cuDNN's
# fused path wins (9.1 against 14.7 ms, 13.7 against 30.2). Float32 keeps MLX's path there: its
# kernels are the scalar ones. Elsewhere the kernel runs when the walk asks for the prefix read
# in place (attention "tiled"), where its memory stays flat.
CUDA_HEAD_DIMS: tuple[int, ...] = (256,)
CUDA_DTYPES = (mx.float16, mx.bfloat16)


def path(
    q: mx.array, k: mx.array, prefix: Prefix | None, auto: bool = False, v: mx.array | None = None
) -> str:
    """Which implementation runs: the kernels where they apply and passed the self-check (per
    dtype, head dim, GQA ratio and store dtype); `auto`: the walk left the path to us (on CUDA
    the kernel then runs only at the head dims where it was measured to win)."""
    arrays = prefix.in_place() if prefix is not None else (k, k)
    store = arrays[0].dtype if arrays is not None and prefix is not None else None
    case = routing.attention_case(q, k, store)
    if case is None or routing.mode() == "off" or arrays is None:
        return "twin"
    if not attention_kernels.supports(q, k, k if v is None else v, arrays[0].dtype):
        return "twin"
    measured = case.head_dim in CUDA_HEAD_DIMS and case.dtype in CUDA_DTYPES
    if auto and case.backend == "cuda" and not measured and not routing.forced():
        return "twin"
    if not routing.decide(case, check.kernel_vs_twin, check.race):
        return "twin"
    return "check" if routing.mode() == "check" else "kernel"


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
    how: str | None = None,
) -> mx.array:
    """softmax(q [prefix; k]^T * scale, causal in the chunk) [prefix; v], shape of q.

    q (B, Hq, L, D), k and v (B, Hkv, L, D) are the chunk's own; prefix the cached [0, start);
    taps, if given, are zero deltas on [grad_from, start) whose gradient is dL/d(cached K/V).
    `how`: a path already decided by `path` (else decided here)."""
    gf = grad_from if taps is not None else (prefix.end if prefix is not None else 0)
    chosen = how or path(q, k, prefix, auto, v)
    forward, backward = PATHS[chosen]
    if chosen != "twin":
        forward, backward = _guarded(q, k, prefix, gf, forward, backward)

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


def _guarded(q, k, prefix, grad_from, forward, backward):
    """The kernel path's forward and backward, each falling back to the twin where it fails
    (routing.guard: one line, that case on the twin from then on)."""
    arrays = prefix.in_place() if prefix is not None else None
    case = routing.attention_case(q, k, arrays[0].dtype if arrays is not None else None)
    start = prefix.end if prefix is not None else 0
    b, heads, n = q.shape[:3]
    size = f"batch {b}, {heads} heads, {n} queries over {start + n} keys"
    fell = []  # the forward fell back: its out and lse are the twin's

    def guarded_forward(*args):
        def fallback():
            fell.append(True)
            return twin.forward(*args)

        return routing.guard(case, "attention/forward", size, lambda: forward(*args), fallback)

    def guarded_backward(q, k, v, prefix, grad_from, scale, tile, out, lse, d_out):
        inputs = (q, k, v, prefix, grad_from, scale, tile)

        def fallback():  # the kernels' out and lse are in their own layout: the twin's anew
            return twin.backward(
                *inputs, *(twin.forward(*inputs) if not fell else (out, lse)), d_out
            )

        return routing.guard(
            case,
            "attention/dq, attention/dkdv",
            f"{size}, gradient from key {grad_from}",
            lambda: backward(*inputs, out, lse, d_out),
            fallback,
        )

    return guarded_forward, guarded_backward


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
        chosen = path(queries, cache.keys, cache.prefix, auto=True, v=cache.values)
        if chosen != "twin":
            return chunk_attention(*args, scale, how=chosen)
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
