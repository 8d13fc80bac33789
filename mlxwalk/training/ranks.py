"""Several processes training one adapter (under `mlx.launch`): MLX's distributed group, the
windows each rank walks, and each step's one reduction.

A step covers `windows_per_step` windows per rank, taken in the epoch's order: rank r walks
positions [r * k, (r + 1) * k) of the step's slice. The step's gradient is the gradient of the
mean loss over every labelled position of the step's windows, the same one process computes on
those windows: each window's gradient (of its own mean) weighted by its labelled weight, summed
over the windows and the ranks, divided by the summed weight. Everything a step needs from the
other ranks travels in one `all_sum` of one float32 vector: the weighted gradient, each window's
loss and weight by its slot, a non-finite flag, and a failure flag per rank. A failure's words
travel only when a rank failed, in a second `all_sum` of bytes.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..errors import RanksError

MESSAGE_BYTES = 400  # a failure's words, per rank
LEADER_FIRST_S = 2.0  # how long the other ranks wait to exit after a failure, leader first


class RankFailed(RanksError):
    """One rank failed; every rank raises this, naming it and its cause."""


@dataclass
class Ranks:
    group: object | None
    rank: int = 0
    size: int = 1

    @classmethod
    def init(cls) -> Ranks:
        """The launch's group (a group of one without `mlx.launch`)."""
        group = mx.distributed.init()
        return cls(group, group.rank(), group.size())

    @property
    def leader(self) -> bool:
        """The rank that writes: adapters, checkpoints, reports and the progress display."""
        return self.rank == 0

    def all_sum(self, x: mx.array) -> mx.array:
        if self.size == 1:
            return x
        return mx.distributed.all_sum(x, group=self.group, stream=mx.cpu)

    def sum_numpy(self, x: np.ndarray) -> np.ndarray:
        """all_sum of a small host array (flags, words), in the group's framework."""
        return x if self.size == 1 else np.array(self.all_sum(mx.array(x)))

    def mine(self, step: list, per_rank: int) -> list:
        """This rank's share of a step's slice of the epoch's order."""
        return step[self.rank * per_rank : (self.rank + 1) * per_rank]

    def agree(self, error: BaseException | None) -> None:
        """Every rank learns whether any failed; each raises RankFailed naming the first that
        did, with its words (this call is where the ranks meet)."""
        flags = np.zeros(self.size, np.float32)
        flags[self.rank] = error is not None
        flags = self.sum_numpy(flags)
        if flags.any():
            self._raise(int(np.flatnonzero(flags)[0]), error)

    def together(self, make):
        """`make()` on every rank: its result, or, if it raised on any rank, RankFailed on all
        (one process: the error itself), before any rank goes on alone."""
        made, error = None, None
        try:
            made = make()
        except Exception as e:
            error = e
        self.agree(error)
        return made

    def _raise(self, first: int, error: BaseException | None) -> None:
        words = np.zeros((self.size, MESSAGE_BYTES), np.int32)
        if error is not None:
            text = (str(error) or type(error).__name__).encode()[:MESSAGE_BYTES]
            words[self.rank, : len(text)] = np.frombuffer(text, np.uint8)
        words = self.sum_numpy(words)[first].astype(np.uint8)
        cause = bytes(words).rstrip(b"\0").decode(errors="replace")
        if self.size == 1 and error is not None:
            raise error
        failed = RankFailed(f"rank {first} of {self.size}: {cause}")
        failed.quiet = not self.leader  # one line, from the rank that speaks
        failed.settle = self.settle
        raise failed

    def settle(self) -> None:
        """Every rank waits here for every other (after the leader has said why it stops): a
        launcher ends the others once one rank exits, and the leader must not be ended before
        its line is out and its folder tidied."""
        self.sum_numpy(np.zeros(1, np.float32))
        if not self.leader:  # the leader exits first (its status is the one launchers report);
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a launcher's kill then just ends us
            time.sleep(LEADER_FIRST_S)


@dataclass
class StepSum:
    """One rank's part of a step, per slot (the step's windows in order; zeros in the slots of
    other ranks): each window's loss, labelled weight and the horizon it used (0: as asked),
    and the sum of its windows' gradients, each weighted by its window's weight (zeros when
    it has none, so every rank sends the same shapes)."""

    grads: dict
    losses: np.ndarray  # (slots,)
    weights: np.ndarray  # (slots,)
    horizons: np.ndarray  # (slots,)
    finite: bool = True


@dataclass
class Step:
    grads: dict  # the gradient of the mean loss over the step's labelled positions
    losses: np.ndarray  # (slots,) each window's loss
    weights: np.ndarray  # (slots,)
    horizons: np.ndarray  # (slots,) narrowed horizons, 0 where none was
    finite: bool


def weighs(slots: int, size: int) -> bool:
    """Whether a step combines windows (else its one window's gradient is taken as it is)."""
    return slots > 1 or size > 1


def reduce_step(ranks: Ranks, part: StepSum, error: BaseException | None) -> Step:
    """The step from every rank's part, in one all_sum; a rank's `error` stops every rank."""
    slots = len(part.losses)
    if not weighs(slots, ranks.size):
        if error is not None:
            raise error
        finite = part.finite and bool(np.isfinite(part.losses).all())
        return Step(part.grads, part.losses, part.weights, part.horizons, finite)
    flat = tree_flatten(part.grads)
    head = np.zeros(3 * slots + 1 + ranks.size, np.float32)
    head[:slots] = part.losses * part.weights
    head[slots : 2 * slots], head[2 * slots : 3 * slots] = part.weights, part.horizons
    head[3 * slots] = not part.finite
    head[3 * slots + 1 + ranks.rank] = error is not None
    pieces = [mx.array(head)] + [v.astype(mx.float32).reshape(-1) for _, v in flat]
    total = ranks.all_sum(mx.concatenate(pieces))
    mx.eval(total)
    head = np.array(total[: len(head)])
    failed = head[3 * slots + 1 :]
    if failed.any():
        ranks._raise(int(np.flatnonzero(failed)[0]), error)
    weights = head[slots : 2 * slots]
    losses = np.divide(head[:slots], weights, out=np.zeros(slots, np.float32), where=weights > 0)
    finite = head[3 * slots] == 0 and bool(np.isfinite(head[:slots]).all())
    whole, grads, at = float(weights.sum()), [], len(head)
    for name, v in flat:
        grads.append((name, (total[at : at + v.size].reshape(v.shape) / whole).astype(v.dtype)))
        at += v.size
    return Step(tree_unflatten(grads), losses, weights, head[2 * slots : 3 * slots], finite)


__all__ = ["RankFailed", "Ranks", "Step", "StepSum", "reduce_step", "weighs"]
