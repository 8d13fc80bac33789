"""The torch backend on several ranks (torchrun, gloo on this CPU): two ranks train the adapter
one process trains stepping on both windows at once, and a failing rank stops both."""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from .extras import needs_torch  # noqa: E402

needs_torch()
pytestmark = pytest.mark.torch


from safetensors.numpy import load_file  # noqa: E402

from .test_ranks import free_port, one  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RUN = [
    "train",
    "--backend",
    "torch",
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


def torchrun(ranks: int, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(ranks),
        "--master-port",
        str(free_port()),
        str(ROOT / "tests" / "launched.py"),
        *args,
    ]
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


def adapter(folder: Path) -> np.ndarray:
    weights = load_file(str(folder / "adapter_model.safetensors"))
    return np.concatenate([weights[k].ravel() for k in sorted(weights)])


def test_two_torch_ranks_train_what_one_process_trains_on_both_windows(tmp_path):
    two = torchrun(2, *RUN, "--adapter-path", str(tmp_path / "two"))
    assert two.returncode == 0, two.stderr[-2000:]
    single = one(*RUN, "--windows-per-step", "2", "--adapter-path", str(tmp_path / "one"))
    assert single.returncode == 0, single.stderr[-2000:]
    apart = one(*RUN, "--adapter-path", str(tmp_path / "apart"))
    assert apart.returncode == 0, apart.stderr[-2000:]
    a, b, c = adapter(tmp_path / "two"), adapter(tmp_path / "one"), adapter(tmp_path / "apart")
    err = np.linalg.norm(a - b) / np.linalg.norm(b)
    print(f"two torch ranks against one process on both windows: relative error {err:.1e}")
    assert err <= 1e-6  # gloo sums in another order (reads 3e-7)
    assert np.linalg.norm(c - b) / np.linalg.norm(b) > 1e-3
    assert two.stdout.count("epoch 1") == 1


def test_a_failing_torch_rank_stops_both_with_one_line(tmp_path):
    out = tmp_path / "run"
    failed = torchrun(2, *RUN, "--adapter-path", str(out), env={"MLXWALK_TEST_FAIL_RANK": "1"})
    assert failed.returncode != 0
    lines = [x for x in failed.stderr.splitlines() if re.match(r"mlxwalk: error", x)]
    assert lines == [
        "mlxwalk: error: rank 1 of 2: window 3 does not fit this rank's memory (a test's refusal)"
    ], failed.stderr[-3000:]
    assert not out.exists()
