"""The torch walk (mlxwalk/torch_backend) on transformers models with PEFT, float32 on the CPU:
the exact walk equals one graph to rounding, on attention and hybrid models; the plain walk and
a narrowed horizon do not; the bundled tiny models are the same functions in both frameworks."""

import mlx.core as mx
import numpy as np
import pytest

from .extras import needs_torch  # noqa: E402

needs_torch()
pytestmark = pytest.mark.torch

import mlx_lm  # noqa: E402
import torch  # noqa: E402
from transformers.cache_utils import Cache  # noqa: E402

from mlxwalk import cli, tiny  # noqa: E402
from mlxwalk.torch_backend import attention  # noqa: E402
from mlxwalk.torch_backend import model as models  # noqa: E402
from mlxwalk.torch_backend.cache import WalkCache  # noqa: E402
from mlxwalk.torch_backend.walk import (  # noqa: E402
    ExactWalk,
    TorchWalkConfig,
    gradients,
    train_window,
    window_gradient,
)
from mlxwalk.walk.config import Window  # noqa: E402

EXACT = 2e-5  # relative L2 error, float32 (the walks read about 1e-6)


def window(n=192, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 256, n + 1)
    weights = (rng.uniform(size=n) > 0.3).astype(np.float32)
    weights[: n // 3] = 0  # a context that takes no loss
    return ids[:-1], ids[1:], weights


def flat(grads: dict) -> np.ndarray:
    return np.concatenate([grads[k].ravel() for k in sorted(grads)])


def rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module", params=["tiny-qwen2", "tiny-qwen3_5", "tiny-qwen3_next"])
def lora_model(request):
    model = models.load(models.tiny_folder(request.param))
    return models.add_lora(model, rank=4, seed=0)


def test_exact_walk_equals_one_graph_and_the_plain_walk_does_not(lora_model):
    x, y, w = window()
    loss, one = window_gradient(lora_model, x, y, w, walk="one-graph")
    walked_loss, exact = window_gradient(lora_model, x, y, w, chunk=48)  # chunks follow the runs
    _, plain = window_gradient(lora_model, x, y, w, chunk=48, walk="plain")
    assert abs(walked_loss - loss) <= 1e-6 * abs(loss)
    assert len(one) > 0 and all(np.abs(g).sum() > 0 for g in one.values())
    assert rel(flat(exact), flat(one)) < EXACT
    assert rel(flat(plain), flat(one)) > 0.1


class PrefixReference(WalkCache):
    """One graph over the window, chunk by chunk with a growing K/V list, the gradient stopped
    at grad_from: what a narrowed horizon promises, built without the walk's store or taps."""

    def __init__(self, kv: dict, start: int, end: int, grad_from: int, states: dict):
        Cache.__init__(self, layers=[])
        self.kv, self.start, self.end, self.gf = kv, start, end, grad_from
        self.entry, self.exit = {n: dict(s) for n, s in states.items()}, {}

    def update(self, k, v, layer_idx, *args, **kwargs):
        ks, vs = self.kv.setdefault(layer_idx, ([], []))
        out = []
        for seen, x in ((ks, k), (vs, v)):
            prefix = torch.cat(seen, 2) if seen else x[:, :, :0]
            out.append(torch.cat([prefix[:, :, : self.gf].detach(), prefix[:, :, self.gf :], x], 2))
            seen.append(x)
        return tuple(out)


def horizon_reference(model, x, y, w, chunk, horizon, follow_runs):
    walk = ExactWalk(
        model, Window.of(x, y, w), TorchWalkConfig(chunk, horizon=horizon, follow_runs=follow_runs)
    )
    model.zero_grad(set_to_none=True)
    kv, states, total = {}, {}, 0.0
    for c in walk.plan.chunks:
        cache = PrefixReference(kv, c.start, c.end, c.grad_from, states)
        total = total + walk.chunk_loss(c.start, c.end, cache)
        states = cache.exit
    total.backward()
    return gradients(model)


@pytest.mark.parametrize("chunk, horizon, follow_runs", [(48, 48, False), (32, 40, True)])
def test_a_narrowed_horizon_is_its_promise_and_cuts_the_gradient(
    lora_model, chunk, horizon, follow_runs
):
    x, y, w = window()
    kw = dict(chunk=chunk, follow_runs=follow_runs)
    _, full = window_gradient(lora_model, x, y, w, **kw)
    _, wide = window_gradient(lora_model, x, y, w, horizon=192, **kw)  # the window: no cut
    _, narrow = window_gradient(lora_model, x, y, w, horizon=horizon, **kw)
    want = horizon_reference(lora_model, x, y, w, chunk, horizon, follow_runs)
    assert rel(flat(wide), flat(full)) < EXACT
    assert rel(flat(narrow), flat(want)) < EXACT
    assert rel(flat(narrow), flat(full)) > 1e-3


def test_host_accumulators_and_strided_checkpoints_change_nothing(lora_model):
    # (on the CPU, host memory is the device's but its layout (positions first) is not; on
    # CUDA the exactness row (1c) compares pinned host memory with the GPU)
    x, y, _ = window()
    w = np.r_[np.zeros(64), np.ones(128)]  # six chunks of 32: a short re-decode per stride
    _, ref = window_gradient(lora_model, x, y, w, chunk=32)
    _, host = window_gradient(lora_model, x, y, w, chunk=32, accumulators="host", store="host")
    assert rel(flat(host), flat(ref)) < 1e-7
    foot = models.footprint(lora_model)
    if foot.recurrent:  # room for a few checkpoints: the others re-decoded in the reverse pass
        budget = foot.kv_width * 4 * 192 + 2.5 * foot.state_bytes
        win = Window.of(x, y, w)
        config = TorchWalkConfig(32, host_budget_mib=budget / 2**20)
        assert ExactWalk(lora_model, win, config).plan.stride > 1
        _, strided = window_gradient(lora_model, x, y, w, chunk=32, host_budget_mib=budget / 2**20)
        assert rel(flat(strided), flat(ref)) < 1e-7


def test_one_step_per_window_and_a_refusal_before_any_step():
    model = models.add_lora(models.load(models.tiny_folder("tiny-qwen2")), rank=4, seed=1)
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    opt = torch.optim.SGD(params, lr=0.1)
    win = Window.of(*window())
    with pytest.raises(ValueError, match="host memory"):
        train_window(model, opt, win, TorchWalkConfig(chunk=48, host_budget_mib=1e-6))
    assert all(torch.equal(a, p) for a, p in zip(before, params))
    walk = train_window(model, opt, win, TorchWalkConfig(chunk=48))
    assert np.isfinite(walk.loss)
    assert all(not torch.equal(a, p) for a, p in zip(before, params))


def test_an_answer_group_is_refused_by_name():
    from mlxwalk.errors import ConfigError

    model = models.add_lora(models.load(models.tiny_folder("tiny-qwen2")), rank=4, seed=1)
    x, y, w = window()
    group = Window.of_targets(x, np.c_[y, y[::-1]], np.c_[w, -w])
    with pytest.raises(ConfigError, match="answer group"):
        ExactWalk(model, group, TorchWalkConfig(chunk=48))


def test_walk_attention_is_causal_at_the_bottom_right():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 5, 16, generator=g)
    k, v = torch.randn(1, 2, 12, 16, generator=g), torch.randn(1, 2, 12, 16, generator=g)
    out, _ = attention.walk_attention(None, q, k, v, scaling=0.25)  # (1, 5, 4, 16)
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = (q @ kr.transpose(-1, -2)) * 0.25  # query i sees keys 0 .. 7 + i
    scores = scores.masked_fill(torch.ones(5, 12).tril(7) == 0, float("-inf"))
    want = (scores.softmax(-1) @ vr).transpose(1, 2)
    assert torch.allclose(out, want, atol=1e-6)


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-qwen3_5", "tiny-qwen3_next"])
def test_the_tiny_models_are_one_function_in_both_frameworks(name):
    ids = np.random.default_rng(0).integers(0, 256, 96)
    mlx_model, _ = mlx_lm.load(str(tiny.path(name)))
    want = np.array(mlx_model(mx.array(ids)[None]).astype(mx.float32))
    got = models.load(models.tiny_folder(name))(torch.tensor(ids)[None]).logits.detach().numpy()
    assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()


def test_test_walk_exact_torch_prints_every_row_ok(capsys):
    assert cli.main(["test-walk-exact", "--backend", "torch", "-m", "tiny-qwen3_5"]) == 0
    out = capsys.readouterr().out
    assert "every row OK" in out and "(4)" in out and "FAILED" not in out


def test_the_delta_rule_routes_agree():
    """mlxwalk's torch op in a transformers hybrid gives transformers' own gradient."""
    x, y, w = window(n=150)
    got = {}
    for how in ("transformers", "mlxwalk"):
        model = models.load(models.tiny_folder("tiny-qwen3_5"), delta_rule=how)
        model = models.add_lora(model, rank=4, seed=0)
        got[how] = window_gradient(model, x, y, w, chunk=64)
    assert abs(got["mlxwalk"][0] - got["transformers"][0]) <= 1e-6 * got["transformers"][0]
    assert rel(flat(got["mlxwalk"][1]), flat(got["transformers"][1])) < EXACT


def test_the_blocked_head_loss_is_the_whole_one():
    from mlxwalk.torch_backend.walk import head_loss, weighted_loss
    from mlxwalk.walk.algorithm import LOSS_BLOCK

    g = torch.Generator().manual_seed(0)
    n = 2 * LOSS_BLOCK + 300
    head = torch.nn.Linear(16, 50, bias=False)
    h = torch.randn(1, n, 16, generator=g, requires_grad=True)
    t, w = torch.randint(0, 50, (n,), generator=g), torch.rand(n, generator=g)
    grads = []
    for loss in (head_loss, weighted_loss):
        h.grad = head.weight.grad = None
        value = loss(head, h, t, w, 100.0) if loss is head_loss else loss(head(h), t, w, 100.0)
        value.backward()
        grads.append((value.detach(), h.grad.clone(), head.weight.grad.clone()))
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_decoded_states_hold_nothing_but_themselves():
    """A checkpointed state must not be a view into its chunk's activations (a view of the conv
    input kept the whole chunk alive per layer and per checkpoint)."""
    model = models.load(models.tiny_folder("tiny-qwen3_5"))
    x, y, _ = window()
    walk = ExactWalk(model, Window.of(x, y, np.ones(len(x))), TorchWalkConfig(chunk=48))
    walk.decode_forward()
    states = [x for c in walk.checkpoints.values() for s in c.values() for x in s.values()]
    assert len(states) == 3 * 4 * 2  # 3 checkpoints x 4 recurrent layers x (conv, recurrent)
    for x in states:
        assert x.untyped_storage().nbytes() == x.numel() * x.element_size()


def test_the_walk_is_exact_with_the_model_in_training_mode_and_checkpointing_on():
    """transformers' gradient checkpointing drops the cache from a layer in training mode; the
    walk runs the model in eval mode and puts its mode back."""
    model = models.add_lora(models.load(models.tiny_folder("tiny-qwen3_5")), rank=4, seed=0)
    x, y, w = window()
    _, one = window_gradient(model, x, y, w, walk="one-graph")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    _, exact = window_gradient(model, x, y, w, chunk=48)
    assert model.training
    assert rel(flat(exact), flat(one)) < EXACT


def test_one_position_chunks_take_the_routed_rule(monkeypatch):
    from mlxwalk.torch_backend import recurrent

    calls = []  # (positions, whether a state came in)
    rule = recurrent.mlxwalk_rule

    def spy(q, k, v, g, beta, *args, initial_state=None, **kw):
        calls.append((q.shape[1], initial_state is not None))
        return rule(q, k, v, g, beta, *args, initial_state=initial_state, **kw)

    monkeypatch.setattr(recurrent, "mlxwalk_rule", spy)
    model = models.add_lora(models.load(models.tiny_folder("tiny-qwen3_5")), rank=4, seed=0)
    x, y, w = window(n=40)
    window_gradient(model, x, y, w, chunk=1)
    monkeypatch.undo()
    recurrent.route(model, "mlxwalk")  # the modeling module's names back on the real rule
    assert (1, True) in calls  # transformers' per-token rule for these: routed too


def test_models_load_with_no_kernels_from_the_hub(monkeypatch, tmp_path):
    """transformers 5.25 kernelizes a model with kernels fetched from the Hub unless told not to
    (on CUDA: a download, refused offline as 'could not verify publisher trust status', and
    another rotary embedding than the walk was checked on)."""
    from transformers import AutoModelForCausalLM

    seen = {}

    def loading(*args, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("loaded no further")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", loading)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(RuntimeError, match="loaded no further"):
        models.load(tmp_path)
    assert seen["use_kernels"] is False and seen["local_files_only"] is True


def test_an_unsupported_transformers_is_refused_before_a_wrong_gradient(monkeypatch):
    """transformers 5.17 swallows the walk's `cache=`: every chunk then attends no prefix and
    the exact walk equals the plain one (seen on a GPU machine); the walk refuses it instead."""
    from mlxwalk.errors import ConfigError

    model = models.add_lora(models.load(models.tiny_folder("tiny-qwen2")), rank=4, seed=1)
    ids, targets, weights = window(64)
    win = Window.of(ids, targets, weights)
    monkeypatch.setattr(models, "transformers_version", lambda: "5.17.0")
    with pytest.raises(ConfigError, match=r"transformers 5\.17\.0 .*>=5\.24,<5\.26"):
        ExactWalk(model, win, TorchWalkConfig(chunk=32))
    for version in ("5.24.0", "5.25.1", "5.25.0.dev0"):
        models.check_transformers(version)
    for version in ("5.26.0", "4.57.1", "6.0.0"):
        with pytest.raises(ConfigError):
            models.check_transformers(version)
