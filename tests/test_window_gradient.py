"""The public entry: exactness on the bundled attention model, its contract, and its refusals."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlxwalk import window_gradient
from mlxwalk.commands.walk_exact import Table
from mlxwalk.grading import BARS, EXACT, compare

N = 128
rng = np.random.default_rng(1)
IDS = rng.integers(0, 256, N + 1)
X, Y = IDS[:-1], IDS[1:]


def test_exact_walk_equals_one_graph_and_plain_does_not(qwen2):
    w = np.r_[np.zeros(40), np.ones(70), np.zeros(18)]
    l1, one = window_gradient(qwen2, X, Y, w, chunk=N, walk="one-graph")
    le, exact = window_gradient(qwen2, X, Y, w, chunk=24)
    lp, plain = window_gradient(qwen2, X, Y, w, chunk=24, walk="plain")
    assert BARS[EXACT](*compare(exact, one))  # relative L2 error <= 2e-5 (reads 4.6e-6)
    assert le == pytest.approx(l1, rel=1e-5) and lp == pytest.approx(l1, rel=1e-5)
    assert compare(plain, one)[0] < 0.95
    names = [k for k, _ in tree_flatten(qwen2.trainable_parameters())]
    assert [k for k, _ in tree_flatten(exact)] == names


class CutKV(KVCache):
    """mlx-lm's K/V cache inside one graph over the window: the K/V of every position stays in the
    graph, but a chunk's attention reads those before `grad_from` as constants."""

    def __init__(self):
        super().__init__()
        self.grad_from = 0

    def update_and_fetch(self, keys, values):
        if self.keys is not None:
            keys = mx.concatenate([self.keys, keys], axis=2)
            values = mx.concatenate([self.values, values], axis=2)
        self.keys, self.values, self.offset = keys, values, keys.shape[2]
        gf = self.grad_from
        return tuple(
            mx.concatenate([mx.stop_gradient(a[:, :, :gf]), a[:, :, gf:]], axis=2)
            for a in (keys, values)
        )


def horizon_reference(model, x, y, w, chunk: int, horizon: int) -> dict:
    """What a horizon-h walk promises, built without the walk (its plan, store, taps or loss):
    one graph over the window, run chunk by chunk through mlx-lm's caches, in which the chunk at
    `start` reads the K/V of positions before start - h as constants. The gradient still reaches
    them through the chunks that read them within their own horizon; recurrent states carry it
    whole, as the walk's do (the horizon cuts attention's prefix only)."""

    def objective(params):
        model.update(params)
        caches = [CutKV() if type(c) is KVCache else c for c in make_prompt_cache(model)]
        total = mx.array(0.0)
        for s in range(0, len(x), chunk):
            e = min(s + chunk, len(x))
            for c in caches:
                if isinstance(c, CutKV):
                    c.grad_from = max(0, s - horizon)
            logits = model(mx.array(x[None, s:e]), cache=caches)[0].astype(mx.float32)
            ce = nn.losses.cross_entropy(logits, mx.array(y[s:e]), reduction="none")
            total = total + (ce * mx.array(w[s:e], mx.float32)).sum()
        return total / float(np.sum(w))

    grads = mx.grad(objective)(model.trainable_parameters())
    mx.eval(grads)
    return grads


@pytest.mark.parametrize("name, horizon", [("qwen2", 32), ("hybrid", 40)])
def test_a_narrowed_horizon_is_its_prefix_reference_and_cuts_the_gradient(name, horizon, request):
    """The walk at horizon h against the independent reference (reads 4.6e-6 on both models; a
    horizon doubled in the walk reads 0.42 and 0.06), and a horizon covering the window is
    exact."""
    model = request.getfixturevalue(name)
    w = np.ones(N)
    _, one = window_gradient(model, X, Y, w, chunk=N, walk="one-graph")
    _, near = window_gradient(model, X, Y, w, chunk=32, horizon=horizon)
    _, whole = window_gradient(model, X, Y, w, chunk=32, horizon=N)
    want = horizon_reference(model, X, Y, w, 32, horizon)
    assert BARS[EXACT](*compare(near, want)), compare(near, want)
    assert BARS[EXACT](*compare(whole, one))  # a horizon covering the window is exact
    assert compare(near, one)[1] > 1e-2  # the horizon cuts the gradient


def test_every_row_of_the_table_holds(qwen2):
    rows = Table(qwen2, "tiny-qwen2").run()
    assert rows and all(r.ok for r in rows), "\n".join(r.line() for r in rows)


@pytest.mark.parametrize(
    "kwargs, inputs, match",
    [
        ({"chunk": 8}, (X, Y, np.zeros(N)), "no labelled position"),
        ({"chunk": 0}, (X, Y, np.ones(N)), "chunk must be at least 1"),
        ({"chunk": 8}, (X, Y[:-1], np.ones(N)), "differ in length"),
        ({"chunk": 8, "walk": "sideways"}, (X, Y, np.ones(N)), "walk 'sideways' is unknown"),
        ({"chunk": 8, "cache_type": "q3"}, (X, Y, np.ones(N)), "'q3' is unknown"),
    ],
)
def test_bad_input_raises_value_error(qwen2, kwargs, inputs, match):
    with pytest.raises(ValueError, match=match):
        window_gradient(qwen2, *inputs, **kwargs)


@pytest.mark.parametrize("name", ["qwen2", "hybrid"])
def test_loss_in_blocks_is_exact(name, request, monkeypatch):
    import mlx.core as mx

    from mlxwalk.walk import algorithm, arch

    model = request.getfixturevalue(name)
    head = arch.head(model)
    x = mx.array(X[:40])[None]
    assert mx.allclose(head.project(head.body(x, None)), model(x), atol=1e-5)
    monkeypatch.setattr(algorithm, "LOSS_BLOCK", 16)  # a 64-position chunk's loss in 4 blocks
    w = np.r_[np.zeros(20), np.ones(108)]
    l1, one = window_gradient(model, X, Y, w, chunk=N, walk="one-graph")
    le, exact = window_gradient(model, X, Y, w, chunk=64)
    assert le == pytest.approx(l1, rel=1e-5)
    assert BARS[EXACT](*compare(exact, one))


def test_dropout_gets_a_seed_and_refuses_recompute(qwen2):
    import mlx.nn as nn

    from mlxwalk.plan import PlanError
    from mlxwalk.walk import ExactWalk, WalkConfig, Window

    layers = [m for _, m in qwen2.named_modules() if isinstance(m, nn.Dropout)]
    assert layers
    for m in layers:
        m._p_1 = 0.9  # dropout 0.1
    w = np.ones(N)
    assert ExactWalk(qwen2, Window.of(X, Y, w), WalkConfig(chunk=32)).seed is not None
    with pytest.raises(PlanError, match="dropout"):
        window_gradient(qwen2, X, Y, w, chunk=32, recompute=True)


@pytest.mark.parametrize("split", [True, False])  # by layer, or mx.checkpoint in one graph
def test_recompute_is_exact_with_and_without_the_head_split(qwen2, monkeypatch, split):
    from mlxwalk.walk import arch

    if not split:
        monkeypatch.setattr(arch, "head", lambda model: None)
    w = np.r_[np.zeros(30), np.ones(98)]
    l1, one = window_gradient(qwen2, X, Y, w, chunk=N, walk="one-graph")
    le, exact = window_gradient(qwen2, X, Y, w, chunk=32, recompute=True)
    assert le == pytest.approx(l1, rel=1e-5)
    assert BARS[EXACT](*compare(exact, one))


def test_dropout_draws_the_same_masks_in_a_chunks_decode_and_its_graph(qwen2, monkeypatch):
    """A chunk runs twice (its decode, then its graph in the reverse pass); the surrogates pair
    the K/V of the decode with the graph's only if dropout drew the same masks in both."""
    import mlx.core as mx
    import mlx.nn as nn

    layers = [m for _, m in qwen2.named_modules() if isinstance(m, nn.Dropout)]
    for m in layers:
        m._p_1 = 0.7  # dropout 0.3
    drawn = []
    original = nn.Dropout.__call__

    def recording(self, x):
        y = original(self, x)
        drawn.append(y != 0)  # the mask (x has no exact zeros)
        return y

    monkeypatch.setattr(nn.Dropout, "__call__", recording)
    window_gradient(qwen2, X, Y, np.ones(N), chunk=32)  # 4 chunks
    d = len(layers)
    assert len(drawn) == 8 * d  # a one-token look at the layout, then the walk's seven runs:
    drawn = drawn[d:]  # 3 decodes (the last chunk's K/V feed nothing), 4 graphs in reverse
    decodes = [drawn[i * d : (i + 1) * d] for i in range(3)]
    graphs = [drawn[(3 + i) * d : (4 + i) * d] for i in range(4)][::-1]
    for k in range(3):
        for a, b in zip(decodes[k], graphs[k]):
            assert mx.array_equal(a, b), f"chunk {k}: the graph drew other masks"
    kept = mx.mean(decodes[0][0].astype(mx.float32)).item()
    assert 0.6 < kept < 0.8 and not mx.array_equal(decodes[0][0], decodes[1][0])


def test_exact_after_mlx_lm_grad_checkpoint_patched_the_layer_class(qwen2, monkeypatch):
    """mlx-lm's grad_checkpoint replaces the layer class's call with an mx.checkpoint that would
    hold the taps as constants; the walk runs the call beneath it."""
    from mlxwalk.walk import taps
    from scripts.lib import bench

    monkeypatch.setattr(taps, "_walk_classes", {})  # no walk class made before the patch
    w = np.ones(N)
    with bench.grad_checkpoint(qwen2):
        _, one = window_gradient(qwen2, X, Y, w, chunk=N, walk="one-graph")
        _, exact = window_gradient(qwen2, X, Y, w, chunk=32)
    assert BARS[EXACT](*compare(exact, one))
