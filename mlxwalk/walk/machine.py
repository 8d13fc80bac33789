"""The memory this machine gives MLX, as MLX reports it: the budget a walk keeps to when none is
given on a GPU, and what `mlxwalk plan` compares an estimate with.

Metal: the GPU's recommended working set (`mx.device_info()`); past it macOS pages the unified
memory and a step slows many times over. CUDA: the device's free memory. The CPU: the machine's
physical memory, said but not enforced (the operating system pages past it).

A Mac not at hand: `working_set(gb)`, macOS's default working set for each memory size in MACS
(what `mlxwalk plan --macs` and scripts/mac-table.py budget by).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import mlx.core as mx

GIB = 1 << 30
MACS = (16, 24, 32, 36, 48, 64, 96, 128)  # GB of unified memory Apple sells a Mac with


@dataclass(frozen=True)
class Memory:
    bytes: int | None  # None: not known
    what: str  # where the figure comes from, as the start line and plan say it
    binding: bool  # the walk's memory budget when none is given

    def said(self) -> str:
        gib = "unknown" if self.bytes is None else f"{self.bytes / (1 << 30):.1f} GiB"
        return f"{gib} ({self.what})"


def backend() -> str:
    if mx.metal.is_available():
        return "metal"
    return "cuda" if mx.cuda.is_available() else "cpu"


def device_info() -> dict:
    return mx.device_info()


def physical() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def memory() -> Memory:
    """What this machine's MLX may hold."""
    where = backend()
    if where == "metal":
        size = device_info().get("max_recommended_working_set_size")
        return Memory(size, "the GPU's recommended working set, mx.device_info()", size is not None)
    if where == "cuda":
        info = device_info()
        size = info.get("free_memory", info.get("total_memory"))
        return Memory(size, "free CUDA device memory", size is not None)
    return Memory(physical(), "this machine's memory; the CPU backend pages past it", False)


def default_budget_mib(given: float | None) -> tuple[float | None, Memory | None]:
    """The memory budget a walk keeps to: the one given, else on a GPU what MLX reports it may
    use (returned so the caller can say so)."""
    if given is not None:
        return given, None
    mem = memory()
    if mem.binding and mem.bytes:
        return mem.bytes / (1 << 20), mem
    return None, None


def working_set(gb: int) -> int:
    """macOS's default GPU working set in bytes for a Mac of `gb` GB (recommendedMaxWorkingSetSize,
    MLX's `max_recommended_working_set_size`): about two thirds of memory up to 36 GB, three
    quarters above. An estimate: the machine's own figure is what `mlxwalk kernels` prints."""
    return int(gb * GIB * (2 / 3 if gb <= 36 else 3 / 4))
