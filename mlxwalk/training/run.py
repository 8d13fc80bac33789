"""`mlxwalk train`: a training run over jsonl data, one window per example.

Each example is its own window (no packing: the walk exists for long windows, and packing would
let short examples attend to each other). The run reads top to bottom: its setup (setup.py:
every refusal, the folder opened and claimed before anything is loaded, identity and resume
checked together), then the loop here (epochs of steps, evaluation, checkpoints, the report),
with a failure's rescue in rescue.py and the report's contents in report.py. The loop takes an
objective (objective.py: how an item becomes a loss and a gradient; token cross-entropy by
default) and callbacks (mlx-lm's TrainingCallback's two methods), so a new objective plugs in
without touching it.

The exact walk takes one optimizer step per `windows_per_step` windows per rank (step.py), the
plain walk one per labelled chunk. After each epoch the validation examples are evaluated; every
`save_every` windows, at each epoch's end, at `--iters` and on Ctrl-C, a checkpoint (adapter,
optimizer state, position in the data) is written to a fresh folder that is renamed into place,
so a run killed at any moment resumes with `--resume` from the last checkpoint (runfolder.py says
what must match). A run that fails leaves nothing it made, except checkpoints it can resume from.
"""

from __future__ import annotations

import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import numpy.random  # noqa: F401  (now, not lazily at the first window: see rescue.noticed)

from ..errors import NonFinite
from ..plan import MIB
from . import objective as objectives
from . import report, rescue, setup
from .config import TrainConfig
from .framework import Framework
from .objective import Objective
from .step import Stepped, Walker


def say(*args) -> None:
    print(*args, flush=True)


class Run:
    """One training run on one framework (`fw`, its mechanics) toward `objective`, telling
    `callbacks` (each with mlx-lm's on_train_loss_report and on_val_loss_report) as it goes."""

    def __init__(
        self,
        cfg: TrainConfig,
        fw: Framework | None = None,
        echo=say,
        objective: Objective | None = None,
        callbacks: tuple = (),
    ):
        objective = objective or objectives.of(cfg)
        if fw is None:  # MLX's, in one process
            from .mlx_framework import MLXFramework

            fw = MLXFramework()
        self.setup = s = setup.prepare(cfg, fw, echo, objective)
        self.cfg, self.fw, self.ranks, self.echo = s.cfg, fw, fw.ranks, s.echo
        self.objective, self.callbacks = objective, list(callbacks)
        self.folder, self.out, self.watch = s.folder, s.folder.folder, s.watch
        self.train_set, self.valid_set = s.windows.train, s.windows.valid
        self.position, self.total = s.position, s.windows.total
        self.per_step = self.cfg.windows_per_step * self.ranks.size  # windows a step covers
        self.peak, self.streak = 0, 0  # the memory peak; non-finite windows in a row
        self.trained = 0  # positions walked with gradient by this process, for the callbacks
        self.reduce_seconds = 0.0  # in the steps' reductions (and waiting for other ranks)
        self.undo = None  # (position, adapter and optimizer state) at the step's start
        self.partial: report.Epoch | None = None  # the epoch row of a run stopped by --iters
        self.bar = self.stops = None  # the progress bar and the stop signals, while it runs
        self.rescued: Path | None = None  # where a failed write's adapter went instead
        self.keep = True  # rescue clears it when the run leaves nothing worth keeping

    def train(self) -> dict:
        s = self.setup
        try:
            if self.ranks.leader:
                self.folder.begin(s.identity, self.cfg.overwrite, s.resumed_from is not None)
            if s.resumed_from is not None:
                self.echo(
                    f"resumed from {s.resumed_from} (epoch {self.position.epoch + 1}, "
                    f"window {self.position.windows})"
                )
            self.loop()
            summary = report.summary(self)
            if self.ranks.leader:
                self.fw.save_adapter(self.out, self.cfg)
                report.write(self.out, summary)
            return summary
        except BaseException as e:
            failed = rescue.fail(self, e)
            if failed is e:
                raise
            raise failed from None
        finally:
            self.folder.release(keep=self.keep)

    # --- the loop: epochs of steps, evaluations between, checkpoints --------------------------

    def loop(self) -> None:
        cfg, total, items = self.cfg, self.total, self.train_set.examples
        shown = cfg.progress and self.ranks.leader
        self.bar = report.progress(total, self.position.windows, enabled=shown)
        self.fw.train_mode(True)
        self.stops = rescue.noticed()
        try:
            while self.position.epoch < cfg.epochs:
                order = self.order(self.position.epoch)
                while self.position.index < len(order) and self.position.windows < total:
                    p = self.position
                    n = min(self.per_step, len(order) - p.index, total - p.windows)
                    self.step([items[i] for i in order[p.index : p.index + n]])
                    if crossed(cfg.save_every, p.windows, self.position.windows):
                        self.checkpoint()
                    if self.eval_due(p.windows):
                        self.evaluate_between()
                if self.position.index >= len(order):  # also one a stop left open at its end
                    self.end_epoch()
                    if self.position.windows >= total:
                        break
                    continue
                self.partial = report.epoch_row(self, partial=True)  # --iters: ended mid-epoch
                self.echo(report.epoch_line(self.partial, self.objective))
                self.checkpoint()
                break
        finally:
            self.stops.close()
            self.bar.close()

    def order(self, epoch: int) -> list[int]:
        return list(
            np.random.default_rng(self.cfg.seed + epoch).permutation(len(self.train_set.examples))
        )

    def on_chunk(self, *args) -> None:
        if self.stops is not None:
            self.stops.check()
        self.bar.chunk(*args)

    def step(self, items: list) -> None:
        """One optimizer step on `items` (the step's slice of the epoch's order; this rank walks
        its share). The position moves (one assignment) only once the step is taken; an
        interruption before that puts the adapter back as it was (`undo`)."""
        p, cfg, fw = self.position, self.cfg, self.fw
        self.undo = (p, fw.snapshot())
        if self.stops is not None:
            self.stops.check()
        tic = time.perf_counter()
        fw.reset_peak()
        seed = cfg.seed + p.windows
        if cfg.walk == "plain":
            stepped = fw.step_plain(items[0], cfg, seed, self.on_chunk)
        else:
            stepped = fw.step(items, cfg, seed, self.on_chunk, self.objective)
        self.reduce_seconds += stepped.reduce_seconds  # the wait for the slowest rank too
        if not stepped.finite:
            fw.restore(self.undo[1])
            rescue.non_finite(self, items, stepped.error or NonFinite("a NaN or infinite loss"))
            return
        self.stepped(items, stepped, time.perf_counter() - tic)

    def stepped(self, items: list, stepped: Stepped, seconds: float) -> None:
        """The position after a step on `items`: every item's loss and metrics, and the narrowed
        ones."""
        p, cfg, weight = self.position, self.cfg, self.weight
        losses, horizons, peak = stepped.losses, stepped.horizons, self.fw.peak()
        sums = {
            k: p.metrics.get(k, 0.0) + float(v @ [weight(x) for x in items])
            for k, v in stepped.metrics.items()
        }
        self.streak = 0
        narrowed = [int(h) for h in horizons if h]
        self.position = replace(
            p,
            index=p.index + len(items),
            windows=p.windows + len(items),
            loss_sum=p.loss_sum + sum(float(v) * weight(x) for v, x in zip(losses, items)),
            tokens=p.tokens + sum(weight(x) for x in items),
            seconds=p.seconds + seconds,
            losses=[*p.losses, *(round(float(v), 6) for v in losses)],
            narrowed=p.narrowed + len(narrowed),
            horizon=min([p.horizon or min(narrowed), *narrowed]) if narrowed else p.horizon,
            metrics=sums,
        )
        self.peak = max(self.peak, peak)
        for j, (x, loss, h) in enumerate(zip(items, losses, horizons)):
            used = int(h) or cfg.horizon
            self.watch.window(p.windows + j + 1, x.where, float(loss), used, peak)
        tokens = sum(self.tokens(x) for x in items)
        self.trained += tokens
        shown = min(narrowed) if narrowed else None
        loss = float(np.mean(losses))
        means = {k: float(np.mean(v)) for k, v in stepped.metrics.items()}
        said = report.metrics_said(self.objective, means)
        self.bar.window(loss, tokens / seconds, peak / MIB, shown, len(items), said)
        self.tell(
            "on_train_loss_report",
            iteration=self.position.windows,
            train_loss=loss,
            tokens_per_second=tokens / seconds,
            trained_tokens=self.trained,
            peak_memory=peak / 1e9,
            **{f"train_{k}": v for k, v in means.items()},
        )

    def weight(self, item) -> float:
        """What the epoch's mean training loss weighs the item by (the objective's weight: a
        window's labelled tokens, or 1 a pair)."""
        return self.objective.weight(item)

    def tokens(self, item) -> int:
        return sum(len(w) for w in self.objective.windows(item))

    def tell(self, what: str, **info) -> None:
        """The callbacks' `what` (on the rank that speaks)."""
        if self.ranks.leader:
            for callback in self.callbacks:
                getattr(callback, what)(info)

    def eval_due(self, before: int) -> bool:
        """--steps-per-eval: every so many windows (a step that passes a multiple counts),
        except where an epoch's end evaluates."""
        p = self.position
        epoch_end = p.index >= len(self.train_set.examples)
        return crossed(self.cfg.steps_per_eval, before, p.windows) and not epoch_end

    def evaluate_between(self) -> None:
        evaluated = self.evaluate()
        if evaluated is not None:
            loss, means = evaluated
            said = report.metrics_said(self.objective, means)
            self.echo(f"window {self.position.windows}: eval_loss {loss:.4f}{said}")
            p = self.position
            self.position = replace(p, evals=[*p.evals, [p.windows, round(loss, 6)]])

    def evaluate(self) -> tuple[float, dict] | None:
        """The validation items' mean loss and metrics (each item weighted by the objective)."""
        if not self.valid_set.examples:
            return None
        tic, names = time.perf_counter(), list(self.objective.metrics)
        sums = np.zeros(2 + len(names), np.float64)  # (loss x weight, weight, each metric x weight)
        self.fw.train_mode(False)
        try:  # each rank its share; the sums reduced together
            for item in self.valid_set.examples[self.ranks.rank :: self.ranks.size]:
                walker, weight = Walker(self.fw, self.cfg, 0, None), self.weight(item)
                loss = self.objective.evaluate(item, walker)
                sums += weight * np.array([loss, 1.0, *(walker.noted[k] for k in names)])
        finally:
            self.fw.train_mode(True)
        if self.ranks.size > 1:
            sums = self.ranks.sum_numpy(sums)
        loss, means = float(sums[0] / sums[1]), dict(zip(names, (sums[2:] / sums[1]).tolist()))
        seconds = time.perf_counter() - tic
        self.tell(
            "on_val_loss_report",
            iteration=self.position.windows,
            val_loss=loss,
            **{f"val_{k}": v for k, v in means.items()},
            val_time=seconds,
        )
        return loss, means

    def end_epoch(self) -> None:
        epoch = report.epoch_row(self)
        self.echo(report.epoch_line(epoch, self.objective))
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
            metrics={},
        )
        self.checkpoint()

    def checkpoint(self) -> Path | None:
        if not self.ranks.leader:
            return None
        saved = self.folder.save(lambda tmp: self.fw.save_state(tmp, self.cfg), self.position)
        self.folder.drop_aside()  # --overwrite: the new run now stands on its own
        return saved


def crossed(every: int, before: int, after: int) -> bool:
    """Whether a step from `before` to `after` windows passed a multiple of `every` (0: never)."""
    return bool(every) and after // every > before // every


def train_run(
    cfg: TrainConfig,
    echo=say,
    framework=None,
    objective: Objective | None = None,
    callbacks: tuple = (),
) -> dict:
    """A run on `framework` (a class taking the ranks; default MLX's), with its first lines and
    its table."""
    from .mlx_framework import MLXFramework

    kind = framework or MLXFramework
    ranks = kind.ranks_kind.init()
    make = lambda: Run(cfg, kind(ranks), echo, objective, callbacks)  # noqa: E731
    run = ranks.together(make)  # a refusal stops every rank
    for line in report.opening(run):
        run.echo(line)
    summary = run.train()
    run.echo(report.table(summary["epochs"], run.objective))
    curve = ", report and loss curve" if summary["epochs"] else " and report"
    run.echo(f"adapter{curve} written to {run.out}")
    return summary
