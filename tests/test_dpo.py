"""DPO by the walk: the pair's gradient equals one graph's, on an attention model and a hybrid."""

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from mlxwalk.grading import BARS, EXACT, compare
from mlxwalk.preference import dpo
from mlxwalk.walk import WalkConfig, Window

PROMPT, ANSWER = 150, 18


def pair(seed: int = 3, vocab: int = 256) -> dpo.Pair:
    """One prompt, two answers of different lengths; only the answers are labelled."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, vocab, PROMPT)

    def window(n: int) -> Window:
        ids = np.r_[prompt, rng.integers(0, vocab, n + 1)]
        w = np.r_[np.zeros(PROMPT - 1), np.ones(n + 1)]
        return Window.of(ids[:-1], ids[1:], w)

    return dpo.Pair(window(ANSWER), window(ANSWER - 5))


def test_terms_follow_the_definition():
    t = dpo.terms(dpo.Scores(-10.0, -14.0), dpo.Scores(-12.0, -12.5), beta=0.1)
    m = 0.1 * ((-10.0 + 12.0) - (-14.0 + 12.5))
    assert t.margin == pytest.approx(m)
    assert t.loss == pytest.approx(-math.log(1 / (1 + math.exp(-m))))
    assert t.weight == pytest.approx(0.1 / (1 + math.exp(m)))
    assert t.accurate and t.chosen_reward == pytest.approx(0.2)
    far = dpo.terms(dpo.Scores(0.0, -1e4), dpo.Scores(0.0, 0.0), beta=1.0)
    assert far.loss == 0.0 and far.weight == 0.0  # no overflow at a huge margin
    assert dpo.terms(dpo.Scores(-1e4, 0.0), dpo.Scores(0.0, 0.0), 1.0).loss == pytest.approx(1e4)


@pytest.mark.parametrize("name", ["qwen2", "hybrid"])
def test_exact_dpo_equals_one_graph_and_the_chunk_cut_does_not(name, request):
    model = request.getfixturevalue(name)
    p, config = pair(), WalkConfig(chunk=32)
    ref = dpo.reference_scores(model, p, config)
    loss, one = dpo.one_graph_loss(model, p, ref, beta=0.5)
    t, exact = dpo.pair_gradient(model, p, ref, 0.5, config)
    _, plain = dpo.pair_gradient(model, p, ref, 0.5, config, walk="plain")
    assert t.loss == pytest.approx(loss, rel=1e-5)
    assert BARS[EXACT](*compare(exact, one))  # relative L2 <= 2e-5 (reads 4.5e-6, 4.2e-6)
    assert compare(plain, one)[1] > 0.1  # the cut loses the prefix's share (reads 0.6-0.8)
    names = [k for k, _ in tree_flatten(model.trainable_parameters())]
    assert [k for k, _ in tree_flatten(exact)] == names


def test_the_reference_is_the_model_without_its_adapter(qwen2):
    p, config = pair(), WalkConfig(chunk=48)
    ref = dpo.reference_scores(qwen2, p, config)
    policy = dpo.Scores(dpo.score(qwen2, p.chosen, config), dpo.score(qwen2, p.rejected, config))
    assert policy.chosen != pytest.approx(ref.chosen, rel=1e-4)  # the adapter is on again
    saved = qwen2.trainable_parameters()
    qwen2.update(tree_map(lambda a: a * 0 if a.ndim else a, saved))  # A and B zero: no adapter
    bare = dpo.Scores(dpo.score(qwen2, p.chosen, config), dpo.score(qwen2, p.rejected, config))
    qwen2.update(saved)
    assert ref.chosen == pytest.approx(bare.chosen, rel=1e-5)
    assert ref.rejected == pytest.approx(bare.rejected, rel=1e-5)


def test_refusals(qwen2):
    p, config = pair(), WalkConfig(chunk=32)
    ref = dpo.Scores(0.0, 0.0)
    with pytest.raises(ValueError, match="beta"):
        dpo.pair_gradient(qwen2, p, ref, 0.0, config)
    with pytest.raises(ValueError, match="walk 'sideways'"):
        dpo.pair_gradient(qwen2, p, ref, 0.1, config, walk="sideways")
    mx.eval(qwen2.parameters())
