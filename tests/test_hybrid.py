"""The exact walk on the bundled gated delta-net hybrid: every row, and the checkpoint schedule."""

import numpy as np

from mlxwalk.commands.walk_exact import Table
from mlxwalk.grading import BARS, EXACT, compare
from mlxwalk.walk import ExactWalk, WalkConfig, Window, window_gradient


def test_every_hybrid_row_holds(hybrid):
    rows = Table(hybrid, "tiny-qwen3_5").run()
    assert {r.row for r in rows} >= {"(1)", "(1b)", "(2)", "(3)", "(4)", "(7)"}
    assert all(r.ok for r in rows), "\n".join(r.line() for r in rows)


def test_the_schedule_re_decodes_as_planned_within_its_slots(hybrid):
    """Fewer checkpoints than chunks: the walk re-decodes exactly the chunks the binomial
    schedule counts, never holds more states than its slots (and the one it trains from), and
    its gradient is one graph's."""
    n, chunk = 160, 16  # 10 chunks
    ids = np.random.default_rng(5).integers(0, 256, n + 1)
    window = Window.of(ids[:-1], ids[1:], np.ones(n))
    free = ExactWalk(hybrid, window, WalkConfig(chunk=chunk)).plan
    budget = (free.accumulator_bytes + free.checkpoint_bytes // 3) / 2**20
    walk = ExactWalk(hybrid, window, WalkConfig(chunk=chunk, host_budget_mib=budget))
    assert walk.plan.stride >= 3 and walk.plan.slots == -(-10 // walk.plan.stride) - 1
    again, held, decode = [0], [0], walk.decode

    def counted(c, state, write=True):
        again[0] += not write
        held[0] = max(held[0], len(walk.checkpoints))
        return decode(c, state, write)

    walk.decode = counted
    _, grads = walk.run()
    assert again[0] == walk.plan.decoded_again() > 0
    assert held[0] <= walk.plan.slots + 1
    _, one = window_gradient(hybrid, ids[:-1], ids[1:], np.ones(n), chunk=n, walk="one-graph")
    assert BARS[EXACT](*compare(grads, one))
