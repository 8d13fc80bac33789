"""Several processes training one adapter (under `mlx.launch`): MLX's distributed group, the
windows each rank walks, its failures said by every rank, and the sum that carries a step.
What a step reduces, and how, is step.py's, for both frameworks; `Ranks.reduce` is MLX's way of
summing it (torch_backend/ranks.py has torch's).
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

    def reduce(self, head: np.ndarray, grads: dict) -> tuple[np.ndarray, dict]:
        """A step's head (step.Layout) and gradient summed over the ranks in one all_sum of one
        float32 vector; the gradient comes back in float32."""
        flat = tree_flatten(grads)
        pieces = [mx.array(head)] + [v.astype(mx.float32).reshape(-1) for _, v in flat]
        total = self.all_sum(mx.concatenate(pieces))  # (len(head) + parameters,)
        mx.eval(total)
        summed, at = [], len(head)
        for name, v in flat:
            summed.append((name, total[at : at + v.size].reshape(v.shape)))
            at += v.size
        return np.array(total[: len(head)]), tree_unflatten(summed)

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


__all__ = ["RankFailed", "Ranks"]
