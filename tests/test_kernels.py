"""The chunk-attention kernels, run on the CPU: MLX renders each Metal kernel, the harness
compiles it with g++ and runs it, and every output is compared with the ops twin."""

import zipfile

import mlx.core as mx
import numpy as np
import pytest

import metal_kernels.attention as attention_kernels
from metal_kernels import harness
from metal_kernels.attention import Q8, blocks, traffic
from mlxwalk.ops import routing
from mlxwalk.ops.attention import Prefix, check, chunk_attention, path
from mlxwalk.plan import PlanError
from mlxwalk.walk import store as kvstore

from .kernel_edits import mutating

pytestmark = pytest.mark.slow  # compiles every kernel: `python -m pytest -m slow`

F32 = 1e-5  # float32: the kernels accumulate in float32 like the twin, in another order


# Every head dim, and each grouped-query ratio 1-8 at least once; 45 queries and a prefix of 100
# are multiples of no block; two kv heads in the first case at 128 and at 256.
@pytest.mark.parametrize(
    "dim, groups, kv_heads",
    [
        (64, 5, 1),
        (64, 6, 1),
        (64, 7, 1),
        (64, 8, 1),
        (128, 1, 2),
        (128, 2, 1),
        (128, 4, 1),
        (256, 1, 2),
        (256, 3, 1),
    ],
)
def test_float32_kernels_match_the_twin(on_harness, dim, groups, kv_heads):
    sizes = check.Sizes(kv_heads=kv_heads, chunk=45, start=100, grad_from=37)
    case = routing.AttentionCase("metal", mx.float32, dim, groups)
    for name, (kernel_error, _) in check.errors(case, sizes).items():
        assert kernel_error < F32, name


@pytest.mark.parametrize(
    "dtype, store, dim, groups",
    [
        (mx.float16, mx.float16, 64, 2),
        (mx.bfloat16, mx.float32, 128, 3),
        (mx.bfloat16, mx.float16, 256, 2),
    ],
)
def test_half_precision_within_the_twins_own_error(on_harness, dtype, store, dim, groups):
    """In float16/bfloat16 (with a store of another dtype in the mixed cases) the kernels' error
    against the float32 reference is no worse than the twin's own in that dtype."""
    case = routing.AttentionCase("metal", dtype, dim, groups)
    sizes = check.Sizes(kv_heads=1, chunk=40, start=70, grad_from=25)
    for name, (kernel_error, twin_error) in check.errors(case, sizes, store).items():
        assert kernel_error <= 1.5 * twin_error + 1e-6, name


@pytest.mark.parametrize("store_batch", [2, 1])
def test_a_batch_over_its_own_store_or_a_shared_one(on_harness, store_batch):
    """Two sequences: each over its own rows of the store, or both over one store row."""
    mx.random.seed(2)
    q, d_out = mx.random.normal((2, 4, 21, 64)), mx.random.normal((2, 4, 21, 64))
    k, v = mx.random.normal((2, 2, 2, 21, 64))
    keys, values = mx.random.normal((2, store_batch, 2, 60, 64))
    x = {
        "q": q,
        "k": k,
        "v": v,
        "prefix": Prefix(check.Store(keys, values), 0, 50, mx.float32),
        "grad_from": 19,
        "scale": 0.125,
        "d_out": d_out,
    }
    got, want = check.through("kernel", x), check.through("twin", x)
    for name in check.OUTPUTS:
        assert check.relative_error(got[name], want[name]) < F32, name


def test_no_prefix_and_untapped_prefix(on_harness):
    """The first chunk (no prefix) and a prefix that takes no gradient (no taps)."""
    for start, grad_from in ((0, 0), (64, 64)):
        sizes = check.Sizes(chunk=33, start=start, grad_from=grad_from)
        case = routing.AttentionCase("metal", mx.float32, 64, 2)
        for name, (kernel_error, _) in check.errors(case, sizes).items():
            assert kernel_error < F32, (start, name)


def test_chunk_attention_routes_to_the_kernel_and_its_vjp(on_harness):
    """The public op, routed: the kernel path's output and gradients equal the twin's."""
    mx.random.seed(1)
    q, k, v = mx.random.normal((1, 4, 40, 64)), *mx.random.normal((2, 1, 2, 40, 64))
    store = check.Store(*mx.random.normal((2, 1, 2, 100, 64)))
    prefix = Prefix(store, 0, 60, mx.float32)
    taps = (mx.zeros((1, 2, 40, 64)), mx.zeros((1, 2, 40, 64)))
    assert path(q, k, prefix) == "kernel"

    def attend(q, k, v, tk, tv):
        return chunk_attention(q, k, v, prefix, 20, (tk, tv), 0.125)

    cot = mx.random.normal(q.shape)
    got = mx.vjp(attend, [q, k, v, *taps], [cot])
    routing._verdicts.clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLXWALK_KERNELS", "off")
        assert path(q, k, prefix) == "twin"
        want = mx.vjp(attend, [q, k, v, *taps], [cot])
    for a, b in zip([*got[0], *got[1]], [*want[0], *want[1]]):
        assert check.relative_error(a, b) < F32


# The 8-bit store (mlx-lm's q8: mx.quantize's triples), read in place by the kernels: the walk's
# groups are 64 at these head dims; 32 (mlx-lm's at head dims of 32 * odd) forced in one case.
@pytest.mark.parametrize("dim, groups, group", [(64, 2, 64), (128, 3, 32), (256, 1, 64)])
def test_float32_kernels_read_an_8bit_store_in_place(on_harness, monkeypatch, dim, groups, group):
    """The kernels over the q8 store equal the twin over its dequantized values (float32 bar)."""
    monkeypatch.setattr(kvstore, "group_size", lambda d: group)
    sizes = check.Sizes(kv_heads=1, chunk=45, start=100, grad_from=37)
    case = routing.AttentionCase("metal", mx.float32, dim, groups)
    for name, (kernel_error, _) in check.errors(case, sizes, Q8.dtype).items():
        assert kernel_error < F32, name


@pytest.mark.parametrize("dtype, dim", [(mx.float32, 128), (mx.bfloat16, 64), (mx.float16, 256)])
def test_an_8bit_store_reads_as_mx_dequantize_gives_it(on_harness, dtype, dim):
    """The kernels over the q8 store equal, bit for bit, the same kernels over a store holding
    mx.dequantize's values in the model's dtype: each element is dequantized as MLX does it."""
    case = routing.AttentionCase("metal", dtype, dim, 2)
    sizes = check.Sizes(kv_heads=2, chunk=33, start=70, grad_from=20)
    x = check.inputs(case, sizes, Q8.dtype)
    q8 = x["prefix"].store
    assert isinstance(x["prefix"].in_place()[0], Q8)
    dequantized = check.Store(*q8.read(0, 0, sizes.start + sizes.chunk, dtype), dtype)
    y = dict(x, prefix=Prefix(dequantized, 0, sizes.start, dtype))
    got, want = check.through("kernel", x), check.through("kernel", y)
    for name in check.OUTPUTS:
        assert mx.array_equal(got[name], want[name]).item(), name


@pytest.mark.parametrize(
    "stem, old, new, broken",
    [  # a wrong scale (the forward's staging, dK/dV's taps); a wrong group (every element of a
        # row on its first group's scale and bias)
        ("attention/forward", "float(S(s * float(", "float(S(1.01f * s * float(", "out"),
        ("attention/dkdv", "float(S(s * float(", "float(S(b * float(", "dtap_k"),
        ("attention/dq", "+ c / G;", "+ c / D;", "dq"),
        ("attention/dkdv", "+ d / G;", "+ d / D;", "dtap_v"),
    ],
)
def test_the_harness_catches_a_wrong_dequantization(
    on_harness, monkeypatch, stem, old, new, broken
):
    from metal_kernels import build

    mutating(monkeypatch, stem, (old, new))
    try:
        case = routing.AttentionCase("metal", mx.float32, 128, 2)  # two groups a row
        errors = check.errors(case, check.Sizes(chunk=40, start=70, grad_from=25), Q8.dtype)
    finally:
        monkeypatch.undo()
        build.kernel.cache_clear()
    assert not errors[broken][0] < 100 * F32, errors  # (NaN too: a bias as scale overflows)


def q8_store(positions: int, heads: int = 2, dim: int = 64) -> kvstore.KVStore:
    """The walk's 8-bit store of one attention layer over `positions`, filled."""
    store = kvstore.KVStore([(heads, dim, dim)], positions, "q8", mx.float32)
    store.write(0, 0, *mx.random.normal((2, 1, heads, positions, dim)))
    mx.eval(store.arrays())
    return store


def graph_peak(store, start: int, how: str, chunk: int = 64, taps: int = 64) -> float:
    """MiB MLX allocates past what it holds to evaluate one chunk's attention and its gradient
    (taps over the prefix's last `taps` positions) through `how`, the prefix of `start` read
    from layer 0 of `store`."""
    mx.random.seed(0)
    heads, dim = store.keys[0][0].shape[1], 64
    q = mx.random.normal((1, 2 * heads, chunk, dim))
    k, v = mx.random.normal((2, 1, heads, chunk, dim))
    tk, tv = mx.zeros((2, 1, heads, taps, dim))
    prefix = Prefix(store, 0, start, mx.float32)
    mx.eval(q, k, v, tk, tv)

    def loss(q, k, v, tk, tv):
        attended = chunk_attention(q, k, v, prefix, start - taps, (tk, tv), 0.125, how=how)
        return attended.sum()

    grads = mx.grad(loss, argnums=(0, 1, 2, 3, 4))
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    held = mx.get_active_memory()
    mx.eval(grads(q, k, v, tk, tv))
    return (mx.get_peak_memory() - held) / 2**20


def test_an_8bit_stores_chunk_graph_is_flat_in_the_prefix(on_harness, monkeypatch):
    """With a q8 store the kernels take the store's own arrays (nothing of the prefix computed
    in the chunk's graph), so what the chunk's attention allocates is the same over a prefix of
    1K and of 16K (a window of each); the twin, which dequantizes it tile by tile, allocates more
    past one tile."""
    calls = []
    monkeypatch.setattr(routing, "launch", lambda call: calls.append(call) or harness.launch(call))
    kernel, twin = [], []
    for start in (1024, 16384):
        store = q8_store(start + 64)
        calls.clear()
        kernel.append(graph_peak(store, start, "kernel"))
        (kq, ks, kb), (vq, vs, vb) = store.keys[0], store.values[0]
        assert len(calls) == 3
        for call in calls:  # q, k, v, then the store's own packed keys, values, scales, biases
            assert all(a is b for a, b in zip(call.inputs[3:9], [kq, vq, ks, kb, vs, vb]))
        twin.append(graph_peak(store, start, "twin"))
    assert kernel[1] <= kernel[0] * 1.01 + 0.01, kernel
    assert twin[1] > twin[0] + 2 * (kernel[1] + 0.1), (twin, kernel)


def test_a_mismatch_falls_back_with_one_line(on_harness, monkeypatch, capsys):
    def wrong(call):
        outputs = harness.launch(call)
        return [outputs[0] + 1.0, *outputs[1:]] if call.spec.name.endswith("dq") else outputs

    monkeypatch.setattr(routing, "launch", wrong)
    q, k = mx.zeros((1, 4, 8, 64)), mx.zeros((1, 2, 8, 64))
    assert path(q, k, None) == "twin"
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        "mlxwalk: kernel attention/dq disagrees with the ops twin (relative error "
        + lines[0].split("relative error ")[1]
    ]
    assert "metal float32 head dim 64 GQA 2; using the ops path" in lines[0]
    assert path(q, k, None) == "twin" and capsys.readouterr().err == ""  # checked once


def test_a_kernel_that_fails_to_build_falls_back_with_one_line(on_harness, monkeypatch, capsys):
    def broken(call):
        raise RuntimeError("error: use of undeclared identifier 'x'\nmore lines")

    monkeypatch.setattr(routing, "launch", broken)
    q, k = mx.zeros((1, 2, 8, 128)), mx.zeros((1, 2, 8, 128))
    assert path(q, k, None) == "twin"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "failed to run (error: use of undeclared identifier" in err


def test_on_a_kernel_that_fails_its_self_check_fails_loudly(on_harness, monkeypatch, capsys):
    """MLXWALK_KERNELS=on asks for the kernels: one that fails to build or to check is an error
    naming it (auto falls back, above), not a quiet run on the ops path."""

    def broken(call):
        raise RuntimeError("error: use of undeclared identifier 'x'")

    monkeypatch.setattr(routing, "launch", broken)
    monkeypatch.setenv("MLXWALK_KERNELS", "on")
    q, k = mx.zeros((1, 2, 8, 128)), mx.zeros((1, 2, 8, 128))
    with pytest.raises(RuntimeError, match="MLXWALK_KERNELS=on, and kernel attention failed its"):
        path(q, k, None)
    assert "failed to run (error: use of undeclared identifier" in capsys.readouterr().err


def test_check_mode_compares_and_returns_the_twin(on_harness, monkeypatch, capsys):
    q, k, v = mx.random.normal((1, 2, 24, 64)), *mx.random.normal((2, 1, 1, 24, 64))
    monkeypatch.setenv("MLXWALK_KERNELS", "off")
    want = mx.vjp(lambda q: chunk_attention(q, k, v, None, 0, None, 0.125), [q], [q])
    monkeypatch.setenv("MLXWALK_KERNELS", "check")
    assert path(q, k, None) == "check"
    got = mx.vjp(lambda q: chunk_attention(q, k, v, None, 0, None, 0.125), [q], [q])
    assert capsys.readouterr().err == ""  # they agree
    assert mx.array_equal(got[0][0], want[0][0]) and mx.array_equal(got[1][0], want[1][0])

    def wrong(call):  # a kernel gone wrong is named, and turned off
        return [a * 2 for a in harness.launch(call)]

    monkeypatch.setattr(routing, "launch", wrong)
    mx.eval(mx.vjp(lambda q: chunk_attention(q, k, v, None, 0, None, 0.125), [q], [q]))
    assert "kernel attention/forward disagrees with the ops twin" in capsys.readouterr().err
    assert path(q, k, None) == "twin"


def test_on_metal_a_kernel_slower_than_the_twin_is_not_used(on_harness, monkeypatch, capsys):
    """The first-use race on Metal: the harness (threads on a CPU) loses to the twin."""
    monkeypatch.setattr(routing, "RACE", {"attention": (32, 64)})
    q, k = mx.zeros((1, 2, 8, 64)), mx.zeros((1, 2, 8, 64))
    assert path(q, k, None) == "twin"
    err = capsys.readouterr().err
    assert err.startswith("mlxwalk: kernel attention took ") and err.count("\n") == 1
    assert "ms on metal float32 head dim 64 GQA 1 (32 queries over 64 keys" in err
    monkeypatch.setattr(check, "race", lambda case, size: (1.0, 2.0))
    monkeypatch.setattr(routing, "_verdicts", {})
    assert path(q, k, None) == "kernel"  # a kernel that wins is kept


def test_a_kernel_that_fails_in_its_race_falls_back_with_one_line(on_harness, monkeypatch, capsys):
    """A failure that shows only at the race's size (a launch past a device limit, memory) must
    not reach the training step: the ops path runs, with one line naming the kernel."""
    monkeypatch.setattr(routing, "RACE", {"attention": (32, 64)})

    def broken(case, size):
        raise RuntimeError("[metal::Device] Unable to allocate 1234 bytes\nand more")

    monkeypatch.setattr(check, "race", broken)
    q, k = mx.zeros((1, 2, 8, 64)), mx.zeros((1, 2, 8, 64))
    assert path(q, k, None) == "twin"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mlxwalk: kernel attention failed in its race")
    assert "Unable to allocate 1234 bytes) on metal float32 head dim 64" in err


def test_the_race_times_the_walks_own_instantiation(on_harness, monkeypatch):
    """Queries in half precision over a float32 store: the race builds its prefix in the store's
    dtype, the kernel instantiation the walk calls, not the queries'."""
    seen = []
    original = check.inputs

    def spy(case, sizes, store):
        seen.append(store)
        return original(case, sizes, store)

    monkeypatch.setattr(check, "inputs", spy)
    monkeypatch.setattr(routing, "seconds", lambda step: 0.0)
    case = routing.AttentionCase("metal", mx.float16, 64, 1, mx.float32)
    check.race(case, (8, 16))
    assert seen == [mx.float32]


def test_routing(monkeypatch):
    q, k = mx.zeros((1, 4, 8, 64)), mx.zeros((1, 2, 8, 64))
    assert path(q, k, None) == "twin"  # the CPU: no GPU backend
    monkeypatch.setattr(routing, "backend", lambda: "cuda")
    monkeypatch.setattr(
        routing, "_verdicts", {routing.AttentionCase("cuda", mx.float32, 64, 2): True}
    )
    assert path(q, k, None) == "kernel"
    assert path(q, k, None, auto=True) == "twin"  # CUDA at 64: mlx-lm's fused path wins
    h, hk = mx.zeros((1, 4, 8, 256), mx.bfloat16), mx.zeros((1, 2, 8, 256), mx.bfloat16)
    routing._verdicts[routing.AttentionCase("cuda", mx.bfloat16, 256, 2)] = True
    routing._verdicts[routing.AttentionCase("cuda", mx.float32, 256, 2)] = True
    assert path(h, hk, None, auto=True) == "kernel"  # CUDA at 256, bf16: the kernels win
    assert path(h.astype(mx.float32), hk.astype(mx.float32), None, auto=True) == "twin"
    x80, x64 = mx.zeros((1, 2, 8, 80)), mx.zeros((1, 2, 8, 64))
    assert not attention_kernels.supports(x80, x80, x80, None)  # not a multiple of 32
    assert not attention_kernels.supports(x64, x64, mx.zeros((1, 2, 8, 32)), None)  # dv != dk
    assert path(q, k, None, v=mx.zeros((1, 2, 8, 32))) == "twin"
    monkeypatch.setenv("MLXWALK_KERNELS", "check")  # check compares everywhere: tables aside
    assert path(q, k, None, auto=True) == "check"
    monkeypatch.setenv("MLXWALK_KERNELS", "on")
    assert path(q, k, None, auto=True) == "kernel"
    monkeypatch.setenv("MLXWALK_KERNELS", "off")
    assert path(q, k, None) == "twin"
    monkeypatch.setenv("MLXWALK_KERNELS", "fast")
    with pytest.raises(PlanError, match="MLXWALK_KERNELS='fast' is unknown"):
        path(q, k, None)


@pytest.mark.parametrize("dim", [64, 128, 256])
def test_mlx_renders_every_metal_kernel(dim):
    """MLX's own generator (mx.export_function, verbose) writes each kernel's full source."""
    q, k = mx.zeros((1, 4, 8, dim), mx.bfloat16), mx.zeros((1, 2, 8, dim), mx.bfloat16)
    pk = mx.zeros((1, 2, 16, dim), mx.float16)
    lse = delta = mx.zeros((1, 4, 8))
    forward = attention_kernels.forward_launch(q, k, k, pk, pk, 10, 0.1)
    launches = [
        forward,
        *attention_kernels.backward_launches(q, k, k, pk, pk, 10, 4, 0.1, lse, delta, q),
    ]
    for call, kind in zip(launches, blocks.KERNELS):
        source = harness.render(call)
        assert "[[kernel]] void custom_kernel_" + call.spec.name in source
        g = blocks.metal(kind, dim, mx.bfloat16)
        template = f"<bfloat16_t, float16_t, {dim}, 0, {g.rows}, {g.walk}, {g.pad}, {g.split}>"
        assert template in source  # G = 0: a float store
        for name in call.spec.inputs + call.spec.outputs:
            assert f"* {name} [[buffer(" in source


def test_the_wheel_carries_the_kernel_sources(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(root)]
    subprocess.run(cmd, check=True, capture_output=True)
    (wheel,) = tmp_path.glob("mlxwalk-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for kernel in ("forward", "dq", "dkdv"):
        for suffix in (".metal", ".cu"):
            assert f"metal_kernels/attention/{kernel}{suffix}" in names
    for name in ("common.metal", "common.cuh"):
        assert f"metal_kernels/attention/{name}" in names
        assert f"metal_kernels/delta/{name}" in names
    for scan in ("scan", "scan_back"):
        for suffix in (".metal", ".cu"):
            assert f"metal_kernels/delta/{scan}{suffix}" in names
    assert "metal_kernels/harness/metal.h" in names
    assert "metal_kernels/build.py" in names


@pytest.mark.parametrize(
    "stem, old, new, broken, dim",  # broken: the output the mutation must show in
    [
        ("attention/dq", "- dl)", ")", "dq", 64),  # dS without the rowsum term
        (
            "attention/forward",
            "const int sees = START + metal::min(r0 + fr, L - 1) + 1;",
            "const int sees = START + L;",
            "out",
            64,
        ),  # not causal within a simdgroup's rows
        ("attention/dkdv", "(kc < NT || kc - NT <= i)", "(kc < NK)", "dk", 64),  # nor in dK/dV
        (
            "attention/forward",
            "simd_shuffle_xor(x, 8)",
            "simd_shuffle_xor(x, 2)",
            "out",
            64,
        ),  # a row's lanes taken from another layout
        ("attention/dkdv", "(2 * (rg * SPLIT + p))", "(2 * sg)", "dk", 128),  # partners' parts
        ("attention/dq", "0, KT) : 0;", "0, KT - 1) : 0;", "dq", 64),  # a key tile skipped
        # a split simdgroup's partial S (forward), dP (dq) not summed with its partners'
        ("attention/forward", "sum_partials<SPLIT>(s,", "sum_partials<1>(s,", "out", 256),
        ("attention/dq", "sum_partials<SPLIT>(dp,", "sum_partials<1>(dp,", "dq", 256),
    ],
)
def test_the_harness_catches_a_broken_kernel(on_harness, monkeypatch, stem, old, new, broken, dim):
    """The comparisons can fail: each mutation of a Metal body shows as a large error."""
    from metal_kernels import build

    mutating(monkeypatch, stem, (old, new))
    try:
        case = routing.AttentionCase("metal", mx.float32, dim, 2)
        errors = check.errors(case, check.Sizes(chunk=40, start=70, grad_from=25))
    finally:
        monkeypatch.undo()
        build.kernel.cache_clear()
    assert errors[broken][0] > 1e-2, errors


def test_every_block_fits_a_threadgroup():
    """Each shape of the table within an Apple GPU's 32 KiB of threadgroup memory (the harness
    refuses more at run time, and the tests above run every entry) and 1,024 threads, and at
    least 8 simdgroups a GPU core by the threadgroup-memory estimate."""
    for kind, dim, width in blocks.METAL:
        dtype = mx.float32 if width == "float" else mx.float16
        g = blocks.metal(kind, dim, dtype)
        assert blocks.metal_threadgroup_bytes(kind, dim, dtype) <= blocks.THREADGROUP_MEMORY
        assert g.rows % 8 == 0 and g.walk % 8 == 0 and dim % (8 * g.split) == 0
        assert g.threads <= 1024, (kind, dim, width)
        assert blocks.simdgroups_per_core(kind, dim, dtype) >= 8, (kind, dim, width)


def counted_launches(dtype=mx.float32, store=mx.float32, dim=64, heads=4, kv_heads=2):
    """The three kernels over 37 queries and a prefix of 50 (30 of it tapped), and the shape
    as traffic.py takes it."""
    rng = np.random.default_rng(0)

    def normal(*shape, dt=dtype):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dt)

    q, d_out = normal(1, heads, 37, dim), normal(1, heads, 37, dim)
    k, v = normal(1, kv_heads, 37, dim), normal(1, kv_heads, 37, dim)
    pk, pv = normal(1, kv_heads, 60, dim, dt=store), normal(1, kv_heads, 60, dim, dt=store)
    lse, delta = normal(1, heads, 37, dt=mx.float32), normal(1, heads, 37, dt=mx.float32)
    calls = [
        attention_kernels.forward_launch(q, k, v, pk, pv, 50, 0.1),
        *attention_kernels.backward_launches(q, k, v, pk, pv, 50, 20, 0.1, lse, delta, d_out),
    ]
    shape = traffic.Shape(1, heads, kv_heads, 37, 50, 20, dim, dtype, store)
    return dict(zip(blocks.KERNELS, calls)), shape


@pytest.mark.parametrize(
    "dtype, store, dim", [(mx.float32, mx.float32, 64), (mx.bfloat16, mx.float16, 128)]
)
def test_each_block_is_read_once_per_threadgroup(dtype, store, dim):
    """The harness's counters equal traffic.py's design numbers (device bytes, products,
    barriers, threadgroup memory), and the walked side is read within the reuse the blocks
    promise: each K/V element at most ceil(L / BQ) times per query head in the forward and dq
    (one simdgroup per row read it L times), each Q/dO element at most ceil(keys / BK) times
    per query head in dK/dV."""
    calls, shape = counted_launches(dtype, store, dim)
    for kind, call in calls.items():
        _, counts = harness.run(call, counters=True)
        want = traffic.traffic(kind, shape)
        for name in ("device_read_bytes", "device_write_bytes", "mma", "barriers"):
            assert counts[name] == getattr(want, name), (kind, name)
        tg = blocks.metal_threadgroup_bytes(kind, dim, dtype)
        assert counts["threadgroup_memory_bytes"] == tg, kind
        walked = counts["device_read_bytes"] - (want.device_read_bytes - want.kv_read_bytes)
        assert walked <= want.kv_bound_bytes, kind


@pytest.mark.parametrize(
    "kind, stem, old, new",
    [
        (
            "forward",
            "attention/forward",
            "k_own, k0, START, kend, tid, THREADS",
            "k_own, k0, START, kend, lane, 32",
        ),  # each simdgroup stages K itself
        (
            "dq",
            "attention/dq",
            "v_own, k0, START, kend, tid, THREADS",
            "v_own, k0, START, kend, lane, 32",
        ),  # each simdgroup stages V itself
        (
            "dkdv",
            "attention/dkdv",
            "q0, L, tid, THREADS);\n    stage_rows<D>(tdo",
            "q0, L, lane, 32);\n    stage_rows<D>(tdo",
        ),  # each simdgroup stages Q itself
    ],
)
def test_the_traffic_test_catches_a_block_read_per_simdgroup(monkeypatch, kind, stem, old, new):
    """Each simdgroup loading a block from device memory itself computes the same outputs, but
    reads past the bound above."""
    from metal_kernels import build

    calls, shape = counted_launches()
    want = traffic.traffic(kind, shape)
    plain = harness.run(calls[kind])
    mutating(monkeypatch, stem, (old, new))
    try:
        outputs, counts = harness.run(calls[kind], counters=True)
    finally:
        monkeypatch.undo()
        build.kernel.cache_clear()
    for got, ref in zip(outputs, plain):
        np.testing.assert_array_equal(got, ref)
    walked = counts["device_read_bytes"] - (want.device_read_bytes - want.kv_read_bytes)
    assert walked > want.kv_bound_bytes


def test_no_small_input_meets_pointer_arithmetic():
    """MLX passes an input of fewer than 8 elements in Metal's `constant` address space; a body
    that offsets such a pointer into a `device` one compiles in the harness (address spaces are
    defined away there) but not for an Apple GPU. Render every kernel at its smallest shapes
    (lse and delta in constant memory too) and, with libclang, check its address spaces."""
    import re

    import metal_kernels.delta as delta_kernels

    z = mx.zeros
    q, k = z((1, 1, 1, 64)), z((1, 1, 1, 64))  # the smallest Metal head dim
    lse = delta = z((1, 1, 1))
    calls = [
        attention_kernels.forward_launch(q, k, k, None, None, 0, 0.1),
        *attention_kernels.backward_launches(q, k, k, None, None, 0, 0, 0.1, lse, delta, q),
        delta_kernels.scan_launch(
            z((1, 1, 1, 1)),
            *[z((1, 1, 1, 32))] * 2,
            z((1, 1, 1, 1)),
            z((1, 1, 1, 32)),
            z((1, 1)),
            z((1, 1, 32)),
        ),
        delta_kernels.scan_back_launch(
            *[z((1, 1, 1, 32))] * 2,
            z((1, 1, 1, 1)),
            z((1, 1, 1, 32)),
            z((1, 1)),
            z((1, 1, 1, 1)),
            z((1, 1, 32)),
        ),
    ]
    for call in calls:
        source = harness.render(call)
        body = source.split(") {", 1)[1]
        for name in re.findall(r"const constant \w+\* (\w+) \[\[buffer", source):
            assert not re.search(rf"\b{name} \+", body), (call.spec.name, name)
        if harness.HAS_CLANG:  # nor meets a helper's `device` parameter
            harness.check_address_spaces(call, source)


def test_the_roofline_script_prints_each_kernel():
    """scripts/roofline-attention.py prices traffic.py's numbers (pinned above) at a shape."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "roofline-attention.py"
    args = [sys.executable, str(script), "--chunk", "256", "--prefix", "512", "--dims", "64"]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    for kind in blocks.KERNELS:
        assert f"| {kind} | 64 | " in out
    assert "Estimates, not measurements" in out


def test_test_walk_exact_through_the_metal_kernels_on_the_harness(on_harness, capsys):
    """`mlxwalk test-walk-exact`'s table with every attention call on the Metal kernels (run by
    the harness): every row OK, and the kernels named as having run."""
    from mlxwalk import tiny
    from mlxwalk.commands import walk_exact as exactness

    assert exactness.table([("tiny-llama", str(tiny.path("tiny-llama")))])
    out = capsys.readouterr().out
    assert "test-walk-exact: every row OK" in out
    assert "kernels: metal float32 head dim 64 GQA 2" in out
    assert "metal float32 head dim 64 GQA 2 (q8 store)" in out  # the 8-bit row's, in place


def test_a_launch_split_over_kv_heads_changes_no_bit(on_harness, monkeypatch):
    """A launch past the roofline's limit runs as one per group of K/V heads (each head alone
    either way): forced here into 3 groups of the 4 K/V heads (1, 1 and 2), every output
    bit-equal to the one launch's, taps and all. A group that dropped or shifted a head
    (or a query-head slice off its K/V group) would not be."""
    from metal_kernels import roofline
    from mlxwalk.ops.attention import kernel

    mx.random.seed(4)
    q, d_out = mx.random.normal((2, 1, 8, 19, 64))  # 8 query heads over 4 K/V heads
    k, v = mx.random.normal((2, 1, 4, 19, 64))
    store = check.Store(*mx.random.normal((2, 1, 4, 50, 64)))
    x = {
        "q": q,
        "k": k,
        "v": v,
        "prefix": Prefix(store, 0, 40, mx.float32),
        "grad_from": 13,
        "scale": 0.125,
        "d_out": d_out,
    }
    whole = check.through("kernel", x)
    calls = []
    launch = routing.launch
    monkeypatch.setattr(routing, "launch", lambda call: calls.append(call) or launch(call))
    layer = roofline.attention(8, 4, 64, 19, 40, 13, mx.float32, mx.float32)
    slowest = max(x.seconds(roofline.M1_7CORE) for x in layer)
    monkeypatch.setattr(roofline, "LIMIT_S", slowest / 2.5)  # 3 launches each
    assert len(kernel.head_groups(("dq", "dkdv"), q, k, store.keys[0], 40, 13)) == 3
    split = check.through("kernel", x)
    assert len(calls) == 9  # forward, dq and dkdv, 3 groups each
    for name in check.OUTPUTS:
        assert mx.array_equal(split[name], whole[name]).item(), name


@pytest.mark.parametrize("shape, window", [("qwen3_5-27b", 67584), ("llama3-8b", 65536)])
def test_no_attention_launch_of_a_64k_walk_is_past_the_limit(shape, window):
    """The last chunk's launches (the largest: every prefix key tapped) at the 27B and 8B shapes,
    each group's under roofline.LIMIT_S on the smallest M-series GPU once split as the kernel
    path splits them."""
    from metal_kernels import roofline
    from mlxwalk.ops.attention import kernel
    from mlxwalk.shapes import SHAPES

    cfg = SHAPES[shape]
    hq, hkv, dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    start = (window - 1) // 2048 * 2048
    for kernels in (("forward",), ("dq", "dkdv")):
        groups = kernel.launches_needed(
            kernels, 1, hq, hkv, dim, 2048, start, 0, mx.bfloat16, mx.bfloat16
        )
        largest = -(-hkv // groups)  # K/V heads in the largest group
        layer = roofline.attention(hq // hkv * largest, largest, dim, 2048, start, 0)
        for launch in layer:
            if launch.kernel.split("/")[1] in kernels:
                assert launch.seconds(roofline.M1_7CORE) <= roofline.LIMIT_S, (shape, launch)
