"""Device memory: the estimate against the measured peak, admission, and the horizon retry."""

import logging

import numpy as np
import pytest

from mlxwalk.commands.walk_exact import upper_layers_only
from mlxwalk.plan import MIB, OutOfMemory
from mlxwalk.walk import ExactWalk, WalkConfig, Window, budget
from mlxwalk.walk import probe as probes
from mlxwalk.walk.exact import probe

# lossless and held, so that a budget short of the full horizon narrows it (the admission's
# lossy choices: tests/test_admission_choices.py)
HELD = dict(cache_type="float32", accumulator_dtype="float32")


def window(n, seed=0):
    ids = np.random.default_rng(seed).integers(0, 256, n + 1)
    return Window.of(ids[:-1], ids[1:], np.ones(n))


@pytest.mark.parametrize("model", ["qwen2", "hybrid"])
@pytest.mark.parametrize("n, chunk, horizon", [(1024, 256, 0), (1536, 256, 512)])
def test_estimate_is_within_15_percent_of_the_measured_peak(measured, model, n, chunk, horizon):
    model = measured[model]
    walk = ExactWalk(model, window(n), WalkConfig(chunk=chunk, horizon=horizon))
    acts = probe(model, WalkConfig(chunk=chunk))
    est = budget.estimate(model, walk.layout, acts, walk.plan, "float32", optimizer_factor=2)
    measured = budget.live_peak(walk.run)
    predicted = est.total - est.weights  # the weights were loaded before the measurement
    assert abs(predicted / measured - 1) <= 0.15, (predicted / MIB, measured / MIB)


@pytest.mark.parametrize("model", ["qwen2", "hybrid"])
def test_with_a_stem_skipped_the_estimate_is_the_larger_phase_within_15_percent(measured, model):
    """The stem's output kept: the stem's K/V held through the decode alone, the estimate the
    larger of the decode's memory and the reverse pass's, within 15% of the measured peak."""
    model = measured[model]
    config = WalkConfig(chunk=256, recompute=True, keep_inputs="stem")
    with upper_layers_only(model, len(model.layers) // 2):
        walk = ExactWalk(model, window(1536), config)
        assert walk.skips_stem()
        walk.acts = probe(model, config)
        est = walk.measure(walk.plan)
        assert est.stem_store > 0 and est.total == max(est.decoding, est.reversing)
        measured = budget.live_peak(walk.run)
    predicted = est.total - est.weights - est.resident  # loaded before the measurement
    assert abs(predicted / measured - 1) <= 0.15, (predicted / MIB, measured / MIB)


def budgets(model, n, chunk):
    """(the walk's memory with one chunk of taps, with every prefix position tapped) for the last
    chunk: weights, adapter, store, accumulators and the graph."""
    walk = ExactWalk(model, window(n), WalkConfig(chunk=chunk))
    acts = walk.acts = probe(model, WalkConfig(chunk=chunk))
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
    config = WalkConfig(chunk=256, memory_budget_mib=(least + full) / 2 / MIB, **HELD)
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


def test_strict_exact_refuses_what_the_budget_would_narrow(measured):
    qwen2 = measured["qwen2"]
    least, full = budgets(qwen2, 2048, 256)
    config = WalkConfig(
        chunk=256, memory_budget_mib=(least + full) / 2 / MIB, strict_exact=True, **HELD
    )
    with pytest.raises(OutOfMemory, match="only with its horizon narrowed .* --strict-exact"):
        ExactWalk(qwen2, window(2048), config)
    roomy = WalkConfig(chunk=256, memory_budget_mib=full * 1.2 / MIB, strict_exact=True)
    assert ExactWalk(qwen2, window(2048), roomy).horizon_used == 0  # fits whole: admitted


def test_narrowing_shows_on_the_progress_line_and_the_epoch_line(capsys):
    from mlxwalk.training import report
    from mlxwalk.training.report import Epoch

    bar = report.progress(2, enabled=True)
    bar.lines, bar.live = True, False
    bar.window(3.2, 900.0, 120.0, narrowed=512)
    bar.window(3.1, 900.0, 120.0)
    err = capsys.readouterr().err
    assert "window 1/2: loss 3.200, 900 tok/s, peak 120 MiB, horizon narrowed to 512" in err
    assert "window 2/2: loss 3.100, 900 tok/s, peak 120 MiB\n" in err
    line = report.epoch_line(Epoch(1, 3.0, 2.9, 10.0, 800.0, 2, False, 1, 512))
    assert "1 window(s) not exact" in line and "as few as 512 positions" in line
    assert "not exact" not in report.epoch_line(Epoch(1, 3.0, 2.9, 10.0, 800.0, 2))


def test_a_budget_below_one_chunk_of_taps_is_refused_before_the_walk(measured):
    qwen2 = measured["qwen2"]
    least, _ = budgets(qwen2, 2048, 256)
    with pytest.raises(OutOfMemory, match="device memory") as e:
        config = WalkConfig(chunk=256, memory_budget_mib=least / 2 / MIB, **HELD)
        ExactWalk(qwen2, window(2048), config)
    assert "budget is" in str(e.value) and "q8" in str(e.value)


def test_the_probe_is_keyed_by_everything_that_changes_it(qwen2):
    base = WalkConfig(chunk=256)
    key = probes.probe_key(qwen2, base)
    assert probes.probe_key(qwen2, WalkConfig(chunk=256, horizon=64)) == key  # no change
    for other in (
        {"chunk": 512},
        {"recompute": True},
        {"attention": "fused"},
        {"cache_type": "bfloat16"},
    ):
        assert probes.probe_key(qwen2, WalkConfig(**{"chunk": 256, **other})) != key, other
    kept = probes.probe_key(qwen2, WalkConfig(chunk=256, recompute=True))
    assert probes.probe_key(qwen2, WalkConfig(chunk=256, recompute=True, keep_inputs="off")) != kept
    qwen2.layers[0].self_attn.q_proj.lora_a = qwen2.layers[0].self_attn.q_proj.lora_a[:, :4]
    assert probes.probe_key(qwen2, base) != key  # another adapter shape


def test_a_long_probe_reads_its_share_of_the_prefix_in_whole_chunks(monkeypatch):
    chunk, reach = 2048, 31 * 2048  # the 8B window's last chunk reads 31 chunks
    short = probes.prefix_for(chunk, reach, long=False)
    assert short == chunk * -(-2 * probes.TILE // chunk)  # two attention tiles
    assert probes.prefix_for(chunk, reach, long=True) == reach  # the whole prefix
    assert probes.prefix_for(chunk, 2 * chunk, long=True) == 2 * chunk  # never past the reach
    monkeypatch.setattr(probes, "LONG_SHARE", 0.5)
    assert probes.prefix_for(chunk, reach, long=True) == 15 * chunk  # half, rounded down


@pytest.mark.parametrize(
    "error, refused",
    [
        ("cudaMallocAsync(&data, size, stream) failed: out of memory", True),
        ("[metal::malloc] Resource limit (499000) exceeded.", True),
        ("[matmul] Last dimension of first input with shape (1,2) must match", False),
    ],
)
def test_a_probe_out_of_device_memory_is_a_refusal_not_a_crash(qwen2, monkeypatch, error, refused):
    # on CUDA the probe walks the whole window: where the run would not fit the device, it fails
    # first, and that is the window refused by name, not a traceback
    def fails(*_, **__):
        raise RuntimeError(error)

    monkeypatch.setattr(probes, "_probes", {})
    monkeypatch.setattr(probes, "measure", fails)
    config = WalkConfig(chunk=256, memory_budget_mib=64 * 1024)
    if refused:
        with pytest.raises(OutOfMemory, match="device memory: measuring one chunk's graph") as e:
            ExactWalk(qwen2, window(1024), config)
        assert "\n" not in str(e.value) and e.value.__cause__ is None
    else:
        with pytest.raises(RuntimeError, match="matmul"):
            ExactWalk(qwen2, window(1024), config)


@pytest.mark.parametrize("model", ["qwen2", "hybrid"])
@pytest.mark.parametrize("recompute", [False, True])
def test_the_probe_walk_decodes_nothing_and_measures_the_graph_a_decoding_walk_holds(
    measured, model, recompute
):
    """The probe's walk (`filled`) allocates the store and trains the last chunk without
    decoding the prefix: its graph (peak less what the walk holds) is the decoding walk's."""
    model = measured[model]
    config = WalkConfig(chunk=512, recompute=recompute, keep_inputs="stem" if recompute else "off")
    graph, decoded = {}, {}
    for filled in (False, True):
        run = ExactWalk(model, window(3072), config)
        run.filled = filled
        decoded[filled] = 0
        decode = run.decode

        def counted(*args, decode=decode, filled=filled, **kw):
            decoded[filled] += 1
            return decode(*args, **kw)

        run.decode = counted
        graph[filled] = budget.live_peak(lambda run=run: run.run(chunks=1)) - run.held()
    assert decoded[True] == 0 and decoded[False] >= 5, decoded
    assert abs(graph[True] / graph[False] - 1) <= 0.05, (graph[True] / MIB, graph[False] / MIB)


def test_the_estimate_is_the_larger_phase_and_its_lines_say_both():
    """The decode's end holds the whole store and no graph; the reverse pass the graph and the
    accumulators without the stem's K/V: the estimate is the larger, and its lines show both."""
    parts = dict(weights=10, adapter=1, store=4, accumulators=4, checkpoints=1, inputs=2)
    small = budget.Estimate(**parts, graph=20, stem_store=12)
    large = budget.Estimate(**parts, graph=2, stem_store=12)
    assert small.total == small.reversing == 42 and small.decoding == 30
    assert large.total == large.decoding == 30 and large.reversing == 24
    lines = [
        line.split()[:2] for line in budget.Estimate(**parts, graph=2, stem_store=12 * MIB).lines()
    ]
    assert ["decode's", "end"] in lines and ["reverse", "pass"] in lines
    assert not any("end" in line for line in budget.Estimate(**parts, graph=2).lines())
