"""The torch backend's chunked gated delta rule: against a per-token loop in torch and against
the MLX op on the same inputs, values and every gradient (the initial state's included)."""

import numpy as np
import pytest

from .extras import needs_torch  # noqa: E402

needs_torch()
pytestmark = pytest.mark.torch

import mlx.core as mx  # noqa: E402
import torch  # noqa: E402

from mlxwalk.ops.delta import chunk as mlx_chunk  # noqa: E402
from mlxwalk.torch_backend import delta  # noqa: E402


def arrays(t=70, hk=2, hv=4, dk=32, dv=16, seed=0):
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=1.0):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    return [
        normal(1, t, hk, dk, scale=0.3),
        normal(1, t, hk, dk, scale=0.3),
        normal(1, t, hv, dv),
        -rng.uniform(0.01, 0.3, (1, t, hv)).astype(np.float32),
        rng.uniform(0.1, 0.9, (1, t, hv)).astype(np.float32),
        normal(1, hv, dv, dk, scale=0.5),
    ]


def per_token(q, k, v, log_g, beta, state):
    """The recurrence as written, one position at a time (autograd keeps every state)."""
    r = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
    s, ys = state, []
    g = torch.exp(log_g)
    for t in range(q.shape[1]):
        s = g[:, t, :, None, None] * s
        pred = (s @ k[:, t, :, :, None])[..., 0]  # (B, H, Dv)
        s = s + beta[:, t, :, None, None] * (v[:, t] - pred)[..., None] * k[:, t, :, None, :]
        ys.append((s @ q[:, t, :, :, None])[..., 0])
    return torch.stack(ys, dim=1), s


def grads(fn, xs, cots):
    ts = [torch.tensor(x, requires_grad=True) for x in xs]
    y, s = fn(*ts)
    torch.autograd.backward((y, s), [torch.tensor(c) for c in cots])
    return [y.detach().numpy(), s.detach().numpy()] + [t.grad.numpy() for t in ts]


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("chunk", [16, 64])
def test_matches_the_per_token_recurrence(chunk):
    xs = arrays()
    rng = np.random.default_rng(1)
    cots = [
        rng.standard_normal((1, 70, 4, 16)).astype(np.float32),
        rng.standard_normal((1, 4, 16, 32)).astype(np.float32),
    ]
    got = grads(lambda *a: delta.gated_delta(*a, chunk=chunk), xs, cots)
    want = grads(per_token, xs, cots)
    for name, a, b in zip(["y", "state", "dq", "dk", "dv", "dlog_g", "dbeta", "dstate"], got, want):
        assert rel(a, b) < 1e-5, name


def test_matches_the_mlx_op():
    """The same inputs through mlxwalk/ops/delta/chunk.py: one algorithm, two frameworks."""
    xs = arrays(t=90)
    rng = np.random.default_rng(2)
    cots = [
        rng.standard_normal((1, 90, 4, 16)).astype(np.float32),
        rng.standard_normal((1, 4, 16, 32)).astype(np.float32),
    ]
    got = grads(lambda *a: delta.gated_delta(*a, chunk=32), xs, cots)
    mlx_chunk.CHUNK = 32
    try:
        (y, s), vjps = mx.vjp(
            mlx_chunk.gated_delta, [mx.array(x) for x in xs], [mx.array(c) for c in cots]
        )
    finally:
        mlx_chunk.CHUNK = None
    want = [np.array(y), np.array(s)] + [np.array(g) for g in vjps]
    for a, b in zip(got, want):
        assert rel(a, b) < 1e-5
