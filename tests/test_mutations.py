"""The exactness rows can fail: remove a surrogate and watch the exact row fail."""

import mlx.core as mx
import numpy as np
import pytest

from mlxwalk import taps, window_gradient
from mlxwalk.exactness import BARS, EXACT, compare

N = 128
IDS = np.random.default_rng(2).integers(0, 256, N + 1)


@pytest.mark.parametrize(
    "model, cache",
    [("qwen2", taps.ChunkKV), ("hybrid", taps.ChunkState)],
    ids=["kv-surrogate", "state-surrogate"],
)
@pytest.mark.parametrize("recompute", [False, True], ids=["one-graph", "by-layer"])
def test_exact_row_fails_without_the_surrogate(request, model, cache, recompute, monkeypatch):
    model = request.getfixturevalue(model)
    w = np.ones(N)
    _, one = window_gradient(model, IDS[:-1], IDS[1:], w, chunk=N, walk="one-graph")
    _, exact = window_gradient(model, IDS[:-1], IDS[1:], w, chunk=32, recompute=recompute)
    assert BARS[EXACT](*compare(exact, one))
    monkeypatch.setattr(cache, "surrogate", lambda self: mx.array(0.0))
    _, broken = window_gradient(model, IDS[:-1], IDS[1:], w, chunk=32, recompute=recompute)
    assert not BARS[EXACT](*compare(broken, one))
