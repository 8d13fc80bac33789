"""The kernels as plain data, without MLX: each kernel's `Spec` and the text of its source and
header per backend. build.py builds and launches them with MLX; the torch backend's driver
(mlxwalk/torch_backend/delta_kernels.py) compiles the same CUDA text with NVRTC through torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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


def dtype_name(dtype) -> str:
    """A dtype's name ("float32", "bfloat16", ...) from the name itself, an MLX dtype
    (`mlx.core.float32`) or a torch one (`torch.float32`): the tables here key on names."""
    return dtype if isinstance(dtype, str) else str(dtype).rsplit(".", 1)[-1]


def header_files(spec: Spec, backend: str) -> list[Path]:
    """The files of a kernel's header for a backend, in order."""
    folder = (ROOT / spec.stem).parent
    files = [folder / (h + _HEADER[backend]) for h in spec.headers]
    return [MMA, *files] if backend == "cuda" and spec.tensor_cores else files


def source(spec: Spec, backend: str) -> tuple[str, str]:
    """(header, body) of a kernel for a backend."""
    header = "\n".join(h.read_text() for h in header_files(spec, backend))
    return header, (ROOT / (spec.stem + _SOURCE[backend])).read_text()
