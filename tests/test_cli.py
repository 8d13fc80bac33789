"""The command line: exit codes, JSON, and one-line errors."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(*args):
    return subprocess.run(
        [sys.executable, "-m", "mlxwalk", *args], capture_output=True, text=True, cwd=ROOT
    )


def test_test_walk_exact_json_on_a_model_folder():
    from mlxwalk import grading, tiny

    folder = str(tiny.path("tiny-llama"))  # the smallest attention model: the script's rows
    p = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "test-walk-exact.py"), "-m", folder, "--json"],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["ok"] and len(out["rows"]) == 17
    rows = {r["row"] for r in out["rows"]}
    assert rows == {
        "(1)",
        "(1a)",
        "(1b)",
        "(1c)",
        "(1d)",
        "(2)",
        "(3)",
        "(7)",
        "(7b)",
        "(8)",
        "(8b)",
        "(9)",
    }
    assert all(
        r["rel_l2"] <= 2e-5 for r in out["rows"] if r["bar"] == grading.EXACT and not r["detail"]
    )
    (sliced,) = [r for r in out["rows"] if r["row"] == "(1d)"]  # a tied head
    assert sliced["detail"] == "not offered: a tied or unquantized head"


def test_a_missing_model_is_one_line_and_exit_2(tmp_path):
    p = run("test-walk-exact", "-m", str(tmp_path / "nowhere"))
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr
    assert "nowhere" in p.stderr


def test_plan_prints_the_estimate_and_exits_1_when_it_does_not_fit():
    ok = run("plan", "--window", "1024", "--chunk", "256")
    assert ok.returncode == 0 and "verdict: fits" in ok.stdout and "K/V store" in ok.stdout
    no = run("plan", "--window", "1024", "--chunk", "256", "--memory-budget-mib", "12")
    assert no.returncode == 1 and "device memory" in no.stdout and "budget is 12.0 MiB" in no.stdout
    assert "a shorter window" in no.stdout  # what the walk can change
    weights = run("plan", "--window", "1024", "--chunk", "256", "--memory-budget-mib", "1")
    assert weights.returncode == 1 and "alone exceed the memory budget of 1.0 MiB" in weights.stdout
    assert "a shorter window" not in weights.stdout  # nothing the walk can change would fit
    host = run("plan", "--window", "1024", "--chunk", "256", "--host-budget-mib", "0.5")
    assert host.returncode == 1 and "host memory" in host.stdout


def test_test_walk_exact_says_when_float32_products_may_run_in_tf32(monkeypatch):
    import mlx.core as mx

    from mlxwalk.commands import walk_exact as exactness

    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.delenv("MLX_ENABLE_TF32", raising=False)
    assert "MLX_ENABLE_TF32=0" in exactness.kernels_line()
    monkeypatch.setenv("MLX_ENABLE_TF32", "0")
    assert "TF32" not in exactness.kernels_line()
    monkeypatch.setattr(mx.cuda, "is_available", lambda: False)
    monkeypatch.delenv("MLX_ENABLE_TF32")
    assert "TF32" not in exactness.kernels_line()
