"""SimPO by the walk: the pair's gradient equals one graph's, on an attention model and a hybrid;
its terms follow the definition."""

import math

import pytest
from mlx.utils import tree_flatten

from mlxwalk.grading import BARS, EXACT, compare
from mlxwalk.preference import dpo
from mlxwalk.preference.rewards import simpo_terms
from mlxwalk.walk import WalkConfig

from .test_dpo import pair


def test_terms_follow_the_definition():
    t = simpo_terms(-1.25, -2.0, beta=2.0, gamma=0.5)
    m = 2.0 * (-1.25 + 2.0)  # the reward margin, 1.5
    assert t.margin == pytest.approx(m) and t.chosen_reward == pytest.approx(-2.5)
    assert t.loss == pytest.approx(-math.log(1 / (1 + math.exp(-(m - 0.5)))))
    assert t.weight == pytest.approx(2.0 / (1 + math.exp(m - 0.5)))
    assert t.accurate
    short = simpo_terms(-1.0, -1.1, beta=1.0, gamma=0.5)  # ahead, yet short of gamma
    assert short.accurate and short.loss > math.log(2)


@pytest.mark.parametrize("name", ["qwen2", "hybrid"])
def test_exact_simpo_equals_one_graph_and_the_chunk_cut_does_not(name, request):
    model = request.getfixturevalue(name)
    p, config = pair(), WalkConfig(chunk=32)
    loss, one = dpo.one_graph_simpo(model, p, beta=2.0, gamma=0.5)
    t, exact = dpo.simpo_gradient(model, p, 2.0, 0.5, config)
    _, plain = dpo.simpo_gradient(model, p, 2.0, 0.5, config, walk="plain")
    assert t.loss == pytest.approx(loss, rel=1e-5)
    assert BARS[EXACT](*compare(exact, one))
    assert compare(plain, one)[1] > 0.1  # the cut loses the prefix's share
    names = [k for k, _ in tree_flatten(model.trainable_parameters())]
    assert [k for k, _ in tree_flatten(exact)] == names
