"""training/files.load_safetensors: MLX reads the file by its name, and a bad file is refused by
name."""

from pathlib import Path

import mlx.core as mx
import pytest

from mlxwalk.errors import ModelError
from mlxwalk.training import files


def test_mlx_reads_the_file_by_name_not_through_a_python_file(tmp_path, monkeypatch):
    # Through a Python file object MLX's lazy loads take the GIL on its own threads; one left
    # unread when the interpreter exits (a refusal after loading) aborted the process: 3 of 16
    # `mlxwalk convert-adapter` refusals on a loaded machine, 0 of 30 read by name.
    path = tmp_path / "a.safetensors"
    mx.save_safetensors(str(path), {"w": mx.arange(6).reshape(2, 3)})
    seen = []
    load = mx.load
    monkeypatch.setattr(mx, "load", lambda f, **kw: seen.append(f) or load(f, **kw))
    got = files.load_safetensors(path)
    assert seen == [str(path)]
    assert got["w"].tolist() == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.parametrize("content", [None, b"xx"])
def test_a_missing_or_truncated_file_is_refused_by_name(tmp_path: Path, content):
    path = tmp_path / "adapters.safetensors"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ModelError, match=f"{path} is not a readable safetensors file"):
        files.load_safetensors(path)
