"""What the chunked delta rule's kernel tests share (tests/test_delta_chunked.py through the Metal
harness, tests/test_delta_cuda.py through the CUDA emulator): the outputs compared and how."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

NAMES = ("y", "final_state", "dq", "dk", "dv", "dlog_g", "dbeta", "dstate")


def relative_error(a: mx.array, b: mx.array) -> float:
    """Relative L2 error in float32; anything not finite (an output never written: the harness
    and the emulator start outputs as NaN, and in the emulator a read before a cp.async's wait
    reads NaN) counts as infinite."""
    a, b = (np.array(x.astype(mx.float32), np.float64) for x in (a, b))
    if not np.isfinite(a).all():
        return float("inf")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def through(fn, x, cots) -> dict[str, mx.array]:
    """y, the final state and the six gradients of `fn` by mx.vjp."""
    outputs, grads = mx.vjp(fn, x, cots)
    return dict(zip(NAMES, [*outputs, *grads]))
