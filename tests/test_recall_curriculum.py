"""scripts/recall-curriculum.py in seconds: the driver's schedule followed by every trainer, a
stage the driver does not pass ending the schedule, and a run stopped and resumed giving the
numbers of one never stopped."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the benchmark script end to end: `python -m pytest -m slow`

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "recall-curriculum.py"


def curriculum(out: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(SCRIPT), "--quick", "--out", str(out), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def scores(out: Path) -> dict:
    runs = json.loads((out / "curriculum.json").read_text())["runs"]
    return {
        key: [(s["window"], s["epochs"], s["accuracy"], s["loss"]) for s in run["stages"]]
        for key, run in runs.items()
    }


def test_every_trainer_follows_the_drivers_schedule(tmp_path):
    done = curriculum(tmp_path, "--max-epochs", "2", "--advance", "1.01")
    assert done.returncode == 0, done.stderr[-2000:]
    got = scores(tmp_path)
    # the driver never reaches 1.01: it gives the first stage its 2 epochs and stops there
    assert [(w, e) for w, e, *_ in got["one-graph/0"]] == [(128, 2)]
    for trainer in ("exact", "plain"):
        assert [(w, e) for w, e, *_ in got[f"{trainer}/0"]] == [(128, 2)]
    assert "one-graph/0: did not reach 1.01 at 128" in done.stdout
    assert "| 128 | 4 | exact | 1 | 2.0 |" in done.stdout


def test_a_stopped_run_resumes_to_the_same_numbers(tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    quick = ("--advance", "0", "--max-epochs", "1")  # each stage passed in one epoch
    assert curriculum(whole, *quick).returncode == 0
    stopped = curriculum(parts, *quick, "--stop-after", "3")
    assert stopped.returncode == 3 and "--resume continues" in stopped.stdout
    assert not (parts / "curriculum.json").exists()
    resumed = curriculum(parts, *quick, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "one-graph seed 0 window 128" not in resumed.stdout  # done before the stop
    want, got = scores(whole), scores(parts)
    assert want.keys() == got.keys()
    for key in want:
        for (w0, e0, a0, l0), (w1, e1, a1, l1) in zip(want[key], got[key], strict=True):
            assert (w0, e0, a0) == (w1, e1, a1) and abs(l0 - l1) <= 1e-6 * abs(l0), key


def test_seeds_run_side_by_side_give_the_table_of_one_run(tmp_path):
    together, apart = tmp_path / "together", tmp_path / "apart"
    quick = ("--advance", "0", "--max-epochs", "1", "--seeds", "2")
    assert curriculum(together, *quick).returncode == 0
    for seed in ("1", "0"):  # either order: each seed's state is its own
        alone = curriculum(apart, *quick, "--seed", seed)
        assert alone.returncode == 0, alone.stderr[-2000:]
        assert f"one-graph seed {1 - int(seed)} " not in alone.stdout
        assert (apart / f"curriculum-seed{seed}.json").exists()
    table = curriculum(apart, *quick, "--resume")
    assert table.returncode == 0 and " epoch " not in table.stdout  # nothing left to train
    assert scores(together) == scores(apart)
    assert "| 2 | 1.0 |" in table.stdout  # two seeds a row


def test_parallel_seeds_give_the_table_of_one_run(tmp_path):
    together, apart = tmp_path / "together", tmp_path / "apart"
    quick = ("--advance", "0", "--max-epochs", "1", "--seeds", "2")
    one = curriculum(together, *quick)
    both = curriculum(apart, *quick, "--parallel")
    assert both.returncode == 0, both.stdout[-2000:] + both.stderr[-2000:]
    # each seed's driver in its own process, then each follower in its own, on its schedule
    assert "one-graph seed 1 window 256" in (apart / "seed1-one-graph.log").read_text()
    follower = (apart / "seed1-plain.log").read_text()
    assert "plain seed 1 window 256" in follower and "one-graph seed" not in follower
    assert scores(together) == scores(apart)

    def rows(out: str) -> list[list[str]]:  # up to the answer loss: seconds differ
        table = [line for line in out.splitlines() if line[:3].strip("| ").isdigit()]
        return [line.split("|")[1:10] for line in table]

    assert rows(both.stdout) == rows(one.stdout) and len(rows(one.stdout)) == 6


def test_a_time_limit_stops_before_a_window_and_resumes(tmp_path):
    quick = ("--advance", "0", "--max-epochs", "1")
    stopped = curriculum(tmp_path, *quick, "--stop-after-s", "0")
    assert stopped.returncode == 3 and "--resume continues" in stopped.stdout
    assert " epoch " not in stopped.stdout  # none started past the limit
    resumed = curriculum(tmp_path, *quick, "--resume", "--stop-after-s", "600")
    assert resumed.returncode == 0 and "one-graph seed 0 window 256 epoch 1" in resumed.stdout


def load_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("curriculum", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_a_resumed_trainer_predicts_its_next_window_from_its_saved_epoch():
    import types

    script = load_script()
    budget = script.Budget(None, 10.0)
    a = types.SimpleNamespace(stages=[128, 256], trains={128: 10, 256: 10})
    saved = {"epochs": [], "stages": [{"window": 128, "per_epoch": [{"seconds": 60.0}]}]}
    assert budget.allows("exact/0", 256)  # nothing known: it starts
    budget.resumed("exact/0", saved, a)  # 6 s a window of 128, with the margin 9 s
    assert not budget.allows("exact/0", 256)  # 18 s > 10 s left
    assert budget.allows("exact/0", 128)


def test_a_run_stopped_inside_an_epoch_resumes_to_the_same_numbers(tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    quick = ("--advance", "0", "--max-epochs", "1")
    assert curriculum(whole, *quick).returncode == 0
    stopped = curriculum(parts, *quick, "--stop-after-windows", "4")  # 6 windows an epoch
    assert stopped.returncode == 3 and " epoch " not in stopped.stdout
    shown = curriculum(parts, *quick, "--table")
    assert "one-graph/0: not finished, at 128 after 0 epochs and 4 windows of the next" in (
        shown.stdout
    )
    again = curriculum(parts, *quick, "--resume", "--stop-after-windows", "5")
    assert again.returncode == 3 and "one-graph seed 0 window 128 epoch 1" in again.stdout
    resumed = curriculum(parts, *quick, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    want, got = scores(whole), scores(parts)
    assert want.keys() == got.keys()
    for key in want:  # a window trained twice or skipped would move every later number
        for (w0, e0, a0, l0), (w1, e1, a1, l1) in zip(want[key], got[key], strict=True):
            assert (w0, e0, a0) == (w1, e1, a1) and abs(l0 - l1) <= 1e-6 * abs(l0), key


def test_a_run_sent_sigterm_saves_its_epoch_part_way(tmp_path):
    import signal
    import time

    small = ["--stages", "128", "--chunk", "32", "--train", "2000", "--valid", "4"]
    small += ["--width", "32", "--layers", "1", "--trainers", "one-graph", "--seeds", "1"]
    cmd = [sys.executable, str(SCRIPT), *small, "--out", str(tmp_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout.readline().startswith("training;")  # the handler is in place
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 3 and "every state saved" in out, out[-2000:]
    progress = json.loads((tmp_path / "state" / "one-graph-seed0" / "progress.json").read_text())
    assert 0 < progress["partial"]["windows"] < 2000 and not progress["epochs"]


def test_a_driver_given_more_epochs_trains_its_last_stage_on(tmp_path):
    once, twice = tmp_path / "once", tmp_path / "twice"
    never = ("--advance", "1.01")  # the driver never passes: it ends at the first stage
    assert curriculum(twice, *never, "--max-epochs", "2").returncode == 0
    assert curriculum(once, *never, "--max-epochs", "1").returncode == 0
    more = curriculum(once, *never, "--max-epochs", "2", "--resume")
    assert more.returncode == 0, more.stderr[-2000:]
    for trainer in ("one-graph", "exact", "plain"):  # the followers too: owed the driver's epoch
        assert f"{trainer} seed 0 window 128 epoch 2" in more.stdout
        assert f"{trainer} seed 0 window 128 epoch 1" not in more.stdout
    assert scores(once) == scores(twice)
    again = curriculum(once, *never, "--max-epochs", "2", "--resume")
    assert again.returncode == 0 and " epoch " not in again.stdout  # nothing more owed


def test_the_table_of_a_stopped_run_says_where_each_trainer_stands(tmp_path):
    quick = ("--advance", "0", "--max-epochs", "1")
    assert curriculum(tmp_path, *quick, "--stop-after", "3").returncode == 3
    shown = curriculum(tmp_path, *quick, "--table")
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert " epoch " not in shown.stdout  # nothing trained
    assert "| 128 | 4 | one-graph | 1 | 1.0 |" in shown.stdout
    assert "| 128 | 4 | exact | 1 | 1.0 |" in shown.stdout  # the third epoch: exact at 128
    assert "| plain |" not in shown.stdout  # not started
    assert "exact/0: not finished, at 256 after 0 epochs there" in shown.stdout
    assert "one-graph/0" not in shown.stdout  # finished without a note


def test_the_figure_notes_each_early_ending_once_with_its_seeds():
    over = "over the cap at 8192: 2581 MiB"
    runs = {
        "one-graph/0": {"ended": over},
        "one-graph/2": {"ended": over},
        "exact/0": {"ended": None},
        "exact/1": {"ended": "did not reach 0.9 at 8192"},
    }
    assert load_script().endings(runs) == [
        f"one-graph: {over} (seeds 0, 2)",
        "exact: did not reach 0.9 at 8192 (seeds 1)",
    ]


def test_a_finished_run_goes_on_to_added_stages_with_the_exact_walk_driving(tmp_path):
    small = ["--chunk", "32", "--train", "6", "--valid", "6", "--width", "32", "--layers", "1"]
    small += ["--warmup", "2", "--seeds", "1", "--advance", "0", "--max-epochs", "1"]
    small += ["--trainers", "one-graph,exact", "--out", str(tmp_path)]

    def run(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, str(SCRIPT), *small, *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    assert run("--stages", "128").returncode == 0
    longer = run("--stages", "128", "256", "--driver", "exact", "--resume", "--cap-gib", "0.002")
    assert longer.returncode == 0, longer.stderr[-2000:]
    assert "exact seed 0 window 256 epoch 1" in longer.stdout  # the added stage, trained
    assert "window 128 epoch" not in longer.stdout  # the first, not again
    assert "one-graph/0: over the cap at 256" in longer.stdout  # one graph's step: over 2 MiB
    # a trainer that now drives is held to --advance at the stage it last trained
    assert run("--stages", "128", "256", "--resume").returncode == 0
    held = run(
        "--stages", "128", "256", "512", "--driver", "exact", "--resume", "--advance", "1.01"
    )
    assert held.returncode == 0, held.stderr[-2000:]
    assert " epoch " not in held.stdout and "exact/0: did not reach 1.01 at 256" in held.stdout


def test_a_fresh_parallel_run_resumes_no_earlier_state(tmp_path):
    quick = ("--advance", "0", "--max-epochs", "1", "--seeds", "1", "--parallel")
    assert curriculum(tmp_path, *quick).returncode == 0
    again = curriculum(tmp_path, *quick, "--lr", "3e-3")
    assert again.returncode == 0, again.stdout[-2000:]
    log = (tmp_path / "seed0-plain.log").read_text()  # appended to by each call
    assert log.count("plain seed 0 window 128 epoch 1") == 2  # trained again, not restored
    settings = json.loads((tmp_path / "curriculum.json").read_text())["settings"]
    assert settings["lr"] == 3e-3 and not list(tmp_path.glob("curriculum-seed*.json"))


def test_the_gradient_check_reads_a_saved_model(tmp_path):
    assert curriculum(tmp_path, "--advance", "0", "--max-epochs", "1").returncode == 0
    check = SCRIPT.parent / "recall-gradient.py"
    cmd = [sys.executable, str(check), "--out", str(tmp_path), "--trainer", "exact"]
    done = subprocess.run([*cmd, "--window", "256"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "in chunks of 32 (8 chunks)" in done.stdout  # the run's chunk and model, not flags'
    (tmp_path / "curriculum.json").unlink()
    lost = subprocess.run([*cmd, "--window", "256"], capture_output=True, text=True, timeout=120)
    assert (
        lost.returncode == 2 and lost.stderr.count("\n") == 1 and "curriculum JSON" in lost.stderr
    )
    worst = float(done.stdout.split("worst exact rel L2: ")[1])
    plain = [float(x.split()[0]) for x in done.stdout.split("plain rel L2 ")[1:]]
    assert worst < 1e-5 and min(plain) > 1e-2  # exact to rounding; the cut gradient is not
