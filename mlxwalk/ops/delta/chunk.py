"""The gated delta rule, chunked, in plain MLX ops (every backend): the reference for the kernels
and the CPU path, an `mx.custom_function` whose VJP recomputes its forward.

Per value head, with S the (Dv x Dk) state, g_t in (0, 1] the decay and beta_t the write strength:
    S_t = g_t S_{t-1} + beta_t (v_t - g_t S_{t-1} k_t) k_t^T,    o_t = S_t q_t.
naive.py walks this token by token, as mlx-lm trains it, its autodiff keeping every S_t (T x Dv x
Dk floats per head). Here the sequence is cut into chunks of C positions (chunk_size()). Inside a
chunk, with gamma_t the decay accumulated since the chunk's start and S the state entering it (the
WY form):
    A_ij = beta_i (gamma_i / gamma_j) k_i.k_j  (j < i),   T = (I + A)^-1
    U    = T diag(beta) V - T diag(beta gamma) K S^T          (the chunk's effective writes)
    O    = diag(gamma) Q S^T + [(gamma_t / gamma_i) q_t.k_i]_{i <= t} U
    S'   = gamma_C S + U^T diag(gamma_C / gamma) K
Everything but the last line is parallel over the chunks; the chunks are walked in sequence only to
carry S (scan.sequential: recurrence.py's MLX ops, or scan.py's kernels where routed). The custom
VJP recomputes the forward and differentiates it (activation checkpointing of the op), so between
forward and backward nothing but the inputs is held; the triangular inverse has its own VJP
(dA = -T^T dT T^T) so its substitution is never differentiated step by step.
"""

from __future__ import annotations

import mlx.core as mx

from . import scan
from .recurrence import Factors

CHUNK: int | None = None  # positions per chunk; None: chunk_size() picks by backend


def chunk_size() -> int:
    """64 on the CPU, 256 on a GPU. Longer chunks trade arithmetic (c^2 per chunk) for fewer steps
    of the sequential walk; on the CPU the arithmetic dominates, on a GPU the per-step kernel
    launches do (scripts/bench-delta.py --chunks, docs/BENCHMARKS.md)."""
    if CHUNK is not None:
        return CHUNK
    return 256 if mx.default_device() == mx.gpu else 64


BLOCK = 16  # the inverse substitutes inside blocks of 16 rows, then merges blocks pairwise


def _substitute(a: mx.array) -> mx.array:
    """(I + A)^-1 for small strictly lower A (..., b, b): rows by forward substitution."""
    b = a.shape[-1]
    eye = mx.eye(b, dtype=a.dtype)
    rows = [mx.broadcast_to(eye[0], (*a.shape[:-2], 1, b))]
    for i in range(1, b):
        # row i: e_i - A[i, :i] T[:i, :]
        rows.append(eye[i] - a[..., i : i + 1, :i] @ mx.concatenate(rows, axis=-2))
    return mx.concatenate(rows, axis=-2)


def _merged_inverse(a: mx.array) -> mx.array:
    """unit_lower_inverse for C = BLOCK x 2^k."""
    lead, c = a.shape[:-2], a.shape[-1]
    n = c // BLOCK
    # the diagonal blocks: (..., n, BLOCK, BLOCK)
    blocks = a.reshape(*lead, n, BLOCK, n, BLOCK).swapaxes(-3, -2)
    idx = mx.arange(n)
    t = _substitute(blocks[..., idx, idx, :, :])
    while t.shape[-3] > 1:
        m = t.shape[-3] // 2
        s = t.shape[-1]
        t11, t22 = t[..., 0::2, :, :], t[..., 1::2, :, :]
        a21 = mx.stack(
            [
                a[..., (2 * i + 1) * s : (2 * i + 2) * s, 2 * i * s : (2 * i + 1) * s]
                for i in range(m)
            ],
            axis=-3,
        )
        low = -(t22 @ a21 @ t11)
        top = mx.concatenate([t11, mx.zeros_like(t11)], axis=-1)
        bottom = mx.concatenate([low, t22], axis=-1)
        t = mx.concatenate([top, bottom], axis=-2)
    return t[..., 0, :, :]


@mx.custom_function
def unit_lower_inverse(a: mx.array) -> mx.array:
    """(I + A)^-1 for A strictly lower triangular (..., C, C).

    Diagonal blocks of BLOCK rows are inverted by substitution, all at once; then pairs of blocks
    merge: [[T11, 0], [A21, T22]] -> [[T11, 0], [-T22 A21 T11, T22]], doubling the block size.
    A is padded with zeros to BLOCK x 2^k rows (I + A stays block diagonal, so the inverse's
    leading block is the answer)."""
    c = a.shape[-1]
    if c <= BLOCK:
        return _substitute(a)
    full = BLOCK * (1 << (-(-c // BLOCK) - 1).bit_length())
    if full == c:
        return _merged_inverse(a)
    pad = [(0, 0)] * (a.ndim - 2) + [(0, full - c), (0, full - c)]
    return _merged_inverse(mx.pad(a, pad))[..., :c, :c]


@unit_lower_inverse.vjp
def _unit_lower_inverse_vjp(primals, cotangent, output):
    t = output
    ta = t.swapaxes(-1, -2)
    da = -(ta @ cotangent @ ta)
    c = t.shape[-1]
    return (da * mx.tril(mx.ones((c, c), dtype=da.dtype), -1),)


def _chunks(x: mx.array, n: int, c: int) -> mx.array:
    """(B, T, H, ...) padded to n * c positions -> (n, B, H, c, ...): a chunk is contiguous."""
    b, t, h = x.shape[:3]
    rest = x.shape[3:]
    if n * c > t:
        x = mx.concatenate([x, mx.zeros((b, n * c - t, h, *rest), x.dtype)], axis=1)
    x = x.reshape(b, n, c, h, *rest)
    return x.transpose(1, 0, 3, 2, *range(4, 4 + len(rest)))


def gated_delta_chunked(q, k, v, log_g, beta, state, differentiable: bool = True):
    """The chunked gated delta rule in plain MLX ops (runs on every backend); `differentiable`
    routes the recurrence through its VJP, which keeps every chunk's entry state."""
    b, t, hk, dk = q.shape
    hv, dv = v.shape[-2:]
    r = hv // hk  # value heads per key head: q and k broadcast over them, never repeated
    out_dtype = q.dtype
    c = min(chunk_size(), t)
    n = -(-t // c)
    f32 = mx.float32

    def split(x):  # (B, T, H, ...) -> (n, B, Hk, r or 1, c, ...)
        x = _chunks(x.astype(f32), n, c)
        return x.reshape(n, b, hk, x.shape[2] // hk, *x.shape[3:])

    # padded positions have k = v = beta = log_g = 0: they write nothing and do not decay
    q, k, v, log_g, beta = (split(x) for x in (q, k, v, log_g, beta))
    cum = mx.cumsum(log_g, axis=-1)  # log gamma, (n, B, Hk, r, c)
    causal = mx.tril(mx.ones((c, c), dtype=mx.bool_))
    # gamma_i / gamma_j on and below the diagonal, 0 above (exp of -inf), one exp for both uses
    decay = mx.exp(mx.where(causal, cum[..., :, None] - cum[..., None, :], -mx.inf))
    kt = k.swapaxes(-1, -2)
    a = beta[..., None] * (k @ kt) * mx.tril(decay, -1)
    tri = unit_lower_inverse(a)
    gamma = mx.exp(cum)
    w = tri @ ((beta * gamma)[..., None] * k)  # (n, B, Hk, r, c, Dk)
    u0 = tri @ (beta[..., None] * v)  # (n, B, Hk, r, c, Dv)
    p = (q @ kt) * decay  # (n, B, Hk, r, c, c)
    qg = gamma[..., None] * q
    kd = mx.exp(cum[..., -1:] - cum)[..., None] * k
    g_end = gamma[..., -1:][..., None]  # (n, B, Hk, r, 1, 1)

    s0 = state.astype(f32).reshape(b, hk, r, dv, dk)
    factors = Factors(u0=u0, w=w, qg=qg, p=p, kd=kd, g_end=g_end)
    o, s = scan.sequential(factors, s0, differentiable)
    y = o.transpose(1, 0, 4, 2, 3, 5).reshape(b, n * c, hv, dv)[:, :t]
    return y.astype(out_dtype), s.reshape(b, hv, dv, dk)


@mx.custom_function
def gated_delta(q, k, v, log_g, beta, state):
    """The gated delta rule with a recomputing VJP (see the module doc); its forward keeps no
    entry states (the VJP recomputes them).

    Args:
        q, k: (B, T, Hk, Dk), float32, float16 or bfloat16.
        v: (B, T, Hv, Dv), Hv a multiple of Hk (value head h reads key head h // (Hv / Hk)).
        log_g: (B, T, Hv) float32, log of the decay (<= 0); beta: (B, T, Hv) float32.
        state: (B, Hv, Dv, Dk) float32, the state entering position 0.

    Returns:
        y (B, T, Hv, Dv) in q's dtype and the final state (B, Hv, Dv, Dk) in float32.
    """
    return gated_delta_chunked(q, k, v, log_g, beta, state, differentiable=False)


@gated_delta.vjp
def _gated_delta_vjp(primals, cotangents, outputs):
    _, grads = mx.vjp(gated_delta_chunked, list(primals), list(cotangents))
    return tuple(grads)
