"""The reliability suite: the paths around the happy one, as a new user meets them. A user loses
nothing and is told: each test names the promise it keeps (numbered after the issue's items)."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from mlxwalk import cli, tiny
from mlxwalk.dropin import lora
from mlxwalk.plan import MIB, OutOfMemory, PlanError
from mlxwalk.training import mlx_framework, run
from mlxwalk.training.files import FolderLock
from mlxwalk.training.run import TrainConfig, train_run
from mlxwalk.training.watch import BUDGET_MARGIN
from mlxwalk.walk import ExactWalk, WalkConfig, Window, budget, window_gradient
from mlxwalk.walk import probe as probes
from mlxwalk.walk.exact import probe
from mlxwalk.walk.guards import NonFinite

from .test_train import chat

ROOT = Path(__file__).resolve().parent.parent


def rows(d: Path, name: str, items) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text("".join(json.dumps(r) + "\n" for r in items))
    return d


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("chats")
    rows(d, "train.jsonl", [chat(i, 2) for i in range(4)])
    rows(d, "valid.jsonl", [chat(9, 2)])
    rows(d, "test.jsonl", [chat(i, 2) for i in range(5, 7)])
    return d


def variant(tmp_path_factory, name: str, seed: int = 2, **config) -> str:
    """A tiny model beside the bundled ones: tiny-qwen2's config with `config` over it."""
    spec = tiny.TinySpec(name, {**tiny.MODELS["tiny-qwen2"].config, **config}, seed)
    return str(tiny.write(spec, tmp_path_factory.mktemp(name) / name))


def quick(qwen2_path, data, out, **kw) -> TrainConfig:
    base = dict(
        model=qwen2_path,
        data=str(data),
        chunk=64,
        epochs=1,
        lr=1e-3,
        num_layers=2,
        adapter_path=str(out),
        progress=False,
    )
    return TrainConfig(**{**base, **kw})


def quiet(*_) -> None:
    pass


def one_line(p) -> str:
    assert "Traceback" not in p.stderr, p.stderr
    assert p.stderr.count("\n") == 1, p.stderr
    return p.stderr


def test_a_run_leaves_files_with_the_users_umask_and_no_temporaries(qwen2_path, chats, tmp_path):
    """(10) adapters, report, loss curve and checkpoints are written 0666 less the umask."""
    old = os.umask(0o022)
    try:
        train_run(quick(qwen2_path, chats, tmp_path / "r", iters=1), echo=quiet)
    finally:
        os.umask(old)
    files = [p for p in (tmp_path / "r").rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"adapters.safetensors", "report.json", "loss.png"}
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in files), [
        (p.name, oct(p.stat().st_mode)) for p in files
    ]
    assert not [p for p in (tmp_path / "r").rglob(".*")]


# --- (1) the mlx-lm drop-in's --test -------------------------------------------------------------


def lora_main(capsys, *args) -> tuple[int, str, str]:
    code = lora.main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_lora_test_scores_the_adapter_it_is_given_and_writes_nothing(
    qwen2_path, chats, tmp_path, capsys
):
    ad = tmp_path / "ad"
    common = ["--model", qwen2_path, "--data", chats, "--chunk", 64]
    code, _, err = lora_main(
        capsys,
        *common,
        "--train",
        "--iters",
        3,
        "--learning-rate",
        3e-2,
        "--num-layers",
        2,
        "--adapter-path",
        ad,
    )
    assert code == 0, err
    config = (ad / "adapter_config.json").read_bytes()

    def test_loss(path):
        code, out, err = lora_main(capsys, *common, "--test", "--adapter-path", path)
        assert code == 0, err
        return float(out.split("Test loss ")[1].split(",")[0]), out

    tuned, out = test_loss(ad)
    base, _ = test_loss("")
    assert "Testing the adapter in" in out and abs(tuned - base) > 1e-3
    assert (ad / "adapter_config.json").read_bytes() == config  # a test run writes nothing
    code, _, err = lora_main(capsys, *common, "--test", "--adapter-path", tmp_path / "nowhere")
    assert code == 2 and "has no adapter_config.json" in err and err.count("\n") == 1
    assert not (tmp_path / "nowhere").exists()
    code, _, err = lora_main(capsys, *common, "--adapter-path", tmp_path / "neither")
    assert code == 2 and "give --train, --test or both" in err
    assert not (tmp_path / "neither").exists()


# --- (2) and (3): whose folder, whose checkpoint -------------------------------------------------


def test_a_fresh_run_refuses_a_folder_holding_another_run_unless_told(qwen2_path, chats, tmp_path):
    out = tmp_path / "r"
    train_run(quick(qwen2_path, chats, out, iters=1), echo=quiet)
    adapter = (out / "adapters.safetensors").read_bytes()
    with pytest.raises(PlanError, match="holds another run .*--resume.*--overwrite"):
        run.Run(quick(qwen2_path, chats, out, iters=1), echo=quiet)
    assert (out / "adapters.safetensors").read_bytes() == adapter
    old_id = json.loads((out / "run.json").read_text())["run"]
    train_run(quick(qwen2_path, chats, out, iters=2, overwrite=True), echo=quiet)
    new = json.loads((out / "run.json").read_text())["run"]
    assert new != old_id
    states = [json.loads((p / "state.json").read_text()) for p in (out / "checkpoints").iterdir()]
    assert states and all(s["run"] == new for s in states)


def test_resume_refuses_a_complete_run_and_extends_with_more_iters(qwen2_path, chats, tmp_path):
    out = tmp_path / "r"
    train_run(quick(qwen2_path, chats, out, iters=2), echo=quiet)
    with pytest.raises(PlanError, match="already trained the 2 windows --iters asks for; raise"):
        run.Run(quick(qwen2_path, chats, out, iters=2, resume=True), echo=quiet)
    lines = []
    report = train_run(quick(qwen2_path, chats, out, iters=3, resume=True), echo=lines.append)
    assert any("resumed from" in line and "window 2" in line for line in lines)
    assert report["windows"] == 3


def test_a_run_stopped_at_its_last_window_resumes_to_close_it(
    qwen2_path, chats, tmp_path, monkeypatch
):
    """Ctrl-C in the last epoch's evaluation: the windows are all trained, the epoch is not
    closed, no report: --resume closes it and writes the adapter and report."""
    out = tmp_path / "r"

    def interrupted(self):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(run.Run, "evaluate", interrupted)
        with pytest.raises(KeyboardInterrupt, match="--resume"):
            train_run(quick(qwen2_path, chats, out, save_every=1), echo=quiet)
    assert not (out / "report.json").exists()
    report = train_run(quick(qwen2_path, chats, out, save_every=1, resume=True), echo=quiet)
    assert report["windows"] == 4 and [e["epoch"] for e in report["epochs"]] == [1]
    assert (out / "adapters.safetensors").exists()


def test_a_resume_takes_the_learning_rate_it_is_given_and_says_so(qwen2_path, chats, tmp_path):
    out = tmp_path / "r"
    train_run(quick(qwen2_path, chats, out, iters=1), echo=quiet)
    lines = []
    r = run.Run(quick(qwen2_path, chats, out, iters=2, lr=5e-5, resume=True), echo=lines.append)
    assert float(r.fw.optimizer.learning_rate) == pytest.approx(5e-5)
    assert any("learning rate 5e-05 from here on (the run's was 0.001)" in line for line in lines)


def test_an_overwrite_that_fails_before_its_first_checkpoint_puts_the_old_run_back(
    qwen2_path, chats, tmp_path, monkeypatch
):
    out = tmp_path / "r"
    train_run(quick(qwen2_path, chats, out, iters=1), echo=quiet)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    poison_window(monkeypatch, {1})
    with pytest.raises(NonFinite):
        train_run(quick(qwen2_path, chats, out, iters=2, overwrite=True), echo=quiet)
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rank": 4}, "trained with --rank 8; this one asks for 4"),
        ({"num_layers": 1}, "trained with --num-layers 2"),
        ({"walk": "plain"}, "trained with --walk exact"),
        ({"seed": 5}, "trained with --seed 0"),
        ({"model": "twin"}, "trained on model"),
        ({"model": "other"}, "trained on model"),
        ({"data": "changed"}, "trained on other data"),
    ],
)
def test_resume_refuses_another_model_layout_walk_or_data_by_name(
    qwen2_path, chats, tmp_path, tmp_path_factory, change, message
):
    out = tmp_path / "r"
    train_run(quick(qwen2_path, chats, out, iters=1, epochs=2), echo=quiet)
    before = sorted(p.name for p in out.rglob("*"))
    if change.get("model") == "twin":  # the same names and shapes, other weights
        change = {"model": variant(tmp_path_factory, "twin", seed=7)}
    elif change.get("model") == "other":
        change = {"model": variant(tmp_path_factory, "other", hidden_size=128, seed=7)}
    elif change.get("data"):
        d = rows(tmp_path / "d2", "train.jsonl", [chat(i, 2) for i in range(1, 5)])
        rows(d, "valid.jsonl", [chat(9, 2)])
        change = {"data": str(d)}
    data = change.pop("data", chats)
    with pytest.raises(PlanError, match=message):
        run.Run(quick(qwen2_path, data, out, epochs=2, resume=True, **change), echo=quiet)
    assert sorted(p.name for p in out.rglob("*")) == before


def test_resume_loads_its_checkpoint_strictly(qwen2_path, chats, tmp_path):
    out = tmp_path / "r"
    train_run(quick(qwen2_path, chats, out, iters=1, epochs=2), echo=quiet)
    (last,) = [p for p in (out / "checkpoints").iterdir()]
    weights = mx.load(str(last / "adapters.safetensors"))
    name = sorted(weights)[0]
    weights[name] = weights[name][:, :4]  # another rank's shape
    mx.save_safetensors(str(last / "adapters.safetensors"), weights)
    with pytest.raises(PlanError, match=f"adapter tensor {name} has shape"):
        run.Run(quick(qwen2_path, chats, out, epochs=2, resume=True), echo=quiet)


# --- (4) NaN and infinity ------------------------------------------------------------------------


def poison_window(monkeypatch, at: set[int]):
    """Windows (1-based) whose adapter gets a NaN just before the walk: a stand-in for a
    learning rate that has blown up."""
    seen = [0]

    def poisoned(real):  # the plain walk's train_window, the exact walk's exact_gradient
        def walk(model, *a, **kw):
            seen[0] += 1
            if seen[0] in at:
                flat = __import__("mlx.utils").utils.tree_flatten(model.trainable_parameters())
                (name, p), *_ = flat
                model.load_weights([(name, mx.full(p.shape, float("nan")))], strict=False)
            return real(model, *a, **kw)

        return walk

    monkeypatch.setattr(mlx_framework, "train_window", poisoned(mlx_framework.train_window))
    monkeypatch.setattr(mlx_framework, "exact_gradient", poisoned(mlx_framework.exact_gradient))


@pytest.mark.parametrize("walk", ["exact", "plain"])
def test_a_non_finite_window_stops_before_its_step_and_keeps_the_last_checkpoint(
    qwen2_path, chats, tmp_path, monkeypatch, walk
):
    out = tmp_path / "r"
    poison_window(monkeypatch, {3})
    cfg = quick(qwen2_path, chats, out, iters=4, save_every=1, walk=walk)
    saved = out / "checkpoints" / "window-0000002" / "adapters.safetensors"
    with pytest.raises(NonFinite, match=r"window 3 \(epoch 1, .*train.jsonl:\d+\).*loss is nan"):
        train_run(cfg, echo=quiet)
    kept = mx.load(str(saved))
    assert all(np.isfinite(np.asarray(v)).all() for v in kept.values())
    assert not (out / "adapters.safetensors").exists()  # no adapter of NaNs
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "window-0000001",
        "window-0000002",
    ]


def test_on_nan_skip_skips_the_window_with_the_adapter_unchanged(
    qwen2_path, chats, tmp_path, monkeypatch
):
    poison_window(monkeypatch, {2})
    lines = []
    report = train_run(
        quick(qwen2_path, chats, tmp_path / "r", iters=4, on_nan="skip"), echo=lines.append
    )
    assert report["windows_skipped_non_finite"] == 1 and report["windows"] == 4
    assert any("window 2" in line and "skipped" in line for line in lines)
    weights = mx.load(str(tmp_path / "r" / "adapters.safetensors"))
    assert all(np.isfinite(np.asarray(v)).all() for v in weights.values())


def test_a_learning_rate_that_wrecks_the_model_is_said_so(qwen2_path, chats, tmp_path):
    """--lr 1e6 is announced before training, and a loss that climbs to ln(vocabulary) from well
    below it is announced when it happens."""
    lines = []
    r = run.Run(quick(qwen2_path, chats, tmp_path / "r", lr=1e6), echo=lines.append)
    assert any("--lr 1e+06 is far above" in line for line in lines)
    uniform = math.log(r.fw.layout.vocab)
    where = r.train_set.examples[0].where
    r.watch.collapse(1, where, 0.5 * uniform)
    r.watch.collapse(2, where, 0.7 * uniform)
    assert not any("diverged" in line for line in lines)
    r.watch.collapse(3, where, uniform + 0.01)
    assert any("training has diverged" in line for line in lines)


# --- (5) token ids within the vocabulary ---------------------------------------------------------


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory) -> str:
    return variant(tmp_path_factory, "vocab212", vocab_size=212)


def test_probes_draw_ids_the_model_has(small_vocab, monkeypatch):
    from mlxwalk.commands import walk_exact as exactness

    model, _ = mlx_lm.load(small_vocab)
    seen = []
    real = probes.measure

    def spy(model, chunk, far, peak, echo=None):
        def peak_seen(ids, n, horizon):
            seen.append(int(np.max(ids[: n + 1])))
            return peak(ids, n, horizon)

        return real(model, chunk, far, peak_seen, echo)

    monkeypatch.setattr(probes, "measure", spy)
    monkeypatch.setattr(probes, "TILE", 64)  # a short probe: only its ids are looked at
    monkeypatch.setattr(probes, "_probes", {})  # a fresh cache, the shared one kept
    acts = probe(model, WalkConfig(chunk=64))
    assert seen and max(seen) < 212 and acts.graph < 256 * MIB
    table = exactness.Table(exactness.prepare(model), "vocab212")
    assert max(table.x.max(), table.y.max()) < 212


def test_ids_outside_the_vocabulary_are_refused_before_mlx_sees_them(small_vocab, chats, tmp_path):
    model, _ = mlx_lm.load(small_vocab)
    with pytest.raises(PlanError, match="token id 300 is outside the model's vocabulary of 212"):
        window_gradient(model, [1, 300, 5], [300, 5, 7], [1, 1, 1], chunk=2)
    cfg = quick(small_vocab, chats, tmp_path / "r")
    with pytest.raises(ValueError, match=r"train.jsonl:\d+: token id \d+ is outside .* of 212 ids"):
        run.Run(cfg, echo=quiet)
    assert not (tmp_path / "r").exists()


# --- (6) the memory budget holds, or the run is refused ------------------------------------------


@pytest.mark.parametrize("model", ["qwen2", "hybrid"])
def test_the_memory_budget_bounds_the_measured_peak_or_refuses(measured, model):
    """A budget halfway between what the walk needs with one chunk of taps and with all of them:
    it holds (within the stated margin) by narrowing the horizon under MLX's memory limit. One
    below the least is refused before any array of the window exists."""
    from .test_budget import budgets

    model = measured[model]
    ids = np.random.default_rng(0).integers(0, 320, 1537)
    window = Window.of(ids[:-1], ids[1:], np.ones(1536))
    least, full = budgets(model, 1536, 256)
    cap = (least + full) / 2
    lossless = dict(cache_type="float32", accumulator_dtype="float32")  # narrowed, not lossy
    config = WalkConfig(chunk=256, memory_budget_mib=cap / MIB, **lossless)
    walk = ExactWalk(model, window, config)
    mx.clear_cache()
    mx.reset_peak_memory()
    walk.run()
    held = mx.get_peak_memory()
    assert held <= cap * (1 + BUDGET_MARGIN), (held / MIB, cap / MIB, full / MIB)
    # it had to give something up, and said so: a narrowed horizon, or (the hybrid) a longer
    # checkpoint stride that keeps it exact
    assert 0 < walk.horizon_used < 1536 or walk.given_up, walk.given_up
    with pytest.raises(OutOfMemory, match="device memory: the walk needs .* memory budget is"):
        config = WalkConfig(chunk=256, memory_budget_mib=least * 0.9 / MIB, **lossless)
        ExactWalk(model, window, config)


@pytest.mark.parametrize("recompute", [False, True])
def test_a_window_leaves_nothing_alive_behind_it(hybrid, recompute):
    """What a window's walk made is freed when it ends (traced arrays keep a chunk's caches alive
    from C++ unless the caches let go of them): otherwise the next window starts above budget."""
    import gc

    import mlx.optimizers as optim

    ids = np.random.default_rng(0).integers(0, 320, 1025)
    window = Window.of(ids[:-1], ids[1:], np.ones(1024))
    optimizer = optim.Adam(learning_rate=1e-5)
    optimizer.init(hybrid.trainable_parameters())
    mx.eval(optimizer.state)
    gc.collect()
    before = mx.get_active_memory()
    for _ in range(2):
        mlx_framework.train_window(
            hybrid, optimizer, window, WalkConfig(chunk=256, recompute=recompute)
        )
    gc.collect()
    assert mx.get_active_memory() - before < 0.05 * MIB


# --- (7) the 8-bit cache only where the heads allow it -------------------------------------------


@pytest.fixture(scope="module")
def narrow_heads(tmp_path_factory) -> str:
    return variant(tmp_path_factory, "head16", hidden_size=64, intermediate_size=128)


def test_q8_is_refused_and_not_offered_for_heads_mlx_cannot_quantize(narrow_heads, chats, tmp_path):
    with pytest.raises(PlanError, match="--cache-type q8 needs head dimensions .* are 16"):
        run.Run(quick(narrow_heads, chats, tmp_path / "r", cache_type="q8"), echo=quiet)
    assert not (tmp_path / "r").exists()
    model, _ = mlx_lm.load(narrow_heads)
    from mlxwalk.walk import arch

    assert "q8" not in budget.what_fits(arch.inspect(model), "float32")


def test_test_walk_exact_prints_every_row_on_such_a_model(narrow_heads, capsys):
    from mlxwalk.commands import walk_exact as exactness

    ok = exactness.table([("head16", narrow_heads)], as_json=True)
    out = json.loads(capsys.readouterr().out)
    assert ok and out["ok"] and len(out["rows"]) == 17
    (q8,) = [r for r in out["rows"] if "q8" in r["what"]]
    assert "not offered" in q8["detail"]


# --- (8) nothing changes in the data without a word ----------------------------------------------


def test_cuts_and_skips_are_announced_with_counts(qwen2_path, tmp_path):
    items = [chat(i, 2) for i in range(3)] + [{"messages": [{"role": "user", "content": "hi"}]}]
    d = rows(tmp_path / "d", "train.jsonl", items)
    lines = []
    r = run.Run(quick(qwen2_path, d, tmp_path / "r", window=96, val_split=0), echo=lines.append)
    text = "\n".join(lines)
    assert "1 training row(s) skipped, no labelled token: " in text and "train.jsonl:4" in text
    assert "3 training example(s) longer than the window of 96 tokens cut (--fit left)" in text
    assert r.train_set.truncated == 3


def test_a_window_that_cuts_every_label_away_says_so(qwen2_path, chats, tmp_path):
    with pytest.raises(
        PlanError,
        match="every training example lost its labelled tokens when cut "
        "to the window of 16 tokens .*--fit middle",
    ):
        run.Run(quick(qwen2_path, chats, tmp_path / "r", window=16), echo=quiet)


def test_a_misspelt_role_is_refused_by_file_and_line(qwen2_path, tmp_path):
    bad = chat(1, 2)
    bad["messages"][2]["role"] = "assistnat"
    d = rows(tmp_path / "d", "train.jsonl", [chat(0, 2), bad])
    with pytest.raises(ValueError, match=r"train.jsonl:2: message 2 has role 'assistnat'"):
        run.Run(quick(qwen2_path, d, tmp_path / "r"), echo=quiet)


def test_the_drop_in_announces_max_seq_length_cuts(qwen2_path, chats, tmp_path, capsys):
    code, out, err = lora_main(
        capsys,
        "--model",
        qwen2_path,
        "--data",
        chats,
        "--train",
        "--iters",
        1,
        "--max-seq-length",
        32,
        "--chunk",
        32,
        "--num-layers",
        2,
        "--adapter-path",
        tmp_path / "ad",
    )
    assert code == 0, err
    assert "[WARNING] 4 of 4 training items are longer than max_seq_length (32)" in out


# --- (9) values that make no sense, refused by flag ----------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "--rank", "0"], "--rank must be at least 1, got 0"),
        (["train", "--rank", "-1"], "--rank must be at least 1, got -1"),
        (["train", "--iters", "-1"], "--iters must be at least 1, got -1"),
        (["train", "--save-every", "-1"], "--save-every must be at least 0"),
        (["train", "--lr", "-1"], "--lr must be a positive, finite number, got -1.0"),
        (["train", "--lr", "nan"], "--lr must be a positive, finite number, got nan"),
        (["train", "--dropout", "1.5"], "--dropout must be in [0, 1), got 1.5"),
        (["train", "--num-layers", "0"], "--num-layers must be at least 1 (or -1 for all)"),
        (
            ["train", "--targets", "foo.bar", "--num-layers", "2"],
            "--targets: 'foo.bar' is not a linear layer of the adapted layers",
        ),
        (["train", "--resume", "--overwrite"], "give one"),
        (["train", "--on-nan", "ignore"], "--on-nan 'ignore' is unknown"),
        (["train", "--seed", "-1"], "--seed must be between 0 and 4294967295 (2^32 - 1), got -1"),
        (["plan", "--window", "-256", "--chunk", "64"], "--window must be at least 1, got -256"),
        (["plan", "--window", "256", "--chunk", "0"], "--chunk must be at least 1, got 0"),
    ],
)
def test_option_values_are_range_checked_by_flag(args, message, tmp_path, capsys):
    if args[0] == "train":
        args = [*args, "--no-progress", "--adapter-path", str(tmp_path / "r")]
    code = cli.main(args)
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--iters", "0"], "--iters must be at least 1, got 0"),
        (["--learning-rate", "-1"], "--learning-rate must be a positive, finite number"),
        (["--max-seq-length", "0"], "--max-seq-length must be at least 1"),
    ],
)
def test_drop_in_values_are_range_checked_by_flag(args, message, chats, tmp_path, capsys):
    code, _, err = lora_main(
        capsys,
        "--model",
        "tiny-qwen2",
        "--train",
        "--data",
        chats,
        "--adapter-path",
        tmp_path / "ad",
        *args,
    )
    assert code == 2 and message in err, err
    assert not (tmp_path / "ad").exists()


# --- (10) failures leave nothing; interruptions say how to go on ---------------------------------


def test_a_run_that_fails_before_its_first_checkpoint_leaves_no_folder(
    qwen2_path, chats, tmp_path, monkeypatch
):
    poison_window(monkeypatch, {1})
    with pytest.raises(NonFinite, match="Nothing was saved"):
        train_run(quick(qwen2_path, chats, tmp_path / "a" / "r", iters=2), echo=quiet)
    assert not (tmp_path / "a").exists()


def test_a_failed_drop_in_run_leaves_no_adapter_config(qwen2_path, chats, tmp_path, capsys):
    """Every item's labels lie past max_seq_length: the run fails at its first iteration."""
    code, _, err = lora_main(
        capsys,
        "--model",
        qwen2_path,
        "--data",
        chats,
        "--train",
        "--iters",
        2,
        "--max-seq-length",
        4,
        "--mask-prompt",
        "--num-layers",
        2,
        "--adapter-path",
        tmp_path / "ad",
    )
    assert code == 2 and "the batch has no labelled token within max_seq_length (4)" in err, err
    assert not (tmp_path / "ad" / "adapter_config.json").exists()


def test_leftovers_of_a_killed_writer_are_swept_on_resume(qwen2_path, chats, tmp_path):
    out = tmp_path / "r"
    train_run(quick(qwen2_path, chats, out, iters=1), echo=quiet)
    (out / ".loss.png.tmp-abc123.png").write_bytes(b"half a png")
    (out / "checkpoints" / ".window-0000009.tmp-new").mkdir()
    train_run(quick(qwen2_path, chats, out, iters=2, resume=True), echo=quiet)
    assert not [p for p in out.rglob(".*")]


def progress_until(proc, text: str, limit: float = 180) -> list[str]:
    seen, deadline = [], time.time() + limit
    while time.time() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        seen.append(line)
        if text in line:
            return seen
    raise AssertionError(f"{text!r} never appeared: {seen[-5:]}")


def test_ctrl_c_saves_the_windows_trained_and_says_how_to_resume(qwen2_path, tmp_path):
    d = rows(tmp_path / "d", "train.jsonl", [chat(i, 6) for i in range(8)])
    out = tmp_path / "r"
    args = [
        "--model",
        qwen2_path,
        "--data",
        str(d),
        "--chunk",
        "64",
        "--epochs",
        "1",
        "--adapter-path",
        str(out),
        "--val-split",
        "0",
    ]

    # A shell's background job inherits SIGINT ignored, and Python then keeps ignoring it: the
    # run gets the default (KeyboardInterrupt), as it has at a terminal.
    def interruptible():
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxwalk", "train", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=interruptible,
    )
    progress_until(proc, "window 2/8")
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("mlxwalk: interrupted at window ") and "--resume --adapter-path" in last
    assert "Traceback" not in err
    done = int(last.split("at window ")[1].split()[0])
    assert (out / "checkpoints" / f"window-{done:07d}").exists()
    resumed = subprocess.run(
        [sys.executable, "-m", "mlxwalk", "train", "--no-progress", *args, "--resume"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((out / "report.json").read_text())["windows"] == 8


def test_a_drop_in_run_killed_mid_training_leaves_a_loadable_adapter(qwen2_path, chats, tmp_path):
    """The SIGKILL test, for python -m mlxwalk.lora: whatever moment the kill comes, the folder
    holds an adapter mlx-lm loads (with its config) and no temporary file; it resumes."""
    ad = tmp_path / "ad"
    args = [
        "--model",
        qwen2_path,
        "--data",
        str(chats),
        "--train",
        "--chunk",
        "64",
        "--num-layers",
        "2",
        "--save-every",
        "1",
        "--steps-per-eval",
        "1000",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxwalk.lora", *args, "--iters", "40", "--adapter-path", str(ad)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    deadline = time.time() + 120
    while not (ad / "0000002_adapters.safetensors").exists():
        assert time.time() < deadline and proc.poll() is None, "no adapter appeared"
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    # nothing half-written; the killed run's lock file may stay, no longer held by anyone
    leftovers = [p.name for p in ad.iterdir() if p.name.startswith(".")]
    assert leftovers in ([], [FolderLock.NAME]), leftovers
    model, _ = mlx_lm.load(qwen2_path, adapter_path=str(ad))
    assert model.layers[-1].self_attn.q_proj.lora_a.shape[-1] == 8
    resumed = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlxwalk.lora",
            *args,
            "--iters",
            "1",
            "--adapter-path",
            str(ad),
            "--resume-adapter-file",
            str(ad / "adapters.safetensors"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert not [p for p in ad.iterdir() if p.name.startswith(".")]  # the stale lock taken, let go


# --- optimization options of mlxwalk train -------------------------------------------------------


def test_schedule_warmup_clipping_and_evals_between(qwen2_path, chats, tmp_path):
    lines = []
    r = run.Run(
        quick(
            qwen2_path,
            chats,
            tmp_path / "r",
            epochs=2,
            lr_schedule="cosine_decay",
            warmup=2,
            grad_clip=0.5,
            optimizer="adamw",
            weight_decay=0.01,
            steps_per_eval=3,
        ),
        echo=lines.append,
    )
    assert r.setup.windows.steps == 8  # 4 windows, 2 epochs: the schedule decays over every step
    rates = [float(r.fw.optimizer.learning_rate)]
    report = r.train()
    rates.append(float(r.fw.optimizer.learning_rate))
    assert rates[0] == 0.0 and 0 < rates[1] < 1e-3  # warmed up from 0, decayed from the peak
    assert [w for w, _ in report["evals_between"]] == [3, 6]  # not at 4 and 8: epoch ends
    assert any(line.startswith("window 3: eval_loss") for line in lines)
    assert len(report["window_losses"]) == 8


def test_grad_clip_bounds_the_step(qwen2):
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten

    from mlxwalk.walk import train_window

    ids = np.random.default_rng(0).integers(0, 256, 129)
    window = Window.of(ids[:-1], ids[1:], np.ones(128))
    before = [v for _, v in tree_flatten(qwen2.trainable_parameters())]
    train_window(qwen2, optim.SGD(learning_rate=1.0), window, WalkConfig(chunk=32), clip=1e-3)
    after = [v for _, v in tree_flatten(qwen2.trainable_parameters())]
    step = np.sqrt(sum(float(((a - b) ** 2).sum()) for a, b in zip(after, before)))
    assert step == pytest.approx(1e-3, rel=1e-3)  # the whole step's norm is the clip
