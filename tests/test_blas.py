"""MLX's CPU GEMMs run on the OpenBLAS pip installed (mlxwalk/_blas.py), and compute the same."""

import os
import sys
import time

import mlx.core as mx
import numpy as np
import pytest

from mlxwalk import _blas

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux wheels only")


@linux
def test_the_gemms_are_routed_to_openblas():
    if os.environ.get("MLXWALK_BLAS") == "off":
        assert _blas.loaded is None
        return
    assert _blas.loaded and "openblas" in os.path.basename(_blas.loaded)


def test_products_match_numpys():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((300, 200), np.float32), rng.standard_normal((200, 100), np.float32)
    got = np.asarray(mx.array(a) @ mx.array(b))
    assert np.allclose(got, a @ b, rtol=1e-4, atol=1e-4)
    c = rng.standard_normal((3, 64, 32)).astype(np.float32)
    got = np.asarray(mx.array(c) @ mx.array(c).swapaxes(-1, -2))  # batched, transposed
    assert np.allclose(got, c @ c.swapaxes(-1, -2), rtol=1e-4, atol=1e-4)


@linux
def test_a_matmul_runs_far_faster_than_the_reference_blas():
    """The reference BLAS does ~2 GFLOP/s here, OpenBLAS ~80-120: a bound of 10 tells them apart."""
    if _blas.loaded is None:
        pytest.skip("MLXWALK_BLAS=off")
    a = mx.random.normal((1024, 1024))
    mx.eval(a @ a)
    best = min(_timed(lambda: mx.eval(a @ a)) for _ in range(3))
    assert 2 * 1024**3 / best / 1e9 > 10


def _timed(fn) -> float:
    tic = time.perf_counter()
    fn()
    return time.perf_counter() - tic


API_USER = """
import sys
import mlxwalk
from mlxwalk import _blas, tiny
import mlx_lm
import numpy as np

assert _blas.loaded is None and not _blas.tried, "importing mlxwalk routed the products"
if sys.argv[1] == "hidden":
    _blas._wheel_library = lambda: None  # as on a machine without the scipy-openblas32 wheel
model, _ = mlx_lm.load(str(tiny.path("tiny-qwen2")))
from mlxwalk.commands.walk_exact import prepare

model = prepare(model)
x = np.arange(64, dtype=np.int32)[None] % 50
for _ in range(2):  # routed once, said once
    mlxwalk.window_gradient(model, x[:, :-1], x[:, 1:], np.ones((1, 63), np.float32), chunk=32)
print("routed" if _blas.loaded else "not routed")
"""


@linux
@pytest.mark.parametrize("wheel", ["present", "hidden"])
def test_the_python_api_routes_the_products_at_first_use(wheel, qwen2_path):
    """`import mlxwalk` routes nothing; the API's first call routes MLX's CPU products as the
    commands do, and where it can't, says so once on stderr, in the commands' words."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "MLXWALK_BLAS"}
    out = subprocess.run(
        [sys.executable, "-c", API_USER, wheel], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    said = [line for line in out.stderr.splitlines() if "reference BLAS" in line]
    if wheel == "present":
        assert out.stdout.strip() == "routed" and not said
    else:
        assert out.stdout.strip() == "not routed"
        assert len(said) == 1 and said[0].startswith("mlxwalk: MLX's CPU matrix products stay")
