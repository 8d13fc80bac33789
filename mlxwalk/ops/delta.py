"""The gated delta rule, chunked, as an `mx.custom_function` fit for training.

Per value head, with S the (Dv x Dk) state, g_t in (0, 1] the decay and beta_t the write strength:
    S_t = g_t S_{t-1} + beta_t (v_t - g_t S_{t-1} k_t) k_t^T,    o_t = S_t q_t.
mlx-lm trains this through a per-token loop whose autodiff keeps every S_t (T x Dv x Dk floats per
head). Here the sequence is cut into chunks of C positions (chunk_size()). Inside a chunk, with
gamma_t the decay accumulated since the chunk's start and S the state entering it (the WY form):
    A_ij = beta_i (gamma_i / gamma_j) k_i.k_j  (j < i),   T = (I + A)^-1
    U    = T diag(beta) V - T diag(beta gamma) K S^T          (the chunk's effective writes)
    O    = diag(gamma) Q S^T + [(gamma_t / gamma_i) q_t.k_i]_{i <= t} U
    S'   = gamma_C S + U^T diag(gamma_C / gamma) K
Everything but the last line is parallel over the chunks; the chunks are walked in sequence only to
carry S. The custom VJP recomputes the forward and differentiates it (activation checkpointing of
the op), so between forward and backward nothing but the inputs is held; the triangular inverse
has its own VJP (dA = -T^T dT T^T) so its substitution is never differentiated step by step.

The sequential part is delta_recurrence.py's in MLX ops, or, where a GPU takes them and they are
routed, delta_scan.py's kernels (metal_kernels/delta: the scan and the reverse scan, one launch
each instead of several per chunk). On Metal a layer may instead go to MLX's own
`mx.fast.gated_delta_update` (checked and raced first, below).

Inputs follow mlx-lm's `gated_delta_ops`: q, k (B, T, Hk, Dk); v (B, T, Hv, Dv) with Hv a multiple
of Hk; log_g and beta (B, T, Hv) (scalar gates, given as log g for range); state (B, Hv, Dv, Dk),
float32. Returns y (B, T, Hv, Dv) in q's dtype and the final state in float32.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn

from metal_kernels.delta import chunked

from . import delta_chunked, delta_recurrence, delta_scan, routing
from .delta_recurrence import Factors

CHUNK: int | None = None  # positions per chunk; None: chunk_size() picks by backend


def chunk_size() -> int:
    """64 on the CPU, 256 on a GPU. Longer chunks trade arithmetic (c^2 per chunk) for fewer steps
    of the sequential walk; on the CPU the arithmetic dominates, on a GPU the per-step kernel
    launches do (scripts/bench-delta.py --chunks, docs/BENCHMARKS.md)."""
    if CHUNK is not None:
        return CHUNK
    return 256 if mx.default_device() == mx.gpu else 64


BLOCK = 16  # the inverse substitutes inside blocks of 16 rows, then merges blocks pairwise


def _substitute(a: mx.array) -> mx.array:
    """(I + A)^-1 for small strictly lower A (..., b, b): rows by forward substitution."""
    b = a.shape[-1]
    eye = mx.eye(b, dtype=a.dtype)
    rows = [mx.broadcast_to(eye[0], (*a.shape[:-2], 1, b))]
    for i in range(1, b):
        # row i: e_i - A[i, :i] T[:i, :]
        rows.append(eye[i] - a[..., i : i + 1, :i] @ mx.concatenate(rows, axis=-2))
    return mx.concatenate(rows, axis=-2)


def _merged_inverse(a: mx.array) -> mx.array:
    """unit_lower_inverse for C = BLOCK x 2^k."""
    lead, c = a.shape[:-2], a.shape[-1]
    n = c // BLOCK
    # the diagonal blocks: (..., n, BLOCK, BLOCK)
    blocks = a.reshape(*lead, n, BLOCK, n, BLOCK).swapaxes(-3, -2)
    idx = mx.arange(n)
    t = _substitute(blocks[..., idx, idx, :, :])
    while t.shape[-3] > 1:
        m = t.shape[-3] // 2
        s = t.shape[-1]
        t11, t22 = t[..., 0::2, :, :], t[..., 1::2, :, :]
        a21 = mx.stack(
            [
                a[..., (2 * i + 1) * s : (2 * i + 2) * s, 2 * i * s : (2 * i + 1) * s]
                for i in range(m)
            ],
            axis=-3,
        )
        low = -(t22 @ a21 @ t11)
        top = mx.concatenate([t11, mx.zeros_like(t11)], axis=-1)
        bottom = mx.concatenate([low, t22], axis=-1)
        t = mx.concatenate([top, bottom], axis=-2)
    return t[..., 0, :, :]


@mx.custom_function
def unit_lower_inverse(a: mx.array) -> mx.array:
    """(I + A)^-1 for A strictly lower triangular (..., C, C).

    Diagonal blocks of BLOCK rows are inverted by substitution, all at once; then pairs of blocks
    merge: [[T11, 0], [A21, T22]] -> [[T11, 0], [-T22 A21 T11, T22]], doubling the block size.
    A is padded with zeros to BLOCK x 2^k rows (I + A stays block diagonal, so the inverse's
    leading block is the answer)."""
    c = a.shape[-1]
    if c <= BLOCK:
        return _substitute(a)
    full = BLOCK * (1 << (-(-c // BLOCK) - 1).bit_length())
    if full == c:
        return _merged_inverse(a)
    pad = [(0, 0)] * (a.ndim - 2) + [(0, full - c), (0, full - c)]
    return _merged_inverse(mx.pad(a, pad))[..., :c, :c]


@unit_lower_inverse.vjp
def _unit_lower_inverse_vjp(primals, cotangent, output):
    t = output
    ta = t.swapaxes(-1, -2)
    da = -(ta @ cotangent @ ta)
    c = t.shape[-1]
    return (da * mx.tril(mx.ones((c, c), dtype=da.dtype), -1),)


def _chunks(x: mx.array, n: int, c: int) -> mx.array:
    """(B, T, H, ...) padded to n * c positions -> (n, B, H, c, ...): a chunk is contiguous."""
    b, t, h = x.shape[:3]
    rest = x.shape[3:]
    if n * c > t:
        x = mx.concatenate([x, mx.zeros((b, n * c - t, h, *rest), x.dtype)], axis=1)
    x = x.reshape(b, n, c, h, *rest)
    return x.transpose(1, 0, 3, 2, *range(4, 4 + len(rest)))


def recurrence(f: Factors, s: mx.array, differentiable: bool = True):
    """(outputs, exit state) of the chunk recurrence; entry states are kept for the VJP only.
    On the scan kernels where they apply (MLXWALK_KERNELS=check: compared with the ops, whose
    result goes on)."""
    if delta_scan.use_kernel(f.w.shape[-1], f.u0.shape[-2]):
        case = routing.ScanCase(routing.backend(), f.w.shape[-1], f.u0.shape[-2])
        size = f"{f.u0.shape[0]} chunks, {f.u0.shape[1] * f.u0.shape[2] * f.u0.shape[3]} heads"
        if routing.mode() != "check":
            if not differentiable:
                return routing.guard(
                    case,
                    "delta/scan",
                    size,
                    lambda: delta_scan.scan(f, s, keep=False)[:2],
                    lambda: delta_recurrence.walk(f, s, keep=False)[:2],
                )
            return _guarded_scans(case, size)(*f, s)[:2]
        got = delta_scan.scan(f, s, keep=False)[:2]
        want = delta_recurrence.walk(f, s, keep=False)[:2]
        routing.compare(got, want, case, "delta/scan")
    if not differentiable:
        return delta_recurrence.walk(f, s, keep=False)[:2]
    return delta_recurrence.recurrence(f, s)[:2]


def _guarded_scans(case: routing.ScanCase, size: str):
    """The scan kernels' recurrence (outputs, exit state, entry states), forward and backward
    each falling back to the ops recurrence where it fails (routing.guard). The backward goes
    through the kernels' own VJP, which recomputes their forward scan."""

    @mx.custom_function
    def scans(*x):
        return routing.guard(
            case,
            "delta/scan",
            size,
            lambda: delta_scan.recurrence(Factors(*x[:6]), x[6]),
            lambda: delta_recurrence.recurrence(Factors(*x[:6]), x[6]),
        )

    @scans.vjp
    def _scans_vjp(primals, cotangents, outputs):
        def through(f):
            return lambda: tuple(
                mx.vjp(lambda *x: f(Factors(*x[:6]), x[6]), list(primals), list(cotangents))[1]
            )

        return routing.guard(
            case,
            "delta/scan_back",
            size,
            through(delta_scan.recurrence),
            through(delta_recurrence.recurrence),
        )

    return scans


def gated_delta_chunked(q, k, v, log_g, beta, state, differentiable: bool = True):
    """The chunked gated delta rule in plain MLX ops (runs on every backend); `differentiable`
    routes the recurrence through its VJP, which keeps every chunk's entry state."""
    b, t, hk, dk = q.shape
    hv, dv = v.shape[-2:]
    r = hv // hk  # value heads per key head: q and k broadcast over them, never repeated
    out_dtype = q.dtype
    c = min(chunk_size(), t)
    n = -(-t // c)
    f32 = mx.float32

    def split(x):  # (B, T, H, ...) -> (n, B, Hk, r or 1, c, ...)
        x = _chunks(x.astype(f32), n, c)
        return x.reshape(n, b, hk, x.shape[2] // hk, *x.shape[3:])

    # padded positions have k = v = beta = log_g = 0: they write nothing and do not decay
    q, k, v, log_g, beta = (split(x) for x in (q, k, v, log_g, beta))
    cum = mx.cumsum(log_g, axis=-1)  # log gamma, (n, B, Hk, r, c)
    causal = mx.tril(mx.ones((c, c), dtype=mx.bool_))
    # gamma_i / gamma_j on and below the diagonal, 0 above (exp of -inf), one exp for both uses
    decay = mx.exp(mx.where(causal, cum[..., :, None] - cum[..., None, :], -mx.inf))
    kt = k.swapaxes(-1, -2)
    a = beta[..., None] * (k @ kt) * mx.tril(decay, -1)
    tri = unit_lower_inverse(a)
    gamma = mx.exp(cum)
    w = tri @ ((beta * gamma)[..., None] * k)  # (n, B, Hk, r, c, Dk)
    u0 = tri @ (beta[..., None] * v)  # (n, B, Hk, r, c, Dv)
    p = (q @ kt) * decay  # (n, B, Hk, r, c, c)
    qg = gamma[..., None] * q
    kd = mx.exp(cum[..., -1:] - cum)[..., None] * k
    g_end = gamma[..., -1:][..., None]  # (n, B, Hk, r, 1, 1)

    s0 = state.astype(f32).reshape(b, hk, r, dv, dk)
    factors = Factors(u0=u0, w=w, qg=qg, p=p, kd=kd, g_end=g_end)
    o, s = recurrence(factors, s0, differentiable)
    y = o.transpose(1, 0, 4, 2, 3, 5).reshape(b, n * c, hv, dv)[:, :t]
    return y.astype(out_dtype), s.reshape(b, hv, dv, dk)


@mx.custom_function
def gated_delta(q, k, v, log_g, beta, state):
    """The gated delta rule with a recomputing VJP (see the module doc); its forward keeps no
    entry states (the VJP recomputes them)."""
    return gated_delta_chunked(q, k, v, log_g, beta, state, differentiable=False)


@gated_delta.vjp
def _gated_delta_vjp(primals, cotangents, outputs):
    _, grads = mx.vjp(gated_delta_chunked, list(primals), list(cotangents))
    return tuple(grads)


def gated_delta_update(
    q,
    k,
    v,
    a,
    b,
    A_log,
    dt_bias,
    state=None,
    mask=None,
    *,
    use_kernel: bool = True,
    lower_bound=None,
    allow_neg_eigval: bool = False,
):
    """Drop-in for mlx-lm's `gated_delta_update` that trains through `gated_delta`."""
    if mask is not None or lower_bound is not None:
        return _mlx_lm_update(
            q,
            k,
            v,
            a,
            b,
            A_log,
            dt_bias,
            state,
            mask,
            use_kernel=use_kernel,
            lower_bound=lower_bound,
            allow_neg_eigval=allow_neg_eigval,
        )
    beta = mx.sigmoid(b)
    if allow_neg_eigval:
        beta = beta * 2.0
    log_g = -mx.exp(A_log.astype(mx.float32)) * nn.softplus(a + dt_bias)
    if state is None:
        state = mx.zeros((q.shape[0], v.shape[-2], v.shape[-1], q.shape[-1]), mx.float32)
    if CPU_COMPILE and routing.backend() is None:
        return _compiled(q, k, v, log_g, beta, state)
    if delta_chunked.use(q, k, v, gated_delta):
        kernels = _guarded_chunked(delta_chunked.case_of(q, v), q, v)
        if routing.mode() != "check":
            return kernels(q, k, v, log_g, beta, state)
        got = kernels(q, k, v, log_g, beta, state)
        want = gated_delta(q, k, v, log_g, beta, state)
        routing.compare(got, want, delta_chunked.case_of(q, v), "delta/chunked")
        return want
    if routing.backend() == "metal" and use_mlx_fast(q, v):
        x = (q, k, v, log_g, beta, state)
        got = routing.guard(  # (its forward; its backward is MLX's own VJP)
            _mlx_fast_case(q, v),
            "mlx gated_delta_update",
            _size(q),
            lambda: mlx_fast(*x),
            lambda: gated_delta(*x),
        )
        if routing.mode() != "check":
            return got
        want = gated_delta(q, k, v, log_g, beta, state)
        routing.compare(got, want, _mlx_fast_case(q, v), "mlx gated_delta_update")
        return want
    return gated_delta(q, k, v, log_g, beta, state)


def _size(q: mx.array) -> str:
    return f"{q.shape[1]} positions, batch {q.shape[0]}"


def _guarded_chunked(case: routing.ChunkedDeltaCase, q: mx.array, v: mx.array):
    """The chunked kernels' gated delta rule (delta_chunked.op's pair, forward and backward),
    each falling back to the ops' `gated_delta` where it fails (routing.guard)."""
    run, where = routing.launch, routing.backend()
    size = f"{_size(q)}, {v.shape[-2]} value heads"

    @mx.custom_function
    def kernels(*x):
        return routing.guard(
            case,
            "delta/chunked",
            size,
            lambda: chunked.forward(*x, run=run, backend=where),
            lambda: gated_delta(*x),
        )

    @kernels.vjp
    def _kernels_vjp(primals, cotangents, outputs):
        return routing.guard(
            case,
            "delta/chunked backward",
            size,
            lambda: chunked.backward(*primals, *cotangents, run=run, backend=where),
            lambda: tuple(mx.vjp(gated_delta, list(primals), list(cotangents))[1]),
        )

    return kernels


def mlx_fast(q, k, v, log_g, beta, state):
    """MLX's own gated delta rule (Metal kernels with a VJP for the shapes it covers): the same
    contract as gated_delta (gamma given in linear space)."""
    y, s = mx.fast.gated_delta_update(q, k, v, mx.exp(log_g), beta, initial_state=state)
    return y.astype(q.dtype), s.astype(mx.float32)


def _mlx_fast_case(q, v) -> routing.MlxDeltaCase:
    """MLX's op covers some shapes only: one case per (key heads, value heads, key dim, value
    dim, dtype)."""
    hk, dk, hv, dv = q.shape[-2], q.shape[-1], v.shape[-2], v.shape[-1]
    return routing.MlxDeltaCase(routing.backend(), q.dtype, hk, hv, dk, dv)


def use_mlx_fast(q, v) -> bool:
    """On Metal: MLX's gated_delta_update where it matches the ops on a small case of the layer's
    shape (values, the final state, every gradient including the initial state's) and, at first
    use, beats them."""
    if routing.mode() == "off":
        return False
    return routing.decide(_mlx_fast_case(q, v), mlx_fast_vs_ops, mlx_fast_race)


def _layer(case: routing.MlxDeltaCase, t: int):
    return delta_chunked.layer(
        case.dtype, case.key_heads, case.value_heads, case.key_dim, case.value_dim, t
    )


def mlx_fast_vs_ops(case: routing.MlxDeltaCase) -> dict[str, float]:
    x, cots = _layer(case, 70)
    got = mx.vjp(mlx_fast, x, cots)
    want = mx.vjp(gated_delta, x, cots)
    pairs = zip([*got[0], *got[1]], [*want[0], *want[1]])
    return {"mlx gated_delta_update": max(routing.relative_error(a, b) for a, b in pairs)}


def mlx_fast_race(case: routing.MlxDeltaCase, size: tuple[int, int]) -> tuple[float, float]:
    """Seconds for a layer's forward and backward over size[0] positions: MLX's op, then ours."""
    x, cots = _layer(case, size[0])
    mlx_s, ours_s = (
        routing.seconds(lambda f=f: mx.eval(mx.vjp(f, x, cots))) for f in (mlx_fast, gated_delta)
    )
    return mlx_s, ours_s


# The ops under mx.compile on the CPU (recompiled per distinct shape: a walk meets its chunk and
# a shorter last one): 1.05-1.4x on the op alone, nothing measurable on the exact walk over the
# bundled hybrid (scripts/bench-delta.py --compiled, docs/BENCHMARKS.md); off until it pays.
CPU_COMPILE = False
_compiled = mx.compile(gated_delta)


def _mlx_lm_update(*args, **kwargs):
    from mlx_lm.models import gated_delta as reference

    return reference.gated_delta_update(*args, **kwargs)


@contextmanager
def fast_recurrence(model: nn.Module) -> Iterator[None]:
    """Within the block, the model's gated delta-net layers run through `gated_delta`."""
    patched = []
    for _, m in model.named_modules():
        module = sys.modules.get(type(m).__module__)
        if module is not None and getattr(module, "gated_delta_update", None) is not None:
            if module not in [p[0] for p in patched]:
                patched.append((module, module.gated_delta_update))
                module.gated_delta_update = gated_delta_update
    try:
        yield
    finally:
        for module, original in patched:
            module.gated_delta_update = original
