import os
import tempfile

import pytest

import mlxwalk  # noqa: F401  (first, so MLX's CPU backend binds to OpenBLAS when installed)

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

    from mlxwalk.exactness import prepare

    model, _ = mlx_lm.load(qwen2_path)
    return prepare(model)


@pytest.fixture
def hybrid(hybrid_path):
    import mlx_lm

    from mlxwalk.exactness import prepare

    model, _ = mlx_lm.load(hybrid_path)
    return prepare(model)


@pytest.fixture(scope="session")
def measured(qwen2_path, hybrid_path):
    """Prepared models that no test trains, shared so their memory probes are measured once."""
    import mlx_lm

    from mlxwalk.exactness import prepare

    return {
        "qwen2": prepare(mlx_lm.load(qwen2_path)[0]),
        "hybrid": prepare(mlx_lm.load(hybrid_path)[0]),
    }
