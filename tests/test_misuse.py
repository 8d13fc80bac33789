"""Misuse: what a user gets wrong, or what the machine does to a run, each said in one line
(`mlxwalk: error: ...`, exit 2, no traceback) naming the thing at fault, with nothing left
half-written; or, where there is a right thing to do, done. Numbered after the findings."""

import builtins
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from mlxwalk import cli, tiny
from mlxwalk.training import mlx_framework
from mlxwalk.training.run import train_run
from mlxwalk.walk import machine

from .test_reliability import chats, quick, quiet  # noqa: F401  (chats: a fixture)

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--chunk", 64, "--num-layers", 2, "--no-progress"]


def refused(capsys, *args) -> str:
    """The one line a refused command prints (exit 2, no traceback)."""
    code = cli.main([str(a) for a in args])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, (code, err)
    assert err.startswith("mlxwalk: error: "), err
    return err


@pytest.fixture(scope="module")
def finished(tmp_path_factory, qwen2_path, chats) -> Path:  # noqa: F811
    """A finished one-window run (chunk 64), copied by the tests that change it."""
    out = tmp_path_factory.mktemp("finished") / "r"
    train_run(quick(qwen2_path, chats, out, iters=1), echo=quiet)
    return out


def copy_of(finished: Path, tmp_path: Path) -> Path:
    out = tmp_path / "r"
    shutil.copytree(finished, out)
    return out


def train_args(qwen2_path, chats, out, *more) -> list:  # noqa: F811
    return ["train", "--model", qwen2_path, "--data", chats, "--adapter-path", out, *SMALL, *more]


def at_step(monkeypatch, n: int, act) -> None:
    """`act()` at the start of the run's `n`th optimizer step (1-based)."""
    real, count = mlx_framework.MLXFramework.step, [0]

    def step(self, *args, **kw):
        count[0] += 1
        if count[0] == n:
            act()
        return real(self, *args, **kw)

    monkeypatch.setattr(mlx_framework.MLXFramework, "step", step)


# --- (1) a Ctrl-C that code in the first window swallows --------------------------------------


def test_a_swallowed_ctrl_c_at_the_first_window_stops_an_overwrite(
    qwen2_path,
    chats,  # noqa: F811
    finished,
    tmp_path,
    monkeypatch,
    capsys,
):
    """The SIGINT arrives as the first window starts, and is swallowed there (as numpy's lazy
    import of numpy.random does now and then): the run still stops within the window, nothing is
    saved and the run it was to --overwrite is put back."""
    out = copy_of(finished, tmp_path)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}

    def swallowed():
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            pass

    # Ctrl-C handled as at a terminal: a background job (nohup, `&`) inherits SIGINT ignored
    at_terminal = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        at_step(monkeypatch, 1, swallowed)
        code = cli.main(
            [str(a) for a in train_args(qwen2_path, chats, out, "--iters", 2, "--overwrite")]
        )
    finally:
        signal.signal(signal.SIGINT, at_terminal)
    err = capsys.readouterr().err
    assert code == 130, err
    assert err.strip().endswith("interrupted before the first window finished; nothing was saved")
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before


def test_numpy_random_is_imported_before_any_window():
    """The lazy import that swallowed Ctrl-C happens when the run's module is imported."""
    code = "import sys, mlxwalk.training.run; sys.exit('numpy.random' not in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


# --- (2) a run too large for the machine, without a budget -------------------------------------


def test_a_run_that_cannot_fit_the_machine_is_refused_before_its_first_window(
    qwen2_path,
    chats,  # noqa: F811
    tmp_path,
    monkeypatch,
    capsys,
):
    """Without --memory-budget-mib, plan's estimate against the machine's memory (here said to be
    1 MiB): refused, each part named, and the adapter folder never made."""
    tiny_machine = machine.Memory(1 << 20, "this machine's memory", False)
    monkeypatch.setattr(machine, "memory", lambda: tiny_machine)
    out = tmp_path / "r"
    err = refused(capsys, *train_args(qwen2_path, chats, out, "--iters", 1))
    assert "mlxwalk: error: memory: the walk needs " in err
    for part in ("weights", "adapter and optimizer", "K/V store", "accumulators", "checkpoints"):
        assert part in err
    assert "no --memory-budget-mib is given, but this machine has 1.0 MiB" in err
    assert "a lower --rank" in err
    assert not out.exists()


# --- (3) a config.json without model_type ------------------------------------------------------


def test_a_config_without_model_type_is_one_line_naming_the_file_and_key(
    qwen2_path,
    chats,  # noqa: F811
    tmp_path,
    capsys,
):
    model = tmp_path / "m"
    model.mkdir()
    for f in Path(qwen2_path).iterdir():
        (model / f.name).symlink_to(f)
    config = json.loads((Path(qwen2_path) / "config.json").read_text())
    del config["model_type"]
    (model / "config.json").unlink()
    (model / "config.json").write_text(json.dumps(config))
    said = f"{model / 'config.json'} has no 'model_type' key"
    assert said in refused(capsys, "plan", "--model", model, "--window", 64)
    assert said in refused(capsys, "test-walk-exact", "--model", model)
    assert said in refused(capsys, *train_args(str(model), chats, tmp_path / "r"))
    assert not (tmp_path / "r").exists()


# --- (4) a seed outside the range ---------------------------------------------------------------


@pytest.mark.parametrize("seed", [2**64, 2**64 - 1, 2**32, -1])
def test_a_seed_outside_its_range_is_refused_up_front(seed, tmp_path, capsys):
    err = refused(capsys, "train", "--seed", seed, "--adapter-path", tmp_path / "r")
    assert f"--seed must be between 0 and 4294967295 (2^32 - 1), got {seed}" in err
    assert not (tmp_path / "r").exists()


def test_the_largest_seed_trains(qwen2_path, chats, tmp_path):  # noqa: F811
    """2^32 - 1, with dropout (whose per-chunk seeds are derived from it)."""
    out = tmp_path / "r"
    train_run(quick(qwen2_path, chats, out, iters=1, seed=2**32 - 1, dropout=0.1), echo=quiet)
    assert (out / "adapters.safetensors").is_file()


# --- (5) an empty path (an unset shell variable) -----------------------------------------------


@pytest.mark.parametrize("flag", ["--data", "--model", "--adapter-path"])
def test_an_empty_path_flag_is_refused_not_read_as_absent(flag, tmp_path, capsys):
    args = ["train", "--adapter-path", tmp_path / "r", flag, ""]
    err = refused(capsys, *args)
    assert f"{flag} is empty (an unset shell variable?)" in err
    assert not (tmp_path / "r").exists()


def test_plan_and_convert_refuse_an_empty_model(tmp_path, capsys):
    assert "--model is empty" in refused(capsys, "plan", "--model", "", "--window", 64)
    err = refused(capsys, "convert-adapter", tmp_path / "a", tmp_path / "b", "--model", "")
    assert "--model is empty" in err


# --- (6) a data file that is not a regular file ------------------------------------------------


@pytest.mark.parametrize("name", ["train.jsonl", "valid.jsonl"])
def test_a_named_pipe_for_data_is_refused_not_waited_on(name, chats, tmp_path, capsys):  # noqa: F811
    d = tmp_path / "d"
    d.mkdir()
    shutil.copy(chats / "train.jsonl", d / "train.jsonl")
    (d / name).unlink(missing_ok=True)
    os.mkfifo(d / name)
    err = refused(capsys, "train", "--data", d, "--adapter-path", tmp_path / "r")
    assert f"{d / name} is not a regular file (a named pipe" in err
    assert not (tmp_path / "r").exists()


# --- (7) a closed terminal -----------------------------------------------------------------------


def test_sighup_saves_what_was_trained_as_sigterm_does(
    qwen2_path,
    chats,  # noqa: F811
    tmp_path,
    monkeypatch,
    capsys,
):
    def unhandled(*_):
        raise AssertionError("SIGHUP reached its default handling")

    old = signal.signal(signal.SIGHUP, unhandled)  # (the default would end this process)
    try:
        at_step(monkeypatch, 2, lambda: signal.raise_signal(signal.SIGHUP))
        out = tmp_path / "r"
        code = cli.main([str(a) for a in train_args(qwen2_path, chats, out, "--iters", 3)])
    finally:
        signal.signal(signal.SIGHUP, old)
    err = capsys.readouterr().err
    assert code == 130, err
    assert "mlxwalk: interrupted at window 1 of 3; checkpoint " in err and "--resume" in err
    assert (out / "checkpoints" / "window-0000001" / "adapters.safetensors").is_file()


# --- (8) a run that died before its first checkpoint -------------------------------------------


def test_a_run_that_died_before_its_first_checkpoint_is_not_a_dead_end(
    qwen2_path,
    chats,  # noqa: F811
    finished,
    tmp_path,
    capsys,
):
    """What a crash before the first checkpoint leaves, run.json alone: --resume says what to
    run instead, and a fresh run takes the folder (there is nothing in it to lose)."""
    out = copy_of(finished, tmp_path)
    for p in out.iterdir():
        if p.name != "run.json":
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    err = refused(capsys, *train_args(qwen2_path, chats, out, "--iters", 1, "--resume"))
    assert "stopped before its first checkpoint, so there is nothing to resume" in err
    assert "with --overwrite instead of --resume" in err
    code = cli.main([str(a) for a in train_args(qwen2_path, chats, out, "--iters", 1)])
    assert code == 0, capsys.readouterr().err
    assert (out / "adapters.safetensors").is_file()


def test_a_folder_of_adapter_files_without_run_json_points_at_overwrite(
    qwen2_path,
    chats,  # noqa: F811
    finished,
    tmp_path,
    capsys,
):
    out = copy_of(finished, tmp_path)
    (out / "run.json").unlink()
    err = refused(capsys, *train_args(qwen2_path, chats, out, "--iters", 1))
    assert "but no run.json to resume it from; replace them with --overwrite" in err
    err = refused(capsys, *train_args(qwen2_path, chats, out, "--iters", 1, "--resume"))
    assert "with --overwrite instead of --resume" in err


# --- (9) --resume with another --chunk -----------------------------------------------------------


def test_resume_with_another_chunk_names_chunk(
    qwen2_path,
    chats,  # noqa: F811
    finished,
    tmp_path,
    capsys,
):
    out = copy_of(finished, tmp_path)
    window = json.loads((out / "report.json").read_text())["window"]
    args = train_args(qwen2_path, chats, out, "--iters", 2, "--resume")
    args[args.index("--chunk") + 1] = 1000
    err = refused(capsys, *args)
    assert f"trained with --chunk 64 (a window of {window}); this one asks for --chunk 1000" in err
    assert "--window" not in err


# --- (10) a sharded model missing a shard --------------------------------------------------------


def test_a_missing_shard_is_named(qwen2_path, tmp_path, capsys):
    model = tmp_path / "m"
    model.mkdir()
    for f in Path(qwen2_path).iterdir():
        if f.name != "model.safetensors":
            (model / f.name).symlink_to(f)
    weights = mx.load(str(Path(qwen2_path) / "model.safetensors"))
    names = sorted(weights)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for shard, keys in shards.items():
        mx.save_safetensors(str(model / shard), {k: weights[k] for k in keys})
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    index = {"metadata": {}, "weight_map": weight_map}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    (model / "model-00002-of-00002.safetensors").unlink()
    err = refused(capsys, "plan", "--model", model, "--window", 64)
    assert (
        f"model folder {model} lacks model-00002-of-00002.safetensors, which "
        "model.safetensors.index.json lists" in err
    )
    (model / "model.safetensors.index.json").unlink()  # no index: the parameters, by name
    err = refused(capsys, "plan", "--model", model, "--window", 64)
    missing = len(shards["model-00002-of-00002.safetensors"])
    assert f"its weights lack {missing} parameters ({names[len(names) // 2]}, " in err


# --- (11) a full MLXWALK_HOME --------------------------------------------------------------------


def test_a_full_mlxwalk_home_is_named_as_full(tmp_path, monkeypatch, capsys):
    """The bundled model's weights written to /dev/full: the kernel's own ENOSPC."""
    home = tmp_path / "home"
    monkeypatch.setenv("MLXWALK_HOME", str(home))
    full = lambda path, mode="r": builtins.open("/dev/full", mode)  # noqa: E731
    monkeypatch.setattr(tiny, "open", full, raising=False)
    err = refused(capsys, "plan", "--model", "tiny-llama", "--window", 64)
    assert (
        f"can't write the bundled model tiny-llama-v{tiny.VERSION} into {home / 'models'} "
        "(MLXWALK_HOME's models): no space left on the device" in err
    )
    assert not any((home / "models").iterdir())  # no half-written model


# --- (12) a TMPDIR that is not there -------------------------------------------------------------


def test_a_missing_tmpdir_is_named(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TMPDIR", str(tmp_path / "gone"))
    err = refused(capsys, "plan", "--window", 64)
    assert f"TMPDIR={tmp_path / 'gone'} does not exist" in err


# --- (13) convert-adapter takes a bundled model's name ---------------------------------------


def test_convert_adapter_takes_a_bundled_model_name(finished, tmp_path, capsys):
    peft = tmp_path / "peft"
    assert cli.main(["convert-adapter", str(finished), str(peft)]) == 0
    back = tmp_path / "back"
    code = cli.main(["convert-adapter", str(peft), str(back), "--model", "tiny-qwen2"])
    assert code == 0, capsys.readouterr().err
    assert (back / "adapters.safetensors").is_file()
    config = json.loads((back / "adapter_config.json").read_text())
    assert config["num_layers"] == 2


def test_the_drop_in_handles_a_closed_terminal_as_the_commands_do(monkeypatch):
    from mlxwalk.dropin import lora

    seen = {}
    monkeypatch.setattr(signal, "signal", lambda s, handler: seen.__setitem__(s, handler))
    with pytest.raises(SystemExit):
        lora.main(["--version"])
    assert seen.get(signal.SIGHUP) is cli.on_sigterm and seen.get(signal.SIGTERM) is cli.on_sigterm
