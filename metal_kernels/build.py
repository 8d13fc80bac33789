"""Read, build, cache and launch the kernels: one `Spec` per kernel, one `Launch` per call."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent
BACKENDS = ("metal", "cuda")
_SOURCE = {"metal": ".metal", "cuda": ".cu"}
_HEADER = {"metal": ".metal", "cuda": ".cuh"}
MMA = ROOT / "mma.cuh"  # the CUDA tensor-core primitives (mma.sync, ldmatrix, cp.async)


@dataclass(frozen=True)
class Spec:
    """A kernel: its source stem under metal_kernels/ (`attention/forward` reads
    `attention/forward.metal` or `.cu`, and the folder's headers, `common.metal` or `.cuh` by
    default, as the header), the names of its buffers in the order they are passed, and the
    backends it has a source for. A kernel on the tensor cores takes mma.cuh ahead of its
    headers in CUDA."""

    stem: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    headers: tuple[str, ...] = ("common",)
    backends: tuple[str, ...] = ("metal", "cuda")
    tensor_cores: bool = False

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
    shared_memory: int = 0  # dynamic shared memory in bytes (CUDA)


def current_backend() -> str | None:
    """The GPU backend MLX runs on, or None on the CPU."""
    if mx.metal.is_available():
        return "metal"
    if mx.cuda.is_available():
        return "cuda"
    return None


def header_files(spec: Spec, backend: str) -> list[Path]:
    """The files of a kernel's header for a backend, in order."""
    folder = (ROOT / spec.stem).parent
    files = [folder / (h + _HEADER[backend]) for h in spec.headers]
    return [MMA, *files] if backend == "cuda" and spec.tensor_cores else files


def source(spec: Spec, backend: str) -> tuple[str, str]:
    """(header, body) of a kernel for a backend."""
    header = "\n".join(h.read_text() for h in header_files(spec, backend))
    return header, (ROOT / (spec.stem + _SOURCE[backend])).read_text()


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
