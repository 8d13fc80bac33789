"""`mlxwalk plan --macs`: per Mac memory size, the verdict for a window and the longest exact
window, each held to the exact walk's own admission at the same budget."""

import importlib.util
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from mlxwalk.commands.plan import macs_table, report_macs
from mlxwalk.plan import MIB, OutOfMemory
from mlxwalk.walk import ExactWalk, WalkConfig, Window, admission, machine, macs

ROOT = Path(__file__).resolve().parent.parent
CHUNK, WINDOW = 128, 512  # the probe walks 640 positions: seconds on a CPU
MOST = 131072  # tiny-qwen2's maximum positions


@pytest.fixture(scope="module")
def model():
    from mlxwalk import tiny
    from mlxwalk.training import adapters, models

    model, _ = models.load(str(tiny.path("tiny-qwen2")), tokenizer=False)
    adapters.apply(model, adapters.LoraConfig(rank=8, num_layers=16))  # as `mlxwalk plan` does
    return model


@pytest.fixture(scope="module")
def config():
    """As the survey admits (macs.Admissions): lossless, the chunk held."""
    held = dict(cache_type="float32", accumulator_dtype="float32", min_chunk=CHUNK)
    return WalkConfig(chunk=CHUNK, **held).check()


@pytest.fixture(scope="module")
def graphs(model, config):
    """The direct admissions' graph: measured once over the asked window's prefix, as the survey
    measures it (the probe's cache hands both the same measurement)."""
    return macs.Admissions(model, config, WINDOW).graphs


def direct(model, config, graphs, window, budget):
    """The exact walk's own admission of a fully labelled window under `budget` bytes."""
    try:
        walk = ExactWalk(
            model,
            Window.labelled(window),
            replace(config, memory_budget_mib=budget / MIB),
            None,
            graphs,
        )
    except OutOfMemory:
        return None
    return walk


def exact(model, config, graphs, window, budget) -> bool:
    walk = direct(model, config, graphs, window, budget)
    return walk is not None and walk.estimate.total <= budget


@pytest.fixture(scope="module")
def sizes(model, config, graphs):
    """Budgets around the window's need: one below the model's weights, one that narrows the
    horizon, one a byte short, the need itself, and three roomier (labelled 1 to 7 "GB")."""
    walk = direct(model, config, graphs, WINDOW, 1 << 40)
    need = walk.estimate.total
    last = walk.plan.chunks[-1]
    saved = walk.estimate.graph - walk.graph_bytes(CHUNK, last.start)  # one chunk of taps only
    budgets = [
        walk.estimate.weights // 2,
        need - saved // 2,
        need - 1,
        need,
        need + 3 * MIB,
        2 * need,
        8 * need,
    ]
    return [(gb, b) for gb, b in enumerate(budgets, 1)]


@pytest.fixture(scope="module")
def verdicts(model, config, sizes):
    return macs.survey(model, WINDOW, config, macs=sizes, most=MOST)


def test_the_sizes_are_every_mac_at_macos_default_working_set():
    assert machine.MACS == (16, 24, 32, 36, 48, 64, 96, 128)
    gib = 1 << 30
    assert machine.working_set(36) == 24 * gib and machine.working_set(48) == 36 * gib
    assert machine.working_set(16) == int(16 * gib * 2 / 3)  # 10.7 GiB
    assert macs.sizes() == [(gb, machine.working_set(gb)) for gb in machine.MACS]
    shown = [b / gib for _, b in macs.sizes()]
    assert [f"{x:.1f}" for x in shown] == "10.7 16.0 21.3 24.0 36.0 48.0 72.0 96.0".split()
    # docs/MAC.md's script reads the same definitions
    spec = importlib.util.spec_from_file_location("mac_table", ROOT / "scripts" / "mac-table.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.MACS is machine.MACS and script.working_set is machine.working_set


def test_the_table_shows_every_mac_with_its_working_set(verdicts):
    table = [macs.Verdict(gb, b, macs.EXACT, None, MOST) for gb, b in macs.sizes()]
    lines = macs_table(table, WINDOW, MOST)
    rows = lines[1:9]
    for (gb, b), row in zip(macs.sizes(), rows):
        assert row.split()[:4] == [f"{gb}", "GB", f"{b / (1 << 30):.1f}", "GiB"], row
    assert "has 16 GB (10.7 GiB GPU working set)" in lines[9]
    assert "mlxwalk kernels" in lines[10] and "iogpu.wired_limit_mb" in lines[10]
    assert len(macs_table(verdicts, WINDOW, MOST)) == len(verdicts) + 4


def test_each_verdict_is_the_walks_own_admission_and_a_size_that_fits_implies_the_larger(
    model, config, graphs, sizes, verdicts
):
    said = [v.fits for v in verdicts]
    assert said == [
        macs.NO,
        macs.NARROWED,
        macs.NARROWED,
        macs.EXACT,
        macs.EXACT,
        macs.EXACT,
        macs.EXACT,
    ]
    for (gb, budget), v in zip(sizes, verdicts):
        assert (v.gb, v.budget) == (gb, budget)
        walk = direct(model, config, graphs, WINDOW, budget)
        if walk is None:
            assert v.fits == macs.NO
        else:
            assert v.fits == (macs.EXACT if walk.estimate.total <= budget else macs.NARROWED)
    first = said.index(macs.EXACT)
    assert all(f == macs.EXACT for f in said[first:])  # monotone in the budget
    # the smallest size reported is the smallest whose budget admits the window exactly
    smallest = next(gb for gb, b in sizes if exact(model, config, graphs, WINDOW, b))
    line = macs_table(verdicts, WINDOW, MOST)[len(verdicts) + 1]
    assert f"has {smallest} GB" in line and smallest == verdicts[first].gb
    largest = [v.largest for v in verdicts]
    assert largest == sorted(largest)


def test_the_narrowed_horizon_is_the_one_the_walk_trains_with(model, config, sizes, verdicts):
    v = verdicts[1]
    assert v.fits == macs.NARROWED and v.horizon is not None
    ids = np.random.default_rng(0).integers(0, 256, WINDOW + 1)
    window = Window.of(ids[:-1], ids[1:], np.ones(WINDOW))
    walk = ExactWalk(model, window, replace(config, memory_budget_mib=v.budget / MIB))
    loss, _ = walk.run()
    assert np.isfinite(loss.item())
    assert walk.horizon_used == v.horizon < WINDOW - CHUNK


def test_the_longest_exact_window_holds_and_one_chunk_more_does_not(
    model, config, graphs, verdicts
):
    assert verdicts[0].largest == 0 and not exact(model, config, graphs, CHUNK, verdicts[0].budget)
    assert verdicts[1].largest < WINDOW <= verdicts[3].largest < verdicts[-1].largest < MOST
    for v in verdicts[1:]:
        assert v.largest % CHUNK == 0 and v.largest > 0
        assert exact(model, config, graphs, v.largest, v.budget), v
        assert not exact(model, config, graphs, v.largest + CHUNK, v.budget), v


def test_the_search_stops_at_the_models_maximum():
    assert macs.largest(lambda w: True, CHUNK, 1000) == 896  # whole chunks up to the maximum
    assert macs.largest(lambda w: w <= 640, CHUNK, MOST) == 640
    assert macs.largest(lambda w: False, CHUNK, MOST) == 0


def run(*args):
    return subprocess.run(
        [sys.executable, "-m", "mlxwalk", "plan", *args], capture_output=True, text=True, cwd=ROOT
    )


def test_macs_with_a_memory_budget_is_one_line_and_exit_2():
    p = run("--window", "512", "--macs", "--memory-budget-mib", "100")
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr
    assert "--macs" in p.stderr and "--memory-budget-mib" in p.stderr


def test_the_torch_plan_refuses_macs_by_name():
    p = run("--window", "512", "--macs", "--backend", "torch")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr
    assert "--macs" in p.stderr and "torch" in p.stderr


def test_the_command_prints_the_table(model, config):
    lines = []
    assert report_macs(model, "tiny-qwen2", WINDOW, config, MOST, echo=lines.append)
    head = next(i for i, line in enumerate(lines) if line.startswith("Mac memory"))
    rows = lines[head + 1 : head + 9]
    assert [line.split()[0] for line in rows] == [str(gb) for gb in machine.MACS]
    assert all(
        "trains exactly" in line and "131,072 (the model's maximum)" in line for line in rows
    )
    assert "smallest Mac that trains a window of 512 exactly has 16 GB" in lines[head + 9]


def test_graphs_are_measured_once_and_reused(model, config, monkeypatch):
    calls = []
    measured = admission.probe

    def counted(*a, **k):
        calls.append(a[3] if len(a) > 3 else k.get("reach"))
        return measured(*a, **k)

    monkeypatch.setattr(admission, "probe", counted)
    made = macs.survey(model, WINDOW, config, macs=[(1, 1 << 30), (2, 1 << 31)], most=4096)
    assert [v.largest for v in made] == [4096, 4096]
    assert len(calls) == 1 and calls[0] == WINDOW - CHUNK  # the asked window's reach, once
