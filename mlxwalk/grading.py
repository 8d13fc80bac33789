"""How a walk's gradient is graded against its reference, in any framework: the bars and the
comparison (`mlxwalk test-walk-exact`'s table: exactness.py). Plain Python and NumPy."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

# The exact bar is float32's (on CUDA with TF32 off): the walks read 1e-6 to 5e-6 against their
# references, on the CPU and the H200, so 2e-5 leaves a factor of 4 and still fails a gradient
# scaled by 0.9999 or a float16 K/V store on the hybrid (5e-5). Rows where half precision is in
# play have their own bars, named by it, a few times what they read (tiny-qwen2 the worst, float32
# products: float16 store 2.3e-3, bfloat16 store 2.0e-2, q8 5.3e-2, bfloat16 accumulators 2.0e-3).
EXACT = "cosine >= 0.99999, relative L2 error <= 2e-5 (float32)"
FLOAT16_STORE = "float16 store: relative L2 error <= 1e-2"
BFLOAT16_STORE = "bfloat16 store: relative L2 error <= 5e-2"
Q8_STORE = "8-bit store: relative L2 error <= 1e-1"
BFLOAT16_ACCUMULATORS = "bfloat16 accumulators: relative L2 error <= 1e-2"
TELLS_APART = "cosine < 0.95 (tells the walks apart)"
BARS: dict[str, Callable[[float, float], bool]] = {  # (cosine, relative L2 error)
    EXACT: lambda c, e: c >= 0.99999 and e <= 2e-5,
    FLOAT16_STORE: lambda c, e: e <= 1e-2,
    BFLOAT16_STORE: lambda c, e: e <= 5e-2,
    Q8_STORE: lambda c, e: e <= 1e-1,
    BFLOAT16_ACCUMULATORS: lambda c, e: e <= 1e-2,
    TELLS_APART: lambda c, e: c < 0.95,
}


def flat(tree) -> np.ndarray:
    """Every leaf of a gradient tree (dicts and lists of arrays of any framework), in float64."""
    if isinstance(tree, dict):
        parts = [flat(tree[k]) for k in sorted(tree)]
    elif isinstance(tree, (list, tuple)):
        parts = [flat(v) for v in tree]
    else:
        return np.asarray(tree, np.float64).ravel()
    return np.concatenate(parts) if parts else np.zeros(0)


def compare(grads, reference) -> tuple[float, float]:
    """(cosine, relative L2 error |a - b| / |b|) of two gradient trees, in float64."""
    a, b = flat(grads), flat(reference)
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    return float(a @ b / (na * nb)), float(np.linalg.norm(a - b) / nb)
