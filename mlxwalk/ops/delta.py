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

The sequential part runs as two kernels where a GPU takes them (metal_kernels/delta: the scan
and the reverse scan, one launch each instead of several per chunk), checked at first use against
the ops recurrence here, which stays the reference, the fallback and the CPU path.

Inputs follow mlx-lm's `gated_delta_ops`: q, k (B, T, Hk, Dk); v (B, T, Hv, Dv) with Hv a multiple
of Hk; log_g and beta (B, T, Hv) (scalar gates, given as log g for range); state (B, Hv, Dv, Dk),
float32. Returns y (B, T, Hv, Dv) in q's dtype and the final state in float32.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
import numpy as np

import metal_kernels.delta as delta_kernels

from . import routing

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


def _walk_chunks(u0, w, qg, p, kd, g_end, s, keep: bool = True):
    """The sequential part: carry the state through the chunks; (outputs, exit, entry states),
    the entry states only if `keep` (the VJP's)."""
    outs, entries = [], []
    for i in range(u0.shape[0]):
        if keep:
            entries.append(s)
        st = s.swapaxes(-1, -2)  # (B, H, Dk, Dv)
        u = u0[i] - w[i] @ st
        outs.append(qg[i] @ st + p[i] @ u)
        s = g_end[i] * s + u.swapaxes(-1, -2) @ kd[i]
    return mx.stack(outs), s, (mx.stack(entries) if keep else None)


@mx.custom_function
def _recurrence_with_states(u0, w, qg, p, kd, g_end, s):
    return _walk_chunks(u0, w, qg, p, kd, g_end, s)


@_recurrence_with_states.vjp
def _recurrence_vjp(primals, cotangents, outputs):
    """The chunk recurrence's adjoint, walked in reverse; per-chunk gradients are stacked
    (differentiating slices instead would scatter each into a full-size zero array)."""
    u0, w, qg, p, kd, g_end, _ = primals
    d_out, ds = cotangents[0], cotangents[1]
    entries = outputs[2]
    grads = {k: [] for k in ("u0", "w", "qg", "p", "kd", "g")}
    for i in reversed(range(u0.shape[0])):
        s, do = entries[i], d_out[i]
        u = u0[i] - w[i] @ s.swapaxes(-1, -2)
        du = p[i].swapaxes(-1, -2) @ do + kd[i] @ ds.swapaxes(-1, -2)
        grads["p"].append(do @ u.swapaxes(-1, -2))
        grads["qg"].append(do @ s)
        grads["kd"].append(u @ ds)
        grads["g"].append((ds * s).sum(axis=(-1, -2), keepdims=True))
        grads["u0"].append(du)
        grads["w"].append(-(du @ s))
        ds = g_end[i] * ds + do.swapaxes(-1, -2) @ qg[i] - du.swapaxes(-1, -2) @ w[i]
    g = {k: mx.stack(v[::-1]) for k, v in grads.items()}
    return g["u0"], g["w"], g["qg"], g["p"], g["kd"], g["g"], ds


def _flat(x: mx.array) -> mx.array:
    """(n, B, Hk, r, ...) -> (n, B Hk r, ...): the kernels' heads."""
    return x.reshape(x.shape[0], -1, *x.shape[4:])


def _kernel_scan(u0, w, qg, p, kd, g_end, s, keep: bool = True):
    """The forward scan kernel: (outputs, exit state, entry states or a placeholder)."""
    n, lead = u0.shape[0], u0.shape[:4]
    heads = s.reshape(-1, *s.shape[-2:])
    call = delta_kernels.scan_launch(_flat(u0), _flat(w), _flat(qg), _flat(p), _flat(kd),
                                     g_end.reshape(n, -1), heads, keep)  # fmt: skip
    o, entries, s_out = routing.launch(call)
    entries = entries.reshape(*lead, *s.shape[-2:]) if keep else entries
    return o.reshape(u0.shape), s_out.reshape(s.shape), entries


@mx.custom_function
def _kernel_recurrence(u0, w, qg, p, kd, g_end, s):
    return _kernel_scan(u0, w, qg, p, kd, g_end, s)


@_kernel_recurrence.vjp
def _kernel_recurrence_vjp(primals, cotangents, outputs):
    """The reverse scan kernel gives dS leaving each chunk and du; the rest is per chunk, in
    parallel (the same products as _recurrence_vjp's)."""
    u0, w, qg, p, kd, g_end, s = primals
    d_out, ds = cotangents[0], cotangents[1]
    entries = outputs[2]  # (n, B, Hk, r, Dv, Dk)
    call = delta_kernels.scan_back_launch(_flat(w), _flat(qg), _flat(p), _flat(kd),
                                          g_end.reshape(u0.shape[0], -1), _flat(d_out),
                                          ds.reshape(-1, *ds.shape[-2:]))  # fmt: skip
    ds_exit, du, ds0 = routing.launch(call)
    ds_exit, du = ds_exit.reshape(entries.shape), du.reshape(u0.shape)
    u = u0 - w @ entries.swapaxes(-1, -2)  # (n, B, Hk, r, c, Dv)
    dg = (ds_exit * entries).sum(axis=(-1, -2), keepdims=True)
    return (du, -(du @ entries), d_out @ entries, d_out @ u.swapaxes(-1, -2), u @ ds_exit, dg,
            ds0.reshape(s.shape))  # fmt: skip


def _kernel_case(dk: int, chunk: int) -> routing.Case | None:
    b = routing.backend()
    if b is None or routing.mode() == "off" or not delta_kernels.supports(dk, chunk):
        return None
    return routing.Case(b, mx.float32, dk, chunk, op="delta")


# On CUDA the scans lose to the ops at the GPU's chunk of 256 (scripts/bench-delta.py --kernels,
# docs/BENCHMARKS.md), so `auto` keeps the ops there; MLXWALK_KERNELS=on runs them.
CUDA_SCANS = False


def use_kernel(dk: int, chunk: int) -> bool:
    """Whether the recurrence runs on the scan kernels (self-checked once per case; on Metal
    raced against the ops at first use)."""
    case = _kernel_case(dk, chunk)
    if case is None or (case.backend == "cuda" and not CUDA_SCANS and not routing.forced()):
        return False
    return routing.decide(case, kernel_vs_twin, race)


def _case(case: routing.Case, n: int, dv: int, heads: int) -> tuple[list, list]:
    """Recurrence inputs and cotangents for a case: n chunks, a non-zero initial state."""
    rng = np.random.default_rng(0)
    c, dk = case.groups, case.dim
    lead = (n, 1, 1, heads)

    def normal(*shape, scale=0.1):
        return mx.array((scale * rng.standard_normal(shape)).astype(np.float32))

    p = normal(*lead, c, c) * mx.tril(mx.ones((c, c)))
    g_end = mx.array(rng.uniform(0.5, 1.0, (*lead, 1, 1)).astype(np.float32))
    inputs = [normal(*lead, c, dv), normal(*lead, c, dk), normal(*lead, c, dk), p,
              normal(*lead, c, dk), g_end, normal(1, 1, heads, dv, dk, scale=1.0)]  # fmt: skip
    cots = [normal(*lead, c, dv, scale=1.0), normal(1, 1, heads, dv, dk, scale=1.0)]
    return inputs, cots


def race(case: routing.Case, size: tuple[int, int]) -> tuple[float, float]:
    """Seconds for the recurrence forward and backward, scans then ops (median of three after a
    warm-up): `size` = (chunks, value heads of dim 128)."""
    inputs, cots = _case(case, size[0], 128, size[1])
    seconds = []
    for fn in (_kernel_recurrence, _recurrence_with_states):
        step = lambda f=fn: mx.eval(mx.vjp(lambda *a: f(*a)[:2], inputs, cots))  # noqa: E731
        step()
        times = []
        for _ in range(3):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        seconds.append(sorted(times)[1])
    return seconds[0], seconds[1]


def kernel_vs_twin(case: routing.Case, n: int = 3, dv: int = 32) -> dict[str, float]:
    """The self-check: the scan kernels against the ops recurrence on a small case (n chunks, a
    non-zero initial state, two value heads), forward and backward."""
    inputs, cots = _case(case, n, dv, 2)
    got = mx.vjp(lambda *a: _kernel_recurrence(*a)[:2], inputs, cots)
    want = mx.vjp(lambda *a: _recurrence_with_states(*a)[:2], inputs, cots)

    return {
        "delta/scan": max(routing.relative_error(a, b) for a, b in zip(got[0], want[0])),
        "delta/scan_back": max(routing.relative_error(a, b) for a, b in zip(got[1], want[1])),
    }


def recurrence(u0, w, qg, p, kd, g_end, s, differentiable: bool = True):
    """(outputs, exit state) of the chunk recurrence; entry states are kept for the VJP only.
    On the scan kernels where they apply (MLXWALK_KERNELS=check: compared with the ops, whose
    result goes on)."""
    if use_kernel(w.shape[-1], u0.shape[-2]):
        if routing.mode() != "check":
            if not differentiable:
                return _kernel_scan(u0, w, qg, p, kd, g_end, s, keep=False)[:2]
            return _kernel_recurrence(u0, w, qg, p, kd, g_end, s)[:2]
        got = _kernel_scan(u0, w, qg, p, kd, g_end, s, keep=False)[:2]
        want = _walk_chunks(u0, w, qg, p, kd, g_end, s, keep=False)[:2]
        case = routing.Case(routing.backend(), mx.float32, w.shape[-1], u0.shape[-2], op="delta")
        _compare(got, want, case, "delta/scan")
    if not differentiable:
        return _walk_chunks(u0, w, qg, p, kd, g_end, s, keep=False)[:2]
    o, s_exit, _ = _recurrence_with_states(u0, w, qg, p, kd, g_end, s)
    return o, s_exit


def _compare(got, want, case: routing.Case, name: str) -> None:
    """MLXWALK_KERNELS=check: a disagreement is named and turns that path off."""
    error = max(routing.relative_error(a, b) for a, b in zip(got, want))
    if error > routing.TOLERANCE[case.dtype]:
        routing.report(name, case, f"disagrees with the ops twin (relative error {error:.1e})")
        routing.disable(case)


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
    o, s = recurrence(u0, w, qg, p, kd, g_end, s0, differentiable)
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
            q, k, v, a, b, A_log, dt_bias, state, mask,
            use_kernel=use_kernel, lower_bound=lower_bound, allow_neg_eigval=allow_neg_eigval,
        )  # fmt: skip
    beta = mx.sigmoid(b)
    if allow_neg_eigval:
        beta = beta * 2.0
    log_g = -mx.exp(A_log.astype(mx.float32)) * nn.softplus(a + dt_bias)
    if state is None:
        state = mx.zeros((q.shape[0], v.shape[-2], v.shape[-1], q.shape[-1]), mx.float32)
    if CPU_COMPILE and routing.backend() is None:
        return _compiled(q, k, v, log_g, beta, state)
    if routing.backend() == "metal" and use_mlx_fast(q, v):
        if routing.mode() != "check":
            return mlx_fast(q, k, v, log_g, beta, state)
        got = mlx_fast(q, k, v, log_g, beta, state)
        want = gated_delta(q, k, v, log_g, beta, state)
        _compare(got, want, _mlx_fast_case(q, v), "mlx gated_delta_update")
        return want
    return gated_delta(q, k, v, log_g, beta, state)


def mlx_fast(q, k, v, log_g, beta, state):
    """MLX's own gated delta rule (Metal kernels with a VJP for the shapes it covers): the same
    contract as gated_delta (gamma given in linear space)."""
    y, s = mx.fast.gated_delta_update(q, k, v, mx.exp(log_g), beta, initial_state=state)
    return y.astype(q.dtype), s.astype(mx.float32)


def _mlx_fast_case(q, v) -> routing.Case:
    """MLX's op covers some shapes only: one case per (key heads, value heads, key dim, value
    dim, dtype)."""
    hk, dk, hv, dv = q.shape[-2], q.shape[-1], v.shape[-2], v.shape[-1]
    return routing.Case(routing.backend(), q.dtype, dk, dv, op=f"mlx-delta {hk}/{hv}")


def use_mlx_fast(q, v) -> bool:
    """On Metal: MLX's gated_delta_update where it matches the ops on a small case of the layer's
    shape (values, the final state, every gradient including the initial state's) and, at first
    use, beats them."""
    if routing.mode() == "off":
        return False
    return routing.decide(_mlx_fast_case(q, v), mlx_fast_vs_ops, mlx_fast_race)


def _layer(case: routing.Case, t: int):
    hk, hv = (int(x) for x in case.op.split()[1].split("/"))
    rng = np.random.default_rng(0)

    def normal(*shape, scale=1.0):
        return mx.array((scale * rng.standard_normal(shape)).astype(np.float32))

    x = [normal(1, t, hk, case.dim, scale=0.3).astype(case.dtype),
         normal(1, t, hk, case.dim, scale=0.3).astype(case.dtype),
         normal(1, t, hv, case.groups).astype(case.dtype),
         -mx.array(rng.uniform(0.01, 0.3, (1, t, hv)).astype(np.float32)),
         mx.array(rng.uniform(0.1, 0.9, (1, t, hv)).astype(np.float32)),
         normal(1, hv, case.groups, case.dim, scale=0.5)]  # fmt: skip
    cots = [normal(1, t, hv, case.groups).astype(case.dtype), normal(1, hv, case.groups, case.dim)]
    return x, cots


def mlx_fast_vs_ops(case: routing.Case) -> dict[str, float]:
    x, cots = _layer(case, 70)
    got = mx.vjp(mlx_fast, x, cots)
    want = mx.vjp(gated_delta, x, cots)
    pairs = zip([*got[0], *got[1]], [*want[0], *want[1]])
    return {"mlx gated_delta_update": max(routing.relative_error(a, b) for a, b in pairs)}


def mlx_fast_race(case: routing.Case, size: tuple[int, int]) -> tuple[float, float]:
    """Seconds for a layer's forward and backward over size[0] positions: MLX's op, then ours."""
    x, cots = _layer(case, size[0])
    seconds = []
    for fn in (mlx_fast, gated_delta):
        step = lambda f=fn: mx.eval(mx.vjp(f, x, cots))  # noqa: E731
        step()
        times = []
        for _ in range(3):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        seconds.append(sorted(times)[1])
    return seconds[0], seconds[1]


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
