"""The gated delta rule on its chunked kernels (metal_kernels/delta/chunked.py: FLA's
decomposition on the matrix units, forward and backward), and where they run: self-checked per
case (a layer's dtype, heads and dim) against the ops twin (chunk.py's `gated_delta`) on a small
case, every gradient included; on Metal raced against the ops at first use; on CUDA where measured
faster (`CUDA_CHUNKED`) or with MLXWALK_KERNELS=on."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from metal_kernels.delta import chunked

from .. import routing

# The input dtypes for which `auto` on CUDA takes the kernels: on the H200 one Qwen3.5 layer's
# forward+backward in bf16 took 5.6 / 17.3 / 49.4 ms at 4K / 16K / 64K against the ops' 37 / 120 /
# 434 (docs/BENCHMARKS.md); float32 (float32 FMA in the same tiles) was not timed: the ops keep it.
CUDA_CHUNKED = (mx.bfloat16, mx.float16)


def case_of(q: mx.array, v: mx.array) -> routing.ChunkedDeltaCase | None:
    b = routing.backend()
    if b is None or routing.mode() == "off":
        return None
    return routing.ChunkedDeltaCase(b, q.dtype, q.shape[-2], v.shape[-2], q.shape[-1])


def use(q: mx.array, k: mx.array, v: mx.array, twin) -> bool:
    """Whether this layer's gated delta rule runs on the chunked kernels, checked (and on Metal
    raced) against `twin`, the ops' `gated_delta`."""
    case = case_of(q, v)
    if case is None or not chunked.supports(q, k, v, case.backend):
        return False
    if case.backend == "cuda" and case.dtype not in CUDA_CHUNKED and not routing.forced():
        return False
    return routing.decide(
        case, lambda c: kernel_vs_twin(c, twin), lambda c, size: race(c, size, twin)
    )


def op():
    """The kernels' `gated_delta(q, k, v, log_g, beta, state)`, launched through routing's
    launcher (the CPU harness in the tests)."""
    return chunked.op(run=routing.launch, backend=routing.backend())


def layer(dtype: mx.Dtype, hk: int, hv: int, dk: int, dv: int, t: int) -> tuple[list, list]:
    """A gated delta-net layer's inputs and cotangents for a self-check or a race: t positions,
    hk key and hv value heads, a non-zero initial state, seeded."""
    rng = np.random.default_rng(0)

    def normal(*shape, scale=1.0):
        return mx.array((scale * rng.standard_normal(shape)).astype(np.float32))

    x = [
        normal(1, t, hk, dk, scale=0.3).astype(dtype),
        normal(1, t, hk, dk, scale=0.3).astype(dtype),
        normal(1, t, hv, dv).astype(dtype),
        -mx.array(rng.uniform(0.01, 0.3, (1, t, hv)).astype(np.float32)),
        mx.array(rng.uniform(0.1, 0.9, (1, t, hv)).astype(np.float32)),
        normal(1, hv, dv, dk, scale=0.5),
    ]
    cots = [normal(1, t, hv, dv).astype(dtype), normal(1, hv, dv, dk)]
    return x, cots


def _layer(case: routing.ChunkedDeltaCase, t: int) -> tuple[list, list]:
    return layer(case.dtype, case.key_heads, case.value_heads, case.dim, case.dim, t)


def kernel_vs_twin(case: routing.ChunkedDeltaCase, twin) -> dict[str, float]:
    """The self-check: values, the final state and every gradient, kernels against the ops'
    `twin`, on two chunks and a part (T = 150)."""
    x, cots = _layer(case, 150)
    got = mx.vjp(op(), x, cots)
    want = mx.vjp(twin, x, cots)
    pairs = zip([*got[0], *got[1]], [*want[0], *want[1]])
    return {"delta/chunked": max(routing.relative_error(a, b) for a, b in pairs)}


def race(case: routing.ChunkedDeltaCase, size: tuple[int, int], twin) -> tuple[float, float]:
    """Seconds for a layer's forward and backward over size[0] positions: kernels, then ops."""
    x, cots = _layer(case, size[0])
    kernels_s, ops_s = (
        routing.seconds(lambda f=f: mx.eval(mx.vjp(f, x, cots))) for f in (op(), twin)
    )
    return kernels_s, ops_s


def guarded(case: routing.ChunkedDeltaCase, q: mx.array, v: mx.array, twin):
    """The kernels' gated delta rule (op()'s pair, forward and backward), each falling back to
    the ops' `twin` where it fails (routing.guard)."""
    run, where = routing.launch, routing.backend()
    size = f"{q.shape[1]} positions, batch {q.shape[0]}, {v.shape[-2]} value heads"

    @mx.custom_function
    def kernels(*x):
        return routing.guard(
            case,
            "delta/chunked",
            size,
            lambda: chunked.forward(*x, run=run, backend=where),
            lambda: twin(*x),
        )

    @kernels.vjp
    def _kernels_vjp(primals, cotangents, outputs):
        return routing.guard(
            case,
            "delta/chunked backward",
            size,
            lambda: chunked.backward(*primals, *cotangents, run=run, backend=where),
            lambda: tuple(mx.vjp(twin, list(primals), list(cotangents))[1]),
        )

    return kernels
