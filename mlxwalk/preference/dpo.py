"""DPO on whole windows: the loss of a preference pair and its gradient by the walk.

DPO's loss for a pair is -log sigmoid(m), with the margin
    m = beta * ((pi_c - ref_c) - (pi_r - ref_r)),
pi and ref the summed log-probabilities of the chosen (c) and rejected (r) response tokens under
the policy (the adapter on) and the reference (the adapter off). Its gradient is
    dL = -beta * sigmoid(-m) * (d pi_c - d pi_r),
a weighted difference of the two windows' log-likelihood gradients whose weight is known once
both windows are decoded. A window's walk returns the gradient of its mean cross-entropy
(sum(w * CE) / sum(w)), which is -pi / n: so the pair's gradient is
    c * (n_c * g_c - n_r * g_r),  c = beta * sigmoid(-m),
each g taken by the exact walk in one chunk's memory. Scaling a gradient after the walk equals
signing the weights before it (the walk is linear in its weights), and keeps each window's
loss the policy's own score, so one walk per window gives both m and the gradient. SimPO (no
reference, rewards beta * pi / n, a target margin gamma) is the same with the weights +1 and -1
and c = beta * sigmoid(gamma - m) (simpo_gradient, one_graph_simpo).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_map

from ..walk import PlainWalk, WalkConfig, Window, exact_gradient, one_graph, window_loss
from ..walk.guards import check_finite
from ..walk.loss import weighted_loss
from .rewards import Pair, Scores, Terms, terms, walk_pair, walk_simpo

WALKS = ("exact", "plain", "one-graph")

__all__ = ["Pair", "Scores", "Terms", "terms", "adapter_off", "score", "reference_scores"]


@contextmanager
def adapter_off(model: nn.Module) -> Iterator[None]:
    """The reference model: every LoRA layer's scale set to 0 (mlx-lm's LoRA and DoRA layers
    add `scale * lora_b(lora_a(x))`), restored on exit."""
    layers = [m for _, m in model.named_modules() if hasattr(m, "lora_a") and hasattr(m, "scale")]
    saved = [m.scale for m in layers]
    try:
        for m in layers:
            m.scale = 0.0
        yield
    finally:
        for m, s in zip(layers, saved):
            m.scale = s


def score(model: nn.Module, window: Window, config: WalkConfig) -> float:
    """The window's summed log-probability of its labelled tokens, decoded chunk by chunk with no
    gradient (window_loss is the weighted mean cross-entropy)."""
    return -window_loss(model, window, config) * window.total


def reference_scores(model: nn.Module, pair: Pair, config: WalkConfig) -> Scores:
    """The pair's scores with the adapter off: computed once per pair and kept."""
    with adapter_off(model):
        return Scores(score(model, pair.chosen, config), score(model, pair.rejected, config))


def pair_gradient(
    model: nn.Module,
    pair: Pair,
    reference: Scores,
    beta: float,
    config: WalkConfig,
    walk: str = "exact",
) -> tuple[Terms, dict]:
    """The pair's DPO terms and the gradient of its loss in `model.trainable_parameters()`.

    walk="exact" walks each window in chunks and equals "one-graph" (the reference: each window as
    one graph) to rounding; "plain" cuts the gradient at every chunk boundary (the sum of its
    chunks' gradients at the unchanged adapter), as a chunk-cut trainer does."""
    if walk not in WALKS:
        raise ValueError(f"walk {walk!r} is unknown; choose one of {', '.join(WALKS)}")
    if not beta > 0:
        raise ValueError(f"beta must be positive, got {beta}")
    walker = _Walker(model, config, walk)
    t = walk_pair(pair, reference, beta, walker)
    mx.eval(walker.grads)
    return t, walker.grads


def simpo_gradient(
    model: nn.Module, pair: Pair, beta: float, gamma: float, config: WalkConfig, walk="exact"
) -> tuple[Terms, dict]:
    """SimPO's terms and gradient for the pair, as pair_gradient gives DPO's (no reference)."""
    if walk not in WALKS:
        raise ValueError(f"walk {walk!r} is unknown; choose one of {', '.join(WALKS)}")
    walker = _Walker(model, config, walk)
    t = walk_simpo(pair, beta, gamma, walker)
    mx.eval(walker.grads)
    return t, walker.grads


class _Walker:
    """training/objective.py's Walker over one model's walks: the pair's gradient summed here."""

    def __init__(self, model: nn.Module, config: WalkConfig, walk: str):
        self.model, self.config, self.walk = model, config, walk
        self.grads = None

    def gradient(self, window: Window, scale: float = 1.0) -> float:
        mean, grads = walked_gradient(self.model, window, self.config, self.walk)
        if self.grads is None:
            self.grads = tree_map(lambda g: scale * g, grads)
        else:
            self.grads = tree_map(lambda a, g: a + scale * g, self.grads, grads)
        return mean

    def rescale(self, factor: float) -> None:
        self.grads = tree_map(lambda a: factor * a, self.grads)


def walked_gradient(
    model: nn.Module, window: Window, config: WalkConfig, walk: str
) -> tuple[float, dict]:
    """The window's mean cross-entropy and its gradient, by one walk."""
    if walk == "exact":
        runner, grads = exact_gradient(model, window, config)
        return runner.loss, grads
    if walk == "plain":
        loss, grads = PlainWalk(model, window, config).run()
    else:
        loss, grads = one_graph(model, window, config.products)
    check_finite(loss, grads)
    mx.eval(loss, grads)
    return loss.item(), grads


def one_graph_loss(model: nn.Module, pair: Pair, reference: Scores, beta: float):
    """The pair's DPO loss and gradient as one graph over both whole windows: the definition the
    walk is checked against (no chunks, no weights known in advance)."""
    x_c, y_c, w_c = _rows(pair.chosen)
    x_r, y_r, w_r = _rows(pair.rejected)

    def objective(params):
        model.update(params)
        pi_c = -weighted_loss(model(x_c), y_c, w_c, 1.0)
        pi_r = -weighted_loss(model(x_r), y_r, w_r, 1.0)
        margin = beta * ((pi_c - reference.chosen) - (pi_r - reference.rejected))
        return -nn.log_sigmoid(margin)

    loss, grads = mx.value_and_grad(objective)(model.trainable_parameters())
    mx.eval(loss, grads)
    return loss.item(), grads


def one_graph_simpo(model: nn.Module, pair: Pair, beta: float, gamma: float):
    """SimPO's loss and gradient for the pair as one graph: -log sigmoid(beta (pi_c / n_c -
    pi_r / n_r) - gamma), the definition simpo_gradient is checked against."""
    x_c, y_c, w_c = _rows(pair.chosen)
    x_r, y_r, w_r = _rows(pair.rejected)

    def objective(params):
        model.update(params)
        mean_c = -weighted_loss(model(x_c), y_c, w_c, w_c.sum())
        mean_r = -weighted_loss(model(x_r), y_r, w_r, w_r.sum())
        return -nn.log_sigmoid(beta * (mean_c - mean_r) - gamma)

    loss, grads = mx.value_and_grad(objective)(model.trainable_parameters())
    mx.eval(loss, grads)
    return loss.item(), grads


def _rows(window: Window) -> tuple[mx.array, mx.array, mx.array]:
    """inputs, targets, weights as (1, n) arrays."""
    return tuple(mx.array(a)[None] for a in (window.inputs, window.targets, window.weights))
