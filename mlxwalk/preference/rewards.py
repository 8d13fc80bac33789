"""DPO's loss, rewards and gradient weight from a pair's four scores, and the order in which a
pair's two windows are walked to give its gradient. No array library: both backends, the
training loop and the exactness table share it.

A window's walk hands in the gradient of its mean cross-entropy, g = -d pi / n (pi the summed
log-probability of its n labelled tokens). DPO's gradient is
    dL = -beta sigmoid(-m) (d pi_c - d pi_r) = c (n_c g_c - n_r g_r),  c = beta sigmoid(-m),
so the chosen window is walked with the weight +n_c, the rejected one with -n_r, and the pair's
gradient is then scaled by c, known once both walks have given their losses (the walk is linear
in its weights, so scaling after it equals signing the weights before it). SimPO's reward is
beta times the mean log-probability, -beta times the window's mean loss, with no reference: the
weights are +1 and -1 and c = beta sigmoid(gamma - margin) (`walk_simpo`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Pair:
    """One preference: the same prompt answered twice, each answer's tokens labelled (each side
    a window: inputs, targets and weights)."""

    chosen: object
    rejected: object


@dataclass(frozen=True)
class Scores:
    """Summed log-probabilities of each answer's labelled tokens."""

    chosen: float
    rejected: float


@dataclass(frozen=True)
class Terms:
    """What a pair contributes, in mlx-lm-lora's terms (DPO's rewards are beta * (pi - ref),
    SimPO's beta * pi / n)."""

    loss: float  # -log sigmoid(margin) (SimPO's: of margin - gamma)
    margin: float  # chosen reward - rejected reward
    chosen_reward: float
    rejected_reward: float
    weight: float  # c, the factor on the walks' signed gradients: beta * sigmoid(-margin)

    @property
    def accurate(self) -> bool:
        return self.chosen_reward > self.rejected_reward


def terms(policy: Scores, reference: Scores, beta: float) -> Terms:
    """The pair's loss, rewards and gradient weight from the four scores."""
    chosen = beta * (policy.chosen - reference.chosen)
    rejected = beta * (policy.rejected - reference.rejected)
    margin = chosen - rejected
    loss = softplus(-margin)  # -log sigmoid(margin), stable for either sign
    return Terms(loss, margin, chosen, rejected, beta * sigmoid(-margin))


def softplus(x: float) -> float:
    return max(x, 0.0) + math.log1p(math.exp(-abs(x)))


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def labelled(window) -> float:
    """The window's summed weights: n, its labelled tokens."""
    return float(window.weights.sum())


def walk_pair(pair: Pair, reference: Scores, beta: float, walker) -> Terms:
    """The pair's terms, its gradient handed to `walker` (training/objective.py's Walker: each
    window walked once with gradient, then the pair's share rescaled by c)."""
    n_c, n_r = labelled(pair.chosen), labelled(pair.rejected)
    mean_c = walker.gradient(pair.chosen, n_c)
    mean_r = walker.gradient(pair.rejected, -n_r)
    t = terms(Scores(-mean_c * n_c, -mean_r * n_r), reference, beta)
    walker.rescale(t.weight)
    return t


def simpo_terms(chosen: float, rejected: float, beta: float, gamma: float) -> Terms:
    """SimPO's terms from each answer's mean log-probability per labelled token (no reference):
    rewards beta * mean, loss -log sigmoid(margin - gamma)."""
    chosen, rejected = beta * chosen, beta * rejected
    margin = chosen - rejected
    short = gamma - margin  # how far the margin falls short of gamma
    return Terms(softplus(short), margin, chosen, rejected, beta * sigmoid(short))


def walk_simpo(pair: Pair, beta: float, gamma: float, walker) -> Terms:
    """SimPO's pair on the walk: its rewards are beta times the windows' mean log-probabilities,
    so each window's gradient (of its mean loss) enters with the weight +1 or -1, and the pair's
    share is rescaled by c = beta sigmoid(gamma - margin):
        dL = -sigmoid(gamma - m) beta (d pi_c / n_c - d pi_r / n_r) = c (g_c - g_r)."""
    mean_c = walker.gradient(pair.chosen, 1.0)
    mean_r = walker.gradient(pair.rejected, -1.0)
    t = simpo_terms(-mean_c, -mean_r, beta, gamma)
    walker.rescale(t.weight)
    return t


def reference_scores(pair: Pair, walker) -> Scores:
    """The pair's scores with the adapter off (the walker's reference decode)."""
    n_c, n_r = labelled(pair.chosen), labelled(pair.rejected)
    return Scores(
        -walker.loss(pair.chosen, reference=True) * n_c,
        -walker.loss(pair.rejected, reference=True) * n_r,
    )


def policy_scores(pair: Pair, walker) -> Scores:
    """The pair's scores with the adapter on, decoded with no gradient (validation)."""
    n_c, n_r = labelled(pair.chosen), labelled(pair.rejected)
    return Scores(-walker.loss(pair.chosen) * n_c, -walker.loss(pair.rejected) * n_r)
