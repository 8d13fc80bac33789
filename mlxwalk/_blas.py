"""An optimized BLAS for MLX's CPU backend on Linux, from pip.

MLX's Linux CPU wheel links the reference BLAS: float32 matmul measured ~2-5 GFLOP/s on a 2-core
x86-64 machine against ~110-130 with OpenBLAS. The `scipy-openblas32` wheel (the OpenBLAS numpy
and scipy build on) installs from pip with nothing from the system, but prefixes its symbols
(`scipy_cblas_sgemm`), so MLX cannot bind to it by name. MLX calls its three GEMMs through lazily
bound jump slots in libmlx.so; `use_openblas` writes OpenBLAS's functions into those slots. The
functions have the same C signature (32-bit integers), so the result is the same call to a faster
library. The command-line entry points and the tests' configuration call it (importing mlxwalk
does not); on a machine whose MLX runs on a GPU it does nothing and says nothing.

MLXWALK_BLAS=off keeps the reference BLAS; MLXWALK_BLAS=/path/to/libopenblas.so takes an
unprefixed OpenBLAS (a system one) instead of the wheel's.
"""

from __future__ import annotations

import ctypes
import functools
import os
import struct
import sys
from collections.abc import Callable
from typing import TypeVar

GEMMS = ("cblas_sgemm", "cblas_dgemm", "cblas_cgemm")
SHT_RELA = 4

loaded: str | None = None
tried = False  # use_openblas has been called once by an entry point (at_first_use)
F = TypeVar("F", bound=Callable)


def at_first_use() -> None:
    """What every entry point does before MLX's first product, once a process: route MLX's CPU
    GEMMs (saying on stderr, as the commands do, when they stay on the reference BLAS)."""
    global tried
    if not tried:
        tried = True
        use_openblas()


def first_use(fn: F) -> F:
    """A public function that routes MLX's CPU products at its first call (`at_first_use`)."""

    @functools.wraps(fn)
    def routed(*args, **kwargs):
        at_first_use()
        return fn(*args, **kwargs)

    return routed  # type: ignore[return-value]


def use_openblas() -> str | None:
    """Route MLX's GEMMs to OpenBLAS where it can; return the library's path (None: not done,
    said once on stderr unless MLXWALK_BLAS=off)."""
    global loaded
    choice = os.environ.get("MLXWALK_BLAS", "")
    if loaded or choice == "off" or not sys.platform.startswith("linux"):
        return loaded
    if choice and not os.path.isfile(choice):
        raise ValueError(
            f"MLXWALK_BLAS={choice!r} is unknown: give off, or the path of an OpenBLAS library"
        )
    import mlx.core as mx

    if mx.default_device().type != mx.cpu:  # a GPU does the work: nothing to route or say
        return None
    library, prefix = (choice, "") if choice else (_wheel_library(), "scipy_")
    if library is None:
        return _not_used("the scipy-openblas32 wheel is not installed")
    written: dict[int, int] = {}  # slot address -> the value it held
    try:
        blas = ctypes.CDLL(library)
        libmlx, base = _mapped("libmlx.so")
        slots = _jump_slots(libmlx, set(GEMMS))
        targets = {
            name: ctypes.cast(getattr(blas, prefix + name), ctypes.c_void_p).value for name in slots
        }
        for name, offset in slots.items():
            written[base + offset] = ctypes.c_void_p.from_address(base + offset).value
            _write_pointer(base + offset, targets[name])
        _check()
    except (OSError, AttributeError, ValueError, struct.error, AssertionError) as e:
        for address, value in written.items():  # all of MLX's GEMMs back where they were
            _write_pointer(address, value)
        return _not_used(f"{library}: {e}")
    loaded = library
    return loaded


def _check() -> None:
    """A product through the new slots against NumPy's (an ILP64 or otherwise foreign BLAS given
    by MLXWALK_BLAS would compute garbage)."""
    import mlx.core as mx
    import numpy as np

    a = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    b = np.arange(20, dtype=np.float32).reshape(4, 5) / 3
    if not np.allclose(np.asarray(mx.array(a) @ mx.array(b)), a @ b, rtol=1e-5, atol=1e-5):
        raise AssertionError("its matrix product disagrees with NumPy's")


def _not_used(why: str) -> None:
    print(
        f"mlxwalk: MLX's CPU matrix products stay on its reference BLAS, 25-50x slower ({why}); "
        "pip install scipy-openblas32, or set MLXWALK_BLAS=off to keep it quietly",
        file=sys.stderr,
    )
    return None


def _wheel_library() -> str | None:
    try:
        import scipy_openblas32
    except ImportError:
        return None
    return os.path.join(os.path.dirname(scipy_openblas32.__file__), "lib", "libscipy_openblas.so")


def _mapped(name: str) -> tuple[str, int]:
    """The path and load address of a shared library mapped into this process."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split()
            if len(parts) >= 6 and parts[5].endswith("/" + name) and int(parts[2], 16) == 0:
                return parts[5], int(parts[0].split("-")[0], 16)
    raise ValueError(f"{name} is not mapped")


def _jump_slots(path: str, names: set[str]) -> dict[str, int]:
    """Offsets (from the load address) of the relocated slots through which `path` calls `names`:
    the r_offset of each Elf64_Rela naming one of them."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:5] != b"\x7fELF\x02" or data[5] != 1:  # 64-bit, little-endian
        raise ValueError(f"{path} is not a 64-bit little-endian ELF")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    # Elf64_Shdr: name, type, flags, addr, offset, size, link, info, addralign, entsize
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)
    ]
    slots = {}
    for sec in sections:
        if sec[1] != SHT_RELA or sec[6] >= shnum:
            continue
        symtab = sections[sec[6]]
        strtab = sections[symtab[6]]
        for at in range(sec[4], sec[4] + sec[5], 24):
            r_offset, r_info = struct.unpack_from("<QQ", data, at)
            (st_name,) = struct.unpack_from("<I", data, symtab[4] + (r_info >> 32) * 24)
            start = strtab[4] + st_name
            name = data[start : data.index(b"\0", start)].decode()
            if name in names:
                slots[name] = r_offset
    if set(slots) != names:
        raise ValueError(f"{path} calls {sorted(names - set(slots))} through no slot")
    return slots


def _write_pointer(address: int, value: int) -> None:
    """Write a function pointer into a slot, opening its page for writing if it is read-only."""
    page = address & ~(os.sysconf("SC_PAGE_SIZE") - 1)
    libc = ctypes.CDLL(None, use_errno=True)
    protected = not _writable(address)
    if protected and libc.mprotect(ctypes.c_void_p(page), 4096, 3) != 0:  # PROT_READ | WRITE
        raise OSError(ctypes.get_errno(), "mprotect")
    ctypes.c_void_p.from_address(address).value = value
    if protected:
        libc.mprotect(ctypes.c_void_p(page), 4096, 1)  # PROT_READ, as the loader left it


def _writable(address: int) -> bool:
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                return perms[1] == "w"
    return False
