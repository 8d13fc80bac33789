"""The chunked gated delta rule against mlx-lm's per-token ops path, values and every gradient."""

import mlx.core as mx
import pytest
from mlx_lm.models.gated_delta import gated_delta_ops

from mlxwalk.ops.delta import gated_delta, naive_recurrent, unit_lower_inverse
from mlxwalk.ops.delta.chunk import _substitute

NAMES = ("q", "k", "v", "log_g", "beta", "state")


def inputs(t, hk, hv, dk, dv, dtype=mx.float32, seed=0):
    mx.random.seed(seed)
    q, k = mx.random.normal((1, t, hk, dk)), mx.random.normal((1, t, hk, dk))
    q = q / mx.linalg.norm(q, axis=-1, keepdims=True) * dk**-0.5
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = mx.random.normal((1, t, hv, dv))
    log_g = -mx.random.uniform(0.001, 0.7, (1, t, hv))
    beta = mx.sigmoid(mx.random.normal((1, t, hv)))
    state = 0.3 * mx.random.normal((1, hv, dv, dk))  # a nonzero initial state
    return [x.astype(dtype) for x in (q, k, v)] + [log_g, beta, state]


def reference(q, k, v, log_g, beta, state):
    return gated_delta_ops(q, k, v, mx.exp(log_g), beta, state)


def objective(fn):
    def f(*xs):
        y, s = fn(*xs)
        weights = mx.cos(mx.arange(y.size, dtype=mx.float32)).reshape(y.shape)
        return (y.astype(mx.float32) * weights).sum() + 0.1 * (s * s).sum()

    return f


def rel(a, b):
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.linalg.norm((a - b).reshape(-1)) / mx.linalg.norm(b.reshape(-1))).item()


@pytest.mark.parametrize(
    "t, hk, hv, dk, dv",
    [
        (150, 2, 4, 32, 16),
        (64, 1, 1, 16, 16),
        (200, 2, 2, 64, 32),
        (37, 1, 3, 16, 8),
        (48, 1, 2, 16, 8),
    ],
)
def test_values_and_gradients_match_the_per_token_path(t, hk, hv, dk, dv):
    xs = inputs(t, hk, hv, dk, dv)
    (y0, s0), (y1, s1) = reference(*xs), gated_delta(*xs)
    assert rel(y1, y0) < 1e-4 and rel(s1, s0) < 1e-4
    argnums = list(range(6))
    g0 = mx.grad(objective(reference), argnums=argnums)(*xs)
    g1 = mx.grad(objective(gated_delta), argnums=argnums)(*xs)
    for name, a, b in zip(NAMES, g1, g0):
        assert rel(a, b) < 1e-4, name


@pytest.mark.parametrize("t, hk, hv, dk, dv", [(37, 1, 3, 16, 8), (70, 2, 4, 32, 16)])
def test_the_naive_reference_is_the_per_token_path(t, hk, hv, dk, dv):
    """naive.py, the package's own reference, against mlx-lm's per-token ops (values and every
    gradient), and the chunked op against it."""
    xs = inputs(t, hk, hv, dk, dv, seed=1)
    (y0, s0), (y1, s1), (y2, s2) = reference(*xs), naive_recurrent(*xs), gated_delta(*xs)
    assert rel(y1, y0) < 1e-5 and rel(s1, s0) < 1e-5
    assert rel(y2, y1) < 1e-4 and rel(s2, s1) < 1e-4
    argnums = list(range(6))
    g0 = mx.grad(objective(reference), argnums=argnums)(*xs)
    g1 = mx.grad(objective(naive_recurrent), argnums=argnums)(*xs)
    for name, a, b in zip(NAMES, g1, g0):
        assert rel(a, b) < 1e-5, name


def test_bfloat16_inputs_keep_a_float32_state():
    xs = inputs(100, 2, 4, 32, 16)
    low = [x.astype(mx.bfloat16) for x in xs[:3]] + xs[3:]
    y, s = gated_delta(*low)
    assert y.dtype == mx.bfloat16 and s.dtype == mx.float32
    y0, s0 = reference(*xs)
    assert rel(y, y0) < 2e-2 and rel(s, s0) < 2e-2
    grads = mx.grad(objective(gated_delta), argnums=[0, 1, 2])(*low)
    assert all(g.dtype == mx.bfloat16 for g in grads)


@pytest.mark.parametrize("c", [64, 48, 33, 96, 240, 12])  # padded to 16 x 2^k rows, or not
def test_unit_lower_inverse_and_its_vjp(c):
    mx.random.seed(3)
    a = mx.tril(2.4 / c**0.5 * mx.random.normal((2, 3, c, c)), -1)  # 0.3 at 64, as k.k grows
    eye = mx.eye(c)
    t = unit_lower_inverse(a)
    assert mx.abs((eye + a) @ t - eye).max().item() < 1e-4
    cot = mx.random.normal(a.shape)
    _, (got,) = mx.vjp(unit_lower_inverse, [a], [cot])
    _, (want,) = mx.vjp(_substitute, [a], [cot])  # autodiff through the substitution
    assert rel(got, want) < 1e-4


def test_the_compiled_cpu_path_matches(monkeypatch):
    """delta.CPU_COMPILE (off by default: no gain measured on the walk) gives the same values and
    gradients through mlx-lm's gated_delta_update signature."""
    from mlxwalk.ops import delta

    mx.random.seed(3)
    q, k = mx.random.normal((2, 1, 40, 1, 32)) * 0.3
    v = mx.random.normal((1, 40, 2, 16))
    a, b = mx.random.normal((2, 1, 40, 2))
    a_log, dt_bias = mx.zeros((2,)), mx.zeros((2,))

    def run(*x):
        y, s = delta.gated_delta_update(*x, a_log, dt_bias)
        return y.sum() + (s * s).sum()

    want = mx.value_and_grad(run, argnums=[0, 1, 2, 3, 4])(q, k, v, a, b)
    monkeypatch.setattr(delta, "CPU_COMPILE", True)
    got = mx.value_and_grad(run, argnums=[0, 1, 2, 3, 4])(q, k, v, a, b)
    assert abs(got[0].item() - want[0].item()) <= 1e-5 * abs(want[0].item())
    for x, y in zip(got[1], want[1]):
        assert mx.allclose(x, y, rtol=1e-4, atol=1e-5)
