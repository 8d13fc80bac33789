"""The CUDA tensor-core attention kernels (float16/bfloat16 on mma.sync), run on the CPU: the
source MLX would hand to NVRTC, compiled with g++ against the CUDA emulator
(metal_kernels/cuda_emulator, ldmatrix/mma/cp.async modelled lane by lane) and compared with the
float32 twin; and, for the 8-bit store read in place, the scalar float32 kernels (`*.cu`) too.
The GPU's own check is scripts/h200-attention.py."""

import importlib
import shutil

import mlx.core as mx
import pytest

import metal_kernels.attention as attention_kernels
from metal_kernels import build, cuda_emulator, cuda_source
from metal_kernels.attention import Q8, blocks
from mlxwalk.ops import routing
from mlxwalk.ops.attention import Prefix, check

from .kernel_edits import mutating

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


# The 8-bit store (mlx-lm's q8: mx.quantize's triples), read in place by the CUDA kernels.
F32 = 1e-5  # float32: the scalar kernels accumulate in float32 like the twin, in another order


def scalar(x: dict) -> dict:
    """Every output of the scalar CUDA kernels (`*.cu`, float32) on the emulator, as
    check.through names them."""
    pk, pv = x["prefix"].in_place()
    start, gf = x["prefix"].end, x["grad_from"]
    args = (x["q"], x["k"], x["v"], pk, pv)
    run = {"run": cuda_emulator.launch, "backend": "cuda"}
    o, lse = attention_kernels.forward(*args, start, x["scale"], **run)
    dq, dk, dv = attention_kernels.backward(*args, start, gf, x["scale"], o, lse, x["d_out"], **run)
    taps = start - gf
    grads = [dq, dk[:, :, taps:], dv[:, :, taps:], dk[:, :, :taps], dv[:, :, :taps]]
    return dict(zip(check.OUTPUTS, [o, *grads]))


@pytest.mark.parametrize(
    "dim, groups, dtype", [(64, 2, mx.bfloat16), (128, 7, mx.float16), (256, 2, mx.bfloat16)]
)
def test_tensor_core_kernels_read_an_8bit_store_in_place(on_emulator, dim, groups, dtype):
    """Within the twin's own error in the dtype, against the float32 twin over the q8 store's
    dequantized values."""
    case = routing.AttentionCase("cuda", dtype, dim, groups)
    for name, (error, ok) in within_the_twins_error(case, Q8.dtype).items():
        assert ok, (name, error)


@pytest.mark.parametrize(
    "dim, groups, store",
    [(64, 2, Q8.dtype), (96, 3, Q8.dtype), (128, 1, mx.float32)],  # 96: groups of 32
)
def test_scalar_kernels_match_the_twin(dim, groups, store):
    """The float32 kernels (`*.cu`) on the emulator, over a q8 or a float32 store."""
    case = routing.AttentionCase("cuda", mx.float32, dim, groups)
    x = check.inputs(case, SIZES, store)
    got, want = scalar(x), check.through("twin", x)
    for name in check.OUTPUTS:
        assert check.relative_error(got[name], want[name]) < F32, name


@pytest.mark.parametrize("dtype, dim", [(mx.bfloat16, 64), (mx.float16, 128), (mx.float32, 96)])
def test_an_8bit_store_reads_as_mx_dequantize_gives_it(on_emulator, dtype, dim):
    """The kernels over the q8 store equal, bit for bit, the same kernels over a store holding
    mx.dequantize's values in the model's dtype (tensor cores in half precision, the scalar
    kernels in float32)."""
    case = routing.AttentionCase("cuda", dtype, dim, 2)
    x = check.inputs(case, SIZES, Q8.dtype)
    q8 = x["prefix"].store
    dequantized = check.Store(*q8.read(0, 0, SIZES.start + SIZES.chunk, dtype), dtype)
    y = dict(x, prefix=Prefix(dequantized, 0, SIZES.start, dtype))
    through = scalar if dtype == mx.float32 else (lambda x: check.through("kernel", x))
    got, want = through(x), through(y)
    for name in check.OUTPUTS:
        assert mx.array_equal(got[name], want[name]).item(), name


@pytest.mark.parametrize(
    "stem, old, new, broken",
    [  # a wrong scale, a wrong group (every element on its row's first group), in each kind
        ("attention/forward_tc", "round_to<S>(s * float(", "round_to<S>(b * float(", "out"),
        ("attention/dkdv_tc", "+ col / G;", "+ col / D;", "dtap_k"),
        ("attention/dq", "(scales[d / G]) * q", "(biases[d / G]) * q", "dq"),
        ("attention/dkdv", "[d / G]", "[0]", "dtap_v"),
    ],
)
def test_the_emulator_catches_a_wrong_dequantization(
    on_emulator, monkeypatch, stem, old, new, broken
):
    mutating(monkeypatch, stem, (old, new), readers=(cuda_source, cuda_emulator))
    tc = stem.endswith("_tc")
    case = routing.AttentionCase("cuda", mx.bfloat16 if tc else mx.float32, 128, 2)  # 2 groups
    if tc:
        error, ok = within_the_twins_error(case, Q8.dtype)[broken]
    else:
        x = check.inputs(case, SIZES, Q8.dtype)
        error = check.relative_error(scalar(x)[broken], check.through("twin", x)[broken])
        ok = error < F32
    assert not ok, error
