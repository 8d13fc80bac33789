"""One optimizer on both backends (mlxwalk/training/optimizer_spec.py): the spec gives mlx-lm's
schedule and MLX's update rule; MLX's optimizer and torch's, each built from a run's config, take
its learning rate at every update, and the same gradients move the same parameter alike."""

import math

import mlx.core as mx
import numpy as np
import pytest

from mlxwalk.training.config import TrainConfig
from mlxwalk.training.mlx_framework import build_optimizer
from mlxwalk.training.optimizer_spec import OptimizerSpec

from . import extras

STEPS = 8
# (optimizer, schedule, warmup, --weight-decay)
CONFIGS = [
    ("adam", "cosine_decay", 2, None),
    ("adam", None, 0, None),
    ("adam", None, 3, None),
    ("adamw", "cosine_decay", 0, None),
    ("adamw", "linear_schedule", 2, None),
    ("adamw", None, 0, 0.05),
    ("adamw", "cosine_decay", 1, 0.0),
    ("sgd", None, 0, None),
    ("sgd", "linear_schedule", 0, 0.1),
    ("sgd", "cosine_decay", 2, None),
]
IDS = [f"{o}-{s or 'constant'}-w{w}-wd{d}" for o, s, w, d in CONFIGS]


def config(optimizer, schedule, warmup, decay, lr=1e-3) -> TrainConfig:
    return TrainConfig(
        lr=lr, optimizer=optimizer, lr_schedule=schedule, warmup=warmup, weight_decay=decay
    )


# --- the spec itself: no framework --------------------------------------------------------------


def test_the_schedule_is_mlx_lms():
    """lr 1e-3, warmup 2, cosine over 8 updates: from 0, the peak held a step, then decay over
    5 updates (mlx-lm's build_schedule as mlx_lm.lora builds it)."""
    spec = OptimizerSpec.of(config("adamw", "cosine_decay", 2, None), STEPS)
    rates = [spec.lr_at(k) for k in range(STEPS + 1)]
    cos = [0.5 * (1 + math.cos(math.pi * s / 5)) * 1e-3 for s in range(6)]
    assert rates == pytest.approx([0.0, 5e-4, 1e-3, *cos], rel=1e-12, abs=1e-18)
    assert [round(r, 7) for r in rates[:5]] == [0.0, 5e-4, 1e-3, 1e-3, 9.045e-4]
    # without a warmup the decay runs over steps - 1 and reaches 0 at the last update
    linear = OptimizerSpec.of(config("adam", "linear_schedule", 0, None), STEPS)
    assert [linear.lr_at(k) for k in range(STEPS)] == pytest.approx(
        [1e-3 * (1 - k / 7) for k in range(STEPS)], rel=1e-12, abs=1e-18
    )
    warm = OptimizerSpec.of(config("sgd", None, 4, None), STEPS)
    assert [warm.lr_at(k) for k in range(7)] == pytest.approx(
        [0, 2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3]
    )
    assert not OptimizerSpec.of(config("adam", None, 0, None), STEPS).scheduled
    assert OptimizerSpec.of(config("adam", None, 0, None), STEPS).lr_at(100) == 1e-3


def test_the_update_rule_is_mlxs_with_its_defaults():
    """No bias correction; AdamW decays by 0.01 when no --weight-decay is given, SGD by 0."""
    specs = {o: OptimizerSpec.of(config(o, None, 0, None), STEPS) for o in ("adam", "adamw", "sgd")}
    assert [specs[o].weight_decay for o in ("adam", "adamw", "sgd")] == [0.0, 0.01, 0.0]
    assert not any(s.bias_correction for s in specs.values())
    assert specs["adam"].betas == (0.9, 0.999) and specs["adam"].eps == 1e-8
    assert OptimizerSpec.of(config("adamw", None, 0, 0.0), STEPS).weight_decay == 0.0
    # Adam's first update without bias correction: 0.1 g / (sqrt(0.001) |g| + eps)
    step = specs["adam"].update(1.0, 2.0, {}, 0)
    assert step == pytest.approx(1.0 - 1e-3 * 0.2 / (math.sqrt(0.004) + 1e-8), rel=1e-15)
    assert specs["adamw"].update(1.0, 2.0, {}, 0) == pytest.approx((1 - 1e-5) - (1.0 - step))
    assert specs["sgd"].update(1.0, 2.0, {}, 0) == 1.0 - 2e-3
    corrected = OptimizerSpec("adam", 1e-3, bias_correction=True).update(1.0, 2.0, {}, 0)
    assert corrected == pytest.approx(1.0 - 1e-3, rel=1e-9)  # m/sqrt(v) = 1 at the first update


def test_the_spec_refuses_what_it_does_not_describe():
    with pytest.raises(ValueError, match="optimizer"):
        OptimizerSpec("adagrad", 1e-3)
    with pytest.raises(ValueError, match="schedule"):
        OptimizerSpec("adam", 1e-3, schedule="exponential_decay")


# --- MLX's optimizer against the spec ------------------------------------------------------------

PARAM = np.random.default_rng(0).uniform(0.02, 0.04, (4, 8)).astype(np.float32)
PARAM *= np.where(np.arange(32).reshape(4, 8) % 3 == 0, -1, 1).astype(np.float32)
GRADS = np.random.default_rng(1).normal(0, 1, (3, 4, 8)).astype(np.float32)


def mlx_run(cfg, steps=STEPS, updates=3):
    """The learning rate MLX's optimizer takes at each of `steps` updates and the parameter
    after each of the first `updates`."""
    opt = build_optimizer(OptimizerSpec.of(cfg, steps))
    params = {"w": mx.array(PARAM)}
    opt.init(params)
    rates, after = [], []
    for k in range(steps):
        grad = GRADS[k] if k < updates else np.zeros_like(PARAM)
        params = opt.apply_gradients({"w": mx.array(grad)}, params)
        mx.eval(params, opt.state)
        rates.append(float(opt.learning_rate))  # the rate this update took
        if k < updates:
            after.append(np.array(params["w"]))
    return rates, after


def spec_run(spec, updates=3):
    """The spec's rule on each element, in float64."""
    p = PARAM.astype(np.float64).ravel().tolist()
    states = [{} for _ in p]
    after = []
    for k in range(updates):
        g = GRADS[k].astype(np.float64).ravel().tolist()
        p = [spec.update(x, d, s, k) for x, d, s in zip(p, g, states)]
        after.append(np.array(p).reshape(PARAM.shape))
    return after


@pytest.mark.parametrize("case", CONFIGS, ids=IDS)
def test_mlxs_optimizer_is_the_spec(case):
    cfg = config(*case)
    spec = OptimizerSpec.of(cfg, STEPS)
    rates, after = mlx_run(cfg)
    # MLX computes the schedule in float32: equal to its rounding of the peak
    np.testing.assert_allclose(rates, [spec.lr_at(k) for k in range(STEPS)], rtol=0, atol=1e-9)
    for got, want in zip(after, spec_run(spec)):
        np.testing.assert_allclose(got, want, rtol=2e-6)


def test_mlx_lms_build_schedule_is_the_specs_at_any_length():
    from mlx_lm.tuner.utils import build_schedule

    for steps in (1, 2, 5, 40):
        for warmup in (0, 1, 3):
            for name, args in (("cosine_decay", []), ("linear_schedule", [0.0])):
                spec = OptimizerSpec.of(config("adam", name, warmup, None, lr=0.1), steps)
                fn = build_schedule(
                    {"name": name, "arguments": [0.1, *args, spec.decay_steps], "warmup": warmup}
                )
                got = [float(fn(mx.array(k))) for k in range(steps + 2)]
                want = [spec.lr_at(k) for k in range(steps + 2)]
                np.testing.assert_allclose(got, want, rtol=0, atol=1e-7, err_msg=f"{steps=}")


# --- torch's optimizer against MLX's -------------------------------------------------------------


def torch_run(cfg, steps=STEPS, updates=3):
    import torch

    from mlxwalk.torch_backend.train import make_optimizer

    w = torch.nn.Parameter(torch.tensor(PARAM))
    opt, schedule = make_optimizer(OptimizerSpec.of(cfg, steps), [w])
    rates, after = [], []
    for k in range(steps):
        rates.append(opt.param_groups[0]["lr"])
        if k < updates:
            w.grad = torch.tensor(GRADS[k])
            opt.step()
            opt.zero_grad(set_to_none=True)
            after.append(w.detach().numpy().copy())
        schedule.step()
    return rates, after


@extras.torch
@pytest.mark.parametrize("case", CONFIGS, ids=IDS)
def test_torchs_optimizer_is_mlxs(case):
    cfg = config(*case)
    spec = OptimizerSpec.of(cfg, STEPS)
    rates, after = torch_run(cfg)
    np.testing.assert_allclose(rates, [spec.lr_at(k) for k in range(STEPS)], rtol=1e-12, atol=0)
    mlx_rates, mlx_after = mlx_run(cfg)
    np.testing.assert_allclose(rates, mlx_rates, rtol=0, atol=1e-9)
    for k, (got, want) in enumerate(zip(after, mlx_after)):
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=f"update {k}")


@extras.torch
def test_torchs_optimizer_resumes_where_it_stopped():
    """optimizer.pt's state (the moments and the schedule's position) continues the updates."""
    import torch

    from mlxwalk.torch_backend.train import make_optimizer

    cfg = config("adamw", "cosine_decay", 1, None)
    w = torch.nn.Parameter(torch.tensor(PARAM))
    opt, schedule = make_optimizer(OptimizerSpec.of(cfg, STEPS), [w])
    for k in range(3):
        if k == 2:  # a checkpoint after two updates, loaded into a fresh optimizer
            saved = {"optimizer": opt.state_dict(), "schedule": schedule.state_dict()}
            saved = torch.load(_roundtrip(saved), weights_only=True)
            again = torch.nn.Parameter(w.detach().clone())
            opt2, schedule2 = make_optimizer(OptimizerSpec.of(cfg, STEPS), [again])
            opt2.load_state_dict(saved["optimizer"])
            schedule2.load_state_dict(saved["schedule"])
            assert opt2.param_groups[0]["lr"] == pytest.approx(
                OptimizerSpec.of(cfg, STEPS).lr_at(2), rel=1e-12
            )
        w.grad = torch.tensor(GRADS[k])
        opt.step()
        schedule.step()
    again.grad = torch.tensor(GRADS[2])
    opt2.step()
    assert torch.equal(again, w)


def _roundtrip(obj):
    import io

    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf
