"""`mlxwalk train`: a training run over jsonl data, one window per example.

Each example is its own window (no packing: the walk exists for long windows, and packing would
let short examples attend to each other). The exact walk takes one optimizer step per window, the
plain walk one per labelled chunk. After each epoch the validation examples are evaluated; every
`save_every` windows, and at each epoch's end, a checkpoint (adapter, optimizer state, position in
the data) is written to a fresh folder that is renamed into place, so a run killed at any moment
resumes with `--resume` from the last checkpoint: it loses the windows trained since (at most
`save_every`, and none of a checkpoint half-written).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from . import adapters, arch, budget, data, models, report, samples, tiny
from .plan import MIB, PlanError
from .store import check_cache_type
from .walk import WalkConfig, Window, train_window, window_loss

log = logging.getLogger("mlxwalk")
OPTIMIZERS = ("adam", "adamw", "sgd")


KINDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}


def coerce(name: str, value, kind: str):
    """`value` as the field's type (annotations read as text), or a one-line refusal."""
    base = kind.split("|")[0].strip()
    if value is None and "None" in kind:
        return None
    ok, given = True, value
    if base == "bool":
        ok = isinstance(value, bool)
    elif base == "int":
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif base == "float":
        try:
            value = float(value) if not isinstance(value, bool) else None
        except (TypeError, ValueError):
            value = None
        ok = value is not None
    elif base == "str":
        ok = isinstance(value, str)
    elif base.startswith("list"):
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    if not ok:
        what = KINDS.get(base, "a list of strings")
        raise PlanError(f"{name} must be {what}, got {given!r}")
    return value


@dataclass
class TrainConfig:
    model: str = tiny.DEFAULT_MODEL
    data: str | None = None  # a folder with train.jsonl (and valid.jsonl); None = bundled sample
    walk: str = "exact"
    window: int | None = None  # None: the longest example, rounded up to the chunk
    chunk: int = 512
    horizon: int = 0
    cache_type: str = "float32"
    host_budget_mib: float | None = None
    memory_budget_mib: float | None = None
    recompute: bool = False
    epochs: int = 3
    iters: int | None = None  # stop after this many windows (mlx-lm's --iters)
    lr: float = 1e-4
    optimizer: str = "adam"
    rank: int = 8
    scale: float = 20.0
    dropout: float = 0.0
    num_layers: int = 16
    targets: list[str] | None = None
    seed: int = 0
    adapter_path: str | None = None  # None: runs/<model>-<time>
    save_every: int = 0  # windows between checkpoints; 0 = at each epoch's end only
    resume: bool = False
    val_split: float = 0.1  # used only when the data has no valid.jsonl
    fit: str = "left"
    mask_prompt: bool = True
    follow_runs: bool = False  # chunks may cross turns: a chat's short turns make small chunks
    progress: bool = True

    def check(self) -> TrainConfig:
        for f in fields(self):  # a YAML file gives strings for some numbers ("1e-5") or worse
            setattr(self, f.name, coerce(f.name, getattr(self, f.name), str(f.type)))
        if self.walk not in ("exact", "plain"):
            raise PlanError(f"walk {self.walk!r} cannot train; choose exact or plain")
        if self.optimizer not in OPTIMIZERS:
            raise PlanError(
                f"optimizer {self.optimizer!r} is unknown; choose {', '.join(OPTIMIZERS)}"
            )
        if self.fit not in data.FITS:
            raise PlanError(f"fit {self.fit!r} is unknown; choose {' or '.join(data.FITS)}")
        if self.epochs < 1 or self.chunk < 1 or (self.window is not None and self.window < 1):
            raise PlanError("epochs, chunk and window must be at least 1")
        if not 0 <= self.val_split < 1:
            raise PlanError(f"val_split must be in [0, 1), got {self.val_split}")
        check_cache_type(self.cache_type)
        return self

    def lora(self) -> adapters.LoraConfig:
        return adapters.LoraConfig(
            self.rank, self.scale, self.dropout, self.num_layers, self.targets
        )

    def walk_config(self, seed: int | None = None) -> WalkConfig:
        return WalkConfig(
            chunk=self.chunk,
            horizon=self.horizon,
            cache_type=self.cache_type,
            recompute=self.recompute,
            host_budget_mib=self.host_budget_mib,
            memory_budget_mib=self.memory_budget_mib,
            seed=seed,
            follow_runs=self.follow_runs,
        ).check()


@dataclass
class Epoch:
    epoch: int
    train_loss: float
    eval_loss: float | None
    seconds: float
    train_tok_s: float


@dataclass
class Position:
    """Where a run stands: windows done in the current epoch and overall, epochs finished."""

    epoch: int = 0
    index: int = 0
    windows: int = 0
    loss_sum: float = 0.0
    tokens: int = 0
    seconds: float = 0.0
    epochs: list[dict] = field(default_factory=list)


def max_positions(model) -> int | None:
    args = getattr(model, "args", None)
    for source in (args, getattr(args, "text_config", None)):
        if isinstance(source, dict):
            value = source.get("max_position_embeddings")
        else:
            value = getattr(source, "max_position_embeddings", None)
        if isinstance(value, int):
            return value
    return None


def writable(folder: Path) -> Path:
    """The adapter folder, checked writable before any training (and not created yet, so a run
    refused later leaves nothing behind)."""
    probe = folder
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise PlanError(f"adapter path {folder} is not writable ({probe} is not a writable folder)")
    return folder


def make_optimizer(cfg: TrainConfig):
    if cfg.optimizer == "sgd":
        return optim.SGD(learning_rate=cfg.lr)
    if cfg.optimizer == "adamw":
        return optim.AdamW(learning_rate=cfg.lr)
    return optim.Adam(learning_rate=cfg.lr)


def say(*args) -> None:
    print(*args, flush=True)


class Run:
    """One training run: setup (every refusal happens here), then epochs of windows."""

    def __init__(self, cfg: TrainConfig, echo=say):
        self.cfg = cfg.check()
        self.echo = echo
        self.out = writable(Path(cfg.adapter_path or default_path(cfg.model)))
        folder = data.check_folder(cfg.data) if cfg.data else samples.folder()
        self.model, self.tokenizer = models.load(cfg.model)
        self.layout = arch.inspect(self.model)
        self.limit = max_positions(self.model)
        if cfg.window is not None and self.limit is not None and cfg.window > self.limit:
            raise PlanError(
                f"window {cfg.window} exceeds the model's maximum positions ({self.limit})"
            )
        self.train_set, self.valid_set = self._load(folder)
        mx.random.seed(cfg.seed)
        adapters.apply(self.model, cfg.lora())
        self.optimizer = make_optimizer(cfg)
        self.optimizer.init(self.model.trainable_parameters())
        self.position = Position()
        self.peak = 0
        self.horizon_used = cfg.horizon
        self.memory = self._admit()

    def _load(self, folder: Path) -> tuple[data.Dataset, data.Dataset]:
        cfg = self.cfg
        whole = data.load(folder, "train", self.tokenizer, None, mask_prompt=cfg.mask_prompt)
        if not whole.examples:
            raise PlanError(f"no training example has a labelled token ({whole.source})")
        longest = max(len(e) for e in whole.examples)
        asked = cfg.window or cfg.chunk * math.ceil(longest / cfg.chunk)
        self.window_asked = cfg.window or longest
        self.window = min(asked, self.limit) if self.limit else asked
        train = whole.fitted(self.window, cfg.fit)  # tokenized once: chats render turn by turn
        if (folder / "valid.jsonl").exists():
            valid = data.load(
                folder, "valid", self.tokenizer, self.window, cfg.fit, cfg.mask_prompt
            )
        else:
            rng = np.random.default_rng(cfg.seed)
            order = rng.permutation(len(train.examples))
            n_valid = int(round(len(order) * cfg.val_split))
            valid = data.Dataset([train.examples[i] for i in order[:n_valid]])
            train.examples = [train.examples[i] for i in sorted(order[n_valid:])]
        if not train.examples:
            raise PlanError(f"no training example has a labelled token ({train.source})")
        return train, valid

    def _admit(self) -> budget.Estimate | None:
        """The memory of the largest window, refused here if it cannot fit. A window computes up
        to its last labelled position, so that, not its length, sizes it."""
        from .walk import ExactWalk

        if self.cfg.walk != "exact":
            return None
        largest = max(self.train_set.examples, key=lambda e: np.flatnonzero(e.weights).max())
        win = Window.of(largest.inputs, largest.targets, largest.weights)
        walk = ExactWalk(self.model, win, self.cfg.walk_config())
        acts = budget.probe(self.model, self.cfg.chunk, self.cfg.recompute)
        return budget.estimate(self.model, self.layout, acts, walk.plan, self.cfg.cache_type)

    # --- the loop ---------------------------------------------------------------------------

    def order(self, epoch: int) -> list[int]:
        return list(
            np.random.default_rng(self.cfg.seed + epoch).permutation(len(self.train_set.examples))
        )

    def train(self) -> dict:
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        if cfg.resume:
            self.restore()
        total = cfg.iters if cfg.iters is not None else cfg.epochs * len(self.train_set.examples)
        bar = report.progress(total, self.position.windows, enabled=cfg.progress)
        self.model.train()
        while self.position.epoch < cfg.epochs and self.position.windows < total:
            order = self.order(self.position.epoch)
            while self.position.index < len(order) and self.position.windows < total:
                self.step(self.train_set.examples[order[self.position.index]], bar)
                if cfg.save_every and self.position.windows % cfg.save_every == 0:
                    self.checkpoint()
            if self.position.index >= len(order) or self.position.windows >= total:
                self.end_epoch()
        bar.close()
        adapters.save(self.model, self.out, cfg.lora())
        return self.finish()

    def step(self, example: data.Example, bar) -> None:
        p = self.position
        window = Window.of(example.inputs, example.targets, example.weights)
        tic = time.perf_counter()
        mx.reset_peak_memory()
        config = self.cfg.walk_config(seed=self.cfg.seed + p.windows)
        walk = train_window(
            self.model, self.optimizer, window, config, self.cfg.walk, on_chunk=bar.chunk
        )
        seconds = time.perf_counter() - tic
        self.peak = max(self.peak, mx.get_peak_memory())
        used = getattr(walk, "horizon_used", self.cfg.horizon)
        if used and (self.horizon_used == 0 or used < self.horizon_used):
            self.horizon_used = used
        p.index += 1
        p.windows += 1
        p.loss_sum += walk.loss * example.trainable
        p.tokens += example.trainable
        p.seconds += seconds
        bar.window(walk.loss, len(example) / seconds, mx.get_peak_memory() / MIB)

    def evaluate(self) -> float | None:
        if not self.valid_set.examples:
            return None
        total, weight = 0.0, 0
        self.model.eval()
        try:
            for ex in self.valid_set.examples:
                window = Window.of(ex.inputs, ex.targets, ex.weights)
                total += window_loss(self.model, window, self.cfg.walk_config()) * ex.trainable
                weight += ex.trainable
        finally:
            self.model.train()
        return total / weight

    def end_epoch(self) -> None:
        p = self.position
        tokens = sum(len(self.train_set.examples[i]) for i in self.order(p.epoch)[: p.index])
        epoch = Epoch(
            epoch=p.epoch + 1,
            train_loss=p.loss_sum / max(p.tokens, 1),
            eval_loss=self.evaluate(),
            seconds=round(p.seconds, 2),
            train_tok_s=round(tokens / p.seconds, 1) if p.seconds else 0.0,
        )
        p.epochs.append(asdict(epoch))
        self.echo(report.epoch_line(epoch))
        p.epoch, p.index, p.loss_sum, p.tokens, p.seconds = p.epoch + 1, 0, 0.0, 0, 0.0
        self.checkpoint()

    # --- checkpoints --------------------------------------------------------------------------

    def checkpoint(self) -> Path:
        """A complete checkpoint in a fresh folder, renamed into place; older ones pruned."""
        root = self.out / "checkpoints"
        root.mkdir(exist_ok=True)
        final = root / f"window-{self.position.windows:07d}"
        tmp = root / f".tmp-{final.name}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        adapters.save(self.model, tmp, self.cfg.lora())
        mx.save_safetensors(
            str(tmp / "optimizer.safetensors"), dict(tree_flatten(self.optimizer.state))
        )
        (tmp / "state.json").write_text(json.dumps(asdict(self.position)))
        # An end-of-epoch checkpoint can share its window count with the last periodic one: the
        # older moves aside first, so a crash at any point leaves only complete checkpoints.
        aside = root / f".old-{final.name}"
        if final.exists():
            shutil.rmtree(aside, ignore_errors=True)
            final.rename(aside)
        tmp.rename(final)
        shutil.rmtree(aside, ignore_errors=True)
        for old in complete_checkpoints(root)[:-2]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def restore(self) -> None:
        found = complete_checkpoints(self.out / "checkpoints")
        if not found:
            raise PlanError(f"--resume: no checkpoint in {self.out / 'checkpoints'}")
        last = found[-1]
        weights = mx.load(str(last / "adapters.safetensors"))
        self.model.load_weights(list(weights.items()), strict=False)
        state = mx.load(str(last / "optimizer.safetensors"))
        self.optimizer.state = tree_unflatten(list(state.items()))
        self.position = Position(**json.loads((last / "state.json").read_text()))
        mx.eval(self.model.parameters(), self.optimizer.state)
        self.echo(f"resumed from {last} (epoch {self.position.epoch + 1}, "
                  f"window {self.position.windows})")  # fmt: skip

    # --- the report ----------------------------------------------------------------------------

    def finish(self) -> dict:
        cfg, est = self.cfg, self.memory
        summary = {
            "model": cfg.model,
            "adapter_path": str(self.out),
            "walk": cfg.walk,
            "window": self.window,
            "window_asked": self.window_asked,
            "chunk": cfg.chunk,
            "horizon": cfg.horizon,
            "horizon_used": self.horizon_used,
            "host_mib": round(est.host / MIB, 2) if est else 0.0,
            "graph_mib": round(est.graph / MIB, 2) if est else None,
            "peak_mib": round(self.peak / MIB, 2),
            "examples": len(self.train_set.examples),
            "examples_skipped": self.train_set.skipped,
            "examples_truncated": self.train_set.truncated,
            "trainable_tokens": self.train_set.trainable_tokens,
            "windows": self.position.windows,
            "epochs": self.position.epochs,
            "config": {f.name: getattr(cfg, f.name) for f in fields(cfg)},
        }
        report.write(self.out, summary)
        return summary


def complete_checkpoints(root: Path) -> list[Path]:
    if not root.exists():
        return []
    return sorted(p for p in root.glob("window-*") if (p / "state.json").exists())


def default_path(model: str) -> Path:
    name = Path(model).name or model.replace("/", "-")
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def train_run(cfg: TrainConfig, echo=say) -> dict:
    run = Run(cfg, echo)
    est = run.memory
    echo(f"model {cfg.model} ({run.layout.model_type}), {len(run.train_set.examples)} training and "
         f"{len(run.valid_set.examples)} validation windows of up to {run.window} tokens, "
         f"chunk {cfg.chunk}, {cfg.walk} walk; adapter and report go to {run.out}")  # fmt: skip
    if est is not None:
        echo(f"memory estimate: {est.total / MIB:.1f} MiB (graph {est.graph / MIB:.1f}, K/V store "
             f"{est.store / MIB:.1f}, host {est.host / MIB:.1f})")  # fmt: skip
    summary = run.train()
    echo(report.table(summary["epochs"]))
    echo(f"adapter, report and loss curve written to {run.out}")
    return summary
