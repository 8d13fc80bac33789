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
its own function there, taking (kernel, Sizes, dtype) and returning a Geometry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from ..build import ROOT, Launch, Spec, current_backend, launch
from . import blocks

Runner = Callable[[Launch], list[mx.array]]
CHUNK = blocks.CHUNK
FLOATS = (mx.float32, mx.float16, mx.bfloat16)


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
    def of(cls, q: mx.array, v: mx.array) -> Sizes:
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


def metal_geometry(kernel: str, s: Sizes, dtype: mx.Dtype) -> Geometry:
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


GEOMETRY: dict[str, Callable[[str, Sizes, mx.Dtype], Geometry]] = {"metal": metal_geometry}


def supports(q: mx.array, k: mx.array, v: mx.array, backend: str | None = None) -> bool:
    """The shapes and dtypes these kernels take: DK = DV of the backend's table (Metal: 64, 128;
    CUDA: 64, 128), value heads a multiple of key heads, q, k, v of one floating dtype."""
    dims = {"metal": blocks.METAL_DIMS, "cuda": blocks.CUDA_DIMS}.get(_backend(backend), ())
    return (
        q.shape == k.shape
        and q.shape[-1] == v.shape[-1]
        and q.shape[-1] in dims
        and v.shape[2] % q.shape[2] == 0
        and q.dtype in FLOATS
        and k.dtype == q.dtype
        and v.dtype == q.dtype
    )


def _backend(backend: str | None) -> str:
    """`backend`, else MLX's; without a GPU, Metal's (the CPU harness runs the Metal bodies)."""
    return backend or current_backend() or "metal"


def _launch(
    kernel: str,
    s: Sizes,
    dtype: mx.Dtype,
    inputs: list[mx.array],
    shapes: list[tuple[int, ...]],
    backend: str | None,
    extra: tuple[tuple[str, object], ...] = (),
    key_blocks: int | None = None,
) -> Launch:
    """`key_blocks`: params' KB where it is an input's (dcum's), not this launch's geometry's."""
    backend = _backend(backend)
    if backend not in GEOMETRY:
        raise RuntimeError(f"delta/{kernel}: no geometry for backend {backend!r}")
    geo = GEOMETRY[backend](kernel, s, dtype)
    if kernel == "grads":  # dcum: one partial per key block
        shapes = [*shapes[:3], (s.batch, s.value_heads, geo.key_blocks, s.padded)]
    kb = geo.key_blocks if key_blocks is None else key_blocks
    params = mx.array([s.batch, s.length, s.key_heads, s.value_heads, s.chunks, kb], mx.int32)
    template = [("T", dtype), ("DK", s.dk), ("DV", s.dv), *geo.template, *extra]
    return Launch(
        SPECS[kernel],
        [*inputs, params],
        shapes,
        [mx.float32] * len(shapes),
        geo.grid,
        geo.threadgroup,
        template,
        geo.shared_memory,
    )


def prepare_launch(s: Sizes, k, v, log_g, beta, keep: bool, backend: str | None = None) -> Launch:
    """-> cum, w, u, tri (tri only with `keep`, else a placeholder of one element)."""
    b, hv, np_, n = s.batch, s.value_heads, s.padded, s.chunks
    shapes = [
        (b, hv, np_),
        (b, hv, np_, s.dk),
        (b, hv, np_, s.dv),
        (b, hv, n, CHUNK, CHUNK) if keep else (1,),
    ]
    return _launch("prepare", s, k.dtype, [k, v, log_g, beta], shapes, backend, (("KEEP", keep),))


def states_launch(s: Sizes, k, w, u, cum, state, backend: str | None = None) -> Launch:
    """-> h, v_new, final_state."""
    b, hv = s.batch, s.value_heads
    shapes = [(b, s.chunks, hv, s.dv, s.dk), (b, hv, s.padded, s.dv), (b, hv, s.dv, s.dk)]
    return _launch("states", s, k.dtype, [k, w, u, cum, state], shapes, backend)


def output_launch(s: Sizes, q, k, cum, h, v_new, backend: str | None = None) -> Launch:
    """-> y (B, L, HV, DV) float32."""
    shapes = [(s.batch, s.length, s.value_heads, s.dv)]
    return _launch("output", s, q.dtype, [q, k, cum, h, v_new], shapes, backend)


def states_back_launch(
    s: Sizes, q, k, w, cum, d_out, d_final, backend: str | None = None
) -> Launch:
    """-> dh, dv_new, d_state (the initial state's gradient)."""
    b, hv = s.batch, s.value_heads
    shapes = [(b, s.chunks, hv, s.dv, s.dk), (b, hv, s.padded, s.dv), (b, hv, s.dv, s.dk)]
    return _launch("states_back", s, q.dtype, [q, k, w, cum, d_out, d_final], shapes, backend)


def grads_launch(
    s: Sizes, q, k, cum, h, v_new, dh, dv_new, d_out, backend: str | None = None
) -> Launch:
    """-> dq (complete), dk (the output's and the state update's parts), dw, dcum (partials)."""
    b, hv = s.batch, s.value_heads
    shapes = [q.shape, q.shape, (b, hv, s.padded, s.dk), ()]  # dcum's: by the geometry
    return _launch("grads", s, q.dtype, [q, k, cum, h, v_new, dh, dv_new, d_out], shapes, backend)


def prepare_back_launch(
    s: Sizes, k, v, beta, cum, tri, dw, dv_new, dk, dcum, backend: str | None = None
) -> Launch:
    """-> dk (complete), dv, dlog_g, dbeta."""
    shapes = [k.shape, v.shape, beta.shape, beta.shape]
    return _launch(
        "prepare_back",
        s,
        k.dtype,
        [k, v, beta, cum, tri, dw, dv_new, dk, dcum],
        shapes,
        backend,
        key_blocks=dcum.shape[2],
    )


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


def cuda_geometry(kernel: str, s: Sizes, dtype: mx.Dtype) -> Geometry:
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


GEOMETRY["cuda"] = cuda_geometry
