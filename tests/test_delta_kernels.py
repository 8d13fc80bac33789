"""The delta rule's scan kernels, run on the CPU through the harness against the ops recurrence:
the self-check's cases, the whole op forward and backward, MLX's rendering, a mutation."""

import mlx.core as mx
import numpy as np
import pytest

import metal_kernels.delta as delta_kernels
from metal_kernels import build, harness
from mlxwalk.ops import delta, routing
from mlxwalk.ops.delta import chunk, mlx_fast, scan

pytestmark = pytest.mark.slow  # compiles every kernel: `python -m pytest -m slow`

F32 = 1e-5


@pytest.mark.parametrize("dk, chunk", [(32, 16), (64, 40), (128, 64)])
def test_scans_match_the_ops_recurrence(on_harness, dk, chunk):
    errors = scan.kernel_vs_twin(routing.ScanCase("metal", dk, chunk))
    assert max(errors.values()) < F32, errors


def inputs(t=100, hk=1, hv=2, dk=32, dv=16, seed=0):
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=1.0):
        return mx.array((scale * rng.standard_normal(shape)).astype(np.float32))

    q, k = normal(1, t, hk, dk, scale=0.3), normal(1, t, hk, dk, scale=0.3)
    v = normal(1, t, hv, dv)
    log_g = -mx.array(rng.uniform(0.01, 0.3, (1, t, hv)).astype(np.float32))
    beta = mx.array(rng.uniform(0.1, 0.9, (1, t, hv)).astype(np.float32))
    state = normal(1, hv, dv, dk, scale=0.5)  # a non-zero initial state
    return [q, k, v, log_g, beta, state]


@pytest.mark.parametrize("size", [32, 64])
def test_the_op_on_the_kernels_matches_the_ops(on_harness, monkeypatch, size):
    """gated_delta through the scans against its ops path: 100 positions (not a multiple of
    the chunk), several chunks, every input's gradient and the initial state's."""
    monkeypatch.setattr(chunk, "CHUNK", size)
    x = inputs()
    cots = [
        mx.array(np.random.default_rng(1).standard_normal((1, 100, 2, 16)).astype(np.float32)),
        mx.ones((1, 2, 16, 32)),
    ]
    assert scan.use_kernel(32, size)
    got = mx.vjp(delta.gated_delta, x, cots)
    monkeypatch.setenv("MLXWALK_KERNELS", "off")
    assert not scan.use_kernel(32, size)
    want = mx.vjp(delta.gated_delta, x, cots)
    for a, b in zip([*got[0], *got[1]], [*want[0], *want[1]]):
        err = (mx.linalg.norm((a - b).reshape(-1)) / mx.linalg.norm(b.reshape(-1))).item()
        assert err < F32


def test_mlx_renders_both_scans():
    n, h, c, dv, dk = 2, 3, 64, 16, 128
    z = mx.zeros
    calls = [
        delta_kernels.scan_launch(
            z((n, h, c, dv)),
            *[z((n, h, c, dk))] * 2,
            z((n, h, c, c)),
            z((n, h, c, dk)),
            z((n, h)),
            z((h, dv, dk)),
        ),
        delta_kernels.scan_back_launch(
            *[z((n, h, c, dk))] * 2,
            z((n, h, c, c)),
            z((n, h, c, dk)),
            z((n, h)),
            z((n, h, c, dv)),
            z((h, dv, dk)),
        ),
    ]
    for call in calls:
        source = harness.render(call)
        assert "[[kernel]] void custom_kernel_" + call.spec.name in source
        for name in call.spec.inputs + call.spec.outputs:
            assert f"* {name} [[buffer(" in source


def test_a_failing_scan_falls_back_with_one_line(on_harness, monkeypatch, capsys):
    monkeypatch.setattr(routing, "launch", lambda call: [a * 1.5 for a in harness.launch(call)])
    assert not scan.use_kernel(64, 16)
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "disagrees with the ops twin" in err and "metal delta rule key dim 64 chunk 16" in err


@pytest.mark.parametrize(
    "stem, old, new",  # each a mutation of a Metal body the comparison must catch
    [
        ("delta/scan", "acc += tx[sg][t] * kd", "acc -= tx[sg][t] * kd"),
        ("delta/scan_back", "- tdu[sg][t] * w", "+ tdu[sg][t] * w"),
    ],
)
def test_the_harness_catches_a_broken_scan(on_harness, monkeypatch, stem, old, new):
    original = build.source

    def mutated(spec, backend):
        header, body = original(spec, backend)
        if spec.stem == stem:
            assert old in body
            body = body.replace(old, new)
        return header, body

    monkeypatch.setattr(build, "source", mutated)
    build.kernel.cache_clear()
    try:
        errors = scan.kernel_vs_twin(routing.ScanCase("metal", 32, 16))
    finally:
        monkeypatch.undo()
        build.kernel.cache_clear()
    assert errors[stem] > 1e-2, errors


def test_delta_routing(monkeypatch):
    monkeypatch.setattr(routing, "backend", lambda: "cuda")
    case = routing.ScanCase("cuda", 64, 16)
    monkeypatch.setattr(routing, "_verdicts", {case: True})
    monkeypatch.delenv("MLXWALK_KERNELS", raising=False)
    assert not scan.use_kernel(64, 16)  # CUDA: measured slower than the ops
    monkeypatch.setenv("MLXWALK_KERNELS", "on")
    assert scan.use_kernel(64, 16)
    assert not scan.use_kernel(80, 16)  # a key dim the scans do not take
    assert not scan.use_kernel(64, 512)  # nor a chunk past their threadgroup memory


def test_on_metal_slower_scans_are_not_used(on_harness, monkeypatch, capsys):
    monkeypatch.setattr(routing, "RACE", {"delta": (4, 1)})
    assert not scan.use_kernel(32, 16)  # the harness (threads on a CPU) loses to the ops
    err = capsys.readouterr().err
    assert err.startswith("mlxwalk: kernel delta took ") and err.count("\n") == 1
    assert "on metal delta rule key dim 32 chunk 16 (4 chunks, 1 value heads" in err


def test_mlx_gated_delta_update_is_checked_and_raced_on_metal(monkeypatch, capsys):
    """On Metal the drop-in may route a layer to MLX's own op: checked against ours (every
    gradient, the initial state's included), then raced. Here MLX's op is its CPU fallback: it
    matches, and loses the race to ours."""
    monkeypatch.setattr(routing, "backend", lambda: "metal")
    monkeypatch.setattr(routing, "_verdicts", {})
    monkeypatch.setattr(routing, "RACE", {"mlx-delta": (256, 1)})
    monkeypatch.delenv("MLXWALK_KERNELS", raising=False)
    q, v = mx.zeros((1, 8, 2, 32)), mx.zeros((1, 8, 4, 16))
    case = mlx_fast.case_of(q, v)
    assert mlx_fast.kernel_vs_twin(case)["mlx gated_delta_update"] < 1e-5
    assert not mlx_fast.use(q, v)
    err = capsys.readouterr().err
    assert "gated_delta_update 2/4 heads, dims 32/16 (256 positions, batch 1" in err
    monkeypatch.setattr(routing, "_verdicts", {})
    monkeypatch.setattr(routing, "RACE", None)
    assert mlx_fast.use(q, v)  # correct, and not raced: routed
    x = inputs(t=50, hk=2, hv=4, dk=32, dv=16)
    a, b = mx.random.normal((2, 1, 50, 4))
    got = delta.gated_delta_update(x[0], x[1], x[2], a, b, mx.zeros((4,)), mx.zeros((4,)), x[5])
    monkeypatch.setenv("MLXWALK_KERNELS", "off")
    want = delta.gated_delta_update(x[0], x[1], x[2], a, b, mx.zeros((4,)), mx.zeros((4,)), x[5])
    for g, w in zip(got, want):
        assert mx.allclose(g, w, rtol=1e-4, atol=1e-5)
