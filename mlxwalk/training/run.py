"""`mlxwalk train`: a training run over jsonl data, one window per example.

Each example is its own window (no packing: the walk exists for long windows, and packing would
let short examples attend to each other). The exact walk takes one optimizer step per window, the
plain walk one per labelled chunk. After each epoch the validation examples are evaluated; every
`save_every` windows, at each epoch's end, at `--iters` and on Ctrl-C, a checkpoint (adapter,
optimizer state, position in the data) is written to a fresh folder that is renamed into place, so
a run killed at any moment resumes with `--resume` from the last checkpoint (runfolder.py says
what must match). Every refusal comes before the folder is touched; a run that fails leaves
nothing it made, except checkpoints it can resume from.
"""

from __future__ import annotations

import errno
import json
import math
import os
import signal
import tempfile
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_map

from ..errors import ConfigError, FolderError, RanksError
from ..plan import MIB
from ..walk import (
    Window,
    apply_step,
    arch,
    budget,
    exact_gradient,
    machine,
    train_window,
    window_loss,
)
from ..walk.guards import NonFinite
from ..walk.store import check_cache_type
from . import adapters, data, models, report, samples, windows
from .config import TrainConfig
from .files import TMP_MARK, FolderLock, NewFolder, save_safetensors, sweep
from .ranks import Ranks, StepSum, reduce_step, weighs
from .runfolder import Position, RunFolder, identity
from .watch import Watch

SKIP_LIMIT = 5  # --on-nan skip: this many non-finite windows in a row stop the run
LR_WARN = 0.1  # an Adam learning rate above this is announced as one that will diverge


@dataclass
class Epoch:
    epoch: int
    train_loss: float
    eval_loss: float | None
    seconds: float
    train_tok_s: float
    windows: int = 0
    partial: bool = False  # stopped by --iters before the epoch's end
    windows_narrowed: int = 0  # windows whose horizon the memory budget narrowed (not exact)
    smallest_horizon: int | None = None  # the narrowest horizon one of them used


def writable(folder: Path) -> Path:
    """The adapter folder, checked writable before any training (and not created yet, so a run
    refused later leaves nothing behind)."""
    probe = folder
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise FolderError(
            f"adapter path {folder} is not writable ({probe} is not a writable folder)"
        )
    return folder


class WriteFailed(FolderError):
    """A write the run could not make (a full disk), said with what of the run is kept."""


def try_write(folder: Path) -> None:
    """Write and remove a small safetensors file in the run's folder through the very calls that
    will write its checkpoints, so a folder they can't write is refused before any training."""
    probe = folder / f".write-check{TMP_MARK}{os.getpid()}.safetensors"
    try:
        save_safetensors(probe, {"check": mx.zeros((1,))})
    except (OSError, RuntimeError) as e:
        raise FolderError(f"adapter path {folder} can't be written ({e})") from None
    finally:
        probe.unlink(missing_ok=True)


def refuse_overlap(out: Path, model: Path, data_folder: Path) -> None:
    """An adapter path that is the model's or the data's folder (or holds or sits in them)."""
    mine = out.resolve()
    for what, other in (("model", model), ("data", data_folder)):
        theirs = Path(other).resolve()
        if mine == theirs or theirs in mine.parents:
            raise FolderError(
                f"adapter path {out} is inside the {what} folder {other}; choose "
                "another --adapter-path"
            )
        if mine in theirs.parents:
            raise FolderError(
                f"adapter path {out} holds the {what} folder {other}; choose another --adapter-path"
            )


def make_optimizer(cfg: TrainConfig, steps: int):
    """The optimizer, its weight decay, and the learning rate: constant, or mlx-lm's schedule
    (build_schedule) decaying to 0 over `steps`, after `warmup` steps rising from 0."""
    from mlx_lm.tuner.utils import build_schedule

    lr = cfg.lr
    decay = max(steps - cfg.warmup - 1, 1)  # mlx-lm's schedule starts decaying after the warmup
    if cfg.lr_schedule == "cosine_decay":
        lr = build_schedule(
            {"name": "cosine_decay", "arguments": [cfg.lr, decay], "warmup": cfg.warmup}
        )
    elif cfg.lr_schedule == "linear_schedule":
        lr = build_schedule(
            {"name": "linear_schedule", "arguments": [cfg.lr, 0.0, decay], "warmup": cfg.warmup}
        )
    elif cfg.warmup:
        lr = optim.linear_schedule(0.0, cfg.lr, cfg.warmup)
    wd = {} if cfg.weight_decay is None else {"weight_decay": cfg.weight_decay}
    if cfg.optimizer == "sgd":
        return optim.SGD(learning_rate=lr, **wd)
    if cfg.optimizer == "adamw":
        return optim.AdamW(learning_rate=lr, **wd)
    return optim.Adam(learning_rate=lr)


def say(*args) -> None:
    print(*args, flush=True)


class Run:
    """One training run: setup (every refusal happens here), then epochs of windows."""

    def __init__(self, cfg: TrainConfig, echo=say, ranks: Ranks | None = None):
        self.cfg = cfg.check()
        self.ranks = ranks or Ranks(None)
        self.echo = echo if self.ranks.leader else quiet  # one voice: the rank that writes
        echo = self.echo
        if cfg.walk == "plain" and self.ranks.size > 1:
            raise RanksError(
                "--walk plain steps once per chunk; across ranks only the exact "
                "walk's steps combine"
            )
        self.out = writable(Path(cfg.adapter_path or default_path(cfg.model)))
        data_folder = data.check_folder(cfg.data) if cfg.data else samples.folder()
        refuse_overlap(self.out, models.resolve(cfg.model), data_folder)
        self.folder = RunFolder(self.out)
        self.made, self.lock = NewFolder(self.out), FolderLock(self.out)
        if self.ranks.leader:  # the folder is this run's from here until it ends
            self.made.make()
            self.lock.acquire()
        try:
            self._setup(cfg, data_folder)
        except BaseException:
            self.release(keep=False)
            raise

    def _setup(self, cfg: TrainConfig, data_folder: Path) -> None:
        echo = self.echo
        if self.ranks.leader:
            self.folder.claim(cfg.overwrite, cfg.resume)
            try_write(self.out)
        self.model, self.tokenizer = models.load(cfg.model)
        fingerprint = models.fingerprint(self.model)
        self.layout = arch.inspect(self.model)
        check_cache_type(cfg.cache_type, self.layout.head_dims)
        self.limit = models.max_positions(self.model)
        if cfg.window is not None and self.limit is not None and cfg.window > self.limit:
            raise ConfigError(
                f"--window {cfg.window} exceeds the model's maximum positions ({self.limit})"
            )
        loaded = windows.load(cfg, data_folder, self.tokenizer, self.layout.vocab, self.limit, echo)
        self.train_set, self.valid_set = loaded.train, loaded.valid
        self.window, self.window_asked = loaded.window, loaded.window_asked
        mx.random.seed(cfg.seed)
        adapters.apply(self.model, cfg.lora())
        self.optimizer = make_optimizer(cfg, self.steps())
        self.optimizer.init(self.model.trainable_parameters())
        self.position = Position()
        self.peak = 0
        self.cfg = cfg = self._default_budget(cfg)
        self.watch = Watch(cfg, self.layout.vocab, echo)
        self.streak = 0  # non-finite windows in a row (--on-nan skip)
        self.nan: NonFinite | None = None  # what this rank's non-finite window said
        self.reduce_seconds = 0.0  # in the steps' reductions (and waiting for other ranks)
        self.undo = None  # (position, adapter and optimizer state) at the window's start
        self.partial: Epoch | None = None  # the epoch row of a run stopped by --iters
        self.bar = None
        self.rescued: Path | None = None  # where a failed write's adapter went instead
        if cfg.optimizer != "sgd" and cfg.lr > LR_WARN:
            echo(
                f"warning: --lr {cfg.lr:g} is far above what Adam trains LoRA with (1e-6 to "
                "1e-3); expect the loss to diverge"
            )
        self.largest = self._admit()
        self.memory = self.largest.estimate if self.largest else None
        files = [data_folder / "train.jsonl", data_folder / "valid.jsonl"]
        model_path = str(models.resolve(cfg.model).resolve())
        self.identity = identity(cfg, model_path, fingerprint, files, self.window)
        self.identity.update(ranks=self.ranks.size, windows_per_step=cfg.windows_per_step)
        self.resumed_from = self._resume() if cfg.resume else None

    def release(self, keep: bool) -> None:
        """The folder's lock dropped at the run's end; unless `keep`, the folders the run made
        removed as long as they hold nothing."""
        self.lock.release()
        if not keep:
            self.made.discard()

    def _default_budget(self, cfg: TrainConfig) -> TrainConfig:
        """On a GPU with no --memory-budget-mib, the exact walk keeps to what MLX reports the
        GPU may use (machine.py), and the run says so."""
        budget_mib, memory = machine.default_budget_mib(cfg.memory_budget_mib)
        if memory is None or cfg.walk != "exact":
            return cfg
        self.echo(f"memory budget: {memory.said()}, as no --memory-budget-mib is given")
        return replace(cfg, memory_budget_mib=budget_mib)

    def _admit(self):
        """The exact walk's plan for the largest window, and under a memory budget its estimate
        (refused here if it cannot fit). A window computes up to its last labelled position, so
        that, not its length, sizes it. Without a budget nothing is probed."""
        from ..walk import ExactWalk

        if self.cfg.walk != "exact":
            return None
        largest = max(self.train_set.examples, key=lambda e: np.flatnonzero(e.weights).max())
        win = Window.of(largest.inputs, largest.targets, largest.weights)
        return ExactWalk(self.model, win, self.cfg.walk_config(), self.layout)

    def _resume(self) -> Path:
        """Adopt the folder's run (identity checked), load its newest checkpoint strictly."""
        self.folder.check_resume(self.identity)
        last, self.position = self.folder.load(self.model, self.optimizer)
        p = self.position
        if (p.epoch >= self.cfg.epochs or p.windows >= self.total) and self.reported(p.windows):
            done = (
                f"its {p.epoch} epoch(s)"
                if p.epoch >= self.cfg.epochs
                else f"the {p.windows} windows --iters asks for"
            )
            raise FolderError(
                f"--resume: the run in {self.out} has already trained {done}; raise "
                "--epochs or --iters to train on"
            )
        if self.cfg.lr_schedule or self.cfg.warmup:  # the schedule goes on from the saved step
            return last
        was = float(self.optimizer.learning_rate)
        self.optimizer.learning_rate = self.cfg.lr  # the checkpoint's state holds the old one
        if not math.isclose(was, self.cfg.lr, rel_tol=1e-6):
            self.echo(f"learning rate {self.cfg.lr:g} from here on (the run's was {was:g})")
        return last

    def reported(self, windows: int) -> bool:
        """Whether the run finished: its report counts these windows (a run stopped before its
        report, at its last window, resumes to close its epoch and write it)."""
        try:
            return json.loads((self.out / "report.json").read_text())["windows"] == windows
        except (OSError, ValueError, KeyError, TypeError):
            return False

    @property
    def per_step(self) -> int:
        """Windows one optimizer step covers, over every rank."""
        return self.cfg.windows_per_step * self.ranks.size

    def steps(self) -> int:
        """The optimizer steps the run will take: one per `per_step` windows (the exact walk),
        or each labelled chunk's (the plain walk), over --iters or every epoch."""
        examples = self.train_set.examples
        if self.cfg.walk == "exact":
            per_epoch = math.ceil(len(examples) / self.per_step)
            if self.cfg.iters is None:
                return self.cfg.epochs * per_epoch
            return min(self.cfg.epochs * per_epoch, math.ceil(self.cfg.iters / self.per_step))
        per = [
            1
            if self.cfg.walk == "exact"
            else max(1, len({int(i) // self.cfg.chunk for i in np.flatnonzero(e.weights)}))
            for e in examples
        ]
        every = self.cfg.epochs * sum(per)
        if self.cfg.iters is None:
            return every
        return min(every, round(self.cfg.iters * sum(per) / len(per)))

    @property
    def total(self) -> int:
        every = self.cfg.epochs * len(self.train_set.examples)
        return every if self.cfg.iters is None else min(self.cfg.iters, every)

    # --- the loop ---------------------------------------------------------------------------

    def order(self, epoch: int) -> list[int]:
        return list(
            np.random.default_rng(self.cfg.seed + epoch).permutation(len(self.train_set.examples))
        )

    def train(self) -> dict:
        self.keep = True  # `fail` clears it when the run leaves nothing worth keeping
        try:
            return self._train()
        finally:
            self.release(keep=self.keep)

    def _train(self) -> dict:
        if self.ranks.leader:
            sweep(self.out)
            if self.cfg.overwrite:
                self.folder.set_aside()
            if self.resumed_from is None:
                self.folder.start(self.identity)
        if self.resumed_from is not None:
            self.echo(
                f"resumed from {self.resumed_from} (epoch {self.position.epoch + 1}, "
                f"window {self.position.windows})"
            )
        try:
            self.loop()
            if self.ranks.leader:
                adapters.save(self.model, self.out, self.cfg.lora())
            return self.finish()
        except BaseException as e:
            if self.ranks.leader:
                self.fail(e)
            if isinstance(e, OSError):  # a write that failed: said with what is kept, and where
                raise WriteFailed(self.lost_write(e)) from None
            raise

    def lost_write(self, e: OSError) -> str:
        """What a failed write means to the user: which path, and what of the run is kept."""
        where = e.filename or self.out
        said = (
            f"no space left on {where}"
            if e.errno == errno.ENOSPC
            else f"can't write {where} ({e.strerror or e})"
        )
        saved = self.folder.complete()
        if saved:
            return (
                f"{said}; checkpoint {saved[-1]} is intact: once that is mended, run the same "
                f"command with --resume --adapter-path {self.out}"
            )
        if self.rescued:
            return f"{said}; the adapter trained so far is saved to {self.rescued} instead"
        if self.position.windows:
            return f"{said}; the adapter trained so far could not be saved elsewhere either"
        return f"{said}; nothing had been trained yet, and nothing was kept"

    def loop(self) -> None:
        cfg, total = self.cfg, self.total
        shown = cfg.progress and self.ranks.leader
        self.bar = report.progress(total, self.position.windows, enabled=shown)
        self.model.train()
        try:
            while self.position.epoch < cfg.epochs:
                order = self.order(self.position.epoch)
                while self.position.index < len(order) and self.position.windows < total:
                    p = self.position
                    n = min(self.per_step, len(order) - p.index, total - p.windows)
                    self.step([self.train_set.examples[i] for i in order[p.index : p.index + n]])
                    if crossed(cfg.save_every, p.windows, self.position.windows):
                        self.checkpoint()
                    if self.eval_due(p.windows):
                        self.evaluate_between()
                if self.position.index >= len(order):  # also one a stop left open at its end
                    self.end_epoch()
                    if self.position.windows >= total:
                        break
                    continue
                self.partial = self.epoch_row(partial=True)  # --iters ends the run mid-epoch
                self.echo(report.epoch_line(self.partial))
                self.checkpoint()
                break
        finally:
            self.bar.close()

    def step(self, examples: list[data.Example]) -> None:
        """One optimizer step on the windows `examples` (the step's slice of the epoch's order;
        this rank walks its share). The position moves (one assignment) only once the step is
        taken; an interruption before that puts the adapter back as it was (`undo`)."""
        if self.cfg.walk == "plain":
            return self.step_plain(examples[0])
        p, cfg = self.position, self.cfg
        self.undo = (p, self.snapshot())
        tic = time.perf_counter()
        mx.reset_peak_memory()
        part, error = self.walk_share(examples)
        walked = time.perf_counter()
        step = reduce_step(self.ranks, part, error)
        self.reduce_seconds += time.perf_counter() - walked  # the wait for the slowest rank too
        if not step.finite:
            self.restore(self.undo[1])
            self.non_finite(examples, error or NonFinite("a NaN or infinite loss or gradient"))
            return
        apply_step(self.model, self.optimizer, step.grads, cfg.grad_clip)
        mx.eval(self.model.parameters(), self.optimizer.state)
        self.stepped(examples, step.losses, step.horizons, time.perf_counter() - tic)

    def walk_share(self, examples: list[data.Example]) -> tuple[StepSum, BaseException | None]:
        """This rank's windows of the step: their gradients, each weighted by its labelled
        weight when the step combines windows. A failure is kept for the step's reduction (one
        process: raised at once); a non-finite window marks the step."""
        slots, cfg, p = len(examples), self.cfg, self.position
        combine = weighs(slots, self.ranks.size)
        part = StepSum(
            tree_map(mx.zeros_like, self.model.trainable_parameters()),
            *(np.zeros(slots, np.float32) for _ in range(3)),
        )
        error = None
        for i in self.ranks.mine(list(range(slots)), cfg.windows_per_step):
            ex = examples[i]
            window = Window.of(ex.inputs, ex.targets, ex.weights)
            try:
                walk, grads = exact_gradient(
                    self.model,
                    window,
                    cfg.walk_config(seed=cfg.seed + p.windows + i),
                    self.bar.chunk,
                    self.layout,
                )
            except NonFinite as e:
                part.finite, error = False, None
                self.nan = e
                continue
            except Exception as e:
                if self.ranks.size == 1:
                    raise
                error = e
                break
            w = float(window.total) if combine else 1.0
            part.grads = tree_map(lambda a, g, w=w: a + g * w, part.grads, grads)
            used = getattr(walk, "horizon_used", cfg.horizon)
            part.losses[i], part.weights[i] = walk.loss, window.total
            part.horizons[i] = used if used != cfg.horizon else 0
            mx.eval(part.grads)
        return part, error

    def stepped(self, examples, losses, horizons, seconds: float) -> None:
        """The position after a step on `examples`: every window's loss, and the narrowed ones."""
        p, cfg = self.position, self.cfg
        peak = mx.get_peak_memory()
        self.streak = 0
        narrowed = [int(h) for h in horizons if h]
        trainable = sum(ex.trainable for ex in examples)
        self.position = replace(
            p,
            index=p.index + len(examples),
            windows=p.windows + len(examples),
            loss_sum=p.loss_sum + sum(float(v) * ex.trainable for v, ex in zip(losses, examples)),
            tokens=p.tokens + trainable,
            seconds=p.seconds + seconds,
            losses=[*p.losses, *(round(float(v), 6) for v in losses)],
            narrowed=p.narrowed + len(narrowed),
            horizon=min([p.horizon or min(narrowed), *narrowed]) if narrowed else p.horizon,
        )
        self.peak = max(self.peak, peak)
        for j, (ex, loss, h) in enumerate(zip(examples, losses, horizons)):
            used = int(h) or cfg.horizon
            self.watch.window(p.windows + j + 1, ex.where, float(loss), used, peak)
        tokens = sum(len(ex) for ex in examples)
        shown = min(narrowed) if narrowed else None
        self.bar.window(
            float(np.mean(losses)), tokens / seconds, peak / MIB, shown, windows=len(examples)
        )

    def step_plain(self, example: data.Example) -> None:
        """One window by the plain walk, a step per labelled chunk (one process)."""
        p, cfg = self.position, self.cfg
        window = Window.of(example.inputs, example.targets, example.weights)
        self.undo = (p, self.snapshot())
        tic = time.perf_counter()
        mx.reset_peak_memory()
        try:
            walk = train_window(
                self.model,
                self.optimizer,
                window,
                cfg.walk_config(seed=cfg.seed + p.windows),
                cfg.walk,
                on_chunk=self.bar.chunk,
                layout=self.layout,
                clip=cfg.grad_clip,
            )
        except NonFinite as e:
            self.restore(self.undo[1])
            self.non_finite([example], e)
            return
        used = getattr(walk, "horizon_used", cfg.horizon)
        horizon = np.array([used if used != cfg.horizon else 0])
        self.stepped([example], np.array([walk.loss]), horizon, time.perf_counter() - tic)

    def snapshot(self):
        """The adapter and optimizer state as they are (arrays are immutable: references do)."""
        params = tree_map(lambda a: a, self.model.trainable_parameters())
        return params, tree_map(lambda a: a, self.optimizer.state)

    def restore(self, snap) -> None:
        params, state = snap
        self.model.update(params)
        self.optimizer.state = state

    def non_finite(self, examples: list[data.Example], error: BaseException) -> None:
        p, n = self.position, len(examples)
        first = examples[0].where or "an example"
        where = (
            f"window {p.windows + 1} (epoch {p.epoch + 1}, {first})"
            if n == 1
            else f"the step on windows {p.windows + 1}-{p.windows + n} (epoch {p.epoch + 1}, "
            f"from {first})"
        )
        error = self.nan or error
        self.nan = None
        self.streak += 1
        if self.cfg.on_nan == "skip" and self.streak < SKIP_LIMIT:
            self.echo(f"warning: {where}: {error}; skipped (--on-nan skip), adapter unchanged")
            self.position = replace(
                p, index=p.index + n, windows=p.windows + n, skipped=p.skipped + n
            )
            return
        if self.cfg.on_nan == "skip":
            raise NonFinite(
                f"{where}: {error}; the {SKIP_LIMIT}th window in a row that is not "
                f"finite, so the run stops. {self.kept()}"
            )
        raise NonFinite(
            f"{where}: {error}; stopped before its step. {self.kept()} Lower --lr, "
            "or pass --on-nan skip to skip such windows"
        )

    def kept(self) -> str:
        saved = self.folder.complete()
        if not saved:
            return "Nothing was saved."
        return f"The last checkpoint, {saved[-1]}, is as it was (resume with --resume)."

    def eval_due(self, before: int) -> bool:
        """--steps-per-eval: every so many windows (a step that passes a multiple counts),
        except where an epoch's end evaluates."""
        p = self.position
        epoch_end = p.index >= len(self.train_set.examples)
        return crossed(self.cfg.steps_per_eval, before, p.windows) and not epoch_end

    def evaluate_between(self) -> None:
        loss = self.evaluate()
        if loss is not None:
            self.echo(f"window {self.position.windows}: eval_loss {loss:.4f}")
            p = self.position
            self.position = replace(p, evals=[*p.evals, [p.windows, round(loss, 6)]])

    def evaluate(self) -> float | None:
        if not self.valid_set.examples:
            return None
        total, weight = 0.0, 0
        self.model.eval()
        try:  # each rank its share; the sums reduced together
            for ex in self.valid_set.examples[self.ranks.rank :: self.ranks.size]:
                window = Window.of(ex.inputs, ex.targets, ex.weights)
                loss = window_loss(self.model, window, self.cfg.walk_config(), self.layout)
                total += loss * ex.trainable
                weight += ex.trainable
        finally:
            self.model.train()
        if self.ranks.size > 1:
            total, weight = np.array(self.ranks.all_sum(mx.array([total, weight], mx.float32)))
        return float(total / weight)

    def epoch_row(self, partial: bool = False) -> Epoch:
        p = self.position
        tokens = sum(len(self.train_set.examples[i]) for i in self.order(p.epoch)[: p.index])
        return Epoch(
            epoch=p.epoch + 1,
            train_loss=p.loss_sum / max(p.tokens, 1),
            eval_loss=self.evaluate(),
            seconds=round(p.seconds, 2),
            train_tok_s=round(tokens / p.seconds, 1) if p.seconds else 0.0,
            windows=p.index,
            partial=partial,
            windows_narrowed=p.narrowed,
            smallest_horizon=p.horizon or None,
        )

    def end_epoch(self) -> None:
        epoch = self.epoch_row()
        self.echo(report.epoch_line(epoch))
        p = self.position
        self.position = replace(
            p,
            epoch=p.epoch + 1,
            index=0,
            loss_sum=0.0,
            tokens=0,
            seconds=0.0,
            epochs=[*p.epochs, asdict(epoch)],
            narrowed=0,
            horizon=0,
        )
        self.checkpoint()

    # --- checkpoints and failure ----------------------------------------------------------------

    def checkpoint(self) -> Path | None:
        if not self.ranks.leader:
            return None
        saved = self.folder.save(self.model, self.optimizer, self.cfg.lora(), self.position)
        self.folder.drop_aside()  # --overwrite: the new run now stands on its own
        return saved

    def fail(self, error: BaseException) -> None:
        """On the way out: a Ctrl-C saves what was trained and says how to go on; a run with no
        checkpoint leaves nothing behind (and puts back a run it was to --overwrite). A second
        Ctrl-C or a SIGTERM waits until this is done."""
        with shielded():
            self._fail(error)

    def _fail(self, error: BaseException) -> None:
        if isinstance(error, KeyboardInterrupt):
            if self.undo is not None and self.position is self.undo[0]:  # mid-window: undone
                self.restore(self.undo[1])
            saved = self.folder.complete()
            done = self.position.windows
            if done and (not saved or not saved[-1].name.endswith(f"{done:07d}")):
                saved.append(self.checkpoint())
            if saved:
                error.args = (
                    f"at window {done} of {self.total}; checkpoint {saved[-1]} holds "
                    f"it: to continue, run the same command with --resume "
                    f"--adapter-path {self.out}",
                )
        if isinstance(error, OSError) and not self.folder.complete() and self.position.windows:
            self.rescued = self.rescue()
        if not self.folder.complete():
            self.folder.clear()
            self.folder.put_back()
            self.keep = False  # the folders it made go once the lock is dropped
            if isinstance(error, KeyboardInterrupt):
                error.args = ("before the first window finished; nothing was saved",)

    def rescue(self) -> Path | None:
        """The adapter trained so far, saved outside the run's folder (which can't be written);
        None when that fails too."""
        try:
            folder = Path(tempfile.mkdtemp(prefix="mlxwalk-rescued-"))
            adapters.save(self.model, folder, self.cfg.lora())
            return folder
        except (OSError, RuntimeError, ValueError):
            return None

    # --- the report ----------------------------------------------------------------------------

    def finish(self) -> dict:
        cfg, est = self.cfg, self.memory
        epochs = self.position.epochs + ([asdict(self.partial)] if self.partial else [])
        summary = {
            "model": cfg.model,
            "adapter_path": str(self.out),
            "walk": cfg.walk,
            "window": self.window,
            "window_asked": self.window_asked,
            "chunk": cfg.chunk,
            "horizon": cfg.horizon,
            "horizon_used": self.watch.horizon_used,
            "windows_narrowed": self.watch.narrowed,
            "memory_estimate_mib": round(est.total / MIB, 2) if est else None,
            "host_mib": round(self.largest.plan.host_bytes / MIB, 2) if self.largest else 0.0,
            "graph_mib": round(est.graph / MIB, 2) if est else None,
            "peak_mib": round(self.peak / MIB, 2),
            "windows_over_budget": self.watch.over_budget,
            "diverged_at_window": self.watch.collapsed,
            "windows_skipped_non_finite": self.position.skipped,
            "examples": len(self.train_set.examples),
            "examples_skipped": self.train_set.skipped,
            "examples_truncated": self.train_set.truncated,
            "examples_cut_away": self.train_set.cut_away,
            "trainable_tokens": self.train_set.trainable_tokens,
            "windows": self.position.windows,
            "window_losses": self.position.losses,
            "evals_between": self.position.evals,  # [window, eval loss] for --steps-per-eval
            "epochs": epochs,
            "config": {f.name: getattr(cfg, f.name) for f in fields(cfg)},
            "ranks": self.ranks.size,
            "reduce_seconds": round(self.reduce_seconds, 4),
        }
        if self.ranks.leader:
            report.write(self.out, summary)
        return summary


class shielded:
    """SIGINT and SIGTERM held off within the block (where the main thread can hold them)."""

    def __enter__(self):
        self.saved = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self.saved[sig] = signal.signal(sig, signal.SIG_IGN)
            except ValueError:  # not the main thread
                pass

    def __exit__(self, *exc):
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)


def quiet(*args) -> None:
    """The echo of a rank that is not the leader."""


def crossed(every: int, before: int, after: int) -> bool:
    """Whether a step from `before` to `after` windows passed a multiple of `every` (0: never)."""
    return bool(every) and after // every > before // every


def default_path(model: str) -> Path:
    name = Path(model).name or model.replace("/", "-")
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def train_run(cfg: TrainConfig, echo=say) -> dict:
    ranks = Ranks.init()
    run = ranks.together(lambda: Run(cfg, echo, ranks))  # a refusal anywhere stops every rank
    echo = run.echo
    est = run.memory
    echo(
        f"model {cfg.model} ({run.layout.model_type}), {len(run.train_set.examples)} training and "
        f"{len(run.valid_set.examples)} validation windows of up to {run.window} tokens, "
        f"chunk {cfg.chunk}, {cfg.walk} walk; adapter and report go to {run.out}"
    )
    if est is not None:
        echo(
            f"memory estimate: {est.total / MIB:.1f} MiB (graph {est.graph / MIB:.1f}, K/V store "
            f"{est.store / MIB:.1f}, host {est.host / MIB:.1f})"
        )
    elif run.largest is not None:
        plan = run.largest.plan
        store = budget.store_bytes(run.layout, plan.computed, cfg.cache_type)
        echo(
            f"memory: K/V store {store / MIB:.1f} MiB, accumulators and checkpoints "
            f"{plan.host_bytes / MIB:.1f} MiB, beside the weights and one chunk's graph "
            "(mlxwalk plan estimates it all)"
        )
    summary = run.train()
    echo(report.table(summary["epochs"]))
    curve = ", report and loss curve" if summary["epochs"] else " and report"
    echo(f"adapter{curve} written to {run.out}")
    return summary
