"""The gated delta rule, chunked, in torch: mlxwalk/ops/delta/chunk.py's algorithm (see its
docstring for the WY form) with the same contract, for the torch backend.

Per value head, with S the (Dv x Dk) state, g_t in (0, 1] the decay and beta_t the write strength:
    S_t = g_t S_{t-1} + beta_t (v_t - g_t S_{t-1} k_t) k_t^T,    o_t = S_t q_t.
Inputs: q, k (B, T, Hk, Dk); v (B, T, Hv, Dv), Hv a multiple of Hk; log_g, beta (B, T, Hv);
state (B, Hv, Dv, Dk) float32. Returns y (B, T, Hv, Dv) in q's dtype and the final state (float32).
`gated_delta` keeps nothing but its inputs between forward and backward: the backward recomputes
the chunked forward under autograd (activation checkpointing of the op).
"""

from __future__ import annotations

import torch

CHUNK = 64


def _chunks(x: torch.Tensor, n: int, c: int) -> torch.Tensor:
    """(B, T, H, ...) padded to n c positions -> (n, B, H, c, ...): a chunk is contiguous."""
    b, t, h = x.shape[:3]
    if n * c > t:
        x = torch.cat([x, x.new_zeros(b, n * c - t, h, *x.shape[3:])], dim=1)
    x = x.reshape(b, n, c, h, *x.shape[3:])
    return x.permute(1, 0, 3, 2, *range(4, x.dim()))


def gated_delta_chunked(q, k, v, log_g, beta, state, chunk: int = CHUNK):
    """The chunked gated delta rule in differentiable torch ops."""
    b, t, hk, dk = q.shape
    hv, dv = v.shape[-2:]
    out_dtype = q.dtype
    r = hv // hk  # value heads per key head: q and k broadcast over them
    c = min(chunk, t)
    n = -(-t // c)

    def split(x):  # (B, T, H, ...) -> (n, B, Hk, r or 1, c, ...)
        x = _chunks(x.float(), n, c)
        return x.reshape(n, b, hk, x.shape[2] // hk, *x.shape[3:])

    # padded positions have k = v = beta = log_g = 0: they write nothing and do not decay
    q, k, v, log_g, beta = (split(x) for x in (q, k, v, log_g, beta))
    cum = torch.cumsum(log_g, dim=-1)  # log gamma, (n, B, Hk, r, c)
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    diff = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf"))
    decay = torch.exp(diff)  # gamma_i / gamma_j on and below the diagonal, 0 above
    kt = k.transpose(-1, -2)
    a = beta[..., None] * (k @ kt) * decay.tril(-1)
    eye = torch.eye(c, device=q.device, dtype=a.dtype).expand_as(a)
    tri = torch.linalg.solve_triangular(eye + a, eye, upper=False, unitriangular=True)
    gamma = torch.exp(cum)
    w = tri @ ((beta * gamma)[..., None] * k)  # (n, B, Hk, r, c, Dk)
    u0 = tri @ (beta[..., None] * v)  # (n, B, Hk, r, c, Dv)
    p = (q @ kt) * decay  # (n, B, Hk, r, c, c)
    qg = gamma[..., None] * q
    kd = torch.exp(cum[..., -1:] - cum)[..., None] * k
    g_end = gamma[..., -1:][..., None]  # (n, B, Hk, r, 1, 1)

    s = state.float().reshape(b, hk, r, dv, dk)
    outs = []
    for i in range(n):  # the sequential part: the state through the chunks
        st = s.transpose(-1, -2)
        u = u0[i] - w[i] @ st
        outs.append(qg[i] @ st + p[i] @ u)
        s = g_end[i] * s + u.transpose(-1, -2) @ kd[i]
    o = torch.stack(outs)  # (n, B, Hk, r, c, Dv)
    y = o.permute(1, 0, 4, 2, 3, 5).reshape(b, n * c, hv, dv)[:, :t]
    return y.to(out_dtype), s.reshape(b, hv, dv, dk)


class _GatedDelta(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, log_g, beta, state, chunk):
        ctx.save_for_backward(q, k, v, log_g, beta, state)
        ctx.chunk = chunk
        with torch.no_grad():
            y, s = gated_delta_chunked(q, k, v, log_g, beta, state, chunk)
        return y.to(q.dtype), s

    @staticmethod
    def backward(ctx, dy, ds):
        inputs = [x.detach().requires_grad_() for x in ctx.saved_tensors]
        with torch.enable_grad():
            y, s = gated_delta_chunked(*inputs, ctx.chunk)
            grads = torch.autograd.grad((y, s), inputs, (dy, ds), allow_unused=True)
        return (*grads, None)


def gated_delta(q, k, v, log_g, beta, state, chunk: int = CHUNK):
    """The gated delta rule with a recomputing backward; (y, final state)."""
    return _GatedDelta.apply(q, k, v, log_g, beta, state, chunk)
