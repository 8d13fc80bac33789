"""Layer inputs kept from the decode (--keep-inputs, with --recompute): the reverse pass runs each
layer from its kept input with no recorded forward; exact against one graph, sized by the budget
and dropped by `auto` when they don't fit; and the exact row fails when the wrong inputs are
replayed. With a frozen stem, its output alone can be kept ("stem"): no stem layer runs again."""

import numpy as np
import pytest

from mlxwalk import window_gradient
from mlxwalk.commands.walk_exact import upper_layers_only
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
    assert roomy.keep == "all"
    assert roomy.estimate.inputs == (len(layout.kinds) + 1) * layout.hidden * 96 * 4
    est = roomy.estimate
    tight = (est.total - est.inputs // 2) / MIB  # the rest fits, the inputs do not
    walk = ExactWalk(qwen2, window, WalkConfig(32, recompute=True, memory_budget_mib=tight))
    assert walk.keep == "off" and walk.estimate.inputs == 0  # no stem to fall back on
    assert walk.estimate.total <= tight * MIB
    off = ExactWalk(qwen2, window, WalkConfig(32, recompute=True, keep_inputs="off"))
    assert off.keep == "off"
    with pytest.raises(PlanError, match="--keep-inputs on: .* give --recompute"):
        WalkConfig(32, keep_inputs="on").check()


def stem_labels(model, keep: str) -> tuple[list[str], dict]:
    """The layers evaluated by a walk (as its clock hears them) and its gradient."""
    window = Window.of(IDS[:-1], IDS[1:], np.ones(N))
    walk = ExactWalk(model, window, WalkConfig(32, recompute=True, keep_inputs=keep))
    heard: list[str] = []
    walk.layers.clock = lambda what, seconds: heard.append(what)
    _, grads = walk.run()
    return heard, grads


@pytest.mark.parametrize("model", ["qwen2", "hybrid"])
def test_with_the_stems_output_kept_no_stem_layer_runs_again_and_the_walk_is_exact(request, model):
    model = request.getfixturevalue(model)
    with upper_layers_only(model, 2):
        _, one = window_gradient(model, IDS[:-1], IDS[1:], np.ones(N), chunk=N, walk="one-graph")
        ran, recorded = stem_labels(model, "off")
        skipped, kept = stem_labels(model, "stem")
    stem_runs = [sum(w.startswith("stem") for w in heard) for heard in (ran, skipped)]
    # 4 chunks, the stem run in each; kept, in none (the last is decoded too, for its output)
    assert stem_runs[0] > 0 and stem_runs[1] == 0
    assert any(w.startswith("forward") for w in skipped)  # the trained layers still run
    assert BARS[EXACT](*compare(kept, one)) and BARS[EXACT](*compare(recorded, one))


def test_auto_falls_back_to_the_stems_output_and_the_stems_kv_goes(qwen2):
    """Every layer's input, then the stem's output alone. With it kept no stem layer runs in the
    reverse pass, so the stem's K/V is held through the decode only; with nothing kept it is
    held throughout (here more than the stem's output: nothing kept is never the cheaper)."""
    window = Window.of(IDS[:-1], IDS[1:], np.ones(N))
    with upper_layers_only(qwen2, 2):
        roomy = ExactWalk(qwen2, window, WalkConfig(32, recompute=True, memory_budget_mib=4096))
        layout, est = roomy.layout, roomy.estimate
        assert roomy.keep == "all" and est.stem_store > 0
        stem_bytes = layout.hidden * N * 4  # the stem's output over the 4 chunks (all decoded)
        no_inputs = est.total - est.inputs
        tight = (no_inputs + stem_bytes + 1024) / MIB  # the stem's output fits, the rest do not
        walk = ExactWalk(qwen2, window, WalkConfig(32, recompute=True, memory_budget_mib=tight))
        assert walk.keep == "stem" and walk.estimate.inputs == stem_bytes
        off = ExactWalk(
            qwen2, window, WalkConfig(32, recompute=True, keep_inputs="off", memory_budget_mib=4096)
        )
        whole = off.estimate
        assert whole.stem_store == 0 and whole.store == est.store + est.stem_store
        assert whole.total > walk.estimate.total
