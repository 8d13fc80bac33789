"""What a run trains toward, and who hears how it goes.

An objective turns one item of the run's data into a loss and the gradient the step takes,
through the walk's two ways of reading a window: with gradient (`Walker.gradient`, which adds
`scale` x the gradient of the window's mean loss over its labelled tokens) or without
(`Walker.loss`). The loop (run.py) and the step (step.py) take any objective; `TokenLoss`, the
mean cross-entropy over a window's labelled tokens (mlx-lm's `default_loss`, walked), is the
default. An item is what the loop draws in the epoch's order: a window for `TokenLoss`. An
objective over pairs (a chosen and a rejected window) would draw pairs, read each window's loss
without gradient first, then walk each with the scale its pair's loss gives it.

Callbacks hear the run as mlx-lm's `TrainingCallback` does (the same two methods and keys), so
one of mlx-lm's may be passed as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class Walker(Protocol):
    """The framework's walk of one window, as an objective asks for it (step.py's)."""

    def gradient(self, window, scale: float = 1.0) -> float:
        """`window` walked with gradient: `scale` x the gradient of its mean loss added to the
        item's; returns that mean loss. A NaN or infinite one raises NonFinite."""
        ...

    def loss(self, window) -> float:
        """`window`'s mean loss, decoded with no gradient."""
        ...


class Objective(Protocol):
    """How an item becomes a loss and a gradient. The step's loss is the weighted mean of its
    items' losses (`weight`), and its gradient that mean's."""

    name: str

    def windows(self, item) -> list:
        """The windows `item` holds (admission sizes the largest; the bar counts their tokens)."""
        ...

    def weight(self, item) -> float:
        """How much `item` counts in the step's mean, known before it is walked."""
        ...

    def train(self, item, walker: Walker) -> float:
        """`item`'s loss, its gradient handed to `walker` (once per window it walks)."""
        ...

    def evaluate(self, item, walker: Walker) -> float:
        """`item`'s loss with no gradient (validation)."""
        ...


@dataclass(frozen=True)
class TokenLoss:
    """The mean cross-entropy over a window's labelled tokens; a step's is the mean over every
    labelled token of its windows (each window weighted by its labelled weight)."""

    name: str = "tokens"

    def windows(self, item) -> list:
        return [item]

    def weight(self, item) -> float:
        return float(item.weights.sum())

    def train(self, item, walker: Walker) -> float:
        return walker.gradient(item)

    def evaluate(self, item, walker: Walker) -> float:
        return walker.loss(item)


TOKENS = TokenLoss()


class Callback:
    """What a run tells as it goes, under mlx-lm's `TrainingCallback` names and keys: a report
    after every step (`iteration` counts windows) and one after every evaluation."""

    def on_train_loss_report(self, info: dict) -> None:
        """iteration, train_loss, tokens_per_second, trained_tokens, peak_memory (GB)."""

    def on_val_loss_report(self, info: dict) -> None:
        """iteration, val_loss, val_time (seconds)."""
