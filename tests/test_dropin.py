"""The mlx-lm drop-in (mlxwalk/dropin/): python -m mlxwalk.lora with mlx_lm.lora's arguments and
YAML, and mlxwalk.train with mlx-lm's TrainingArgs and TrainingCallback."""

import importlib.util
import json
import subprocess
import sys

import mlx.optimizers as optim
import mlx_lm
import pytest
from mlx_lm.tuner.datasets import CacheDataset, load_dataset
from mlx_lm.tuner.trainer import TrainingArgs, TrainingCallback, default_loss, iterate_batches
from mlx_lm.tuner.utils import linear_to_lora_layers

import mlxwalk
from mlxwalk.plan import PlanError
from mlxwalk.walk import WalkConfig

from .test_train import chat


@pytest.fixture
def data_dir(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    (d / "train.jsonl").write_text("".join(json.dumps(chat(i)) + "\n" for i in range(3)))
    (d / "valid.jsonl").write_text(json.dumps(chat(7)) + "\n")
    return d


def lora(*args):
    return subprocess.run(
        [sys.executable, "-m", "mlxwalk.lora", *args], capture_output=True, text=True
    )


def test_lora_cli_takes_mlx_lm_arguments_and_yaml(qwen2_path, data_dir, tmp_path):
    """An mlx-lm LoRA config with every key a walk honours, numbers as mlx-lm writes them."""
    config = tmp_path / "c.yaml"
    config.write_text(
        f"model: {qwen2_path}\ntrain: true\ntest: false\ndata: {data_dir}\nseed: 3\n"
        "fine_tune_type: lora\noptimizer: adamw\noptimizer_config:\n  adamw:\n"
        "    weight_decay: 0.01\nnum_layers: 2\nbatch_size: 1\niters: 4\nval_batches: -1\n"
        "learning_rate: 1e-3\nsteps_per_report: 1\nsteps_per_eval: 2\n"
        "resume_adapter_file: null\nsave_every: 2\ntest_batches: 10\nmax_seq_length: 4096\n"
        "grad_checkpoint: true\ngrad_accumulation_steps: 1\nclear_cache_threshold: 0\n"
        "lr_schedule:\n  name: cosine_decay\n  warmup: 2\n  warmup_init: 1e-7\n"
        "  arguments: [1e-3, 100, 1e-7]\nlora_parameters:\n  keys: [self_attn.q_proj]\n"
        "  rank: 4\n  scale: 10.0\n  dropout: 0.0\nmask_prompt: true\nreport_to: null\n"
        f"project_name: null\ntrust_remote_code: false\nadapter_path: {tmp_path / 'ad'}\n"
        "chunk: 128\n"
    )
    p = lora("-c", str(config))
    assert p.returncode == 0, p.stderr
    assert "Iter 4: Train loss" in p.stdout and "Iter 1: Val loss" in p.stdout  # it=2, as mlx-lm
    rates = [
        float(line.split("Learning Rate ")[1].split(",")[0])
        for line in p.stdout.splitlines()
        if "Learning Rate" in line
    ]
    assert rates[0] < rates[1] <= 1e-3  # the warmup, then the peak
    saved = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert saved["lora_parameters"]["rank"] == 4 and saved["num_layers"] == 2
    assert (tmp_path / "ad" / "0000002_adapters.safetensors").exists()
    model, _ = mlx_lm.load(qwen2_path, adapter_path=str(tmp_path / "ad"))
    assert model.layers[-1].self_attn.q_proj.lora_a.shape[-1] == 4
    assert not hasattr(model.layers[-1].self_attn.k_proj, "lora_a")  # keys honoured


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_lora_cli_report_to_an_uninstalled_logger_is_one_line(qwen2_path, data_dir, tmp_path):
    p = lora(
        "--model",
        qwen2_path,
        "--train",
        "--data",
        str(data_dir),
        "--num-layers",
        "2",
        "--report-to",
        "wandb",
        "--adapter-path",
        str(tmp_path / "ad"),
    )
    assert p.returncode == 2 and "--report-to wandb: wandb is not installed" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and not (tmp_path / "ad").exists()


def test_max_seq_length_cuts_only_when_given_and_says_so(qwen2_path, data_dir, tmp_path):
    base = [
        "--model",
        qwen2_path,
        "--train",
        "--data",
        str(data_dir),
        "--num-layers",
        "2",
        "--iters",
        "1",
        "--chunk",
        "128",
    ]
    whole = lora(*base, "--adapter-path", str(tmp_path / "a"))
    assert whole.returncode == 0 and "max_seq_length" not in whole.stdout, whole.stderr
    cut = lora(*base, "--max-seq-length", "64", "--adapter-path", str(tmp_path / "b"))
    assert cut.returncode == 0, cut.stderr
    assert "longer than max_seq_length (64) and are cut to it" in cut.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--batch-size", "4"], "batch_size 4"),
        (["--fine-tune-type", "dora"], "fine-tune-type 'dora'"),
        (["--optimizer", "lion"], "optimizer 'lion' is unknown"),
        (["--fine-tune-type", "full"], "fine-tune-type 'full'"),
        (["--lr-schedule-typo"], "unrecognized arguments"),
    ],
)
def test_lora_cli_refuses_what_the_walk_cannot_honour(qwen2_path, data_dir, args, message):
    p = lora("--model", qwen2_path, "--train", "--data", str(data_dir), *args)
    assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr


def test_lora_cli_refuses_an_unknown_yaml_key(tmp_path):
    (tmp_path / "c.yaml").write_text("model: x\nlora_paramters: {}\n")
    p = lora("-c", str(tmp_path / "c.yaml"))
    assert p.returncode == 2 and "unknown key 'lora_paramters'" in p.stderr


def test_train_reports_through_mlx_lm_callbacks(qwen2_path, data_dir, tmp_path):
    model, tok = mlx_lm.load(qwen2_path)
    model.freeze()
    linear_to_lora_layers(model, 2, {"rank": 4, "scale": 10.0, "dropout": 0.0})
    ns = type(
        "A",
        (),
        {
            "data": str(data_dir),
            "train": True,
            "test": False,
            "hf_dataset": None,
            "mask_prompt": True,
        },
    )()
    train_set, valid_set, _ = load_dataset(ns, tok)

    class Seen(TrainingCallback):
        def __init__(self):
            self.train, self.val = [], []

        def on_train_loss_report(self, info):
            self.train.append(info)

        def on_val_loss_report(self, info):
            self.val.append(info)

    seen = Seen()
    args = TrainingArgs(
        batch_size=1,
        iters=2,
        steps_per_report=1,
        steps_per_eval=2,
        adapter_file=str(tmp_path / "a.safetensors"),
        max_seq_length=1024,
    )
    mlxwalk.train(
        model,
        optim.Adam(learning_rate=1e-3),
        CacheDataset(train_set),
        CacheDataset(valid_set),
        args,
        default_loss,
        iterate_batches,
        seen,
        walk_config=WalkConfig(chunk=128),
    )
    assert [r["iteration"] for r in seen.train] == [1, 2]
    assert set(seen.train[0]) == {
        "iteration",
        "train_loss",
        "learning_rate",
        "iterations_per_second",
        "tokens_per_second",
        "trained_tokens",
        "peak_memory",
    }
    assert set(seen.val[0]) == {"iteration", "val_loss", "val_time"}
    assert (tmp_path / "a.safetensors").exists()


def test_train_refuses_what_a_walk_cannot_take_in_mlx_lms_order(qwen2):
    args = TrainingArgs(batch_size=1, iters=1)
    with pytest.raises(PlanError, match="got a TrainingCallback; mlx-lm's order is"):
        mlxwalk.train(qwen2, optim.Adam(learning_rate=1e-3), [], None, args, TrainingCallback())
    with pytest.raises(PlanError, match="a custom loss can't be walked"):
        mlxwalk.train(qwen2, optim.Adam(learning_rate=1e-3), [], None, args, lambda *a: 0)


def test_lora_cli_takes_all_layers_a_partial_lora_mapping_and_refuses_a_missing_folder(
    qwen2_path, data_dir, tmp_path
):
    config = tmp_path / "c.yaml"
    config.write_text(
        f"model: {qwen2_path}\ntrain: true\ndata: {data_dir}\niters: 1\n"
        f"num_layers: -1\nlora_parameters: {{rank: 4}}\noptimizer: Adam\n"
        f"adapter_path: {tmp_path / 'ad'}\nchunk: 128\n"
    )
    p = lora("-c", str(config))
    assert p.returncode == 0, p.stderr
    saved = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert saved["lora_parameters"] == {"rank": 4, "dropout": 0.0, "scale": 20.0}
    model, _ = mlx_lm.load(qwen2_path, adapter_path=str(tmp_path / "ad"))
    assert all(hasattr(layer.self_attn.q_proj, "lora_a") for layer in model.layers)
    p = lora("--model", qwen2_path, "--train", "--data", str(tmp_path / "nowhere"))
    assert p.returncode == 2 and "is not a folder (nothing is downloaded)" in p.stderr
    assert "Traceback" not in p.stderr


def test_the_training_report_averages_since_the_last_and_counts_tokens_throughout():
    from mlxwalk.dropin.trainer import Tally

    class Seen:
        def __init__(self):
            self.train = []

        def on_train_loss_report(self, info):
            self.train.append(info)

    seen, opt = Seen(), optim.SGD(learning_rate=0.5)
    tally = Tally(seen, opt)
    tally.add(2.0, 10, 1.0)
    tally.add(4.0, 30, 1.0)
    tally.report(2)
    tally.add(1.0, 5, 0.5)
    tally.report(3)
    first, second = seen.train
    assert (first["train_loss"], first["tokens_per_second"], first["trained_tokens"]) == (
        3.0,
        20.0,
        40,
    )
    assert (second["train_loss"], second["iterations_per_second"], second["trained_tokens"]) == (
        1.0,
        2.0,
        45,
    )
    assert first["learning_rate"] == 0.5
    Tally(None, opt).report(1)  # a rank that is not the leader says nothing
