"""Where models come from: a bundled tiny model, a local folder, or a hub id already in the local
Hugging Face cache. Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

from . import tiny


class ModelNotFound(FileNotFoundError):
    pass


def resolve(model: str) -> Path:
    """The local folder for `model`."""
    if model in tiny.MODELS:
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


def load(model: str, adapter_path: str | None = None):
    """(model, tokenizer) through mlx_lm.load, from a local folder."""
    import mlx_lm

    return mlx_lm.load(str(resolve(model)), adapter_path=adapter_path)
