"""The gated delta rule (Qwen3.5's and Qwen3-Next's linear-attention layers), fit for training:
one package laid out as flash-linear-attention's `ops/gated_delta_rule/`.

  naive.py         token by token in MLX ops, as mlx-lm trains it: the reference
  chunk.py         chunked (the WY form) in MLX ops, with a recomputing VJP: every backend, the
                   twin of the kernels below and the CPU path (its docstring has the algebra)
  recurrence.py    the chunked op's sequential part (the state carried from chunk to chunk) in
                   MLX ops; scan.py the same on metal_kernels/delta's scans, and `sequential`,
                   which picks between the two
  chunk_kernel.py  the whole chunked op on metal_kernels/delta's chunked kernels, and where they run
  mlx_fast.py      MLX's own token-by-token kernel (mx.fast.gated_delta_update), where it runs
Here: `gated_delta_update`, the drop-in for mlx-lm's that picks one per layer call (routing.py
decides where a kernel may run), and `fast_recurrence`, which puts it into a model's layers.

Inputs follow mlx-lm's `gated_delta_ops`: q, k (B, T, Hk, Dk); v (B, T, Hv, Dv) with Hv a multiple
of Hk; log_g and beta (B, T, Hv) (scalar gates, given as log g for range); state (B, Hv, Dv, Dk),
float32. Each op returns y (B, T, Hv, Dv) in q's dtype and the final state in float32.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn

from .. import routing
from . import chunk_kernel, mlx_fast
from .chunk import chunk_size, gated_delta, gated_delta_chunked, unit_lower_inverse
from .naive import naive_recurrent

__all__ = [
    "chunk_size",
    "fast_recurrence",
    "gated_delta",
    "gated_delta_chunked",
    "gated_delta_update",
    "naive_recurrent",
    "unit_lower_inverse",
]


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
    """Drop-in for mlx-lm's `gated_delta_update` that trains through `gated_delta`, or, where
    routing takes them, the chunked kernels or MLX's own op (a mask or a lower bound goes to
    mlx-lm's own)."""
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
    if chunk_kernel.use(q, k, v, gated_delta):
        kernels = chunk_kernel.guarded(chunk_kernel.case_of(q, v), q, v, gated_delta)
        if routing.mode() != "check":
            return kernels(q, k, v, log_g, beta, state)
        got = kernels(q, k, v, log_g, beta, state)
        want = gated_delta(q, k, v, log_g, beta, state)
        routing.compare(got, want, chunk_kernel.case_of(q, v), "delta/chunked")
        return want
    if routing.backend() == "metal" and mlx_fast.use(q, v):
        x = (q, k, v, log_g, beta, state)
        got = routing.guard(  # (its forward; its backward is MLX's own VJP)
            mlx_fast.case_of(q, v),
            "mlx gated_delta_update",
            f"{q.shape[1]} positions, batch {q.shape[0]}",
            lambda: mlx_fast.gated_delta(*x),
            lambda: gated_delta(*x),
        )
        if routing.mode() != "check":
            return got
        want = gated_delta(q, k, v, log_g, beta, state)
        routing.compare(got, want, mlx_fast.case_of(q, v), "mlx gated_delta_update")
        return want
    return gated_delta(q, k, v, log_g, beta, state)


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
