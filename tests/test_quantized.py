"""Quantized base models (mlx-lm's 4-bit and 8-bit, LoRA over QuantizedLinear): the walk is
exact against one graph over the same quantized model, `mlxwalk train` takes their folders, and
mlx-lm generates with the adapter and fuses it."""

import json
import subprocess
import sys

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx import nn

from mlxwalk import tiny, window_gradient
from mlxwalk.commands.walk_exact import prepare
from mlxwalk.grading import compare
from mlxwalk.training.config import TrainConfig
from mlxwalk.training.run import train_run

N = 192
IDS = np.random.default_rng(5).integers(0, 256, N + 1)


@pytest.mark.parametrize("name", sorted(tiny.QUANTIZED))
def test_a_quantized_model_walks_exactly(name):
    model, _ = mlx_lm.load(str(tiny.path(name)))
    prepare(model)
    quantized = [m for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert quantized, "the LoRA layers sit over QuantizedLinear"
    w = np.r_[np.zeros(50), np.ones(N - 50)]
    _, one = window_gradient(model, IDS[:-1], IDS[1:], w, chunk=N, walk="one-graph")
    _, exact = window_gradient(model, IDS[:-1], IDS[1:], w, chunk=48)
    _, plain = window_gradient(model, IDS[:-1], IDS[1:], w, chunk=48, walk="plain")
    cosine, err = compare(exact, one)
    print(f"{name}: exact vs one graph cosine {cosine:.6f}, relative L2 error {err:.1e}")
    assert cosine >= 0.99999 and err <= 2e-5
    assert compare(plain, one)[0] < 0.95


def test_train_on_a_quantized_folder_then_generate_and_fuse(tmp_path):
    base = tiny.path("tiny-qwen2-4bit")
    out = tmp_path / "run"
    cfg = TrainConfig(
        model=str(base),
        iters=2,
        epochs=1,
        window=256,
        chunk=64,
        adapter_path=str(out),
        progress=False,
    )
    train_run(cfg, echo=lambda *a: None)
    model, tokenizer = mlx_lm.load(str(base), adapter_path=str(out))
    text = mlx_lm.generate(model, tokenizer, prompt="hello", max_tokens=4)
    assert isinstance(text, str)
    fused = tmp_path / "fused"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_lm",
            "fuse",
            "--model",
            str(base),
            "--adapter-path",
            str(out),
            "--save-path",
            str(fused),
            "--dequantize",
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "quantization" not in json.loads((fused / "config.json").read_text())
    ids = mx.array(IDS[:64])[None]
    want = np.array(model(ids))
    got = np.array(mlx_lm.load(str(fused))[0](ids))
    err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    print(f"fused (dequantized) against the adapter over the 4-bit model: logits error {err:.1e}")
    assert err <= 2e-5  # float32 rounding (reads 3.2e-6)
