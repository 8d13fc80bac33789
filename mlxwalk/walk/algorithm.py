"""The walks' algorithms, once, for every framework: the order of their steps over a window's
chunks, the horizon narrowed under a memory budget, the refusals. No array library: a framework
subclasses `ExactAlgorithm` and `PlainAlgorithm` with its mechanics (walk/exact.py and
walk/plain.py for MLX, torch_backend/walk.py for torch).

The exact walk:
  1. decode_forward: every chunk but the last (whose K/V and exit state no chunk reads), first
     to last, with no gradient: its K/V into the store; the states entering the chunks the
     plan's checkpoint schedule names kept (recurrent layers), and the one entering the last.
  2. reverse: every needed chunk, last to first, as a graph of its own: its share of the loss
     plus the surrogates <own K/V, adjoint> + <exit state, adjoint>, the adjoints being what later
     chunks sent back; its entry state is held, or re-decoded from the nearest held one before
     it, keeping on the way the states the schedule names (checkpoints.py: binomial, so a few
     slots cost a few passes, not the gap's square).
  3. the caller steps once on the summed gradient.

The adapter must not change between the start of decode_forward and the end of reverse: the
reverse pass recomputes each chunk's K/V and exit state and pairs them with adjoints taken
against the stored ones.

The plain walk: chunk by chunk, first to last, the prefix a constant; each labelled chunk's loss
differentiated alone (with a step, one per labelled chunk), then the chunk decoded into the store
under the adapter as it now is, so later chunks read what it now produces.

What a framework supplies (the mechanics): `new_store`, `zero_state`, `decode` (write or not),
`walking` (the model as the walk runs it); for the exact walk `decode_chunk`, `start_reverse`,
`train_chunk`, `finish_reverse` and under a memory budget `fits(chunk, taps)`; for the plain
walk `train_plain` and `finish_plain`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

from ..errors import OutOfMemory
from ..plan import Chunk, Plan, cut

log = logging.getLogger("mlxwalk")


def narrowed(taps: int, size: int, fits: Callable[[int], bool]) -> int:
    """The tapped positions a chunk's graph fits with (`fits(taps)`): all of them, else half and
    again, a multiple of the chunk `size`, never below one chunk."""
    while taps > size and not fits(taps):
        taps = max(size, taps // 2 // size * size)
    return taps


LOSS_BLOCK = 1024  # positions whose logits are alive at once in a chunk's graph


def loss_blocks(n: int) -> list[slice]:
    """A chunk's `n` positions in blocks of LOSS_BLOCK, each block's logits alive alone (its
    loss checkpointed): the chunk's logits, positions x vocabulary, the largest tensor of its
    graph for a large vocabulary, are never all alive, for the price of one more output
    projection. One block (no checkpoint) when the chunk is no longer than one."""
    return [slice(a, min(a + LOSS_BLOCK, n)) for a in range(0, n, LOSS_BLOCK)]


class WalkAlgorithm:
    """What both walks' algorithms run on: the framework's store, states and decode."""

    on_chunk: Callable[[str, int, int], None] | None = None  # (phase, done, of)

    def tick(self, phase: str, done: int, of: int) -> None:
        if self.on_chunk is not None:
            self.on_chunk(phase, done, of)

    # --- the framework's mechanics -------------------------------------------------------------

    def walking(self) -> AbstractContextManager:
        """The model as the walk runs it, for the walk's duration."""
        return nullcontext()

    def new_store(self, positions: int) -> None:
        raise NotImplementedError

    def zero_state(self):
        raise NotImplementedError

    def decode(self, chunk: Chunk, state, write: bool = True):
        """One chunk with no gradient: its K/V into the store (if `write`); its exit state."""
        raise NotImplementedError


class ExactAlgorithm(WalkAlgorithm):
    """One window's exact walk over `self.plan`, the framework's mechanics in the hooks below.
    A subclass sets `plan`, `horizon_used` (its configured horizon), `recurrent`, `budget_mib`
    (None without a memory budget) and `remedies` (what a --strict-exact refusal suggests)."""

    plan: Plan
    horizon_used: int = 0  # narrowed per chunk if the memory budget asks (0: the whole window)
    recurrent: bool = False
    budget_mib: float | None = None
    remedies: str = "raise --memory-budget-mib, or give a smaller --chunk"
    checkpoints: dict  # chunk index -> the recurrent state entering it, while held
    # The memory probe's walk: the decode only allocates the store it would fill, each entry
    # state is zero. A chunk's graph depends on its prefix's length, not its values, and a whole
    # window's decode per probe walk cost minutes on CUDA, where the probe reads the run's whole
    # prefix (walk/probe.py).
    filled: bool = False

    # --- the phases ------------------------------------------------------------------------

    def walk(self, chunks: int | None = None):
        """The window's loss and gradient (as `finish_reverse` gives them). `chunks`: the reverse
        pass stops after that many (the memory probe: the first, reading the longest prefix,
        holds the walk's largest graph)."""
        with self.walking():
            self.decode_forward()
            return self.reverse(chunks)

    def decode_forward(self) -> None:
        self.new_store(self.plan.computed)
        self.checkpoints = {}
        if self.filled:
            return
        state = self.zero_state()
        chunks = self.plan.chunks
        last = chunks[-1]  # no later chunk reads its K/V or state: decoded only for its inputs
        whole = self.skips_stem()
        for run in self.decode_runs(chunks if whole else chunks[:-1]):
            if self.recurrent and (self.plan.checkpointed(run[0].index) or run[0] is last):
                self.checkpoints[run[0].index] = self.to_hold(state)
            state = self.decode_run(run, state)
            for chunk in run:
                self.tick("decode", chunk.index + 1, len(chunks))
        if whole:
            self.drop_stem_store()
        elif self.recurrent and last.index > 0:  # the reverse pass trains it first, from this
            self.checkpoints[last.index] = state
        self.tick("decode", last.index + 1, len(chunks))

    def skips_stem(self) -> bool:
        """Whether no stem layer runs in the reverse pass (a framework that keeps the stem's
        output): then the decode takes the last chunk too, for its stem output, and the stem's
        part of the store goes once the decode is done (`drop_stem_store`)."""
        return False

    def drop_stem_store(self) -> None:
        """The stem's K/V, read by no one once the decode is done."""

    def decode_runs(self, chunks, most: int | None = None) -> list[list[Chunk]]:
        """The decode's runs: consecutive chunks decoded at once, up to `most` (default
        `run_chunks()`) of them, a run starting wherever a recurrent state checkpoint is kept
        (only a run's entry state exists), the last chunk's among them."""
        runs: list[list[Chunk]] = []
        most = max(1, self.run_chunks() if most is None else most)
        last = self.plan.chunks[-1]
        for chunk in chunks:
            kept = self.recurrent and (self.plan.checkpointed(chunk.index) or chunk is last)
            if not runs or len(runs[-1]) == most or kept:
                runs.append([])
            runs[-1].append(chunk)
        return runs

    def run_chunks(self) -> int:
        """How many chunks the decode may run at once (1: chunk by chunk)."""
        return 1

    def decode_run(self, run: list[Chunk], state):
        """A run of chunks with no gradient, their K/V into the store; the exit state. By
        default chunk by chunk (a framework may run them at once)."""
        for chunk in run:
            state = self.decode_chunk(chunk, state)
        return state

    def entry_state(self, chunk: Chunk):
        """The state entering `chunk`: held, or decoded forward (without writing the store)
        from the nearest held one before it, keeping on the way what the schedule says."""
        if not self.recurrent or self.filled:
            return self.zero_state()
        source = max((i for i in self.checkpoints if i <= chunk.index), default=0)
        state = self.checkpoints[source] if source in self.checkpoints else self.zero_state()
        keeps = self.plan.schedule.keeps.get(chunk.index, ())
        for c in self.plan.chunks[source : chunk.index]:
            state = self.redecode(c, state)
            if c.index + 1 in keeps:
                self.checkpoints[c.index + 1] = state
        return state

    def to_hold(self, state):
        """What of a recurrent state the reverse pass needs (a framework may hold less)."""
        return state

    def redecode(self, chunk: Chunk, state):
        """A chunk decoded again in the reverse pass, for the state leaving it."""
        return self.decode(chunk, state, write=False)

    def let_go(self, chunk: Chunk) -> None:
        """Trained: the states entering it and later chunks are needed no more (their slots
        take the states the schedule keeps on the way to earlier chunks)."""
        for i in [i for i in self.checkpoints if i >= chunk.index]:
            del self.checkpoints[i]

    def reverse(self, chunks: int | None = None):
        self.start_reverse()
        loss = None
        order = self.plan.reverse()[:chunks]
        for done, chunk in enumerate(order, 1):
            share = self.train_chunk(chunk, self.entry_state(chunk), self.grad_from(chunk))
            self.let_go(chunk)
            loss = share if loss is None else loss + share
            self.tick("train", done, len(order))
        return self.finish_reverse(loss)

    # --- the horizon under a memory budget ---------------------------------------------------

    def grad_from(self, chunk: Chunk) -> int:
        """The chunk's first tapped position: the plan's, or, when the walk would exceed the
        memory budget with this chunk's graph, `narrowed_taps` before it. Only this chunk is
        narrowed; the next window starts from the requested horizon."""
        taps = chunk.start - chunk.grad_from
        fewer = self.narrowed_taps(chunk)
        if fewer < taps:
            log.info(
                "chunk %d: its graph with %d tapped positions exceeds the memory budget of "
                "%.1f MiB; horizon narrowed to %d for this chunk",
                chunk.index,
                taps,
                self.budget_mib,
                fewer,
            )
            self.horizon_used = fewer if self.horizon_used == 0 else min(self.horizon_used, fewer)
        return chunk.start - fewer

    def narrowed_taps(self, chunk: Chunk) -> int:
        """The tapped positions the chunk's graph fits the memory budget with: the plan's, else
        half of them and again (a multiple of the chunk, never below one chunk)."""
        taps = chunk.start - chunk.grad_from
        if self.budget_mib is None or chunk.start == 0:
            return taps
        return narrowed(taps, self.plan.chunk, lambda t: self.fits(chunk, t))

    def refuse_narrowing(self) -> None:
        """--strict-exact: a window whose gradient the budget would cut is refused up front
        (which chunks would narrow is known from the estimate before the walk starts)."""
        for chunk in self.plan.chunks:
            taps = chunk.start - chunk.grad_from
            if (fewer := self.narrowed_taps(chunk)) < taps:
                raise OutOfMemory(
                    f"the memory budget of {self.budget_mib:,.0f} MiB fits chunk {chunk.index} "
                    f"only with its horizon narrowed from {taps} to {fewer} positions, and "
                    f"--strict-exact refuses a gradient that is not exact: {self.remedies}"
                )

    # --- the framework's mechanics -------------------------------------------------------------

    def decode_chunk(self, chunk: Chunk, state):
        """The decode pass's step (a framework may keep more of it than `decode` does)."""
        return self.decode(chunk, state)

    def start_reverse(self) -> None:
        raise NotImplementedError

    def train_chunk(self, chunk: Chunk, entry, grad_from: int):
        """The chunk's graph differentiated; its gradients to the adapter's sum, the K/V
        accumulators and the state adjoint. Returns its share of the loss."""
        raise NotImplementedError

    def finish_reverse(self, loss):
        raise NotImplementedError

    def fits(self, chunk: Chunk, taps: int) -> bool:
        """Whether the walk fits its memory budget with this chunk's graph tapping `taps`."""
        raise NotImplementedError


class PlainAlgorithm(WalkAlgorithm):
    """One window's plain walk over `self.window`, cut as `self.config` says (its `chunk` and
    `follow_runs`), the framework's mechanics in the hooks below."""

    def walk(self, step: Callable | None = None):
        """The window's loss and gradient (as `finish_plain` gives them). With `step`, one
        optimizer step per labelled chunk (`train_plain` takes it): the gradient is then the sum
        of the chunks' gradients, each taken at the adapter that chunk saw."""
        chunks = cut(self.window.labels, self.config.chunk, self.config.follow_runs)
        loss = None
        with self.walking():
            self.new_store(chunks[-1].end)
            state = self.zero_state()
            for chunk in chunks:
                if chunk.labelled:
                    share = self.train_plain(chunk, state, step)
                    loss = share if loss is None else loss + share
                if chunk is not chunks[-1]:  # no later chunk reads the last one's K/V
                    state = self.decode(chunk, state)
                self.tick("train", chunk.index + 1, len(chunks))
        return self.finish_plain(loss)

    # --- the framework's mechanics -------------------------------------------------------------

    def train_plain(self, chunk: Chunk, state, step: Callable | None):
        """The chunk's loss differentiated with the prefix constant, its gradient summed (and
        stepped on with `step`). Returns its share of the loss."""
        raise NotImplementedError

    def finish_plain(self, loss):
        raise NotImplementedError
