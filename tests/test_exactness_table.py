"""test-walk-exact's table is one, for both backends (mlxwalk/exactness.py): a backend supplies
only how to run a walk. Checked here on a backend of NumPy arrays whose walks are planted."""

import subprocess
import sys

import numpy as np
import pytest

from mlxwalk import exactness
from mlxwalk.exactness import EXACT, ONE, ExactnessTable, Setting
from mlxwalk.plan import OutOfMemory, Plan

from . import extras

MIB = 2**20
REFERENCE = {"a": np.linspace(1.0, 2.0, 50)}
PLAIN = {"a": np.cos(np.arange(50.0))}  # far from the reference, as the plain walk is


def plan(checkpoint_mib: int, stride: int) -> Plan:
    return Plan(64, 16, 0, (), MIB, stride, checkpoint_mib * MIB)


class Planted(ExactnessTable):
    """Every walk gives the reference gradient (the plain walk another), but those in `off`,
    scaled by 0.9999 (the smallest error the exact bar is promised to catch)."""

    store_name = "store"

    def __init__(self, offers=lambda s: True, off=(), recurrent=False, refuses=True, steps=False):
        self.layers, self.recurrent = 4, recurrent
        self.offered, self.off, self.refuses, self.steps = offers, off, refuses, steps
        self.params = {"a": np.zeros(3)}
        self.walks: list[Setting] = []
        super().__init__("planted", vocab=10, window=64, n_chunks=4)

    def header(self) -> str:
        return "planted"

    def offers(self, setting):
        return self.offered(setting)

    def walked(self, setting, weights, chunk, ids):
        chosen = ids[0] is self.x  # else row (9)'s rejected answer
        self.walks.append((setting, chosen))
        grads = PLAIN if setting.walk == "plain" else REFERENCE
        side = 1.0 if chosen else 1.3  # the pair's two answers differ
        loss = 2.0 + side + (0.3 if setting.walk == "plain" else 0.0)
        return loss, {"a": grads["a"] * side * (0.9999 if setting in self.off else 1.0)}

    def reference_loss(self, ids, weights):
        return 2.5 if ids[0] is self.x else 3.1

    def planned(self, host_budget_mib, run=True):
        if host_budget_mib is None:
            return plan(4, 1), (dict(REFERENCE) if run else None)
        assert host_budget_mib == 4.0  # the accumulators and 3/4 of the checkpoints
        return plan(2, 2), dict(REFERENCE)

    def adapter(self):
        return self.params

    def train(self, host_budget_mib):
        if self.steps:
            self.params["a"] = self.params["a"] + 1.0
        if self.refuses:
            raise OutOfMemory("the window's store exceeds the host memory budget")


def rows_of(table):
    return {(r.row, r.what): r for r in table.run()}


def test_a_backend_runs_the_rows_it_offers_in_the_tables_order():
    table = Planted(offers=lambda s: s.attention == "auto" and not s.recompute)
    rows = table.run()
    want = ["(1)", "(1)", "(1b)", "(1b)", "(1b)", "(1c)", "(1c)", "(2)", "(3)"]
    want += ["(9)", "(9)"]
    assert [r.row for r in rows] == want and all(r.ok for r in rows)
    assert rows[2].what == "float16 store: exact vs float32 one graph"
    assert len(set(table.walks)) == len(table.walks), "a setting walked twice"


def test_a_reason_prints_the_row_as_not_offered():
    reason = lambda s: "head dimension 16" if s.store == "q8" else True  # noqa: E731
    (q8,) = [r for r in Planted(offers=reason).run() if "q8" in r.what]
    assert q8.ok and q8.detail == "not offered: head dimension 16" and q8.cosine is None


@pytest.mark.parametrize("row", [s for s in exactness.ROWS if s.bar == EXACT and s.walk])
def test_every_exact_row_fails_a_gradient_off_by_a_ten_thousandth(row):
    off = row.walk if row.reference in (ONE, exactness.EVERY) else row.reference
    rows = Planted(off=(off,), recurrent=True).run()
    failed = [(r.row, r.what) for r in rows if not r.ok]
    assert (row.row, row.what.format(k=4, store="store", half=2)) in failed, failed


@pytest.mark.parametrize(
    "refuses, steps, detail",
    [
        (True, False, "refused, adapter untouched"),
        (False, True, "not refused, adapter changed"),
        (True, True, "refused, adapter changed"),
        (False, False, "not refused, adapter untouched"),
    ],
)
def test_the_refusal_row_holds_only_when_refused_before_a_step(refuses, steps, detail):
    row = rows_of(Planted(refuses=refuses, steps=steps))[("(3)", "host budget of 1 byte")]
    assert row.detail == detail and row.ok == (refuses and not steps)


def test_the_strided_row_reads_the_plans():
    (row,) = [r for r in Planted(recurrent=True).run() if r.row == "(4)"]
    assert row.ok and row.what == "3/4 checkpoint budget: stride 2, 3.00 vs 5.00 MiB"


def test_the_table_imports_with_the_frameworks_blocked():
    """The table is shared: mlxwalk.exactness imports no framework."""
    code = (
        "import sys; [sys.modules.__setitem__(m, None) for m in ('mlx', 'mlx.core', 'torch', "
        "'mlx_lm', 'transformers', 'peft')]; import mlxwalk.exactness; print('ok')"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.stdout.strip() == "ok", p.stderr[-2000:]


@extras.torch
def test_the_torch_table_imports_with_mlx_blocked():
    code = (
        "import sys; [sys.modules.__setitem__(m, None) for m in ('mlx', 'mlx.core', 'mlx_lm')]; "
        "import mlxwalk.torch_backend.exactness; print('ok')"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.stdout.strip() == "ok", p.stderr[-2000:]
