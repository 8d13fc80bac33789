"""The stem: with LoRA on the upper layers only (mlx-lm's --num-layers), the layers beneath are
never differentiated. They get no taps and no accumulators, and the reverse pass neither records
nor keeps them. The walk stays exact against one graph, and a stem one layer too tall fails."""

import mlx.core as mx
import numpy as np
import pytest

from mlxwalk import window_gradient
from mlxwalk.commands.walk_exact import upper_layers_only
from mlxwalk.grading import BARS, EXACT, compare
from mlxwalk.walk import ExactWalk, WalkConfig, Window, arch, exact, runner

N = 128
IDS = np.random.default_rng(5).integers(0, 256, N + 1)


def grads(model, **kw):
    return window_gradient(model, IDS[:-1], IDS[1:], np.ones(N), **kw)[1]


def test_the_stem_is_the_frozen_layers_beneath_the_first_that_trains(qwen2):
    assert arch.stem(qwen2) == 0  # LoRA on every layer
    with upper_layers_only(qwen2, 3):
        assert arch.stem(qwen2) == 3
        qwen2.model.embed_tokens.unfreeze()
        assert arch.stem(qwen2) == 0  # the embedding trains: every layer carries its gradient
        qwen2.model.embed_tokens.freeze()
    with upper_layers_only(qwen2, len(qwen2.layers)):
        assert arch.stem(qwen2) == len(qwen2.layers) - 1  # the last layer always runs backward


@pytest.mark.parametrize("model", ["qwen2", "hybrid"])
@pytest.mark.parametrize(
    "kw", [{}, {"recompute": True, "keep_inputs": "off"}, {"recompute": True, "keep_inputs": "on"}]
)
def test_exact_with_a_stem(request, model, kw):
    model = request.getfixturevalue(model)
    with upper_layers_only(model, len(model.layers) // 2):
        one = grads(model, chunk=N, walk="one-graph")
        assert BARS[EXACT](*compare(grads(model, chunk=32, **kw), one))


def test_no_taps_accumulators_or_kept_inputs_beneath_the_stem(qwen2, monkeypatch):
    window = Window.of(IDS[:-1], IDS[1:], np.ones(N))
    config = WalkConfig(32, recompute=True, keep_inputs="on")
    full = ExactWalk(qwen2, window, config)
    with upper_layers_only(qwen2, 2):
        walk = ExactWalk(qwen2, window, config)
        assert walk.plan.accumulator_bytes * 2 == full.plan.accumulator_bytes
        seen = {}
        reverse = walk.reverse

        def spy(chunks=None):  # the decode's kept inputs, as the reverse pass starts
            seen["kept"] = {i: [k is not None for k in ks] for i, ks in walk.kept.items()}
            return reverse(chunks)

        walk.reverse = spy
        monkeypatch.setattr(exact, "Accumulators", spying(seen, exact.Accumulators))
        walk.run()
    layers = len(qwen2.layers)
    assert all(ks == [False] * 2 + [True] * (layers - 2 + 1) for ks in seen["kept"].values())
    acc = seen["acc"]
    assert [k.shape[2] for k in acc.keys] == [0, 0, N, N]


def spying(seen: dict, cls):
    def make(*args, **kw):
        seen["acc"] = cls(*args, **kw)
        return seen["acc"]

    return make


def test_a_stem_one_layer_too_tall_is_not_exact(qwen2, monkeypatch):
    with upper_layers_only(qwen2, 2):
        one = grads(qwen2, chunk=N, walk="one-graph")
        monkeypatch.setattr(arch, "stem", lambda model: 3)  # layer 2 trains, but gets no taps
        assert runner.arch.stem(qwen2) == 3
        assert not BARS[EXACT](*compare(grads(qwen2, chunk=32), one))
    mx.clear_cache()
