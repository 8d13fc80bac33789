"""transformers models for the torch walk: what the plan needs to know of one (its footprint),
loading one from a local folder with a PEFT LoRA adapter, and the bundled tiny models as
transformers folders (the same weights as mlxwalk.tiny's, in transformers' layout)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file, save_file

from .. import tiny
from ..errors import ConfigError, ModelError
from ..plan import Footprint
from . import recurrent

# The RMSNorms a Qwen3.5 / Qwen3-Next checkpoint stores zero-centred (transformers applies
# 1 + w, mlx-lm shifts them by one at load time).
_CENTRED = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)


def text_config(model):
    config = model.config
    return getattr(config, "text_config", None) or config


def layer_kinds(model) -> list[str]:
    """ "attention" or "recurrent" per decoder layer."""
    cfg = text_config(model)
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    return ["recurrent" if t == "linear_attention" else "attention" for t in types]


def footprint(model) -> Footprint:
    """K/V elements per position of every attention layer; bytes of every recurrent layer's
    states (the conv window and the delta rule's float32 state) at a chunk boundary."""
    cfg = text_config(model)
    kinds = layer_kinds(model)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_width = kinds.count("attention") * 2 * cfg.num_key_value_heads * head_dim
    state = 0
    if "recurrent" in kinds:
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        conv = (2 * hk * dk + hv * dv) * cfg.linear_conv_kernel_dim * _bytes(model)
        state = kinds.count("recurrent") * (conv + hv * dk * dv * 4)
    return Footprint(kv_width, state)


def _bytes(model) -> int:
    return next(model.parameters()).element_size()


# pyproject's torch extra (transformers>=5.24,<5.26): the versions whose layers the walk drives
SUPPORTED = ((5, 24), (5, 26))


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def check_transformers(version: str | None = None) -> None:
    """Refuse a transformers outside SUPPORTED in one line. Before 5.24 its decoders take the
    cache as `past_key_values` and swallow the walk's `cache=` in **kwargs: the chunks would
    attend no prefix and carry no state, and the gradient would be wrong without a word."""
    version = version or transformers_version()
    parts = []
    for part in version.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit()) or "0"
        parts.append(int(digits))
    low, high = SUPPORTED
    if not low <= tuple(parts) < high:
        raise ConfigError(
            f"transformers {version} is not one the torch walk supports "
            f"(>={low[0]}.{low[1]},<{high[0]}.{high[1]}): pip install -e '.[torch]'"
        )


def load(
    folder: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | None = None,
    attention: str = "mlxwalk",
    delta_rule: str = "mlxwalk",
):
    """A causal LM from a local transformers folder; nothing is downloaded. Attention through
    the walk's (attention.py) unless `attention` names one of transformers' own; a hybrid's
    delta rule as `delta_rule` routes it (recurrent.py)."""
    from transformers import AutoModelForCausalLM

    from . import attention as walk_attention

    walk_attention.register()

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ModelError(f"{folder}: not a model folder (no config.json)")
    # use_kernels=False: transformers 5.25 kernelizes layers with kernels fetched from the Hub by
    # default where the `kernels` package is installed (it is a dependency of 5.25): a download,
    # refused offline, and another rotary embedding than the one the walk was checked on
    model = AutoModelForCausalLM.from_pretrained(
        str(folder),
        dtype=dtype,
        local_files_only=True,
        attn_implementation=attention,
        use_kernels=False,
    )
    model = model.to(device) if device else model
    recurrent.route(model, delta_rule)
    return model


def add_lora(
    model,
    rank: int = 8,
    alpha: float = 16.0,
    layers: int | None = None,
    keys: tuple[str, ...] = ("q_proj", "v_proj"),
    seed: int | None = None,
):
    """A PEFT LoRA adapter on `keys` of the last `layers` decoder layers (all by default). With
    `seed`, B starts random rather than zero, so a gradient check sees every path."""
    from peft import LoraConfig, get_peft_model

    n = text_config(model).num_hidden_layers
    chosen = list(range(n - (layers or n), n))
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(keys),
        layers_to_transform=chosen,
        lora_dropout=0.0,
    )
    model = get_peft_model(model, config)
    if seed is not None:  # A and B both random and reproducible
        g = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                scale = p.shape[1] ** -0.5 if "lora_A" in name else 0.05
                p.data = (scale * torch.randn(p.shape, generator=g)).to(p)
    return model


def tiny_folder(name: str) -> Path:
    """The bundled tiny model `name` as a transformers folder, written once next to it."""
    src = tiny.path(name)
    config = json.loads((src / "config.json").read_text())
    if config["model_type"] not in ("qwen3_5", "qwen3_next"):
        return src  # the attention families load as written
    dst = src.with_name(src.name + "-transformers")
    if (dst / "model.safetensors").is_file():
        return dst
    weights = {}
    for key, w in load_file(str(src / "model.safetensors")).items():
        key = key.removeprefix("language_model.")
        if "conv1d.weight" in key:
            w = np.ascontiguousarray(np.moveaxis(w, 2, 1))  # (C, K, 1) -> (C, 1, K)
        if key.endswith(_CENTRED):
            w = w - 1.0
        weights[key] = w
    for key in [k for k in weights if k.endswith("switch_mlp.gate_proj.weight")]:
        # mlx-lm's stacked experts -> transformers' fused (experts, 2 x inter, hidden) gate_up
        stem = key.removesuffix("switch_mlp.gate_proj.weight")
        gate, up = weights.pop(key), weights.pop(stem + "switch_mlp.up_proj.weight")
        weights[stem + "experts.gate_up_proj"] = np.concatenate([gate, up], axis=1)
        weights[stem + "experts.down_proj"] = weights.pop(stem + "switch_mlp.down_proj.weight")
    if config["model_type"] == "qwen3_next":
        config.setdefault("norm_topk_prob", False)  # mlx-lm's default; transformers' is True
    if config["model_type"] == "qwen3_5":
        config.update(model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"])
    tmp = Path(tempfile.mkdtemp(dir=src.parent, prefix=".tmp-"))
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, tmp / f.name)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    try:
        os.rename(tmp, dst)
    except OSError:  # written meanwhile by another process
        shutil.rmtree(tmp, ignore_errors=True)
    return dst
