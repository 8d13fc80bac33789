"""Run the Metal kernels on the CPU: MLX renders each call's full Metal source (the generator's
own signature and template instantiation), g++ compiles it as C++ against `metal.h`, and every
threadgroup's threads run concurrently, one threadgroup at a time.

What this checks: the kernel bodies' arithmetic, indexing, masking, barriers and simdgroup
exchanges, through the very source MLX would hand to Metal. What it cannot: Metal's compiler,
an Apple GPU's scheduling, and speed.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..build import Launch, kernel

HEADER = Path(__file__).resolve().parent / "metal.h"
CACHE = Path(
    os.environ.get("MLXWALK_HARNESS_CACHE", Path(tempfile.gettempdir()) / "mlxwalk-harness")
)


def render(call: Launch) -> str:
    """MLX's generated Metal source for the call (printed by `mx.export_function` with
    `verbose=True`; on a build without Metal nothing runs)."""
    k = kernel(call.spec, "metal")  # (the CUDA-only tensor-core kernels have no Metal body)

    def fn(*inputs):
        return k(inputs=list(inputs), template=call.template, grid=call.grid,
                 threadgroup=call.threadgroup, output_shapes=call.output_shapes,
                 output_dtypes=call.output_dtypes, verbose=True)  # fmt: skip

    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryFile("w+") as out:
        saved = os.dup(1)
        os.dup2(out.fileno(), 1)
        try:
            mx.export_function(str(Path(tmp) / "k.mlxfn"), fn, *call.inputs)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        out.seek(0)
        text = out.read()
    match = re.search(r"```\n(.*?)```", text, re.S)
    if match is None:
        raise RuntimeError(f"{call.spec.name}: MLX printed no source")
    return match.group(1)


def _parameters(source: str) -> tuple[str, str, list[tuple[str, str]]]:
    """(kernel function, template arguments, [(type, name)]) from the generated source."""
    head = re.search(r"\[\[kernel\]\] void (\w+)\((.*?)\)\s*\{", source, re.S)
    inst = re.search(r"decltype\(\w+<(.*?)>\) \w+<", source)
    params = []
    for part in head.group(2).split(",\n"):
        decl = re.sub(r"\[\[.*?\]\]", "", part).strip()
        kind, name = decl.rsplit(None, 1)
        params.append((kind, name))
    return head.group(1), inst.group(1) if inst else "", params


def _cpp(call: Launch, source: str) -> str:
    """The translation unit: metal.h, MLX's source (the kernel's header included), a launcher."""
    fn, targs, params = _parameters(source)
    unit = re.sub(r"^template \[\[host_name.*$", "", source, flags=re.M)  # the launcher's instead
    # a `threadgroup` declaration is storage the group shares; the word elsewhere is a qualifier
    unit = re.sub(r"^(\s*)threadgroup(\s+\w+\s+\w+\s*\[)", r"\1static\2", unit, flags=re.M)
    args, b = [], 0
    for kind, name in params:
        if "*" in kind:
            args.append(f"({kind})buf[{b}]")
            b += 1
        else:
            args.append(f"p.{name}")
    call_expr = f"{fn}<{targs}>" if targs else fn
    return (
        f'#include "{HEADER}"\n{unit}\n'
        'extern "C" int mlxwalk_launch(void** buf, const uint* grid, const uint* tg) {\n'
        "  return harness::run(grid, tg, [&](const harness::Pos& p) {\n"
        f"    {call_expr}({', '.join(args)});\n"
        "  });\n"
        "}\n"
    )


def compile_call(call: Launch) -> ctypes.CDLL:
    """The call's kernel as a shared library (cached by its source)."""
    unit = _cpp(call, render(call))
    digest = hashlib.sha256((unit + HEADER.read_text()).encode()).hexdigest()[:16]
    CACHE.mkdir(parents=True, exist_ok=True)
    lib = CACHE / f"{call.spec.name}-{digest}.so"
    if not lib.exists():
        src = CACHE / f"{call.spec.name}-{digest}.cpp"
        src.write_text(unit)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        cmd = ["g++", "-std=c++17", "-O1", "-pthread", "-shared", "-fPIC", "-Wno-attributes",
               "-o", str(tmp), str(src)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{call.spec.name}: g++ failed:\n{done.stderr[-4000:]}")
        tmp.rename(lib)
    return ctypes.CDLL(str(lib))


def _host(a: mx.array) -> np.ndarray:
    if a.dtype == mx.bfloat16:  # bfloat16 as its bits: the top half of a float32
        return (np.array(a.astype(mx.float32)).view(np.uint32) >> 16).astype(np.uint16)
    return np.ascontiguousarray(np.array(a))


def run(call: Launch) -> list[np.ndarray]:
    """Run the call's Metal kernel on the CPU; outputs start as NaN so unwritten ones show."""
    lib = compile_call(call)
    inputs = [_host(a) for a in call.inputs]
    outputs = [np.full(s, np.nan, dtype=np.float32) for s in call.output_shapes]
    if any(d != mx.float32 for d in call.output_dtypes):
        raise NotImplementedError("the harness reads float32 outputs only")
    buffers = (ctypes.c_void_p * (len(inputs) + len(outputs)))(
        *[a.ctypes.data for a in inputs + outputs]
    )
    grid, group = ((ctypes.c_uint * 3)(*dims) for dims in (call.grid, call.threadgroup))
    if lib.mlxwalk_launch(buffers, grid, group):
        raise ValueError(f"{call.spec.name}: the grid must fill whole threadgroups of 32k threads")
    return outputs


def launch(call: Launch) -> list[mx.array]:
    """`run` as MLX arrays: a stand-in for `build.launch` on a machine without a GPU."""
    return [mx.array(a) for a in run(call)]
