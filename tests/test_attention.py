"""chunk_attention against the unfused reference: outputs and gradients, every layout."""

import mlx.core as mx
import pytest

from mlxwalk.ops.attention import Prefix, chunk_attention
from mlxwalk.walk.store import KVStore


def reference_attention(q, k, v, scale, offset=0):
    """The naive reference: unfused attention over full K/V, causal with an `offset`."""
    hq, hkv = q.shape[1], k.shape[1]
    k, v = mx.repeat(k, hq // hkv, axis=1), mx.repeat(v, hq // hkv, axis=1)
    s = (q * scale) @ k.swapaxes(-1, -2)
    n, m = s.shape[-2:]
    mask = (mx.arange(n)[:, None] + offset) >= mx.arange(m)[None]
    s = mx.where(mask, s, -mx.inf)
    return mx.softmax(s, axis=-1) @ v


def rel(a, b):
    return (mx.linalg.norm((a - b).reshape(-1)) / mx.linalg.norm(b.reshape(-1))).item()


def setup(hkv, groups, dim, start, chunk, cache_type="float32", seed=0):
    mx.random.seed(seed)
    hq = hkv * groups
    q = mx.random.normal((1, hq, chunk, dim))
    k, v = mx.random.normal((1, hkv, chunk, dim)), mx.random.normal((1, hkv, chunk, dim))
    pk, pv = mx.random.normal((1, hkv, start, dim)), mx.random.normal((1, hkv, start, dim))
    store = KVStore([(hkv, dim, dim)], start + chunk, cache_type, mx.float32)
    store.write(0, 0, pk, pv)
    mx.eval(store.arrays())
    pk, pv = store.read(0, 0, start, mx.float32)  # the prefix as the store holds it
    return q, k, v, pk, pv, Prefix(store, 0, start, mx.float32)


@pytest.mark.parametrize("groups", [1, 2, 7])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("start, chunk, grad_from, tile", [(300, 64, 100, 128), (96, 40, 0, 64)])
def test_matches_the_unfused_reference(groups, dim, start, chunk, grad_from, tile):
    q, k, v, pk, pv, prefix = setup(2, groups, dim, start, chunk)
    scale = dim**-0.5
    taps = tuple(mx.zeros((1, 2, start - grad_from, dim)) for _ in range(2))

    def walk(q, k, v, dk, dv):
        return chunk_attention(q, k, v, prefix, grad_from, (dk, dv), scale, tile=tile)

    def ref(q, k, v, dk, dv):
        kk = mx.concatenate([pk[..., :grad_from, :], pk[..., grad_from:, :] + dk, k], axis=2)
        vv = mx.concatenate([pv[..., :grad_from, :], pv[..., grad_from:, :] + dv, v], axis=2)
        return reference_attention(q, kk, vv, scale, offset=start)

    cot = mx.random.normal(q.shape)
    inputs = [q, k, v, *taps]
    out, grads = mx.vjp(walk, inputs, [cot])
    want, want_grads = mx.vjp(ref, inputs, [cot])
    assert rel(out[0], want[0]) < 1e-4
    for name, a, b in zip(("dq", "dk", "dv", "dtap_k", "dtap_v"), grads, want_grads):
        assert rel(a, b) < 1e-4, name


def test_no_prefix_and_no_taps():
    q, k, v, *_ = setup(2, 2, 64, 0, 50)
    out = chunk_attention(q, k, v, None, 0, None, 0.125)
    assert rel(out, reference_attention(q, k, v, 0.125)) < 1e-5


def test_8bit_prefix_is_read_tile_by_tile():
    q, k, v, pk, pv, prefix = setup(2, 2, 64, 200, 32, cache_type="q8")
    out = chunk_attention(q, k, v, prefix, 200, None, 0.125, tile=64)
    ref = reference_attention(
        q, mx.concatenate([pk, k], axis=2), mx.concatenate([pv, v], axis=2), 0.125, offset=200
    )
    assert rel(out, ref) < 1e-5  # against the same dequantized values
