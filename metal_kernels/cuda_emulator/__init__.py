"""Run the CUDA tensor-core kernels on the CPU: the source MLX would hand to NVRTC for a call
(metal_kernels/cuda_source), compiled by g++ against `emulate.h` (which models ldmatrix,
mma.m16n8k16, cp.async, named barriers and warp shuffles lane by lane, see there) and run as a
separate process over the call's buffers, one block at a time (blocks split across processes).

What this checks: the bodies' indexing, fragment layouts, masking, pipelining (a read of a
cp.async destination before its wait reads NaN), barriers (a deadlock is reported), shared
memory bounds. What it cannot: NVRTC or ptxas (scripts/compile-cuda.py builds the same source
with nvcc), a GPU's scheduling or memory ordering, and speed. The tensor-core kernels use only
the primitives of metal_kernels/mma.cuh; the scalar `.cu` ones (warp shuffles, __syncwarp, static
__shared__ arrays, made one per process: its blocks run one at a time) run here too, launched
with their CUDA geometry (`backend="cuda"`).
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from .. import cuda_source
from ..build import Launch, source

HEADER = Path(__file__).resolve().parent / "emulate.h"
CACHE = Path(
    os.environ.get("MLXWALK_EMULATOR_CACHE", Path(tempfile.gettempdir()) / "mlxwalk-cuda-emulator")
)


_STATIC_SHARED = re.compile(r"^([ \t]*)__shared__ ", re.M)


def _unit(call: Launch) -> str:
    head, _ = source(call.spec, "cuda")
    # a block's static __shared__ arrays (the scalar kernels'): one per process, shared by the
    # block's threads (blocks run one at a time); `extern __shared__` is emulate.h's smem
    kernel = _STATIC_SHARED.sub(r"\1static ", cuda_source.render(call, "kernel", header=False))
    n = len(call.spec.inputs) + len(call.spec.outputs)
    types = [cuda_source.ctype(a.dtype) for a in call.inputs]
    types += [cuda_source.ctype(d) for d in call.output_dtypes]
    args = [
        f"({'const ' if i < len(call.inputs) else ''}{t}*)buf[{i}]" for i, t in enumerate(types)
    ]
    return (
        f'#include "{HEADER}"\n{head}\n{kernel}\n'
        f"static void* buf[{n}];\n"
        f"static void body() {{ mlx::core::cu::kernel({', '.join(args)}); }}\n"
        f"int main(int argc, char** argv) {{ return emu::main(argc, argv, {n}, buf, body); }}\n"
    )


def compile_call(call: Launch) -> Path:
    """The call's emulated kernel as an executable (cached by its source)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    unit = _unit(call)
    digest = hashlib.sha256((unit + HEADER.read_text()).encode()).hexdigest()[:16]
    exe = CACHE / f"{call.spec.name}-{digest}"
    if not exe.exists():
        src = exe.with_suffix(".cpp")
        src.write_text(unit)
        tmp = exe.with_suffix(f".{os.getpid()}.tmp")
        cmd = [
            "g++",
            "-std=c++17",
            "-O1",
            "-fno-strict-aliasing",
            "-Wno-attributes",
            "-o",
            str(tmp),
            str(src),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{call.spec.name}: g++ failed:\n{done.stderr[-4000:]}")
        tmp.rename(exe)
    return exe


def _host(a: mx.array) -> np.ndarray:
    if a.dtype in (mx.bfloat16, mx.float16):  # as their bits
        return np.array(a.view(mx.uint16))
    return np.ascontiguousarray(np.array(a))


def run(call: Launch, processes: int = 2, seed: int = 0) -> list[np.ndarray]:
    """The call's outputs, computed by the emulator; they start as NaN, so unwritten ones show.
    `processes`: how many share the blocks (each runs the blocks of its own grid range)."""
    if any(d != mx.float32 for d in call.output_dtypes):
        raise NotImplementedError("the emulator reads float32 outputs only")
    exe = compile_call(call)
    inputs = [_host(a) for a in call.inputs]
    grid = [-(-g // t) for g, t in zip(call.grid, call.threadgroup)]
    blocks = grid[0] * grid[1] * grid[2]
    if grid[1] * grid[2] != 1:
        processes = 1  # (the kernels here use one grid axis)
    processes = max(1, min(processes, blocks))
    outputs = [np.full(s, np.nan, np.float32) for s in call.output_shapes]
    with tempfile.TemporaryDirectory() as tmp:
        jobs = []
        for p in range(processes):
            d = Path(tmp) / str(p)
            d.mkdir()
            arrays = inputs + outputs
            for i, a in enumerate(arrays):
                (d / f"b{i}.bin").write_bytes(a.tobytes())
            lo, hi = blocks * p // processes, blocks * (p + 1) // processes
            argv = [
                str(exe),
                str(d),
                str(hi - lo),
                "1",
                "1",
                *map(str, call.threadgroup),
                str(call.shared_memory),
                str(seed + p),
                str(len(inputs)),
                *[str(a.nbytes) for a in arrays],
            ]
            env = dict(os.environ, MLXWALK_EMULATOR_FIRST_BLOCK=str(lo))
            jobs.append(subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True))
        for job in jobs:
            _, err = job.communicate()
            if job.returncode:
                raise RuntimeError(f"{call.spec.name}: the emulator failed: {err.strip()[-2000:]}")
        for p in range(processes):
            d = Path(tmp) / str(p)
            for i, out in enumerate(outputs):
                got = np.fromfile(d / f"b{len(inputs) + i}.bin", np.float32).reshape(out.shape)
                written = ~np.isnan(got)
                out[written] = got[written]
    return outputs


def launch(call: Launch) -> list[mx.array]:
    """`run` as MLX arrays: a stand-in for `build.launch` on a machine without a GPU."""
    return [mx.array(a) for a in run(call)]
