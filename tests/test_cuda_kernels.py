"""The CUDA tensor-core attention kernels (float16/bfloat16 on mma.sync), run on the CPU: the
source MLX would hand to NVRTC, compiled with g++ against the CUDA emulator
(metal_kernels/cuda_emulator, ldmatrix/mma/cp.async modelled lane by lane) and compared with the
float32 twin. The GPU's own check is scripts/h200-attention.py."""

import importlib
import shutil

import mlx.core as mx
import pytest

from metal_kernels import build, cuda_emulator, cuda_source
from metal_kernels.attention import blocks
from mlxwalk.ops import routing
from mlxwalk.ops.attention import check

pytestmark = [
    pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator needs g++"),
    pytest.mark.slow,  # compiles every kernel: `python -m pytest -m slow`
]
tensor_cores = importlib.import_module("metal_kernels.attention.tensor_cores")
SIZES = check.Sizes(chunk=40, start=70, grad_from=25)


@pytest.fixture
def on_emulator(monkeypatch):
    monkeypatch.setattr(routing, "backend", lambda: "cuda")
    monkeypatch.setattr(routing, "launch", cuda_emulator.launch)
    monkeypatch.setattr(routing, "_verdicts", {})
    monkeypatch.delenv("MLXWALK_KERNELS", raising=False)


def within_the_twins_error(case, store) -> dict:
    """Each output's error against the float32 twin, and whether it is within 3x the twin's own
    worst in the dtype (the kernels round P and dS to it before their second products)."""
    errors = check.errors(case, SIZES, store)
    bar = 3 * max(twin for _, twin in errors.values()) + 1e-6
    return {name: (kernel, kernel <= bar) for name, (kernel, _) in errors.items()}


@pytest.mark.parametrize(
    "dim, groups, dtype, store",
    [
        (64, 2, mx.bfloat16, mx.bfloat16),
        (128, 7, mx.float16, mx.float16),
        (256, 2, mx.bfloat16, mx.float32),  # dK/dV split over warp pairs; a converted store
    ],
)
def test_tensor_core_kernels_match_the_twin(on_emulator, dim, groups, dtype, store):
    case = routing.AttentionCase("cuda", dtype, dim, groups)
    for name, (error, ok) in within_the_twins_error(case, store).items():
        assert ok, (name, error)


@pytest.mark.parametrize(
    "stem, old, new, dim",
    [  # the block-wide barrier before a tile is read, dQ's causal mask, the pairs' swap barrier
        ("attention/forward_tc", "  cp_wait<0>();\n  __syncthreads();", "  cp_wait<0>();", 64),
        ("attention/dq_tc", "p = j > START + i ? 0.0f : p;", "", 64),
        ("attention/dkdv_tc", "bar_sync(1 + grp, 64);", "", 256),
    ],
)
def test_the_emulator_catches_a_broken_kernel(on_emulator, monkeypatch, stem, old, new, dim):
    original = build.source

    def mutated(spec, backend):
        header, body = original(spec, backend)
        if spec.stem == stem:
            assert old in body
            body = body.replace(old, new)
        return header, body

    monkeypatch.setattr(cuda_source, "source", mutated)
    monkeypatch.setattr(cuda_emulator, "source", mutated)
    case = routing.AttentionCase("cuda", mx.bfloat16, dim, 2)
    assert not all(ok for _, ok in within_the_twins_error(case, mx.bfloat16).values())


def test_every_block_shape_fits_and_launches():
    """Each table entry's shared memory fits an sm_90 block, and its launch says so."""
    for (kernel, dim), b in blocks.CUDA.items():
        assert blocks.cuda_shared_bytes(kernel, dim, b) <= tensor_cores.SHARED_MEMORY
        assert tensor_cores.shape(kernel, dim) == b
    q, k = mx.zeros((1, 4, 40, 96), mx.bfloat16), mx.zeros((1, 2, 40, 96), mx.bfloat16)
    call = tensor_cores.forward_launch(q, k, k, None, None, 0, 0.1)  # 96: the 128 entry's shape
    b = blocks.CUDA[("forward", 128)]
    assert call.threadgroup == (b.threads, 1, 1) and call.grid == (b.threads * 4, 1, 1)
    assert dict(call.template)["MT"] == b.mt and dict(call.template)["BN"] == b.walk
