"""The checkpoint schedule without a model: the closed form against its recursion, and the walk's
algorithm following it with integer states (the state entering chunk i is i)."""

import pytest

from mlxwalk.checkpoints import by_stride, decodes, decodes_by_recursion, schedule
from mlxwalk.plan import Footprint, plan_window
from mlxwalk.walk.algorithm import ExactAlgorithm


@pytest.mark.parametrize("slots", range(0, 9))
def test_the_closed_form_is_the_recursions_least(slots):
    assert [decodes(n, slots) for n in range(1, 40)] == [
        decodes_by_recursion(n, slots) for n in range(1, 40)
    ]


class Counting(ExactAlgorithm):
    """The exact walk's algorithm on integer states: a decode adds one, a chunk checks the state
    it is trained from and how many states the walk holds."""

    recurrent = True

    def __init__(self, plan):
        self.plan, self.again, self.held, self.trained = plan, 0, [], []

    def new_store(self, positions):
        pass

    def zero_state(self):
        return 0

    def decode(self, chunk, state, write=True):
        assert state == chunk.index
        self.again += not write
        return state + 1

    def start_reverse(self):
        pass

    def train_chunk(self, chunk, entry, grad_from):
        assert entry == chunk.index
        self.held.append(len(self.checkpoints))
        self.trained.append(chunk.index)
        return 0.0

    def finish_reverse(self, loss):
        return loss


def walked(chunks: int, stride: int) -> Counting:
    plan = plan_window([1.0] * chunks, 1, Footprint(kv_width=1, state_bytes=1))
    algorithm = Counting(plan.__class__(**{**plan.__dict__, "stride": stride}))
    algorithm.walk()
    return algorithm


@pytest.mark.parametrize("chunks", [1, 2, 5, 16, 33, 132])
@pytest.mark.parametrize("stride", [1, 2, 5, 19, 66, 1000])
def test_the_walk_trains_every_chunk_from_its_state_within_the_slots(chunks, stride):
    a = walked(chunks, stride)
    slots = a.plan.slots
    assert a.trained == list(reversed(range(chunks)))
    assert a.again == a.plan.decoded_again() == decodes(chunks, slots) - (chunks - 1)
    # the forward's checkpoints and the state handed to the last chunk; then within the slots
    assert a.held[0] <= slots + 1 and max(a.held[1:], default=0) <= slots
    assert [h for _, _, h in a.plan.schedule.walk()] == a.held
    assert len(a.plan.schedule.forward) == min(slots, max(chunks - 1, 0))


def test_the_binomial_schedule_re_decodes_a_fraction_of_the_stride_walk():
    """The 27B-shaped window at 21 GiB: 132 chunks of 512, one checkpoint per 19 chunks. Each
    chunk decoded from the checkpoint before it re-decodes 1,162 chunks (1,179 when the last
    chunk's state was decoded again too); the schedule 232."""
    a = walked(132, 19)
    stride_walk = by_stride(132, 19).again()
    assert (a.plan.slots, stride_walk, a.again) == (6, 1_162, 232)
    # no slot: every chunk decoded from the zero state; one slot: far less than its stride walk
    assert walked(132, 132).again == 132 * 131 // 2 - 131
    assert walked(132, 66).again == 1_169 < by_stride(132, 66).again() == 4_225


def test_as_many_slots_as_chunks_re_decode_nothing():
    for chunks in (2, 9, 40):
        assert walked(chunks, 1).again == 0
        assert decodes(chunks, chunks) == chunks - 1


def test_the_schedule_costs_its_closed_form_and_keeps_within_its_slots():
    for chunks in range(1, 70):
        for slots in range(0, 12):
            s = schedule(chunks, slots)
            walked_back = s.walk()
            assert s.again() == decodes(chunks, slots) - max(chunks - 1, 0), (chunks, slots)
            if chunks > 1:  # past the last chunk's training, within the slots
                assert max(h for _, _, h in walked_back[1:]) <= slots, (chunks, slots)


def test_the_even_schedule_decodes_each_chunk_from_the_checkpoint_before_it():
    for chunks, stride in [(9, 3), (33, 5), (132, 19)]:
        even = by_stride(chunks, stride)
        assert even.again() == sum(i % stride for i in range(chunks - 1))  # the last handed over
        assert sorted(even.forward) == list(range(stride, chunks, stride))
