"""profile.py: a torch walk's time by layer kind: each kind's forward and backward found (the
backward through autograd's sequence numbers), and the model left as it was."""

import sys

import numpy as np
import pytest

from .extras import needs_torch

needs_torch()
pytestmark = pytest.mark.torch

import torch  # noqa: E402

from mlxwalk.torch_backend import attention, profile, recurrent  # noqa: E402
from mlxwalk.torch_backend import model as models  # noqa: E402
from mlxwalk.torch_backend.walk import TorchWalkConfig, train_window  # noqa: E402
from mlxwalk.walk.window import Window  # noqa: E402


def test_a_walk_is_charged_to_its_layer_kinds_forward_and_backward():
    model = models.add_lora(models.load(models.tiny_folder("tiny-qwen3_5")), rank=4, seed=0)
    attention.use(model.get_base_model())
    recurrent.route(model.get_base_model(), "mlxwalk")
    module = sys.modules[type(next(m for m in model.modules() if hasattr(m, "A_log"))).__module__]
    rule = getattr(module, recurrent._NAME)
    ids = np.random.default_rng(0).integers(0, 256, 129)
    win = Window.of(ids[:-1], ids[1:], np.ones(128))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)

    p = profile.profile(model, lambda: train_window(model, opt, win, TorchWalkConfig(chunk=32)))

    for kind in ("attention", "delta-net", "delta rule", "conv", "mlp"):
        assert p.forward[kind] > 0, kind
        assert p.backward[kind] > 0, kind  # not all of the backward fell into "other"
    # a share of seconds, so it moves with the load (0.089 measured in a clean-clone suite, under a
    # bar of 0.1 it failed); above 0.02 it is the rule's own backward, not a stray node charged
    assert p.backward["delta rule"] > 0.02 * sum(p.backward.values())
    kinds = {row[0] for row in p.rows()}
    assert kinds <= set(profile.KINDS)
    assert abs(sum(row[3] for row in p.rows()) - 1) < 1e-9
    assert "| delta rule |" in p.table()
    assert getattr(module, recurrent._NAME) is rule  # the wrapped functions are put back
    assert not any(m._forward_pre_hooks for m in model.modules())
