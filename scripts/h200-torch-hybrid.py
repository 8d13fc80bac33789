#!/usr/bin/env python3
"""The torch backend's hybrid walk on one GPU in one call, with no MLX on the machine:

  kernels:  the delta rule's CUDA kernels (delta_kernels.py) checked first thing in the process
            (the first kernels it compiles: the primary-context fix), dk 64 and 128, float32 and
            bfloat16, each output's relative error against the torch ops
  exact:    the torch backend's exactness rows (torch_backend/exactness.py, what
            `mlxwalk test-walk-exact --backend torch` prints) on CUDA for the bundled hybrids and
            tiny-qwen2, with MLXWALK_KERNELS=on (a kernel failure raises instead of falling back),
            then which (dk, dtype) the kernels served
  walk:     scripts/bench-torch.py's step on the 0.8B-shaped hybrid (random bf16 weights, LoRA r8
            on the last 16 layers), chunk 4,096: the exact walk with the kernels and with the
            torch ops (MLXWALK_KERNELS=off), transformers + PEFT with gradient checkpointing;
            median of --repeats after a warm-up (the warm-up also shown: the compiles fall in it)
  profile:  one window of each walk by layer kind (torch_backend/profile.py), GPU kernel time

The bundled models are generated with MLX: write them on a machine that has it and carry them,
    MLXWALK_HOME=$PWD/.tinyhome python -c "from mlxwalk import tiny; from
        mlxwalk.torch_backend import model as m; [m.tiny_folder(n) for n in
        ('tiny-qwen2', 'tiny-qwen3_5', 'tiny-qwen3_next')]"
then, on the GPU (carry .tinyhome):
    MLXWALK_HOME=$PWD/.tinyhome PYTHONPATH=$PWD python3 scripts/h200-torch-hybrid.py
The walk refuses a transformers outside the torch extra's range (an older one swallows its
cache): on a machine without a registry, carry the extra's own transformers, peft,
huggingface_hub, tokenizers, httpx2, httpcore2, truststore, anyio, h11, idna and accelerate
(their site-packages folders with their .dist-info, about 9 MiB as .tar.xz) and put them first
on PYTHONPATH; leave out `kernels` (its compiled part is for one Python version; transformers
runs without it). Only the -transformers folders
of the hybrids are read there: the MLX ones' weights may be left out (an empty
model.safetensors keeps the folder found).
Prints the tables last; the log goes to $OUT when set. `--small` checks the script on a CPU.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import sys
import time
from pathlib import Path

import torch

from mlxwalk.torch_backend import delta_kernels, exactness, profile
from mlxwalk.torch_backend import model as models

HERE = Path(__file__).resolve().parent
START = time.perf_counter()
MODELS = ("tiny-qwen3_5", "tiny-qwen3_next", "tiny-qwen2")
LINES: list[str] = []
TABLES: list[str] = []


def say(*parts) -> None:
    line = " ".join(str(p) for p in parts)
    LINES.append(line)
    print(line, flush=True)


def bench_torch():
    """scripts/bench-torch.py as a module (its build, measure and set_kind)."""
    sys.path.insert(0, str(HERE))
    spec = importlib.util.spec_from_file_location("bench_torch", HERE / "bench-torch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_kernels(device: str) -> None:
    for dim in (64, 128):
        for dtype in (torch.float32, torch.bfloat16):
            start = time.perf_counter()
            try:
                errors = delta_kernels.compare(dtype, dim, torch.device(device))
                worst = max(errors, key=errors.get)
                said = f"worst {worst} {errors[worst]:.1e}"
            except Exception as e:  # the first compile of the process is what is checked
                said = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            seconds = time.perf_counter() - start
            say(f"kernels dk {dim} {str(dtype)[6:]}: {said} ({seconds:.1f} s, compiles included)")


def check_exact(device: str) -> bool:
    os.environ["MLXWALK_KERNELS"] = "on"
    chosen = [(n, str(models.tiny_folder(n))) for n in MODELS]
    ok = exactness.run(chosen, echo=say, device=device)
    say(f"exactness rows on {device}: {'all OK' if ok else 'NOT all OK'}")
    served = sorted(delta_kernels.GATE.passed, key=str)
    say(f"kernels self-checked and serving: {served}; off because: {delta_kernels.GATE.failed}")
    return ok


def walk(a, bt, device: str) -> None:
    model = bt.build("hybrid", a.small, device)
    rows = [("exact", "auto", n) for n in a.windows] + [("exact", "off", n) for n in a.windows]
    rows += [("peft", "off", n) for n in a.windows[:1] if "peft" in a.kinds]
    rows = [r for r in rows if (r[1] == "off") <= ("ops" in a.kinds) or r[0] == "peft"]
    table = ["| window | step | delta rule | warm-up s | s | tokens/s | peak GiB | loss |"]
    table.append("|---:|---|---|---:|---:|---:|---:|---:|")
    for kind, kernels, n in rows:
        os.environ["MLXWALK_KERNELS"] = kernels
        rule = "kernels" if kernels == "auto" else "torch ops"
        if kind == "peft":
            rule = "transformers'"
        start = time.perf_counter()
        try:
            r = bt.measure(model, kind, n, a.chunk, "mlxwalk", a.repeats, 0.0)
            cold = time.perf_counter() - start - r["seconds"] * a.repeats
            row = (
                f"| {n:,} | {kind} | {rule} | {cold:.2f} | {r['seconds']:.2f} | "
                f"{r['tps']:,.0f} | {r['peak']:.1f} | {r['loss']:.4f} |"
            )
            say(row, r["phases"])
        except torch.OutOfMemoryError:
            row = f"| {n:,} | {kind} | {rule} | out of memory | | | | |"
            say(row)
        table.append(row)
        model.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    TABLES.append("\n".join(table))
    return model


def profile_walk(a, bt, model, kernels: str) -> None:
    """One window of the exact walk under the profiler, by layer kind."""
    if time.perf_counter() - START > a.budget:
        say(f"profile on {kernels}: skipped (past --budget)")
        return
    os.environ["MLXWALK_KERNELS"] = kernels
    n = a.profile_window
    bt.set_kind(model, "exact", "mlxwalk")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    win = bt.window(n, models.text_config(model).vocab_size)
    config = bt.TorchWalkConfig(chunk=a.chunk, store_dtype="bfloat16")
    start = time.perf_counter()
    p = profile.profile(model, functools.partial(bt.train_window, model, opt, win, config))
    rule = "kernels" if kernels == "auto" else "torch ops"
    took = time.perf_counter() - start
    TABLES.append(f"profile: exact walk, {n:,} tokens, delta rule on the {rule}\n{p.table()}")
    say(TABLES[-1], f"\n(profiled in {took:.0f} s)")
    top = sorted(p.kernels.items(), key=lambda kv: -kv[1])[:12]
    say("top kernels (ms):", "; ".join(f"{k[:70]} {v:.1f}" for k, v in top))
    model.zero_grad(set_to_none=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--windows", type=int, nargs="+", default=[16384, 65536])
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--skip", nargs="*", default=[], choices=("kernels", "exact", "walk"))
    p.add_argument("--kinds", nargs="*", default=["ops", "peft"], help="beside the kernels")
    p.add_argument("--profile-window", type=int, default=8192)
    p.add_argument("--budget", type=float, default=420, help="seconds before a stage is skipped")
    p.add_argument("--small", action="store_true")
    a = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    say(f"torch {torch.__version__}, transformers {models.transformers_version()} on {where}")
    if a.small:
        a.windows, a.chunk, a.profile_window = [256], 64, 256
    if device == "cuda" and "kernels" not in a.skip:
        check_kernels(device)
    bt = bench_torch()
    model = walk(a, bt, device) if "walk" not in a.skip else None
    if model is not None:
        profile_walk(a, bt, model, "auto")
    if "exact" not in a.skip:
        check_exact(device)
    if model is not None and "ops" in a.kinds:
        profile_walk(a, bt, model, "off")
    print("\n\n".join(TABLES))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "h200-torch-hybrid.log").write_text("\n".join(LINES) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
