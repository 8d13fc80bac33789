"""The CUDA tensor-core attention kernels' launches (`*_tc.cu`, float16/bfloat16 inputs):
FlashAttention-2's forward, dQ and dK/dV passes on mma.sync.m16n8k16, with the contract of
metal_kernels/attention (the same inputs, float32 outputs, dK/dV rows of the taps then the own).
Block shapes come from `blocks.CUDA` (reasons there); a call may pass another `CudaBlocks` to try
a shape (scripts/h200-attention.py does). Grids are one axis: blocks of rows fastest, then head,
then batch; the forward and dq take their last query blocks (the longest rows) first."""

from __future__ import annotations

import mlx.core as mx

from ..build import Launch, Spec
from . import blocks as tables
from .blocks import CudaBlocks

INPUTS = ("q", "k", "v", "pk", "pv", "params", "scale")
BACKWARD_INPUTS = (*INPUTS[:5], "d_out", "lse", "delta", *INPUTS[5:])
TC = {"headers": ("common_tc",), "backends": ("cuda",), "tensor_cores": True}
FORWARD = Spec("attention/forward_tc", INPUTS, ("o", "lse"), **TC)
DQ = Spec("attention/dq_tc", BACKWARD_INPUTS, ("dq",), **TC)
DKDV = Spec("attention/dkdv_tc", BACKWARD_INPUTS, ("dk", "dv"), **TC)
SHARED_MEMORY = 232448  # bytes a block may take on sm_90 (227 KiB)


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


def _common(q, k, v, pk, pv, start, grad_from, scale):
    """Inputs (no prefix: the chunk's own K/V stand in for an empty store) and T, S, D."""
    if pk is None:
        pk, pv, start, grad_from = k, v, 0, 0
    b, hq, n, dim = q.shape
    params = [b, hq, k.shape[1], n, pk.shape[2], start, grad_from, pk.shape[0]]
    extra = [mx.array(params, mx.int32), mx.array([scale], mx.float32)]
    template = [("T", q.dtype), ("S", pk.dtype), ("D", dim)]
    return [q, k, v, pk, pv], extra, template, start - grad_from


def _launch(spec, kernel, inputs, shapes, rows, heads, dim, template, override) -> Launch:
    b = shape(kernel, dim, override)
    blocks = -(-rows // b.rows) * heads
    if kernel == "dkdv":
        extra = [("NW", b.warps), ("BM", b.walk), ("SPLIT", b.split), ("KREG", b.regs)]
    else:
        extra = [("MT", b.mt), ("NW", b.warps), ("BN", b.walk), ("QREG", b.regs)]
    smem = tables.cuda_shared_bytes(kernel, dim, b)
    if smem > SHARED_MEMORY:
        raise ValueError(f"{kernel} at head dim {dim}: {smem} bytes of shared memory for {b}")
    return Launch(
        spec,
        inputs,
        shapes,
        [mx.float32] * len(shapes),
        (blocks * b.threads, 1, 1),
        (b.threads, 1, 1),
        template + extra,
        smem,
    )


def forward_launch(q, k, v, pk, pv, start: int, scale: float, blocks=None) -> Launch:
    """The forward: o (B, HQ, L, D) and lse (B, HQ, L), float32."""
    inputs, extra, template, _ = _common(q, k, v, pk, pv, start, start, scale)
    b, hq, n, dim = q.shape
    return _launch(
        FORWARD, "forward", inputs + extra, [q.shape, (b, hq, n)], n, b * hq, dim, template, blocks
    )


def backward_launches(
    q, k, v, pk, pv, start, grad_from, scale, lse, delta, d_out, blocks=None
) -> tuple[Launch, Launch]:
    """(dq's launch, dkdv's launch): dq (B, HQ, L, D); dk, dv (B, HKV, taps + L, D), the taps
    [grad_from, start) first. `blocks`: {"dq": CudaBlocks, "dkdv": CudaBlocks} to override."""
    inputs, extra, template, taps = _common(q, k, v, pk, pv, start, grad_from, scale)
    inputs = inputs + [d_out, lse, delta] + extra
    b, hq, n, dim = q.shape
    hkv = k.shape[1]
    blocks = blocks or {}
    dq = _launch(DQ, "dq", inputs, [q.shape], n, b * hq, dim, template, blocks.get("dq"))
    rows = (b, hkv, taps + n, dim)
    dkdv = _launch(
        DKDV, "dkdv", inputs, [rows, rows], taps + n, b * hkv, dim, template, blocks.get("dkdv")
    )
    return dq, dkdv
