"""`mlxwalk train --backend torch` on the bundled tiny model and sample data (CPU, float32): it
writes PEFT's adapter, which converts to mlx-lm's and gives mlx-lm transformers' logits; a run
stopped and resumed ends where an unbroken run ends; refusals come before anything is written."""

import json

import mlx.core as mx
import numpy as np
import pytest

from .extras import needs_torch  # noqa: E402

needs_torch()
pytestmark = pytest.mark.torch

import mlx_lm  # noqa: E402
import peft  # noqa: E402
import torch  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from mlxwalk import cli, tiny  # noqa: E402
from mlxwalk.torch_backend import model as models  # noqa: E402
from mlxwalk.training.convert import convert  # noqa: E402

FLAGS = [
    "train",
    "--backend",
    "torch",
    "--model",
    "tiny-qwen2",
    "--chunk",
    "128",
    "--window",
    "384",
    "--epochs",
    "2",
    "--lr",
    "1e-3",
]


def train(path, *extra) -> int:
    return cli.main([*FLAGS, "--adapter-path", str(path), *extra])


def test_a_run_writes_a_peft_adapter_that_mlx_lm_reads(tmp_path):
    assert train(tmp_path / "run", "--iters", "3") == 0
    out = tmp_path / "run"
    for name in ("adapter_model.safetensors", "adapter_config.json", "report.json", "run.json"):
        assert (out / name).is_file(), name
    report = json.loads((out / "report.json").read_text())
    assert report["backend"] == "torch" and report["windows"] == 3
    assert len(report["window_losses"]) == 3 and all(np.isfinite(report["window_losses"]))

    base = models.tiny_folder("tiny-qwen2")
    hf = peft.PeftModel.from_pretrained(models.load(base), str(out))
    ids = [[3, 17, 42, 99, 7, 250, 1, 64, 128, 33]]
    with torch.no_grad():
        want = hf(torch.tensor(ids)).logits.numpy()
    assert convert(out, tmp_path / "mlx", model=base) == "mlx"
    model, _ = mlx_lm.load(str(tiny.path("tiny-qwen2")), adapter_path=str(tmp_path / "mlx"))
    got = np.array(model(mx.array(ids)).astype(mx.float32))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-4


def test_a_resumed_run_ends_where_an_unbroken_run_ends(tmp_path):
    assert train(tmp_path / "whole", "--iters", "4") == 0
    assert train(tmp_path / "broken", "--iters", "2") == 0
    assert train(tmp_path / "broken", "--iters", "4", "--resume") == 0
    a = load_file(str(tmp_path / "whole" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "broken" / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert np.allclose(a[k], b[k], rtol=1e-5, atol=1e-7), k
    whole = json.loads((tmp_path / "whole" / "report.json").read_text())["window_losses"]
    broken = json.loads((tmp_path / "broken" / "report.json").read_text())["window_losses"]
    assert np.allclose(whole, broken, rtol=1e-5)


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--memory-budget-mib", "100"], "--memory-budget-mib counts CUDA memory"),
        (["--cache-type", "q8"], "--cache-type q8"),
        (["--model", "/nonexistent"], "/nonexistent: the torch backend loads a local transformers"),
    ],
)
def test_refusals_are_one_line_and_write_nothing(tmp_path, capsys, extra, says):
    assert train(tmp_path / "run", *extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0]
    assert not (tmp_path / "run").exists()


def test_plan_for_the_torch_backend(capsys):
    args = [
        "plan",
        "--backend",
        "torch",
        "--model",
        "tiny-qwen3_5",
        "--window",
        "4096",
        "--chunk",
        "1024",
        "--cache-type",
        "bfloat16",
    ]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    # 2 attention layers x 2 x 2 kv heads x 64 = 512 K/V elements a position
    assert "4 chunks, checkpoint stride 1" in out and "K/V store                 4.0 MiB" in out
    assert "K/V accumulators (fp32)   8.0 MiB" in out and "verdict: fits" in out
    assert cli.main([*args, "--host-budget-mib", "1"]) == 1
    assert "does not fit: host memory" in capsys.readouterr().out
    if not torch.cuda.is_available():  # a budget's graph is measured on the GPU
        assert cli.main([*args, "--memory-budget-mib", "100"]) == 2
        assert "--memory-budget-mib counts CUDA memory" in capsys.readouterr().err


def test_a_hybrid_adapter_crosses_both_ways(tmp_path):
    """Qwen3.5's layers sit under language_model.model in mlx-lm and under model in
    transformers' Qwen3_5ForCausalLM: the adapter of a torch run converts to mlx-lm's and back,
    and each framework gives the other's logits."""
    assert train(tmp_path / "run", "--model", "tiny-qwen3_5", "--iters", "1") == 0
    base = models.tiny_folder("tiny-qwen3_5")
    ids = [[3, 17, 42, 99, 7, 250, 1, 64, 128, 33]]
    hf = peft.PeftModel.from_pretrained(models.load(base), str(tmp_path / "run"))
    with torch.no_grad():
        want = hf(torch.tensor(ids)).logits.numpy()
    assert convert(tmp_path / "run", tmp_path / "mlx", model=base) == "mlx"
    model, _ = mlx_lm.load(str(tiny.path("tiny-qwen3_5")), adapter_path=str(tmp_path / "mlx"))
    got = np.array(model(mx.array(ids)).astype(mx.float32))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-4
    assert convert(tmp_path / "mlx", tmp_path / "back", model=base) == "peft"
    again = peft.PeftModel.from_pretrained(models.load(base), str(tmp_path / "back"))
    with torch.no_grad():
        back = again(torch.tensor(ids)).logits.numpy()
    assert np.linalg.norm(back - want) / np.linalg.norm(want) < 1e-6
