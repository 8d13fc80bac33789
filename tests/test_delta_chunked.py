"""The chunked gated delta rule's Metal kernels (metal_kernels/delta: prepare, states, output,
states_back, grads, prepare_back), run on the CPU through the harness against the ops twin
(mlxwalk.ops.delta.gated_delta_chunked): the forward and every gradient (the initial state's
included), half precision, mutations the comparisons catch, the traffic counters against
traffic.py's design, the block table, MLX's rendering and the address-space check."""

import shutil

import mlx.core as mx
import numpy as np
import pytest

from metal_kernels import build, harness
from metal_kernels.delta import blocks, chunked, traffic
from mlxwalk.ops.delta import gated_delta_chunked

from .delta_checks import NAMES, relative_error, through
from .kernel_edits import mutating

pytestmark = [
    pytest.mark.skipif(shutil.which("g++") is None, reason="the harness needs g++"),
    pytest.mark.slow,  # compiles every kernel: `python -m pytest -m slow`
]

F32 = 1e-5  # float32: the kernels accumulate in float32 like the twin, in another order


def inputs(t, hk, hv, dim, batch=1, dtype=mx.float32, seed=0):
    """q, k, v, log_g, beta, a non-zero initial state; the cotangents of y and the final state."""
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=1.0):
        return mx.array((scale * rng.standard_normal(shape)).astype(np.float32))

    q, k = normal(batch, t, hk, dim, scale=0.3), normal(batch, t, hk, dim, scale=0.3)
    v = normal(batch, t, hv, dim)
    log_g = -mx.array(rng.uniform(0.01, 0.3, (batch, t, hv)).astype(np.float32))
    beta = mx.array(rng.uniform(0.1, 0.9, (batch, t, hv)).astype(np.float32))
    state = normal(batch, hv, dim, dim, scale=0.5)
    cots = [normal(batch, t, hv, dim).astype(dtype), normal(batch, hv, dim, dim)]
    return [q.astype(dtype), k.astype(dtype), v.astype(dtype), log_g, beta, state], cots


KERNELS = chunked.op(run=harness.launch)


def errors(x, cots, backward: bool = True) -> dict[str, float]:
    """Each output's error against the twin's; `backward`: the gradients' too."""
    if backward:
        got, want = through(KERNELS, x, cots), through(gated_delta_chunked, x, cots)
    else:
        got = dict(zip(NAMES, chunked.forward(*x, run=harness.launch)))
        want = dict(zip(NAMES, gated_delta_chunked(*x)))
    return {name: relative_error(got[name], want[name]) for name in got}


# Lengths that are multiples of no chunk (the last one padded) over 2 and 3 chunks; value heads
# per key head 1 and 2; two key heads; a batch of 2; head dims 64 and 128 (two key blocks in
# grads at 128).
@pytest.mark.parametrize(
    "t, hk, hv, dim, batch",
    [(100, 1, 2, 64, 1), (140, 2, 2, 64, 1), (70, 1, 1, 128, 2)],
)
def test_forward_and_every_gradient_match_the_twin(t, hk, hv, dim, batch):
    x, cots = inputs(t, hk, hv, dim, batch)
    for name, error in errors(x, cots).items():
        assert error < F32, (name, error)


@pytest.mark.parametrize("t", [1, 64])
def test_one_position_and_exactly_one_chunk(t):
    """No padding at all (64) and a chunk of one real position (log_g and beta then small
    enough for MLX to pass in `constant` memory)."""
    x, cots = inputs(t, 1, 2, 64, seed=t)
    for name, error in errors(x, cots).items():
        assert error < F32, (name, error)


@pytest.mark.parametrize("dtype, dim, t, hv", [(mx.float16, 64, 70, 2), (mx.bfloat16, 128, 40, 1)])
def test_half_precision_within_the_twins_own_error(dtype, dim, t, hv):
    """In float16/bfloat16 the kernels' error against the float32 twin on the same (rounded)
    inputs is no worse than the twin's own in that dtype (zero for the float32 outputs: the twin
    computes in float32 too, so those are held to float32's bound)."""
    x, cots = inputs(t, 1, hv, dim, dtype=dtype)
    up = [a.astype(mx.float32) for a in x]
    ref = through(gated_delta_chunked, up, [c.astype(mx.float32) for c in cots])
    got, own = through(KERNELS, x, cots), through(gated_delta_chunked, x, cots)
    for name in NAMES:
        kernel_error = relative_error(got[name], ref[name])
        twin_error = relative_error(own[name], ref[name])
        assert kernel_error <= 1.5 * twin_error + F32, (name, kernel_error, twin_error)
    assert got["y"].dtype == dtype and got["dq"].dtype == dtype


@pytest.mark.parametrize(
    "stem, edits, broken",  # broken: an output the mutation must show in
    [
        # the WY backward: dA = +T^T dT T^T
        ("delta/prepare_back", [("col < i ? -e[x]", "col < i ? e[x]")], "dk"),
        # the state scan skips chunk 0's update: the state passes through it unchanged
        (
            "delta/states",
            [("  const float gc = ", "  if (c == 0) {\n    continue;\n  }\n  const float gc = ")],
            "y",
        ),
        # tiles loaded with another lane layout (lane i holding row i / 4) than Apple's
        (
            "delta/output",
            [
                ("return ((lane / 4) & 4) + (lane / 2) % 4;", "return lane / 4;"),
                ("return ((lane / 4) & 2) * 2 + (lane % 2) * 2;", "return (lane % 4) * 2;"),
            ],
            "y",
        ),
        # the gates' share of the state update dropped from d cum
        ("delta/grads", [("tdc[CHUNK - 1] += s;", "tdc[CHUNK - 1] += 0.0f * s;")], "dlog_g"),
    ],
)
def test_the_comparisons_catch_a_broken_kernel(monkeypatch, stem, edits, broken):
    """The comparisons can fail: each mutation of a Metal body (made in the source MLX is
    handed within the test, then undone; the files stay as they are) shows as a large error in
    the output it breaks."""
    x, cots = inputs(100, 1, 1, 64)
    mutating(monkeypatch, stem, *edits)
    try:
        found = errors(x, cots, backward=broken not in ("y", "final_state"))
    finally:
        monkeypatch.undo()
        build.kernel.cache_clear()
    assert found[broken] > 1e-2, found


def test_every_block_fits_a_threadgroup():
    """Each shape of the table within an Apple GPU's 32 KiB of threadgroup memory and 1,024
    threads, leaving a GPU core at least 8 resident simdgroups by the estimate (about 60 KB of
    threadgroup memory a core), its steps dividing the head dim, with a reason."""
    for (kind, dim, width), g in blocks.METAL.items():
        dtype = mx.float32 if width == "float" else mx.float16
        assert blocks.metal_threadgroup_bytes(kind, dim, dtype) <= blocks.THREADGROUP_MEMORY
        resident = blocks.metal_simdgroups_per_core(kind, dim, dtype)
        assert resident >= blocks.MIN_SIMDGROUPS, (kind, dim, width, resident)
        assert g.threads <= 1024 and g.why, (kind, dim, width)
        for name, value in g.template:
            if name != "SK":
                assert value % 8 == 0 and dim % value == 0, (kind, dim, width, name)
        if kind == "grads":
            assert g["KB"] % g["SK"] == 0 and g["SK"] % 8 == 0
        if kind in ("states", "states_back"):
            assert g.simdgroups == g["BV"] // 8
        else:
            assert g.simdgroups == 8  # one per row tile of the chunk
    assert {(k, d) for k, d, _ in blocks.METAL} == {
        (k, d) for k in blocks.KERNELS for d in blocks.METAL_DIMS
    }


def counted_launches(dtype=mx.float32, dim=64, t=100, hk=1, hv=2):
    """The six kernels' launches (prepare keeping T) on inputs of their shapes (what a kernel
    reads does not depend on the values), and the shape as traffic.py takes it."""
    x, (dy, dstate) = inputs(t, hk, hv, dim, dtype=dtype)
    q, k, v, log_g, beta, state = x
    s = chunked.Sizes.of(q, v)
    z = mx.zeros
    n, np_ = s.chunks, s.padded
    cum, w, u = z((1, hv, np_)), z((1, hv, np_, dim)), z((1, hv, np_, dim))
    h, tri = z((1, n, hv, dim, dim)), z((1, hv, n, 64, 64))
    kb = blocks.metal("grads", dim, dtype)["KB"]
    calls = {
        "prepare": chunked.prepare_launch(s, k, v, log_g, beta, True),
        "states": chunked.states_launch(s, k, w, u, cum, state),
        "output": chunked.output_launch(s, q, k, cum, h, u),
        "states_back": chunked.states_back_launch(s, q, k, w, cum, dy, dstate),
        "grads": chunked.grads_launch(s, q, k, cum, h, u, h, u, dy),
        "prepare_back": chunked.prepare_back_launch(
            s, k, v, beta, cum, tri, w, u, z(q.shape), z((1, hv, dim // kb, np_))
        ),
    }
    return calls, traffic.Shape(1, t, hk, hv, dim, dtype)


@pytest.mark.parametrize("dtype, dim, t", [(mx.float32, 64, 100), (mx.bfloat16, 128, 40)])
def test_each_chunk_operand_is_read_a_bounded_number_of_times(dtype, dim, t):
    """The harness's counters equal traffic.py's design numbers (device bytes, products,
    barriers, threadgroup memory), and the staged operands (K, V, w, Q, h) are read within the
    bound the design states: a fixed number of times per kernel, not once per simdgroup."""
    calls, shape = counted_launches(dtype, dim, t)
    for kind, call in calls.items():
        _, counts = harness.run(call, counters=True)
        want = traffic.traffic(kind, shape, keep=True)
        for name in ("device_read_bytes", "device_write_bytes", "mma", "barriers"):
            assert counts[name] == getattr(want, name), (kind, name)
        tg = blocks.metal_threadgroup_bytes(kind, dim, dtype)
        assert counts["threadgroup_memory_bytes"] == tg, kind
        walked = counts["device_read_bytes"] - (want.device_read_bytes - want.walked_bytes)
        assert walked <= want.walked_bound_bytes, kind


@pytest.mark.parametrize(
    "kind, old",
    [
        ("states", "stage(tw, LDW, w + rows * DK + k0, DK, CHUNK, CHUNK, SL, tid, THREADS)"),
        ("output", "stage(tk, LDK, kc + k0, size_t(HK) * DK, CHUNK, valid, KS, tid, THREADS)"),
        ("prepare", "stage(tx, LD, vc + k0, size_t(HV) * DV, CHUNK, valid, KS, tid, THREADS)"),
    ],
)
def test_the_traffic_test_catches_an_operand_read_per_simdgroup(monkeypatch, kind, old):
    """Each simdgroup staging a chunk's w (states), K (output) or V (prepare) itself computes
    the same outputs, but reads past the bound above."""
    calls, shape = counted_launches()
    want = traffic.traffic(kind, shape, keep=True)
    plain = harness.run(calls[kind])
    mutating(monkeypatch, "delta/" + kind, (old, old.replace("tid, THREADS", "lane, 32")))
    try:
        outputs, counts = harness.run(calls[kind], counters=True)
    finally:
        monkeypatch.undo()
        build.kernel.cache_clear()
    for got, ref in zip(outputs, plain):
        np.testing.assert_array_equal(got, ref)
    walked = counts["device_read_bytes"] - (want.device_read_bytes - want.walked_bytes)
    assert walked > want.walked_bound_bytes


@pytest.mark.parametrize("dim", [64, 128])
def test_mlx_renders_every_kernel(dim):
    """MLX's own generator writes each kernel's full source with the table's block template."""
    calls, _ = counted_launches(mx.bfloat16, dim, t=8)
    for kind, call in calls.items():
        source = harness.render(call)
        assert "[[kernel]] void custom_kernel_" + call.spec.name in source
        values = ", ".join(str(v) for _, v in blocks.metal(kind, dim, mx.bfloat16).template)
        assert f"<bfloat16_t, {dim}, {dim}, {values}" in source, kind
        for name in call.spec.inputs + call.spec.outputs:
            assert f"* {name} [[buffer(" in source, (kind, name)


def test_no_small_input_meets_pointer_arithmetic():
    """MLX passes an input of fewer than 8 elements in Metal's `constant` address space (log_g
    and beta at one position, params always); a body offsetting such a pointer compiles in the
    harness but not for an Apple GPU. Render every kernel at its smallest shapes and, with
    libclang, check its address spaces."""
    import re

    for dtype in (mx.float32, mx.float16):
        calls, _ = counted_launches(dtype, 64, t=1, hk=1, hv=1)
        for call in calls.values():
            source = harness.render(call)
            body = source.split(") {", 1)[1]
            small = re.findall(r"const constant \w+\* (\w+) \[\[buffer", source)
            assert {"log_g", "beta", "params"} & set(small)
            for name in small:
                assert not re.search(rf"\b{name} \+", body), (call.spec.name, name)
            if harness.HAS_CLANG:
                harness.check_address_spaces(call, source)


def test_supports_and_geometry():
    q, v = mx.zeros((1, 8, 2, 64)), mx.zeros((1, 8, 4, 64))
    assert chunked.supports(q, q, v, "metal")
    assert not chunked.supports(q, q, mx.zeros((1, 8, 3, 64)), "metal")  # 3 value heads over 2
    assert not chunked.supports(q, q, mx.zeros((1, 8, 4, 32)), "metal")  # dv != dk
    x80 = mx.zeros((1, 8, 2, 80))
    assert not chunked.supports(x80, x80, x80, "metal")  # no block shape at 80
    assert not chunked.supports(q, q.astype(mx.float16), v, "metal")
    s = chunked.Sizes.of(q, v)
    assert (s.chunks, s.padded) == (1, 64)
    with pytest.raises(RuntimeError, match="no geometry for backend 'nowhere'"):
        chunked.output_launch(s, q, q, None, None, None, backend="nowhere")
    call = chunked.grads_launch(s, *[mx.zeros((1,))] * 8)
    g = blocks.metal("grads", 64, mx.float32)
    assert call.output_shapes[3] == (1, 4, 64 // g["KB"], 64)  # one dcum partial per key block
    assert call.grid == (1 * 2 * 1 * (64 // g["KB"]) * 256, 1, 1)
