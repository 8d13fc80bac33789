"""Read, build, cache and launch the kernels: one `Spec` per kernel, one `Launch` per call."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent
BACKENDS = ("metal", "cuda")
_SOURCE = {"metal": ".metal", "cuda": ".cu"}
_HEADER = {"metal": "common.metal", "cuda": "common.cuh"}


@dataclass(frozen=True)
class Spec:
    """A kernel: its source stem under metal_kernels/ (`attention/forward` reads
    `attention/forward.metal` or `.cu`, and the folder's `common.metal` or `.cuh` as the header)
    and the names of its buffers, in the order they are passed."""

    stem: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    @property
    def name(self) -> str:
        return "mlxwalk_" + self.stem.replace("/", "_")


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


def current_backend() -> str | None:
    """The GPU backend MLX runs on, or None on the CPU."""
    if mx.metal.is_available():
        return "metal"
    if mx.cuda.is_available():
        return "cuda"
    return None


def source(stem: str, backend: str) -> tuple[str, str]:
    """(header, body) of a kernel for a backend."""
    path = ROOT / (stem + _SOURCE[backend])
    header = path.parent / _HEADER[backend]
    return (header.read_text() if header.exists() else ""), path.read_text()


@cache
def kernel(spec: Spec, backend: str):
    """The MLX kernel object (built once per backend; MLX compiles each template on first use)."""
    header, body = source(spec.stem, backend)
    make = mx.fast.metal_kernel if backend == "metal" else mx.fast.cuda_kernel
    return make(
        name=spec.name,
        input_names=list(spec.inputs),
        output_names=list(spec.outputs),
        source=body,
        header=header,
    )


def launch(call: Launch, backend: str | None = None, verbose: bool = False) -> list[mx.array]:
    backend = backend or current_backend()
    if backend not in BACKENDS:
        raise RuntimeError(f"{call.spec.name}: no GPU backend to run it on")
    return kernel(call.spec, backend)(
        inputs=call.inputs,
        template=call.template,
        grid=call.grid,
        threadgroup=call.threadgroup,
        output_shapes=call.output_shapes,
        output_dtypes=call.output_dtypes,
        verbose=verbose,
    )
