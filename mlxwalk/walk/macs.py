"""Which Macs train a window exactly: the exact walk's admission (admission.py) under each Mac
memory size's default GPU working set (machine.MACS, machine.working_set), with one chunk's graph
measured once on the model and reused for every size and window (admission.Graphs). A size that
falls short says what it gives up: the longest window it trains exactly, in whole chunks, and
whether the asked one trains there with a narrowed horizon (and how far that horizon reaches)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ..plan import MIB, OutOfMemory, plan_window
from . import arch, choices, machine
from .admission import Graphs
from .config import WalkConfig
from .exact import ExactWalk
from .window import Window

EXACT, NARROWED, NO = "exact", "narrowed", "does not fit"
FARTHEST = 1 << 30  # positions the search stops at where the model states no maximum


@dataclass(frozen=True)
class Verdict:
    """One memory size's answer for one window."""

    gb: float  # the Mac's memory, GB
    budget: int  # its GPU working set, bytes: the walk's memory budget
    fits: str  # EXACT, NARROWED (the late chunks' horizon cut to fit) or NO
    horizon: int | None  # NARROWED: the fewest prefix positions a chunk's gradient still reaches
    largest: int  # the longest window it trains exactly, a multiple of the chunk (0: none)


def sizes(macs: Sequence[int] = machine.MACS) -> list[tuple[float, int]]:
    """(memory in GB, default GPU working set in bytes) for each Mac memory size."""
    return [(gb, machine.working_set(gb)) for gb in macs]


class Admissions:
    """The exact walk's admission of one model at one config under any budget and window up to
    `window`'s reach, one chunk's graph measured once (on the first admission that needs it)."""

    def __init__(self, model, config: WalkConfig, window: int, echo=None):
        self.model = model
        self.layout = arch.inspect(model)
        # what trains exactly at the asked chunk: "auto" as its lossless choice, the chunk held
        kv = choices.dtype_name(self.layout.dtype)
        self.config = replace(choices.lossless(config, kv), min_chunk=config.chunk)
        labels = Window.labelled(window).labels
        reach = plan_window(labels, config.chunk, self.layout.footprint()).chunks[-1].start
        self.graphs = Graphs(reach, echo=echo)

    def walk(self, window: int, budget: int) -> ExactWalk | None:
        """The walk over a fully labelled `window` under `budget` bytes; None where refused."""
        config = replace(self.config, memory_budget_mib=budget / MIB, strict_exact=False)
        try:
            return ExactWalk(self.model, Window.labelled(window), config, self.layout, self.graphs)
        except OutOfMemory:
            return None

    def verdict(self, window: int, budget: int) -> tuple[str, int | None]:
        """(EXACT, NARROWED or NO; under NARROWED the fewest prefix positions a chunk's
        gradient reaches, None if the admission names none)."""
        walk = self.walk(window, budget)
        if walk is None:
            return NO, None
        if walk.estimate.total <= budget:
            return EXACT, None
        cut = [
            fewer
            for c in walk.plan.chunks
            if c.needed and (fewer := walk.narrowed_taps(c)) < c.start - c.grad_from
        ]
        return NARROWED, min(cut, default=None)

    def exact(self, window: int, budget: int) -> bool:
        return self.verdict(window, budget)[0] == EXACT


def largest(ok: Callable[[int], bool], step: int, most: int) -> int:
    """The largest multiple of `step` up to `most` for which `ok` holds (`ok` monotone: where a
    window trains, every shorter one does), 0 when not even `step` does: doubling from `step` until
    a window fails, then bisection between the last that held and the first that failed."""
    most = most // step * step
    if most < step or not ok(step):
        return 0
    good = step
    while good < most:
        far = min(most, 2 * good)
        if not ok(far):
            bad = far
            break
        good = far
    else:
        return good
    while bad - good > step:  # good holds, bad fails, both multiples of step
        mid = (good + bad) // 2 // step * step
        good, bad = (mid, bad) if ok(mid) else (good, mid)
    return good


def survey(
    model,
    window: int,
    config: WalkConfig,
    macs: Sequence[tuple[float, int]] | None = None,
    most: int | None = None,
    echo=None,
) -> list[Verdict]:
    """For each (GB, working set in bytes) of `macs` (default: every size in machine.MACS), how a
    fully labelled `window` trains at `config` with the working set as its memory budget, and
    the longest window that trains exactly there (up to `most` positions, the model's maximum).
    `echo` hears the probe's walks."""
    admissions = Admissions(model, config, window, echo)
    most = most or FARTHEST
    out = []
    for gb, budget in sizes() if macs is None else macs:
        fits, horizon = admissions.verdict(window, budget)
        n = largest(lambda w, b=budget: admissions.exact(w, b), config.chunk, most)
        out.append(Verdict(gb, budget, fits, horizon, n))
    return out
