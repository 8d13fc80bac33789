"""The gated delta rule token by token in plain MLX ops: the reference the chunked op is read
against. Autodiff through it keeps every state S_t (T x Dv x Dk floats per head), so it serves
checks only, never training."""

from __future__ import annotations

import mlx.core as mx


def naive_recurrent(
    q: mx.array, k: mx.array, v: mx.array, log_g: mx.array, beta: mx.array, state: mx.array
) -> tuple[mx.array, mx.array]:
    """Per value head, S_t = g_t S_{t-1} + beta_t (v_t - g_t S_{t-1} k_t) k_t^T, o_t = S_t q_t.

    Args:
        q, k: (B, T, Hk, Dk), any float dtype; value head h reads key head h // (Hv / Hk).
        v: (B, T, Hv, Dv), Hv a multiple of Hk.
        log_g: (B, T, Hv), log of the decay g_t in (0, 1].
        beta: (B, T, Hv), the write strength.
        state: (B, Hv, Dv, Dk), the state entering position 0.

    Returns:
        y (B, T, Hv, Dv) in q's dtype and the state after position T - 1 (B, Hv, Dv, Dk) in
        float32; every product in float32.
    """
    f32 = mx.float32
    r = v.shape[-2] // q.shape[-2]  # value heads per key head
    qs, ks = (mx.repeat(x.astype(f32), r, axis=2) for x in (q, k))  # (B, T, Hv, Dk)
    vs, g, beta = v.astype(f32), mx.exp(log_g.astype(f32)), beta.astype(f32)
    s = state.astype(f32)
    ys = []
    for t in range(q.shape[1]):
        s = g[:, t, :, None, None] * s  # (B, Hv, Dv, Dk)
        written = (s @ ks[:, t, :, :, None])[..., 0]  # S k: (B, Hv, Dv)
        delta = beta[:, t, :, None] * (vs[:, t] - written)  # (B, Hv, Dv)
        s = s + delta[..., None] * ks[:, t, :, None, :]
        ys.append((s @ qs[:, t, :, :, None])[..., 0])  # (B, Hv, Dv)
    return mx.stack(ys, axis=1).astype(q.dtype), s
