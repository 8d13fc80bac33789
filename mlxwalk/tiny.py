"""Bundled tiny models: written on first use from a fixed seed, never downloaded.

Each is a Hugging Face-format folder (config.json, model.safetensors, a byte-level tokenizer with a
ChatML chat template) that `mlx_lm.load` loads like any real model. They are small enough for the
exactness table to run in seconds on two CPU cores, and shaped like the families they stand for:
grouped-query attention everywhere, head dimension 64 (so an 8-bit cache quantizes in mlx-lm's
default groups of 64).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

VERSION = 2  # 2: tiny-mistral's head untied, as Mistral-7B's is
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 320  # 256 bytes + specials, rounded up

CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "Tools you may call:\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n"
    "{{ messages[0]['content'] }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% if message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    "<tool_call>{{ call | tojson }}</tool_call>{% endfor %}{% endif %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class TinySpec:
    name: str
    config: dict
    seed: int


_COMMON = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "bos_token_id": 256,
    "eos_token_id": 258,
}

MODELS: dict[str, TinySpec] = {
    "tiny-qwen2": TinySpec(
        "tiny-qwen2",
        {
            **_COMMON,
            "model_type": "qwen2",
            "architectures": ["Qwen2ForCausalLM"],
            "num_hidden_layers": 4,
            "rope_theta": 10000.0,
        },
        seed=2,
    ),
    "tiny-qwen3_5": TinySpec(
        "tiny-qwen3_5",
        {
            **_COMMON,
            "model_type": "qwen3_5",
            "architectures": ["Qwen3_5ForCausalLM"],
            "num_hidden_layers": 6,
            "full_attention_interval": 3,
            "head_dim": 64,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 64,
            "linear_value_head_dim": 64,
            "linear_conv_kernel_dim": 4,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
            },
        },
        seed=3,
    ),
}

# The other families the walk supports, smaller still: the tests walk each exactly; `mlxwalk
# test-walk-exact -m tiny-llama` (and so on) writes and checks one.
_SMALL = {
    **_COMMON,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "rope_theta": 10000.0,
}
FAMILIES: dict[str, TinySpec] = {
    "tiny-llama": TinySpec(
        "tiny-llama",
        {
            **_SMALL,
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "num_hidden_layers": 2,
        },
        seed=4,
    ),
    "tiny-mistral": TinySpec(
        "tiny-mistral",
        {
            **_SMALL,
            "model_type": "mistral",
            "architectures": ["MistralForCausalLM"],
            "num_hidden_layers": 2,
            "sliding_window": None,
            "tie_word_embeddings": False,  # an untied head, which a quantized model quantizes
        },
        seed=5,
    ),
    "tiny-qwen3": TinySpec(
        "tiny-qwen3",
        {
            **_SMALL,
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
            "num_hidden_layers": 2,
            "head_dim": 64,
        },
        seed=6,
    ),
    "tiny-qwen3_next": TinySpec(
        "tiny-qwen3_next",
        {
            **_SMALL,
            "model_type": "qwen3_next",
            "architectures": ["Qwen3NextForCausalLM"],
            "num_hidden_layers": 4,
            "full_attention_interval": 2,
            "head_dim": 64,
            "linear_num_key_heads": 1,
            "linear_num_value_heads": 2,
            "linear_key_head_dim": 64,
            "linear_value_head_dim": 64,
            "linear_conv_kernel_dim": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 128,
            "partial_rotary_factor": 0.25,
        },
        seed=7,
    ),
}

# Quantized as mlx-lm quantizes (affine, groups of 64; the embedding too), from the models above:
# the walk over QuantizedLinear layers under LoRA, as most Mac users train.
QUANTIZED: dict[str, tuple[str, int]] = {
    "tiny-qwen2-4bit": ("tiny-qwen2", 4),
    "tiny-qwen2-8bit": ("tiny-qwen2", 8),
    "tiny-qwen3_5-4bit": ("tiny-qwen3_5", 4),
    "tiny-mistral-4bit": ("tiny-mistral", 4),  # an untied quantized head: row (1d)
}

DEFAULT_MODEL = "tiny-qwen2"


def bundled() -> list[str]:
    """Every bundled model's name."""
    return [*MODELS, *FAMILIES, *QUANTIZED]


def home() -> Path:
    """Where bundled models are generated: MLXWALK_HOME (unset or empty: ~/.cache/mlxwalk)."""
    return Path(os.environ.get("MLXWALK_HOME") or Path.home() / ".cache" / "mlxwalk")


def path(name: str = DEFAULT_MODEL) -> Path:
    """The folder of a bundled model, generated on first use."""
    specs = {**MODELS, **FAMILIES}
    if name not in specs and name not in QUANTIZED:
        raise ValueError(f"unknown bundled model {name!r}; bundled: {', '.join(bundled())}")
    folder = home() / "models" / f"{name}-v{VERSION}"
    if not (folder / "model.safetensors").exists():
        if name in QUANTIZED:
            _publish(folder, lambda tmp: _write_quantized(*QUANTIZED[name], tmp))
        else:
            write(specs[name], folder)
    return folder


def _write_quantized(base: str, bits: int, folder: Path) -> None:
    import mlx_lm
    from mlx_lm.utils import quantize_model, save_config, save_model

    source = path(base)
    model, _ = mlx_lm.load(str(source))
    config = json.loads((source / "config.json").read_text())
    model, config = quantize_model(model, config, group_size=64, bits=bits)
    save_model(folder, model)
    save_config(config, folder / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, folder / name)


def _publish(folder: Path, fill) -> None:
    """`fill` a temporary sibling of `folder`, then rename it into place; a write that fails is
    refused naming the folder (and a full disk as such)."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    except OSError as e:
        raise _unwritable(folder, e) from None
    try:
        try:
            fill(tmp)
        except Exception as e:  # OSError, MLX's RuntimeError, the tokenizers' own Exception
            raise _unwritable(folder, e) from None
        tmp.chmod(0o755)
        try:
            os.rename(tmp, folder)
        except OSError:  # another process wrote it first
            if not (folder / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _unwritable(folder: Path, e: BaseException):
    """The refusal for a bundled model that could not be written into `folder`."""
    from .errors import FolderError

    said = str(e).split("] ", 1)[-1]
    try:
        nearly_full = shutil.disk_usage(folder.parent).free < 64 << 20
    except OSError:
        nearly_full = False
    full = getattr(e, "errno", None) == errno.ENOSPC or "os error 28" in said or nearly_full
    why = "no space left on the device" if full else (getattr(e, "strerror", None) or said)
    fix = "free some space there, or " if full else ""
    return FolderError(
        f"can't write the bundled model {folder.name} into {folder.parent} (MLXWALK_HOME's "
        f"models): {why}; {fix}set MLXWALK_HOME to another folder"
    )


def write(spec: TinySpec, folder: Path) -> Path:
    """Write `spec` into `folder` atomically: a temporary sibling, then a rename."""

    def fill(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(spec.config, indent=2))
        _write_weights(spec, tmp / "model.safetensors")
        _write_tokenizer(tmp)

    _publish(folder, fill)
    return folder


def _init(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """A deterministic, non-degenerate initialization by parameter name."""
    leaf = name.rsplit(".", 1)[-1]
    # Slow decay (gates near 0.99 a token), so the recurrent state carries across chunks.
    if name.endswith("A_log"):
        return np.log(rng.uniform(0.02, 0.2, shape))
    if name.endswith("dt_bias"):
        return np.full(shape, -2.0)
    if "norm" in name:
        return np.ones(shape)
    if leaf == "bias":
        return rng.normal(0.0, 0.02, shape)
    if "conv1d" in name:
        return rng.normal(0.0, 0.5, shape)
    if "embed_tokens" in name:
        return rng.normal(0.0, shape[-1] ** -0.5, shape)
    # Sharper attention than a plain fan-in scale, so positions depend on each other strongly.
    gain = 1.5 if ("q_proj" in name or "k_proj" in name) else 1.0
    return rng.normal(0.0, gain * shape[-1] ** -0.5, shape)


def _write_weights(spec: TinySpec, file: Path) -> None:
    import copy

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(copy.deepcopy(spec.config))  # mistral is llama's
    model = model_class(args_class.from_dict(copy.deepcopy(spec.config)))  # args edit it
    rng = np.random.default_rng(spec.seed)
    weights = {
        name: mx.array(_init(name, tuple(p.shape), rng).astype(np.float32))
        for name, p in sorted(tree_flatten(model.parameters()))
    }
    with open(file, "wb") as f:  # (a Python file: a full disk is an OSError with its errno)
        mx.save_safetensors(f, weights, metadata={"format": "mlx"})


def _byte_vocab() -> dict[str, int]:
    """GPT-2's printable stand-ins for the 256 bytes, in byte order."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return {chars[b]: b for b in range(256)}


def _write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab=_byte_vocab(), merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 131072,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
