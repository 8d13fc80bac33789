"""scripts/recall-preference.py in seconds: the recall conversations as DPO pairs, every trainer
on the curriculum's schedule, the JSON and table it writes, and a run stopped part-way and
resumed giving the numbers of one never stopped."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # the benchmark script end to end: `python -m pytest -m slow`

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "recall-preference.py"
QUICK = ("--advance", "0", "--max-epochs", "1")  # each stage passed in one epoch


def preference(out: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(SCRIPT), "--quick", "--out", str(out), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def scores(out: Path) -> dict:
    """Per trainer and seed, each epoch's held-out numbers and training loss, stage by stage."""
    runs = json.loads((out / "preference.json").read_text())["runs"]
    keys = ("epoch", "accuracy", "recall", "margin", "dpo_loss", "loss", "train_loss")
    return {
        key: [(s["window"], *(e[k] for k in keys)) for s in run["stages"] for e in s["per_epoch"]]
        for key, run in runs.items()
    }


def load_script():
    sys.path.insert(0, str(SCRIPT.parent))  # as the script sees it: lib/ beside it
    spec = importlib.util.spec_from_file_location("recall_preference", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_a_pair_differs_from_its_conversation_in_the_answer_alone():
    script = load_script()
    from lib import recall

    data = recall.dataset(0, 300, 128, 32)
    rejected = []
    for i in range(len(data["inputs"])):
        window = script.bench.window_of(data, i)
        pair = script.pair_of(window)
        assert pair.chosen is window
        for k in ("inputs", "weights"):
            assert np.array_equal(getattr(pair.rejected, k), getattr(window, k))
        assert np.array_equal(pair.rejected.targets[:-1], window.targets[:-1])
        chosen, other = chr(window.targets[-1]), chr(pair.rejected.targets[-1])
        assert chosen == recall.CODES[data["codes"][i]] and other in recall.CODES
        assert other != chosen
        assert script.pair_of(window).rejected.targets[-1] == pair.rejected.targets[-1]
        rejected.append(other)
    # drawn from the tokens, not one fixed offset: every other code turns up
    offsets = {
        (recall.CODES.index(o) - c) % len(recall.CODES) for o, c in zip(rejected, data["codes"])
    }
    assert offsets == set(range(1, len(recall.CODES)))


def test_a_group_holds_the_true_code_against_each_other_one():
    script = load_script()
    from lib import recall

    data = recall.dataset(1, 20, 128, 32)
    for i in range(len(data["inputs"])):
        window = script.bench.window_of(data, i)
        group = script.group_of(window)
        assert np.array_equal(group.inputs, window.inputs)
        assert group.targets.shape == (len(window), len(recall.CODES))
        assert np.array_equal(group.targets[:-1], np.repeat(window.targets[:-1, None], 16, 1))
        assert group.targets[-1, 0] == window.targets[-1]  # column 0: the true code
        assert sorted(map(chr, group.targets[-1])) == sorted(recall.CODES)  # each code once
        assert np.array_equal(group.weights, np.repeat(window.weights[:, None], 16, 1))


def test_the_quick_run_of_groups_takes_one_graphs_gradient_on_the_walk(tmp_path):
    done = preference(tmp_path, *QUICK, "--rejected", "all")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "rejected: all" in done.stdout
    runs = json.loads((tmp_path / "preference.json").read_text())["runs"]
    first = {k: runs[f"{k}/0"]["stages"][0]["per_epoch"][0]["loss"] for k in runs_of(runs)}
    assert abs(first["exact"] - first["one-graph"]) < 1e-4 < abs(first["plain"] - first["exact"])


def runs_of(runs: dict) -> list[str]:
    return [key.split("/")[0] for key in runs]


def test_the_table_shows_the_stage_under_way_when_asked(tmp_path):
    run = ("--advance", "1.1", "--max-epochs", "2", "--trainers", "exact", "--driver", "exact")
    stopped = preference(tmp_path, *run, "--stop-after-windows", "8")  # epoch 1 of 2, and 2 pairs
    assert stopped.returncode != 0 and "--resume continues" in stopped.stdout
    plain = preference(tmp_path, *run, "--table")
    assert "| 128 |" not in plain.stdout
    shown = preference(tmp_path, *run, "--table", "--under-way")
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "| 128 | 4 | exact | 1 | 1.0 |" in shown.stdout, shown.stdout
    saved = json.loads((tmp_path / "preference.json").read_text())
    assert "under_way" not in saved["settings"]


def test_the_quick_run_writes_its_table_and_json(tmp_path):
    done = preference(tmp_path, *QUICK, "--plot", str(tmp_path / "p.png"))
    assert done.returncode == 0, done.stderr[-2000:]
    saved = json.loads((tmp_path / "preference.json").read_text())
    assert set(saved["runs"]) == {"one-graph/0", "exact/0", "plain/0"}
    for run in saved["runs"].values():
        assert [(s["window"], s["epochs"]) for s in run["stages"]] == [(128, 1), (256, 1)]
        for e in (s["per_epoch"][-1] for s in run["stages"]):
            assert 0 <= e["accuracy"] <= 1 and 0 <= e["recall"] <= 1
            assert e["dpo_loss"] > 0 and np.isfinite(e["margin"])
    assert [(r["window"], r["trainer"]) for r in saved["summary"]] == [
        (w, t) for w in (128, 256) for t in ("one-graph", "exact", "plain")
    ]
    assert saved["settings"]["beta"] == 0.1 and "resume" not in saved["settings"]
    assert "| window | chunks | trainer | seeds | epochs | preference |" in done.stdout
    assert "| 256 | 8 | exact | 1 | 1.0 |" in done.stdout
    assert (tmp_path / "p.png").stat().st_size > 10_000
    # the exact walk takes one graph's gradient to rounding; the plain walk another
    runs = saved["runs"]
    first = {k: runs[f"{k}/0"]["stages"][0]["per_epoch"][0]["loss"] for k in ("one-graph", "exact")}
    plain = runs["plain/0"]["stages"][0]["per_epoch"][0]["loss"]
    assert abs(first["exact"] - first["one-graph"]) < 1e-4 < abs(plain - first["one-graph"])


def test_a_stopped_run_resumes_to_the_same_numbers(tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert preference(whole, *QUICK).returncode == 0
    stopped = preference(parts, *QUICK, "--stop-after-windows", "10")  # 6 pairs an epoch
    assert stopped.returncode == 3 and "--resume continues" in stopped.stdout
    assert not (parts / "preference.json").exists()
    shown = preference(parts, *QUICK, "--table")
    assert "one-graph/0: not finished, at 256 after 0 epochs and 4 pairs of the next" in (
        shown.stdout
    )
    resumed = preference(parts, *QUICK, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "one-graph seed 0 window 128" not in resumed.stdout  # done before the stop
    want, got = scores(whole), scores(parts)
    assert want.keys() == got.keys()
    for key in want:  # a pair trained twice or skipped would move every later number
        for a, b in zip(want[key], got[key], strict=True):
            assert np.allclose(a, b, rtol=1e-6, atol=1e-9), key


def test_parallel_runs_this_script_and_gives_the_table_of_one_run(tmp_path):
    together, apart = tmp_path / "together", tmp_path / "apart"
    both = (*QUICK, "--seeds", "1", "--trainers", "exact,plain", "--driver", "exact")
    assert preference(together, *both).returncode == 0
    side = preference(apart, *both, "--parallel")
    assert side.returncode == 0, side.stdout[-2000:] + side.stderr[-2000:]
    log = (apart / "seed0-plain.log").read_text()
    assert "plain seed 0 window 256" in log and "exact seed" not in log
    assert scores(together) == scores(apart)


def test_a_fixed_schedule_with_chunks_and_pairs_per_stage_runs_every_trainer_at_once(tmp_path):
    together, apart = tmp_path / "together", tmp_path / "apart"
    fixed = ("--seeds", "1", "--trainers", "exact,plain", "--epochs", "2", "1")
    per_stage = ("--chunk", "32", "64", "--train", "6", "4")
    # --quick sets one chunk and six pairs: the per-stage values given after it would be lost
    script = [sys.executable, str(SCRIPT), "--width", "32", "--layers", "1", "--warmup", "2"]
    small = (*script, "--stages", "128", "256", "--valid", "6", *fixed, *per_stage)
    run = lambda out, *more: subprocess.run(  # noqa: E731
        [*small, "--out", str(out), *more], capture_output=True, text=True, timeout=300
    )
    done = run(together)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "chunk 32/64, a fixed schedule of [2, 1] epochs" in done.stdout
    assert "| 128 | 4 | exact | 1 | 2.0 |" in done.stdout  # chunk 32: 4 chunks
    assert "| 256 | 4 | plain | 1 | 1.0 |" in done.stdout  # chunk 64: 4 chunks
    side = run(apart, "--parallel")
    assert side.returncode == 0, side.stdout[-2000:] + side.stderr[-2000:]
    exact_log = (apart / "seed0-exact.log").read_text()
    assert "exact seed 0 window 256" in exact_log and "plain seed" not in exact_log
    assert scores(together) == scores(apart)
    runs = json.loads((together / "preference.json").read_text())["runs"]
    for run_ in runs.values():  # the pairs per stage: 6 at 128, 4 at 256
        assert [
            round(e["seconds"] / e["s_per_window"]) for s in run_["stages"] for e in s["per_epoch"]
        ] == [6, 6, 4]


def test_per_stage_values_must_match_the_stages(tmp_path):
    def asked(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, str(SCRIPT), "--out", str(tmp_path), *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    bad = asked("--stages", "128", "256", "--chunk", "32", "64", "128")
    assert bad.returncode == 2
    assert "--chunk: give one value or one per stage (2), not 3" in bad.stderr
    bad = asked("--epochs", "0")
    assert bad.returncode == 2 and "--epochs: every value must be positive" in bad.stderr
    bad = asked("--stages", "128", "256", "--chunk", "32", "96")
    assert bad.returncode == 2 and "window 256 is not a multiple of its --chunk (96)" in bad.stderr
    assert not any(tmp_path.iterdir())  # refused before anything was written
