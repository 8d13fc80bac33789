"""A prompt's answer group by the walk: one decode and one walk give the mean DPO loss of K
pairs that share every input, and its gradient equals one graph's."""

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxwalk.errors import DataError
from mlxwalk.grading import BARS, EXACT, compare
from mlxwalk.preference import dpo, groups
from mlxwalk.walk import WalkConfig, Window, target_scores

N, K, VOCAB = 150, 5, 256


def group(seed: int = 4) -> Window:
    """A window whose answer, its last two positions, has a chosen and K rejected targets."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, N + 1)
    answer = np.r_[np.zeros(N - 2), np.ones(2)]
    rejected = rng.integers(0, VOCAB, (N, K))
    return groups.group_window(ids[:-1], ids[1:], rejected, answer)


def column(g: Window, t: int) -> Window:
    """Column t of the group as a window of its own."""
    return Window.of(g.inputs, g.targets[:, t], g.weights[:, t])


def test_scores_are_each_columns_own(qwen2):
    g, config = group(), WalkConfig(chunk=32)
    scores = target_scores(qwen2, g, config)
    assert len(scores) == K + 1
    for t in (0, 3, K):
        assert scores[t] == pytest.approx(dpo.score(qwen2, column(g, t), config), rel=1e-5)


@pytest.mark.parametrize("name", ["qwen2", "hybrid"])
def test_exact_group_equals_one_graph_and_the_chunk_cut_does_not(name, request):
    model = request.getfixturevalue(name)
    g, config = group(), WalkConfig(chunk=32)
    ref = groups.reference_scores(model, g, config)
    loss, one = groups.one_graph_group_loss(model, g, ref, beta=0.5)
    pairs, exact = groups.group_gradient(model, g, ref, 0.5, config)
    _, plain = groups.group_gradient(model, g, ref, 0.5, config, walk="plain")
    assert sum(t.loss for t in pairs) / K == pytest.approx(loss, rel=1e-5)
    assert BARS[EXACT](*compare(exact, one))  # relative L2 <= 2e-5
    assert compare(plain, one)[1] > 0.1  # the cut loses the prefix's share


def test_a_group_of_one_is_the_pair(qwen2):
    """One rejected answer: the group's gradient is pair_gradient's on the two windows."""
    g, config = group(), WalkConfig(chunk=40)
    one = Window.of_targets(g.inputs, g.targets[:, :2], g.weights[:, :2])
    pair = dpo.Pair(column(one, 0), column(one, 1))
    ref = groups.reference_scores(qwen2, one, config)
    [t], grads = groups.group_gradient(qwen2, one, ref, 0.3, config)
    t2, grads2 = dpo.pair_gradient(qwen2, pair, dpo.Scores(*ref), 0.3, config)
    assert t.loss == pytest.approx(t2.loss, rel=1e-5)
    assert BARS[EXACT](*compare(grads, grads2))


def test_saturated_group_steps_nowhere(qwen2):
    g, config = group(), WalkConfig(chunk=32)
    policy = target_scores(qwen2, g, config)
    ref = [policy[0] - 1e4, *policy[1:]]  # every margin huge: sigmoid(-m) is 0
    pairs, grads = groups.group_gradient(qwen2, g, ref, 1.0, config)
    assert all(t.weight == 0 and t.loss == 0 for t in pairs)
    assert not any(mx.any(a).item() for _, a in tree_flatten(grads))


def test_several_targets_refusals():
    ids = np.arange(8)
    with pytest.raises(DataError, match=r"\(n, T\)"):
        Window.of_targets(ids, ids, np.ones(8))
    with pytest.raises(DataError, match="no labelled position"):
        Window.of_targets(ids, np.c_[ids, ids], np.zeros((8, 2)))
    with pytest.raises(DataError, match="finite"):
        Window.of_targets(ids, np.c_[ids, ids], np.full((8, 2), math.nan))
    w = Window.of_targets(ids, np.c_[ids, ids], np.c_[np.ones(8), -np.ones(8)])
    assert w.total == 16 and w.targets_per_position == 2
