"""The plan without a model: chunking, marks, host bytes, stride and refusal."""

import pytest

from mlxwalk.plan import MIB, Footprint, OutOfMemory, PlanError, cut, plan_window, runs

ATTN = Footprint(kv_width=4 * 2 * 128)
HYBRID = Footprint(kv_width=2 * 128, state_bytes=3 * MIB)


def reply_window(context=300, reply=200, tail=40):
    return [0.0] * context + [1.0] * reply + [0.0] * tail


def test_runs_are_maximal():
    assert runs([0, 0, 1, 1, 1, 0]) == [(0, 2, 0.0), (2, 5, 1.0), (5, 6, 0.0)]


def test_chunks_follow_runs_and_stop_at_the_last_label():
    w = [0.0] * 10 + [1.0] * 7 + [0.0] * 5 + [1.0] * 3 + [0.0] * 9
    chunks = cut(w, 4)
    assert [(c.start, c.end) for c in chunks] == [
        (0, 4),
        (4, 8),
        (8, 10),
        (10, 14),
        (14, 17),
        (17, 21),
        (21, 22),
        (22, 25),
    ]
    for c in chunks:
        assert len(set(w[c.start : c.end])) == 1, "a chunk crossed a run"
        assert c.size <= 4
    assert chunks[-1].end == 25  # the last label is position 24
    assert [c.index for c in chunks] == list(range(len(chunks)))


def test_the_reverse_pass_ends_on_the_first_needed_chunk():
    for horizon in (0, 64, 100):
        plan = plan_window(reply_window(), 64, ATTN, horizon=horizon)
        needed = [c for c in plan.chunks if c.needed]
        assert plan.reverse()[-1] is needed[0] and plan.reverse()[0] is needed[-1]


def test_horizon_sets_grad_from():
    plan = plan_window(reply_window(context=512, reply=128, tail=0), 64, ATTN, horizon=128)
    by_start = {c.start: c for c in plan.chunks}
    assert by_start[576].grad_from == 448
    assert by_start[0].grad_from == 0
    # a horizon bounds each chunk's taps, not the chain: a needed context chunk's own taps
    # reach the chunk before it, so every chunk up to the last label stays needed
    assert all(c.needed for c in plan.chunks)


def test_recurrent_state_keeps_every_earlier_chunk_needed():
    plan = plan_window(reply_window(context=512, reply=128, tail=0), 64, HYBRID, horizon=64)
    assert all(c.needed for c in plan.chunks)


def test_accumulator_bytes_cover_the_computed_positions():
    plan = plan_window(reply_window(300, 200, 40), 64, ATTN)
    assert plan.computed == 500
    assert plan.accumulator_bytes == 500 * ATTN.kv_width * 4
    assert plan.checkpoint_bytes == 0 and plan.stride == 1


def test_smaller_host_budget_gives_larger_stride_and_fewer_bytes():
    w = [1.0] * 64 * 16
    free = plan_window(w, 64, HYBRID)
    assert free.stride == 1 and free.checkpoint_bytes == 15 * 3 * MIB
    budget = free.accumulator_bytes + free.checkpoint_bytes * 3 // 4
    tight = plan_window(w, 64, HYBRID, host_budget=budget)
    assert tight.stride > 1
    assert tight.host_bytes < free.host_bytes and tight.host_bytes <= budget
    tighter = plan_window(w, 64, HYBRID, host_budget=free.accumulator_bytes + 3 * MIB)
    assert tighter.stride > tight.stride and tighter.host_bytes <= tight.host_bytes
    kept = [c.index for c in tight.chunks if tight.checkpointed(c.index)]
    assert len(kept) == tight.slots == -(-16 // tight.stride) - 1 and 0 not in kept


def test_impossible_budget_is_refused_naming_host_memory():
    with pytest.raises(OutOfMemory) as e:
        plan_window([1.0] * 256, 64, ATTN, host_budget=1)
    msg = str(e.value)
    assert "host memory" in msg
    assert "1.0 MiB" in msg  # 256 positions x 1024 elements x 4 bytes
    assert "budget is 0.0 MiB" in msg


@pytest.mark.parametrize(
    "weights, chunk, match",
    [([0.0] * 8, 4, "no labelled position"), ([1.0] * 8, 0, "chunk must be at least 1")],
)
def test_bad_windows_are_refused(weights, chunk, match):
    with pytest.raises(PlanError, match=match):
        plan_window(weights, chunk, ATTN)


def test_without_following_runs_chunks_are_consecutive_and_carry_their_weights():
    w = [0.0] * 10 + [1.0] * 7 + [0.0] * 5 + [1.0] * 3 + [0.0] * 9
    chunks = cut(w, 8, follow_runs=False)
    assert [(c.start, c.end) for c in chunks] == [(0, 8), (8, 16), (16, 24), (24, 25)]
    assert [c.weight for c in chunks] == [0.0, 6.0, 3.0, 1.0]
    plan = plan_window(w, 8, ATTN, follow_runs=False)
    assert sum(c.weight for c in plan.chunks) == sum(w)
