"""MLX's own gated delta rule, `mx.fast.gated_delta_update`: Metal kernels that walk the
sequence token by token, with a VJP, for the shapes MLX covers. Where it runs: on Metal only, per
case (key and value heads and dims, dtype) where it matches the ops twin (chunk.py's
`gated_delta`) on a small case and, at first use, beats it."""

from __future__ import annotations

import mlx.core as mx

from .. import routing
from .chunk import gated_delta as twin
from .chunk_kernel import layer


def gated_delta(q, k, v, log_g, beta, state):
    """MLX's own gated delta rule (Metal kernels with a VJP for the shapes it covers): the same
    contract as the twin's (gamma given in linear space)."""
    y, s = mx.fast.gated_delta_update(q, k, v, mx.exp(log_g), beta, initial_state=state)
    return y.astype(q.dtype), s.astype(mx.float32)


def case_of(q, v) -> routing.MlxDeltaCase:
    """MLX's op covers some shapes only: one case per (key heads, value heads, key dim, value
    dim, dtype)."""
    hk, dk, hv, dv = q.shape[-2], q.shape[-1], v.shape[-2], v.shape[-1]
    return routing.MlxDeltaCase(routing.backend(), q.dtype, hk, hv, dk, dv)


def use(q, v) -> bool:
    """On Metal: MLX's gated_delta_update where it matches the ops on a small case of the layer's
    shape (values, the final state, every gradient including the initial state's) and, at first
    use, beats them."""
    if routing.mode() == "off":
        return False
    return routing.decide(case_of(q, v), kernel_vs_twin, race)


def _layer(case: routing.MlxDeltaCase, t: int):
    return layer(case.dtype, case.key_heads, case.value_heads, case.key_dim, case.value_dim, t)


def kernel_vs_twin(case: routing.MlxDeltaCase) -> dict[str, float]:
    """The self-check: values, the final state and every gradient, MLX's op against the twin on
    70 positions."""
    x, cots = _layer(case, 70)
    got = mx.vjp(gated_delta, x, cots)
    want = mx.vjp(twin, x, cots)
    pairs = zip([*got[0], *got[1]], [*want[0], *want[1]])
    return {"mlx gated_delta_update": max(routing.relative_error(a, b) for a, b in pairs)}


def race(case: routing.MlxDeltaCase, size: tuple[int, int]) -> tuple[float, float]:
    """Seconds for a layer's forward and backward over size[0] positions: MLX's op, then ours."""
    x, cots = _layer(case, size[0])
    mlx_s, ours_s = (
        routing.seconds(lambda f=f: mx.eval(mx.vjp(f, x, cots))) for f in (gated_delta, twin)
    )
    return mlx_s, ours_s
