"""The exact walk on the bundled gated delta-net hybrid: every row, and the checkpoint stride."""

import numpy as np

from mlxwalk.commands.walk_exact import Table
from mlxwalk.grading import BARS, EXACT, compare
from mlxwalk.walk import ExactWalk, WalkConfig, Window, window_gradient


def test_every_hybrid_row_holds(hybrid):
    rows = Table(hybrid, "tiny-qwen3_5").run()
    assert {r.row for r in rows} >= {"(1)", "(1b)", "(2)", "(3)", "(4)", "(7)"}
    assert all(r.ok for r in rows), "\n".join(r.line() for r in rows)


def test_stride_decodes_forward_from_the_nearest_checkpoint(hybrid):
    n, chunk = 160, 16  # 10 chunks
    ids = np.random.default_rng(5).integers(0, 256, n + 1)
    window = Window.of(ids[:-1], ids[1:], np.ones(n))
    free = ExactWalk(hybrid, window, WalkConfig(chunk=chunk)).plan
    budget = (free.accumulator_bytes + free.checkpoint_bytes // 3) / 2**20
    walk = ExactWalk(hybrid, window, WalkConfig(chunk=chunk, host_budget_mib=budget))
    assert walk.plan.stride >= 3
    _, grads = walk.run()
    assert len(walk.checkpoints) == -(-10 // walk.plan.stride) - 1
    _, one = window_gradient(hybrid, ids[:-1], ids[1:], np.ones(n), chunk=n, walk="one-graph")
    assert BARS[EXACT](*compare(grads, one))
