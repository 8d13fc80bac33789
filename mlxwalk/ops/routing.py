"""Where the custom kernels (metal_kernels/) run and where the ops twins do.

MLXWALK_KERNELS=auto (default) routes to a kernel where one applies and passed its self-check;
off keeps every op on its pure-MLX twin; check runs both on every call, returns the twin's
result and reports a disagreement; on runs every kernel that applies and passes its self-check,
whatever the measurements say (the CUDA tables and the Metal race below). The self-check runs
once per case (AttentionCase: backend, dtype, head dim, grouped-query ratio; ScanCase: key dim
and chunk; MlxDeltaCase: a layer's heads and dims): a small case through the kernel and the
twin; a compile error or a mismatch prints one line naming the kernel and the case, and that
case stays on the ops path. A kernel that passed and then fails at a size it had not run at (a
launch past a device limit, memory) falls back the same way for that call and the case from then
on (`guard`); under `on` each of these failures is an error naming the kernel.

On CUDA, where the kernels are measured (docs/BENCHMARKS.md), `auto` follows that table. On
Metal, where nothing could be measured while the kernels were written, the first use also races
kernel and twin on a mid-sized case on the user's GPU and keeps the faster, saying so when it
is the twin.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar, TypeVar

import mlx.core as mx

from metal_kernels import build

from ..errors import ConfigError

MODES = ("auto", "off", "check", "on")
# The relative L2 error a kernel may show against the twin: float32 leaves room for TF32
# matmuls in the twin on CUDA, half precision for its rounded inputs and outputs. A wrong
# kernel is off by order one.
TOLERANCE = {mx.float32: 1e-3, mx.float16: 2e-2, mx.bfloat16: 4e-2}


def _name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


@dataclass(frozen=True)
class AttentionCase:
    """What an attention kernel's self-check covers."""

    backend: str
    dtype: mx.Dtype
    head_dim: int
    gqa: int  # query heads per key/value head
    store: mx.Dtype | None = None  # the K/V store's dtype (None: the inputs')
    op: ClassVar[str] = "attention"

    def __str__(self) -> str:
        store = ""
        if self.store is not None:  # mx.uint32: an 8-bit store's packed words (Q8.dtype)
            store = f" ({'q8' if self.store == mx.uint32 else _name(self.store)} store)"
        return f"{self.backend} {_name(self.dtype)} head dim {self.head_dim} GQA {self.gqa}{store}"


@dataclass(frozen=True)
class ScanCase:
    """What the delta rule's scan kernels' self-check covers (float32 throughout)."""

    backend: str
    key_dim: int
    chunk: int
    dtype: ClassVar[mx.Dtype] = mx.float32
    op: ClassVar[str] = "delta"

    def __str__(self) -> str:
        return f"{self.backend} delta rule key dim {self.key_dim} chunk {self.chunk}"


@dataclass(frozen=True)
class MlxDeltaCase:
    """What MLX's own gated_delta_update is checked and raced on: one layer's shape."""

    backend: str
    dtype: mx.Dtype
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    op: ClassVar[str] = "mlx-delta"

    def __str__(self) -> str:
        return (
            f"{self.backend} {_name(self.dtype)} gated_delta_update {self.key_heads}/"
            f"{self.value_heads} heads, dims {self.key_dim}/{self.value_dim}"
        )


@dataclass(frozen=True)
class ChunkedDeltaCase:
    """What the chunked gated delta rule's kernels (metal_kernels/delta/chunked.py) are checked
    and raced on: one layer's dtype, heads and dim."""

    backend: str
    dtype: mx.Dtype
    key_heads: int
    value_heads: int
    dim: int  # the key and value dim (the kernels take them equal)
    op: ClassVar[str] = "delta-chunked"

    def __str__(self) -> str:
        return (
            f"{self.backend} {_name(self.dtype)} chunked delta rule {self.key_heads}/"
            f"{self.value_heads} heads, dim {self.dim}"
        )


Case = AttentionCase | ScanCase | MlxDeltaCase | ChunkedDeltaCase


def relative_error(a: mx.array, b: mx.array) -> float:
    """|a - b| / |b| in float32 (L2 over every element)."""
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.linalg.norm((a - b).reshape(-1)) / (mx.linalg.norm(b.reshape(-1)) + 1e-30)).item()


Checker = Callable[[Case], dict[str, float]]  # relative errors by kernel, kernel vs twin
Racer = Callable[[Case, tuple[int, int]], tuple[float, float]]  # seconds: kernel, twin
# The first-use races on Metal, per op: attention (queries, prefix), the delta rule (chunks of
# the case's size, value heads of dim 128); None: no race.
RACE: dict[str, tuple[int, int]] | None = {
    "attention": (1024, 4096),
    "delta": (32, 8),
    "mlx-delta": (2048, 1),  # MLX's gated_delta_update against the ops, one layer
    "delta-chunked": (2048, 1),  # the chunked kernels against the ops, one layer
}
_RACE_SIZE = {
    "attention": "{} queries over {} keys",
    "delta": "{} chunks, {} value heads",
    "mlx-delta": "{} positions, batch {}",
    "delta-chunked": "{} positions, batch {}",
}
# Injected so the CPU tests can run the Metal kernels through the harness.
launch = build.launch
backend = build.current_backend
_verdicts: dict[Case, bool] = {}
_ran: dict[Case, set[tuple[str, str]]] = {}  # the (kernel, size) pairs each case evaluated
T = TypeVar("T")


def mode() -> str:
    value = os.environ.get("MLXWALK_KERNELS", "auto")
    if value not in MODES:
        raise ConfigError(f"MLXWALK_KERNELS={value!r} is unknown; choose one of {', '.join(MODES)}")
    return value


def attention_case(q: mx.array, k: mx.array, store: mx.Dtype | None = None) -> Case | None:
    """The case of an attention call (None on the CPU)."""
    b = backend()
    if b is None:
        return None
    return AttentionCase(b, q.dtype, q.shape[-1], q.shape[1] // k.shape[1], store)


def forced() -> bool:
    """MLXWALK_KERNELS=on or check: every kernel that passes its self-check runs, whatever the
    measured tables and the Metal race say (check then compares it with its twin on each call)."""
    return mode() in ("on", "check")


def decide(case: Case, check: Checker, race: Racer | None = None) -> bool:
    """A case's verdict, found once: the self-check, then on Metal the race (when given)."""
    if case not in _verdicts:
        ok = self_check(case, check)
        kind = case.op
        raced = RACE and kind in RACE and race is not None and not forced()
        if not ok and mode() == "on":  # asked for the kernels: no quiet fall back
            raise RuntimeError(
                f"MLXWALK_KERNELS=on, and kernel {case.op} failed its self-check on {case} "
                "(said above); unset MLXWALK_KERNELS to fall back to the ops path"
            )
        if ok and case.backend == "metal" and raced:
            ok = won_race(case, race)
        _verdicts[case] = ok
    return _verdicts[case]


@dataclass(frozen=True)
class Timing:
    """One side of a race: the median seconds and the peak memory MLX reported over its runs."""

    seconds: float
    peak_bytes: int


_timings: list[Timing] | None = None  # set by `timed`: every `seconds` call's Timing, in order


@contextmanager
def timed() -> Iterator[list[Timing]]:
    """Within the block each race's sides are recorded (kernel first, then twin, as the racers
    return them), with their peak memory: what `mlxwalk kernels` prints."""
    global _timings
    saved, _timings = _timings, []
    try:
        yield _timings
    finally:
        _timings = saved


def seconds(step: Callable[[], object]) -> float:
    """A race's timing: the median of three runs of `step` after one to warm up (compiles,
    allocations)."""
    if _timings is not None:  # (a walk's own peak is left alone)
        mx.reset_peak_memory()
    step()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    median = sorted(times)[1]
    if _timings is not None:
        _timings.append(Timing(median, mx.get_peak_memory()))
    return median


def won_race(case: Case, race: Racer) -> bool:
    """The kernel against its twin at the race's size; a kernel that fails there (a launch
    that only breaks at that size, memory) loses, with one line, and the ops path runs."""
    kind = case.op
    size = RACE[kind]
    try:
        kernel_s, twin_s = race(case, size)
    except Exception as e:  # whatever a real device throws: the ops path still works
        report(case.op, case, f"failed in its race ({str(e).splitlines()[0][:200]})")
        return False
    if kernel_s <= twin_s:
        return True
    print(
        f"mlxwalk: kernel {case.op} took {kernel_s * 1e3:.0f} ms against the ops twin's "
        f"{twin_s * 1e3:.0f} ms on {case} ({_RACE_SIZE[kind].format(*size)}, forward and "
        "backward); using the ops path",
        file=sys.stderr,
    )
    return False


def verdicts() -> dict[Case, bool]:
    """The self-check's verdict per case met so far."""
    return dict(_verdicts)


def why_none() -> str:
    if mode() == "off":
        return "MLXWALK_KERNELS=off"
    b = backend()
    return "no GPU backend: the ops twin runs" if b is None else f"none routed on {b}"


def report(kernel: str, case: Case, what: str) -> None:
    print(f"mlxwalk: kernel {kernel} {what} on {case}; using the ops path", file=sys.stderr)


def disable(case: Case) -> None:
    _verdicts[case] = False


def self_check(case: Case, check: Checker) -> bool:
    try:
        errors = check(case)
    except Exception as e:  # a compile error, a launch failure: the ops path still works
        report(case.op, case, f"failed to run ({str(e).splitlines()[0][:200]})")
        return False
    worst = max(errors, key=errors.get)
    if errors[worst] > TOLERANCE[case.dtype]:
        report(worst, case, f"disagrees with the ops twin (relative error {errors[worst]:.1e})")
        return False
    return True


def compare(got: list, want: list, case: Case, name: str) -> None:
    """MLXWALK_KERNELS=check: a disagreement is named and turns that path off."""
    error = max(relative_error(a, b) for a, b in zip(got, want))
    if error > TOLERANCE[case.dtype]:
        report(name, case, f"disagrees with the ops twin (relative error {error:.1e})")
        disable(case)


def settle(result: object) -> None:
    """Evaluate a kernel's result where it is made. MLX runs lazily: without this a launch that
    fails only at a new size would fail in the training step's own eval, past any fall back.
    (Injected by the tests as a device failure would raise.)"""
    mx.eval(result)


# Raised by an eval under mx.compile or vmap: nothing can be settled there (the kernel's
# failure, if any, then shows at the caller's eval).
_TRACING = "[eval] Attempting to eval an array during function transformations"


def guard(case: Case, kernel: str, size: str, run: Callable[[], T], twin: Callable[[], T]) -> T:
    """`run()`, a routed kernel's result; evaluated at once the first time `kernel` meets `size`
    in this case (later calls at that size stay lazy). Where it raises, `twin()`: one line names
    the kernel, the size and the failure, and the case stays on the ops path from then on; under
    MLXWALK_KERNELS=on a RuntimeError naming the kernel instead.

    Args:
        case: the routed case (its verdict was True when the caller chose the kernel).
        kernel: the kernel's name as the notice says it, e.g. "attention/forward".
        size: the call's size in words; a size not met before is evaluated here.
        run: builds the kernel's result (arrays, or tuples and lists of them).
        twin: builds the ops path's result for the same inputs, same structure.

    Returns:
        `run()`'s result, or `twin()`'s where the kernel failed or its case is already off.
    """
    if _verdicts.get(case) is False:  # turned off by an earlier failure in this graph
        return twin()
    seen = _ran.setdefault(case, set())
    try:
        result = run()
        if (kernel, size) not in seen:
            try:
                settle(result)
            except Exception as e:
                if not str(e).startswith(_TRACING):
                    raise
            seen.add((kernel, size))
        return result
    except Exception as e:  # whatever a real device throws: the ops path still works
        first = (str(e).splitlines() or [type(e).__name__])[0][:200]
        if mode() == "on":
            raise RuntimeError(
                f"MLXWALK_KERNELS=on, and kernel {kernel} failed at {size} on {case} ({first}); "
                "unset MLXWALK_KERNELS to fall back to the ops path"
            ) from e
        report(kernel, case, f"failed at {size} ({first})")
        disable(case)
        return twin()
