import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

import mlxwalk

# The scripts import their helpers as `lib` (scripts/lib/), as they do when run from scripts/;
# tests load some scripts as modules.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

pytest_plugins = ["tests.skips"]  # under MLXWALK_NO_SKIPS=1 a skip outside torch's fails the run

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:  # (pytest-xdist's workers: -n auto)
    # OpenBLAS's threads spin while they wait: a worker a core, each with all the cores' threads,
    # ran the suite slower than one process did. Each worker takes its share, before OpenBLAS loads.
    share = (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(max(share, 1)))
mlxwalk.use_openblas()  # MLX's CPU GEMMs on OpenBLAS, as the command-line entry points do

# Bundled models are generated once per test session, away from the user's cache.
os.environ.setdefault("MLXWALK_HOME", tempfile.mkdtemp(prefix="mlxwalk-test-"))


@pytest.fixture(scope="session")
def qwen2_path():
    from mlxwalk import tiny

    return str(tiny.path("tiny-qwen2"))


@pytest.fixture(scope="session")
def hybrid_path():
    from mlxwalk import tiny

    return str(tiny.path("tiny-qwen3_5"))


@pytest.fixture
def qwen2(qwen2_path):
    import mlx_lm

    from mlxwalk.commands.walk_exact import prepare

    model, _ = mlx_lm.load(qwen2_path)
    return prepare(model)


@pytest.fixture
def hybrid(hybrid_path):
    import mlx_lm

    from mlxwalk.commands.walk_exact import prepare

    model, _ = mlx_lm.load(hybrid_path)
    return prepare(model)


@pytest.fixture(scope="session")
def measured(qwen2_path, hybrid_path):
    """Prepared models that no test trains, shared so their memory probes are measured once."""
    import mlx_lm

    from mlxwalk.commands.walk_exact import prepare

    return {
        "qwen2": prepare(mlx_lm.load(qwen2_path)[0]),
        "hybrid": prepare(mlx_lm.load(hybrid_path)[0]),
    }


@pytest.fixture
def on_harness(monkeypatch):
    """Route the kernels through the CPU harness (metal_kernels/harness) as if a Metal GPU were
    here; the harness compiles each kernel with g++."""
    if shutil.which("g++") is None:
        pytest.skip("the Metal harness compiles with g++, which is not on PATH")
    from metal_kernels import harness
    from mlxwalk.ops import routing

    monkeypatch.setattr(routing, "backend", lambda: "metal")
    monkeypatch.setattr(routing, "launch", harness.launch)
    monkeypatch.setattr(routing, "_verdicts", {})
    monkeypatch.setattr(routing, "RACE", None)  # the harness is no GPU: no first-use race
    monkeypatch.delenv("MLXWALK_KERNELS", raising=False)
