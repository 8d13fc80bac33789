#!/usr/bin/env python3
"""MLX's CPU float32 matmul on each BLAS mlxwalk can route it to (mlxwalk/_blas.py): the reference
BLAS MLX's Linux wheel links, the scipy-openblas32 wheel pip installs, a system OpenBLAS. Each in
its own process (the routing is per process), one after the other on the same machine.

    scripts/bench-blas.py [--n 2048] [--repeats 5]
"""

import argparse
import os
import platform
import subprocess
import sys

SYSTEM = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
PROBE = """
import time, mlxwalk, mlxwalk._blas as b, mlx.core as mx
n, r = {n}, {r}
a = mx.random.normal((n, n)); mx.eval(a @ a)
t = time.perf_counter()
for _ in range(r): mx.eval(a @ a)
print(f"{{2 * n**3 * r / (time.perf_counter() - t) / 1e9:.1f}}", b.loaded)
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    print(f"{platform.machine()}, {os.cpu_count()} cores; float32 {a.n}x{a.n} matmul")
    print("| BLAS | GFLOP/s |\n|---|---:|")
    for name, choice in (
        ("reference (MLX's wheel)", "off"),
        ("scipy-openblas32 (pip)", ""),
        ("system OpenBLAS", SYSTEM),
    ):
        if choice == SYSTEM and not os.path.exists(SYSTEM):
            print(f"| {name} | not installed |")
            continue
        env = {**os.environ, "MLXWALK_BLAS": choice}
        code = PROBE.format(n=a.n, r=a.repeats if choice != "off" else 1)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        rate = out.stdout.split()[0] if out.returncode == 0 else "failed: " + out.stderr[-200:]
        print(f"| {name} | {rate} |")


if __name__ == "__main__":
    main()
