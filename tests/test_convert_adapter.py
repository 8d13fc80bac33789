"""Adapters that cross over: a PEFT LoRA adapter converted to mlx-lm's format gives mlx-lm the
logits transformers gives with the original, and an mlx-lm adapter converted to PEFT's gives
transformers mlx-lm's logits (the bundled tiny model, float32, in both frameworks)."""

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from .extras import needs_torch  # noqa: E402

needs_torch()
pytestmark = pytest.mark.torch

import mlx_lm  # noqa: E402
import peft  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from mlx_lm.tuner.utils import linear_to_lora_layers  # noqa: E402

from mlxwalk import tiny  # noqa: E402
from mlxwalk.plan import PlanError  # noqa: E402
from mlxwalk.training import adapters  # noqa: E402
from mlxwalk.training.convert import convert  # noqa: E402

IDS = [[3, 17, 42, 99, 7, 250, 1, 64, 128, 33, 5, 200]]
KEYS = ["self_attn.q_proj", "self_attn.v_proj"]


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def hf_model(base):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)


def hf_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits.numpy()


def mlx_logits(model) -> np.ndarray:
    return np.array(model(mx.array(IDS)).astype(mx.float32))


def test_the_base_model_agrees_across_frameworks():
    base = tiny.path("tiny-qwen2")
    model, _ = mlx_lm.load(str(base))
    assert rel(mlx_logits(model), hf_logits(hf_model(base))) < 1e-4


def test_peft_to_mlx_lm(tmp_path):
    base = tiny.path("tiny-qwen2")
    config = peft.LoraConfig(
        r=4,
        lora_alpha=12,
        target_modules=["q_proj", "v_proj"],
        layers_to_transform=[2, 3],
        init_lora_weights=False,
    )
    model = peft.get_peft_model(hf_model(base), config)
    model.save_pretrained(str(tmp_path / "peft"))
    want = hf_logits(model)
    assert convert(tmp_path / "peft", tmp_path / "mlx", model=base) == "mlx"
    mlx_model, _ = mlx_lm.load(str(base), adapter_path=str(tmp_path / "mlx"))
    got = mlx_logits(mlx_model)
    print(f"PEFT -> mlx-lm: logits relative error {rel(got, want):.1e}")
    assert rel(got, want) < 1e-4
    assert rel(got, hf_logits(hf_model(base))) > 1e-2  # the adapter does change the logits


def test_mlx_lm_to_peft(tmp_path):
    base = tiny.path("tiny-qwen2")
    model, _ = mlx_lm.load(str(base))
    model.freeze()
    lora = adapters.LoraConfig(rank=4, scale=3.0, num_layers=2, keys=KEYS)
    linear_to_lora_layers(model, 2, lora.parameters())
    mx.random.seed(0)
    for _, m in model.named_modules():
        if hasattr(m, "lora_b"):
            m.lora_b = 0.05 * mx.random.normal(m.lora_b.shape)
    adapters.save(model, tmp_path / "mlx", lora)
    want = mlx_logits(model)
    assert convert(tmp_path / "mlx", tmp_path / "peft", model=base) == "peft"
    hf = peft.PeftModel.from_pretrained(hf_model(base), str(tmp_path / "peft"))
    print(f"mlx-lm -> PEFT: logits relative error {rel(hf_logits(hf), want):.1e}")
    assert rel(hf_logits(hf), want) < 1e-4


def test_refusals(tmp_path):
    base = tiny.path("tiny-qwen2")
    with pytest.raises(PlanError, match="no adapter there"):
        convert(tmp_path, tmp_path / "out")
    config = peft.LoraConfig(r=2, lora_alpha=2, target_modules=["q_proj"], layers_to_transform=[0])
    peft.get_peft_model(hf_model(base), config).save_pretrained(str(tmp_path / "first"))
    with pytest.raises(PlanError, match=r"layers \[0\] are not the model's last 1 of 4"):
        convert(tmp_path / "first", tmp_path / "out", model=base)
    assert not (tmp_path / "out").exists()  # nothing half-written
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(PlanError, match="exists and is not an empty folder"):
        convert(tmp_path / "first", tmp_path / "full", model=base)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlxwalk",
            "convert-adapter",
            str(tmp_path / "first"),
            str(tmp_path / "out2"),
            "--model",
            str(base),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert done.stderr.startswith("mlxwalk: error: ") and "Traceback" not in done.stderr
    assert json.loads((tmp_path / "first" / "adapter_config.json").read_text())["r"] == 2
