"""One window, one adapter, two frameworks: mlxwalk's loss and LoRA gradient on MLX (as one graph
and by the exact walk) against transformers + PEFT in torch on the same weights, float32. The
adapter crosses over through `convert-adapter`; the loss is sum(w CE) / sum(w) in both."""

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
from mlx.utils import tree_flatten  # noqa: E402

from mlxwalk import tiny  # noqa: E402
from mlxwalk.training import adapters  # noqa: E402
from mlxwalk.training.convert import convert  # noqa: E402
from mlxwalk.walk import Window, one_graph, window_gradient  # noqa: E402

KEYS = ["self_attn.q_proj", "self_attn.v_proj"]


def window(n=64, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 256, n + 1)
    weights = (rng.uniform(size=n) > 0.3).astype(np.float32)
    weights[: n // 4] = 0  # a context that takes no loss
    return ids[:-1], ids[1:], weights


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_loss_and_gradient_agree_across_frameworks(tmp_path):
    base = tiny.path("tiny-qwen2")
    model, _ = mlx_lm.load(str(base))
    lora = adapters.LoraConfig(rank=4, scale=3.0, num_layers=2, keys=KEYS)
    adapters.apply(model, lora)
    mx.random.seed(0)
    for _, m in model.named_modules():
        if hasattr(m, "lora_b"):
            m.lora_b = 0.05 * mx.random.normal(m.lora_b.shape)
    adapters.save(model, tmp_path / "mlx", lora)
    x, y, w = window()
    loss, grads = one_graph(model, Window.of(x, y, w))
    walked_loss, walked = window_gradient(model, x, y, w, chunk=16)  # four chunks, exact

    convert(tmp_path / "mlx", tmp_path / "peft", model=base)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(hf, str(tmp_path / "peft"), is_trainable=True)
    logits = hf(torch.tensor(x)[None]).logits[0]
    ce = torch.nn.functional.cross_entropy(logits, torch.tensor(y), reduction="none")
    t_loss = (ce * torch.tensor(w)).sum() / float(w.sum())
    t_loss.backward()
    t_grads = {
        n.removeprefix("base_model.model.").replace(".default", ""): p.grad.numpy()
        for n, p in hf.named_parameters()
        if p.requires_grad
    }

    for value in (loss.item(), walked_loss):
        print(f"MLX against torch: loss relative error {abs(value / t_loss.item() - 1):.1e}")
        assert abs(value - t_loss.item()) <= 1e-6 * abs(t_loss.item())
    for source in (grads, walked):
        flat = dict(tree_flatten(source))
        assert len(flat) == len(t_grads) == 8
        errors = {}
        for name, g in flat.items():
            path, ab = name.rsplit(".lora_", 1)
            errors[name] = rel(np.array(g), t_grads[f"{path}.lora_{ab.upper()}.weight"].T)
        worst = max(errors, key=errors.get)
        print(f"MLX against torch: worst LoRA gradient {worst}, relative error {errors[worst]:.1e}")
        assert errors[worst] <= 2e-5, worst  # float32's exact bar (reads 8e-6 at worst)
