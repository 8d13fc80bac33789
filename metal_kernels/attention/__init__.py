"""How the chunk-attention kernels are called.

A chunk's L queries attend to the cached prefix [0, start), read in place from the walk's K/V
store (a float one, or the 8-bit one as `Q8`: each element dequantized as it is read, as
mx.dequantize computes it), then causally to the chunk's own L keys. Three kernels,
FlashAttention-2's split without atomics (Apple GPUs emulate float atomics):
  forward: the output and the log-sum-exp per query row;
  dq:      dQ per query row, scores recomputed from the log-sum-exp, delta = rowsum(dO * O);
  dkdv:    dK/dV per key row, for the tapped prefix [grad_from, start) and the chunk's own keys
           only (the fixed prefix takes no gradient), summed over the grouped query heads.
Accumulation is float32 whatever the inputs' dtype; outputs are float32.

The Metal bodies run on Apple's 8x8 simdgroup matrices, in blocks of rows per threadgroup
(`blocks.py` says which and why); their CUDA twins (`*.cu`) share their contract and math but not
their design: scalar, one warp per row, with their own geometry (`backend="cuda"`). On CUDA,
float16/bfloat16 inputs take tensor-core variants instead (`*_tc.cu`, CUDA only: FlashAttention-2
on mma.sync with ldmatrix and cp.async, float32 softmax and accumulators in registers, the same
contract; launched by `tensor_cores.py` with the block shapes of `blocks.CUDA`). A CUDA timing
says nothing about a Metal body's speed (each `.cu` header says what it shares).
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from ..build import Launch, Spec, current_backend, launch
from . import blocks
from . import tensor_cores as tc_launches  # (the name `tensor_cores` is the function below)

Runner = Callable[[Launch], list[mx.array]]

ROWS = 4  # the scalar CUDA kernels' rows (warps of 32 threads) per block
DIMS = tuple(range(32, 257, 32))  # head dims the CUDA kernels take: D / 32 per lane
METAL_DIMS = blocks.METAL_DIMS  # head dims the Metal kernels take: those of the block table
# The store: pk, pv a float store's keys and values, or an 8-bit store's packed words with its
# scales and biases (`Q8`); a float store passes itself in their place (template G = 0).
STORE = ("pk", "pv", "pk_scales", "pk_biases", "pv_scales", "pv_biases")
INPUTS = ("q", "k", "v", *STORE, "params", "scale")
FORWARD = Spec("attention/forward", INPUTS, ("o", "lse"))
DQ = Spec("attention/dq", (*INPUTS[:9], "d_out", "lse", "delta", *INPUTS[9:]), ("dq",))
DKDV = Spec("attention/dkdv", DQ.inputs, ("dk", "dv"))
FORWARD_TC, DQ_TC, DKDV_TC = tc_launches.FORWARD, tc_launches.DQ, tc_launches.DKDV


class Q8:
    """One layer's keys or values in an 8-bit store, as mlx-lm's quantized cache keeps them and
    the kernels read them in place: `mx.quantize(x, group_size=g, bits=8)`'s triple, `packed`
    (BS, H, N, D / 4) uint32 (four elements a word, the first in the low byte), `scales` and
    `biases` (BS, H, N, D / g) in the model's dtype; an element is scale * q + bias (MLX's affine
    quantization). Indexing takes the same rows and heads of all three (a launch per head group).
    `dtype` is the packed words' (what `supports` and the self-check key an 8-bit store by)."""

    dtype = mx.uint32

    def __init__(self, packed: mx.array, scales: mx.array, biases: mx.array):
        self.packed, self.scales, self.biases = packed, scales, biases

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(BS, H, N, D): the dequantized store's."""
        *rows, words = self.packed.shape
        return (*rows, words * 4)

    @property
    def group(self) -> int:
        return self.shape[-1] // self.scales.shape[-1]

    def __getitem__(self, index) -> Q8:
        return Q8(self.packed[index], self.scales[index], self.biases[index])


def store_inputs(pk, pv) -> tuple[list, mx.Dtype, int]:
    """(the kernels' STORE inputs, the template's S, G): a float store's arrays in the place of
    the scales and biases it has not (G = 0), or an 8-bit store's triples (S their dtype, G
    their group size)."""
    if isinstance(pk, Q8):
        arrays = [pk.packed, pv.packed, pk.scales, pk.biases, pv.scales, pv.biases]
        return arrays, pk.scales.dtype, pk.group
    return [pk, pv, pk, pk, pv, pv], pk.dtype, 0


def supports(
    q: mx.array, k: mx.array, v: mx.array, store_dtype: mx.Dtype | None, backend: str | None = None
) -> bool:
    """The shapes and dtypes these kernels take (not values of another head dim than the keys',
    for one); `store_dtype` a float store's dtype or `Q8.dtype` for an 8-bit store (its groups
    divide the head dim: mlx-lm's take 64 or 32); `backend`: the one they would run on (default:
    MLX's; Metal's head dims are those of its block table)."""
    floats = (mx.float32, mx.float16, mx.bfloat16, Q8.dtype)
    hq, hkv, dim = q.shape[1], k.shape[1], q.shape[-1]
    return (
        dim in (DIMS if _cuda(backend) else METAL_DIMS)
        and k.shape[-1] == dim
        and v.shape[-1] == dim
        and hq % hkv == 0
        and q.dtype in floats
        and k.dtype == q.dtype
        and (store_dtype is None or store_dtype in floats)
    )


def tensor_cores(q: mx.array, backend: str | None) -> bool:
    """Whether the tensor-core variants run: on CUDA, for float16 and bfloat16 inputs."""
    return backend == "cuda" and q.dtype in (mx.float16, mx.bfloat16)


def _common(q, k, v, pk, pv, start, grad_from, scale):
    """Inputs (no prefix: the chunk's own K/V stand in for an empty store) and template."""
    if pk is None:
        pk, pv, start, grad_from = k, v, 0, 0
    b, hq, n, dim = q.shape
    params = [b, hq, k.shape[1], n, pk.shape[2], start, grad_from, pk.shape[0]]
    store, dtype, group = store_inputs(pk, pv)
    inputs = [q, k, v, *store]
    extra = [mx.array(params, mx.int32), mx.array([scale], mx.float32)]
    template = [("T", q.dtype), ("S", dtype), ("D", dim), ("G", group)]
    return inputs, extra, template, start - grad_from


def _cuda(backend: str | None) -> bool:
    """Whether a launch is for CUDA: `backend`, else the one MLX runs on (without a GPU, Metal's:
    the CPU harness runs the Metal bodies)."""
    return (backend or current_backend()) == "cuda"


def _grid(rows: int) -> dict:
    """The scalar CUDA kernels' grid: ROWS rows per block, one warp each."""
    groups = -(-rows // ROWS)
    return {"grid": (groups * 32 * ROWS, 1, 1), "threadgroup": (32 * ROWS, 1, 1)}


def _metal(kind: str, dtype: mx.Dtype, dim: int, rows: int, heads: int) -> dict:
    """A Metal kernel's grid, threadgroup and block template: threadgroups of `blocks.metal`'s
    rows over `rows` rows of each of `heads` heads, one grid axis (block fastest, then head)."""
    g = blocks.metal(kind, dim, dtype)
    groups = -(-rows // g.rows) * heads
    names = ("BQ", "BK") if kind != "dkdv" else ("BK", "BQ")  # the rows owned, the rows walked
    template = [(names[0], g.rows), (names[1], g.walk), ("PAD", g.pad), ("SPLIT", g.split)]
    return {
        "grid": (groups * g.threads, 1, 1),
        "threadgroup": (g.threads, 1, 1),
        "template": template,
    }


def forward_launch(
    q, k, v, pk, pv, start: int, scale: float, tc: bool = False, backend: str | None = None
) -> Launch:
    """`backend`: the geometry's (default: MLX's; see `_cuda`)."""
    inputs, extra, template, _ = _common(q, k, v, pk, pv, start, start, scale)
    b, hq, n, dim = q.shape
    shapes, dtypes = [q.shape, (b, hq, n)], [mx.float32] * 2
    if tc:
        return tc_launches.forward_launch(q, k, v, pk, pv, start, scale)
    if _cuda(backend):
        return Launch(
            FORWARD,
            inputs + extra,
            shapes,
            dtypes,
            template=template + [("ROWS", ROWS)],
            **_grid(b * hq * n),
        )
    g = _metal("forward", q.dtype, dim, n, b * hq)
    return Launch(
        FORWARD,
        inputs + extra,
        shapes,
        dtypes,
        g["grid"],
        g["threadgroup"],
        template + g["template"],
    )


def backward_launches(
    q, k, v, pk, pv, start, grad_from, scale, lse, delta, d_out, tc=False, backend=None
):
    """(dq's launch, dkdv's launch); dkdv's rows are the taps [grad_from, start) then the own
    (the tensor-core kernel's padded to whole blocks). `backend` as forward_launch's."""
    inputs, extra, template, taps = _common(q, k, v, pk, pv, start, grad_from, scale)
    inputs = inputs + [d_out, lse, delta] + extra
    b, hq, n, dim = q.shape
    hkv = k.shape[1]
    if tc:
        return tc_launches.backward_launches(
            q, k, v, pk, pv, start, grad_from, scale, lse, delta, d_out
        )
    rows = (b, hkv, taps + n, dim)
    if _cuda(backend):
        scalar = template + [("ROWS", ROWS)]
        dq = Launch(DQ, inputs, [q.shape], [mx.float32], template=scalar, **_grid(b * hq * n))
        dkdv = Launch(
            DKDV,
            inputs,
            [rows, rows],
            [mx.float32] * 2,
            template=scalar,
            **_grid(b * hkv * (taps + n)),
        )
        return dq, dkdv
    g = _metal("dq", q.dtype, dim, n, b * hq)
    dq = Launch(
        DQ, inputs, [q.shape], [mx.float32], g["grid"], g["threadgroup"], template + g["template"]
    )
    g = _metal("dkdv", q.dtype, dim, taps + n, b * hkv)
    dkdv = Launch(
        DKDV,
        inputs,
        [rows, rows],
        [mx.float32] * 2,
        g["grid"],
        g["threadgroup"],
        template + g["template"],
    )
    return dq, dkdv


def forward(
    q,
    k,
    v,
    pk,
    pv,
    start: int,
    scale: float,
    run: Runner = launch,
    tc: bool = False,
    backend: str | None = None,
):
    """(o, lse), both float32: o (B, HQ, L, D), lse (B, HQ, L). `run` launches a call (on the
    GPU by default; the CPU harness in tests); `tc`: the tensor-core variant."""
    return run(forward_launch(q, k, v, pk, pv, start, scale, tc, backend))


def backward(
    q, k, v, pk, pv, start, grad_from, scale, o, lse, d_out, run=launch, tc=False, backend=None
):
    """(dq, dk, dv) in float32; dk and dv (B, HKV, start - grad_from + L, D), taps first."""
    delta = (d_out.astype(mx.float32) * o.astype(mx.float32)).sum(axis=-1)  # (B, HQ, L)
    calls = backward_launches(
        q, k, v, pk, pv, start, grad_from, scale, lse, delta, d_out, tc, backend
    )
    rows = (start - grad_from if pk is not None else 0) + q.shape[2]  # past them: padding
    dk, dv = run(calls[1])
    return run(calls[0])[0], dk[:, :, :rows], dv[:, :, :rows]
