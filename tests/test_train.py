"""mlxwalk train end to end: a run, its report, its adapter through mlx-lm, resume after SIGKILL,
and every bad input refused in one line."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest

from mlxwalk.training.run import TrainConfig, train_run

ROOT = Path(__file__).resolve().parent.parent


def chat(i, turns=3):
    msgs = [{"role": "system", "content": "You are Wren."}]
    for t in range(turns):
        msgs.append({"role": "user", "content": f"Question {i}.{t} about tides?"})
        msgs.append({"role": "assistant", "content": f"Wren here. Tides {i} rise and fall."})
    return {"messages": msgs}


@pytest.fixture
def data_dir(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    (d / "train.jsonl").write_text("".join(json.dumps(chat(i)) + "\n" for i in range(4)))
    (d / "valid.jsonl").write_text("".join(json.dumps(chat(i)) + "\n" for i in range(4, 6)))
    return d


def cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "mlxwalk", "train", "--no-progress", *args],
        capture_output=True,
        text=True,
        cwd=cwd or ROOT,
    )


def test_a_run_trains_reports_and_its_adapter_loads_in_mlx_lm(qwen2_path, data_dir, tmp_path):
    out = tmp_path / "run"
    lines = []
    cfg = TrainConfig(
        model=qwen2_path,
        data=str(data_dir),
        chunk=128,
        epochs=2,
        lr=2e-3,
        adapter_path=str(out),
        progress=False,
    )
    summary = train_run(cfg, echo=lines.append)
    report = json.loads((out / "report.json").read_text())
    assert report == json.loads(json.dumps(summary))
    for key in (
        "window",
        "window_asked",
        "chunk",
        "walk",
        "horizon_used",
        "host_mib",
        "graph_mib",
        "examples",
        "examples_skipped",
        "examples_truncated",
        "trainable_tokens",
    ):
        assert key in report
    epochs = report["epochs"]
    assert [e["epoch"] for e in epochs] == [1, 2]
    assert epochs[1]["eval_loss"] < epochs[0]["eval_loss"]
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert any("| epoch | train_loss | eval_loss" in line for line in lines)

    base, tok = mlx_lm.load(qwen2_path)
    tuned, _ = mlx_lm.load(qwen2_path, adapter_path=str(out))
    x = mx.array(tok.encode("Question 9.1 about tides?"))[None]
    assert mx.abs(tuned(x) - base(x)).max().item() > 1e-3
    text = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_lm",
            "generate",
            "--model",
            qwen2_path,
            "--adapter-path",
            str(out),
            "--prompt",
            "hi",
            "--max-tokens",
            "4",
        ],
        capture_output=True,
        text=True,
    )
    assert text.returncode == 0, text.stderr


def test_a_run_killed_mid_window_resumes_and_loses_at_most_that_window(qwen2_path, tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    (d / "train.jsonl").write_text("".join(json.dumps(chat(i, 6)) + "\n" for i in range(8)))
    out = tmp_path / "run"
    args = [
        "--model",
        qwen2_path,
        "--data",
        str(d),
        "--chunk",
        "64",
        "--epochs",
        "1",
        "--save-every",
        "1",
        "--adapter-path",
        str(out),
        "--val-split",
        "0",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxwalk", "train", "--no-progress", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    deadline = time.time() + 120
    while not (out / "checkpoints" / "window-0000003").exists():
        assert time.time() < deadline and proc.poll() is None, "no checkpoint appeared"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    kept = sorted(p.name for p in (out / "checkpoints").glob("window-*"))
    done = int(kept[-1].split("-")[1])
    assert done >= 3
    resumed = cli(*args, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert f"window {done}" in resumed.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["windows"] == 8
    assert len(report["epochs"]) == 1


def write(d, name, text):
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text(text)
    return d


@pytest.mark.parametrize(
    "setup, args, message",
    [
        (lambda t: None, ["--data", "{t}/nowhere"], "data folder {t}/nowhere does not exist"),
        (
            lambda t: write(t / "d", "train.jsonl", '{"text": "ok"}\n{"text": \n'),
            ["--data", "{t}/d"],
            "{t}/d/train.jsonl:2: not valid JSON",
        ),
        (
            lambda t: write(t, "c.yaml", "epochs: 1\nlearning_rat: 3\n"),
            ["-c", "{t}/c.yaml"],
            "unknown key 'learning_rat'",
        ),
        (lambda t: write(t, "f", "x"), ["--adapter-path", "{t}/f/run"], "is not writable"),
        (lambda t: None, ["--window", "1000000"], "exceeds the model's maximum positions"),
        (lambda t: None, ["--walk", "sideways"], "walk 'sideways' cannot train"),
        (
            lambda t: write(t / "d", "train.jsonl", '{"messages": "hi"}\n'),
            ["--data", "{t}/d"],
            "{t}/d/train.jsonl:1: 'messages' must be a list",
        ),
        (
            lambda t: write(t, "c.yaml", "chunk: 64k\n"),
            ["-c", "{t}/c.yaml"],
            "chunk must be an integer, got '64k'",
        ),
        (lambda t: None, ["--recompute", "--dropout", "0.1"], "recompute with LoRA dropout"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, setup, args, message):
    setup(tmp_path)
    args = [a.format(t=tmp_path) for a in args]
    if "--adapter-path" not in args:
        args += ["--adapter-path", str(tmp_path / "out")]
    p = cli(*args)
    assert p.returncode == 2, p.stderr
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    assert message.format(t=tmp_path) in p.stderr
    assert not (tmp_path / "out").exists()


def test_unlabelled_and_overlong_examples_are_skipped_and_cut(qwen2_path, tmp_path):
    rows = [
        chat(0),
        {"messages": [{"role": "user", "content": "only a question"}]},
        {"text": "x" * 900},
        chat(1),
    ]
    d = write(tmp_path / "d", "train.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    cfg = TrainConfig(
        model=qwen2_path,
        data=str(d),
        window=512,
        chunk=128,
        epochs=1,
        adapter_path=str(tmp_path / "o"),
        val_split=0,
        progress=False,
    )
    report = train_run(cfg, echo=lambda s: None)
    assert report["examples_skipped"] == 1 and report["examples_truncated"] == 1
    assert report["examples"] == 3 and report["window"] == 512


def test_an_unsupported_architecture_is_named_with_the_supported_list(tmp_path):
    from mlxwalk import tiny

    spec = tiny.TinySpec(
        "tiny-gemma",
        {**tiny.MODELS["tiny-qwen2"].config, "model_type": "gemma", "head_dim": 64},
        seed=1,
    )
    folder = tiny.write(spec, tmp_path / "gemma")
    p = cli("--model", str(folder), "--adapter-path", str(tmp_path / "out"))
    assert p.returncode == 2 and "model type 'gemma' is not supported" in p.stderr
    assert "qwen3_5" in p.stderr and not (tmp_path / "out").exists()
