"""The chunked gated delta rule's CUDA kernels (metal_kernels/delta/*.cu: prepare, states, output,
states_back, grads, prepare_back on mma.sync.m16n8k16, float32 FMA for float32 inputs), run on
the CPU through the CUDA emulator (metal_kernels/cuda_emulator: the source MLX would hand NVRTC,
compiled with g++, ldmatrix/mma/cp.async modelled lane by lane) on chunked.py's CUDA geometry,
against the ops twin (mlxwalk.ops.delta.gated_delta_chunked and its mx.vjp): the forward, the
final state and every gradient (the initial state's included) in float32 and in half precision,
mutations the emulator catches, the block table. The GPU's own check is scripts/h200-delta.py."""

import hashlib
import shutil

import mlx.core as mx
import numpy as np
import pytest

from metal_kernels import cuda_emulator, cuda_source
from metal_kernels.build import ROOT
from metal_kernels.delta import blocks, chunked
from mlxwalk.ops.delta import gated_delta_chunked

from .delta_checks import NAMES, relative_error, through
from .kernel_edits import mutating

pytestmark = [
    pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator needs g++"),
    pytest.mark.slow,  # compiles every kernel: `python -m pytest -m slow`
]

F32 = 1e-5  # float32: FMA in float32 like the twin, in another order
# Half precision: a derived float32 operand enters the products as hi + lo halves (16 bits of
# it in bf16, 22 in fp16), so the outputs the twin keeps in float32 (final state, dlog_g, dbeta,
# dstate) land within HALF of it; the outputs rounded to the dtype (y, dq, dk, dv) within the
# twin's own rounding of them (1.5x, plus HALF).
HALF = 1e-4
STEMS = ("prepare", "states", "output", "states_back", "grads", "prepare_back")
KERNELS = chunked.op(run=cuda_emulator.launch, backend="cuda")


def inputs(t, hk, hv, dim, batch=1, dtype=mx.float32, seed=0):
    """q, k (unit rows, q scaled by dim^-1/2, as a Qwen3.5 layer feeds them), v, log_g, beta,
    a non-zero initial state; the cotangents of y (in the dtype) and of the final state."""
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=1.0):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    q, k = normal(batch, t, hk, dim), normal(batch, t, hk, dim)
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) * dim**-0.5
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    v = normal(batch, t, hv, dim)
    log_g = -rng.uniform(0.001, 0.7, (batch, t, hv)).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((batch, t, hv))))).astype(np.float32)
    state = normal(batch, hv, dim, dim, scale=0.3)
    x = [mx.array(a) for a in (q, k, v, log_g, beta, state)]
    x = [a.astype(dtype) for a in x[:3]] + x[3:]
    cots = [
        mx.array(normal(batch, t, hv, dim)).astype(dtype),
        mx.array(normal(batch, hv, dim, dim)),
    ]
    return x, cots


def errors(x, cots, backward: bool = True) -> dict[str, float]:
    """Each output's error against the twin's (float32) on the same inputs."""
    up = [a.astype(mx.float32) for a in x]
    ups = [c.astype(mx.float32) for c in cots]
    if backward:
        got, want = through(KERNELS, x, cots), through(gated_delta_chunked, up, ups)
    else:
        got = dict(zip(NAMES, chunked.forward(*x, run=cuda_emulator.launch, backend="cuda")))
        want = dict(zip(NAMES, gated_delta_chunked(*up)))
    return {name: relative_error(got[name], want[name]) for name in got}


# Lengths that are multiples of no chunk (the last one padded) over 2 and 3 chunks; value heads
# per key head 2 and 1; two key heads; a batch of 2; head dims 64 and 128 (two key blocks in
# grads at 128).
@pytest.mark.parametrize("t, hk, hv, dim, batch", [(150, 1, 2, 64, 1), (100, 2, 2, 128, 2)])
def test_float32_forward_and_every_gradient_match_the_twin(t, hk, hv, dim, batch):
    x, cots = inputs(t, hk, hv, dim, batch)
    for name, error in errors(x, cots).items():
        assert error < F32, (name, error)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_the_scans_without_the_key_split(monkeypatch, dtype):
    """states and states_back with one warp on all of a state's key columns (DKS 1, BV 64) and
    the reverse scan on one stage, the shapes the H200 sweep tries beside the table's."""
    width = "float" if dtype == mx.float32 else "half"
    shapes = {
        "states": blocks.CudaBlocks(4, (("BV", 64), ("DKS", 1)), "sweep"),
        "states_back": blocks.CudaBlocks(4, (("BV", 64), ("DKS", 1), ("STAGES", 1)), "sweep"),
    }
    for kernel, b in shapes.items():
        monkeypatch.setitem(blocks.CUDA, (kernel, 64, width), b)
    x, cots = inputs(150, 1, 2, 64, dtype=dtype)
    bar = F32 if dtype == mx.float32 else HALF
    for name, error in errors(x, cots).items():
        if name in ("final_state", "dlog_g", "dbeta", "dstate") or dtype == mx.float32:
            assert error < bar, (name, error)


@pytest.mark.parametrize("t", [1, 64])
def test_one_position_and_exactly_one_chunk(t):
    """A chunk of one real position (63 padded rows in every kernel) and one with no padding."""
    x, cots = inputs(t, 1, 2, 64, seed=t)
    for name, error in errors(x, cots).items():
        assert error < F32, (name, error)


@pytest.mark.parametrize(
    "dtype, dim, t, hk, hv",
    [(mx.bfloat16, 128, 70, 1, 2), (mx.float16, 64, 130, 2, 2)],  # Qwen3.5's 2 value heads a key
)
def test_half_precision_within_the_twins_own_error(dtype, dim, t, hk, hv):
    """float16/bfloat16 inputs against the float32 twin on the same (rounded) inputs: each output
    within the twin's own error in that dtype (outputs rounded to it: 1.5x the twin's rounding;
    the float32 ones: HALF, the twin's own being zero there)."""
    x, cots = inputs(t, hk, hv, dim, dtype=dtype)
    up = [a.astype(mx.float32) for a in x]
    ref = through(gated_delta_chunked, up, [c.astype(mx.float32) for c in cots])
    got, own = through(KERNELS, x, cots), through(gated_delta_chunked, x, cots)
    for name in NAMES:
        kernel_error = relative_error(got[name], ref[name])
        twin_error = relative_error(own[name], ref[name])
        assert kernel_error <= 1.5 * twin_error + HALF, (name, kernel_error, twin_error)
    assert got["y"].dtype == dtype and got["dq"].dtype == dtype


def _fingerprint() -> str:
    files = sorted((ROOT / "delta").glob("*.cu")) + [ROOT / "delta" / "tiles.cuh", ROOT / "mma.cuh"]
    return hashlib.sha256(b"".join(p.read_bytes() for p in files)).hexdigest()


@pytest.mark.parametrize(
    "stem, edits, backward, broken",  # broken: an output the mutation must show in
    [
        # the barrier after w's split: warps read w's parts before (or while) they are written
        ("delta/states", [("  __syncthreads();  // w's parts are in", "")], False, "y"),
        # a derived operand without its remainder (lo = 0): bf16's rounding, 100x the floor
        ("delta/states", [("lo = pack2<T>(a - ra, b - rb);", "lo = 0u;")], False, "final_state"),
        # the reverse scan reads the chunk in flight: cp.async's destination is NaN until its wait
        ("delta/states_back", [("  cp_wait<0>();", "  cp_wait<1>();")], True, "dstate"),
        # the WY backward's sign: dA = +T^T dT T^T
        ("delta/prepare_back", [("x = j < a ? -x * expd", "x = j < a ? x * expd")], True, "dk"),
    ],
)
def test_the_emulator_catches_a_broken_kernel(monkeypatch, stem, edits, backward, broken):
    """Each mutation shows in the comparison with the twin (the bar: HALF, 1e-4, which the
    intact kernels meet at bfloat16 here with 10x to spare), and the files stay untouched."""
    before = _fingerprint()
    x, cots = inputs(100, 1, 2, 64, dtype=mx.bfloat16)
    intact = errors(x, cots, backward)
    assert intact[broken] < 0.1 * HALF or broken in ("y", "dk"), intact
    mutating(monkeypatch, stem, *edits, readers=(cuda_source, cuda_emulator))
    got = errors(x, cots, backward)
    assert got[broken] > max(HALF, 3 * intact[broken]), (broken, got[broken], intact[broken])
    assert _fingerprint() == before


def test_every_block_shape_fits_and_launches():
    """Each CUDA entry's shared memory fits an sm_90 block (227 KiB), the geometry passes it to
    the body as SMEM (checked there at compile time), and the grid covers whole blocks."""
    for (kernel, dim, width), b in blocks.CUDA.items():
        dtype = mx.float32 if width == "float" else mx.bfloat16
        s = chunked.Sizes(2, 130, 2, 4, dim, dim)
        geo = chunked.cuda_geometry(kernel, s, dtype)
        assert geo.shared_memory == blocks.cuda_shared_bytes(kernel, dim, dim, dtype, b)
        assert geo.shared_memory <= 232448, (kernel, dim, width, geo.shared_memory)
        assert dict(geo.template)["SMEM"] == geo.shared_memory
        assert geo.threadgroup == (b.threads, 1, 1) and geo.grid[0] % b.threads == 0
        assert b.why
    assert set(blocks.CUDA_DIMS) == {64, 128}
    for dim, ok in ((64, True), (128, True), (96, False)):
        q, v = mx.zeros((1, 10, 2, dim), mx.bfloat16), mx.zeros((1, 10, 4, dim), mx.bfloat16)
        assert chunked.supports(q, q, v, "cuda") == ok
    assert all(
        (k, d, w) in blocks.CUDA for k in STEMS for d in (64, 128) for w in ("half", "float")
    )
