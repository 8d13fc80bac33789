#!/usr/bin/env python3
"""One window, one adapter, two frameworks, float32 on this machine's CPU: the loss and the LoRA
gradient from mlxwalk on MLX (one graph, and the exact walk in 4 chunks) and from the torch
backend on transformers + PEFT (one graph, and the torch walk's exact walk in 4 chunks), the
adapter crossing over through convert-adapter. Prints each one's relative error against MLX's
one graph.

    scripts/check-cross-backend.py
"""

import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import peft
from mlx.utils import tree_flatten

from mlxwalk import tiny, use_openblas
from mlxwalk.torch_backend import model as models
from mlxwalk.torch_backend.walk import window_gradient as torch_gradient
from mlxwalk.training import adapters
from mlxwalk.training.convert import convert
from mlxwalk.walk import Window, one_graph, window_gradient

use_openblas()  # MLX's CPU matrix products on OpenBLAS (mlxwalk/_blas.py)


def main() -> int:
    rng = np.random.default_rng(0)
    n = 256
    ids = rng.integers(0, 256, n + 1)
    x, y = ids[:-1], ids[1:]
    w = (rng.uniform(size=n) > 0.3).astype(np.float32)
    w[: n // 4] = 0
    base = tiny.path("tiny-qwen2")
    model, _ = mlx_lm.load(str(base))
    lora = adapters.LoraConfig(
        rank=4, scale=3.0, num_layers=2, keys=["self_attn.q_proj", "self_attn.v_proj"]
    )
    mx.random.seed(0)  # the adapter's start (A random, B below)
    adapters.apply(model, lora)
    for _, m in model.named_modules():
        if hasattr(m, "lora_b"):
            m.lora_b = 0.05 * mx.random.normal(m.lora_b.shape)
    results = {}
    loss, grads = one_graph(model, Window.of(x, y, w))
    results["MLX one graph"] = (loss.item(), dict(tree_flatten(grads)))
    loss, grads = window_gradient(model, x, y, w, chunk=n // 4)
    results["MLX exact walk, 4 chunks"] = (loss, dict(tree_flatten(grads)))
    with tempfile.TemporaryDirectory() as tmp:
        adapters.save(model, Path(tmp) / "mlx", lora)
        convert(Path(tmp) / "mlx", Path(tmp) / "peft", model=base)
        hf = peft.PeftModel.from_pretrained(
            models.load(base), str(Path(tmp) / "peft"), is_trainable=True
        )
        for walk, what in (
            ("one-graph", "torch one graph"),
            ("exact", "torch exact walk, 4 chunks"),
        ):
            loss, g = torch_gradient(hf, x, y, w, walk=walk, chunk=n // 4)
            results[what] = (loss, {k: v.T for k, v in g.items()})

    def flat(g: dict) -> np.ndarray:
        """Every gradient in (layer, module, A/B) order, whichever framework named it."""
        order = sorted(g, key=lambda k: k.replace("base_model.model.", "").split("."))
        return np.concatenate([np.asarray(g[k]).ravel() for k in order])

    ref_loss, ref = results["MLX one graph"]
    ref_flat = flat(ref)
    print(
        "tiny-qwen2, window 256 (a quarter context), LoRA r4 on q/v of the last 2 layers, float32"
    )
    print("| path | loss | loss rel. error | LoRA gradient rel. L2 error |\n|---|---:|---:|---:|")
    for what, (loss, g) in results.items():
        got = flat(g)
        err = np.linalg.norm(got - ref_flat) / np.linalg.norm(ref_flat)
        print(f"| {what} | {loss:.7f} | {abs(loss - ref_loss) / ref_loss:.1e} | {err:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
