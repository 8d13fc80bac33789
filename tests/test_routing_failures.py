"""A routed kernel that fails anywhere a real GPU can make it fail: to build, its self-check, its
first-use race, or a later call at a size it had not run at (raised when launched, or when MLX
evaluates it). Under MLXWALK_KERNELS=auto the result is the ops twin's, with one line naming the
kernel and the failure; under `on`, a RuntimeError naming the kernel.

Nothing here compiles a kernel: a failing launcher stands for a build or a wrong result, and a
stand-in kernel that computes the twin's result (raising where told) for one that passed its
self-check. The real kernels on the harness: the last test, marked slow."""

import mlx.core as mx
import numpy as np
import pytest

from metal_kernels import build
from metal_kernels.delta import chunked
from mlxwalk.ops import attention, delta, routing
from mlxwalk.ops.attention import check, chunk_attention, kernel, twin
from mlxwalk.ops.delta import chunk_kernel, mlx_fast, recurrence, scan

ALLOC = "[metal::Device] Unable to allocate 268435456 bytes"


@pytest.fixture
def gpu(monkeypatch):
    """Routing as on a Metal GPU, with no verdict yet, no race unless a test sets one, the scans
    and MLX's own delta rule out of the way (each test routes one kernel)."""
    monkeypatch.setattr(routing, "backend", lambda: "metal")
    monkeypatch.setattr(routing, "_verdicts", {})
    monkeypatch.setattr(routing, "_ran", {})
    monkeypatch.setattr(routing, "RACE", None)
    monkeypatch.setattr(scan, "use_kernel", lambda dk, chunk: False)
    monkeypatch.setattr(mlx_fast, "use", lambda q, v: False)
    monkeypatch.delenv("MLXWALK_KERNELS", raising=False)


def normal(*shape, seed=0):
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


class Attention:
    """One chunk's attention (8 or more queries, head dim 64, GQA 2), forward and gradients."""

    name = "attention"

    @staticmethod
    def run(n: int) -> list[mx.array]:
        q, d_out = normal(1, 2, n, 64), normal(1, 2, n, 64, seed=1)
        k, v = normal(1, 1, n, 64, seed=2), normal(1, 1, n, 64, seed=3)
        out, grads = mx.vjp(
            lambda q, k, v: chunk_attention(q, k, v, None, 0, None, 0.125), [q, k, v], [d_out]
        )
        mx.eval(out, grads)
        return [*out, *grads]

    @staticmethod
    def stand_in(monkeypatch, fails) -> None:
        """The kernel path computing the twin's result, raising where `fails(stage, size)`."""

        def forward(q, k, v, prefix, grad_from, scale, tile):
            if fails("forward", q.shape[2]):
                raise RuntimeError(ALLOC + "\nmore")
            return twin.forward(q, k, v, prefix, grad_from, scale, tile)

        def backward(q, k, v, prefix, grad_from, scale, tile, out, lse, d_out):
            if fails("backward", q.shape[2]):
                raise RuntimeError(ALLOC)
            return twin.backward(q, k, v, prefix, grad_from, scale, tile, out, lse, d_out)

        monkeypatch.setattr(kernel, "forward", forward)  # the self-check's and the race's
        monkeypatch.setattr(kernel, "backward", backward)
        monkeypatch.setitem(attention.PATHS, "kernel", (forward, backward))  # the walk's

    race = {"attention": (32, 64)}  # 32 queries over 64 keys
    race_size = 32
    forward, backward = "attention/forward", "attention/dq, attention/dkdv"
    sizes = (8, 24)


class Chunked:
    """One gated delta-net layer on the chunked kernels (1/2 heads, dim 64), values and
    gradients."""

    name = "delta-chunked"

    @staticmethod
    def run(t: int) -> list[mx.array]:
        (q, k, v, _, b, state), cots = chunk_kernel.layer(mx.float32, 1, 2, 64, 64, t)
        a, a_log, dt_bias = normal(1, t, 2, seed=4), mx.zeros((2,)), mx.zeros((2,))

        def layer(q, k, v, state):
            return delta.gated_delta_update(q, k, v, a, b, a_log, dt_bias, state)

        out, grads = mx.vjp(layer, [q, k, v, state], cots)
        mx.eval(out, grads)
        return [*out, *grads]

    @staticmethod
    def stand_in(monkeypatch, fails) -> None:
        def forward(q, k, v, log_g, beta, state, run=None, backend=None):
            if fails("forward", q.shape[1]):
                raise RuntimeError(ALLOC + "\nmore")
            return delta.gated_delta(q, k, v, log_g, beta, state)

        def backward(q, k, v, log_g, beta, state, dy, dstate, run=None, backend=None):
            if fails("backward", q.shape[1]):
                raise RuntimeError(ALLOC)
            x = [q, k, v, log_g, beta, state]
            return tuple(mx.vjp(delta.gated_delta, x, [dy, dstate])[1])

        monkeypatch.setattr(chunked, "forward", forward)
        monkeypatch.setattr(chunked, "backward", backward)

    race = {"delta-chunked": (140, 1)}  # 140 positions, batch 1
    race_size = 140
    forward, backward = "delta/chunked", "delta/chunked backward"
    sizes = (70, 130)


OPS = [Attention, Chunked]


def twins(op, size: int, monkeypatch) -> list[mx.array]:
    """The op on its twin (MLXWALK_KERNELS=off), verdicts untouched."""
    with monkeypatch.context() as m:
        m.setenv("MLXWALK_KERNELS", "off")
        return op.run(size)


def assert_twins(got: list[mx.array], want: list[mx.array]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert mx.array_equal(a, b)


def one_notice(capsys) -> str:
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("mlxwalk:")]
    assert len(lines) == 1, lines
    return lines[0]


def never(stage, size):
    return False


@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
def test_a_kernel_that_fails_to_build(gpu, monkeypatch, capsys, op):
    def broken(spec, backend, shared_memory=0):  # the builder, as Metal's compiler refuses
        raise RuntimeError("program_source:12:3: error: use of undeclared identifier 'x'\n...")

    monkeypatch.setattr(build, "kernel", broken)
    monkeypatch.setattr(routing, "launch", lambda call: build.launch(call, "metal"))
    size = op.sizes[0]
    assert_twins(op.run(size), twins(op, size, monkeypatch))
    line = one_notice(capsys)
    assert f"kernel {op.name} failed to run (program_source:12:3: error: use of undecl" in line
    assert line.endswith("; using the ops path")
    monkeypatch.setattr(routing, "_verdicts", {})
    monkeypatch.setenv("MLXWALK_KERNELS", "on")
    with pytest.raises(RuntimeError, match=f"kernel {op.name} failed its self-check"):
        op.run(size)


@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
def test_a_kernel_that_fails_its_self_check(gpu, monkeypatch, capsys, op):
    def wrong(call):  # every output zero: relative error 1
        return [mx.zeros(s, t) for s, t in zip(call.output_shapes, call.output_dtypes)]

    monkeypatch.setattr(routing, "launch", wrong)
    size = op.sizes[0]
    assert_twins(op.run(size), twins(op, size, monkeypatch))
    line = one_notice(capsys)
    assert f"kernel {op.forward} disagrees with the ops twin (relative error 1.0e+00)" in line
    monkeypatch.setattr(routing, "_verdicts", {})
    monkeypatch.setenv("MLXWALK_KERNELS", "on")
    with pytest.raises(RuntimeError, match=f"kernel {op.name} failed its self-check"):
        op.run(size)


@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
def test_a_kernel_that_fails_in_its_race(gpu, monkeypatch, capsys, op):
    """It passes its self-check, then fails at the race's size: the race is lost in one line.
    Under `on` there is no race; the kernel's first call at that size is the error."""
    monkeypatch.setattr(routing, "RACE", op.race)
    op.stand_in(monkeypatch, lambda stage, size: size == op.race_size)
    size = op.sizes[0]
    assert_twins(op.run(size), twins(op, size, monkeypatch))
    line = one_notice(capsys)
    assert f"kernel {op.name} failed in its race ({ALLOC}) on metal float32" in line
    monkeypatch.setattr(routing, "_verdicts", {})
    monkeypatch.setenv("MLXWALK_KERNELS", "on")
    op.run(size)  # checked, not raced
    with pytest.raises(RuntimeError, match=f"kernel {op.forward} failed at"):
        op.run(op.race_size)


@pytest.mark.parametrize("stage", ["forward", "backward"])
@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
def test_a_kernel_that_fails_later_at_another_size(gpu, monkeypatch, capsys, op, stage):
    """It passed its self-check and ran at one size; at the next it raises (a launch past a
    device limit, memory): that call's result is the twin's, one line says so, and the case
    stays on the twin from then on."""
    small, large = op.sizes
    op.stand_in(monkeypatch, lambda s, size: s == stage and size == large)
    op.run(small)
    case = next(iter(routing.verdicts()))
    assert routing.verdicts() == {case: True} and capsys.readouterr().err == ""
    assert_twins(op.run(large), twins(op, large, monkeypatch))
    line = one_notice(capsys)
    name = op.forward if stage == "forward" else op.backward
    assert line.startswith(f"mlxwalk: kernel {name} failed at ")
    assert f"({ALLOC}) on {case}; using the ops path" in line
    assert routing.verdicts() == {case: False}
    assert_twins(op.run(small), twins(op, small, monkeypatch))  # off from then on, quietly
    assert capsys.readouterr().err == ""

    monkeypatch.setattr(routing, "_verdicts", {})
    monkeypatch.setenv("MLXWALK_KERNELS", "on")
    op.run(small)
    with pytest.raises(RuntimeError, match=f"MLXWALK_KERNELS=on, and kernel {name} failed at"):
        op.run(large)


@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
def test_a_failure_that_shows_only_when_evaluated(gpu, monkeypatch, capsys, op):
    """MLX runs lazily: on a GPU a launch that fails at a new size raises at the eval, not at
    the call. The first call at each size is evaluated where the kernel is called (twice per
    size: forward and backward, and not again), so such a failure still falls back there."""
    small, large = op.sizes
    op.stand_in(monkeypatch, never)
    settled, armed = [], []
    original = routing.settle

    def settle(result):
        settled.append(1)
        if armed:
            raise RuntimeError("[METAL] Command buffer execution failed: Caused GPU Timeout Error")
        original(result)

    monkeypatch.setattr(routing, "settle", settle)
    op.run(small)
    op.run(small)
    assert len(settled) == 2  # the size's forward and backward, once
    armed.append(1)
    assert_twins(op.run(large), twins(op, large, monkeypatch))
    line = one_notice(capsys)
    assert f"kernel {op.forward} failed at " in line and "Caused GPU Timeout Error" in line


def test_the_scans_fail_later_at_another_size(gpu, monkeypatch, capsys):
    """The delta rule's scan kernels (their verdict given, as on a GPU): a call at a new chunk
    count that raises runs the ops recurrence, forward and backward, with one line."""
    monkeypatch.setattr(scan, "use_kernel", lambda dk, chunk: True)
    monkeypatch.setattr(chunk_kernel, "use", lambda *a: False)
    monkeypatch.setattr(routing, "_verdicts", {routing.ScanCase("metal", 64, 64): True})
    calls = []

    def failing_scan(f, s, keep=True):  # the forward's (no gradient)
        calls.append(("scan", f.u0.shape[0]))
        if f.u0.shape[0] == 3:  # three chunks
            raise RuntimeError(ALLOC)
        return recurrence.walk(f, s, keep)

    def counted_recurrence(f, s):  # the backward's (differentiable)
        calls.append(("recurrence", f.u0.shape[0]))
        return recurrence.recurrence(f, s)

    monkeypatch.setattr(scan, "scan", failing_scan)
    monkeypatch.setattr(scan, "recurrence", counted_recurrence)
    Chunked.run(70)  # two chunks of 64
    assert ("scan", 2) in calls and ("recurrence", 2) in calls
    assert capsys.readouterr().err == ""
    assert_twins(Chunked.run(130), twins(Chunked, 130, monkeypatch))
    line = one_notice(capsys)
    assert line.startswith("mlxwalk: kernel delta/scan failed at 3 chunks, 2 heads (")
    assert "delta rule key dim 64 chunk 64; using the ops path" in line


@pytest.mark.slow
def test_the_real_kernels_failing_at_a_later_size(on_harness, monkeypatch, capsys):
    """The attention kernels on the CPU harness pass their self-check and run at 8 queries; a
    launch at 40 raises: the twin's result, one line; under `on` the error."""
    from metal_kernels import harness

    monkeypatch.setattr(routing, "_ran", {})

    def launch(call):
        if any(a.ndim == 4 and a.shape[2] == 40 for a in call.inputs):
            raise RuntimeError(ALLOC)
        return harness.launch(call)

    monkeypatch.setattr(routing, "launch", launch)
    got = Attention.run(8)
    for a, b in zip(got, twins(Attention, 8, monkeypatch)):
        assert check.relative_error(a, b) < 1e-5  # the kernels' own result, near the twin's
    assert capsys.readouterr().err == ""
    assert_twins(Attention.run(40), twins(Attention, 40, monkeypatch))
    assert "kernel attention/forward failed at batch 1, 2 heads, 40 queries" in one_notice(capsys)
    monkeypatch.setattr(routing, "_verdicts", {})
    monkeypatch.setenv("MLXWALK_KERNELS", "on")
    with pytest.raises(RuntimeError, match="kernel attention/forward failed at"):
        Attention.run(40)
