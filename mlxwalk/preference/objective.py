"""DPO as the training loop's objective (training/objective.py): `mlxwalk train --objective dpo`
and the mlx-lm drop-in's.

An item is a preference pair (`PairExample`): the chosen and the rejected answer to one prompt,
each a window of its own with only the answer labelled (pairs.py reads mlx-lm-lora's formats).
Training an item: its reference scores (the adapter off) decoded the first time the pair is met
and kept on it, so later epochs read them; then the chosen and the rejected window walked with
the signed weights +n_c and -n_r and the pair's share rescaled by c = beta sigmoid(-margin) once
both losses are known (rewards.walk_pair): one exact gradient per pair, in one chunk's memory.
Each pair counts once in a step's mean, as in mlx-lm-lora, and its metrics are mlx-lm-lora's.
`--objective simpo` trains SimPO on the same pairs the same way, with no reference: its rewards
are beta times the answers' mean log-probabilities, so the weights are +1 and -1 (walk_simpo).
No array library here: both backends run it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from ..errors import DataError
from ..training import data
from . import pairs
from .rewards import (
    Scores,
    Terms,
    policy_scores,
    reference_scores,
    simpo_terms,
    terms,
    walk_pair,
    walk_simpo,
)

# name in the report and mlx-lm-lora's callback keys (train_/val_ before it): label in a line
METRICS = {
    "chosen_reward": "chosen_r",
    "rejected_reward": "rejected_r",
    "accuracies": "acc",
    "margins": "margin",
}


@dataclass
class PairExample:
    """A pair as the run holds it: each answer an Example (ids and labels), and its reference
    scores once decoded."""

    chosen: data.Example
    rejected: data.Example
    where: str = ""
    reference: Scores | None = None

    @property
    def trainable(self) -> int:
        return min(self.chosen.trainable, self.rejected.trainable)

    @property
    def ids(self) -> list[int]:  # every token either window holds (Dataset.check_ids)
        return self.chosen.ids + self.rejected.ids

    def __len__(self) -> int:
        return max(len(self.chosen), len(self.rejected))


class PairData(data.Dataset):
    """A split of preference pairs, cut and counted as data.Dataset cuts and counts examples."""

    @property
    def trainable_tokens(self) -> int:
        return sum(p.chosen.trainable + p.rejected.trainable for p in self.examples)

    def fitted(self, window: int, how: str = "left") -> PairData:
        """Each answer's window cut to `window` positions; a pair either side of which loses every
        label is cut away."""
        out = PairData([], self.skipped, self.truncated, self.source, self.cut_away)
        out.skipped_where, out.cut_away_where = list(self.skipped_where), list(self.cut_away_where)
        for pair in self.examples:
            (chosen, cut_c), (rejected, cut_r) = (
                data.fit(side, window, how) for side in (pair.chosen, pair.rejected)
            )
            out.truncated += cut_c or cut_r
            fitted = PairExample(chosen, rejected, pair.where)
            if fitted.trainable == 0:
                out.cut_away += 1
                out.cut_away_where.append(pair.where)
            else:
                out.examples.append(fitted)
        return out


def is_pair(row: dict) -> bool:
    return isinstance(row, dict) and "chosen" in row and "rejected" in row


def load(
    folder: Path,
    split: str,
    tokenizer,
    window: int | None,
    how: str = "left",
    mask_prompt: bool = True,
    objective: str = "dpo",
) -> PairData:
    """`split`.jsonl of `folder` as pairs (data.load's arguments; only answers are labelled, so
    `mask_prompt` changes nothing); a row that is not a pair is refused, naming `objective`."""
    path = Path(folder) / f"{split}.jsonl"

    def pair(row: dict, where: str) -> PairExample:
        if not is_pair(row):
            keys = ", ".join(repr(k) for k in list(row)[:4]) or "no keys"
            raise DataError(
                f"{where}: --objective {objective} trains on preference pairs (rows with "
                f"'chosen' and 'rejected', mlx-lm-lora's formats); this row has {keys}"
            )
        sides = [pairs.example(tokenizer, m, where) for m in pairs.conversations(row, where)]
        return PairExample(*sides, where)

    out = data.gather(PairData([], source=str(path)), path, pair)
    return out if window is None else out.fitted(window, how)


@dataclass
class DPO:
    """DPO's loss per pair, -log sigmoid(beta ((pi_c - ref_c) - (pi_r - ref_r)))."""

    beta: float = 0.1
    name: str = "dpo"
    metrics: ClassVar[dict[str, str]] = METRICS
    references: int = field(default=0, compare=False)  # pairs whose reference this process decoded

    def load(self, *args, **kw) -> PairData:
        return load(*args, **kw, objective=self.name)

    def windows(self, item: PairExample) -> list:
        return [item.chosen, item.rejected]

    def weight(self, item: PairExample) -> float:
        return 1.0

    def train(self, item: PairExample, walker) -> float:
        t = walk_pair(item, self.reference(item, walker), self.beta, walker)
        return self.noted(t, walker)

    def evaluate(self, item: PairExample, walker) -> float:
        t = terms(policy_scores(item, walker), self.reference(item, walker), self.beta)
        return self.noted(t, walker)

    def reference(self, item: PairExample, walker) -> Scores:
        """The pair's reference scores: decoded with the adapter off once, then kept."""
        if item.reference is None:
            item.reference = reference_scores(item, walker)
            self.references += 1
        return item.reference

    def noted(self, t: Terms, walker) -> float:
        walker.note(
            chosen_reward=t.chosen_reward,
            rejected_reward=t.rejected_reward,
            accuracies=float(t.accurate),
            margins=t.margin,
        )
        return t.loss


@dataclass
class SimPO(DPO):
    """SimPO's loss per pair, -log sigmoid(beta (pi_c / n_c - pi_r / n_r) - gamma): DPO's pairs,
    each reward the answer's mean log-probability per labelled token, no reference."""

    gamma: float = 0.5
    name: str = "simpo"

    def train(self, item: PairExample, walker) -> float:
        return self.noted(walk_simpo(item, self.beta, self.gamma, walker), walker)

    def evaluate(self, item: PairExample, walker) -> float:
        means = [-walker.loss(side) for side in self.windows(item)]
        return self.noted(simpo_terms(*means, self.beta, self.gamma), walker)
