"""A prompt's answer group: a chosen answer and K rejected ones that share every input and
differ only in their labelled targets (a one-token answer: a choice, a label, a letter), every
pair's DPO loss in one decode and one walk.

Such a pair's two windows have the same logits, so one window with several targets a position
(Window.of_targets: column 0 the chosen answer, columns 1..K the rejected ones) holds them all.
The group's loss is the mean of its K pairs' (a batch of K pairs on one prompt, as preference
data built from several answers a prompt holds). With pi_t the summed log-probability of column
t's labelled targets and c_k = beta sigmoid(-m_k) / K,
    L = mean_k softplus(-m_k),   m_k = beta ((pi_0 - ref_0) - (pi_k - ref_k)),
    dL = -sum_k c_k (d pi_0 - d pi_k)  =  d sum_p [ (sum_k c_k) CE_p0 - sum_k c_k CE_pk ],
the gradient of one walk whose weights are +sum_k c_k on column 0 and -c_k on column k at the
answer's positions. The weights need the policy's scores first: a decode with no gradient
(walk.target_scores), then the walk: a decode and one walk for K pairs, where pair_gradient
walks two windows for one.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx.utils import tree_map

from ..walk import WalkConfig, Window, target_scores
from ..walk.runner import window_arrays
from .dpo import WALKS, adapter_off, walked_gradient
from .rewards import Scores, Terms, terms


def group_window(inputs, chosen, rejected, answer) -> Window:
    """The group's window: inputs (n,); chosen (n,) and rejected (n, K) targets; answer (n,),
    1 at the positions the answers are scored on, 0 elsewhere (every column alike)."""
    targets = np.column_stack([np.asarray(chosen), np.asarray(rejected)])  # (n, 1 + K)
    weights = np.repeat(np.asarray(answer, np.float32)[:, None], targets.shape[1], axis=1)
    return Window.of_targets(inputs, targets, weights)


def reference_scores(model: nn.Module, group: Window, config: WalkConfig) -> list[float]:
    """Each answer's score with the adapter off (computed once per group and kept)."""
    with adapter_off(model):
        return target_scores(model, group, config)


def group_gradient(
    model: nn.Module,
    group: Window,
    reference: list[float],
    beta: float,
    config: WalkConfig,
    walk: str = "exact",
) -> tuple[list[Terms], dict]:
    """The terms of each of the group's K pairs and the gradient of their mean loss in
    `model.trainable_parameters()`, by one decode and one walk ("exact", "plain" as
    pair_gradient's, or "one-graph")."""
    if walk not in WALKS:
        raise ValueError(f"walk {walk!r} is unknown; choose one of {', '.join(WALKS)}")
    if not beta > 0:
        raise ValueError(f"beta must be positive, got {beta}")
    policy = target_scores(model, group, config)
    pairs = [
        terms(Scores(policy[0], p), Scores(reference[0], r), beta)
        for p, r in zip(policy[1:], reference[1:])
    ]
    c = np.array([t.weight for t in pairs]) / len(pairs)  # (K,)
    # d pi_t weighs each position by the column's own weight, as its score did
    signed = group.weights * np.r_[c.sum(), -c][None]  # (n, 1 + K)
    if not signed.any():  # every pair saturated: the loss is flat here
        return pairs, tree_map(mx.zeros_like, model.trainable_parameters())
    walked = Window.of_targets(group.inputs, group.targets, signed)
    _, grads = walked_gradient(model, walked, config, walk)  # of sum(w CE) / sum(|w|)
    return pairs, tree_map(lambda g: walked.total * g, grads)


def one_graph_group_loss(model: nn.Module, group: Window, reference: list[float], beta: float):
    """The group's mean DPO loss and its gradient as one graph over the whole window: the
    definition group_gradient is checked against (no chunks, no weights known in advance)."""
    x, y, w = window_arrays(group, 0, len(group))  # (1, n), (1, n, 1 + K), (1, n, 1 + K)
    ref = mx.array(reference)  # (1 + K,)

    def objective(params):
        model.update(params)
        logp = nn.log_softmax(model(x).astype(mx.float32), axis=-1)  # (1, n, vocab)
        pi = (mx.take_along_axis(logp, y, axis=-1) * w).sum(axis=(0, 1))  # (1 + K,)
        margins = beta * ((pi[0] - ref[0]) - (pi[1:] - ref[1:]))  # (K,)
        return -nn.log_sigmoid(margins).mean()

    loss, grads = mx.value_and_grad(objective)(model.trainable_parameters())
    mx.eval(loss, grads)
    return loss.item(), grads
