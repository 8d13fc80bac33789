"""The CUDA tensor-core attention kernels' launches (`*_tc.cu`, float16/bfloat16 inputs) for MLX:
FlashAttention-2's forward, dQ and dK/dV passes on mma.sync.m16n8k16, with the contract of
metal_kernels/attention (the same inputs, float32 outputs, dK/dV rows of the taps then the own).
The launches themselves (grid, block, template, shared memory, params, outputs) are tc_calls.py's
plain data, shared with the torch backend; this module adds MLX's arrays. Block shapes come from
`blocks.CUDA` (reasons there); a call may pass another `CudaBlocks` to try a shape
(scripts/h200-attention.py does)."""

from __future__ import annotations

import mlx.core as mx

from ..build import Launch
from .blocks import CudaBlocks
from .tc_calls import (  # noqa: F401 (this module's public names before tc_calls existed)
    BACKWARD_INPUTS,
    DKDV,
    DQ,
    FORWARD,
    INPUTS,
    SHARED_MEMORY,
    TC,
    Call,
    Sizes,
    backward_calls,
    forward_call,
    shape,
)


def _sizes(q, k, pk, start: int, grad_from: int) -> Sizes:
    return Sizes.of(q.shape, k.shape, None if pk is None else pk.shape, start, grad_from)


def _arrays(q, k, v, pk, pv) -> tuple[list[mx.array], mx.Dtype, int]:
    """(the array inputs, the template's S and G): no prefix, the chunk's own K/V stand in for an
    empty store; an 8-bit store (`Q8`) passes its triples."""
    from . import store_inputs  # (this package's __init__ imports this module)

    if pk is None:
        pk, pv = k, v
    store, dtype, group = store_inputs(pk, pv)
    return [q, k, v, *store], dtype, group


def launch_of(call: Call, inputs: list[mx.array]) -> Launch:
    """A plain call (tc_calls) as MLX's launch on `inputs`, its params and scale appended."""
    extra = [mx.array(call.params, mx.int32), mx.array([call.scale], mx.float32)]
    return Launch(
        call.spec,
        inputs + extra,
        call.output_shapes,
        [mx.float32] * len(call.output_shapes),
        call.grid,
        call.threadgroup,
        call.template,
        call.shared_memory,
    )


def forward_launch(q, k, v, pk, pv, start: int, scale: float, blocks=None) -> Launch:
    """The forward: o (B, HQ, L, D) and lse (B, HQ, L), float32."""
    arrays, dtype, group = _arrays(q, k, v, pk, pv)
    call = forward_call(_sizes(q, k, pk, start, start), q.dtype, dtype, scale, blocks, group)
    return launch_of(call, arrays)


def backward_launches(
    q, k, v, pk, pv, start, grad_from, scale, lse, delta, d_out, blocks=None
) -> tuple[Launch, Launch]:
    """(dq's launch, dkdv's launch): dq (B, HQ, L, D); dk, dv (B, HKV, taps + L, D), the taps
    [grad_from, start) first. `blocks`: {"dq": CudaBlocks, "dkdv": CudaBlocks} to override."""
    arrays, dtype, group = _arrays(q, k, v, pk, pv)
    arrays += [d_out, lse, delta]
    s = _sizes(q, k, pk, start, grad_from)
    dq, dkdv = backward_calls(s, q.dtype, dtype, scale, blocks, group)
    return launch_of(dq, arrays), launch_of(dkdv, arrays)


__all__ = ["CudaBlocks", "backward_launches", "forward_launch", "launch_of", "shape"]
