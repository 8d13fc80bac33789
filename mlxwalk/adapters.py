"""LoRA adapters in mlx-lm's format: applied with mlx-lm's own layers, saved and loaded as
`adapters.safetensors` + `adapter_config.json`, which `mlx_lm.load(..., adapter_path=...)`,
`mlx_lm.generate --adapter-path` and `mlx_lm.fuse` accept."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten


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


def apply(model: nn.Module, lora: LoraConfig) -> nn.Module:
    """Freeze the model and put LoRA layers on its last `num_layers` layers."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model.freeze()
    n = len(model.layers) if lora.num_layers < 0 else lora.num_layers
    linear_to_lora_layers(model, n, lora.parameters())
    return model


def dropout(model: nn.Module) -> float:
    """The largest dropout probability among the model's dropout layers (LoRA's), 0 if none."""
    return max((1.0 - m._p_1 for _, m in model.named_modules() if isinstance(m, nn.Dropout)),
               default=0.0)  # fmt: skip


def atomic_write(path: Path, write) -> None:
    """Write through `write(tmp_path)` into a temporary sibling, then rename over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def save(model: nn.Module, folder: Path, lora: LoraConfig) -> None:
    """adapters.safetensors and adapter_config.json, each written atomically."""
    folder = Path(folder)
    weights = dict(tree_flatten(model.trainable_parameters()))
    atomic_write(folder / "adapters.safetensors", lambda p: mx.save_safetensors(p, weights))
    config = {
        "fine_tune_type": "lora",
        "num_layers": len(model.layers) if lora.num_layers < 0 else lora.num_layers,
        "lora_parameters": lora.parameters(),
    }
    text = json.dumps(config, indent=2)
    atomic_write(folder / "adapter_config.json", lambda p: Path(p).write_text(text))
