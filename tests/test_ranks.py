"""Several ranks under `mlx.launch` (the ring backend, on this machine): the step's gradient is
the one process's on the same windows, every window is walked once, and a failing rank stops
every rank with one line and nothing half-written."""

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxwalk.training.ranks import Ranks

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = Path(sys.executable).parent / "mlx.launch"
RUN = [
    "train",
    "--model",
    "tiny-qwen2",
    "--iters",
    "4",
    "--epochs",
    "1",
    "--chunk",
    "64",
    "--window",
    "256",
    "--no-progress",
    "--seed",
    "3",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(ranks: int, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [
        str(LAUNCH),
        "-n",
        str(ranks),
        "--backend",
        "ring",
        "-p",
        str(free_port()),
        "--env",
        "OPENBLAS_NUM_THREADS=1",  # two ranks on this machine's cores
        "--python",
        sys.executable,
        str(ROOT / "tests" / "launched.py"),
        *args,
    ]
    if env:
        cmd[1:1] = [a for k, v in env.items() for a in ("--env", f"{k}={v}")]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)


def one(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "tests" / "launched.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)


def adapter(folder: Path) -> np.ndarray:
    weights = mx.load(str(folder / "adapters.safetensors"))
    return np.concatenate([np.array(weights[k]).ravel() for k in sorted(weights)])


@pytest.mark.parametrize("size, per_rank", [(1, 1), (2, 1), (3, 2), (2, 3)])
def test_the_ranks_shares_cover_every_window_once(size, per_rank):
    for windows in (1, 5, 7, 12):
        seen, start = [], 0
        while start < windows:
            step = list(range(start, min(start + size * per_rank, windows)))
            for r in range(size):
                seen += Ranks(None, r, size).mine(step, per_rank)
            start += len(step)
        assert sorted(seen) == list(range(windows))


def test_two_ranks_train_the_adapter_one_process_trains_on_both_windows(tmp_path):
    two = launch(2, *RUN, "--adapter-path", str(tmp_path / "two"))
    assert two.returncode == 0, two.stderr[-2000:]
    single = one(*RUN, "--windows-per-step", "2", "--adapter-path", str(tmp_path / "one"))
    assert single.returncode == 0, single.stderr[-2000:]
    apart = one(*RUN, "--adapter-path", str(tmp_path / "apart"))  # a step per window
    assert apart.returncode == 0, apart.stderr[-2000:]
    a, b, c = adapter(tmp_path / "two"), adapter(tmp_path / "one"), adapter(tmp_path / "apart")
    err = np.linalg.norm(a - b) / np.linalg.norm(b)
    print(f"two ranks against one process on both windows: relative error {err:.1e}")
    assert np.array_equal(a, b)  # bit-equal: the same code sums the same windows
    assert np.linalg.norm(c - b) / np.linalg.norm(b) > 1e-3  # the test can tell steps apart
    assert two.stdout.count("epoch 1") == 1  # one voice
    # the same world size to resume, named when it differs
    again = one(*RUN, "--iters", "6", "--resume", "--adapter-path", str(tmp_path / "two"))
    assert again.returncode == 2
    assert "trained on 2 rank(s) (mlx.launch -n 2); this launch has 1" in again.stderr


def test_a_failing_rank_stops_every_rank_with_one_line_and_leaves_nothing(tmp_path):
    out = tmp_path / "run"
    failed = launch(2, *RUN, "--adapter-path", str(out), env={"MLXWALK_TEST_FAIL_RANK": "1"})
    # (mlx.launch exits 0 whatever its ranks do, and ends the others once one exits)
    assert "Node with rank 0 exited with code 2" in failed.stderr, failed.stderr[-2000:]
    assert re.search(r"Node with rank 1 exited with code (2|-15)", failed.stderr)
    lines = [x for x in failed.stderr.splitlines() if "mlxwalk: error" in x]
    assert lines == [
        "mlxwalk: error: rank 1 of 2: window 3 does not fit this rank's memory (a test's refusal)"
    ], failed.stderr[-2000:]
    assert not out.exists()


def test_the_mlx_lm_drop_in_takes_a_row_per_rank(qwen2_path, tmp_path):
    from .test_dropin import chat

    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps(chat(i)) + "\n" for i in range(4)))
    (data / "valid.jsonl").write_text("".join(json.dumps(chat(i)) + "\n" for i in (7, 8)))
    args = [
        "lora",
        "--model",
        qwen2_path,
        "--train",
        "--data",
        str(data),
        "--iters",
        "2",
        "--batch-size",
        "2",
        "--num-layers",
        "2",
        "--chunk",
        "128",
        "--steps-per-report",
        "1",
        "--adapter-path",
        str(tmp_path / "ad"),
    ]
    two = launch(2, *args)
    assert "exited with code" not in two.stderr, two.stderr[-2000:]
    assert (tmp_path / "ad" / "adapters.safetensors").exists()
    assert two.stdout.count("Iter 2: Train loss") == 1, two.stdout[-2000:]  # rank 0 speaks
    alone = one(*args[:-2], "--adapter-path", str(tmp_path / "alone"))
    assert alone.returncode == 2
    assert "batch_size 2: the walk trains one window per step; use 1" in alone.stderr
