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
import signal
import tempfile
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np
import numpy.random  # noqa: F401  (now, not lazily at the first window: see `noticed`)

from ..errors import ConfigError, FolderError, NonFinite, RanksError
from ..plan import MIB
from . import data, report, samples, windows
from .config import TrainConfig
from .files import FolderLock, NewFolder, sweep
from .framework import Framework
from .runfolder import (
    Position,
    RunFolder,
    WriteFailed,
    identity,
    refuse_overlap,
    try_write,
    writable,
)
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


def say(*args) -> None:
    print(*args, flush=True)


class Run:
    """One training run on one framework (`fw`, its mechanics): setup (every refusal happens
    here), then epochs of windows."""

    def __init__(self, cfg: TrainConfig, fw: Framework | None = None, echo=say):
        if fw is None:  # MLX's, in one process
            from .mlx_framework import MLXFramework

            fw = MLXFramework()
        self.cfg = cfg.check()
        self.fw, self.ranks = fw, fw.ranks
        self.echo = echo if self.ranks.leader else quiet  # one voice: the rank that writes
        fw.refuse(cfg)
        if cfg.walk == "plain" and self.ranks.size > 1:
            raise RanksError(
                "--walk plain steps once per chunk; across ranks only the exact "
                "walk's steps combine"
            )
        self.out = writable(Path(cfg.adapter_path or default_path(cfg.model)))
        data_folder = data.check_folder(cfg.data) if cfg.data else samples.folder()
        refuse_overlap(self.out, fw.model_folder(cfg.model), data_folder)
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
        echo, fw = self.echo, self.fw
        if self.ranks.leader:
            self.folder.claim(cfg.overwrite, cfg.resume)
            try_write(self.out, fw)
        self.loaded = loaded = fw.load(cfg)
        if cfg.window is not None and loaded.limit is not None and cfg.window > loaded.limit:
            raise ConfigError(
                f"--window {cfg.window} exceeds the model's maximum positions ({loaded.limit})"
            )
        sets = windows.load(cfg, data_folder, loaded.tokenizer, loaded.vocab, loaded.limit, echo)
        self.train_set, self.valid_set = sets.train, sets.valid
        self.window, self.window_asked = sets.window, sets.window_asked
        fw.adapt(cfg, self.steps())
        self.position = Position()
        self.peak = 0
        self.cfg = cfg = fw.budget(cfg, echo)
        self.watch = Watch(cfg, loaded.vocab, echo)
        self.streak = 0  # non-finite windows in a row (--on-nan skip)
        self.reduce_seconds = 0.0  # in the steps' reductions (and waiting for other ranks)
        self.undo = None  # (position, adapter and optimizer state) at the window's start
        self.partial: Epoch | None = None  # the epoch row of a run stopped by --iters
        self.bar = None
        self.stops: noticed | None = None  # the loop's stop signals, while it runs
        self.rescued: Path | None = None  # where a failed write's adapter went instead
        if cfg.optimizer != "sgd" and cfg.lr > LR_WARN:
            echo(
                f"warning: --lr {cfg.lr:g} is far above what Adam trains LoRA with (1e-6 to "
                "1e-3); expect the loss to diverge"
            )
        self.admission = self._admit()
        files = [data_folder / "train.jsonl", data_folder / "valid.jsonl"]
        self.identity = identity(cfg, str(loaded.path), loaded.fingerprint, files, self.window)
        self.identity.update(
            backend=fw.name, ranks=self.ranks.size, windows_per_step=cfg.windows_per_step
        )
        self.resumed_from = self._resume() if cfg.resume else None

    def release(self, keep: bool) -> None:
        """The folder's lock dropped at the run's end; unless `keep`, the folders the run made
        removed as long as they hold nothing."""
        self.lock.release()
        if not keep:
            self.made.discard()

    def _admit(self):
        """The exact walk's plan for the largest window, and under a memory budget its estimate
        (refused here if it cannot fit). A window computes up to its last labelled position, so
        that, not its length, sizes it. Without a budget nothing is probed."""
        if self.cfg.walk != "exact":
            return None
        largest = max(self.train_set.examples, key=lambda e: np.flatnonzero(e.weights).max())
        return self.fw.admit(self.cfg, largest)

    def _resume(self) -> Path:
        """Adopt the folder's run (identity checked), load its newest checkpoint strictly."""
        self.folder.check_resume(self.identity)
        last, self.position = self.folder.load(self.fw.load_state)
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
        was = self.fw.resume_lr(self.cfg)
        if was is not None:
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
                self.fw.save_adapter(self.out, self.cfg)
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
        self.fw.train_mode(True)
        self.stops = noticed()
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
            self.stops.close()
            self.bar.close()

    def on_chunk(self, *args) -> None:
        if self.stops is not None:
            self.stops.check()
        self.bar.chunk(*args)

    def step(self, examples: list[data.Example]) -> None:
        """One optimizer step on the windows `examples` (the step's slice of the epoch's order;
        this rank walks its share). The position moves (one assignment) only once the step is
        taken; an interruption before that puts the adapter back as it was (`undo`)."""
        p, cfg, fw = self.position, self.cfg, self.fw
        self.undo = (p, fw.snapshot())
        if self.stops is not None:
            self.stops.check()
        tic = time.perf_counter()
        fw.reset_peak()
        if cfg.walk == "plain":
            stepped = fw.step_plain(examples[0], cfg, cfg.seed + p.windows, self.on_chunk)
        else:
            stepped = fw.step(examples, cfg, cfg.seed + p.windows, self.on_chunk)
        self.reduce_seconds += stepped.reduce_seconds  # the wait for the slowest rank too
        if not stepped.finite:
            fw.restore(self.undo[1])
            self.non_finite(examples, stepped.error or NonFinite("a NaN or infinite loss"))
            return
        self.stepped(examples, stepped.losses, stepped.horizons, time.perf_counter() - tic)

    def stepped(self, examples, losses, horizons, seconds: float) -> None:
        """The position after a step on `examples`: every window's loss, and the narrowed ones."""
        p, cfg = self.position, self.cfg
        peak = self.fw.peak()
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

    def non_finite(self, examples: list[data.Example], error: BaseException) -> None:
        p, n = self.position, len(examples)
        first = examples[0].where or "an example"
        where = (
            f"window {p.windows + 1} (epoch {p.epoch + 1}, {first})"
            if n == 1
            else f"the step on windows {p.windows + 1}-{p.windows + n} (epoch {p.epoch + 1}, "
            f"from {first})"
        )
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
        self.fw.train_mode(False)
        try:  # each rank its share; the sums reduced together
            for ex in self.valid_set.examples[self.ranks.rank :: self.ranks.size]:
                total += self.fw.window_loss(ex, self.cfg) * ex.trainable
                weight += ex.trainable
        finally:
            self.fw.train_mode(True)
        if self.ranks.size > 1:
            total, weight = self.ranks.sum_numpy(np.array([total, weight], np.float64))
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
        saved = self.folder.save(lambda tmp: self.fw.save_state(tmp, self.cfg), self.position)
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
                self.fw.restore(self.undo[1])
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
            self.fw.save_adapter(folder, self.cfg)
            return folder
        except (OSError, RuntimeError, ValueError):
            return None

    # --- the report ----------------------------------------------------------------------------

    def finish(self) -> dict:
        cfg, admitted = self.cfg, self.admission
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
            "memory_estimate_mib": mib_or_none(admitted.total) if admitted else None,
            "host_mib": round(admitted.plan.host_bytes / MIB, 2) if admitted else 0.0,
            "graph_mib": mib_or_none(admitted.graph) if admitted else None,
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
            "backend": self.fw.name,
            **self.fw.report(),
        }
        if self.ranks.leader:
            report.write(self.out, summary)
        return summary


STOP_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)


class noticed:
    """The loop's stop signals (Ctrl-C, and those handled as it) noted as they come, as well as
    handled: an interruption that code in the window swallows (an import interrupted, as numpy's
    lazy `numpy.random` is now and then) is raised again at the next chunk (`check`). Signals
    ignored, or left to their default action, are left so."""

    def __init__(self):
        self.came: int | None = None
        self.saved = {}
        for sig in STOP_SIGNALS:
            handler = signal.getsignal(sig)
            if not callable(handler):
                continue
            try:
                signal.signal(sig, self.noting(handler))
            except ValueError:  # not the main thread
                continue
            self.saved[sig] = handler

    def noting(self, handler):
        def note(signum, frame):
            self.came = signum
            handler(signum, frame)

        return note

    def check(self) -> None:
        if self.came is not None:
            self.came = None
            raise KeyboardInterrupt

    def close(self) -> None:
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)
        self.saved = {}


class shielded:
    """The stop signals held off within the block (where the main thread can hold them)."""

    def __enter__(self):
        self.saved = {}
        for sig in STOP_SIGNALS:
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


def mib_or_none(n: int | None) -> float | None:
    return None if n is None else round(n / MIB, 2)


def train_run(cfg: TrainConfig, echo=say, framework=None) -> dict:
    """A run on `framework` (a class taking the ranks; default MLX's), with its first lines and
    its table."""
    from .mlx_framework import MLXFramework

    kind = framework or MLXFramework
    ranks = kind.ranks_class().init()
    run = ranks.together(lambda: Run(cfg, kind(ranks), echo))  # a refusal stops every rank
    echo, admitted = run.echo, run.admission
    echo(
        f"model {cfg.model} ({run.loaded.described}), {len(run.train_set.examples)} training and "
        f"{len(run.valid_set.examples)} validation windows of up to {run.window} tokens, "
        f"chunk {cfg.chunk}, {cfg.walk} walk; adapter and report go to {run.out}"
    )
    if admitted is not None and admitted.total is not None:
        echo(
            f"memory estimate: {admitted.total / MIB:.1f} MiB (graph {admitted.graph / MIB:.1f}, "
            f"K/V store {admitted.store / MIB:.1f}, host {admitted.plan.host_bytes / MIB:.1f})"
        )
    elif admitted is not None:
        echo(
            f"memory: K/V store {admitted.store / MIB:.1f} MiB, accumulators and checkpoints "
            f"{admitted.plan.host_bytes / MIB:.1f} MiB, beside the weights and one chunk's graph "
            "(mlxwalk plan estimates it all)"
        )
    summary = run.train()
    echo(report.table(summary["epochs"]))
    curve = ", report and loss curve" if summary["epochs"] else " and report"
    echo(f"adapter{curve} written to {run.out}")
    return summary
