#!/usr/bin/env python3
"""The attention kernels against their ops twin on this machine's GPU (or, with --harness, the
Metal kernels through the CPU harness): every head dim, grouped-query ratio and dtype.

Each output (the attention's output and dQ, dK, dV, the taps' dK and dV) is compared with the
float32 twin on the same inputs. float32 passes at a relative L2 error <= 1e-5 (run with
MLX_ENABLE_TF32=0 on CUDA); float16/bfloat16 pass when every output's error is within the
twin's own error in that dtype (x1.5, the twin's worst output: its outputs are cast to the dtype,
its taps' gradients are not; the tensor-core kernels round P and dS to the dtype before their
second product, as FlashAttention does, so every output carries that dtype's error).

    check-kernels.py               the GPU MLX runs on (Metal or CUDA)
    check-kernels.py --harness     the Metal kernels on the CPU (slow: keep --small)
"""

import argparse
import os
import sys

import mlx.core as mx

from metal_kernels import build, harness
from mlxwalk import use_openblas
from mlxwalk.ops import routing
from mlxwalk.ops.attention import check
from mlxwalk.ops.delta import scan

use_openblas()  # MLX's CPU matrix products on OpenBLAS (mlxwalk/_blas.py)

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def cases(small: bool):
    dims = (64, 128, 256)
    groups = (1, 7) if small else (1, 2, 4, 7, 8)
    for dim in dims:
        for g in groups:
            for name in ("float32", "float16", "bfloat16"):
                yield dim, g, name, name
    yield 128, 4, "bfloat16", "float32"  # a float32 store under a bfloat16 model
    yield 256, 2, "float16", "bfloat16"


def bar(dtype: str, twin_error: float) -> float:
    """The bar every output's kernel error must stay under; `twin_error`: the twin's worst."""
    return 1e-5 if dtype == "float32" else 1.5 * twin_error + 1e-6


def check_delta(backend: str, small: bool) -> int:
    """The delta rule's scans against the ops recurrence (float32, bar 1e-5): failures."""
    n, dv = (3, 32) if small else (6, 128)
    print(f"\n# delta-rule scans vs the ops recurrence: {n} chunks, value dim {dv}, two heads")
    print("| key dim | chunk | scan error | reverse scan error | ok |\n|---:|---:|---:|---:|---|")
    failed = 0
    for dk, c in ((64, 64), (128, 64), (128, 256)) if not small else ((64, 16), (128, 40)):
        e = scan.kernel_vs_twin(routing.ScanCase(backend, dk, c), n, dv)
        ok = max(e.values()) <= 1e-5
        failed += not ok
        print(
            f"| {dk} | {c} | {e['delta/scan']:.2e} | {e['delta/scan_back']:.2e} | "
            f"{'OK' if ok else 'FAIL'} |",
            flush=True,
        )
    return failed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--harness", action="store_true", help="the Metal kernels on the CPU")
    p.add_argument("--small", action="store_true", help="fewer cases and shapes")
    p.add_argument("--delta-only", action="store_true", help="the delta rule's scans only")
    a = p.parse_args()
    backend = "metal" if a.harness else build.current_backend()
    if backend is None:
        print("check-kernels: no GPU here; use --harness for the Metal kernels on the CPU")
        return 2
    if a.harness:
        routing.launch = harness.launch
    sizes = (
        check.Sizes(chunk=40, start=70, grad_from=25)
        if a.small
        else check.Sizes(kv_heads=2, chunk=300, start=777, grad_from=250)
    )
    print(
        f"# attention kernels vs the ops twin: {backend}, mlx {mx.__version__}, {sizes}, "
        f"TF32 {os.environ.get('MLX_ENABLE_TF32', 'default')}"
    )
    print("| head dim | GQA | dtype | store | worst kernel error | its output | twin's own | ok |")
    print("|---:|---:|---|---|---:|---|---:|---|")
    failed = 0
    for dim, g, name, store in [] if a.delta_only else cases(a.small):
        case = routing.AttentionCase(backend, DTYPES[name], dim, g)
        errors = check.errors(case, sizes, DTYPES[store])
        worst = max(errors, key=lambda k: errors[k][0])
        kernel_error, twin_error = errors[worst]
        limit = bar(name, max(e[1] for e in errors.values()))
        ok = all(e[0] <= limit for e in errors.values())
        failed += not ok
        bad = [f"{k} {e[0]:.2e} > {limit:.2e}" for k, e in errors.items() if e[0] > limit]
        verdict = "OK" if ok else "FAIL: " + ", ".join(bad)
        print(
            f"| {dim} | {g} | {name} | {store} | {kernel_error:.2e} | {worst} | "
            f"{twin_error:.2e} | {verdict} |",
            flush=True,
        )
    failed += check_delta(backend, a.small)
    print(f"{'all OK' if not failed else f'{failed} FAILED'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
