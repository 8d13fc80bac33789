"""The chunked delta rule's kernels as plain data, without MLX: their specs, the sizes of a call,
each launch's geometry per backend, its params and its output buffers' shapes, and the shapes and
dtypes the kernels take. chunked.py launches them through MLX (its docstring tells the pipeline);
the torch backend (mlxwalk/torch_backend/delta_kernels.py) through torch, from the same data.
Dtypes go by name ("float32", "bfloat16", "float16"), or as MLX's or torch's (sources.dtype_name).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..sources import ROOT, Spec, dtype_name
from . import blocks

CHUNK = blocks.CHUNK
FLOATS = ("float32", "float16", "bfloat16")


def _spec(stem: str, inputs: tuple[str, ...], outputs: tuple[str, ...]) -> Spec:
    """A kernel of this pipeline, with the backends it has a source for (`.metal`, `.cu`)."""
    found = tuple(
        b for b, ext in (("metal", ".metal"), ("cuda", ".cu")) if (ROOT / (stem + ext)).exists()
    )
    return Spec(stem, inputs, outputs, headers=("tiles",), backends=found, tensor_cores=True)


PREPARE = _spec("delta/prepare", ("k", "v", "log_g", "beta", "params"), ("cum", "w", "u", "tri"))
STATES = _spec(
    "delta/states", ("k", "w", "u", "cum", "state", "params"), ("h", "v_new", "final_state")
)
OUTPUT = _spec("delta/output", ("q", "k", "cum", "h", "v_new", "params"), ("y",))
STATES_BACK = _spec(
    "delta/states_back",
    ("q", "k", "w", "cum", "d_out", "d_final", "params"),
    ("dh", "dv_new", "d_state"),
)
GRADS = _spec(
    "delta/grads",
    ("q", "k", "cum", "h", "v_new", "dh", "dv_new", "d_out", "params"),
    ("dq", "dk", "dw", "dcum"),
)
PREPARE_BACK = _spec(
    "delta/prepare_back",
    ("k", "v", "beta", "cum", "tri", "dw", "dv_new", "dk_in", "dcum", "params"),
    ("dk", "dv", "dlog_g", "dbeta"),
)
SPECS = dict(zip(blocks.KERNELS, (PREPARE, STATES, OUTPUT, STATES_BACK, GRADS, PREPARE_BACK)))


@dataclass(frozen=True)
class Sizes:
    batch: int
    length: int
    key_heads: int
    value_heads: int
    dk: int
    dv: int

    @classmethod
    def of(cls, q, v) -> Sizes:
        """From q (B, L, HK, DK) and v (B, L, HV, DV): any arrays with a shape."""
        b, t, hk, dk = q.shape
        return cls(b, t, hk, v.shape[2], dk, v.shape[3])

    @property
    def chunks(self) -> int:
        return -(-self.length // CHUNK)

    @property
    def padded(self) -> int:
        return self.chunks * CHUNK


@dataclass
class Geometry:
    """A launch's grid, threadgroup (block) and block template; `key_blocks`: grads's blocks of
    key columns (the partials of dcum); `shared_memory`: dynamic shared memory (CUDA)."""

    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    template: list[tuple[str, object]] = field(default_factory=list)
    key_blocks: int = 1
    shared_memory: int = 0


def metal_geometry(kernel: str, s: Sizes, dtype) -> Geometry:
    """The Metal bodies' geometry: blocks.METAL's shape for (kernel, head dim, dtype); one grid
    axis, the threadgroup index split by the body (see each kernel's header)."""
    g = blocks.metal(kernel, s.dk, dtype)
    b, n, key_blocks = s.batch, s.chunks, 1
    if kernel in ("states", "states_back"):  # (b, value head, value block)
        groups = b * s.value_heads * (s.dv // g["BV"])
    elif kernel == "grads":  # (b, key head, chunk, key block)
        key_blocks = s.dk // g["KB"]
        groups = b * s.key_heads * n * key_blocks
    else:  # (b, key head, chunk)
        groups = b * s.key_heads * n
    return Geometry((groups * g.threads, 1, 1), (g.threads, 1, 1), list(g.template), key_blocks)


def cuda_geometry(kernel: str, s: Sizes, dtype) -> Geometry:
    """The CUDA bodies' geometry: blocks.CUDA's shape for (kernel, head dim, dtype), one grid
    axis (MLX's grid counts threads), the block index split by the body as the Metal one's but
    for prepare and output, which take a block per value head (and output per BV value columns):
      prepare                  (b, value head, chunk)
      states, states_back      (b, value head, value block)
      output                   (b, value head, chunk, value block)
      grads                    (b, key head, chunk, key block)
      prepare_back             (b, key head, chunk)
    Dynamic shared memory from blocks.cuda_shared_bytes, passed to the body as SMEM too."""
    g = blocks.cuda(kernel, s.dk, dtype)
    b, n, key_blocks = s.batch, s.chunks, 1
    scan = kernel in ("states", "states_back")
    if g.warps != (g["BV"] // 16 * g["DKS"] if scan else 4):  # the bodies' own warp counts
        raise ValueError(f"delta/{kernel}: {g.warps} warps do not fit its blocks {g.template}")
    if scan:
        groups = b * s.value_heads * (s.dv // g["BV"])
    elif kernel == "output":
        groups = b * s.value_heads * n * (s.dv // g["BV"])
    elif kernel == "grads":
        key_blocks = s.dk // g["KB"]
        groups = b * s.key_heads * n * key_blocks
    elif kernel == "prepare":
        groups = b * s.value_heads * n
    else:
        groups = b * s.key_heads * n
    smem = blocks.cuda_shared_bytes(kernel, s.dk, s.dv, dtype, g)
    template = [*g.template, ("SMEM", smem)]
    return Geometry((groups * g.threads, 1, 1), (g.threads, 1, 1), template, key_blocks, smem)


GEOMETRY: dict[str, Callable[[str, Sizes, object], Geometry]] = {
    "metal": metal_geometry,
    "cuda": cuda_geometry,
}


def takes(q_shape, k_shape, v_shape, dtypes, backend: str) -> bool:
    """The shapes and dtypes these kernels take: DK = DV of the backend's table (Metal: 64, 128;
    CUDA: 64, 128), value heads a multiple of key heads, q, k, v of one floating dtype
    (`dtypes`: q's, k's and v's)."""
    dims = {"metal": blocks.METAL_DIMS, "cuda": blocks.CUDA_DIMS}.get(backend, ())
    names = {dtype_name(d) for d in dtypes}
    return (
        tuple(q_shape) == tuple(k_shape)
        and q_shape[-1] == v_shape[-1]
        and q_shape[-1] in dims
        and v_shape[2] % q_shape[2] == 0
        and len(names) == 1
        and names <= set(FLOATS)
    )


def params(s: Sizes, key_blocks: int) -> list[int]:
    """Every kernel's `params` buffer (int32): [B, L, HK, HV, N, KB]."""
    return [s.batch, s.length, s.key_heads, s.value_heads, s.chunks, key_blocks]


def output_shapes(kernel: str, s: Sizes, key_blocks: int = 1, keep: bool = True) -> list[tuple]:
    """The shapes of a kernel's outputs (all float32), in its spec's order; `key_blocks`: grads's
    partials of dcum (its geometry's); `keep`: prepare writes T (else a placeholder of one)."""
    b, t, hk, hv, n, np_ = s.batch, s.length, s.key_heads, s.value_heads, s.chunks, s.padded
    states = [(b, n, hv, s.dv, s.dk), (b, hv, np_, s.dv), (b, hv, s.dv, s.dk)]
    return {
        "prepare": lambda: [
            (b, hv, np_),
            (b, hv, np_, s.dk),
            (b, hv, np_, s.dv),
            (b, hv, n, CHUNK, CHUNK) if keep else (1,),
        ],
        "states": lambda: states,
        "output": lambda: [(b, t, hv, s.dv)],
        "states_back": lambda: states,
        "grads": lambda: [
            (b, t, hk, s.dk),
            (b, t, hk, s.dk),
            (b, hv, np_, s.dk),
            (b, hv, key_blocks, np_),
        ],
        "prepare_back": lambda: [(b, t, hk, s.dk), (b, t, hv, s.dv), (b, t, hv), (b, t, hv)],
    }[kernel]()


@dataclass
class Call:
    """One launch of a kernel as plain data (its inputs aside): what MLX's `Launch` and the
    torch driver are built from. `grid` counts threads (MLX's convention), `params` is the
    params buffer's values, the outputs are float32 of `output_shapes`."""

    spec: Spec
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    template: list[tuple[str, object]]
    shared_memory: int
    params: list[int]
    output_shapes: list[tuple]


def call(
    kernel: str, s: Sizes, dtype, backend: str, keep: bool = True, key_blocks: int | None = None
) -> Call:
    """A kernel's launch on `backend`'s geometry, its template T the inputs' `dtype` (as given:
    MLX's for MLX). `keep`: prepare's KEEP; `key_blocks`: params' KB where it is an input's
    (prepare_back's dcum), not this launch's geometry's."""
    if backend not in GEOMETRY:
        raise RuntimeError(f"delta/{kernel}: no geometry for backend {backend!r}")
    geo = GEOMETRY[backend](kernel, s, dtype)
    kb = geo.key_blocks if key_blocks is None else key_blocks
    extra = (("KEEP", keep),) if kernel == "prepare" else ()
    template = [("T", dtype), ("DK", s.dk), ("DV", s.dv), *geo.template, *extra]
    return Call(
        SPECS[kernel],
        geo.grid,
        geo.threadgroup,
        template,
        geo.shared_memory,
        params(s, kb),
        output_shapes(kernel, s, geo.key_blocks, keep),
    )
