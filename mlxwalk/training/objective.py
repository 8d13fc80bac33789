"""What a run trains toward, and who hears how it goes.

An objective turns one item of the run's data into a loss and the gradient the step takes,
through the walk's two ways of reading a window: with gradient (`Walker.gradient`, which adds
`scale` x the gradient of the window's mean loss over its labelled tokens) or without
(`Walker.loss`, the adapter on or off). The loop (run.py) and the step (step.py) take any
objective; `TokenLoss`, the mean cross-entropy over a window's labelled tokens (mlx-lm's
`default_loss`, walked), is the default. An item is what the loop draws in the epoch's order: a
window for `TokenLoss`, a preference pair for DPO and SimPO (preference/objective.py), which walk
each of its windows with gradient and then rescale the pair's share by a weight known only once
both losses are (`Walker.rescale`). The numbers an objective reports beside its loss (`metrics`:
the pairs' rewards, accuracy and margin) travel with the loss through the step's reduction to the
run's lines, epochs and report (`Walker.note`).

Callbacks hear the run as mlx-lm's `TrainingCallback` does (the same two methods and keys), so
one of mlx-lm's may be passed as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

from ..errors import DataError
from . import data


class Walker(Protocol):
    """The framework's walk of one window, as an objective asks for it (step.py's)."""

    def gradient(self, window, scale: float = 1.0) -> float:
        """`window` walked with gradient: `scale` x the gradient of its mean loss added to the
        item's; returns that mean loss. A NaN or infinite one raises NonFinite."""
        ...

    def loss(self, window, reference: bool = False) -> float:
        """`window`'s mean loss, decoded with no gradient; `reference`: with the adapter off
        (the model it adapts)."""
        ...

    def rescale(self, factor: float) -> None:
        """What this item has handed in so far, times `factor` (a weight known only after its
        walks)."""
        ...

    def note(self, **values: float) -> None:
        """The item's numbers beside its loss, by the names in the objective's `metrics`."""
        ...


class Objective(Protocol):
    """How an item becomes a loss and a gradient. The step's loss is the weighted mean of its
    items' losses (`weight`), and its gradient that mean's."""

    name: str
    metrics: dict[str, str]  # what `note` reports beside the loss: name -> a line's label

    def load(self, folder, split: str, tokenizer, window, how: str, mask_prompt: bool):
        """`split`.jsonl of the data folder as a data.Dataset of items (data.load's arguments),
        or a one-line DataError for a row this objective can't train on."""
        ...

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
    metrics: ClassVar[dict[str, str]] = {}

    def load(self, folder, split, tokenizer, window, how="left", mask_prompt=True):
        path = Path(folder) / f"{split}.jsonl"
        rows = data.numbered_rows(path) if path.is_file() else []
        if rows and "chosen" in rows[0][1] and "rejected" in rows[0][1]:
            raise DataError(
                f"{path}:{rows[0][0]}: a preference pair ('chosen' and 'rejected'); train "
                "preference data with --objective dpo (or simpo)"
            )
        return data.load(folder, split, tokenizer, window, how, mask_prompt)

    def windows(self, item) -> list:
        return [item]

    def weight(self, item) -> float:
        return float(item.weights.sum())

    def train(self, item, walker: Walker) -> float:
        return walker.gradient(item)

    def evaluate(self, item, walker: Walker) -> float:
        return walker.loss(item)


TOKENS = TokenLoss()


def of(cfg) -> Objective:
    """The objective a run's config names (--objective, --beta, --gamma)."""
    if cfg.objective == "dpo":
        from ..preference.objective import DPO

        return DPO(cfg.beta)
    if cfg.objective == "simpo":
        from ..preference.objective import SimPO

        return SimPO(beta=cfg.beta, gamma=cfg.gamma)
    return TOKENS


class Callback:
    """What a run tells as it goes, under mlx-lm's `TrainingCallback` names and keys: a report
    after every step (`iteration` counts windows) and one after every evaluation."""

    def on_train_loss_report(self, info: dict) -> None:
        """iteration, train_loss, tokens_per_second, trained_tokens, peak_memory (GB); and the
        objective's metrics as train_<name> (DPO's as mlx-lm-lora names them)."""

    def on_val_loss_report(self, info: dict) -> None:
        """iteration, val_loss, val_time (seconds); the objective's metrics as val_<name>."""
