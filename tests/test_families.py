"""Every family the walk claims (arch.SUPPORTED), each as a tiny model walked exactly through both
attention paths; and the hybrids' reference (the chunked delta rule) against mlx-lm's own
recurrence."""

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest

from mlxwalk import tiny, window_gradient
from mlxwalk.commands.walk_exact import prepare
from mlxwalk.grading import BARS, EXACT, compare
from mlxwalk.ops.delta import fast_recurrence
from mlxwalk.walk import arch

N = 128
IDS = np.random.default_rng(5).integers(0, 256, N + 1)


def test_every_supported_family_has_a_tiny_model():
    families = {s.config["model_type"] for s in [*tiny.MODELS.values(), *tiny.FAMILIES.values()]}
    assert families == set(arch.SUPPORTED)


@pytest.mark.parametrize("name", list(tiny.FAMILIES))
def test_each_family_is_walked_exactly(name):
    model, _ = mlx_lm.load(str(tiny.path(name)))
    model = prepare(model)
    w = np.ones(N)
    _, one = window_gradient(model, IDS[:-1], IDS[1:], w, chunk=N, walk="one-graph")
    for attention in ("tiled", "fused"):
        _, exact = window_gradient(model, IDS[:-1], IDS[1:], w, chunk=32, attention=attention)
        cosine, error = compare(exact, one)
        assert BARS[EXACT](cosine, error), (name, attention, cosine, error)


@pytest.mark.parametrize("name", ["tiny-qwen3_5", "tiny-qwen3_next"])
def test_the_chunked_delta_rule_matches_mlx_lms_recurrence(name):
    """one_graph runs the delta rule chunked (mlxwalk/ops/delta/); mlx-lm runs it token by token.
    The same logits and the same gradient, to float32 rounding."""
    model, _ = mlx_lm.load(str(tiny.path(name)))
    model = prepare(model)
    x, y = mx.array(IDS[None, :-1]), mx.array(IDS[None, 1:])

    def loss(params):
        model.update(params)
        return mx.mean(nn.losses.cross_entropy(model(x), y))

    params = model.trainable_parameters()
    theirs = model(x)
    their_loss, their_grads = mx.value_and_grad(loss)(params)
    with fast_recurrence(model):
        ours = model(x)
        our_loss, our_grads = mx.value_and_grad(loss)(params)
    rel = (mx.linalg.norm((ours - theirs).reshape(-1)) / mx.linalg.norm(theirs.reshape(-1))).item()
    assert rel <= 1e-5, rel
    assert abs(our_loss.item() - their_loss.item()) <= 1e-5 * abs(their_loss.item())
    cosine, error = compare(our_grads, their_grads)
    assert BARS[EXACT](cosine, error), (cosine, error)
