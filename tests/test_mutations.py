"""The exactness rows can fail: remove the surrogate and watch them fail."""

import mlx.core as mx
import numpy as np

from mlxwalk import taps, window_gradient
from mlxwalk.exactness import BARS, EXACT, compare

N = 128
IDS = np.random.default_rng(2).integers(0, 256, N + 1)


def test_exact_row_fails_without_the_kv_surrogate(qwen2, monkeypatch):
    w = np.ones(N)
    _, one = window_gradient(qwen2, IDS[:-1], IDS[1:], w, chunk=N, walk="one-graph")
    _, exact = window_gradient(qwen2, IDS[:-1], IDS[1:], w, chunk=32)
    assert BARS[EXACT](*compare(exact, one))
    monkeypatch.setattr(taps.ChunkKV, "surrogate", lambda self: mx.array(0.0))
    _, broken = window_gradient(qwen2, IDS[:-1], IDS[1:], w, chunk=32)
    assert not BARS[EXACT](*compare(broken, one))


def test_hybrid_exact_row_fails_without_the_state_surrogate(hybrid, monkeypatch):
    w = np.ones(N)
    _, one = window_gradient(hybrid, IDS[:-1], IDS[1:], w, chunk=N, walk="one-graph")
    _, exact = window_gradient(hybrid, IDS[:-1], IDS[1:], w, chunk=32)
    assert BARS[EXACT](*compare(exact, one))
    monkeypatch.setattr(taps.ChunkState, "surrogate", lambda self: mx.array(0.0))
    _, broken = window_gradient(hybrid, IDS[:-1], IDS[1:], w, chunk=32)
    assert not BARS[EXACT](*compare(broken, one))
