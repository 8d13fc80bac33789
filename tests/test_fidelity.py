"""python -m mlxwalk.lora against mlx_lm.lora, same arguments and seed, on data whose windows fit
one chunk (where the walk is one graph): the same validation loss, the same training losses."""

import json
import types

import mlx_lm
import numpy as np
from mlx_lm import lora as mlx_lora
from mlx_lm.tuner.datasets import load_dataset
from mlx_lm.tuner.trainer import TrainingCallback

from mlxwalk.dropin import lora

from .test_train import chat


class Seen(TrainingCallback):
    def __init__(self):
        self.train, self.val = [], []

    def on_train_loss_report(self, info):
        self.train.append(info["train_loss"])

    def on_val_loss_report(self, info):
        self.val.append(info["val_loss"])


def mlx_lm_run(argv):
    """mlx_lm.lora's main, up to its trainer, with a callback of ours."""
    ns = vars(mlx_lora.build_parser().parse_args(argv))
    ns.update({k: v for k, v in mlx_lora.CONFIG_DEFAULTS.items() if ns.get(k) is None})
    args = types.SimpleNamespace(**ns)
    np.random.seed(args.seed)
    model, tokenizer = mlx_lm.load(args.model)
    train_set, valid_set, _ = load_dataset(args, tokenizer)
    seen = Seen()
    mlx_lora.train_model(args, model, train_set, valid_set, seen)
    return seen


def test_same_losses_as_mlx_lm_lora(qwen2_path, tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    rows = [chat(i, turns=2) for i in range(6)]
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))
    (d / "valid.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[4:]))
    common = [
        "--model",
        qwen2_path,
        "--train",
        "--data",
        str(d),
        "--iters",
        "10",
        "--batch-size",
        "1",
        "--mask-prompt",
        "--val-batches",
        "-1",
        "--steps-per-report",
        "1",
        "--steps-per-eval",
        "5",
        "--learning-rate",
        "1e-3",
        "--num-layers",
        "2",
        "--seed",
        "3",
    ]
    theirs = mlx_lm_run([*common, "--adapter-path", str(tmp_path / "theirs")])
    ours = Seen()
    lora.run(
        lora.options([*common, "--adapter-path", str(tmp_path / "ours"), "--chunk", "512"]),
        training_callback=ours,
    )
    assert len(ours.train) == len(theirs.train) == 10
    val = np.abs(np.subtract(ours.val, theirs.val))
    train = np.abs(np.subtract(ours.train, theirs.train))
    print(f"against mlx-lm: validation losses apart by {val}, training losses by {train}")
    # before any step, the same function at the same point: float32 rounding (read 2e-7, 5e-7)
    assert val[0] <= 1e-6 * theirs.val[0] and train[0] <= 1e-6 * theirs.train[0], (val, train)
    # then that rounding grows through the Adam steps (read 7e-6 after 5 steps, 5e-4 after 10)
    assert val.max() <= 1e-3 and train.max() <= 1e-3, (val, train)
