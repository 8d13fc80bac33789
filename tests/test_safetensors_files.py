"""training/files.load_safetensors: MLX reads the file by a name of its own, any path is read,
and a bad file is refused by name."""

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from mlxwalk.errors import ModelError
from mlxwalk.training import files


def test_mlx_reads_by_a_name_not_through_a_python_file(tmp_path, monkeypatch):
    # Through a Python file object MLX's loads are tasks that hold a Python reader; one disposed
    # on MLX's threads as the interpreter exits (a refusal after loading) aborted the process:
    # 3 of 16 `mlxwalk convert-adapter` refusals on a loaded machine, 0 of 30 read by name.
    path = tmp_path / "a.safetensors"
    mx.save_safetensors(str(path), {"w": mx.arange(6).reshape(2, 3)})
    seen = []
    load = mx.load
    monkeypatch.setattr(mx, "load", lambda f, **kw: seen.append(f) or load(f, **kw))
    got = files.load_safetensors(path)
    assert len(seen) == 1 and isinstance(seen[0], str) and seen[0].isascii()
    assert got["w"].tolist() == [[0, 1, 2], [3, 4, 5]]


def test_a_non_ascii_path_under_a_c_locale_is_saved_and_read(tmp_path):
    # MLX encodes a text path itself, which fails on such a path in this locale (std::bad_cast)
    folder = tmp_path / "\u00e9t\u00e9"
    folder.mkdir()
    code = (
        "import sys, mlx.core as mx; from pathlib import Path; from mlxwalk.training import files;"
        "p = Path(sys.argv[1]) / 'a.safetensors';"
        "files.save_safetensors(p, {'w': mx.arange(3)});"
        "print(files.load_safetensors(p)['w'].tolist())"
    )
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"}
    done = subprocess.run(
        [sys.executable, "-c", code, os.fsencode(folder)], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[0, 1, 2]"


@pytest.mark.parametrize("content", [None, b"xx"])
def test_a_missing_or_truncated_file_is_refused_by_name(tmp_path: Path, content):
    path = tmp_path / "adapters.safetensors"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ModelError, match=f"{path} is not a readable safetensors file"):
        files.load_safetensors(path)
