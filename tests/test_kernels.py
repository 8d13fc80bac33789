"""The chunk-attention kernels, run on the CPU: MLX renders each Metal kernel, the harness
compiles it with g++ and runs it, and every output is compared with the ops twin."""

import zipfile

import mlx.core as mx
import pytest

import metal_kernels.attention as attention_kernels
from metal_kernels import harness
from mlxwalk.ops import routing
from mlxwalk.ops.attention import Prefix, check, chunk_attention, path
from mlxwalk.plan import PlanError

F32 = 1e-5  # float32: the kernels accumulate in float32 like the twin, in another order


@pytest.mark.parametrize(
    "dim, groups", [(64, 1), (64, 7), (128, 2), (128, 8), (256, 4), (256, 3), (64, 5), (128, 6)]
)
def test_float32_kernels_match_the_twin(on_harness, dim, groups):
    sizes = check.Sizes(chunk=40, start=70, grad_from=25)
    case = routing.Case("metal", mx.float32, dim, groups)
    for name, (kernel_error, _) in check.errors(case, sizes).items():
        assert kernel_error < F32, name


@pytest.mark.parametrize("dtype, store", [(mx.float16, mx.float16), (mx.bfloat16, mx.float32)])
def test_half_precision_within_the_twins_own_error(on_harness, dtype, store):
    """In float16/bfloat16 (with a float32 store for the mixed case) the kernels' error against
    the float32 reference is no worse than the twin's own in that dtype."""
    case = routing.Case("metal", dtype, 64, 2)
    for name, (kernel_error, twin_error) in check.errors(case, check.Sizes(), store).items():
        assert kernel_error <= 1.5 * twin_error + 1e-6, name


def test_no_prefix_and_untapped_prefix(on_harness):
    """The first chunk (no prefix) and a prefix that takes no gradient (no taps)."""
    for start, grad_from in ((0, 0), (64, 64)):
        sizes = check.Sizes(chunk=33, start=start, grad_from=grad_from)
        case = routing.Case("metal", mx.float32, 64, 2)
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


def test_routing(monkeypatch):
    q, k = mx.zeros((1, 4, 8, 64)), mx.zeros((1, 2, 8, 64))
    assert path(q, k, None) == "twin"  # the CPU: no GPU backend
    monkeypatch.setattr(routing, "backend", lambda: "cuda")
    monkeypatch.setattr(routing, "_verdicts", {routing.Case("cuda", mx.float32, 64, 2): True})
    assert path(q, k, None) == "kernel"
    assert path(q, k, None, auto=True) == "twin"  # CUDA at 64: mlx-lm's fused path wins
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
    for call in launches:
        source = harness.render(call)
        assert "[[kernel]] void custom_kernel_" + call.spec.name in source
        assert f"<bfloat16_t, float16_t, {dim}, {attention_kernels.ROWS}>" in source
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
    "stem, old, new, broken",  # broken: the output the mutation must show in
    [
        ("attention/dq", "- delta_i)", ")", "dq"),  # dS without the rowsum term
        ("attention/forward", "nk = START + i + 1", "nk = START + L", "out"),  # not causal
        ("attention/dkdv", "first = c - NT;", "first = 0;", "dk"),  # causality lost in dK/dV
    ],
)
def test_the_harness_catches_a_broken_kernel(on_harness, monkeypatch, stem, old, new, broken):
    """The comparisons can fail: each mutation of a Metal body shows as a large error."""
    from metal_kernels import build

    original = build.source

    def mutated(spec, backend):
        header, body = original(spec, backend)
        if spec.stem == stem:
            assert old in body or old in header
            body = body.replace(old, new)
        return header, body

    monkeypatch.setattr(build, "source", mutated)
    build.kernel.cache_clear()
    try:
        case = routing.Case("metal", mx.float32, 64, 2)
        errors = check.errors(case, check.Sizes(chunk=40, start=70, grad_from=25))
    finally:
        monkeypatch.undo()
        build.kernel.cache_clear()
    assert errors[broken][0] > 1e-2, errors


def test_no_small_input_meets_pointer_arithmetic():
    """MLX passes an input of fewer than 8 elements in Metal's `constant` address space; a body
    that offsets such a pointer into a `device` one compiles in the harness (address spaces are
    defined away there) but not for an Apple GPU. Render every kernel at its smallest shapes."""
    import re

    import metal_kernels.delta as delta_kernels

    z = mx.zeros
    q, k = z((1, 1, 1, 32)), z((1, 1, 1, 32))
    lse = delta = z((1, 1, 1))
    calls = [attention_kernels.forward_launch(q, k, k, None, None, 0, 0.1),
             *attention_kernels.backward_launches(q, k, k, None, None, 0, 0, 0.1, lse, delta, q),
             delta_kernels.scan_launch(z((1, 1, 1, 1)), *[z((1, 1, 1, 32))] * 2, z((1, 1, 1, 1)),
                                       z((1, 1, 1, 32)), z((1, 1)), z((1, 1, 32))),
             delta_kernels.scan_back_launch(*[z((1, 1, 1, 32))] * 2, z((1, 1, 1, 1)),
                                            z((1, 1, 1, 32)), z((1, 1)), z((1, 1, 1, 1)),
                                            z((1, 1, 32)))]  # fmt: skip
    for call in calls:
        source = harness.render(call)
        body = source.split(") {", 1)[1]
        for name in re.findall(r"const constant \w+\* (\w+) \[\[buffer", source):
            assert not re.search(rf"\b{name} \+", body), (call.spec.name, name)
