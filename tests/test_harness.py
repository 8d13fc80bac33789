"""The CPU harness itself (metal_kernels/harness): simdgroup matrices with Apple's lane layout,
the address-space check, the traffic counters, and mutations of each that the tests must catch.
Small kernels written here go through MLX's generator like the project's own."""

import re
import shutil

import mlx.core as mx
import numpy as np
import pytest

from metal_kernels import build, harness
from metal_kernels.build import Launch, Spec

F32 = 1e-5  # float32 against numpy's float64: another order of sums, float32 exp
needs_clang = pytest.mark.skipif(not harness.HAS_CLANG, reason=harness.NO_CLANG)

SOURCES: dict[str, tuple[str, str]] = {}  # stem -> (header, body) of the kernels written here


@pytest.fixture(autouse=True)
def kernels_written_here(monkeypatch):
    original = build.source

    def source(spec, backend):
        return SOURCES[spec.stem] if spec.stem in SOURCES else original(spec, backend)

    monkeypatch.setattr(build, "source", source)


def spec(stem: str, body: str, inputs, outputs, header: str = "") -> Spec:
    """A Metal-only kernel of this file (each variant under a stem of its own: MLX's kernel
    objects are cached by spec)."""
    SOURCES["harness_test/" + stem] = (header, body)
    return Spec("harness_test/" + stem, tuple(inputs), tuple(outputs), (), ("metal",))


def mutated(body: str, *edits: tuple[str, str]) -> str:
    for old, new in edits:
        assert old in body, old
        body = body.replace(old, new)
    return body


# C = A B for row-major A (M x K) and B (K x N): a threadgroup of four simdgroups owns a 16 x 16
# block of C, each simdgroup an 8 x 8 quarter; every 16-wide K-slice of A and B is staged in
# threadgroup memory once per threadgroup, then read as 8 x 8 matrices.
GEMM = """
threadgroup float ta[16 * 16];
threadgroup float tb[16 * 16];
const uint t = thread_index_in_threadgroup, sg = simdgroup_index_in_threadgroup;
const uint row0 = threadgroup_position_in_grid.y * 16, col0 = threadgroup_position_in_grid.x * 16;
const uint r8 = 8 * (sg / 2), c8 = 8 * (sg % 2);
simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
for (uint k0 = 0; k0 < K; k0 += 16) {
  for (uint i = t; i < 256; i += 128) {
    ta[i] = a[(row0 + i / 16) * K + k0 + i % 16];
    tb[i] = b[(k0 + i / 16) * N + col0 + i % 16];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint kk = 0; kk < 16; kk += 8) {
    simdgroup_float8x8 x, y;
    simdgroup_load(x, ta, 16, ulong2(kk, r8));
    simdgroup_load(y, tb, 16, ulong2(c8, kk));
    simdgroup_multiply_accumulate(acc, x, y, acc);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
STORE
"""
STORE = "simdgroup_store(acc, c, N, ulong2(col0 + c8, row0 + r8));"

# The epilogue as kernels do their softmax: on the lane's own two elements, a row's max and sum
# over the four lanes holding it (Apple's layout: lanes differing in bits 0 and 3), then each
# element written where the layout puts it. Here: a softmax over each row of every 8 x 8 block.
SOFTMAX = """
const uint lane = thread_index_in_simdgroup, qid = lane / 4;
const uint r = (qid & 4) + (lane / 2) % 4, cc = (qid & 2) * 2 + (lane % 2) * 2;
thread float2& e = acc.thread_elements();
float m = metal::max(e[0], e[1]);
m = metal::max(m, simd_shuffle_xor(m, 1));
m = metal::max(m, simd_shuffle_xor(m, 8));
const float2 p = float2(metal::exp(e[0] - m), metal::exp(e[1] - m));
float s = p[0] + p[1];
s += simd_shuffle_xor(s, 1);
s += simd_shuffle_xor(s, 8);
const size_t at = size_t(row0 + r8 + r) * N + col0 + c8 + cc;
c[at] = p[0] / s;
c[at + 1] = p[1] / s;
"""
# The same epilogue for a layout where lane i holds row i / 4 (not Apple's).
ROW_MAJOR_LANES = (
    ("(qid & 4) + (lane / 2) % 4", "lane / 4"),
    ("(qid & 2) * 2 + (lane % 2) * 2", "(lane % 4) * 2"),
    ("simd_shuffle_xor(m, 8)", "simd_shuffle_xor(m, 2)"),
    ("simd_shuffle_xor(s, 8)", "simd_shuffle_xor(s, 2)"),
)

# The operands read straight from device memory by every simdgroup, nothing staged: the same
# product, twice the device reads.
GEMM_UNSTAGED = """
const uint sg = simdgroup_index_in_threadgroup;
const uint row0 = threadgroup_position_in_grid.y * 16, col0 = threadgroup_position_in_grid.x * 16;
const uint r8 = 8 * (sg / 2), c8 = 8 * (sg % 2);
simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
for (uint k0 = 0; k0 < K; k0 += 8) {
  simdgroup_float8x8 x, y;
  simdgroup_load(x, a, K, ulong2(k0, row0 + r8));
  simdgroup_load(y, b, N, ulong2(col0 + c8, k0));
  simdgroup_multiply_accumulate(acc, x, y, acc);
}
simdgroup_store(acc, c, N, ulong2(col0 + c8, row0 + r8));
"""

# Half inputs staged in one two-dimensional threadgroup array through `threadgroup half*`
# pointers (one operand times a half literal), loaded as half matrices, each lane's elements
# converted to float for the product.
GEMM_HALF = mutated(
    GEMM,
    ("ta[i] = a[", "ta[i] = 1.0h * a["),
    (
        "threadgroup float ta[16 * 16];\nthreadgroup float tb[16 * 16];",
        "threadgroup half tiles[2][16 * 16];\nthreadgroup half* ta = tiles[0];\n"
        "threadgroup half *tb = tiles[1];",
    ),
    ("simdgroup_float8x8 x, y;", "simdgroup_half8x8 xh, yh;\n    simdgroup_float8x8 x, y;"),
    ("simdgroup_load(x, ta", "simdgroup_load(xh, ta"),
    ("simdgroup_load(y, tb", "simdgroup_load(yh, tb"),
    (
        "simdgroup_multiply_accumulate(",
        "x.thread_elements() = float2(xh.thread_elements());\n"
        "    y.thread_elements() = float2(yh.thread_elements());\n"
        "    simdgroup_multiply_accumulate(",
    ),
)


def gemm(stem: str, body: str, a: mx.array, b: mx.array, header: str = "") -> Launch:
    (m, k), n = a.shape, b.shape[1]
    assert m % 16 == 0 and n % 16 == 0 and k % 16 == 0
    return Launch(
        spec(stem, body, ("a", "b"), ("c",), header),
        [a, b],
        [(m, n)],
        [mx.float32],
        grid=(n // 16 * 128, m // 16, 1),
        threadgroup=(128, 1, 1),
        template=[("N", n), ("K", k)],
    )


def operands(m=32, n=32, k=48, dtype=mx.float32, seed=0) -> tuple[mx.array, mx.array]:
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    return mx.array(a.astype(np.float32)).astype(dtype), mx.array(b.astype(np.float32)).astype(
        dtype
    )


def product(a: mx.array, b: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)) @ np.array(b.astype(mx.float32))


def block_softmax(c: np.ndarray) -> np.ndarray:
    blocks = c.reshape(c.shape[0], -1, 8)
    e = np.exp(blocks - blocks.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)).reshape(c.shape)


def error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def test_a_simdgroup_matrix_gemm_matches_numpy():
    a, b = operands()
    (c,) = harness.run(gemm("gemm", mutated(GEMM, ("STORE", STORE)), a, b))
    assert error(c, product(a, b)) < F32


def test_half_operands_staged_through_threadgroup_pointers():
    """`threadgroup half tiles[2][16 * 16]` shared by the group, `threadgroup half* p = ...` a
    plain pointer into it; half matrices converted lane by lane."""
    a, b = operands(dtype=mx.float16)
    (c,) = harness.run(gemm("gemm_half", mutated(GEMM_HALF, ("STORE", STORE)), a, b))
    assert error(c, product(a, b)) < F32


# Lane l sets its elements to l and l + 0.5, and the matrix is stored: where each lands is the
# layout.
LANES = """
simdgroup_float8x8 m;
const float lane = float(thread_index_in_simdgroup);
m.thread_elements() = float2(lane, lane + 0.5f);
simdgroup_store(m, out, 8);
"""


def lanes_call(stem: str = "lanes") -> Launch:
    return Launch(
        spec(stem, LANES, ("x",), ("out",)),
        [mx.zeros((8,))],
        [(8, 8)],
        [mx.float32],
        grid=(32, 1, 1),
        threadgroup=(32, 1, 1),
    )


def apple_layout() -> np.ndarray:
    """Apple's map as MLX writes it (steel/attn/mma.h get_coord): qid = lane / 4,
    row = (qid & 4) + (lane / 2) % 4, col = (qid & 2) * 2 + (lane % 2) * 2; elements (row, col)
    and (row, col + 1)."""
    want = np.full((8, 8), np.nan, np.float32)
    for lane in range(32):
        qid = lane // 4
        row, col = (qid & 4) + (lane // 2) % 4, (qid & 2) * 2 + (lane % 2) * 2
        want[row, col], want[row, col + 1] = lane, lane + 0.5
    return want


def test_each_lane_holds_its_two_elements_in_apples_layout():
    (out,) = harness.run(lanes_call())
    np.testing.assert_array_equal(out, apple_layout())


def test_an_epilogue_on_thread_elements_needs_apples_layout():
    """A softmax on each lane's own elements, written for Apple's layout, matches numpy; the
    same body written for another layout (lane i holding row i / 4) does not."""
    a, b = operands()
    want = block_softmax(product(a, b))
    apple = mutated(GEMM, ("STORE", SOFTMAX))
    (c,) = harness.run(gemm("softmax", apple, a, b))
    assert error(c, want) < F32
    (c,) = harness.run(gemm("softmax_row_major", mutated(apple, *ROW_MAJOR_LANES), a, b))
    assert error(c, want) > 0.1


@pytest.fixture
def row_major_header(monkeypatch, tmp_path):
    """The harness with its lane map mutated (lane i holding row i / 4)."""
    for path in harness.HEADER.parent.glob("*.h"):
        shutil.copy(path, tmp_path)
    header = tmp_path / "metal.h"
    text = header.read_text()
    apple = "row = (qid & 4) + (lane / 2) % 4;\n  col = (qid & 2) * 2 + (lane % 2) * 2;"
    assert apple in text
    header.write_text(text.replace(apple, "row = lane / 4;\n  col = (lane % 4) * 2;"))
    monkeypatch.setattr(harness, "HEADER", header)


def test_a_mutated_lane_map_is_caught(row_major_header):
    """With the header's map mutated, the layout test and the Apple-layout epilogue fail, the
    other layout's passes, and a GEMM that only loads, multiplies and stores cannot tell."""
    (out,) = harness.run(lanes_call("lanes_mutated_header"))
    assert not np.array_equal(out, apple_layout())
    a, b = operands()
    want = block_softmax(product(a, b))
    apple = mutated(GEMM, ("STORE", SOFTMAX))
    (c,) = harness.run(gemm("softmax_mutated_header", apple, a, b))
    assert error(c, want) > 0.1
    (c,) = harness.run(
        gemm("softmax_row_major_mutated_header", mutated(apple, *ROW_MAJOR_LANES), a, b)
    )
    assert error(c, want) < F32
    (c,) = harness.run(gemm("gemm_mutated_header", mutated(GEMM, ("STORE", STORE)), a, b))
    assert error(c, product(a, b)) < F32


# Loads and stores with an origin (column 3, row 2) and a row length of W, plain and transposed,
# then the diagonal constructor and simdgroup_multiply: out[0] the block, out[1] the block read
# transposed, out[2] the block stored transposed, out[3] 2 I times the block.
MOVES = """
simdgroup_matrix<T, 8, 8> m;
simdgroup_float8x8 f, g;
simdgroup_load(m, x, W, ulong2(3, 2));
f.thread_elements() = float2(m.thread_elements());
simdgroup_store(f, out, 8);
simdgroup_store(f, out + 128, 8, ulong2(0, 0), true);
simdgroup_float8x8 two(2.0f);
simdgroup_multiply(g, two, f);
simdgroup_store(g, out + 192, 8);
simdgroup_load(m, x, W, ulong2(3, 2), true);
f.thread_elements() = float2(m.thread_elements());
simdgroup_store(f, out + 64, 8);
"""


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_origin_row_length_and_transposition(dtype):
    x = mx.arange(12 * 12).reshape(12, 12).astype(dtype)
    moves = spec("moves_" + str(dtype).split(".")[-1], MOVES, ("x",), ("out",))
    call = Launch(
        moves,
        [x],
        [(4, 8, 8)],
        [mx.float32],
        grid=(32, 1, 1),
        threadgroup=(32, 1, 1),
        template=[("T", dtype), ("W", 12)],
    )
    (out,) = harness.run(call)
    big = np.array(x.astype(mx.float32))
    block = big[2:10, 3:11]
    for got, want in zip(out, [block, big[3:11, 2:10].T, block.T, 2 * block]):
        np.testing.assert_array_equal(got, want)


def staged_traffic(m: int, n: int, k: int) -> dict[str, int]:
    """What the staged GEMM moves: each K-slice of A and B read from device memory once per
    threadgroup and written to threadgroup memory, each simdgroup's two 8 x 8 matrices per
    8-wide step read back, two barriers per slice, C written once."""
    groups, slices = (m // 16) * (n // 16), k // 16
    return {
        "device_read_bytes": groups * slices * 2 * 256 * 4,
        "device_write_bytes": m * n * 4,
        "threadgroup_read_bytes": groups * slices * 2 * 4 * 2 * 64 * 4,
        "threadgroup_write_bytes": groups * slices * 2 * 256 * 4,
        "mma": groups * 4 * k // 8,
        "barriers": groups * slices * 2,
        "simdgroup_barriers": 0,
        "threadgroup_memory_bytes": 2 * 256 * 4,
    }


def test_counters_pin_the_staged_gemm():
    a, b = operands(m=32, n=48, k=64)
    call = gemm("gemm", mutated(GEMM, ("STORE", STORE)), a, b)
    (c,), counts = harness.run(call, counters=True)
    assert error(c, product(a, b)) < F32
    assert counts == staged_traffic(32, 48, 64)
    (plain,) = harness.run(call)
    np.testing.assert_array_equal(c, plain)  # counting leaves the results as they are


def test_counters_catch_operands_read_per_simdgroup():
    """The unstaged GEMM computes the same C; only its traffic differs from the staged one's:
    twice the device reads, no threadgroup memory."""
    a, b = operands(m=32, n=48, k=64)
    (c,), counts = harness.run(gemm("gemm_unstaged", GEMM_UNSTAGED, a, b), counters=True)
    assert error(c, product(a, b)) < F32
    staged = staged_traffic(32, 48, 64)
    assert counts != staged
    assert counts["device_read_bytes"] == 2 * staged["device_read_bytes"]
    assert counts["threadgroup_read_bytes"] == counts["threadgroup_memory_bytes"] == 0
    assert counts["mma"] == staged["mma"] and counts["barriers"] == 0


def test_counters_on_the_attention_forward():
    """The counting build runs the project's kernels unchanged: the same outputs, every output
    byte written once, the traffic, products and barriers of the design (traffic.py), the
    threadgroup memory of its block table, no simdgroup barrier (loads are per lane)."""
    import metal_kernels.attention as attention_kernels
    from metal_kernels.attention import blocks, traffic

    mx.random.seed(0)
    q, k = mx.random.normal((1, 2, 8, 64)), mx.random.normal((1, 1, 8, 64))
    call = attention_kernels.forward_launch(q, k, k, None, None, 0, 0.1)
    plain = harness.run(call)
    outputs, counts = harness.run(call, counters=True)
    for got, want in zip(outputs, plain):
        np.testing.assert_array_equal(got, want)
    assert counts["device_write_bytes"] == sum(a.nbytes for a in outputs)
    design = traffic.traffic("forward", traffic.Shape(1, 2, 1, 8, 0, 0, 64, q.dtype, q.dtype))
    assert counts["device_read_bytes"] == design.device_read_bytes
    assert counts["mma"] == design.mma == 2 * 2 * 8  # per head: Q K^T and P V, 8 dim tiles
    assert counts["barriers"] == design.barriers == 2 * 4  # per head: one block of keys, K then V
    assert counts["simdgroup_barriers"] == 0
    tg = blocks.metal_threadgroup_bytes("forward", 64, mx.float32)
    assert counts["threadgroup_memory_bytes"] == tg


def test_threadgroup_memory_past_32_kib_is_refused():
    body = "threadgroup float big[8200];\nbig[thread_index_in_threadgroup] = 1.0f;\nout[0] = 0.0f;"
    call = Launch(
        spec("too_big", body, ("x",), ("out",)),
        [mx.zeros((8,))],
        [(1,)],
        [mx.float32],
        grid=(32, 1, 1),
        threadgroup=(32, 1, 1),
    )
    with pytest.raises(RuntimeError, match="32800 bytes of threadgroup memory"):
        harness.run(call)


def test_two_threadgroup_arrays_in_one_declaration_are_refused():
    """They would silently become one array per thread."""
    body = "threadgroup float ta[32], tb[32];\nout[0] = 0.0f;"
    call = Launch(
        spec("two_in_one", body, ("x",), ("out",)),
        [mx.zeros((8,))],
        [(1,)],
        [mx.float32],
        grid=(32, 1, 1),
        threadgroup=(32, 1, 1),
    )
    with pytest.raises(ValueError, match="one threadgroup variable per declaration"):
        harness.run(call)


# Address spaces: helpers of the kind kernels use, and mutations that cross spaces.
HELPERS = """
// The first element of a row in device memory.
inline float first(const device float* row) { return row[0]; }
"""
SCALED = "out[thread_position_in_grid.x] = x[thread_position_in_grid.x] * first(s);"


def written_here() -> list[Launch]:
    a, b = operands()
    return [
        gemm("gemm", mutated(GEMM, ("STORE", STORE)), a, b),
        gemm("gemm_half", mutated(GEMM_HALF, ("STORE", STORE)), *operands(dtype=mx.float16)),
        gemm("softmax", mutated(GEMM, ("STORE", SOFTMAX)), a, b),
        lanes_call(),
    ]


def the_projects() -> list[Launch]:
    """The project's kernels at float32 and in bfloat16 with a float16 store."""
    import metal_kernels.attention as attention_kernels
    import metal_kernels.delta as delta_kernels

    z, calls = mx.zeros, []
    for dtype, store in [(mx.float32, mx.float32), (mx.bfloat16, mx.float16)]:
        q, k, pk = z((1, 4, 8, 64), dtype), z((1, 2, 8, 64), dtype), z((1, 2, 16, 64), store)
        lse = z((1, 4, 8))
        calls.append(attention_kernels.forward_launch(q, k, k, pk, pk, 10, 0.1))
        calls += attention_kernels.backward_launches(q, k, k, pk, pk, 10, 4, 0.1, lse, lse, q)
    w, p = z((1, 1, 16, 32)), z((1, 1, 16, 16))
    calls.append(delta_kernels.scan_launch(z((1, 1, 16, 8)), w, w, p, w, z((1, 1)), z((1, 8, 32))))
    calls.append(
        delta_kernels.scan_back_launch(w, w, p, w, z((1, 1)), z((1, 1, 16, 8)), z((1, 8, 32)))
    )
    return calls


@needs_clang
def test_the_projects_kernels_and_these_pass_the_address_space_check():
    for call in written_here() + the_projects():
        harness.check_address_spaces(call)


@needs_clang
@pytest.mark.parametrize(
    "name, edit",
    [
        ("a threadgroup array to a device parameter", (STORE, STORE + "\nc[0] = first(ta);")),
        (
            "a threadgroup array bound to a device pointer",
            (STORE, STORE + "\ndevice float* p = ta;\np[0] = 0.0f;"),
        ),
        (
            "a thread array bound to a threadgroup pointer",
            (STORE, STORE + "\nthread float own[4];\nthreadgroup float* p = own;\np[0] = 0.0f;"),
        ),
        (
            "a thread array loaded as a matrix",
            (STORE, STORE + "\nthread float own[64];\nsimdgroup_load(acc, own);"),
        ),
    ],
)
def test_a_pointer_crossing_address_spaces_is_refused(name, edit):
    """g++ (address spaces defined away) compiles each; the clang check refuses it, as Metal's
    compiler would, and so does the harness's compile path."""
    body = mutated(GEMM, ("STORE", STORE), edit)
    call = gemm("cross_" + re.sub(r"\W", "_", name), body, *operands(), HELPERS)
    harness.compile_call(call, check=False)
    with pytest.raises(harness.AddressSpaceError, match="refused with Metal's address spaces"):
        harness.check_address_spaces(call)
    with pytest.raises(harness.AddressSpaceError):
        harness.compile_call(call)


@needs_clang
def test_a_small_input_in_constant_memory_meets_a_device_parameter():
    """MLX passes an input of fewer than 8 elements as `constant`: handing it to a helper that
    takes a `device` pointer compiles with g++ but not for an Apple GPU."""
    call = Launch(
        spec("scaled", SCALED, ("x", "s"), ("out",), HELPERS),
        [mx.ones((32,)), mx.array([2.0])],
        [(32,)],
        [mx.float32],
        grid=(32, 1, 1),
        threadgroup=(32, 1, 1),
    )
    assert "const constant float* s" in harness.render(call)
    harness.compile_call(call, check=False)
    with pytest.raises(harness.AddressSpaceError, match="first"):
        harness.check_address_spaces(call)
    call.inputs[1] = mx.full((8,), 2.0)  # 8 elements: a device buffer, and the helper is right
    harness.check_address_spaces(call)
    np.testing.assert_array_equal(harness.run(call)[0], np.full(32, 2.0, np.float32))
