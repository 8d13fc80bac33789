"""Layer inputs kept from the decode (--keep-inputs, with --recompute): the reverse pass runs each
layer from its kept input with no recorded forward; exact against one graph, sized by the budget
and dropped by `auto` when they don't fit; and the exact row fails when the wrong inputs are
replayed."""

import numpy as np
import pytest

from mlxwalk import window_gradient
from mlxwalk.grading import BARS, EXACT, compare
from mlxwalk.plan import MIB, PlanError
from mlxwalk.walk import ExactWalk, WalkConfig, Window
from mlxwalk.walk.taps import Layers

N = 128
IDS = np.random.default_rng(4).integers(0, 256, N + 1)


@pytest.mark.parametrize("model", ["qwen2", "hybrid"])
def test_kept_inputs_are_replayed_and_exact(request, model, monkeypatch):
    model = request.getfixturevalue(model)
    w = np.ones(N)
    _, one = window_gradient(model, IDS[:-1], IDS[1:], w, chunk=N, walk="one-graph")
    replayed = []
    replaying = Layers.replaying
    monkeypatch.setattr(
        Layers, "replaying", lambda self, kept: replayed.append(1) or replaying(self, kept)
    )
    _, kept = window_gradient(
        model, IDS[:-1], IDS[1:], w, chunk=32, recompute=True, keep_inputs="on"
    )
    assert len(replayed) == 3  # every chunk but the last (not decoded) replays its inputs
    assert BARS[EXACT](*compare(kept, one))


def test_the_exact_row_fails_when_another_chunks_inputs_are_replayed(qwen2, monkeypatch):
    w = np.ones(N)
    _, one = window_gradient(qwen2, IDS[:-1], IDS[1:], w, chunk=N, walk="one-graph")

    def shifted(self, chunk):  # the inputs of the chunk before (the same size here)
        return self.kept.get(chunk.index - 1)

    monkeypatch.setattr(ExactWalk, "kept_inputs", shifted)
    _, broken = window_gradient(
        qwen2, IDS[:-1], IDS[1:], w, chunk=32, recompute=True, keep_inputs="on"
    )
    assert not BARS[EXACT](*compare(broken, one))


def test_kept_inputs_are_sized_and_auto_leaves_them_out_past_the_budget(qwen2):
    window = Window.of(IDS[:-1], IDS[1:], np.ones(N))
    roomy = ExactWalk(qwen2, window, WalkConfig(32, recompute=True, memory_budget_mib=4096))
    layout = roomy.layout
    assert roomy.keep
    assert roomy.estimate.inputs == (len(layout.kinds) + 1) * layout.hidden * 96 * 4
    est = roomy.estimate
    tight = (est.total - est.inputs // 2) / MIB  # the rest fits, the inputs do not
    walk = ExactWalk(qwen2, window, WalkConfig(32, recompute=True, memory_budget_mib=tight))
    assert not walk.keep and walk.estimate.inputs == 0 and walk.estimate.total <= tight * MIB
    off = ExactWalk(qwen2, window, WalkConfig(32, recompute=True, keep_inputs="off"))
    assert not off.keep
    with pytest.raises(PlanError, match="--keep-inputs on: .* give --recompute"):
        WalkConfig(32, keep_inputs="on").check()
