"""Build, cache and launch the kernels with MLX: one `Spec` per kernel (sources.py, with the
reading of their text), one `Launch` per call."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

import mlx.core as mx

from .sources import BACKENDS, MMA, ROOT, Spec, header_files, source

__all__ = [
    "BACKENDS",
    "MMA",
    "ROOT",
    "Launch",
    "Spec",
    "current_backend",
    "header_files",
    "kernel",
    "launch",
    "source",
]


@dataclass
class Launch:
    """One call of a kernel, as plain data: MLX launches it (`launch`) and so does the CPU
    harness (`harness.run`), from the same grid, threadgroup and template."""

    spec: Spec
    inputs: list[mx.array]
    output_shapes: list[tuple[int, ...]]
    output_dtypes: list[mx.Dtype]
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    template: list[tuple[str, object]] = field(default_factory=list)
    shared_memory: int = 0  # dynamic shared memory in bytes (CUDA)


def current_backend() -> str | None:
    """The GPU backend MLX runs on, or None on the CPU."""
    if mx.metal.is_available():
        return "metal"
    if mx.cuda.is_available():
        return "cuda"
    return None


@cache
def kernel(spec: Spec, backend: str, shared_memory: int = 0):
    """The MLX kernel object (built once per backend and shared memory size; MLX compiles each
    template on first use)."""
    if backend not in spec.backends:
        raise RuntimeError(f"{spec.name} has no {backend} source")
    header, body = source(spec, backend)
    common = {
        "name": spec.name,
        "input_names": list(spec.inputs),
        "output_names": list(spec.outputs),
        "source": body,
        "header": header,
    }
    if backend == "metal":
        return mx.fast.metal_kernel(**common)
    return mx.fast.cuda_kernel(**common, shared_memory=shared_memory)


def launch(call: Launch, backend: str | None = None, verbose: bool = False) -> list[mx.array]:
    backend = backend or current_backend()
    if backend not in BACKENDS:
        raise RuntimeError(f"{call.spec.name}: no GPU backend to run it on")
    return kernel(call.spec, backend, call.shared_memory if backend == "cuda" else 0)(
        inputs=call.inputs,
        template=call.template,
        grid=call.grid,
        threadgroup=call.threadgroup,
        output_shapes=call.output_shapes,
        output_dtypes=call.output_dtypes,
        verbose=verbose,
    )
