#!/usr/bin/env python3
"""The gated delta rule in torch, one layer, forward and forward+backward, side by side in one
process: flash-linear-attention's `chunk_gated_delta_rule` (Triton) where it is installed and
runs, against mlxwalk's chunked torch op (`mlxwalk/torch_backend/delta.py`). First a check:
both on the same inputs (a non-zero initial state), the relative L2 error of the output, the
final state and every input's gradient.

    scripts/bench-delta-torch.py [--lengths 4096 16384 65536] [--key-heads 16 --value-heads 32]
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

import torch

from mlxwalk import use_openblas
from mlxwalk.torch_backend import delta

use_openblas()  # MLX's CPU matrix products on OpenBLAS (mlxwalk/_blas.py)

GIB = 1 << 30


def inputs(t, hk, hv, d, device, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    q = 0.1 * rnd(1, t, hk, d)
    k = torch.nn.functional.normalize(rnd(1, t, hk, d), dim=-1)
    v = rnd(1, t, hv, d)
    log_g = -0.5 * torch.rand(1, t, hv, generator=g) - 1e-3
    beta = torch.sigmoid(rnd(1, t, hv))
    s0 = 0.1 * rnd(1, hv, d, d)  # (B, Hv, Dv, Dk)
    xs = [x.to(device, dtype) for x in (q, k, v)] + [x.to(device) for x in (log_g, beta, s0)]
    return [x.requires_grad_() for x in xs]


def ours(q, k, v, log_g, beta, s0):
    return delta.gated_delta(q, k, v, log_g, beta, s0, 64)


def fla_chunk(q, k, v, log_g, beta, s0):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    y, s = chunk_gated_delta_rule(
        q,
        k,
        v,
        log_g,
        beta.to(q.dtype),
        scale=1.0,
        initial_state=s0,
        output_final_state=True,
        state_v_first=True,
    )
    return y, s


def grads(fn, xs):
    y, s = fn(*xs)
    gy = torch.ones_like(y) * 0.01
    out = torch.autograd.grad((y, s), xs, (gy, torch.ones_like(s) * 0.01))
    return [y.detach(), s.detach(), *out]


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / (b.norm() + 1e-30))


def timed(fn, xs, backward: bool, repeats: int) -> tuple[float, float]:
    def step():
        if backward:
            return grads(fn, xs)
        with torch.no_grad():
            return fn(*xs)

    step()  # warm-up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2], (torch.cuda.max_memory_allocated() - base) / GIB


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    p.add_argument("--key-heads", type=int, default=16)
    p.add_argument("--value-heads", type=int, default=32)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("bench-delta-torch: no CUDA device")
        return 1
    dev = torch.device("cuda")
    print(
        f"torch {torch.__version__} on {torch.cuda.get_device_name()}; layer {a.key_heads}/"
        f"{a.value_heads} heads, dim {a.dim}, bf16 inputs, float32 state"
    )
    try:
        import fla
        import triton

        print(f"flash-linear-attention {fla.__version__}, triton {triton.__version__}")
        paths = {"flash-linear-attention": fla_chunk, "mlxwalk torch op": ours}
    except ImportError as e:
        print(f"flash-linear-attention not importable: {e}")
        paths = {"mlxwalk torch op": ours}

    xs = inputs(2048, a.key_heads, a.value_heads, a.dim, dev, torch.float32)
    want = grads(ours, xs)
    names = ["y", "final state", "dq", "dk", "dv", "dlog_g", "dbeta", "dstate"]
    for name, fn in paths.items():
        try:
            got = grads(fn, xs)
            errs = ", ".join(f"{n} {rel(g, w):.1e}" for n, g, w in zip(names, got, want))
            print(f"check float32 T=2048 {name} vs mlxwalk torch op: {errs}")
        except Exception as e:  # the backward may refuse on this GPU; say what it said
            print(f"check {name}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            traceback.print_exc(limit=3)

    print("\n| T | path | forward s | fwd+bwd s | fwd+bwd peak GiB |\n|---:|---|---:|---:|---:|")
    for t in a.lengths:
        xs = inputs(t, a.key_heads, a.value_heads, a.dim, dev, torch.bfloat16)
        for name, fn in paths.items():
            fwd, _ = timed(fn, xs, False, a.repeats)
            try:
                both, peak = timed(fn, xs, True, a.repeats)
                row = f"{both:.4f} | {peak:.2f}"
            except Exception as e:
                row = f"{type(e).__name__}: {str(e).splitlines()[0][:120]} |"
            print(f"| {t:,} | {name} | {fwd:.4f} | {row} |", flush=True)
        del xs
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
