"""LoRA adapters across frameworks, both ways: PEFT's (`adapter_model.safetensors` +
`adapter_config.json`, for transformers) and mlx-lm's (`adapters.safetensors` +
`adapter_config.json`). A LoRA layer adds scale * (x A) B to a linear layer's output; mlx-lm
keeps lora_a (in x r), lora_b (r x out) and the scale, PEFT keeps lora_A.weight (r x in),
lora_B.weight (out x r) and alpha, with scale = alpha / r (alpha / sqrt(r) under rsLoRA).
No framework is needed for it: the arrays are transposed and the configs rewritten.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path

import mlx.core as mx

from ..errors import FolderError, ModelError
from .files import TMP_MARK, load_safetensors

PEFT_WEIGHTS, MLX_WEIGHTS, CONFIG = (
    "adapter_model.safetensors",
    "adapters.safetensors",
    "adapter_config.json",
)
_PEFT_KEY = re.compile(
    r"^base_model\.model\.(.+\.layers\.(\d+)\.(.+))\.lora_([AB])(?:\.default)?\.weight$"
)
_MLX_KEY = re.compile(r"^(.+\.layers\.(\d+)\.(.+))\.lora_([ab])$")


def kind(folder: Path) -> str:
    """ "peft" or "mlx", by the weights file the folder holds."""
    folder = Path(folder)
    if (folder / PEFT_WEIGHTS).is_file():
        return "peft"
    if (folder / MLX_WEIGHTS).is_file():
        return "mlx"
    raise ModelError(f"{folder}: no adapter there (neither {PEFT_WEIGHTS} nor {MLX_WEIGHTS})")


def _config(folder: Path) -> dict:
    try:
        return json.loads((Path(folder) / CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"{Path(folder) / CONFIG}: cannot be read ({e})") from None


def _layer_count(model: Path) -> int:
    config = json.loads((Path(model) / "config.json").read_text())
    config = config.get("text_config", config)
    return int(config["num_hidden_layers"])


# Where the decoder layers sit in the two frameworks' module trees, where they differ: mlx-lm
# keeps a Qwen3.5's under language_model.model; transformers under model (the text-only
# Qwen3_5ForCausalLM) or model.language_model (the published, multimodal checkpoints).
_MLX_STEM = {"qwen3_5": "language_model.model", "qwen3_5_moe": "language_model.model"}
_HF_STEM = {
    "Qwen3_5ForCausalLM": "model",
    "Qwen3_5MoeForCausalLM": "model",
    "Qwen3_5ForConditionalGeneration": "model.language_model",
    "Qwen3_5MoeForConditionalGeneration": "model.language_model",
}


def _stems(model: Path | None) -> tuple[str, str] | None:
    """(mlx-lm's stem, transformers') for the base model's family, None where they agree or
    no base model is given."""
    if model is None or not (Path(model) / "config.json").is_file():
        return None
    config = json.loads((Path(model) / "config.json").read_text())
    family = config.get("model_type", "").removesuffix("_text")
    if family not in _MLX_STEM:
        return None
    arch = (config.get("architectures") or ["Qwen3_5ForConditionalGeneration"])[0]
    return _MLX_STEM[family], _HF_STEM.get(arch, "model.language_model")


def _restem(path: str, stems: tuple[str, str] | None, to_mlx: bool) -> str:
    """A layer's module path moved from one framework's tree to the other's."""
    if stems is None:
        return path
    src, dst = (stems[1], stems[0]) if to_mlx else stems
    head, sep, rest = path.partition(".layers.")
    return f"{dst}{sep}{rest}" if head == src else path


def tensor_rank(weights: dict, src: Path, said: int, rank_axis: dict[str, int]) -> int:
    """The rank the tensors hold (each A's and B's rank axis, `rank_axis` by the name's last
    letter), refused when they disagree with each other or with the config's `said` rank."""
    ranks = {}
    for name, w in weights.items():
        ab = re.search(r"lora_([aAbB])", name).group(1).lower()
        ranks[name] = w.shape[rank_axis[ab]]
    found = set(ranks.values())
    if len(found) > 1:
        name = min(ranks, key=lambda k: (ranks[k], k))
        raise ModelError(
            f"{src}: its LoRA tensors disagree on the rank ({sorted(found)}; "
            f"{name} has {ranks[name]})"
        )
    rank = found.pop() if found else said
    if rank != said:
        name = min(ranks)
        raise ModelError(
            f"{src}: {CONFIG} says rank {said}, but its tensors have rank {rank} "
            f"({name} is {tuple(weights[name].shape)}); fix the config or the "
            "adapter"
        )
    return rank


def peft_to_mlx(src: Path, model: Path | None = None) -> tuple[dict, dict]:
    """(weights, config) in mlx-lm's format. mlx-lm adapts the last num_layers layers, so the
    layer count comes from the base model's config.json (`model`, else the folder PEFT names)."""
    cfg = _config(src)
    if cfg.get("peft_type", "").upper() != "LORA" or cfg.get("use_dora"):
        raise ModelError(f"{src}: a {cfg.get('peft_type')} adapter; only LoRA converts")
    r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    scale = alpha / (math.sqrt(r) if cfg.get("use_rslora") else r)
    model = Path(model or cfg.get("base_model_name_or_path") or "")
    if not (model / "config.json").is_file():
        raise ModelError(f"{src}: give the base model's folder (--model) to count its layers")
    total = _layer_count(model)
    stems = _stems(model)
    weights, layers, keys = {}, set(), set()
    for name, w in load_safetensors(Path(src) / PEFT_WEIGHTS).items():
        m = _PEFT_KEY.match(name)
        if m is None:
            raise ModelError(f"{src}: {name} is not a LoRA weight of a decoder layer")
        path, layer, key, ab = m.groups()
        path = _restem(path, stems, to_mlx=True)
        weights[f"{path}.lora_{ab.lower()}"] = w.T  # A (r, in) -> lora_a (in, r); B likewise
        layers.add(int(layer))
        keys.add(key)
    tensor_rank(weights, src, r, {"a": 1, "b": 0})  # lora_a (in, r), lora_b (r, out)
    n = len(layers)
    if sorted(layers) != list(range(total - n, total)):
        raise ModelError(
            f"{src}: adapters on layers {sorted(layers)} are not the model's last "
            f"{n} of {total}, the only set mlx-lm's adapter_config names"
        )
    lora = {
        "rank": r,
        "scale": scale,
        "dropout": float(cfg.get("lora_dropout") or 0.0),
        "keys": sorted(keys),
    }
    return weights, {"fine_tune_type": "lora", "num_layers": n, "lora_parameters": lora}


def mlx_to_peft(src: Path, model: Path | None = None) -> tuple[dict, dict]:
    """(weights, config) in PEFT's format, alpha = scale x r, the layers named explicitly."""
    cfg = _config(src)
    if cfg.get("fine_tune_type", "lora") != "lora":
        raise ModelError(f"{src}: a {cfg['fine_tune_type']} adapter; only LoRA converts")
    lp = cfg["lora_parameters"]
    r, scale = int(lp["rank"]), float(lp["scale"])
    stems = _stems(model)
    weights, layers, keys = {}, set(), set()
    for name, w in load_safetensors(Path(src) / MLX_WEIGHTS).items():
        m = _MLX_KEY.match(name)
        if m is None:
            raise ModelError(f"{src}: {name} is not a LoRA weight of a decoder layer")
        path, layer, key, ab = m.groups()
        path = _restem(path, stems, to_mlx=False)
        weights[f"base_model.model.{path}.lora_{ab.upper()}.weight"] = w.T
        layers.add(int(layer))
        keys.add(key)
    tensor_rank(weights, src, r, {"a": 0, "b": 1})  # lora_A (r, in), lora_B (out, r)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": r,
        "lora_alpha": scale * r,
        "lora_dropout": float(lp.get("dropout", 0.0)),
        "target_modules": sorted(keys),
        "layers_to_transform": sorted(layers),
        "layers_pattern": "layers",
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
        "base_model_name_or_path": str(model) if model else None,
    }
    return weights, config


def convert(src: Path, dst: Path, model: Path | None = None) -> str:
    """Convert the adapter in `src` to the other format in `dst` (a new or empty folder, written
    whole or not at all); returns the format written."""
    from . import models
    from .config import not_empty

    src, dst = Path(src), Path(dst)
    if model is not None:  # a bundled name or a cached hub id, as `mlxwalk train` takes them
        not_empty("model", str(model))
        model = models.resolve(str(model))
    source = kind(src)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise FolderError(f"{dst} exists and is not an empty folder")
    weights, config = (peft_to_mlx if source == "peft" else mlx_to_peft)(src, model)
    target = "mlx" if source == "peft" else "peft"
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}{TMP_MARK}", dir=dst.parent))
    try:
        with open(tmp / (MLX_WEIGHTS if target == "mlx" else PEFT_WEIGHTS), "wb") as f:
            mx.save_safetensors(f, {k: mx.array(v) for k, v in weights.items()})
        (tmp / CONFIG).write_text(json.dumps(config, indent=2))
        os.replace(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
