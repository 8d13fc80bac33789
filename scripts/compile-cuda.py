#!/usr/bin/env python3
"""Compile every CUDA kernel (attention: the scalar float32 kernels and the tensor-core ones for
float16/bfloat16 with a store of the same dtype or a float32 one; the delta rule's scans; the
chunked delta rule's six kernels, metal_kernels/delta/chunked.py, for float32, float16 and
bfloat16 at the head dims blocks.CUDA has, prepare with and without KEEP) with nvcc, as MLX would
hand it to NVRTC (metal_kernels/cuda_source), for each head dim: a build check where no GPU runs
them. Prints each failure's errors; with --ptxas, a table of each kernel's registers, spills and
shared memory from ptxas (-Xptxas -v).

    compile-cuda.py [--arch sm_90] [--dims 64 128 256] [--ptxas] [--only tc|scalar|delta|chunked]
"""

import argparse
import importlib
import inspect
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

import metal_kernels.attention as A
import metal_kernels.delta as delta_kernels
from metal_kernels import cuda_source
from metal_kernels.build import header_files
from metal_kernels.delta import blocks as delta_blocks
from metal_kernels.delta import chunked

TC = importlib.import_module("metal_kernels.attention.tensor_cores")
NAMES = {mx.float32: "f32", mx.float16: "f16", mx.bfloat16: "bf16"}
# (queries' dtype, store's dtype): float32 on the scalar kernels; the others on tensor cores
CASES = (
    (mx.float32, mx.float32),
    (mx.bfloat16, mx.bfloat16),
    (mx.float16, mx.float16),
    (mx.bfloat16, mx.float32),
    (mx.float16, mx.float32),
)


def _cuda(fn) -> dict:
    """The scalar kernels' launch builders take a backend where Metal's geometry differs."""
    return {"backend": "cuda"} if "backend" in inspect.signature(fn).parameters else {}


def launches(dim: int, dtype: mx.Dtype, store: mx.Dtype):
    """(label, launch) of each attention kernel for a case."""
    q, k = mx.zeros((1, 4, 40, dim), dtype), mx.zeros((1, 2, 40, dim), dtype)
    pk = mx.zeros((1, 2, 100, dim), store)
    lse = delta = mx.zeros((1, 4, 40))
    tag = f"{dim} {NAMES[dtype]}/{NAMES[store]}"
    if dtype == mx.float32:
        calls = [
            A.forward_launch(q, k, k, pk, pk, 60, 0.1, **_cuda(A.forward_launch)),
            *A.backward_launches(
                q, k, k, pk, pk, 60, 20, 0.1, lse, delta, q, **_cuda(A.backward_launches)
            ),
        ]
    else:
        calls = [
            TC.forward_launch(q, k, k, pk, pk, 60, 0.1),
            *TC.backward_launches(q, k, k, pk, pk, 60, 20, 0.1, lse, delta, q),
        ]
    for call in calls:
        yield f"{call.spec.stem.removeprefix('attention/')} {tag}", call


def delta_launches(dk: int):
    n, h, c, dv = 2, 3, 64, 128
    z = mx.zeros
    for keep in (True, False):
        yield (
            f"delta/scan {dk} keep={keep}",
            delta_kernels.scan_launch(
                z((n, h, c, dv)),
                *[z((n, h, c, dk))] * 2,
                z((n, h, c, c)),
                z((n, h, c, dk)),
                z((n, h)),
                z((h, dv, dk)),
                keep,
            ),
        )
    yield (
        f"delta/scan_back {dk}",
        delta_kernels.scan_back_launch(
            *[z((n, h, c, dk))] * 2,
            z((n, h, c, c)),
            z((n, h, c, dk)),
            z((n, h)),
            z((n, h, c, dv)),
            z((h, dv, dk)),
        ),
    )


def chunked_launches(dim: int, dtype: mx.Dtype):
    """(label, launch) of each chunked delta-rule kernel at head dim `dim` (dk = dv), 2 key and
    4 value heads, 100 positions, on CUDA's geometry."""
    if dim not in delta_blocks.CUDA_DIMS:
        return
    b, t, hk, hv = 1, 100, 2, 4
    s = chunked.Sizes(b, t, hk, hv, dim, dim)
    n, np_, z, f = s.chunks, s.padded, mx.zeros, mx.float32
    q = k = z((b, t, hk, dim), dtype)
    v = dy = z((b, t, hv, dim), dtype)
    gate = z((b, t, hv), f)
    cum, w, u = z((b, hv, np_), f), z((b, hv, np_, dim), f), z((b, hv, np_, dim), f)
    h = z((b, n, hv, dim, dim), f)
    state, tri, dcum = z((b, hv, dim, dim), f), z((b, hv, n, 64, 64), f), z((b, hv, 1, np_), f)
    calls = [
        chunked.prepare_launch(s, k, v, gate, gate, True, "cuda"),
        chunked.prepare_launch(s, k, v, gate, gate, False, "cuda"),
        chunked.states_launch(s, k, w, u, cum, state, "cuda"),
        chunked.output_launch(s, q, k, cum, h, u, "cuda"),
        chunked.states_back_launch(s, q, k, w, cum, dy, state, "cuda"),
        chunked.grads_launch(s, q, k, cum, h, u, h, u, dy, "cuda"),
        chunked.prepare_back_launch(s, k, v, gate, cum, tri, w, u, z(q.shape, f), dcum, "cuda"),
    ]
    for call in calls:
        keep = dict(call.template).get("KEEP")
        tag = "" if keep is None else f" keep={keep}"
        yield f"{call.spec.stem} {dim} {NAMES[dtype]}{tag}", call


def ptxas_table(stderr: str, labels: list[str], calls: list) -> list[str]:
    """One row per kernel from ptxas's report: registers, spills, stack, shared memory."""
    rows, current = {}, None
    for line in stderr.splitlines():
        m = re.search(r"Compiling entry function '_ZN3mlx4core2cu\d+(k\d+)E", line)
        if m:
            current = int(m.group(1)[1:])
            rows[current] = {}
        elif current is not None:
            m = re.search(
                r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill", line
            )
            if m:
                rows[current].update(stack=int(m[1]), stores=int(m[2]), loads=int(m[3]))
            m = re.search(r"Used (\d+) registers", line)
            if m:
                rows[current]["regs"] = int(m[1])
    out = [
        "| kernel | head dim | T/S | threads | registers | spill stores/loads B | stack B "
        "| dynamic shared B | blocks an SM (regs, smem) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for i, (label, call) in enumerate(zip(labels, calls)):
        r = rows.get(i, {})
        threads = call.threadgroup[0]
        regs = r.get("regs", 0)
        by_regs = 65536 // max(1, ((regs + 7) // 8 * 8) * threads) if regs else 0
        by_smem = 233472 // (call.shared_memory + 1024) if call.shared_memory else 32
        parts = label.split()
        out.append(
            f"| {parts[0]} | {parts[1]} | {' '.join(parts[2:])} | {threads} | {regs} | "
            f"{r.get('stores', '?')}/{r.get('loads', '?')} | {r.get('stack', '?')} | "
            f"{call.shared_memory} | {min(by_regs, by_smem)} ({by_regs}, {by_smem}) |"
        )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--arch", default="sm_90", help="sm_90; MLX's NVRTC builds sm_90a on Hopper")
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--nvcc", nargs="*", default=[], help="more nvcc flags")
    p.add_argument("--ptxas", action="store_true", help="registers and spills per kernel")
    p.add_argument(
        "--only", choices=["tc", "scalar", "delta", "chunked"], help="one kind of kernel"
    )
    p.add_argument("--keep", help="write the translation unit here")
    a = p.parse_args()
    labels, calls, units, headers = [], [], [], {}
    for dim in a.dims:
        for dtype, store in CASES:
            kind = "scalar" if dtype == mx.float32 else "tc"
            found = list(launches(dim, dtype, store)) if a.only in (None, kind) else []
            if dtype == mx.float32 and a.only in (None, "delta"):
                found += list(delta_launches(dim))
            if store == dtype and a.only in (None, "chunked"):
                found += list(chunked_launches(dim, dtype))
            for label, call in found:
                labels.append(label)
                calls.append(call)
                units.append(cuda_source.render(call, f"k{len(units)}", header=False))
                for path in header_files(call.spec, "cuda"):  # each once, in order of first use
                    headers.setdefault(path, path.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernels.cu"
        src.write_text(cuda_source.PRELUDE + "\n".join(headers.values()) + "\n".join(units))
        if a.keep:
            Path(a.keep).write_text(src.read_text())
        out = str(Path(tmp) / "k.o")
        flags = [*a.nvcc, "-Xptxas", "-v"] if a.ptxas else a.nvcc
        cmd = ["nvcc", f"-arch={a.arch}", "-std=c++17", *flags, "-c", "-o", out, str(src)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            print(done.stderr[-6000:])
            return done.returncode
        if a.ptxas:
            print("\n".join(ptxas_table(done.stderr, labels, calls)))
        warnings = [
            line
            for line in done.stderr.splitlines()
            if "warning" in line.lower() and "ptxas info" not in line
        ]
        print("\n".join(warnings[:20]))
        print(f"{len(units)} kernels compiled ({a.arch})")
        return 0


if __name__ == "__main__":
    sys.exit(main())
