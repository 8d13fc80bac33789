"""Preference training end to end (`mlxwalk train --objective dpo|simpo`, the mlx-lm drop-in):
the report and its plot, the reference decoded once per pair, the refusals, and the loop's steps
against the one-graph definition of the pair's loss."""

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from mlxwalk.grading import BARS, EXACT, compare
from mlxwalk.preference import dpo
from mlxwalk.preference.objective import DPO, METRICS, SimPO
from mlxwalk.training import adapters, models
from mlxwalk.training.files import load_safetensors
from mlxwalk.training.run import TrainConfig, train_run
from mlxwalk.walk import Window

from .extras import torch

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "mlxwalk" / "data" / "preference"  # 16 training and 4 validation pairs
# Each answer keeps the conversation's start (the locker code) and its end (the question and the
# 34-token answer): two chunks, so the walk carries the first chunk's K/V to the second.
SMALL = ["--window", "64", "--fit", "middle", "--chunk", "32", "--num-layers", "2"]


def rows(split: str, n: int) -> list[str]:
    return (SAMPLE / f"{split}.jsonl").read_text().splitlines(keepends=True)[:n]


@pytest.fixture
def few(tmp_path) -> Path:
    """The bundled sample's first 3 training pairs and first validation pair."""
    d = tmp_path / "few"
    d.mkdir()
    (d / "train.jsonl").write_text("".join(rows("train", 3)))
    (d / "valid.jsonl").write_text("".join(rows("valid", 1)))
    return d


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "mlxwalk", "train", "--no-progress", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )


def test_a_dpo_run_reports_rewards_per_epoch_and_plots_them(few, tmp_path):
    out = tmp_path / "run"
    p = cli(
        "--objective",
        "dpo",
        "--data",
        str(few),
        "--epochs",
        "2",
        "--lr",
        "1e-3",
        *SMALL,
        "--adapter-path",
        str(out),
    )
    assert p.returncode == 0, p.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["objective"] == "dpo" and report["examples"] == 3
    assert [e["epoch"] for e in report["epochs"]] == [1, 2]
    for e in report["epochs"]:
        for side in ("metrics", "eval_metrics"):
            assert set(e[side]) == set(METRICS), (side, e)
            assert all(np.isfinite(v) for v in e[side].values())
            assert 0 <= e[side]["accuracies"] <= 1
            assert e[side]["margins"] == pytest.approx(
                e[side]["chosen_reward"] - e[side]["rejected_reward"], abs=2e-6
            )
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    head = "| epoch | train_loss | eval_loss | seconds | train_tok_s | chosen_r | rejected_r |"
    assert head in p.stdout and "epoch 2: train_loss" in p.stdout and "; eval chosen_r" in p.stdout


@pytest.mark.parametrize("objective", [DPO(beta=0.5), SimPO(beta=2.0, gamma=0.5)])
def test_the_reference_is_decoded_once_per_pair(few, tmp_path, qwen2_path, objective):
    cfg = TrainConfig(
        model=qwen2_path,
        data=str(few),
        objective=objective.name,
        epochs=2,
        window=64,
        fit="middle",
        chunk=32,
        num_layers=2,
        adapter_path=str(tmp_path / "run"),
        progress=False,
    )
    summary = train_run(cfg, echo=lambda s: None, objective=objective)
    assert summary["objective"] == objective.name and summary["windows"] == 6
    assert all(set(e["eval_metrics"]) == set(METRICS) for e in summary["epochs"])
    # 3 training pairs and 1 validation pair, each met twice (trained or evaluated per epoch):
    # DPO decodes each one's reference once; SimPO has none.
    assert objective.references == (4 if objective.name == "dpo" else 0)


def write(d: Path, name: str, text: str) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text(text)
    return d


@pytest.mark.parametrize(
    "data, args, message",
    [
        (lambda t: SAMPLE, [], "preference/train.jsonl:1: a preference pair ('chosen' and"),
        (lambda t: SAMPLE, ["--objective", "dpo", "--walk", "plain"], "dpo takes the exact walk"),
        (lambda t: SAMPLE, ["--objective", "dpo", "--beta", "0"], "--beta must be a positive"),
        (lambda t: SAMPLE, ["--objective", "dpo", "--beta", "-1"], "--beta must be a positive"),
        (lambda t: SAMPLE, ["--objective", "simpo", "--gamma", "-1"], "--gamma must be a finite"),
        (
            lambda t: write(t / "d", "train.jsonl", rows("train", 1)[0] + '{"text": "hi"}\n'),
            ["--objective", "dpo"],
            "{t}/d/train.jsonl:2: --objective dpo trains on preference pairs",
        ),
    ],
)
def test_refusals_are_one_line_exit_2_and_write_nothing(tmp_path, data, args, message):
    out = tmp_path / "out"
    p = cli("--data", str(data(tmp_path)), *args, "--adapter-path", str(out))
    assert p.returncode == 2, p.stderr
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    assert message.format(t=tmp_path) in p.stderr, p.stderr
    assert not out.exists()


@pytest.mark.parametrize("name", ["dpo", "simpo"])
def test_the_loops_steps_equal_the_one_graph_definition(tmp_path, qwen2_path, name):
    """Two SGD steps on one pair through the run (the second from a nonzero adapter and margin):
    each update is -lr x the pair's gradient by the walk (pair_gradient, simpo_gradient), which
    equals the definition's (one_graph_loss, one_graph_simpo: no walk, no signed weights). So the
    loop folds each window's gradient with its signed weight and the pair's rescale as they are
    meant (step.Walker), and rewards.py's weights are the loss's."""
    d = write(tmp_path / "one", "train.jsonl", rows("train", 1)[0])
    beta, gamma, lr = (0.5, 0.5, 1e-4) if name == "dpo" else (2.0, 0.5, 0.02)
    cfg = TrainConfig(
        model=qwen2_path,
        data=str(d),
        objective=name,
        beta=beta,
        gamma=gamma,
        optimizer="sgd",
        lr=lr,
        epochs=2,
        val_split=0.0,
        window=64,
        fit="middle",
        chunk=32,
        num_layers=2,
        adapter_path=str(tmp_path / "run"),
        progress=False,
    ).check()
    train_run(cfg, echo=lambda s: None)
    trained = load_safetensors(tmp_path / "run" / "adapters.safetensors")

    model, tokenizer = models.load(qwen2_path)
    mx.random.seed(cfg.seed)  # the run's adapter as it started (MLXFramework.adapt)
    adapters.apply(model, cfg.lora())
    start = tree_map(lambda a: a, model.trainable_parameters())
    objective = DPO(beta) if name == "dpo" else SimPO(beta=beta, gamma=gamma)
    (item,) = objective.load(d, "train", tokenizer, 64, "middle").examples
    pair = dpo.Pair(
        *(Window.of(s.inputs, s.targets, s.weights) for s in (item.chosen, item.rejected))
    )
    walk = cfg.walk_config()
    ref = dpo.reference_scores(model, pair, walk)

    def gradient(how: str):
        if name == "dpo" and how == "one":
            return None, dpo.one_graph_loss(model, pair, ref, beta)[1]
        if name == "dpo":
            return dpo.pair_gradient(model, pair, ref, beta, walk)
        if how == "one":
            return None, dpo.one_graph_simpo(model, pair, beta, gamma)[1]
        return dpo.simpo_gradient(model, pair, beta, gamma, walk)

    def two_steps(how: str) -> tuple[dict, list]:
        """The adapter's change over two SGD steps on `how`'s gradients, flat by name."""
        model.update(start)
        margins = []
        for _ in range(2):
            t, g = gradient(how)
            margins.append(t and t.margin)
            model.update(tree_map(lambda p, g: p - lr * g, model.trainable_parameters(), g))
        return moved(tree_flatten(model.trainable_parameters())), margins

    def moved(params) -> dict:
        was = dict(tree_flatten(start))
        return {k: np.array(v) - np.array(was[k]) for k, v in dict(params).items()}

    got = moved(trained)
    defined, _ = two_steps("one")
    walked, margins = two_steps("walk")
    assert set(got) == set(defined) == set(walked)
    assert BARS[EXACT](*compare(got, defined))  # the run's steps are the loss's (4.2e-6, 3.6e-6)
    cosine, error = compare(got, walked)
    assert error < 1e-6, (cosine, error)  # ... and the walk's to float32 rounding (6e-8, 3e-7)
    assert abs(margins[1] - margins[0]) > 0.3  # the second step's weight is not the first's


def test_the_drop_in_trains_pairs_and_reports_their_metrics(tmp_path, qwen2_path, capsys):
    from mlxwalk.dropin import lora

    heard = []

    class Heard:
        def on_train_loss_report(self, info):
            heard.append(info)

        def on_val_loss_report(self, info):
            heard.append(info)

    config = tmp_path / "dpo.yaml"
    config.write_text("objective: dpo\nbeta: 0.2\n")  # the YAML keys, as the flags'
    out = tmp_path / "adapter"
    argv = [
        "-c",
        str(config),
        "--model",
        qwen2_path,
        "--train",
        "--data",
        str(SAMPLE),
        "--iters",
        "2",
        "--steps-per-report",
        "1",
        "--val-batches",
        "1",
        "--max-seq-length",
        "64",
        "--chunk",
        "32",
        "--num-layers",
        "2",
        "--adapter-path",
        str(out),
    ]
    lora.run(lora.options(argv), training_callback=Heard())
    said = capsys.readouterr().out
    trains = [i for i in heard if "train_loss" in i]
    vals = [i for i in heard if "val_loss" in i]
    assert [i["iteration"] for i in trains] == [1, 2] and len(vals) == 2
    for info, side in [(i, "train") for i in trains] + [(i, "val") for i in vals]:
        for k in METRICS:
            assert np.isfinite(info[f"{side}_{k}"]), (side, k, info)
    assert vals[0]["val_loss"] == pytest.approx(np.log(2), rel=1e-4)  # B = 0: policy = reference
    assert "Iter 2: Train loss" in said and ", acc " in said and ", margin " in said
    assert "16 train pair(s) longer than max_seq_length (64) are cut" in said
    saved = json.loads((out / "adapter_config.json").read_text())
    assert saved["objective"] == "dpo" and saved["beta"] == 0.2
    assert (out / "adapters.safetensors").is_file()


def test_the_drop_in_refuses_pairs_on_the_plain_walk(tmp_path, qwen2_path):
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlxwalk.lora",
            "--model",
            qwen2_path,
            "--train",
            "--data",
            str(SAMPLE),
            "--objective",
            "dpo",
            "--walk",
            "plain",
            "--adapter-path",
            str(tmp_path / "a"),
        ],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 2, p.stderr
    assert p.stderr.count("\n") == 1 and "dpo takes the exact walk" in p.stderr, p.stderr
    assert not (tmp_path / "a").exists()


@torch
def test_a_dpo_run_on_the_torch_backend(few, tmp_path):
    from mlxwalk import cli as main

    out = tmp_path / "run"
    args = [
        "train",
        "--backend",
        "torch",
        "--objective",
        "dpo",
        "--data",
        str(few),
        "--epochs",
        "1",
        "--no-progress",
        *SMALL,
        "--adapter-path",
        str(out),
    ]
    assert main.main(args) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["backend"] == "torch" and report["objective"] == "dpo"
    (epoch,) = report["epochs"]
    assert set(epoch["metrics"]) == set(epoch["eval_metrics"]) == set(METRICS)
    assert all(np.isfinite(v) for v in epoch["metrics"].values())
    assert (out / "adapter_model.safetensors").is_file()
