"""The project's CUDA kernels compiled with NVRTC and launched by torch, without MLX: what the
delta rule's driver (delta_kernels.py) and attention's (attention_kernels.py) share.

torch compiles a kernel's text at run time (`torch.cuda._compile_kernel`: no nvcc on the user's
machine) and launches it on torch's current stream. The text is cuda_source.render_kernel's, the
function MLX's unit is rendered with (the same `mlx::core::cu` kernel and headers); only PRELUDE
is this driver's own (the half types and int32_t, which NVRTC has no standard header for), and
torch adds its NVRTC flags (-D__CUDA_NO_HALF_OPERATORS__ and the like, which only take overloads
away: a kernel that compiles under them computes the same). A kernel above 48 KiB of dynamic
shared memory has its limit raised once (`set_shared_memory_config`). MLXWALK_KERNELS (the MLX
side's switch) is read here: auto (default), check, off, on; each driver says what they do.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from metal_kernels import cuda_source
from metal_kernels.sources import Spec

from ..errors import ConfigError

MODES = ("auto", "off", "check", "on")
PRELUDE = """#include <cuda_bf16.h>
#include <cuda_fp16.h>
typedef int int32_t;
typedef unsigned int uint32_t;
namespace cooperative_groups {}  // the rendered kernel aliases it (`cg`); these bodies use none
"""

_driver = None  # libcuda, once loaded


class KernelFailure(RuntimeError):
    """A kernel that could not be built or run: `kernel` names it (its stem, "delta/prepare")."""

    def __init__(self, kernel: str, why: str):
        super().__init__(f"{kernel}: {why}")
        self.kernel = kernel


@dataclass
class Gate:
    """A kernel family's routing state for the process: each case (head dim, dtype, device)
    self-checked once before its first call, and the first failure switching the family off."""

    what: str  # what the kernels compute, for the one line: "the delta rule"
    fallback: str  # what serves it without them: "the torch ops"
    passed: set[tuple] = field(default_factory=set)  # cases whose self-check passed
    failed: str | None = None  # why the kernels are off for the rest of the process

    def admits(self, case: tuple, where: str, check: Callable[[], str | None]) -> bool:
        """Whether `case` runs on the kernels, `check` (why not, or None) run the first time.
        Under MLXWALK_KERNELS=on a failing check raises; else it says so once and turns off."""
        if self.failed is not None:
            return False
        if case in self.passed:
            return True
        why = check()
        if why is not None and mode() == "on":
            raise RuntimeError(
                f"MLXWALK_KERNELS=on, and {why} {where}; unset MLXWALK_KERNELS to use "
                f"{self.fallback}"
            )
        if why is not None:
            self.failed = f"{why} {where}"
            print(f"mlxwalk: {self.failed}; {self.what} runs on {self.fallback}", file=sys.stderr)
            return False
        self.passed.add(case)
        return True


def mode() -> str:
    value = os.environ.get("MLXWALK_KERNELS", "auto")
    if value not in MODES:
        raise ConfigError(f"MLXWALK_KERNELS={value!r} is unknown; choose one of {', '.join(MODES)}")
    return value


def include_dirs() -> list[str]:
    """Where cuda_fp16.h and cuda_bf16.h are: the CUDA wheels' include folders (torch's cu13x
    wheels bring nvidia/cu13/include), else CUDA_HOME's (torch adds that one itself)."""
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations or []) if spec else []
    return sorted({str(p.parent) for r in roots for p in Path(r).glob("*/include/cuda_fp16.h")})


def unit(spec: Spec, input_dtypes: list[str], outputs: int, template: list) -> str:
    """The NVRTC translation unit of a launch: PRELUDE, then cuda_source's rendering (the
    kernel's headers and its `mlx::core::cu` function, named as the spec) for inputs of
    `input_dtypes` (names, params and the like included) and `outputs` float32 outputs."""
    return PRELUDE + cuda_source.render_kernel(
        spec, input_dtypes, ["float32"] * outputs, template, spec.name
    )


def current_context(device: torch.device) -> None:
    """Make the device's primary context (the one torch's runtime calls use) current on this
    thread for the driver calls torch's NVRTC path makes (module load, launch): before any
    kernel of the process has run, none may be, and cuModuleLoadData then fails with "invalid
    device context" (seen on an H100 under torch 2.11, the first kernel's compile)."""
    global _driver
    import ctypes

    from torch.cuda import _utils

    _driver = _driver or _utils._get_gpu_runtime_library()
    lib, ctx = _driver, ctypes.c_void_p()
    _utils._check_cuda(lib.cuCtxGetCurrent(ctypes.byref(ctx)))
    if ctx.value:
        return
    torch.cuda.init()
    dev = ctypes.c_int()
    index = torch.cuda.current_device() if device.index is None else device.index
    _utils._check_cuda(lib.cuDeviceGet(ctypes.byref(dev), index))
    _utils._check_cuda(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
    _utils._check_cuda(lib.cuCtxSetCurrent(ctx))


def compile_unit(source: str, name: str, device: torch.device, shared_memory: int):
    """NVRTC through torch: the launchable kernel `mlx::core::cu::<name>` of `source` for
    `device` (its architecture), its dynamic shared memory limit raised to `shared_memory`."""
    compile_kernel = getattr(torch.cuda, "_compile_kernel", None)
    if compile_kernel is None:
        raise RuntimeError(f"torch {torch.__version__} has no torch.cuda._compile_kernel")
    with torch.cuda.device(device):
        current_context(device)
        fn = compile_kernel(source, f"mlx::core::cu::{name}", cuda_include_dirs=include_dirs())
        fn.set_shared_memory_config(shared_memory)  # above 48 KiB: the attribute, once
    return fn


def first_error(e: Exception) -> str:
    """The line of an exception (an NVRTC log, say) that tells what went wrong."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    errors = [x for x in lines if "error" in x.lower() and not x.startswith("Kernel compilation")]
    return (errors or lines or [type(e).__name__])[0][:200]


def cached(cache: dict, key: tuple, spec: Spec, source: Callable[[], str], device, shared, build):
    """The kernel of `key` from `cache`, else `build(source(), name, device, shared)` stored
    there; a build failure is a KernelFailure naming the spec's stem."""
    if key not in cache:
        try:
            cache[key] = build(source(), spec.name, device, shared)
        except Exception as e:
            raise KernelFailure(spec.stem, f"does not build ({first_error(e)})") from e
    return cache[key]


def launch(fn, grid: tuple, block: tuple, args: list, shared_memory: int, device) -> None:
    """Launch `fn` on `device`, `grid` counted in threads (MLX's convention) as torch's blocks."""
    blocks = tuple(-(-g // t) for g, t in zip(grid, block))
    with torch.cuda.device(device):
        current_context(device)  # (a backward launches from autograd's own thread)
        fn(grid=blocks, block=block, args=args, shared_mem=shared_memory)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return ((a - b).norm() / (b.norm() + 1e-30)).item()
