"""LoRA adapters in mlx-lm's format: applied with mlx-lm's own layers, saved and loaded as
`adapters.safetensors` + `adapter_config.json`, which `mlx_lm.load(..., adapter_path=...)`,
`mlx_lm.generate --adapter-path` and `mlx_lm.fuse` accept."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import ConfigError, ModelError
from .files import save_safetensors, write_text

LINEAR_TYPES = ("Linear", "QuantizedLinear", "SwitchLinear", "QuantizedSwitchLinear")


@dataclass
class LoraConfig:
    rank: int = 8
    scale: float = 20.0
    dropout: float = 0.0
    num_layers: int = 16  # the last layers that get adapters; -1 = all
    keys: list[str] | None = field(default=None)  # module keys within a layer; None = mlx-lm's

    def parameters(self) -> dict:
        p = {"rank": self.rank, "scale": self.scale, "dropout": self.dropout}
        if self.keys:
            p["keys"] = list(self.keys)
        return p


def layers_of(model: nn.Module, lora: LoraConfig) -> list[nn.Module]:
    n = len(model.layers) if lora.num_layers < 0 else lora.num_layers
    return list(model.layers)[-n:] if n else []


def check(model: nn.Module, lora: LoraConfig) -> None:
    """Refuse, naming the flag, a target key that names no linear layer among the adapted ones.
    (More layers than the model has means all of them, as in mlx-lm.)"""
    if not lora.keys:
        return
    found = {
        name
        for layer in layers_of(model, lora)
        for name, m in layer.named_modules()
        if type(m).__name__ in LINEAR_TYPES or hasattr(m, "to_lora")
    }
    for key in lora.keys:
        if key not in found:
            have = ", ".join(sorted(found)[:12]) + (", ..." if len(found) > 12 else "")
            raise ConfigError(
                f"--targets: {key!r} is not a linear layer of the adapted layers; they have {have}"
            )


def apply(model: nn.Module, lora: LoraConfig) -> nn.Module:
    """Freeze the model and put LoRA layers on its last `num_layers` layers."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    check(model, lora)
    model.freeze()
    n = len(model.layers) if lora.num_layers < 0 else lora.num_layers
    linear_to_lora_layers(model, n, lora.parameters())
    return model


def load_strict(model: nn.Module, weights: dict, source: str) -> None:
    """Load adapter weights that must match the model's trainable parameters exactly: the same
    names, the same shapes; a mismatch is refused, naming the first one."""
    want = dict(tree_flatten(model.trainable_parameters()))
    missing = sorted(set(want) - set(weights))
    extra = sorted(set(weights) - set(want))
    if missing or extra:
        name = (missing or extra)[0]
        why = "missing from it" if missing else "not a trainable parameter of this model"
        raise ModelError(
            f"{source}: adapter tensor {name} is {why} ({len(missing)} missing, "
            f"{len(extra)} unexpected): it was trained with another LoRA layout or model"
        )
    for name, w in want.items():
        if tuple(weights[name].shape) != tuple(w.shape):
            raise ModelError(
                f"{source}: adapter tensor {name} has shape {tuple(weights[name].shape)}, the "
                f"model's is {tuple(w.shape)}: it was trained with another rank or model"
            )
    model.load_weights(list(weights.items()), strict=False)


def dropout(model: nn.Module) -> float:
    """The largest dropout probability among the model's dropout layers (LoRA's), 0 if none."""
    return max(
        (1.0 - m._p_1 for _, m in model.named_modules() if isinstance(m, nn.Dropout)), default=0.0
    )


def save(model: nn.Module, folder: Path, lora: LoraConfig) -> None:
    """adapters.safetensors and adapter_config.json, each written atomically."""
    folder = Path(folder)
    weights = dict(tree_flatten(model.trainable_parameters()))
    save_safetensors(folder / "adapters.safetensors", weights)
    config = {
        "fine_tune_type": "lora",
        "num_layers": len(model.layers) if lora.num_layers < 0 else lora.num_layers,
        "lora_parameters": lora.parameters(),
    }
    write_text(folder / "adapter_config.json", json.dumps(config, indent=2))
