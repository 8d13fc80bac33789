"""Device memory: the estimate against the measured peak, admission, and the horizon retry."""

import logging

import numpy as np
import pytest

from mlxwalk import budget
from mlxwalk.plan import MIB, OutOfMemory
from mlxwalk.walk import ExactWalk, WalkConfig, Window


def window(n, seed=0):
    ids = np.random.default_rng(seed).integers(0, 256, n + 1)
    return Window.of(ids[:-1], ids[1:], np.ones(n))


@pytest.mark.parametrize("model", ["qwen2", "hybrid"])
@pytest.mark.parametrize("n, chunk, horizon", [(1024, 256, 0), (2048, 256, 512)])
def test_estimate_is_within_15_percent_of_the_measured_peak(measured, model, n, chunk, horizon):
    model = measured[model]
    walk = ExactWalk(model, window(n), WalkConfig(chunk=chunk, horizon=horizon))
    acts = budget.probe(model, chunk)
    est = budget.estimate(model, walk.layout, acts, walk.plan, "float32", optimizer_factor=2)
    measured = budget.live_peak(walk.run)
    predicted = est.total - est.weights  # the weights were loaded before the measurement
    assert abs(predicted / measured - 1) <= 0.15, (predicted / MIB, measured / MIB)


def budgets(model, n, chunk):
    """(the walk's memory with one chunk of taps, with every prefix position tapped) for the last
    chunk: weights, adapter, store, accumulators and the graph."""
    walk = ExactWalk(model, window(n), WalkConfig(chunk=chunk))
    acts = walk.acts = budget.probe(model, chunk)
    est = walk.measure(walk.plan)  # with whatever else is alive, as the walk counts it
    fp = walk.layout.footprint()
    rest = est.total - est.graph
    last = n - chunk
    least, full = (
        budget.graph_bytes(acts, fp, chunk, last),
        budget.graph_bytes(acts, fp, last, last),
    )
    return rest + least, rest + full


def test_a_budget_short_of_the_full_horizon_narrows_it_per_chunk_and_not_beyond(measured, caplog):
    qwen2 = measured["qwen2"]
    least, full = budgets(qwen2, 2048, 256)
    config = WalkConfig(chunk=256, memory_budget_mib=(least + full) / 2 / MIB)
    walk = ExactWalk(qwen2, window(2048), config)
    with caplog.at_level(logging.INFO, logger="mlxwalk"):
        loss, grads = walk.run()
    assert 256 <= walk.horizon_used < 2048 and walk.horizon_used % 256 == 0
    assert "horizon narrowed" in caplog.text and "memory budget" in caplog.text
    assert np.isfinite(loss.item())
    # the next window starts from the requested horizon again
    short = ExactWalk(qwen2, window(512, seed=1), config)
    short.run()
    assert short.horizon_used == 0


def test_a_budget_below_one_chunk_of_taps_is_refused_before_the_walk(measured):
    qwen2 = measured["qwen2"]
    least, _ = budgets(qwen2, 2048, 256)
    with pytest.raises(OutOfMemory, match="device memory") as e:
        ExactWalk(qwen2, window(2048), WalkConfig(chunk=256, memory_budget_mib=least / 2 / MIB))
    assert "budget is" in str(e.value) and "q8" in str(e.value)
