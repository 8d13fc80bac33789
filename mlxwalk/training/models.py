"""Where models come from: a bundled tiny model, a local folder, or a hub id already in the local
Hugging Face cache. Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

from .. import tiny


class ModelNotFound(FileNotFoundError):
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


def load(model: str, adapter_path: str | None = None, trust_remote_code: bool = False):
    """(model, tokenizer) through mlx_lm.load, from a local folder."""
    import mlx_lm

    return mlx_lm.load(str(resolve(model)), adapter_path=adapter_path,
                       tokenizer_config={"trust_remote_code": trust_remote_code},
                       trust_remote_code=trust_remote_code)  # fmt: skip


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
