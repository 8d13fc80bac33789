"""The torch backend's routes ahead of and inside a hybrid's gated delta-net layers
(mlxwalk/torch_backend/recurrent.py), on a CPU with neither package installed: causal-conv1d and
flash-linear-attention are stand-in modules put in sys.modules. The conv route takes a package
that computes the causal conv, refuses one that does not (or is missing, or raises) with one line,
and a tiny hybrid's logits, loss and gradients are the same through either conv; flash-linear-
attention is refused on Hopper under Triton before 3.7.1, in one line naming both."""

import types

import numpy as np
import pytest

from .extras import needs_torch

needs_torch()
pytestmark = pytest.mark.torch

import torch  # noqa: E402
from transformers.models.qwen3_5 import modeling_qwen3_5  # noqa: E402
from transformers.models.qwen3_next import modeling_qwen3_next  # noqa: E402

from mlxwalk.errors import ConfigError  # noqa: E402
from mlxwalk.torch_backend import model as models  # noqa: E402
from mlxwalk.torch_backend import recurrent  # noqa: E402
from mlxwalk.torch_backend.walk import window_gradient  # noqa: E402

ROUTED = ("causal_conv1d_fn", "causal_conv1d_update", recurrent._NAME, recurrent._ONE)


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    """The modeling modules' names put back after each test; no check or line remembered."""
    for module in (modeling_qwen3_5, modeling_qwen3_next):
        for name in ROUTED:
            monkeypatch.setattr(module, name, getattr(module, name))
    clear(monkeypatch)


def clear(monkeypatch):
    monkeypatch.setattr(recurrent, "_conv_checked", {})
    monkeypatch.setattr(recurrent, "_checked", {})
    monkeypatch.setattr(recurrent, "_said", set())


def shifted_conv(x, weight, bias=None, activation=None):
    """A causal depthwise conv written out as shifted sums: x (B, C, T), weight (C, K)."""
    t, k = x.shape[-1], weight.shape[-1]
    y = torch.zeros_like(x)
    for j in range(k):  # tap j reads position t - (k - 1 - j)
        lag = k - 1 - j
        y = y + weight[:, j, None] * torch.nn.functional.pad(x, (lag, 0))[..., :t]
    y = y if bias is None else y + bias[:, None]
    return torch.nn.functional.silu(y) if activation in ("silu", "swish") else y


def fake_package(monkeypatch, kind: str = "right") -> list:
    """A `causal_conv1d` module in sys.modules: "right" computes the conv, "wrong" reads one
    position ahead, "raises" fails as a kernel built for another GPU would, "missing" is none.
    Returns the list its conv appends to per call."""
    calls = []

    def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, activation=None, **kwargs):
        calls.append(tuple(x.shape))
        if kind == "raises":
            raise RuntimeError("no kernel image is available for execution on the device")
        if kind == "wrong":
            x = torch.nn.functional.pad(x[..., 1:], (0, 1))  # the future leaks in
        return shifted_conv(x, weight, bias, activation)

    module = types.ModuleType("causal_conv1d")
    module.causal_conv1d_fn = causal_conv1d_fn
    monkeypatch.setitem(
        recurrent.sys.modules, "causal_conv1d", None if kind == "missing" else module
    )
    clear(monkeypatch)
    return calls


def tiny(name: str = "tiny-qwen3_5"):
    return models.load(models.tiny_folder(name))


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def test_fla_is_refused_on_hopper_under_triton_before_3_7_1():
    refused = recurrent.fla_refusal((9, 0), "3.6.0")
    assert refused is not None and "9.0" in refused and "3.6.0" in refused
    assert recurrent.fla_refusal((9, 0), "3.7.1") is None
    assert recurrent.fla_refusal((8, 0), "3.6.0") is None
    assert recurrent.fla_refusal((9, 0), "3.7.0+git1a2b3c") is not None
    assert recurrent.fla_refusal((9, 0), "3.10.0") is None  # compared as versions, not text
    assert recurrent.fla_refusal((10, 0), "3.6.0") is None


def test_without_packaging_versions_are_compared_by_their_leading_numbers(monkeypatch):
    monkeypatch.setitem(recurrent.sys.modules, "packaging.version", None)
    assert recurrent._version("3.6.0+git1a2b") == (3, 6, 0)
    assert recurrent.fla_refusal((9, 0), "3.6.0+git1a2b") is not None
    assert recurrent.fla_refusal((9, 0), "3.10") is None


def test_fla_problem_refuses_a_hopper_before_running_a_kernel(monkeypatch):
    """On a capability 9.0 device under Triton 3.6.0 nothing of fla's is run (no CUDA here)."""
    monkeypatch.setitem(recurrent.sys.modules, "fla", types.ModuleType("fla"))
    triton = types.ModuleType("triton")
    triton.__version__ = "3.6.0"
    monkeypatch.setitem(recurrent.sys.modules, "triton", triton)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    why = recurrent.fla_problem(torch.device("cuda"))
    assert "9.0" in why and "3.6.0" in why and "3.7.1" in why


def test_a_refused_fla_is_said_once_and_the_rule_is_mlxwalks(monkeypatch, capsys):
    model = tiny()
    capsys.readouterr()
    monkeypatch.setitem(recurrent.sys.modules, "fla", types.ModuleType("fla"))
    monkeypatch.setattr(recurrent, "_gpu_refusal", lambda d: recurrent.fla_refusal((9, 0), "3.6"))
    assert recurrent.route(model, "fla", conv=None) == "mlxwalk"
    assert recurrent.route(model, "fla", conv=None) == "mlxwalk"
    err = one_line(capsys)
    assert "mlxwalk's torch op" in err and "9.0" in err and "Triton 3.6" in err
    assert modeling_qwen3_5.torch_chunk_gated_delta_rule is recurrent.mlxwalk_rule


def test_a_conv_that_computes_the_conv_is_taken(monkeypatch, capsys):
    model = tiny()
    capsys.readouterr()
    calls = fake_package(monkeypatch)
    assert recurrent.route_conv(model, "causal-conv1d") == "causal-conv1d"
    assert recurrent.route_conv(model, "auto") == "causal-conv1d"
    assert len(calls) == 1  # the self-check's forward, once per device type
    assert modeling_qwen3_5.causal_conv1d_fn is recurrent.package_conv
    assert modeling_qwen3_5.causal_conv1d_update is recurrent.torch_conv_update
    assert capsys.readouterr().err == ""
    assert recurrent.route_conv(model, "torch") == "torch"
    assert modeling_qwen3_5.causal_conv1d_fn is recurrent.torch_conv


@pytest.mark.parametrize(
    "kind, said",
    [
        ("wrong", "disagrees with the torch conv"),
        ("raises", "RuntimeError: no kernel image"),
        ("missing", "causal-conv1d is not installed"),
    ],
)
def test_a_conv_that_cannot_serve_falls_back_to_torch_in_one_line(kind, said, monkeypatch, capsys):
    model = tiny()
    capsys.readouterr()
    fake_package(monkeypatch, kind)
    assert recurrent.route_conv(model, "causal-conv1d") == "torch"
    assert recurrent.route_conv(model, "causal-conv1d") == "torch"
    err = one_line(capsys)
    assert said in err and "causal convolution runs in torch" in err
    assert modeling_qwen3_5.causal_conv1d_fn is recurrent.torch_conv


def test_auto_says_nothing_where_the_package_is_missing_and_why_where_it_fails(monkeypatch, capsys):
    model = tiny()
    capsys.readouterr()
    fake_package(monkeypatch, "missing")
    assert recurrent.route_conv(model) == "torch"
    assert capsys.readouterr().err == ""
    fake_package(monkeypatch, "wrong")
    assert recurrent.route_conv(model) == "torch"
    assert "disagrees" in one_line(capsys)


def test_an_unknown_conv_route_is_refused_by_name():
    with pytest.raises(ConfigError, match="conv route 'cuda' is unknown"):
        recurrent.route_conv(tiny(), "cuda")


def test_the_torch_conv_is_the_layers_own_conv():
    """torch_conv against the layer's nn.Conv1d (padding K-1, the first T outputs) and silu."""
    layer = next(m for m in tiny().modules() if hasattr(m, "A_log"))
    x = torch.randn(2, layer.conv1d.in_channels, 37)
    want = torch.nn.functional.silu(layer.conv1d(x)[..., :37])
    got = recurrent.torch_conv(x, layer.conv1d.weight.squeeze(1), None, activation="silu")
    assert torch.allclose(got, want, atol=1e-6)


def test_the_torch_update_is_the_conv_one_token_on():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 8, 12, generator=g), torch.randn(8, 4, generator=g)
    whole = recurrent.torch_conv(x, w, activation="silu")  # (2, 8, 12)
    state = torch.nn.functional.pad(x[..., :11], (4, 0))[..., -4:].clone()  # the last 4 inputs
    one = recurrent.torch_conv_update(x[..., 11:], state, w, activation="silu")
    assert torch.allclose(one, whole[..., 11:], atol=1e-6)
    assert torch.equal(state, x[..., 8:])


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), loss.detach(), grads


@pytest.mark.parametrize("name", ["tiny-qwen3_5", "tiny-qwen3_next"])
def test_a_tiny_hybrid_is_the_same_through_either_conv(name, monkeypatch):
    model = tiny(name)
    ids = torch.as_tensor(np.random.default_rng(0).integers(0, 256, (1, 70)))
    got = {}
    calls = fake_package(monkeypatch)
    for how in ("torch", "causal-conv1d"):
        assert recurrent.route_conv(model, how) == how
        before = len(calls)
        got[how] = loss_and_grads(model, ids)
        used = len(calls) - before
        layers = sum(hasattr(m, "A_log") for m in model.modules())
        assert used == (layers if how == "causal-conv1d" else 0)
    (la, a, ga), (lb, b, gb) = got["torch"], got["causal-conv1d"]
    assert torch.allclose(la, lb, atol=1e-5) and torch.allclose(a, b, atol=1e-6)
    conv = [n for n in ga if "conv1d" in n]
    worst = max(float((ga[n] - gb[n]).norm() / ga[n].norm()) for n in ga)
    assert conv and worst < 5e-5, worst  # float32 sums in another order: 6e-6


def test_the_walk_reads_the_routed_conv_chunk_by_chunk(monkeypatch):
    """The exact walk's cache prepends the conv state to a chunk: the package is called then
    too, and the walk's gradient is the torch conv's."""
    model = models.add_lora(tiny(), rank=4, seed=0)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 256, 97)
    calls = fake_package(monkeypatch)
    got = {}
    for how in ("torch", "causal-conv1d"):
        recurrent.route_conv(model, how)
        loss, grads = window_gradient(model, ids[:-1], ids[1:], np.ones(96), chunk=32)
        got[how] = (loss, np.concatenate([grads[k].ravel() for k in sorted(grads)]))
    assert len(calls) > 1 + 3  # the self-check, then the layers of three chunks (at least)
    (a, ga), (b, gb) = got["torch"], got["causal-conv1d"]
    assert abs(a - b) <= 1e-6 * abs(a)
    assert np.linalg.norm(ga - gb) <= 1e-5 * np.linalg.norm(ga)
