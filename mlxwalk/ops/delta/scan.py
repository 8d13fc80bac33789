"""The chunked rule's sequential part on the scan kernels (metal_kernels/delta), behind a custom
function whose VJP runs the reverse scan and leaves the per-chunk products to MLX; where the scans
run (self-checked against recurrence.py's ops per key dim and chunk; on CUDA only when forced,
measured slower; on Metal raced at first use), and `sequential`, which picks between the two."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

import metal_kernels.delta as delta_kernels

from .. import routing
from . import recurrence as ops_recurrence
from .recurrence import Factors, _recurrence_with_states


def _flat(x: mx.array) -> mx.array:
    """(n, B, Hk, r, ...) -> (n, B Hk r, ...): the kernels' heads."""
    return x.reshape(x.shape[0], -1, *x.shape[4:])


def scan(f: Factors, s: mx.array, keep: bool = True):
    """The forward scan kernel, no gradient: (outputs, exit state, entry states if `keep`)."""
    return _kernel_scan(*f, s, keep)


def recurrence(f: Factors, s: mx.array):
    """The scan kernels, differentiable (the reverse scan in the VJP): (outputs, exit state,
    entry states)."""
    return _kernel_recurrence(*f, s)


def _kernel_scan(u0, w, qg, p, kd, g_end, s, keep: bool = True):
    """The forward scan kernel: (outputs, exit state, entry states or a placeholder)."""
    n, lead = u0.shape[0], u0.shape[:4]
    heads = s.reshape(-1, *s.shape[-2:])
    call = delta_kernels.scan_launch(
        _flat(u0), _flat(w), _flat(qg), _flat(p), _flat(kd), g_end.reshape(n, -1), heads, keep
    )
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
    call = delta_kernels.scan_back_launch(
        _flat(w),
        _flat(qg),
        _flat(p),
        _flat(kd),
        g_end.reshape(u0.shape[0], -1),
        _flat(d_out),
        ds.reshape(-1, *ds.shape[-2:]),
    )
    ds_exit, du, ds0 = routing.launch(call)
    ds_exit, du = ds_exit.reshape(entries.shape), du.reshape(u0.shape)
    u = u0 - w @ entries.swapaxes(-1, -2)  # (n, B, Hk, r, c, Dv)
    dg = (ds_exit * entries).sum(axis=(-1, -2), keepdims=True)
    return (
        du,
        -(du @ entries),
        d_out @ entries,
        d_out @ u.swapaxes(-1, -2),
        u @ ds_exit,
        dg,
        ds0.reshape(s.shape),
    )


def _kernel_case(dk: int, chunk: int) -> routing.ScanCase | None:
    b = routing.backend()
    if b is None or routing.mode() == "off" or not delta_kernels.supports(dk, chunk):
        return None
    return routing.ScanCase(b, dk, chunk)


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


def _case(case: routing.ScanCase, n: int, dv: int, heads: int) -> tuple[list, list]:
    """Recurrence inputs and cotangents for a case: n chunks, a non-zero initial state."""
    rng = np.random.default_rng(0)
    c, dk = case.chunk, case.key_dim
    lead = (n, 1, 1, heads)

    def normal(*shape, scale=0.1):
        return mx.array((scale * rng.standard_normal(shape)).astype(np.float32))

    p = normal(*lead, c, c) * mx.tril(mx.ones((c, c)))
    g_end = mx.array(rng.uniform(0.5, 1.0, (*lead, 1, 1)).astype(np.float32))
    inputs = [
        normal(*lead, c, dv),
        normal(*lead, c, dk),
        normal(*lead, c, dk),
        p,
        normal(*lead, c, dk),
        g_end,
        normal(1, 1, heads, dv, dk, scale=1.0),
    ]
    cots = [normal(*lead, c, dv, scale=1.0), normal(1, 1, heads, dv, dk, scale=1.0)]
    return inputs, cots


def race(case: routing.ScanCase, size: tuple[int, int]) -> tuple[float, float]:
    """Seconds for the recurrence forward and backward, scans then ops (median of three after a
    warm-up): `size` = (chunks, value heads of dim 128)."""
    inputs, cots = _case(case, size[0], 128, size[1])

    def step(f):
        return mx.eval(mx.vjp(lambda *a: f(*a)[:2], inputs, cots))

    scans_s, ops_s = (
        routing.seconds(lambda f=f: step(f)) for f in (_kernel_recurrence, _recurrence_with_states)
    )
    return scans_s, ops_s


def kernel_vs_twin(case: routing.ScanCase, n: int = 3, dv: int = 32) -> dict[str, float]:
    """The self-check: the scan kernels against the ops recurrence on a small case (n chunks, a
    non-zero initial state, two value heads), forward and backward."""
    inputs, cots = _case(case, n, dv, 2)
    got = mx.vjp(lambda *a: _kernel_recurrence(*a)[:2], inputs, cots)
    want = mx.vjp(lambda *a: _recurrence_with_states(*a)[:2], inputs, cots)

    return {
        "delta/scan": max(routing.relative_error(a, b) for a, b in zip(got[0], want[0])),
        "delta/scan_back": max(routing.relative_error(a, b) for a, b in zip(got[1], want[1])),
    }


def sequential(f: Factors, s: mx.array, differentiable: bool = True):
    """The chunked rule's sequential part: (outputs, exit state) of the chunk recurrence, entry
    states kept for the VJP only. On the scan kernels where they apply, else recurrence.py's ops
    (MLXWALK_KERNELS=check: the two compared, the ops' result goes on); `differentiable` False
    for a forward that keeps no entry state (the recomputing VJP's first pass)."""
    if use_kernel(f.w.shape[-1], f.u0.shape[-2]):
        case = routing.ScanCase(routing.backend(), f.w.shape[-1], f.u0.shape[-2])
        size = f"{f.u0.shape[0]} chunks, {f.u0.shape[1] * f.u0.shape[2] * f.u0.shape[3]} heads"
        if routing.mode() != "check":
            if not differentiable:
                return routing.guard(
                    case,
                    "delta/scan",
                    size,
                    lambda: scan(f, s, keep=False)[:2],
                    lambda: ops_recurrence.walk(f, s, keep=False)[:2],
                )
            return _guarded_scans(case, size)(*f, s)[:2]
        got = scan(f, s, keep=False)[:2]
        want = ops_recurrence.walk(f, s, keep=False)[:2]
        routing.compare(got, want, case, "delta/scan")
    if not differentiable:
        return ops_recurrence.walk(f, s, keep=False)[:2]
    return ops_recurrence.recurrence(f, s)[:2]


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
            lambda: recurrence(Factors(*x[:6]), x[6]),
            lambda: ops_recurrence.recurrence(Factors(*x[:6]), x[6]),
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
            through(recurrence),
            through(ops_recurrence.recurrence),
        )

    return scans
