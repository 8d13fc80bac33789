#!/usr/bin/env python3
"""Does the exact walk learn what chunk-cut trainers cannot? Recall, measured.

A code letter is stated in a conversation's first chunk and asked for in its last; only the answer
is labelled (mlxwalk/recall.py; 8 chunks to a window, the fact in the first, the answer in the
last). A small qwen2 (2 layers of width 64, output head untied), randomly initialised, is trained
in full on the same conversations, from the same init and at the same schedule (Adam, warmup then
cosine, gradient clipped to norm 1, one window per step), by each trainer:

  one-graph  the whole window as one graph (the reference)
  exact      the exact walk in chunks of --chunk (one step per window, the whole window's gradient)
  plain      the plain walk (a step per labelled chunk, the gradient cut at chunk boundaries)
  peer       mlx-lm-lora's long-context mode (installed on demand into runs/peer/site)

After each epoch, on held-out conversations: exact-match accuracy (the greedy answer given the
true prefix) and the answer's loss (chance: 1/16 and ln 16 = 2.77).

    scripts/recall.py [--seeds 3] [--epochs 4] [--trainers one-graph,exact,plain,peer]
                      [--json runs/recall/recall.json] [--plot docs/recall.png] [--quick]

The defaults take about 35 minutes on 2 CPU cores (docs/RECALL.md).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The model's matrices are small: OpenBLAS's threads only spin against each other (and against
# anything else on the cores), 2-30x slower than one thread here.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before MLX loads OpenBLAS: the imports wait

import mlx.core as mx  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402
from lib import recall  # noqa: E402
from mlx import nn  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

import mlxwalk  # noqa: E402
from mlxwalk.training import files  # noqa: E402
from mlxwalk.training.mlx_framework import MLXFramework, WindowStep  # noqa: E402
from mlxwalk.training.ranks import Ranks  # noqa: E402
from mlxwalk.walk import WalkConfig, Window  # noqa: E402
from mlxwalk.walk.api import apply_step, one_graph  # noqa: E402

mlxwalk.use_openblas()  # MLX's CPU matrix products on OpenBLAS (mlxwalk/_blas.py)

TRAINERS = ("one-graph", "exact", "plain", "peer")
VALID_SEED = 10_000  # held-out conversations come from their own seed


def build_model(seed: int, width: int, layers: int, tied: bool = False, rope_theta: float = 1e4):
    """A qwen2 in the tiny models' byte vocabulary, randomly initialised from `seed`, every weight
    trainable (there is no pretrained model to adapt, and LoRA on a random model learns little).

    The output head is untied by default: tied, training the answer's output row also moves the
    code letters' input embedding, so a chunk-cut trainer changes the fact's K/V without a
    gradient through them (measured: plain walk 0.52-0.65 accuracy after 2,000 windows tied,
    chance untied). Untied, the test reads the gradient cut alone; --tied shows the other."""
    from mlx_lm.models import qwen2

    args = qwen2.ModelArgs.from_dict(
        {
            "model_type": "qwen2",
            "vocab_size": 320,
            "hidden_size": width,
            "intermediate_size": 2 * width,
            "num_hidden_layers": layers,
            "num_attention_heads": max(width // 32, 1),
            "num_key_value_heads": max(width // 64, 1),
            "rms_norm_eps": 1e-6,
            "rope_theta": rope_theta,
            "max_position_embeddings": 131072,
            "tie_word_embeddings": tied,
        }
    )
    mx.random.seed(seed)
    model = qwen2.Model(args)
    mx.eval(model.parameters())
    model.unfreeze()
    return model


def window_of(data: dict, i: int) -> Window:
    """Conversation `i` of a `recall.dataset` as a window."""
    return Window.of(*(data[k][i] for k in ("inputs", "targets", "weights")))


EVAL_POSITIONS = 32768  # positions one held-out forward holds at once


def evaluate(model, data: dict, batch: int = 32) -> tuple[float, float, float]:
    """Held-out (accuracy, answer loss, the share of answers that are a stated letter): one
    forward over each batch of windows; only the answer's column (the last) of the logits is
    kept. A batch holds at most EVAL_POSITIONS positions (one graph's scores at 16K, 32 windows
    at once, overran an H200)."""
    logits = []
    batch = max(1, min(batch, EVAL_POSITIONS // data["inputs"].shape[1]))
    for i in range(0, len(data["inputs"]), batch):
        out = model(mx.array(data["inputs"][i : i + batch]))[:, -1:]  # (b, 1, vocab)
        mx.eval(out)
        logits.append(np.array(out.astype(mx.float32)))
    logits = np.concatenate(logits)  # (count, 1, vocab)
    accuracy, loss = recall.answer_scores(logits, data["targets"][:, -1:], data["weights"][:, -1:])
    stated, _ = recall.stated_scores(logits[:, -1].argmax(-1), data["inputs"])
    return accuracy, loss, stated


class ClippedAdam(optim.Adam):
    """Adam on the gradient clipped to a global L2 norm: inside the optimizer, so that every
    trainer (the peer's own loop included) clips alike."""

    def __init__(self, clip: float | None, **kwargs):
        super().__init__(**kwargs)
        self.clip = clip

    def update(self, model, gradients: dict) -> None:
        if self.clip is not None:
            gradients, _ = optim.clip_grad_norm(gradients, self.clip)
        super().update(model, gradients)


def schedule(lr: float, steps: int, warmup: int):
    """Linear warmup, then cosine to a tenth: the same for every trainer."""
    warm = optim.linear_schedule(lr / 100, lr, max(warmup, 1))
    decay = optim.cosine_decay(lr, max(steps - warmup, 1), lr / 10)
    return optim.join_schedules([warm, decay], [max(warmup, 1)])


def train(trainer: str, seed: int, train_set: dict, valid_set: dict, a) -> dict:
    """One trainer, one seed: per epoch, held-out accuracy and loss, seconds, peak memory."""
    model = build_model(seed, a.width, a.layers, a.tied)
    steps = a.epochs * len(train_set["inputs"])
    optimizer = ClippedAdam(a.clip, learning_rate=schedule(a.lr, steps, a.warmup))
    config = WalkConfig(chunk=a.chunk, follow_runs=False)  # fixed chunks, as training cuts them
    step = make_step(trainer, model, optimizer, config, a)
    order = np.random.default_rng(seed)
    acc, loss, stated = evaluate(model, valid_set)
    epochs = [
        {
            "epoch": 0,
            "accuracy": acc,
            "loss": loss,
            "stated": stated,
            "seconds": 0.0,
            "peak_mib": 0.0,
        }
    ]
    print(f"  {trainer} seed {seed} epoch 0: acc {acc:.3f} loss {loss:.3f}", flush=True)
    for epoch in range(1, a.epochs + 1):
        mx.reset_peak_memory()
        start, train_loss = time.perf_counter(), 0.0
        for i in order.permutation(len(train_set["inputs"])):
            train_loss += step(window_of(train_set, int(i)))
        seconds = time.perf_counter() - start
        peak = mx.get_peak_memory() / 2**20
        acc, loss, stated = evaluate(model, valid_set)
        epochs.append(
            {
                "epoch": epoch,
                "accuracy": acc,
                "loss": loss,
                "stated": stated,
                "seconds": seconds,
                "peak_mib": peak,
                "train_loss": train_loss / len(train_set["inputs"]),
            }
        )
        print(
            f"  {trainer} seed {seed} epoch {epoch}: acc {acc:.3f} loss {loss:.3f} "
            f"stated {stated:.3f} train {epochs[-1]['train_loss']:.3f} {seconds:.0f}s "
            f"{peak:.0f}MiB",
            flush=True,
        )
    return {"trainer": trainer, "seed": seed, "epochs": epochs}


def make_step(trainer: str, model, optimizer, config: WalkConfig, a):
    """A function that trains on one window and returns its loss (before the step)."""
    if trainer == "one-graph":

        def step(window: Window) -> float:
            loss, grads = one_graph(model, window)
            apply_step(model, optimizer, grads)
            mx.eval(model.parameters(), optimizer.state)
            return loss.item()

    elif trainer in ("exact", "plain"):
        # the training loop's own step (mlxwalk train's, the drop-in's)
        fw = MLXFramework.around(model, optimizer, Ranks(None))
        seeds = iter(range(1 << 62))
        cfg = WindowStep(config, walk=trainer)

        def step(window: Window) -> float:
            stepped = fw.step_window(window, cfg, next(seeds))
            if not stepped.finite:
                raise stepped.error
            return float(stepped.losses[0])

    else:
        step = peer_step(model, optimizer, a)
    return step


def summary(runs: list[dict]) -> list[dict]:
    """Per trainer and epoch: mean, std, min and max over seeds of each measure."""
    rows = []
    for trainer in dict.fromkeys(r["trainer"] for r in runs):
        mine = [r["epochs"] for r in runs if r["trainer"] == trainer]
        for e in range(len(mine[0])):
            row = {"trainer": trainer, "epoch": e, "seeds": len(mine)}
            for key in ("accuracy", "loss", "stated", "seconds", "peak_mib"):
                v = np.array([m[e][key] for m in mine])
                row[key] = {
                    "mean": float(v.mean()),
                    "std": float(v.std()),
                    "min": float(v.min()),
                    "max": float(v.max()),
                }
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    def ms(v: dict, f: str) -> str:
        return f"{v['mean']:{f}} ± {v['std']:{f}}"

    lines = [
        "| trainer | epoch | accuracy (mean ± std) | acc min-max | answer loss "
        "| answer a stated letter | s/epoch | peak MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        a = r["accuracy"]
        lines.append(
            f"| {r['trainer']} | {r['epoch']} | {ms(a, '.3f')} | "
            f"{a['min']:.3f}-{a['max']:.3f} | {ms(r['loss'], '.3f')} | "
            f"{r['stated']['mean']:.3f} | "
            f"{r['seconds']['mean']:.0f} | {r['peak_mib']['mean']:.0f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for trainer in dict.fromkeys(r["trainer"] for r in rows):
        mine = [r for r in rows if r["trainer"] == trainer]
        x = [r["epoch"] for r in mine]
        ax.plot(x, [r["accuracy"]["mean"] for r in mine], marker="o", label=trainer)
        ax.fill_between(
            x, [r["accuracy"]["min"] for r in mine], [r["accuracy"]["max"] for r in mine], alpha=0.2
        )
    ax.axhline(1 / len(recall.CODES), color="gray", linestyle=":", label="chance")
    ax.set(xlabel="epoch", ylabel="held-out exact-match accuracy", ylim=(0, 1.02), title=title)
    ax.set_xticks(range(max(r["epoch"] for r in rows) + 1))
    ax.legend(loc="best")
    fig.tight_layout()
    files.atomic_write(Path(path), lambda tmp: fig.savefig(tmp, dpi=120, format="png"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--trainers", default=",".join(TRAINERS))
    p.add_argument("--train", type=int, default=1000, help="training conversations")
    p.add_argument("--valid", type=int, default=256, help="held-out conversations")
    p.add_argument("--window", type=int, default=recall.WINDOW)
    p.add_argument("--chunk", type=int, default=recall.CHUNK)
    p.add_argument("--fact-within", type=int, default=None, help="default: the chunk")
    p.add_argument(
        "--decoys",
        type=float,
        default=recall.DECOY_RATE,
        help="share of filler turns stating a decoy fact (The gate is K.)",
    )
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument(
        "--tied", action="store_true", help="tie the output head to the embedding (see build_model)"
    )
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--json", default="runs/recall/recall.json")
    p.add_argument("--plot", default=None, help="write accuracy per epoch to this PNG")
    p.add_argument("--quick", action="store_true", help="a tiny smoke run")
    p.add_argument("--from-json", help="no training: the table (and --plot) of a saved run")
    a = p.parse_args(argv)
    if a.quick:
        a.seeds, a.epochs, a.train, a.valid, a.window, a.chunk = 1, 1, 8, 8, 256, 32
        a.width, a.layers, a.warmup = 64, 1, 2
    a.fact_within = a.fact_within or a.chunk
    trainers = a.trainers.split(",")
    if unknown := set(trainers) - set(TRAINERS):
        p.error(f"unknown trainers {sorted(unknown)}; choose from {', '.join(TRAINERS)}")
    if a.chunk * 8 > a.window:
        print(f"note: chunk {a.chunk} is more than an eighth of the window {a.window}")
    if a.from_json:  # the table and plot of a finished run, its settings as it ran
        saved = json.loads(Path(a.from_json).read_text())
        runs, skipped = saved["runs"], saved["skipped"]
        keys = (
            "seeds",
            "window",
            "chunk",
            "fact_within",
            "layers",
            "width",
            "tied",
            "train",
            "lr",
            "valid",
            "decoys",
        )
        vars(a).update({k: saved["settings"][k] for k in keys})
        a.json = None
    else:
        runs, skipped = run_all(a, trainers)
    rows = summary(runs)
    n_params = sum(
        v.size for _, v in tree_flatten(build_model(0, a.width, a.layers, a.tied).parameters())
    )
    title = f"recall: window {a.window}, chunk {a.chunk}, fact < {a.fact_within}, {a.seeds} seeds"
    print(
        f"\n{title}; qwen2 {a.layers}x{a.width} ({n_params / 1e6:.2f}M params, full training), "
        f"{a.train} conversations, lr {a.lr}, Adam; chance: accuracy {1 / len(recall.CODES):.3f},"
        f" loss {recall.CHANCE_LOSS:.2f}; one of the stated letters at random: accuracy "
        f"{guess_among_stated(a):.3f}"
    )
    print(table(rows))
    for trainer, reason in skipped.items():
        print(f"{trainer}: left out ({reason})")
    if a.json:
        write(a, runs, skipped, rows)
        print(f"JSON: {a.json}")
    if a.plot:
        plot(rows, a.plot, title)
        print(f"plot: {a.plot}")
    return 0


def guess_among_stated(a) -> float:
    """The held-out accuracy of answering with one of the letters the conversation states (the
    code's or a decoy's) at random: what copying a stated letter, without recall, scores."""
    valid_set = recall.dataset(VALID_SEED, a.valid, a.window, a.fact_within, a.decoys)
    return recall.stated_scores(valid_set["codes"], valid_set["inputs"])[1]


def run_all(a, trainers: list[str]) -> tuple[list[dict], dict]:
    """Every trainer on every seed: each seed's data and init shared by its trainers."""
    skipped = {}
    if "peer" in trainers:
        reason = prepare_peer(a)
        if reason:
            skipped["peer"] = reason
            trainers.remove("peer")
            print(f"peer left out: {reason}", flush=True)
    valid_set = recall.dataset(VALID_SEED, a.valid, a.window, a.fact_within, a.decoys)
    runs = []
    for seed in range(a.seeds):
        train_set = recall.dataset(seed, a.train, a.window, a.fact_within, a.decoys)
        for trainer in trainers:
            runs.append(train(trainer, seed, train_set, valid_set, a))
            if a.json:
                write(a, runs, skipped)
    return runs, skipped


def write(a, runs: list[dict], skipped: dict, rows: list[dict] | None = None) -> None:
    settings = {k: v for k, v in vars(a).items() if k not in ("json", "plot")}
    out = {
        "settings": settings,
        "chance": {"accuracy": 1 / len(recall.CODES), "loss": recall.CHANCE_LOSS},
        "runs": runs,
        "summary": rows,
        "skipped": skipped,
    }
    files.write_text(Path(a.json), json.dumps(out, indent=1))  # whole or not at all


PEER_SITE = ROOT / "runs" / "peer" / "site"


def prepare_peer(a) -> str | None:
    """Install mlx-lm-lora (no dependencies: it runs on this venv's mlx-lm) into runs/peer/site
    once and put it on the path; the reason it cannot run, or None."""
    import subprocess

    if not (PEER_SITE / "mlx_lm_lora").exists():
        print(f"installing mlx-lm-lora into {PEER_SITE}", flush=True)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--target",
            str(PEER_SITE),
            "--no-deps",
            "mlx-lm-lora",
        ]
        if subprocess.run(cmd).returncode != 0:
            return "pip could not install mlx-lm-lora"
    sys.path.insert(0, str(PEER_SITE))
    try:
        from mlx_lm_lora.trainer import sft_trainer  # noqa: F401
    except ImportError as e:
        return f"mlx-lm-lora does not import: {e}"
    return None


def peer_step(model, optimizer, a):
    """mlx-lm-lora's long-context mode (`train_sft` with `seq_step_size`): the window in chunks
    of --chunk through one mlx-lm KV cache, each chunk's gradient taken with the cache's K/V as
    constants, the chunks' gradients averaged by labelled tokens, one optimizer step per window.
    Driven through `train_sft` itself, one iteration per call, with two shims:
    - `mx.set_wired_limit(mx.device_info()["max_recommended_working_set_size"])` is a Metal
      setting: on the CPU the key is missing, so the call is made a no-op;
    - its loss divides by the chunk's labelled tokens, 0/0 = NaN in every chunk before the
      answer's (and then in the average): the same loss is passed in with the count floored at
      1e-9, which leaves the labelled chunk's loss and gradient as they were."""
    from mlx_lm_lora.trainer import sft_trainer

    sft_trainer.mx = _NoWiredLimit()
    args = sft_trainer.SFTTrainingArgs(
        batch_size=1,
        iters=1,
        seq_step_size=a.chunk,
        max_seq_length=a.chunk,  # each window's own length, set per step
        steps_per_eval=None,
        steps_per_report=1,
        steps_per_save=10**9,
        # its save at the end of each call: a file of this process's own (runs side by side)
        adapter_file=scratch_file(".safetensors"),
    )
    last = {}

    def loss(model, batch, lengths, cache=None):
        inputs, targets = batch[:, :-1], batch[:, 1:]
        offset = sft_trainer._find_cache_offset(cache) or 0
        logits = model(inputs, cache=cache)
        steps = mx.arange(1, targets.shape[1] + 1) + offset
        mask = mx.logical_and(steps >= lengths[:, 0:1], steps <= lengths[:, 1:])
        ntoks = mx.maximum(mask.sum(), 1e-9)
        ce = nn.losses.cross_entropy(logits, targets) * mask
        return ce.astype(mx.float32).sum() / ntoks, ntoks

    class Report(sft_trainer.TrainingCallback):
        def on_train_loss_report(self, info):
            last["loss"] = info["train_loss"]

    def step(window: Window) -> float:
        tokens = np.concatenate([window.inputs, window.targets[-1:]])[None]  # (1, n + 1)
        labelled = np.flatnonzero(window.weights) + 1  # target index i is the peer's step i + 1
        lengths = mx.array([[int(labelled[0]), int(labelled[-1])]])  # (1, 2): its (offset, length)
        args.max_seq_length = tokens.shape[1]  # a curriculum's windows grow

        def batches(**_):
            yield mx.array(tokens), lengths

        quiet = io.StringIO()  # its progress bar, per-iteration report and save notice
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            sft_trainer.train_sft(
                model,
                optimizer,
                [tokens[0]],
                args=args,
                loss=loss,
                iterate_batches=batches,
                training_callback=Report(),
            )
        return last["loss"]

    return step


def scratch_file(suffix: str) -> str:
    """A temporary file's name, the file removed when the process exits."""
    import atexit
    import tempfile

    fd, name = tempfile.mkstemp(suffix=suffix)
    os.close(fd)
    atexit.register(lambda: Path(name).unlink(missing_ok=True))
    return name


class _NoWiredLimit:
    """mlx.core, but set_wired_limit does nothing (a Metal setting; absent on the CPU)."""

    def __getattr__(self, name):
        return getattr(mx, name)

    def set_wired_limit(self, *_):
        return 0

    def device_info(self):
        return {"max_recommended_working_set_size": 0, **mx.device_info()}


if __name__ == "__main__":
    sys.exit(main())
