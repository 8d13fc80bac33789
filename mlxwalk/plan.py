"""The walk's plan: plain data about one window, computed before any array exists.

A window's weights (1 = labelled, 0 = context) split into maximal runs of equal weight; each run is
cut into chunks of at most ``chunk`` positions; with ``follow_runs`` no chunk crosses a run (off in
training, where a chat's short turns would make many small chunks). Nothing after the last
labelled position is computed. The exact walk marks each chunk (needed, grad_from), and the
plan sizes the host memory the walk will hold (K/V gradient accumulators and
recurrent checkpoints), choosing the checkpoint stride a host budget allows, or refusing the window.

This module imports no array library, so it can be tested without a model and shared by backends.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

from . import checkpoints
from .errors import ConfigError, DataError, OutOfMemory, PlanError  # noqa: F401  (re-exported)

MIB = 1 << 20


@dataclass(frozen=True)
class Footprint:
    """What the plan needs to know of a model, as plain numbers.

    kv_width: elements per position of every attention layer's K and V together.
    state_bytes: bytes of the recurrent states held at one chunk boundary (every recurrent
        layer's, or those the reverse pass reads: walk/exact.py `to_hold`).
    tapped_width: kv_width of the attention layers whose K/V carry a gradient (None: all).
    """

    kv_width: int
    state_bytes: int = 0
    tapped_width: int | None = None

    @property
    def recurrent(self) -> bool:
        return self.state_bytes > 0


@dataclass(frozen=True)
class Chunk:
    index: int
    start: int
    end: int
    weight: float  # sum of the weights in [start, end)
    needed: bool = True  # the reverse pass trains it
    grad_from: int = 0  # first prefix position whose K/V is tapped

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def labelled(self) -> bool:
        return self.weight > 0


@dataclass(frozen=True)
class Plan:
    window: int  # positions in the window, as given
    chunk: int
    horizon: int  # 0 = the whole window
    chunks: tuple[Chunk, ...]  # up to the last labelled position
    accumulator_bytes: int = 0
    stride: int = 1  # recurrent checkpoints: one per `stride` chunks (their memory)
    checkpoint_bytes: int = 0

    @property
    def computed(self) -> int:
        """Positions the walk computes: up to and including the last label."""
        return self.chunks[-1].end

    @property
    def host_bytes(self) -> int:
        return self.accumulator_bytes + self.checkpoint_bytes

    def reverse(self) -> list[Chunk]:
        """The chunks the reverse pass trains, last to first."""
        return [c for c in reversed(self.chunks) if c.needed]

    @property
    def slots(self) -> int:
        """Recurrent states the walk holds besides the zero state entering chunk 0 (and the one
        a chunk is trained from): one per `stride` chunks but the first."""
        return math.ceil(len(self.chunks) / self.stride) - 1

    @cached_property
    def schedule(self) -> checkpoints.Schedule:
        """Where the states are kept, forward and in reverse (checkpoints.py): the binomial
        schedule for `slots`."""
        return checkpoints.schedule(len(self.chunks), self.slots)

    def checkpointed(self, index: int) -> bool:
        """Whether the forward decode keeps the recurrent state entering chunk `index`."""
        return index in self.schedule.forward

    def decoded_again(self) -> int:
        """Chunks a recurrent model decodes again in reverse to rebuild entry states."""
        return self.schedule.again([c.index for c in self.reverse()])


Run = tuple[int, int, float]  # (start, end, weight): positions [start, end) share one weight


def runs(weights: Sequence[float]) -> list[Run]:
    """Maximal runs of equal weight, as (start, end, weight)."""
    out: list[Run] = []
    start = 0
    for i in range(1, len(weights) + 1):
        if i == len(weights) or weights[i] != weights[start]:
            out.append((start, i, float(weights[start])))
            start = i
    return out


@dataclass(frozen=True)
class Labels:
    """A window's weights as their maximal runs: the plan costs what the window's chunks and
    changes of weight cost, never a value per position (a plan of a billion positions is a
    handful of numbers)."""

    length: int
    runs: tuple[Run, ...]

    @classmethod
    def of(cls, weights: Sequence[float]) -> Labels:
        return cls(len(weights), tuple(runs(weights)))

    @classmethod
    def labelled(cls, length: int) -> Labels:
        """Every position labelled: the most positions a window of `length` computes."""
        return cls(length, ((0, length, 1.0),) if length else ())

    @property
    def end(self) -> int:
        """One past the last labelled position (0 when nothing is labelled)."""
        return max((e for _, e, w in self.runs if w > 0), default=0)


def _weights(labels: Labels, spans: list[tuple[int, int]]) -> list[float]:
    """Each span's summed weight, the spans in order: one pass over the runs."""
    out, r, runs_ = [], 0, labels.runs
    for s, e in spans:
        while runs_[r][1] <= s:
            r += 1
        total, i = 0.0, r
        while i < len(runs_) and runs_[i][0] < e:
            a, b, w = runs_[i]
            total += w * (min(b, e) - max(a, s))
            i += 1
        out.append(total)
    return out


def cut(weights: Sequence[float] | Labels, chunk: int, follow_runs: bool = True) -> list[Chunk]:
    """Chunks of at most `chunk` positions, stopping at the last label. They follow the runs
    (no chunk crosses a change of weight) unless `follow_runs` is off, when they are simply
    consecutive: a chat's many short turns would otherwise make many small chunks.

    Args:
        weights: the window's loss weight per position (length L; 0 unlabelled), or its Labels.
        chunk: the most positions a chunk holds (>= 1).
        follow_runs: cut at every change of weight as well.

    Returns:
        The chunks in order, covering [0, last labelled position + 1); each with its weight.

    Raises:
        ConfigError for chunk < 1; DataError when no position is labelled.
    """
    if chunk < 1:
        raise ConfigError(f"chunk must be at least 1, got {chunk}")
    labels = weights if isinstance(weights, Labels) else Labels.of(weights)
    last = labels.end
    if last == 0:
        raise DataError("the window has no labelled position (every weight is 0)")
    if follow_runs:
        edges = [(s, min(e, last)) for s, e, _ in labels.runs if s < last]
    else:
        edges = [(0, last)]
    spans = [(s, min(s + chunk, e)) for a, e in edges for s in range(a, e, chunk)]
    return [Chunk(i, s, e, w) for i, ((s, e), w) in enumerate(zip(spans, _weights(labels, spans)))]


def grad_from(start: int, horizon: int) -> int:
    """First prefix position whose K/V gradient a chunk starting at `start` keeps."""
    return 0 if horizon <= 0 else max(0, start - horizon)


def mark(chunks: Sequence[Chunk], horizon: int, recurrent: bool) -> list[Chunk]:
    """The exact walk's marks, from the last chunk to the first.

    A chunk is needed when it is labelled, or a later needed chunk reads its K/V inside the horizon,
    or (recurrent models) a later needed chunk starts from its state.

    Args:
        chunks: `cut`'s chunks, in order.
        horizon: how many positions back a chunk's gradient reaches (0: the whole window).
        recurrent: the model carries a recurrent state between chunks (a hybrid).

    Returns:
        The same chunks with `needed` and `grad_from` set.
    """
    marked: list[Chunk] = []
    reach = math.inf  # smallest grad_from among the needed chunks after this one
    later_needed = False
    for c in reversed(chunks):
        needed = c.labelled or c.end > reach or (recurrent and later_needed)
        gf = grad_from(c.start, horizon)
        if needed:
            reach = min(reach, gf)
            later_needed = True
        marked.append(replace(c, needed=needed, grad_from=gf))
    marked.reverse()
    return marked


def accumulator_bytes(positions: int, footprint: Footprint, element_bytes: int = 4) -> int:
    """The K/V gradient accumulators: every computed position of every tapped attention layer."""
    width = footprint.kv_width if footprint.tapped_width is None else footprint.tapped_width
    return positions * width * element_bytes


def checkpoint_bytes(n_chunks: int, stride: int, footprint: Footprint) -> int:
    """Recurrent states the walk holds: one per stride of chunks but the first (the state
    entering chunk 0 is zero), placed by the binomial schedule (checkpoints.py), and beside them,
    while the last chunk trains, the state entering it (handed over by the decode)."""
    if not footprint.recurrent:
        return 0
    if n_chunks < 2:
        return 0
    slots = math.ceil(n_chunks / stride) - 1
    # the last chunk's state is a slot of the forward only where every chunk's is (stride 1)
    return (min(slots, n_chunks - 2) + 1) * footprint.state_bytes


def stride_for(
    n_chunks: int, fixed_bytes: int, footprint: Footprint, budget: int | None
) -> int | None:
    """Smallest checkpoint stride that fits `budget` beside `fixed_bytes`; None if none does."""
    if budget is None:
        return 1
    for stride in range(1, max(n_chunks, 1) + 1):
        if fixed_bytes + checkpoint_bytes(n_chunks, stride, footprint) <= budget:
            return stride
        if not footprint.recurrent:
            break
    return None


def mib(n: float) -> str:
    return f"{n / MIB:.1f} MiB"


def memory_lines(rows: Sequence[tuple[str, int, str]], width: int) -> list[str]:
    """An estimate's parts, one line each: (what, bytes, a note or ""), `what` padded to `width`
    and the MiB aligned beneath one another."""
    return [
        f"  {what:<{width}}{mib(size):>12}" + (f"   ({note})" if note else "")
        for what, size, note in rows
    ]


def model_rows(est, other: str) -> list[tuple[str, int, str]]:
    """The rows every estimate opens with: the weights, the adapter with its optimizer state, and
    whatever else was alive when the walk started (`other`, if any)."""
    rows = [("weights", est.weights, ""), ("adapter + state", est.adapter, "")]
    return rows + ([(other, est.resident, "")] if est.resident else [])


def plan_window(
    weights: Sequence[float] | Labels,
    chunk: int,
    footprint: Footprint,
    *,
    horizon: int = 0,
    host_budget: int | None = None,
    accumulator_element_bytes: int = 4,
    follow_runs: bool = True,
) -> Plan:
    """The exact walk's plan for one window: plain data, no model or array needed.

    Args:
        weights: the window's loss weight per position (length L; 0 unlabelled), or its Labels.
        chunk: the most positions a chunk holds.
        footprint: the model's per-position K/V width and recurrent state size (`Footprint`).
        horizon: how many positions back a chunk's gradient reaches (0: the whole window, exact).
        host_budget: bytes the K/V gradient accumulators and state checkpoints may take (None:
            unbounded); the checkpoint stride grows until they fit.
        accumulator_element_bytes: 4 for float32 accumulators, 2 for bfloat16.
        follow_runs: chunks end at every change of weight as well (`cut`).

    Returns:
        The Plan: its chunks marked (`mark`), accumulator bytes, checkpoint stride and bytes.

    Raises:
        ConfigError for a negative horizon; OutOfMemory when no stride fits the host budget.
    """
    if horizon < 0:
        raise ConfigError(f"horizon must be 0 (the whole window) or positive, got {horizon}")
    chunks = mark(cut(weights, chunk, follow_runs), horizon, footprint.recurrent)
    positions = chunks[-1].end
    acc = accumulator_bytes(positions, footprint, accumulator_element_bytes)
    stride = stride_for(len(chunks), acc, footprint, host_budget)
    if stride is None:
        least = acc + checkpoint_bytes(len(chunks), len(chunks), footprint)
        raise OutOfMemory(
            f"host memory: the walk needs {mib(least)} at least "
            f"(K/V gradient accumulators {mib(acc)} for {positions} positions) "
            f"but the host budget is {mib(host_budget or 0)}; "
            "a shorter window or a larger host budget would fit"
        )
    return Plan(
        window=weights.length if isinstance(weights, Labels) else len(weights),
        chunk=chunk,
        horizon=horizon,
        chunks=tuple(chunks),
        accumulator_bytes=acc,
        stride=stride,
        checkpoint_bytes=checkpoint_bytes(len(chunks), stride, footprint),
    )


# The K/V store's element types, checked before any array exists.
CACHE_TYPES = ("float32", "float16", "bfloat16", "q8")
CACHE_CHOICES = ("auto", *CACHE_TYPES)  # auto: lossless, 8-bit only where a memory budget asks
Q_GROUPS = (32, 64, 128)  # the group sizes mx.quantize takes


def check_cache_type(cache_type: str, head_dims: tuple[int, ...] = ()) -> str:
    """The cache type, or a refusal: an unknown name, or q8 for head dimensions MLX can't
    quantize (its groups are 32, 64 or 128 wide).

    Args:
        cache_type: one of CACHE_CHOICES, the K/V store's element type (auto: walk/choices.py).
        head_dims: the model's attention head dimensions (checked for q8 only).

    Returns:
        `cache_type` unchanged.

    Raises:
        ConfigError naming the flag and what it takes.
    """
    if cache_type not in CACHE_CHOICES:
        raise ConfigError(
            f"--cache-type {cache_type!r} is unknown; choose one of {', '.join(CACHE_CHOICES)}"
        )
    if cache_type == "q8" and not q8_fits(head_dims):
        raise ConfigError(
            f"--cache-type q8 needs head dimensions that are multiples of {Q_GROUPS[0]} (MLX "
            f"quantizes in groups of {', '.join(map(str, Q_GROUPS))}); this model's are "
            f"{', '.join(map(str, head_dims))}"
        )
    return cache_type


def q8_fits(head_dims: tuple[int, ...]) -> bool:
    return all(d % Q_GROUPS[0] == 0 for d in head_dims)
