"""The torch walk under a memory budget: the placement of the store and accumulators, the
narrowed horizon, the refusals. One chunk's graph is given here (the probe measures CUDA memory,
which the CPU has none of; `scripts/bench-walk.py --backend torch ... --kinds exact-budget`
runs it on a GPU, docs/BENCHMARKS.md)."""

import logging

import numpy as np
import pytest

from .extras import needs_torch  # noqa: E402

needs_torch()
pytestmark = pytest.mark.torch


from mlxwalk.plan import OutOfMemory, PlanError  # noqa: E402
from mlxwalk.torch_backend import model as models  # noqa: E402
from mlxwalk.torch_backend.walk import (  # noqa: E402
    ExactWalk,
    TorchWalkConfig,
    gradients,
    probe,
)
from mlxwalk.walk.budget import Activations  # noqa: E402
from mlxwalk.walk.config import Window  # noqa: E402

CHUNK = 32
ACTS = Activations(CHUNK, graph=2**20, tap_factor=3.0, prefix_factor=0.5)


@pytest.fixture(scope="module")
def model():
    return models.add_lora(models.load(models.tiny_folder("tiny-qwen2")), rank=4, seed=0)


def window(n=192):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 256, n + 1)
    return Window.of(ids[:-1], ids[1:], np.ones(n))


def walk(model, budget: int, **kw) -> ExactWalk:
    config = TorchWalkConfig(CHUNK, memory_budget_mib=budget / 2**20, **kw)
    return ExactWalk(model, window(), config, acts=ACTS)


def gradient(model, runner: ExactWalk) -> np.ndarray:
    model.zero_grad(set_to_none=True)
    runner.run()
    grads = gradients(model)
    return np.concatenate([grads[k].ravel() for k in sorted(grads)])


def rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_the_budget_places_the_store_and_accumulators_before_it_narrows(model, caplog):
    est = walk(model, 2**40).estimate
    assert (est.store_at, est.accumulators_at) == ("device", "device")
    assert est.store > 0 and est.accumulators > 0 and est.graph > ACTS.graph
    all_on_gpu = est.gpu
    accumulators_out = all_on_gpu - est.accumulators
    both_out = accumulators_out - est.store + est.taps  # the taps come up from a host store
    ref = gradient(model, walk(model, all_on_gpu))
    for budget, where in [
        (all_on_gpu, ("device", "device")),
        (all_on_gpu - 1, ("device", "host")),
        (accumulators_out - 1, ("host", "host")),
    ]:
        runner = walk(model, budget)
        assert (runner.config.store, runner.config.accumulators) == where, budget
        assert runner.estimate.gpu <= budget
        assert rel(gradient(model, runner), ref) < 1e-7
        assert runner.horizon_used == 0
    # below the whole horizon with both out: late chunks narrow theirs, and say so
    narrow = walk(model, both_out - 1)
    with caplog.at_level(logging.INFO, logger="mlxwalk"):
        cut = gradient(model, narrow)
    assert 0 < narrow.horizon_used < 160 and "horizon narrowed" in caplog.text
    assert rel(cut, ref) > 1e-3


def test_a_budget_below_one_chunk_of_taps_or_a_narrowing_under_strict_exact_is_refused(model):
    est = walk(model, 2**40).estimate
    floor = est.weights + est.adapter + est.checkpoints + ACTS.graph
    with pytest.raises(OutOfMemory, match="GPU memory: the walk needs .* memory budget"):
        walk(model, floor)
    both_out = est.gpu - est.accumulators - est.store + est.taps
    with pytest.raises(OutOfMemory, match="--strict-exact"):
        walk(model, both_out - 1, strict_exact=True)
    walk(model, both_out, strict_exact=True)  # the whole horizon fits: taken


def test_asked_host_memory_is_kept(model):
    runner = walk(model, 2**40, accumulators="host")
    assert (runner.config.store, runner.config.accumulators) == ("device", "host")
    runner = walk(model, 2**40, store="host")
    assert (runner.config.store, runner.config.accumulators) == ("host", "host")


def test_the_probe_measures_cuda_memory_and_says_so_elsewhere(model):
    with pytest.raises(PlanError, match="--memory-budget-mib counts CUDA memory.*cpu"):
        probe(model, CHUNK)


def test_the_graph_fit_holds_past_the_first_chunk_and_never_under_it():
    from mlxwalk.plan import Footprint
    from mlxwalk.torch_backend.budget import fit
    from mlxwalk.walk.budget import graph_bytes

    chunk, width = 64, 40

    def true_graph(taps: int, prefix: int) -> float:  # a step once there is any prefix
        return 1000.0 + (300.0 if prefix else 0.0) + 2.5 * taps * width + 0.5 * prefix * width

    def walk(n: int, horizon: int) -> float:  # the last chunk's graph dominates the walk's
        prefix = n - chunk
        return true_graph(prefix if horizon == 0 else min(horizon, prefix), prefix)

    acts = fit(chunk, width, walk)
    foot = Footprint(kv_width=width // 4)
    for taps, prefix in [(64, 64), (128, 128), (64, 448), (960, 960)]:
        assert graph_bytes(acts, foot, taps, prefix) == pytest.approx(true_graph(taps, prefix))
    assert graph_bytes(acts, foot, 0, 0) >= true_graph(0, 0)
