"""The tensor-core attention kernels' launches as plain data (`*_tc.cu`): their specs, the sizes
of a call, each launch's grid, block, template, dynamic shared memory, params, scale and output
shapes. tensor_cores.py wraps them for MLX; the torch backend
(mlxwalk/torch_backend/attention_kernels.py) launches the same calls through NVRTC. Nothing here
imports MLX itself (blocks.py and this package's __init__ do: MLX is a dependency on every
platform, its CPU build on Linux). Template dtypes are passed as given: MLX's for MLX, names
("bfloat16") for torch.

Block shapes come from `blocks.CUDA` (reasons there); a call may pass another `CudaBlocks` to try
a shape (scripts/h200-attention.py does). Grids are one axis: blocks of rows fastest, then head,
then batch; the forward and dq take their last query blocks (the longest rows) first."""

from __future__ import annotations

from dataclasses import dataclass

from ..sources import Spec
from . import blocks as tables
from .blocks import CudaBlocks

# The store: a float store's keys and values (passed again in the place of the scales and
# biases, template G = 0), or an 8-bit store's packed words, scales and biases (G their group).
STORE = ("pk", "pv", "pk_scales", "pk_biases", "pv_scales", "pv_biases")
INPUTS = ("q", "k", "v", *STORE, "params", "scale")
BACKWARD_INPUTS = (*INPUTS[:9], "d_out", "lse", "delta", *INPUTS[9:])
TC = {"headers": ("common_tc",), "backends": ("cuda",), "tensor_cores": True}
FORWARD = Spec("attention/forward_tc", INPUTS, ("o", "lse"), **TC)
DQ = Spec("attention/dq_tc", BACKWARD_INPUTS, ("dq",), **TC)
DKDV = Spec("attention/dkdv_tc", BACKWARD_INPUTS, ("dk", "dv"), **TC)
SHARED_MEMORY = 232448  # bytes a block may take on sm_90 (227 KiB)


@dataclass(frozen=True)
class Sizes:
    """A call's sizes: q (B, HQ, L, D), the chunk's own k (B, HKV, L, D), the store
    (BS, HKV, N, D) whose rows [0, start) are the prefix, [grad_from, start) tapped."""

    batch: int
    heads: int
    kv_heads: int
    length: int
    dim: int
    store: int
    store_batch: int
    start: int
    grad_from: int

    @classmethod
    def of(cls, q_shape, k_shape, pk_shape, start: int, grad_from: int) -> Sizes:
        """From the shapes (no store, `pk_shape` None: the chunk's own K/V stand in for an
        empty one, start and grad_from 0)."""
        if pk_shape is None:
            pk_shape, start, grad_from = k_shape, 0, 0
        b, hq, n, dim = q_shape
        return cls(b, hq, k_shape[1], n, dim, pk_shape[2], pk_shape[0], start, grad_from)

    @property
    def taps(self) -> int:
        return self.start - self.grad_from

    @property
    def params(self) -> list[int]:
        """The kernels' `params` buffer (int32): [B, HQ, HKV, L, N, start, grad_from, BS]."""
        heads = [self.batch, self.heads, self.kv_heads, self.length]
        return [*heads, self.store, self.start, self.grad_from, self.store_batch]


@dataclass
class Call:
    """One launch as plain data (its array inputs aside): `grid` counts threads (MLX's
    convention); the inputs are followed by `params` (int32) and `scale` (one float32); the
    outputs are float32 of `output_shapes`."""

    spec: Spec
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    template: list[tuple[str, object]]
    shared_memory: int
    params: list[int]
    scale: float
    output_shapes: list[tuple]


def shape(kernel: str, dim: int, override: CudaBlocks | None = None) -> CudaBlocks:
    """The block shape a kernel runs at `dim`: the table's (head dims between its entries take
    the next larger entry's shape, which fits: shared memory and registers grow with D)."""
    if override is None:
        key = min((d for d in tables.CUDA_DIMS if d >= dim), default=None)
        if key is None:
            raise ValueError(f"no tensor-core attention kernel at head dim {dim}")
        override = tables.CUDA[(kernel, key)]
    b = override
    ok = dim % 16 == 0 and b.walk % 16 == 0 and b.mt >= 1 and b.warps % b.split == 0
    if kernel == "dkdv":
        ok = ok and b.mt == 1 and b.split in (1, 2) and (b.walk // b.split) % 16 == 0
        ok = ok and (dim // b.split) % 16 == 0
    else:
        ok = ok and b.split == 1
    if not ok:
        raise ValueError(f"{kernel} at head dim {dim}: no kernel for {b}")
    return b


def _call(spec, kernel, s: Sizes, dtype, store_dtype, scale, shapes, rows, heads, override, group):
    """A launch of `kernel` over `rows` rows of each of `heads` heads."""
    b = shape(kernel, s.dim, override)
    groups = -(-rows // b.rows) * heads
    if kernel == "dkdv":
        extra = [("NW", b.warps), ("BM", b.walk), ("SPLIT", b.split), ("KREG", b.regs)]
    else:
        extra = [("MT", b.mt), ("NW", b.warps), ("BN", b.walk), ("QREG", b.regs)]
    smem = tables.cuda_shared_bytes(kernel, s.dim, b)
    if smem > SHARED_MEMORY:
        raise ValueError(f"{kernel} at head dim {s.dim}: {smem} bytes of shared memory for {b}")
    template = [("T", dtype), ("S", store_dtype), ("D", s.dim), ("G", group), *extra]
    grid, block = (groups * b.threads, 1, 1), (b.threads, 1, 1)
    return Call(spec, grid, block, template, smem, s.params, scale, shapes)


def forward_call(s: Sizes, dtype, store_dtype, scale: float, blocks=None, group: int = 0) -> Call:
    """The forward (s.grad_from unused): o (B, HQ, L, D) and lse (B, HQ, L), float32.
    `store_dtype`: a float store's, or an 8-bit store's scales' with `group` its group size."""
    shapes = [(s.batch, s.heads, s.length, s.dim), (s.batch, s.heads, s.length)]
    heads = s.batch * s.heads
    return _call(
        FORWARD, "forward", s, dtype, store_dtype, scale, shapes, s.length, heads, blocks, group
    )


def backward_calls(
    s: Sizes, dtype, store_dtype, scale: float, blocks=None, group: int = 0
) -> tuple[Call, Call]:
    """(dq's call, dkdv's call): dq (B, HQ, L, D); dk, dv (B, HKV, taps + L, D), the taps
    [grad_from, start) first. `blocks`: {"dq": CudaBlocks, "dkdv": CudaBlocks} to override;
    `store_dtype`, `group` as forward_call's."""
    blocks = blocks or {}
    t, st, g = dtype, store_dtype, group
    q_rows = (s.batch, s.heads, s.length, s.dim)
    heads = s.batch * s.heads
    dq = _call(DQ, "dq", s, t, st, scale, [q_rows], s.length, heads, blocks.get("dq"), g)
    rows = (s.batch, s.kv_heads, s.taps + s.length, s.dim)
    dkdv = _call(
        DKDV,
        "dkdv",
        s,
        t,
        st,
        scale,
        [rows, rows],
        s.taps + s.length,
        s.batch * s.kv_heads,
        blocks.get("dkdv"),
        g,
    )
    return dq, dkdv
