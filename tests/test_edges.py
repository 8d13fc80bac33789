"""The reliability suite's edges a new user still fell off: the README's test command without the
torch extra, a plan of any size, one run per folder, writes that fail late, one-line refusals of
broken folders and data, the Python API's refusals, adapters whose config disagrees with their
tensors, environment switches, chat templates without line breaks, and the machine's own memory.
Each test names the promise it keeps (numbered as in docs/DESIGN.md, "What a user is told")."""

import errno
import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxwalk import _blas, cli, tiny
from mlxwalk.commands import plan as plan_command
from mlxwalk.dropin import lora
from mlxwalk.plan import Labels, PlanError, plan_window
from mlxwalk.training import files, models
from mlxwalk.training.convert import convert
from mlxwalk.training.files import FolderLock
from mlxwalk.training.run import train_run
from mlxwalk.walk import WalkConfig, Window, machine, window_gradient

from .test_reliability import chats, quick, quiet, rows  # noqa: F401  (chats: a fixture)

ROOT = Path(__file__).resolve().parent.parent


def mlxwalk_cli(capsys, *args) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def refused(capsys, *args, prog=cli.main) -> str:
    """The one line a refused command prints (exit 2, no traceback)."""
    code = prog([str(a) for a in args])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    return err


# --- (1) the README's test command on a machine without the torch extra --------------------------


def test_the_torch_tests_are_skipped_with_their_reason_without_torch():
    """With torch, transformers and peft unimportable, every torch test file collects (skipped,
    saying why) instead of stopping the run at collection."""
    blocked = (
        "import sys; [sys.modules.__setitem__(m, None) for m in ('torch', 'peft')]; "
        "import pytest; sys.exit(pytest.main(['-q', '-rs', '-p', 'no:cacheprovider', "
        "'tests/test_torch_budget.py', 'tests/test_torch_walk.py', "
        "'tests/test_torch_ranks.py', 'tests/test_layout.py', "
        "'-k', 'not script_imports_what_exists or torch_backend']))"
    )
    p = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:]
    assert "error" not in p.stdout.lower(), p.stdout[-2000:]
    assert "pip install -e '.[torch]'" in p.stdout, p.stdout[-2000:]


# --- (2) a plan of any size ----------------------------------------------------------------------


def test_a_plan_holds_nothing_per_position():
    """A billion positions planned from the window's runs: a few MiB, not ~77 bytes a position."""
    tracemalloc.start()
    window = Window.labelled(10**9)
    plan = plan_window(window.labels, 1 << 20, machine_footprint())
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert plan.computed == 10**9 and len(plan.chunks) == -(-(10**9) // (1 << 20))
    assert peak < 16 << 20, peak


def machine_footprint():
    from mlxwalk.plan import Footprint

    return Footprint(kv_width=2 * 2 * 64)


def test_labels_from_runs_cut_as_the_weights_do():
    w = [0.0] * 5 + [1.0] * 7 + [0.5] * 3 + [0.0] * 4
    for follow in (True, False):
        from mlxwalk.plan import cut

        a, b = cut(w, 4, follow), cut(Labels.of(w), 4, follow)
        assert a == b
        assert a == cut(
            Window.of(np.zeros(len(w), int), np.zeros(len(w), int), w).labels, 4, follow
        )


def test_plan_refuses_a_window_past_the_models_positions(capsys):
    err = refused(capsys, "plan", "--window", 10**9, "--chunk", 512)
    assert "--window 1000000000 exceeds the model's maximum positions (131072)" in err


def test_plan_without_a_budget_says_what_the_machine_has(qwen2, capsys, monkeypatch):
    monkeypatch.setattr(machine, "physical", lambda: 8 << 20)  # an 8 MiB machine
    monkeypatch.setattr(machine, "backend", lambda: "cpu")
    ok = plan_command.report(qwen2, "tiny", 4096, WalkConfig(chunk=512))
    out = capsys.readouterr().out
    assert not ok and "this machine has 0.0 GiB" in out and "does not fit this machine" in out


def test_plan_under_a_budget_shows_the_probe_and_sizes_it_to_the_window(qwen2, capsys):
    assert plan_command.report(qwen2, "tiny", 96, WalkConfig(chunk=128, memory_budget_mib=4000))
    out = capsys.readouterr().out
    assert "walk 1 of 1, 128 positions" in out  # one chunk: no prefix to measure
    assert plan_command.report(qwen2, "tiny", 640, WalkConfig(chunk=128, memory_budget_mib=4000))
    out = capsys.readouterr().out
    assert "walk 3 of 3, 640 positions" in out  # the prefix the run reaches, not 2,048 more


def test_plan_help_says_the_window_is_required(capsys):
    with pytest.raises(SystemExit):
        cli.main(["plan", "--help"])
    out = capsys.readouterr().out.replace("\n", " ")
    assert "positions the planned window holds (required)" in " ".join(out.split())


# --- (3) one run per folder ----------------------------------------------------------------------


def test_a_second_run_into_a_locked_folder_is_refused_by_name(qwen2_path, chats, tmp_path):  # noqa: F811
    out = tmp_path / "ad"
    out.mkdir()
    holder = FolderLock(out)
    holder.acquire()
    try:
        with pytest.raises(
            PlanError, match=f"adapter path {out} is in use by another run \\(pid {os.getpid()} on "
        ):
            train_run(quick(qwen2_path, chats, out, iters=1), echo=quiet)
    finally:
        holder.release()
    assert not (out / "adapters.safetensors").exists()
    train_run(quick(qwen2_path, chats, out, iters=1), echo=quiet)  # free again: it runs
    assert (out / "adapters.safetensors").exists() and not (out / FolderLock.NAME).exists()


def test_a_stale_lock_of_a_dead_run_is_taken_over(tmp_path):
    (tmp_path / FolderLock.NAME).write_text("pid 999999 on elsewhere, long ago")  # nobody holds it
    lock = FolderLock(tmp_path)
    lock.acquire()
    assert f"pid {os.getpid()}" in (tmp_path / FolderLock.NAME).read_text()
    lock.release()


def test_two_runs_started_at_once_into_one_folder_one_refused(qwen2_path, chats, tmp_path):  # noqa: F811
    out = tmp_path / "same"
    cmd = [
        sys.executable,
        "-m",
        "mlxwalk",
        "train",
        "--model",
        qwen2_path,
        "--data",
        str(chats),
        "--chunk",
        "64",
        "--iters",
        "2",
        "--num-layers",
        "2",
        "--no-progress",
        "--adapter-path",
        str(out),
    ]
    runs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    results = [(p.wait(timeout=600), p.stderr.read()) for p in runs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    assert any("is in use by another run" in err for _, err in results), results


# --- (4) no work lost to a late failure ---------------------------------------------------------


def test_a_non_ascii_adapter_path_under_a_c_locale_trains_and_saves(qwen2_path, chats, tmp_path):  # noqa: F811
    out = tmp_path / "adapter-\u00e9t\u00e9"
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"}
    cmd = [
        sys.executable,
        "-m",
        "mlxwalk",
        "train",
        "--model",
        qwen2_path,
        "--data",
        str(chats),
        "--chunk",
        "64",
        "--iters",
        "1",
        "--num-layers",
        "2",
        "--no-progress",
        "--adapter-path",
        os.fsencode(out),
    ]
    p = subprocess.run(cmd, capture_output=True, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    assert (out / "adapters.safetensors").is_file() and (out / "checkpoints").is_dir()


def full_disk_after(monkeypatch, writes: int, disk: Path) -> None:
    """Safetensors writes under `disk` fail with ENOSPC after `writes` of them succeed."""
    real, count = files.save_safetensors, [0]

    def save(path, arrays, metadata=None):
        count[0] += disk in Path(path).parents
        if count[0] > writes and disk in Path(path).parents:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, arrays, metadata)

    monkeypatch.setattr(files, "save_safetensors", save)
    for module in ("adapters", "mlx_framework"):
        monkeypatch.setattr(f"mlxwalk.training.{module}.save_safetensors", save)


def test_a_full_disk_names_the_intact_checkpoint_and_leaves_no_temporaries(
    qwen2_path,
    chats,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    out = tmp_path / "r"
    full_disk_after(monkeypatch, 3, out)  # the write check, the first checkpoint, then full
    with pytest.raises(PlanError) as e:
        train_run(quick(qwen2_path, chats, out, iters=3, save_every=1), echo=quiet)
    said = str(e.value)
    assert said.startswith(f"no space left on {out}/checkpoints/"), said
    assert f"checkpoint {out}/checkpoints/window-0000001 is intact" in said
    assert f"--resume --adapter-path {out}" in said
    assert not [p for p in out.rglob("*") if files.TMP_MARK in p.name]
    assert (out / "checkpoints" / "window-0000001" / "adapters.safetensors").is_file()


def test_a_full_disk_before_any_checkpoint_saves_the_adapter_elsewhere(
    qwen2_path,
    chats,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    out = tmp_path / "r"
    full_disk_after(monkeypatch, 1, out)  # the start's write check only
    with pytest.raises(PlanError, match="the adapter trained so far is saved to (.+) instead") as e:
        train_run(quick(qwen2_path, chats, out, iters=2, save_every=1), echo=quiet)
    rescued = Path(str(e.value).rsplit(" is saved to ", 1)[1].removesuffix(" instead"))
    assert (rescued / "adapters.safetensors").is_file() and not out.exists()


# --- (5) one line, never a traceback ------------------------------------------------------------


@pytest.fixture(scope="module")
def broken(tmp_path_factory, qwen2_path) -> Path:
    """Copies of the tiny model, each broken in one way."""
    import shutil

    root = tmp_path_factory.mktemp("broken")
    for name in ("nofield", "badjson", "truncated", "notokenizer"):
        shutil.copytree(qwen2_path, root / name)
    cfg = json.loads((root / "nofield" / "config.json").read_text())
    del cfg["hidden_size"]
    (root / "nofield" / "config.json").write_text(json.dumps(cfg))
    (root / "badjson" / "config.json").write_text('{"model_type": "qwen2",')
    weights = root / "truncated" / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (root / "notokenizer" / name).unlink()
    return root


@pytest.mark.parametrize(
    "name, message",
    [
        ("nofield", "config.json lacks 'hidden_size', which its model type needs"),
        ("badjson", "config.json is not valid JSON (Expecting"),
        ("truncated", "model.safetensors can't be read: Tensor"),
    ],
)
def test_a_broken_model_folder_is_one_line_naming_the_file(broken, name, message, capsys, tmp_path):
    folder = broken / name
    for args in (
        ["train", "--model", folder, "--adapter-path", tmp_path / "ad", "--iters", "1"],
        ["plan", "--model", folder, "--window", "1024"],
        ["test-walk-exact", "-m", folder],
    ):
        err = refused(capsys, *args)
        assert f"{folder}" in err and message in err, err
    assert not (tmp_path / "ad").exists()


def test_a_model_without_tokenizer_files_is_said_as_such(broken, capsys, tmp_path):
    err = refused(
        capsys, "train", "--model", broken / "notokenizer", "--adapter-path", tmp_path / "ad"
    )
    assert "has no tokenizer (none of tokenizer.json" in err


def test_data_given_a_file_and_an_adapter_file_given_a_folder(qwen2_path, chats, capsys, tmp_path):  # noqa: F811
    err = refused(capsys, "train", "--data", chats / "train.jsonl")
    assert "is a file; give the folder that holds train.jsonl" in err
    err = refused(
        capsys, "--model", qwen2_path, "--train", "--data", chats / "train.jsonl", prog=lora.main
    )
    assert "is a file; give the folder" in err
    err = refused(
        capsys,
        "--model",
        qwen2_path,
        "--train",
        "--data",
        chats,
        "--num-layers",
        "2",
        "--adapter-path",
        tmp_path / "ad",
        "--resume-adapter-file",
        chats,
        prog=lora.main,
    )
    assert f"--resume-adapter-file {chats} is a folder" in err


def test_the_drop_in_on_an_empty_train_jsonl_is_one_line(qwen2_path, capsys, tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "train.jsonl").write_text("")
    err = refused(
        capsys,
        "--model",
        qwen2_path,
        "--train",
        "--data",
        tmp_path / "d",
        "--adapter-path",
        tmp_path / "ad",
        prog=lora.main,
    )
    assert "train.jsonl is empty" in err


def test_a_garbage_adapter_is_named_by_file(qwen2_path, chats, capsys, tmp_path):  # noqa: F811
    ad = tmp_path / "ad"
    ad.mkdir()
    (ad / "adapters.safetensors").write_bytes(os.urandom(300))
    config = {"num_layers": 2, "lora_parameters": {"rank": 8, "scale": 20.0, "dropout": 0.0}}
    (ad / "adapter_config.json").write_text(json.dumps(config))
    rows(chats, "test.jsonl", [{"text": "a test row"}])
    err = refused(
        capsys,
        "--model",
        qwen2_path,
        "--test",
        "--data",
        chats,
        "--adapter-path",
        ad,
        prog=lora.main,
    )
    assert f"{ad / 'adapters.safetensors'} is not a readable safetensors file" in err
    (ad / "adapter_config.json").write_text("{")
    err = refused(
        capsys,
        "--model",
        qwen2_path,
        "--test",
        "--data",
        chats,
        "--adapter-path",
        ad,
        prog=lora.main,
    )
    assert f"{ad / 'adapter_config.json'} is not valid JSON" in err


def test_plan_with_the_torch_backend_missing_is_one_line(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlxwalk.torch_backend.plan_command", None)  # as if no torch
    err = refused(capsys, "plan", "--backend", "torch", "--window", "1024")
    assert "the torch backend needs pip install 'mlxwalk[torch]'" in err


# --- (6) the Python API refuses what it would get wrong ------------------------------------------


@pytest.mark.parametrize(
    "inputs, targets, weights, message",
    [
        ([1.7, 2.2, 3.0], [2, 3, 4], [1, 1, 1], "input token ids must be integers, got float64"),
        ([[1, 2], [3, 4]], [[2, 3], [4, 5]], [[1, 1], [1, 1]], "must be one window"),
        ([1, 2, 3], [2, 3, 4], [1, float("nan"), 1], "weights must be finite"),
        ([1, 2, 3], [2, 3, 4], [1, float("inf"), 1], "weights must be finite"),
        ([1, 10**10, 3], [2, 3, 4], [1, 1, 1], "input token id 10000000000 is outside"),
    ],
)
def test_the_api_refuses_what_it_would_get_wrong(qwen2, inputs, targets, weights, message):
    with pytest.raises(PlanError, match=message):
        window_gradient(qwen2, inputs, targets, weights, chunk=2)


def test_the_api_takes_one_row_as_one_window(qwen2):
    flat = window_gradient(qwen2, [1, 2, 3, 4], [2, 3, 4, 5], [1, 1, 1, 1], chunk=2)
    row = window_gradient(qwen2, [[1, 2, 3, 4]], [[2, 3, 4, 5]], [[1, 1, 1, 1]], chunk=2)
    assert flat[0] == row[0]  # the same window, walked the same way: bit-equal
    a, b = dict(tree_flatten(flat[1])), dict(tree_flatten(row[1]))
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)


# --- (7) adapters, switches and folders ----------------------------------------------------------


def test_convert_adapter_refuses_a_config_that_disagrees_with_the_tensors(qwen2_path, tmp_path):
    model, _ = mlx_lm.load(qwen2_path)
    from mlxwalk.training import adapters

    lora_cfg = adapters.LoraConfig(rank=8, num_layers=2)
    adapters.apply(model, lora_cfg)
    adapters.save(model, tmp_path / "r8", lora_cfg)
    cfg = json.loads((tmp_path / "r8" / "adapter_config.json").read_text())
    cfg["lora_parameters"]["rank"] = 4
    (tmp_path / "r8" / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(PlanError, match="says rank 4, but its tensors have rank 8"):
        convert(tmp_path / "r8", tmp_path / "peft", qwen2_path)
    assert not (tmp_path / "peft").exists()


def test_environment_switches_refuse_unknown_values_by_name(capsys, monkeypatch):
    monkeypatch.setenv("MLXWALK_KERNELS", "fast")
    assert "MLXWALK_KERNELS='fast' is unknown" in refused(capsys, "plan", "--window", "64")
    monkeypatch.delenv("MLXWALK_KERNELS")
    if sys.platform.startswith("linux"):
        monkeypatch.setenv("MLXWALK_BLAS", "/nowhere/libblas.so")
        monkeypatch.setattr(_blas, "loaded", None)  # a fresh process: nothing routed or tried
        monkeypatch.setattr(_blas, "tried", False)
        assert "MLXWALK_BLAS='/nowhere/libblas.so' is unknown" in refused(
            capsys, "plan", "--window", "64"
        )


def test_an_empty_mlxwalk_home_is_not_the_current_folder(monkeypatch):
    monkeypatch.setenv("MLXWALK_HOME", "")
    assert tiny.home() == Path.home() / ".cache" / "mlxwalk"


def test_an_adapter_path_in_the_model_or_data_folder_is_refused(qwen2_path, chats, capsys):  # noqa: F811
    err = refused(
        capsys, "train", "--model", qwen2_path, "--data", chats, "--adapter-path", qwen2_path
    )
    assert f"adapter path {qwen2_path} is inside the model folder" in err
    err = refused(
        capsys, "train", "--model", qwen2_path, "--data", chats, "--adapter-path", chats / "ad"
    )
    assert "is inside the data folder" in err and not (chats / "ad").exists()


# --- (9) the machine's own memory ----------------------------------------------------------------


def fake_metal(monkeypatch, working_set: int) -> None:
    monkeypatch.setattr(machine, "backend", lambda: "metal")
    monkeypatch.setattr(
        machine, "device_info", lambda: {"max_recommended_working_set_size": working_set}
    )


def test_on_metal_the_budget_defaults_to_the_recommended_working_set(qwen2, capsys, monkeypatch):
    fake_metal(monkeypatch, 6 << 30)
    assert machine.default_budget_mib(None)[0] == 6 * 1024
    assert machine.default_budget_mib(1000.0)[0] == 1000.0  # one given wins
    assert plan_command.report(qwen2, "tiny", 512, WalkConfig(chunk=128))
    out = capsys.readouterr().out
    assert "memory budget: 6.0 GiB (the GPU's recommended working set" in out
    assert "budget 6144.0 MiB (the GPU's own" in out
    fake_metal(monkeypatch, 1 << 20)  # 1 MiB: the weights alone exceed it
    assert not plan_command.report(qwen2, "tiny", 512, WalkConfig(chunk=128))
    assert "alone exceed the memory budget of 1.0 MiB" in capsys.readouterr().out


def test_a_run_on_metal_says_its_default_budget(qwen2_path, chats, tmp_path, monkeypatch):  # noqa: F811
    fake_metal(monkeypatch, 6 << 30)
    said = []
    summary = train_run(quick(qwen2_path, chats, tmp_path / "r", iters=1), echo=said.append)
    assert any("memory budget: 6.0 GiB (the GPU's recommended working set" in s for s in said)
    assert summary["config"]["memory_budget_mib"] == 6 * 1024 and summary["memory_estimate_mib"]


def test_on_cuda_the_budget_is_the_free_memory(monkeypatch):
    monkeypatch.setattr(machine, "backend", lambda: "cuda")
    monkeypatch.setattr(
        machine, "device_info", lambda: {"free_memory": 3 << 30, "total_memory": 8 << 30}
    )
    assert machine.default_budget_mib(None)[0] == 3 * 1024


def test_importing_mlxwalk_routes_nothing():
    code = (
        "import sys, mlxwalk, mlx.core as mx; from mlxwalk import _blas; "
        "print(_blas.loaded is None, 'mlxwalk.dropin' in sys.modules)"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert p.stdout.split() == ["True", "False"] and p.stderr == "", (p.stdout, p.stderr)


def test_no_openblas_notice_where_a_gpu_does_the_work(monkeypatch, capsys):
    class Gpu:
        type = mx.gpu

    monkeypatch.setattr(_blas, "loaded", None)
    monkeypatch.setattr(_blas, "_wheel_library", lambda: None)  # would print the notice on a CPU
    monkeypatch.setattr(mx, "default_device", lambda: Gpu())
    assert _blas.use_openblas() is None and capsys.readouterr().err == ""
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.cpu))
    if sys.platform.startswith("linux"):
        assert _blas.use_openblas() is None and "reference BLAS" in capsys.readouterr().err


def test_models_max_positions_reads_text_configs():
    class Args:
        text_config = {"max_position_embeddings": 4096}

    class Model:
        args = Args()

    assert models.max_positions(Model()) == 4096
