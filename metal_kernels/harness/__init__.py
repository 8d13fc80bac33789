"""Run the Metal kernels on the CPU: MLX renders each call's full Metal source (the generator's
own signature and template instantiation), g++ compiles it as C++ against `metal.h`, and every
threadgroup's threads run concurrently, one threadgroup at a time.

What this checks: the kernel bodies' arithmetic, indexing, masking, barriers, simdgroup
exchanges and simdgroup matrices (Apple's lane layout), through the very source MLX would hand
to Metal; with libclang installed, that no pointer crosses Metal's address spaces
(`check_address_spaces`); on request, each call's memory traffic (`run(call, counters=True)`).
What it cannot: Metal's compiler, an Apple GPU's scheduling, and speed.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Literal, overload

import mlx.core as mx
import numpy as np

from ..build import Launch, kernel

HEADER = Path(__file__).resolve().parent / "metal.h"
CACHE = Path(
    os.environ.get("MLXWALK_HARNESS_CACHE", Path(tempfile.gettempdir()) / "mlxwalk-harness")
)
# What `run(call, counters=True)` returns, in runtime.h's order (enum Count).
COUNTERS = (
    "device_read_bytes",
    "device_write_bytes",
    "threadgroup_read_bytes",
    "threadgroup_write_bytes",
    "mma",
    "barriers",
    "simdgroup_barriers",
    "threadgroup_memory_bytes",
)
THREADGROUP_MEMORY = 32768  # bytes of threadgroup memory a threadgroup has on Apple GPUs
NO_CLANG = "libclang is not installed: pip install -e '.[test]'"

try:
    from clang import cindex
except ImportError:  # the address-space check is then skipped
    cindex = None
HAS_CLANG = cindex is not None


class AddressSpaceError(RuntimeError):
    """A kernel moves a pointer across Metal's address spaces: Metal's compiler would refuse it."""


def render(call: Launch) -> str:
    """MLX's generated Metal source for the call (printed by `mx.export_function` with
    `verbose=True`; on a build without Metal nothing runs)."""
    k = kernel(call.spec, "metal")  # (the CUDA-only tensor-core kernels have no Metal body)

    def fn(*inputs):
        return k(
            inputs=list(inputs),
            template=call.template,
            grid=call.grid,
            threadgroup=call.threadgroup,
            output_shapes=call.output_shapes,
            output_dtypes=call.output_dtypes,
            verbose=True,
        )

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


# `threadgroup T name[...];` (or a scalar): storage the whole group shares. Made function-static
# (one threadgroup runs at a time) and registered (HARNESS_THREADGROUP, metal.h). A `threadgroup`
# pointer (`threadgroup half* p = ...`) is a plain local and stays as it is.
_SHARED = re.compile(
    r"^([ \t]*)threadgroup\s+([\w:]+(?:\s*<[^;<>]*>)?)\s+(\w+)((?:\s*\[[^\]\n]*\])*)\s*;", re.M
)
_UNSHARED = re.compile(r"^[ \t]*threadgroup\s+[\w:<>, ]+?\s+\w+\s*[\[;,=]", re.M)
_HALF_LITERAL = re.compile(r"(?<![\w.])(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?[hH]\b")  # 0.5h


def _unit_source(call: Launch, source: str) -> str:
    """MLX's source made compilable by either build: the instantiation line dropped (each build
    instantiates the kernel itself), `threadgroup` storage made static, Metal's half literals
    written as conversions."""
    unit = re.sub(r"^template \[\[host_name.*$", "", source, flags=re.M)
    unit = _HALF_LITERAL.sub(r"half(\1\2)", unit)
    unit = _SHARED.sub(r"\1static threadgroup \2 \3\4; HARNESS_THREADGROUP(\3);", unit)
    left = _UNSHARED.search(unit)
    if left:  # would silently become one array per thread
        raise ValueError(
            f"{call.spec.name}: the harness takes one threadgroup variable per declaration, on "
            f"one line: {left.group(0).strip()}"
        )
    return unit


def _argument(kind: str, name: str, b: int) -> str:
    if "atomic<" in kind:
        raise NotImplementedError(f"the harness has no atomic outputs ({name})")
    if kind.endswith("&"):  # a 0-d input: MLX passes `const constant T&`
        return f"*({kind[:-1]}*)buf[{b}]"
    return f"({kind})buf[{b}]"


def _cpp(call: Launch, source: str, counting: bool) -> str:
    """The g++ translation unit: metal.h, MLX's source (the kernel's header included), a
    launcher. `counting`: the build whose memory accesses are counted."""
    fn, targs, params = _parameters(source)
    args, b = [], 0
    for kind, name in params:
        if "*" in kind or kind.endswith("&"):
            args.append(_argument(kind, name, b))
            b += 1
        else:
            args.append(f"p.{name}")
    call_expr = f"{fn}<{targs}>" if targs else fn
    return (
        ("#define HARNESS_COUNT_MEMORY 1\n" if counting else "")
        + f'#include "{HEADER}"\n{_unit_source(call, source)}\n'
        + 'extern "C" __attribute__((visibility("default")))\n'
        "int mlxwalk_launch(void** buf, const unsigned long* bytes, int n,\n"
        "                   const uint* grid, const uint* tg, long long* counts) {\n"
        "  harness::set_buffers(buf, bytes, n);\n"
        "  return harness::run(grid, tg, [&](const harness::Pos& p) {\n"
        f"    {call_expr}({', '.join(args)});\n"
        "  }, counts);\n"
        "}\n"
    )


def _headers() -> str:
    return "".join(p.read_text() for p in sorted(HEADER.parent.glob("*.h")))


def check_address_spaces(call: Launch, source: str | None = None) -> None:
    """Parse the call's kernel with clang, Metal's address spaces as clang's (`device` 1,
    `constant` 2, `threadgroup` 3, `thread` the default), and raise AddressSpaceError with
    clang's errors if it is refused: a pointer crossing address spaces, as Metal's compiler would
    refuse it. Needs libclang (`HAS_CLANG`); `source` defaults to `render(call)`."""
    if cindex is None:
        raise RuntimeError(NO_CLANG)
    source = render(call) if source is None else source
    fn, targs, _ = _parameters(source)
    unit = (
        f'#define HARNESS_SPACES 1\n#include "{HEADER}"\n{_unit_source(call, source)}\n'
        f"auto harness_instance = &{fn}{f'<{targs}>' if targs else ''};\n"
    )
    path = f"{call.spec.name}.cpp"
    flags = [
        "-x",
        "c++",
        "-std=c++17",
        "-nostdinc",
        "-nostdinc++",
        "--target=x86_64-linux-gnu",
        "-Wno-unknown-attributes",
        "-Wno-ignored-attributes",
        "-ferror-limit=10",
    ]
    tu = cindex.Index.create().parse(path, args=flags, unsaved_files=[(path, unit)])
    errors = [d for d in tu.diagnostics if d.severity >= cindex.Diagnostic.Error]
    if errors:
        lines = [f"{d.location.line}: {d.spelling}" for d in errors]
        raise AddressSpaceError(
            f"{call.spec.name}: refused with Metal's address spaces:\n" + "\n".join(lines)
        )


def compile_call(call: Launch, counting: bool = False, check: bool = True) -> ctypes.CDLL:
    """The call's kernel as a shared library (cached by its source). `check`: first
    `check_address_spaces`, where libclang is installed (once per source: a passed check is
    cached too). `counting`: the build that counts memory traffic (compiled with
    -fsanitize=thread's hooks, see runtime.h)."""
    return _compile(call, render(call), counting, check)


def _compile(call: Launch, source: str, counting: bool, check: bool = True) -> ctypes.CDLL:
    CACHE.mkdir(parents=True, exist_ok=True)
    headers = _headers()
    checked = CACHE / f"{call.spec.name}-{_digest(source + headers)}.spaces-ok"
    if check and HAS_CLANG and not checked.exists():
        check_address_spaces(call, source)
        checked.touch()
    unit = _cpp(call, source, counting)
    lib = CACHE / f"{call.spec.name}-{_digest(unit + headers)}.so"
    if not lib.exists():
        src = lib.with_suffix(".cpp")
        src.write_text(unit)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        # hidden: each library keeps its own statics (default-visibility `inline` and template
        # statics would be bound process-wide, one kernel's to another's)
        flags = ["-std=c++17", "-O1", "-pthread", "-fPIC", "-fvisibility=hidden", "-Wno-attributes"]
        if counting:  # instrumented, then linked without the sanitizer's runtime
            obj = lib.with_suffix(f".{os.getpid()}.o")
            instrument = ["-fsanitize=thread", "--param=tsan-instrument-func-entry-exit=0"]
            _gxx([*flags, *instrument, "-c", "-o", str(obj), str(src)], call)
            _gxx(["-shared", "-pthread", "-o", str(tmp), str(obj)], call)
            obj.unlink()
        else:
            _gxx([*flags, "-shared", "-o", str(tmp), str(src)], call)
        tmp.rename(lib)
    return ctypes.CDLL(str(lib))


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _gxx(args: list[str], call: Launch) -> None:
    done = subprocess.run(["g++", *args], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{call.spec.name}: g++ failed:\n{done.stderr[-4000:]}")


def _host(a: mx.array) -> np.ndarray:
    if a.dtype == mx.bfloat16:  # bfloat16 as its bits: the top half of a float32
        return (np.array(a.astype(mx.float32)).view(np.uint32) >> 16).astype(np.uint16)
    return np.ascontiguousarray(np.array(a))


def _buffers(call: Launch, source: str, outputs: list[np.ndarray]) -> list[np.ndarray]:
    """The buffers in the order of the signature's pointer and reference parameters: inputs,
    their `_shape`, `_strides`, `_ndim` where the body names them, outputs."""
    named = dict(zip(call.spec.inputs, (_host(a) for a in call.inputs)))
    named.update(zip(call.spec.outputs, outputs))
    for name, a in zip(call.spec.inputs, call.inputs):
        named[f"{name}_shape"] = np.array(a.shape, np.int32)
        named[f"{name}_strides"] = np.array(named[name].strides, np.int64) // a.dtype.size
        named[f"{name}_ndim"] = np.array([a.ndim], np.int32)
    _, _, params = _parameters(source)
    return [named[name] for kind, name in params if "*" in kind or kind.endswith("&")]


@overload
def run(call: Launch, counters: Literal[False] = False) -> list[np.ndarray]: ...
@overload
def run(call: Launch, counters: Literal[True]) -> tuple[list[np.ndarray], dict[str, int]]: ...
def run(
    call: Launch, counters: bool = False
) -> list[np.ndarray] | tuple[list[np.ndarray], dict[str, int]]:
    """Run the call's Metal kernel on the CPU; outputs start as NaN so unwritten ones show.
    `counters`: also return the call's traffic (COUNTERS): bytes read and written in device
    memory (every buffer, `constant` ones too) and in threadgroup memory, 8x8x8
    multiply-accumulates and threadgroup barriers (once per simdgroup or threadgroup), the
    kernel's threadgroup memory."""
    if any(d != mx.float32 for d in call.output_dtypes):
        raise NotImplementedError("the harness reads float32 outputs only")
    source = render(call)
    lib = _compile(call, source, counters)
    outputs = [np.full(s, np.nan, dtype=np.float32) for s in call.output_shapes]
    arrays = _buffers(call, source, outputs)
    buffers = (ctypes.c_void_p * len(arrays))(*[a.ctypes.data for a in arrays])
    sizes = (ctypes.c_ulong * len(arrays))(*[a.nbytes for a in arrays])
    grid, group = ((ctypes.c_uint * 3)(*dims) for dims in (call.grid, call.threadgroup))
    counts = (ctypes.c_longlong * len(COUNTERS))()
    if lib.mlxwalk_launch(buffers, sizes, len(arrays), grid, group, counts):
        raise ValueError(f"{call.spec.name}: the grid must fill whole threadgroups of 32k threads")
    found = dict(zip(COUNTERS, counts))
    if found["threadgroup_memory_bytes"] > THREADGROUP_MEMORY:
        raise RuntimeError(
            f"{call.spec.name}: {found['threadgroup_memory_bytes']} bytes of threadgroup memory; "
            f"an Apple GPU's threadgroup has {THREADGROUP_MEMORY}"
        )
    return (outputs, found) if counters else outputs


def launch(call: Launch) -> list[mx.array]:
    """`run` as MLX arrays: a stand-in for `build.launch` on a machine without a GPU."""
    return [mx.array(a) for a in run(call)]
