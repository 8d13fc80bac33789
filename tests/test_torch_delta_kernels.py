"""The torch backend's route to the chunked delta rule's CUDA kernels
(mlxwalk/torch_backend/delta_kernels.py), on a machine without a GPU: its launches are chunked.py's
(the same units, grids, blocks, shared memory, params and buffers, call for call, forward and
backward), each unit builds with NVRTC (torch's, to a cubin) and with nvcc, the routing falls back
with one line where a kernel fails to build or disagrees and raises under MLXWALK_KERNELS=on, and
the whole forward and backward, run through the CUDA emulator, matches the torch ops. What only a
GPU tells (loading, launching, the shared memory attribute, speed) is scripts/h200-torch-delta.py's.
"""

import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from .extras import needs_torch

needs_torch()
pytestmark = pytest.mark.torch

import mlx.core as mx  # noqa: E402
import torch  # noqa: E402

from metal_kernels import build, cuda_emulator, cuda_source  # noqa: E402
from metal_kernels.delta import chunked, pipeline  # noqa: E402
from metal_kernels.sources import dtype_name  # noqa: E402
from mlxwalk.errors import ConfigError  # noqa: E402
from mlxwalk.torch_backend import delta, delta_kernels  # noqa: E402
from mlxwalk.torch_backend.nvrtc import Gate  # noqa: E402

DTYPES = {"float32": (torch.float32, mx.float32), "bfloat16": (torch.bfloat16, mx.bfloat16)}
DTYPES["float16"] = (torch.float16, mx.float16)


def torch_calls(dtype: torch.dtype, dim: int, t: int = 100, hk: int = 2, hv: int = 4):
    """(call, input dtypes) of each launch of the driver's forward then backward, recorded by an
    injected runner that hands back zeros."""
    seen = []

    def record(call, inputs):
        seen.append((call, [x.dtype for x in inputs]))
        return [torch.zeros(s) for s in call.output_shapes]

    x, cots = delta_kernels.layer(dtype, hk, hv, dim, t, "cpu")
    delta_kernels.forward(*x, run=record)
    delta_kernels.backward(*x, *cots, run=record)
    return seen


def mlx_launches(dtype: mx.Dtype, dim: int, t: int = 100, hk: int = 2, hv: int = 4):
    """Each launch of chunked.forward then chunked.backward on CUDA's geometry, recorded."""
    seen = []

    def record(launch):
        seen.append(launch)
        return [mx.zeros(s) for s in launch.output_shapes]

    z = mx.zeros
    x = [z((1, t, hk, dim), dtype), z((1, t, hk, dim), dtype), z((1, t, hv, dim), dtype)]
    x += [z((1, t, hv)), z((1, t, hv)), z((1, hv, dim, dim))]
    chunked.forward(*x, run=record, backend="cuda")
    cots = [z((1, t, hv, dim), dtype), z((1, hv, dim, dim))]
    chunked.backward(*x, *cots, run=record, backend="cuda")
    return seen


def units(dims=(64, 128), names=tuple(DTYPES)):
    """(label, NVRTC unit, kernel name) of every launch the driver makes."""
    for dim in dims:
        for name in names:
            for call, dtypes in torch_calls(DTYPES[name][0], dim):
                keep = dict(call.template).get("KEEP")
                label = f"{call.spec.stem} {dim} {name}" + ("" if keep is None else f" {keep}")
                yield label, delta_kernels.unit(call, dtypes), call.spec.name


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize("dim", [64, 128])
def test_the_drivers_launches_are_chunked_pys(dim, name):
    """Call for call, the driver's unit is PRELUDE + the kernel MLX renders for chunked.py's
    launch, with the same grid, block, shared memory, params, outputs and input dtypes."""
    ours, theirs = torch_calls(DTYPES[name][0], dim), mlx_launches(DTYPES[name][1], dim)
    assert [c.spec.stem for c, _ in ours] == [launch.spec.stem for launch in theirs]
    assert len(ours) == 8
    for (call, dtypes), launch in zip(ours, theirs):
        mlx_unit = delta_kernels.PRELUDE + cuda_source.render(launch, launch.spec.name)
        assert delta_kernels.unit(call, dtypes) == mlx_unit, call.spec.stem
        assert (call.grid, call.threadgroup) == (launch.grid, launch.threadgroup)
        assert call.shared_memory == launch.shared_memory > 0
        assert call.params == launch.inputs[-1].tolist()
        assert call.output_shapes == launch.output_shapes
        assert all(d == mx.float32 for d in launch.output_dtypes)
        ours_t = [dtype_name(d) for d in dtypes]
        assert ours_t == [dtype_name(a.dtype) for a in launch.inputs[:-1]]


def nvrtc(label: str, source: str, name: str) -> str | None:
    """NVRTC's error for a unit, built as compile_unit builds it (for sm_90, to a cubin)."""
    from torch.cuda._utils import _nvrtc_compile

    try:
        binary, mangled = _nvrtc_compile(
            source, f"mlx::core::cu::{name}", "90", delta_kernels.include_dirs()
        )
    except Exception as e:  # the log, for the assertion's message
        return f"{label}: {str(e)[-1500:]}"
    return None if binary and mangled.startswith("_ZN3mlx4core2cu") else f"{label}: no kernel"


def test_the_bf16_units_at_128_build_with_nvrtc():
    """Qwen3.5's case through torch's NVRTC (no GPU needed to compile)."""
    found = list(units(dims=(128,), names=("bfloat16",)))
    assert len(found) == 8
    assert [e for e in (nvrtc(*u) for u in found) if e] == []


@pytest.mark.slow
def test_every_unit_builds_with_nvrtc():
    found = list(units())
    assert len(found) == 48
    with ThreadPoolExecutor(2) as pool:
        assert [e for e in pool.map(lambda u: nvrtc(*u), found) if e] == []


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_every_unit_builds_with_nvcc():
    """Each distinct unit (keep's two prepares, the rest once per dim and dtype) with nvcc."""
    distinct = {source: label for label, source, _ in units()}
    assert len(distinct) == 42

    def nvcc(item) -> str | None:
        source, label = item
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "unit.cu"
            src.write_text(source)
            cmd = ["nvcc", "-arch=sm_90", "-std=c++17", "-c", "-o", f"{tmp}/u.o", str(src)]
            done = subprocess.run(cmd, capture_output=True, text=True)
        return f"{label}: {done.stderr[-1500:]}" if done.returncode else None

    with ThreadPoolExecutor(2) as pool:
        assert [e for e in pool.map(nvcc, distinct.items()) if e] == []


@pytest.fixture
def fresh(monkeypatch):
    """The routing's process state reset, the switch unset."""
    monkeypatch.setattr(delta_kernels, "GATE", Gate("the delta rule", "the torch ops"))
    monkeypatch.setattr(delta_kernels, "_compiled", {})
    monkeypatch.delenv("MLXWALK_KERNELS", raising=False)


def small(dtype=torch.float32, dim=64, t=70):
    return delta_kernels.layer(dtype, 1, 2, dim, t, "cpu")


def ops(x):
    return delta.gated_delta(*x)


def test_without_cuda_the_ops_run(fresh, monkeypatch):
    def never(*a, **k):
        raise AssertionError("no self-check without CUDA")

    monkeypatch.setattr(delta_kernels, "self_check", never)
    x, _ = small()
    for got, want in zip(delta_kernels.gated_delta(*x), ops(x)):
        assert torch.equal(got, want)


def cuda_pretended(monkeypatch):
    """CPU tensors routed as CUDA ones: the self-check and the compile then run here."""
    monkeypatch.setattr(delta_kernels, "on_cuda", lambda x: True)


def test_a_compile_failure_falls_back_with_one_line(fresh, monkeypatch, capsys):
    cuda_pretended(monkeypatch)
    built = []

    def broken(source, name, device, shared_memory):
        built.append(name)
        raise RuntimeError("Kernel compilation failed:\nunit.cu(3): error: expected a ';'")

    monkeypatch.setattr(delta_kernels, "compile_unit", broken)
    x, _ = small()
    for _ in range(2):  # the second call goes straight to the ops
        for got, want in zip(delta_kernels.gated_delta(*x), ops(x)):
            assert torch.equal(got, want)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert "delta/prepare: does not build (unit.cu(3): error: expected a ';')" in lines[0]
    assert built == ["mlxwalk_delta_prepare"]


def test_a_mismatch_falls_back_naming_the_kernel(fresh, monkeypatch, capsys):
    cuda_pretended(monkeypatch)
    errors = dict.fromkeys(delta_kernels.WRITER, 1e-7) | {"dbeta": 3e-3}
    monkeypatch.setattr(delta_kernels, "compare", lambda *a, **k: errors)
    x, _ = small()
    for got, want in zip(delta_kernels.gated_delta(*x), ops(x)):
        assert torch.equal(got, want)
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "delta/prepare_back: dbeta disagrees with the ops (relative error 3.0e-03" in line
    assert "dk 64, float32" in line


def test_a_nan_is_a_mismatch(fresh, monkeypatch):
    cuda_pretended(monkeypatch)
    errors = dict.fromkeys(delta_kernels.WRITER, 1e-7) | {"y": float("nan")}
    monkeypatch.setattr(delta_kernels, "compare", lambda *a, **k: errors)
    assert delta_kernels.self_check(torch.float32, 64, "cpu").startswith("delta/output: y")


def test_a_passing_self_check_routes_to_the_kernels_once(fresh, monkeypatch):
    cuda_pretended(monkeypatch)
    checks, ran = [], []
    monkeypatch.setattr(delta_kernels, "self_check", lambda *a: checks.append(a) and None)
    monkeypatch.setattr(delta_kernels, "kernels_op", lambda *a: ran.append(a) or "kernels")
    x, _ = small()
    assert delta_kernels.gated_delta(*x) == delta_kernels.gated_delta(*x) == "kernels"
    assert len(checks) == 1 and len(ran) == 2
    # v in another dtype goes to the kernels in q's; a dim the kernels lack stays on the ops
    half_v = [*x[:2], x[2].bfloat16(), *x[3:]]
    assert delta_kernels.gated_delta(*half_v) == "kernels" and ran[-1][2].dtype == torch.float32
    odd, _ = delta_kernels.layer(torch.float32, 1, 2, 32, 70, "cpu")
    assert delta_kernels.gated_delta(*odd) != "kernels"


def test_on_raises_and_off_never_checks(fresh, monkeypatch):
    cuda_pretended(monkeypatch)
    monkeypatch.setattr(delta_kernels, "self_check", lambda *a: "delta/grads: does not build (x)")
    x, _ = small()
    monkeypatch.setenv("MLXWALK_KERNELS", "on")
    with pytest.raises(RuntimeError, match=r"MLXWALK_KERNELS=on, and delta/grads: does not"):
        delta_kernels.gated_delta(*x)
    monkeypatch.setenv("MLXWALK_KERNELS", "off")
    monkeypatch.setattr(delta_kernels, "self_check", lambda *a: pytest.fail("checked under off"))
    for got, want in zip(delta_kernels.gated_delta(*x), ops(x)):
        assert torch.equal(got, want)
    monkeypatch.setenv("MLXWALK_KERNELS", "fast")
    with pytest.raises(ConfigError, match="MLXWALK_KERNELS='fast' is unknown"):
        delta_kernels.gated_delta(*x)


def emulated(call: pipeline.Call, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """A runner for the driver: the call as MLX's Launch, run by the CUDA emulator."""

    def host(x: torch.Tensor) -> mx.array:
        if x.dtype in (torch.bfloat16, torch.float16):  # as their bits
            bits = mx.array(x.contiguous().view(torch.int16).numpy().view(np.uint16))
            return bits.view(mx.bfloat16 if x.dtype == torch.bfloat16 else mx.float16)
        return mx.array(x.contiguous().numpy())

    launch = build.Launch(
        call.spec,
        [*map(host, inputs), mx.array(call.params, mx.int32)],
        call.output_shapes,
        [mx.float32] * len(call.output_shapes),
        call.grid,
        call.threadgroup,
        call.template,
        call.shared_memory,
    )
    return [torch.from_numpy(a) for a in cuda_emulator.run(launch)]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator needs g++")
@pytest.mark.parametrize("name, dim", [("float32", 64), ("bfloat16", 128)])
def test_the_whole_route_on_the_emulator_matches_the_ops(fresh, name, dim):
    """The driver's forward and backward (autograd.Function and all) with the CUDA bodies run by
    the emulator, against delta.gated_delta_chunked: y, the final state, all six gradients
    within the routing's own tolerance; then the self-check passes on it too."""
    dtype = DTYPES[name][0]
    errors = delta_kernels.compare(dtype, dim, "cpu", run=emulated, t=150)
    assert max(errors.values()) <= delta_kernels.TOLERANCE[name], errors
    with torch.no_grad():  # as the walk's decode first asks
        assert delta_kernels.self_check(dtype, dim, "cpu", run=emulated) is None


@pytest.mark.parametrize("module", ["delta_kernels", "attention_kernels"])
def test_the_self_check_takes_gradients_under_no_grad(module, monkeypatch):
    """The walk's decode runs under no_grad and meets the first call there: the self-check's
    backward must still run (on an H100 it failed so, and the ops served the whole walk)."""
    from mlxwalk.torch_backend import attention_kernels

    mod = {"delta_kernels": delta_kernels, "attention_kernels": attention_kernels}[module]
    seen = []

    def compare(*args, **kwargs):
        seen.append(torch.is_grad_enabled())
        return {"y" if module == "delta_kernels" else "out": 0.0}

    monkeypatch.setattr(mod, "compare", compare)
    with torch.no_grad():
        assert mod.self_check(torch.bfloat16, 64, "cpu") is None
    assert seen == [True]
