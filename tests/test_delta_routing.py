"""Where the chunked delta-rule kernels run (mlxwalk/ops/delta/chunk_kernel.py): on a Metal GPU
(here the CPU harness) after a self-check against the ops that every gradient passes; a kernel
that disagrees is turned off in one line; on CUDA only when measured faster or forced."""

import mlx.core as mx
import pytest

from metal_kernels import harness
from mlxwalk.ops import delta, routing
from mlxwalk.ops.delta import chunk_kernel

pytestmark = pytest.mark.slow  # compiles every kernel: `python -m pytest -m slow`


def layer(t=70, hk=1, hv=2, d=64, seed=1):
    case = routing.ChunkedDeltaCase("metal", mx.float32, hk, hv, d)
    x, _ = chunk_kernel._layer(case, t)
    return x


def test_the_layer_runs_on_the_kernels_after_their_self_check(on_harness):
    q, k, v, log_g, beta, state = layer()
    assert chunk_kernel.use(q, k, v, delta.gated_delta)
    case = chunk_kernel.case_of(q, v)
    assert routing.verdicts()[case] is True
    y, s = delta.gated_delta_update(
        q,
        k,
        v,
        mx.zeros(log_g.shape),
        mx.zeros(beta.shape),
        mx.zeros((v.shape[-2],)),
        mx.zeros((v.shape[-2],)),
        state,
    )
    a_log = mx.zeros((v.shape[-2],))
    want = delta.gated_delta(
        q,
        k,
        v,
        -mx.exp(a_log) * mx.log1p(mx.exp(mx.zeros(log_g.shape))),
        mx.sigmoid(mx.zeros(beta.shape)),
        state,
    )
    assert routing.relative_error(y, want[0]) <= 1e-5
    assert routing.relative_error(s, want[1]) <= 1e-5


def test_a_kernel_that_disagrees_falls_back_with_one_line(on_harness, monkeypatch, capsys):
    monkeypatch.setattr(routing, "launch", lambda call: [a * 1.5 for a in harness.launch(call)])
    q, k, v, *_ = layer()
    assert not chunk_kernel.use(q, k, v, delta.gated_delta)
    lines = [x for x in capsys.readouterr().err.splitlines() if "delta/chunked" in x]
    assert len(lines) == 1 and "chunked delta rule 1/2 heads, dim 64; using the ops" in lines[0]


@pytest.mark.parametrize(
    "mode, measured, used",
    [("auto", False, False), ("auto", True, True), ("on", False, True), ("off", True, False)],
)
def test_on_cuda_only_when_measured_or_forced(on_harness, monkeypatch, mode, measured, used):
    monkeypatch.setattr(routing, "backend", lambda: "cuda")
    monkeypatch.setattr(chunk_kernel, "CUDA_CHUNKED", (mx.float32,) if measured else ())
    monkeypatch.setenv("MLXWALK_KERNELS", mode)
    q, k, v, *_ = layer()
    case = chunk_kernel.case_of(q, v)
    if case is not None:
        routing._verdicts[case] = True  # the self-check's verdict, as on a GPU
    assert chunk_kernel.use(q, k, v, delta.gated_delta) is used
