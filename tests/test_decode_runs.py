"""The exact walk's schedule. Its decode in runs (WalkConfig.decode_run): consecutive chunks
through the model at once, the same store and states; the runs' grouping is plain data (split
where a recurrent state checkpoint is kept); the walk with runs equals one graph, with and without
kept inputs, and decodes once per run. Its layers left in flight while the next is built: the
same gradient, bit for bit."""

from dataclasses import replace

import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxwalk.commands.walk_exact import upper_layers_only
from mlxwalk.grading import BARS, EXACT, compare
from mlxwalk.plan import Footprint, Plan, plan_window
from mlxwalk.walk import ExactWalk, WalkConfig, Window, one_graph
from mlxwalk.walk.algorithm import ExactAlgorithm

N = 160
IDS = np.random.default_rng(11).integers(0, 256, N + 1)


class Grouping(ExactAlgorithm):
    """The algorithm's grouping alone, on a plan: no model."""

    def __init__(self, plan: Plan, recurrent: bool, most: int):
        self.plan, self.recurrent, self.most = plan, recurrent, most

    def run_chunks(self) -> int:
        return self.most


def plan_of(chunks: int, stride: int) -> Plan:
    plan = plan_window([1.0] * (10 * chunks), 10, Footprint(kv_width=4, state_bytes=8))
    return replace(plan, stride=stride)


def indices(runs) -> list[list[int]]:
    return [[c.index for c in run] for run in runs]


def test_runs_group_whole_chunks_and_start_where_a_state_checkpoint_is_kept():
    plan = plan_of(9, stride=3)
    assert indices(Grouping(plan, False, 4).decode_runs(plan.chunks[:-1])) == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
    ]
    # recurrent: the states entering chunks 3 and 6 are checkpoints, so runs start there
    assert indices(Grouping(plan, True, 4).decode_runs(plan.chunks[:-1])) == [
        [0, 1, 2],
        [3, 4, 5],
        [6, 7],
    ]
    assert indices(Grouping(plan, True, 2).decode_runs(plan.chunks[:-1])) == [
        [0, 1],
        [2],
        [3, 4],
        [5],
        [6, 7],
    ]
    assert indices(Grouping(plan, False, 1).decode_runs(plan.chunks[:-1])) == [
        [i] for i in range(8)
    ]


@pytest.mark.parametrize("keep", ["off", "on", "stem"])
def test_the_walk_decoding_in_runs_equals_one_graph_and_decodes_once_per_run(
    qwen2, keep, monkeypatch
):
    window = Window.of(IDS[:-1], IDS[1:], np.r_[np.zeros(20), np.ones(N - 20)])
    with upper_layers_only(qwen2, 2 if keep == "stem" else 0):
        walk_in_runs(qwen2, window, keep, monkeypatch)


def decoded_spans(monkeypatch) -> list[int]:
    """The size of each span the walks decode from here on, in order."""
    spans: list[int] = []
    decode = ExactWalk.decode
    monkeypatch.setattr(
        ExactWalk,
        "decode",
        lambda self, chunk, *a, **k: spans.append(chunk.size) or decode(self, chunk, *a, **k),
    )
    return spans


def walk_in_runs(model, window: Window, keep: str, monkeypatch) -> None:
    _, one = one_graph(model, window)
    spans = decoded_spans(monkeypatch)
    grads = {}
    for run in (0, 64):  # chunk by chunk; runs of two chunks (32 positions each)
        spans.clear()
        config = WalkConfig(chunk=32, recompute=keep != "off", keep_inputs=keep, decode_run=run)
        _, grads[run] = ExactWalk(model, window, config).run()
        # the last chunk is decoded only for its stem output, where the reverse pass skips a stem
        last = [32] if keep == "stem" else []
        assert spans == ([32] * 4 if run == 0 else [64, 64]) + last
        assert BARS[EXACT](*compare(grads[run], one)), (run, compare(grads[run], one))


def test_a_hybrid_decodes_chunk_by_chunk_where_every_entry_state_is_kept(hybrid, monkeypatch):
    window = Window.of(IDS[:-1], IDS[1:], np.ones(N))
    spans = decoded_spans(monkeypatch)
    _, grads = ExactWalk(hybrid, window, WalkConfig(chunk=40)).run()
    _, one = one_graph(hybrid, window)
    assert spans == [40, 40, 40]  # stride 1: a checkpoint before every chunk
    assert BARS[EXACT](*compare(grads, one))


def test_under_a_budget_no_run_is_measured_where_the_schedule_allows_none(hybrid, monkeypatch):
    """A checkpoint before every chunk (stride 1) leaves the decode no run of two chunks: the
    admission measures none (a whole run's decode spent for nothing on the first window)."""
    window = Window.of(IDS[:-1], IDS[1:], np.ones(N))
    measured = []
    monkeypatch.setattr(ExactWalk, "run_bytes", lambda self, *a: measured.append(a) or 0)
    config = WalkConfig(chunk=40, decode_run=120, memory_budget_mib=1 << 16)
    walk = ExactWalk(hybrid, window, config)
    assert walk.plan.stride == 1 and walk.run_chunks() == 1 and not measured


def test_layers_left_in_flight_give_the_gradient_bit_for_bit(qwen2, monkeypatch):
    """The pipeline (Layers.timed) changes when layers are waited for, not what they compute."""
    import mlx.core as mx

    from mlxwalk.walk import taps

    window = Window.of(IDS[:-1], IDS[1:], np.ones(N))
    started = []
    async_eval = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *a: started.append(1) or async_eval(*a))
    grads = {}
    for pipeline in (False, True):
        monkeypatch.setattr(taps, "PIPELINE", pipeline)
        started.clear()
        config = WalkConfig(chunk=40, recompute=True, keep_inputs="off")
        _, grads[pipeline] = ExactWalk(qwen2, window, config).run()
        assert bool(started) == pipeline  # each layer started and left in flight, or waited for
    flat = {k: v for k, v in tree_flatten(grads[True])}
    for k, v in tree_flatten(grads[False]):
        assert mx.array_equal(v, flat[k]).item(), k


def test_under_a_memory_budget_the_decode_runs_as_long_as_its_measured_memory_fits(
    qwen2, monkeypatch
):
    """Under a budget the run the decode would take (DECODE_RUN where attention is fused, CUDA
    at half precision, or the one asked) is measured at the longest prefix it reads and halved
    until it fits beside what the decode holds at its end; chunk by chunk where no run of two
    chunks does. A roomy budget keeps it."""
    import mlx.core as mx

    from mlxwalk.walk import arch, exact

    window = Window.of(IDS[:-1], IDS[1:], np.ones(N))
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)  # the fused decode's backend
    monkeypatch.setattr(exact, "DECODE_RUN", 128)
    roomy = {"memory_budget_mib": 1 << 16}
    half = replace(arch.inspect(qwen2), dtype=mx.bfloat16)  # the half-precision model's
    for extra, run, expected in [({}, None, 4), (roomy, None, 4), (roomy, 64, 2), ({}, 64, 2)]:
        walk = ExactWalk(qwen2, window, WalkConfig(chunk=32, decode_run=run, **extra), half)
        assert walk.run_chunks() == expected, (extra, run)
    # a run's own memory as measured: what fits beside the decode's end decides the width
    est = ExactWalk(qwen2, window, WalkConfig(chunk=32, decode_run=128, **roomy)).estimate
    room = (1 << 16) * (1 << 20) - est.decoding
    for per_position, expected in [(room / 100, 2), (room / 200, 4), (room / 50, 1)]:
        asked = []

        def run_bytes(self, width, prefix, per_position=per_position, asked=asked):
            asked.append((width, prefix))
            return int(width * per_position)

        monkeypatch.setattr(ExactWalk, "run_bytes", run_bytes)
        walk = ExactWalk(qwen2, window, WalkConfig(chunk=32, decode_run=128, **roomy))
        assert walk.run_chunks() == expected, per_position
        # runs end where the last chunk starts (128): the longest prefix each width reads; at
        # room / 50 per position the measured 128 says even 64 would not fit: not measured
        assert asked == [(128, 0), (64, 64)][: {4: 1, 2: 2, 1: 1}[expected]], asked


def test_a_decode_run_measured_holds_the_decode_within_its_end_and_the_run(qwen2):
    """The bound the admission relies on: the decode in runs peaks within what it holds at its
    end plus one run's measured memory, which grows with the run and which the estimate
    counts."""
    from mlxwalk.walk import budget

    n = 1024
    ids = np.random.default_rng(1).integers(0, 256, n + 1)
    window = Window.of(ids[:-1], ids[1:], np.ones(n))
    config = WalkConfig(chunk=128, decode_run=512, recompute=True, keep_inputs="on")
    walk = ExactWalk(qwen2, window, replace(config, memory_budget_mib=1 << 16))
    assert walk.run_chunks() == 4
    est = walk.estimate
    runs = {w: walk.run_bytes(w, 896 - w) for w in (256, 512)}
    assert 0 < runs[256] < runs[512], runs
    with walk.walking():
        peak = budget.live_peak(walk.decode_forward)
    assert est.run == runs[512]  # the estimate counts the run it chose
    held = est.decoding - est.run - est.weights - est.adapter - est.resident
    assert peak <= held + runs[512], (peak, held, runs)
    assert peak > held, (peak, held)  # the run's own memory is real: the end alone under-reads


def test_a_run_whose_measure_runs_out_of_device_memory_is_not_taken(qwen2, monkeypatch):
    """The measure's own failed allocation says the run does not fit (the decode goes by
    chunk); any other error is the walk's fault and is raised."""
    from mlxwalk.walk import probe

    window = Window.of(IDS[:-1], IDS[1:], np.ones(N))
    config = WalkConfig(chunk=32, decode_run=128, memory_budget_mib=1 << 16)
    for message in ["cudaMalloc failed: out of memory", "a bug"]:
        probe.forget()

        def fail(self, run, state, message=message):  # only the run's measure decodes a run
            raise RuntimeError(message)

        monkeypatch.setattr(ExactWalk, "decode_run", fail)
        if message == "a bug":
            with pytest.raises(RuntimeError, match="a bug"):
                ExactWalk(qwen2, window, config)
        else:
            assert ExactWalk(qwen2, window, config).run_chunks() == 1
    probe.forget()
