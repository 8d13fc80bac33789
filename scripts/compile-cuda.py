#!/usr/bin/env python3
"""Compile every CUDA kernel (attention, the delta rule's scans) with nvcc, as MLX would hand it
to NVRTC (metal_kernels/cuda_source), for each head dim and dtype: a build check where no GPU runs
them. Prints each failure's errors.

    compile-cuda.py [--arch sm_90] [--dims 64 128 256]
"""

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402

import metal_kernels.attention as A  # noqa: E402
import metal_kernels.delta as delta_kernels  # noqa: E402
from metal_kernels import cuda_source  # noqa: E402
from metal_kernels.build import ROOT  # noqa: E402


def launches(dim: int, dtype: mx.Dtype, store: mx.Dtype):
    q, k = mx.zeros((1, 4, 40, dim), dtype), mx.zeros((1, 2, 40, dim), dtype)
    pk = mx.zeros((1, 2, 100, dim), store)
    lse = delta = mx.zeros((1, 4, 40))
    for tc in (False, True) if dtype != mx.float32 else (False,):
        yield A.forward_launch(q, k, k, pk, pk, 60, 0.1, tc)
        yield from A.backward_launches(q, k, k, pk, pk, 60, 20, 0.1, lse, delta, q, tc)


def delta_launches(dk: int):
    n, h, c, dv = 2, 3, 64, 128
    z = mx.zeros
    for keep in (True, False):
        yield delta_kernels.scan_launch(z((n, h, c, dv)), *[z((n, h, c, dk))] * 2,
                                        z((n, h, c, c)), z((n, h, c, dk)), z((n, h)),
                                        z((h, dv, dk)), keep)  # fmt: skip
    yield delta_kernels.scan_back_launch(*[z((n, h, c, dk))] * 2, z((n, h, c, c)),
                                         z((n, h, c, dk)), z((n, h)), z((n, h, c, dv)),
                                         z((h, dv, dk)))  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--nvcc", nargs="*", default=[], help="more nvcc flags, e.g. -Xptxas=-v")
    a = p.parse_args()
    units, headers = [], {}
    for dim in a.dims:
        for dtype, store in ((mx.float32, mx.float32), (mx.bfloat16, mx.bfloat16),
                             (mx.float16, mx.float32)):  # fmt: skip
            calls = list(launches(dim, dtype, store))
            calls += list(delta_launches(dim)) if dtype == mx.float32 else []
            for call in calls:
                units.append(cuda_source.render(call, f"k{len(units)}", header=False))
                for h in call.spec.headers:  # each header file once, in order of first use
                    path = ROOT / call.spec.stem.rsplit("/", 1)[0] / f"{h}.cuh"
                    headers.setdefault(path, path.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernels.cu"
        src.write_text(cuda_source.PRELUDE + "\n".join(headers.values()) + "\n".join(units))
        out = str(Path(tmp) / "k.o")
        cmd = ["nvcc", f"-arch={a.arch}", "-std=c++17", *a.nvcc, "-c", "-o", out, str(src)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if a.nvcc:
            print(done.stderr[-20000:])
        print(
            done.stderr[-6000:] if done.returncode else f"{len(units)} kernels compiled ({a.arch})"
        )
        return done.returncode


if __name__ == "__main__":
    sys.exit(main())
