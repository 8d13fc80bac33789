"""One optimizer step, written once for both frameworks: this rank's share of the step's items
walked through the objective, one reduction over the ranks, one update.

A step covers `windows_per_step` items per rank, taken in the epoch's order: rank r walks
positions [r k, (r + 1) k) of the step's slice (`Ranks.mine`). Its gradient is the gradient of
the weighted mean of its items' losses: each item's gradient weighted by the objective's weight
for it (for token cross-entropy, its labelled tokens), summed over the items and the ranks,
divided by the summed weight. That is what one process computes on the same items, so two ranks
and one process take the same step. A step of one item in one process takes that item's
gradient as it is. Everything a step needs from the other ranks travels in one sum of one
float32 vector (`Layout`, then the gradient); a failure's words travel only when a rank failed,
in a second sum of bytes (Ranks._raise). The framework supplies the mechanics: `zeros`,
`gradient`, `accumulate`, `apply` and its ranks' `reduce`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import NonFinite
from .objective import TOKENS, Objective


@dataclass
class Stepped:
    """One optimizer step, as the loop sees it: each item's loss and the horizon it used (0: as
    asked), or a non-finite step (not taken; `error` says why)."""

    losses: np.ndarray
    horizons: np.ndarray
    finite: bool = True
    error: BaseException | None = None
    reduce_seconds: float = 0.0  # in the ranks' reduction, the wait for the slowest included
    weights: np.ndarray | None = None  # each item's weight, where known
    metrics: dict[str, np.ndarray] = field(default_factory=dict)  # the objective's, by item


class Layout:
    """What a step's reduction carries beside the gradient, by slot (the step's items in order;
    zeros in the slots of other ranks): each item's loss, weight and the horizon a memory budget
    narrowed it to (0: none), its metrics (the objective's), a non-finite flag, and one failure
    flag per rank. Packed as one float32 vector, [loss x weight | weight | horizon | each metric
    x weight] by slot, then the flag, then the ranks'."""

    def __init__(self, slots: int, size: int, metrics=()):
        self.slots, self.size, self.names = slots, size, tuple(metrics)
        self.losses = np.zeros(slots, np.float32)  # (slots,)
        self.weights = np.zeros(slots, np.float32)  # (slots,)
        self.horizons = np.zeros(slots, np.float32)  # (slots,)
        self.metrics = np.zeros((len(self.names), slots), np.float32)  # (metrics, slots)
        self.finite = True

    def pack(self, rank: int, failed: bool) -> np.ndarray:
        s, m = self.slots, len(self.names)
        head = np.zeros((3 + m) * s + 1 + self.size, np.float32)  # (3 + m slots + 1 + ranks,)
        head[:s] = self.losses * self.weights
        head[s : 2 * s], head[2 * s : 3 * s] = self.weights, self.horizons
        head[3 * s : (3 + m) * s] = (self.metrics * self.weights).ravel()
        head[(3 + m) * s] = not self.finite
        head[(3 + m) * s + 1 + rank] = failed
        return head

    def unpack(self, head: np.ndarray) -> int | None:
        """This layout from every rank's vector, summed; the first rank that failed, if any."""
        s, m = self.slots, len(self.names)
        failed = head[(3 + m) * s + 1 :]
        self.weights = head[s : 2 * s]
        self.losses, self.metrics = (
            np.divide(a, self.weights, out=np.zeros_like(a), where=self.weights > 0)
            for a in (head[:s], head[3 * s : (3 + m) * s].reshape(m, s))
        )
        self.horizons = head[2 * s : 3 * s]
        self.finite = head[(3 + m) * s] == 0 and bool(np.isfinite(head[:s]).all())
        return int(np.flatnonzero(failed)[0]) if failed.any() else None


class Walker:
    """One item's walks on a framework (objective.Walker): each window's gradient kept with its
    scale until the item is done (`fold`), when the item's share goes into the step's sum, times
    the item's weight when the step combines items."""

    def __init__(self, fw, cfg, seed: int, on_chunk, weight: float = 1.0):
        self.fw, self.cfg, self.seed, self.on_chunk = fw, cfg, seed, on_chunk
        self.weight, self.factor = weight, 1.0
        self.parts: list = []  # (gradient, scale) of each window walked
        self.noted: dict[str, float] = {}
        self.horizon = 0  # the narrowest horizon a budget cut one of its windows to (0: none)

    def gradient(self, window, scale: float = 1.0) -> float:
        loss, grads, used = self.fw.gradient(window, self.cfg, self.seed, self.on_chunk)
        self.parts.append((grads, scale))
        if used != self.cfg.horizon:
            self.horizon = min(self.horizon or used, used)
        return loss

    def loss(self, window, reference: bool = False) -> float:
        return self.fw.window_loss(window, self.cfg, reference)

    def rescale(self, factor: float) -> None:
        self.factor *= factor

    def note(self, **values: float) -> None:
        self.noted.update(values)

    def fold(self, acc):
        """`acc` plus this item's share of the step's gradient."""
        for grads, scale in self.parts:
            acc = self.fw.accumulate(acc, grads, scale * self.factor * self.weight)
        return acc


def weighs(slots: int, size: int) -> bool:
    """Whether a step combines items (else its one item's gradient is taken as it is)."""
    return slots > 1 or size > 1


def take_step(
    fw,
    items: list,
    cfg,
    seed: int,
    on_chunk=None,
    objective: Objective = TOKENS,
    error: BaseException | None = None,
) -> Stepped:
    """One optimizer step over `items` (None in the slot of a rank that failed before its walk,
    with `error`; every rank then stops with it), taken unless some item's loss or gradient is
    not finite. Item i is seeded `seed + i` (dropout)."""
    ranks, slots = fw.ranks, len(items)
    weighted = weighs(slots, ranks.size)
    names = list(objective.metrics)
    layout, acc, nan = Layout(slots, ranks.size, names), fw.zeros(), None
    for i in ranks.mine(list(range(slots)), cfg.windows_per_step):
        if items[i] is None:
            continue
        weight = objective.weight(items[i])
        walker = Walker(fw, cfg, seed + i, on_chunk, weight if weighted else 1.0)
        try:
            loss = objective.train(items[i], walker)
        except NonFinite as e:
            layout.finite, nan = False, e
            continue
        except Exception as e:  # kept for the reduction: every rank stops with it
            if ranks.size == 1:
                raise
            error = e
            break
        acc = walker.fold(acc)
        layout.losses[i], layout.weights[i], layout.horizons[i] = loss, weight, walker.horizon
        layout.metrics[:, i] = [walker.noted.get(name, 0.0) for name in names]
    tic = time.perf_counter()
    if weighted:
        head, acc = ranks.reduce(layout.pack(ranks.rank, error is not None), acc)
        failed = layout.unpack(head)
        if failed is not None:
            ranks._raise(failed, error)
    elif error is not None:
        raise error
    else:
        layout.finite = layout.finite and bool(np.isfinite(layout.losses).all())
    reduced = time.perf_counter() - tic
    if not layout.finite:
        nan = nan or NonFinite("a NaN or infinite loss or gradient")
        return Stepped(layout.losses, layout.horizons, False, nan, reduced)
    fw.apply(acc, float(layout.weights.sum()) if weighted else None, cfg.grad_clip)
    metrics = dict(zip(names, layout.metrics))
    return Stepped(layout.losses, layout.horizons, True, None, reduced, layout.weights, metrics)
