"""Where models come from: a bundled tiny model, a local folder, or a hub id already in the local
Hugging Face cache. Nothing is downloaded."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from .. import tiny
from ..errors import ModelError


class ModelNotFound(ModelError):
    pass


def resolve(model: str) -> Path:
    """The local folder for `model`."""
    if model in tiny.bundled():
        return tiny.path(model)
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise ModelNotFound(f"model folder {path} has no config.json")
        return path
    if model.count("/") == 1 and not model.startswith((".", "/")):
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(model, local_files_only=True))
        except Exception:  # any failure to find it offline means the same to the user
            raise ModelNotFound(
                f"model {model!r} is not a local folder and not in the local Hugging Face cache"
            ) from None
    raise ModelNotFound(f"model {model!r} is not a bundled model, a local folder or a hub id")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def load(
    model: str,
    adapter_path: str | None = None,
    trust_remote_code: bool = False,
    tokenizer: bool = True,
):
    """(model, tokenizer) through mlx_lm.load, from a local folder; a folder mlx-lm can't read
    is refused in one line naming the file at fault. `tokenizer`: the caller reads text, so a
    folder with no tokenizer files is refused up front."""
    import mlx_lm

    folder = resolve(model)
    if tokenizer and not any((folder / name).exists() for name in TOKENIZER_FILES):
        raise ModelNotFound(
            f"model folder {folder} has no tokenizer (none of "
            f"{', '.join(TOKENIZER_FILES)}): reading text needs one"
        )
    check_config(folder)
    try:
        return mlx_lm.load(
            str(folder),
            adapter_path=adapter_path,
            tokenizer_config={"trust_remote_code": trust_remote_code},
            trust_remote_code=trust_remote_code,
        )
    except json.JSONDecodeError as e:
        raise BadModel(f"{_json_file(folder, adapter_path)} is not valid JSON ({e})") from None
    except TypeError as e:  # the model type's ModelArgs lacks a required field
        if "required" not in str(e):
            raise
        missing = str(e).split("argument", 1)[-1].strip(": s")
        raise BadModel(
            f"{folder / 'config.json'} lacks {missing}, which its model type needs"
        ) from None
    except (RuntimeError, ValueError) as e:
        if str(e).startswith("Missing") and "parameters" in str(e):
            raise BadModel(missing_weights(folder, str(e))) from None
        if "safetensors" not in str(e):
            raise
        where = damaged(folder) or damaged(Path(adapter_path or folder)) or folder
        raise BadModel(f"{where} can't be read: {str(e).split('] ', 1)[-1]}") from None


class BadModel(ModelError):
    """A model folder mlx-lm can't load, named by the file at fault."""


def check_config(folder: Path) -> None:
    """A config.json mlx-lm would fail on with a KeyError: no `model_type`, which picks the
    model's code. (One that is not JSON is left to mlx-lm's load, which says so by file.)"""
    file = folder / "config.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError):
        return
    if not isinstance(config, dict):
        raise BadModel(f"{file} holds no JSON object")
    if "model_type" not in config:
        raise BadModel(f"{file} has no 'model_type' key, which names the model's architecture")


INDEX = "model.safetensors.index.json"


def missing_weights(folder: Path, said: str) -> str:
    """mlx-lm's `Missing N parameters:` said by file: the shards the index lists that are not
    there, else the first parameters missing."""
    try:
        shards = sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        shards = []
    gone = [name for name in shards if not (folder / name).is_file()]
    if gone:
        return (
            f"model folder {folder} lacks {', '.join(gone)}, which {INDEX} lists: the download "
            "is incomplete"
        )
    head, _, names = said.partition(":")
    names = [n.strip(",.") for n in names.split()]
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return f"model folder {folder}: its weights lack {head.removeprefix('Missing ')}" + (
        f" ({shown})" if shown else ""
    )


def _json_file(folder: Path, adapter_path: str | None) -> Path:
    """Which of the JSON files mlx-lm reads fails to parse."""
    candidates = [folder / "config.json"]
    if adapter_path:
        candidates.append(Path(adapter_path) / "adapter_config.json")
    for file in candidates:
        try:
            json.loads(file.read_text())
        except (OSError, ValueError):
            return file
    return folder / "config.json"


def damaged(folder: Path) -> Path | None:
    """The first safetensors file in `folder` whose header is unreadable or whose tensors end
    past the file's end (a truncated download)."""
    for file in sorted(Path(folder).glob("*.safetensors")):
        try:
            with open(file, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
            end = max(
                (v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0
            )
            if 8 + size + end > file.stat().st_size:
                return file
        except (OSError, ValueError, KeyError, TypeError, struct.error):
            return file
    return None


def fingerprint(model) -> str:
    """A short hash of the model's weights: every parameter's name, shape and dtype, and 64 of its
    values at evenly spaced positions. Cheap at any size, and two checkpoints of one architecture
    (the same names and shapes) tell apart. Taken before adapters are applied."""
    import hashlib

    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten

    h = hashlib.sha256()
    for name, v in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
        h.update(f"{name}:{tuple(v.shape)}:{v.dtype};".encode())
        flat = v.reshape(-1)
        picks = flat[mx.array(np.linspace(0, flat.size - 1, min(64, flat.size)).astype(np.int64))]
        if picks.dtype == mx.bfloat16:
            picks = picks.view(mx.uint16)
        h.update(np.asarray(picks).tobytes())
    return h.hexdigest()[:16]


def max_positions(model) -> int | None:
    """The model's `max_position_embeddings` (its text config's for a multimodal one), if any."""
    args = getattr(model, "args", None)
    for source in (args, getattr(args, "text_config", None)):
        if isinstance(source, dict):
            value = source.get("max_position_embeddings")
        else:
            value = getattr(source, "max_position_embeddings", None)
        if isinstance(value, int):
            return value
    return None
