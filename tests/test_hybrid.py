"""The exact walk on the bundled gated delta-net hybrid: every row, and the checkpoint schedule."""

from dataclasses import replace

import numpy as np
import pytest

from mlxwalk.commands.walk_exact import Table, upper_layers_only
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


@pytest.mark.parametrize("keep", ["stem", "all", "off"])
def test_with_the_stems_output_kept_a_re_decode_runs_the_trained_layers_alone(hybrid, keep):
    """With a stem and its output kept, no stem layer runs in the reverse pass: the decode takes
    the last chunk too (for its stem output) and lets the stem's K/V go, a re-decode runs from the
    kept stem output through the trained layers only, and the trained layers' states alone are
    held; with nothing kept, every layer runs and every state is held. The states held are the
    estimate's bytes, and the gradient is one graph's either way."""
    n, chunk = 160, 16  # 10 chunks
    ids = np.random.default_rng(6).integers(0, 256, n + 1)
    window = Window.of(ids[:-1], ids[1:], np.ones(n))
    config = WalkConfig(chunk=chunk, recompute=True, keep_inputs="on" if keep == "all" else keep)
    with upper_layers_only(hybrid, 3):  # stem: recurrent, recurrent, attention
        free = ExactWalk(hybrid, window, config).plan
        budget = (free.accumulator_bytes + free.checkpoint_bytes // 3) / 2**20
        walk = ExactWalk(hybrid, window, replace(config, host_budget_mib=budget))
        assert walk.keep == keep and walk.stem == 3 and walk.plan.decoded_again() > 0
        heard, states, held_bytes, stem_kv = [], [], [], []
        walk.layers.clock = lambda what, seconds: heard.append(what)
        let_go = walk.let_go

        def watched(c):  # the states held as each chunk is trained, the one it ran from aside
            states.extend(held for i, held in walk.checkpoints.items() if i != c.index)
            arrays = [a for held in walk.checkpoints.values() for s in held if s for a in s]
            held_bytes.append(sum(a.nbytes for a in arrays))
            if not stem_kv:
                stem_kv.append(walk.store.keys[0] is None)  # layer 2, the stem's attention
            let_go(c)

        walk.let_go = watched
        _, grads = walk.run()
        _, one = window_gradient(hybrid, ids[:-1], ids[1:], np.ones(n), chunk=n, walk="one-graph")
    decodes = sum(w.startswith("decode") for w in heard)  # the forward decode's, then again
    n, skipped = len(walk.plan.chunks), keep != "off"
    # skipped: the last chunk decoded too (for its stem output), each re-decode the trained 3
    forward = 6 * (n if skipped else n - 1)
    assert decodes == forward + (3 if skipped else 6) * walk.plan.decoded_again()
    assert (sum(w.startswith("stem") for w in heard) == 0) == skipped  # no stem layer in reverse
    assert stem_kv == [skipped]  # the stem's attention layer's K/V let go after the decode
    assert states  # the stem's two recurrent layers' states are held only with nothing kept
    assert max(held_bytes) == held_bytes[0] == walk.plan.checkpoint_bytes  # the estimate's
    assert all([s is None for s in held] == [keep != "off"] * 2 + [False] * 2 for held in states)
    assert BARS[EXACT](*compare(grads, one))
