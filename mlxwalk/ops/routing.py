"""Where the custom kernels (metal_kernels/) run and where the ops twins do.

MLXWALK_KERNELS=auto (default) routes to a kernel where one applies and passed its self-check;
off keeps every op on its pure-MLX twin; check runs both on every call, returns the twin's
result and reports a disagreement; on runs every kernel that applies and passes its self-check,
whatever the measurements say (the CUDA tables and the Metal race below). The self-check runs
once per case (attention: backend, dtype, head dim, grouped-query ratio; the delta rule: key dim
and chunk): a small case through the kernel and the twin; a compile error or a mismatch prints
one line naming the kernel and the case, and that case stays on the ops path.

On CUDA, where the kernels are measured (docs/BENCHMARKS.md), `auto` follows that table. On
Metal, where nothing could be measured while the kernels were written, the first use also races
kernel and twin on a mid-sized case on the user's GPU and keeps the faster, saying so when it
is the twin.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

import metal_kernels.attention as attention_kernels
from metal_kernels import build

from ..plan import PlanError

MODES = ("auto", "off", "check", "on")
# The relative L2 error a kernel may show against the twin: float32 leaves room for TF32
# matmuls in the twin on CUDA, half precision for its rounded inputs and outputs. A wrong
# kernel is off by order one.
TOLERANCE = {mx.float32: 1e-3, mx.float16: 2e-2, mx.bfloat16: 4e-2}
# The head dims at which `auto` routes to the CUDA kernel. None: on the H200 it loses to MLX's own
# path at every head dim (scripts/bench-attention.py, docs/BENCHMARKS.md: 4-9x cuDNN's time at
# 64 and 128, 3.5-7x the unfused path's at 256), so `auto` keeps mlx-lm's attention there; the
# kernel runs when the walk asks for the prefix read in place (attention "tiled"), where its
# memory stays flat.
CUDA_HEAD_DIMS: tuple[int, ...] = ()


@dataclass(frozen=True)
class Case:
    """What a kernel's self-check covers: attention per (dtype, head dim, GQA ratio); the delta
    rule per (key dim, chunk) (`groups` holds the chunk)."""

    backend: str
    dtype: mx.Dtype
    dim: int
    groups: int
    op: str = "attention"

    def __str__(self) -> str:
        if self.op == "delta":
            return f"{self.backend} delta rule key dim {self.dim} chunk {self.groups}"
        if self.op.startswith("mlx-delta"):
            name = str(self.dtype).removeprefix("mlx.core.")
            return (f"{self.backend} {name} gated_delta_update {self.op.split()[1]} heads, dims "
                    f"{self.dim}/{self.groups}")  # fmt: skip
        name = str(self.dtype).removeprefix("mlx.core.")
        return f"{self.backend} {name} head dim {self.dim} GQA {self.groups}"


Checker = Callable[[Case], dict[str, float]]  # relative errors by kernel, kernel vs twin
Racer = Callable[[Case, tuple[int, int]], tuple[float, float]]  # seconds: kernel, twin
# The first-use races on Metal, per op: attention (queries, prefix), the delta rule (chunks of
# the case's size, value heads of dim 128); None: no race.
RACE: dict[str, tuple[int, int]] | None = {
    "attention": (1024, 4096),
    "delta": (32, 8),
    "mlx-delta": (2048, 1),  # MLX's gated_delta_update against the ops, one layer
}
_RACE_SIZE = {"attention": "{} queries over {} keys", "delta": "{} chunks, {} value heads",
              "mlx-delta": "{} positions, batch {}"}  # fmt: skip
# Injected so the CPU tests can run the Metal kernels through the harness.
launch = build.launch
backend = build.current_backend
_verdicts: dict[Case, bool] = {}


def mode() -> str:
    value = os.environ.get("MLXWALK_KERNELS", "auto")
    if value not in MODES:
        raise PlanError(f"MLXWALK_KERNELS={value!r} is unknown; choose one of {', '.join(MODES)}")
    return value


def case_of(q: mx.array, k: mx.array) -> Case | None:
    b = backend()
    return None if b is None else Case(b, q.dtype, q.shape[-1], q.shape[1] // k.shape[1])


def use_kernel(
    q: mx.array,
    k: mx.array,
    store_dtype: mx.Dtype | None,
    auto: bool,
    check: Checker,
    race: Racer,
) -> bool:
    """Whether this call runs the attention kernels; `auto`: the walk left the path to us (on
    CUDA the kernel then runs only at the head dims where it was measured to win). `check`
    compares the kernels with their twin on a small case (the self-check, once per case);
    `race` times both (on Metal, once per case)."""
    case = case_of(q, k)
    if mode() == "off" or case is None:
        return False
    if not attention_kernels.supports(q, k, store_dtype):
        return False
    if auto and case.backend == "cuda" and case.dim not in CUDA_HEAD_DIMS and mode() != "on":
        return False
    return decide(case, check, race)


def decide(case: Case, check: Checker, race: Racer | None = None) -> bool:
    """A case's verdict, found once: the self-check, then on Metal the race (when given)."""
    if case not in _verdicts:
        ok = self_check(case, check)
        kind = case.op.split()[0]
        raced = RACE and kind in RACE and race is not None and mode() != "on"
        if ok and case.backend == "metal" and raced:
            ok = won_race(case, race)
        _verdicts[case] = ok
    return _verdicts[case]


def won_race(case: Case, race: Racer) -> bool:
    kind = case.op.split()[0]
    size = RACE[kind]
    kernel_s, twin_s = race(case, size)
    if kernel_s <= twin_s:
        return True
    print(f"mlxwalk: kernel {case.op} took {kernel_s * 1e3:.0f} ms against the ops twin's "
          f"{twin_s * 1e3:.0f} ms on {case} ({_RACE_SIZE[kind].format(*size)}, forward and "
          "backward); using the ops path", file=sys.stderr)  # fmt: skip
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
