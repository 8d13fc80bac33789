"""Where the exact walk keeps a hybrid's recurrent state, and how often it decodes a chunk again.

The reverse pass trains the chunks last to first, each from the state entering it. Memory holds
only `slots` such states beside the zero state entering chunk 0 (the plan's checkpoints); any
other entry state is decoded again from a kept one before it. Decoding every chunk of a gap from
its one checkpoint costs the gap's square; a binomial schedule (Griewank's revolve) costs far
less for the same slots: as the reverse pass goes back, the slots the later chunks no longer need
take states on the way to the next chunk. With s = slots + 1 and r passes over each chunk, up to
C(s + r, s) chunks are reversed, so the decodes grow like n·r, r about log n for a fixed s.

The forward decode is the schedule's first way down (it writes the K/V store); its kept states
are the checkpoints. Plain data, no array library: the walk (walk/algorithm.py) follows it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from math import comb


@cache
def decodes(length: int, slots: int) -> int:
    """The fewest chunk decodes that train `length` chunks last to first from the state entering
    the first, with `slots` more states keepable at once (the forward's decodes included).
    Closed form; `decodes_by_recursion` is its reference."""
    if length <= 1:
        return 0
    if slots <= 0:  # every chunk decoded again from the state entering the first
        return length * (length - 1) // 2
    s, r = slots + 1, 1
    while comb(s + r, s) < length:
        r += 1
    return r * length - comb(s + r, s + 1)


def decodes_by_recursion(length: int, slots: int) -> int:
    """`decodes` by its recursion: keep the state entering chunk m, reverse the chunks after it
    with one slot fewer, then those before it with the slot back."""

    @cache
    def cost(n: int, f: int) -> int:
        if n <= 1:
            return 0
        if f <= 0:
            return n * (n - 1) // 2
        return min(m + cost(n - m, f - 1) + cost(m, f) for m in range(1, n))

    return cost(length, slots)


@cache
def split(length: int, slots: int) -> int:
    """Where the first kept state goes (chunks from the first), for the fewest decodes. The cost
    is convex in it (a line plus two costs convex in their length, whose slope is the number of
    passes), so a bisection on its differences finds a least one."""

    def cost(m: int) -> int:
        return m + decodes(length - m, slots - 1) + decodes(m, slots)

    lo, hi = 1, length - 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if cost(mid + 1) < cost(mid) else (lo, mid)
    return lo


@dataclass(frozen=True)
class Schedule:
    """For each chunk, in the order the reverse pass trains them, the states entering later
    chunks that the decode toward it keeps (ascending). The last chunk's are the forward's."""

    chunks: int
    slots: int
    keeps: dict[int, tuple[int, ...]]

    @property
    def forward(self) -> frozenset[int]:
        """The chunks whose entry state the forward decode keeps (the checkpoints)."""
        return frozenset(self.keeps.get(self.chunks - 1, ()))

    def walk(self, trained: list[int] | None = None) -> list[tuple[int, int, int]]:
        """The reverse pass by the walk's rule, training `trained` (default: every chunk) last to
        first: (chunk, chunks decoded again to reach its entry state, states held while it
        trains: the walk's `checkpoints`). The forward hands over the state entering the last chunk;
        any other is decoded from the nearest state held at or before it, keeping on the way what
        the schedule says; a trained chunk lets go of every state from its own on."""
        last = self.chunks - 1
        held = sorted({0, last} | self.forward)  # ascending; only those below c are needed
        out = []
        for c in sorted(self.keeps if trained is None else trained, reverse=True):
            while held[-1] > c:
                held.pop()
            source = held[-1]
            held += [k for k in self.keeps[c] if k > source] if c != last else []
            out.append((c, c - source, len(held) - (held[0] == 0)))
            while held and held[-1] >= c:
                held.pop()
        return out

    def again(self, trained: list[int] | None = None) -> int:
        """Chunk decodes beyond the forward's (`walk`)."""
        return sum(n for _, n, _ in self.walk(trained))


def schedule(chunks: int, slots: int) -> Schedule:
    """The binomial schedule for `chunks` chunks and `slots` kept states (beyond the zero state
    entering chunk 0)."""
    keeps: dict[int, tuple[int, ...]] = {}
    pending: list[int] = []
    todo = [(0, chunks, max(slots, 0))]  # (first chunk, chunks, free slots), last in first out
    while todo:
        a, n, f = todo.pop()
        if f >= n - 1:  # a slot for every state: each kept on the first way down
            pending += range(a + 1, a + n)
            f = 0
        if n == 1 or f == 0:
            for c in reversed(range(a, a + n)):
                keeps[c], pending = tuple(pending), []
            continue
        m = split(n, min(f, n - 1))
        pending.append(a + m)
        todo.append((a, m, f))  # after the chunks past a + m, with the slot back
        todo.append((a + m, n - m, f - 1))
    return Schedule(chunks, slots, keeps)


def by_stride(chunks: int, stride: int) -> Schedule:
    """The even schedule the binomial one replaced, for comparison: the forward keeps the state
    entering every `stride`-th chunk, the reverse pass keeps nothing on the way, so each entry
    state is decoded from the checkpoint before it."""
    forward = tuple(range(stride, chunks, stride))
    return Schedule(
        chunks, len(forward), {c: forward if c == chunks - 1 else () for c in range(chunks)}
    )
