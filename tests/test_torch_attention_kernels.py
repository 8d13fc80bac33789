"""The torch backend's route to the tensor-core attention kernels
(mlxwalk/torch_backend/attention_kernels.py) and attention.py's routing table, on a machine
without a GPU: the driver's launches are tensor_cores.py's (the MLX side's), the whole forward
and backward with the CUDA bodies run by the CPU emulator matches SDPA's math path (output and the
three gradients, with a prefix and without, grouped heads), the router follows its table, and a
kernel that fails to build falls back with one line. What only a GPU tells (loading, launching,
speed) is scripts/h200-torch-attention.py's.
"""

import importlib
import shutil

import numpy as np
import pytest

from .extras import needs_torch

needs_torch()
pytestmark = pytest.mark.torch

import mlx.core as mx  # noqa: E402
import torch  # noqa: E402

from metal_kernels import build, cuda_emulator, cuda_source  # noqa: E402
from mlxwalk.torch_backend import attention, attention_kernels, nvrtc  # noqa: E402

tensor_cores = importlib.import_module("metal_kernels.attention.tensor_cores")
emulator = pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator needs g++")


def host(x: torch.Tensor) -> mx.array:
    if x.dtype in (torch.bfloat16, torch.float16):  # as their bits
        bits = mx.array(x.contiguous().view(torch.int16).numpy().view(np.uint16))
        return bits.view(mx.bfloat16 if x.dtype == torch.bfloat16 else mx.float16)
    return mx.array(x.contiguous().numpy())


def as_launch(call, inputs: list[torch.Tensor]) -> build.Launch:
    return tensor_cores.launch_of(call, [*map(host, inputs)])


def emulated(call, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """A runner for the driver: the call as MLX's Launch, run by the CUDA emulator."""
    return [torch.from_numpy(np.array(a)) for a in cuda_emulator.run(as_launch(call, inputs))]


def test_the_drivers_launches_are_tensor_cores_pys():
    """The torch driver's three launches equal those tensor_cores.py builds for MLX with the
    store in place (start = S - q, grad_from 0), inputs in the same order and dtypes."""
    seen = []

    def record(call, inputs):
        seen.append((call, [x.dtype for x in inputs], as_launch(call, inputs)))
        return [torch.zeros(s) for s in call.output_shapes]

    q, k, v, cot = attention_kernels.case(torch.bfloat16, 128, "cpu", n=40, prefix=70)
    out = attention_kernels.attention(*(a.requires_grad_() for a in (q, k, v)), run=record)
    out.backward(cot)
    mq, mk = host(q.detach()), host(k.detach())
    own = mk[:, :, 70:]
    lse, d = mx.zeros((1, 4, 40)), mx.zeros((1, 4, 40, 128), mx.bfloat16)
    want = [tensor_cores.forward_launch(mq, own, own, mk, mk, 70, 128**-0.5)]
    want += tensor_cores.backward_launches(mq, own, own, mk, mk, 70, 0, 128**-0.5, lse, lse, d)
    assert len(seen) == 3
    for (call, dtypes, got), launch in zip(seen, want):
        assert got.spec == launch.spec
        assert (got.grid, got.threadgroup) == (launch.grid, launch.threadgroup)
        assert got.shared_memory == launch.shared_memory
        mlx_unit = nvrtc.PRELUDE + cuda_source.render(launch, launch.spec.name)
        assert attention_kernels.unit(call, dtypes) == mlx_unit, call.spec.stem
        assert [tuple(s) for s in got.output_shapes] == [tuple(s) for s in launch.output_shapes]
        assert [a.dtype for a in got.inputs] == [a.dtype for a in launch.inputs]
        assert [a.shape for a in got.inputs] == [a.shape for a in launch.inputs]
        assert [a.tolist() for a in got.inputs[-2:]] == [a.tolist() for a in launch.inputs[-2:]]


@pytest.mark.slow
@emulator
@pytest.mark.parametrize(
    "dtype, dim, prefix, heads",
    [
        (torch.bfloat16, 64, 70, (4, 2)),  # a prefix, 2 query heads a K/V head
        (torch.float16, 128, 0, (3, 1)),  # no prefix: S = q
        (torch.bfloat16, 256, 30, (2, 1)),  # Qwen3.5's head dim: dK/dV split over warp pairs
    ],
)
def test_the_route_on_the_emulator_matches_sdpa_math(dtype, dim, prefix, heads):
    """Output, dq, dk, dv of the autograd op with the CUDA bodies on the emulator, against
    SDPA's math path in float32, within the routing's own tolerance; the self-check passes."""
    sizes = {"n": 40, "prefix": prefix, "heads": heads}
    errors = attention_kernels.compare(dtype, dim, "cpu", run=emulated, **sizes)
    name = str(dtype).rsplit(".", 1)[-1]
    assert max(errors.values()) <= attention_kernels.TOLERANCE[name], errors
    assert set(errors) == {"out", "dq", "dk", "dv"}


@pytest.fixture
def fresh(monkeypatch):
    """The routing's process state reset, the switch unset, the kernels 'on CUDA'."""
    monkeypatch.setattr(attention_kernels, "GATE", nvrtc.Gate("attention", "SDPA"))
    monkeypatch.setattr(attention_kernels, "_compiled", {})
    monkeypatch.setattr(attention_kernels, "on_cuda", lambda x: True)
    monkeypatch.delenv("MLXWALK_KERNELS", raising=False)


def routed(monkeypatch, table: dict, fake_kernels: bool = True) -> list[str]:
    """attention.py with `table` as its routes, each route's call recorded in the list (the
    kernels' too, and their self-check passing, where `fake_kernels`)."""
    taken = []
    monkeypatch.setattr(attention, "ROUTES", table)
    monkeypatch.setattr(attention, "_on_gpu", lambda q: True)
    monkeypatch.setattr(attention, "_flash", lambda *a: taken.append("sdpa-flash") or "flash")
    monkeypatch.setattr(attention, "_sdpa", lambda *a: taken.append("sdpa") or "sdpa")
    if not fake_kernels:
        return taken

    def kernels(query, key, value, scale=None):
        taken.append("kernels")
        return "kernels"

    monkeypatch.setattr(attention_kernels, "attention", kernels)
    monkeypatch.setattr(attention_kernels, "self_check", lambda *a: None)
    return taken


def run_walk(dtype=torch.bfloat16, dim=256):
    q, k, v, _ = attention_kernels.case(dtype, dim, "cpu", n=8, prefix=8)
    return attention.walk_attention(None, q, k, v)[0]


def test_the_router_obeys_the_table(fresh, monkeypatch):
    taken = routed(monkeypatch, {(256, "bfloat16"): "kernels", (128, "bfloat16"): "sdpa"})
    assert run_walk(dim=256) == "kernels"
    assert run_walk(dim=128) == "sdpa"
    assert run_walk(dim=64) == "flash"  # not in the table: FlashAttention's op
    assert run_walk(torch.float16, 256) == "flash"
    assert taken == ["kernels", "sdpa", "sdpa-flash", "sdpa-flash"]
    monkeypatch.setattr(attention, "ROUTES", {(256, "bfloat16"): "sdpa-flash"})
    assert run_walk(dim=256) == "flash"


def test_the_switch_overrides_the_table(fresh, monkeypatch):
    routed(monkeypatch, {})
    monkeypatch.setenv("MLXWALK_KERNELS", "on")
    assert run_walk(dim=256) == "kernels"  # on: wherever they apply, measured or not
    monkeypatch.setenv("MLXWALK_KERNELS", "off")
    monkeypatch.setattr(attention, "ROUTES", {(256, "bfloat16"): "kernels"})
    assert run_walk(dim=256) == "flash"


def test_the_measured_table_routes_the_kernels_nowhere():
    """FlashAttention's op won every measured case at 16K and 64K (docs/BENCHMARKS.md)."""
    assert attention.ROUTES[(256, "bfloat16")] == "sdpa-flash"
    assert "kernels" not in attention.ROUTES.values()
    assert set(attention.ROUTES.values()) <= set(attention.ROUTE_NAMES)


def test_a_build_failure_falls_back_with_one_line(fresh, monkeypatch, capsys):
    """The kernels routed, NVRTC failing: one line naming the kernel, SDPA from then on."""
    routed(monkeypatch, {(64, "bfloat16"): "kernels"}, fake_kernels=False)
    built = []

    def broken(source, name, device, shared_memory):
        built.append(name)
        raise RuntimeError("Kernel compilation failed:\nunit.cu(9): error: identifier undefined")

    monkeypatch.setattr(attention_kernels, "compile_unit", broken)
    assert run_walk(dim=64) == run_walk(dim=64) == "flash"
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert (
        "attention/forward_tc: does not build (unit.cu(9): error: identifier undefined)"
        in (lines[0])
    )
    assert "head dim 64, bfloat16" in lines[0] and built == ["mlxwalk_attention_forward_tc"]
    monkeypatch.setenv("MLXWALK_KERNELS", "on")
    attention_kernels.GATE.failed = None
    with pytest.raises(RuntimeError, match="MLXWALK_KERNELS=on, and attention/forward_tc"):
        run_walk(dim=64)


def test_the_bf16_units_at_256_build_with_nvrtc():
    """Qwen3.5's head dim through torch's NVRTC (for sm_90, to a cubin; no GPU needed)."""
    from torch.cuda._utils import _nvrtc_compile

    seen = []

    def record(call, inputs):
        seen.append(attention_kernels.unit(call, [x.dtype for x in inputs]))
        return [torch.zeros(s) for s in call.output_shapes]

    q, k, v, cot = attention_kernels.case(torch.bfloat16, 256, "cpu", n=16, prefix=16)
    attention_kernels.attention(*(a.requires_grad_() for a in (q, k, v)), run=record).backward(cot)
    names = ["forward_tc", "dq_tc", "dkdv_tc"]
    for source, name in zip(seen, names):
        kernel = f"mlx::core::cu::mlxwalk_attention_{name}"
        binary, mangled = _nvrtc_compile(source, kernel, "90", nvrtc.include_dirs())
        assert binary and mangled.startswith("_ZN3mlx4core2cu"), name
