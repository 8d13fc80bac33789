"""The chunked gated delta rule as a pipeline of kernels, forward and backward.

Per value head h (key head h // (HV / HK)), with S the (DV x DK) float32 state, gates
g_t = exp(log_g_t) and write strengths beta_t:
    S_t = g_t S_{t-1} + beta_t (v_t - g_t S_{t-1} k_t) k_t^T,    o_t = S_t q_t.
The sequence is cut into chunks of CHUNK = 64 positions (the last one padded: k = v = beta =
log_g = 0). FLA's decomposition (flash-linear-attention's chunk_gated_delta_rule), one kernel each:
  prepare      (chunks x heads) cum = the cumulative log gate per chunk (gamma = exp(cum)),
               A_ij = beta_i (gamma_i / gamma_j) k_i.k_j (j < i), T = (I + A)^-1,
               w = T diag(beta gamma) K, u = T diag(beta) V; T itself for the backward;
  states       (sequential, per value block) h_c = the state entering chunk c,
               v_new = u - w S^T, S <- gamma_C S + (K diag(gamma_C / gamma))^T v_new;
  output       (chunks x heads) O = diag(gamma) Q h_c^T + (Q K^T (.) decay, causal) v_new;
  states_back  (reverse, per value block) dh_c = the adjoint of the state leaving chunk c,
               dv_new = (Q K^T (.) decay)^T dO + diag(gamma_C / gamma) K dh_c^T, the state's
               adjoint carried back (gamma_C dh + dO^T diag(gamma) Q - dv_new^T w), the initial
               state's at the end;
  grads        (chunks x heads x key blocks) dq, dk (the output's and the state update's
               parts), dw = -dv_new h_c, and d cum's parts q.dq - k.dk (and the chunk end's);
  prepare_back (chunks x heads) the WY backward: through w and u to dk, dv, dbeta, and through
               T = (I + A)^-1 with dA = -T^T dT T^T (strictly lower) to dk, dbeta, d cum; then
               dlog_g = the reverse cumsum of d cum within the chunk.
The backward recomputes prepare and states (activation checkpointing: nothing but the inputs is
kept between forward and backward). Inputs are the ops twin's (mlxwalk/ops/delta/chunk.py's
`gated_delta_chunked`): q, k (B, L, HK, DK) and v (B, L, HV, DV) in float32, float16 or
bfloat16; log_g, beta (B, L, HV) and the state (B, HV, DV, DK) float32. Every kernel computes in
float32; y goes back in q's dtype, each gradient in its input's.

Buffers between kernels (float32, NP = N * CHUNK padded positions, N chunks):
  cum (B, HV, NP); w (B, HV, NP, DK); u, v_new, dv_new (B, HV, NP, DV);
  tri (B, HV, N, CHUNK, CHUNK) (T, zeros above the diagonal); h, dh (B, N, HV, DV, DK);
  dw (B, HV, NP, DK); dcum (B, HV, KB, NP): grads's d cum, one partial per key block.
Every kernel takes `params` = [B, L, HK, HV, N, KB] (int32) and the template T (dtype), DK, DV
and its block shape; its header is `tiles` (tiles.metal; a CUDA twin's tiles.cuh), its buffers
and their layouts the same on every backend. A launch's grid, block and block template come from
`GEOMETRY[backend]` (Metal's: `metal_geometry`, from blocks.METAL); another backend registers
its own function there, taking (kernel, Sizes, dtype) and returning a Geometry. Those plain parts
(the specs, Sizes, the geometries, params and the buffers' shapes) are pipeline.py's, without
MLX: the torch backend launches the same kernels from them.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from ..build import Launch, current_backend, launch
from . import pipeline
from .pipeline import (  # noqa: F401  (this module's names before pipeline.py held them)
    CHUNK,
    GEOMETRY,
    GRADS,
    OUTPUT,
    PREPARE,
    PREPARE_BACK,
    SPECS,
    STATES,
    STATES_BACK,
    Geometry,
    Sizes,
    cuda_geometry,
    metal_geometry,
)

Runner = Callable[[Launch], list[mx.array]]
FLOATS = (mx.float32, mx.float16, mx.bfloat16)


def supports(q: mx.array, k: mx.array, v: mx.array, backend: str | None = None) -> bool:
    """The shapes and dtypes these kernels take (pipeline.takes): DK = DV of the backend's table
    (Metal: 64, 128; CUDA: 64, 128), value heads a multiple of key heads, q, k, v of one floating
    dtype."""
    dtypes = (q.dtype, k.dtype, v.dtype)
    return pipeline.takes(q.shape, k.shape, v.shape, dtypes, _backend(backend))


def _backend(backend: str | None) -> str:
    """`backend`, else MLX's; without a GPU, Metal's (the CPU harness runs the Metal bodies)."""
    return backend or current_backend() or "metal"


def _launch(
    kernel: str,
    s: Sizes,
    dtype: mx.Dtype,
    inputs: list[mx.array],
    backend: str | None,
    keep: bool = True,
    key_blocks: int | None = None,
) -> Launch:
    """`key_blocks`: params' KB where it is an input's (dcum's), not this launch's geometry's."""
    c = pipeline.call(kernel, s, dtype, _backend(backend), keep, key_blocks)
    return Launch(
        c.spec,
        [*inputs, mx.array(c.params, mx.int32)],
        c.output_shapes,
        [mx.float32] * len(c.output_shapes),
        c.grid,
        c.threadgroup,
        c.template,
        c.shared_memory,
    )


def prepare_launch(s: Sizes, k, v, log_g, beta, keep: bool, backend: str | None = None) -> Launch:
    """-> cum, w, u, tri (tri only with `keep`, else a placeholder of one element)."""
    return _launch("prepare", s, k.dtype, [k, v, log_g, beta], backend, keep)


def states_launch(s: Sizes, k, w, u, cum, state, backend: str | None = None) -> Launch:
    """-> h, v_new, final_state."""
    return _launch("states", s, k.dtype, [k, w, u, cum, state], backend)


def output_launch(s: Sizes, q, k, cum, h, v_new, backend: str | None = None) -> Launch:
    """-> y (B, L, HV, DV) float32."""
    return _launch("output", s, q.dtype, [q, k, cum, h, v_new], backend)


def states_back_launch(
    s: Sizes, q, k, w, cum, d_out, d_final, backend: str | None = None
) -> Launch:
    """-> dh, dv_new, d_state (the initial state's gradient)."""
    return _launch("states_back", s, q.dtype, [q, k, w, cum, d_out, d_final], backend)


def grads_launch(
    s: Sizes, q, k, cum, h, v_new, dh, dv_new, d_out, backend: str | None = None
) -> Launch:
    """-> dq (complete), dk (the output's and the state update's parts), dw, dcum (partials)."""
    return _launch("grads", s, q.dtype, [q, k, cum, h, v_new, dh, dv_new, d_out], backend)


def prepare_back_launch(
    s: Sizes, k, v, beta, cum, tri, dw, dv_new, dk, dcum, backend: str | None = None
) -> Launch:
    """-> dk (complete), dv, dlog_g, dbeta."""
    inputs = [k, v, beta, cum, tri, dw, dv_new, dk, dcum]
    return _launch("prepare_back", s, k.dtype, inputs, backend, key_blocks=dcum.shape[2])


def _checked(q, k, v, log_g, beta, state) -> tuple[Sizes, list[mx.array]]:
    s = Sizes.of(q, v)
    if not (k.dtype == v.dtype == q.dtype and q.dtype in FLOATS):
        raise ValueError(f"q, k, v must share a floating dtype: {q.dtype}, {k.dtype}, {v.dtype}")
    if s.value_heads % s.key_heads or k.shape != q.shape or s.dk != s.dv:
        raise ValueError(f"shapes the kernels do not take: q {q.shape}, k {k.shape}, v {v.shape}")
    f32 = mx.float32
    return s, [q, k, v, log_g.astype(f32), beta.astype(f32), state.astype(f32)]


def forward(q, k, v, log_g, beta, state, run: Runner = launch, backend: str | None = None):
    """(y, final_state): y (B, L, HV, DV) in q's dtype, the final state (B, HV, DV, DK) float32.
    `run` launches a call (on the GPU by default; the CPU harness in tests); `backend`: the
    geometry's (default: MLX's, Metal's without a GPU)."""
    s, (q, k, v, log_g, beta, state) = _checked(q, k, v, log_g, beta, state)
    cum, w, u, _ = run(prepare_launch(s, k, v, log_g, beta, False, backend))
    h, v_new, final = run(states_launch(s, k, w, u, cum, state, backend))
    (y,) = run(output_launch(s, q, k, cum, h, v_new, backend))
    return y.astype(q.dtype), final


def backward(
    q, k, v, log_g, beta, state, dy, dstate, run: Runner = launch, backend: str | None = None
):
    """(dq, dk, dv, dlog_g, dbeta, dstate) for cotangents dy of y and dstate of the final state,
    each in its input's dtype; prepare and states are recomputed from the inputs."""
    dtypes = [x.dtype for x in (q, k, v, log_g, beta, state)]
    s, (q, k, v, log_g, beta, state) = _checked(q, k, v, log_g, beta, state)
    dy, dstate = dy.astype(q.dtype), dstate.astype(mx.float32)
    cum, w, u, tri = run(prepare_launch(s, k, v, log_g, beta, True, backend))
    h, v_new, _ = run(states_launch(s, k, w, u, cum, state, backend))
    dh, dv_new, d_state = run(states_back_launch(s, q, k, w, cum, dy, dstate, backend))
    dq, dk, dw, dcum = run(grads_launch(s, q, k, cum, h, v_new, dh, dv_new, dy, backend))
    dk, dv, dlog_g, dbeta = run(
        prepare_back_launch(s, k, v, beta, cum, tri, dw, dv_new, dk, dcum, backend)
    )
    grads = (dq, dk, dv, dlog_g, dbeta, d_state)
    return tuple(g.astype(dt) for g, dt in zip(grads, dtypes))


def op(run: Runner = launch, backend: str | None = None):
    """`gated_delta(q, k, v, log_g, beta, state) -> (y, final_state)` on these kernels, with
    their backward as its VJP (an `mx.custom_function`)."""

    @mx.custom_function
    def gated_delta(q, k, v, log_g, beta, state):
        return forward(q, k, v, log_g, beta, state, run, backend)

    @gated_delta.vjp
    def _vjp(primals, cotangents, outputs):
        return backward(*primals, *cotangents, run=run, backend=backend)

    return gated_delta
