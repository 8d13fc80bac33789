"""`mlxwalk.train`: mlx-lm's `tuner.trainer.train`, each iteration one window trained by the walk.

Same signature and positional order as mlx-lm's: `(model, optimizer, train_dataset, val_dataset,
args, loss, iterate_batches, training_callback)`, the same `TrainingArgs` and `TrainingCallback`
keys. What each means for a walk:
  loss             mlx-lm's `default_loss` (the mean cross-entropy over a batch's labelled tokens)
                   is what the walk computes, chunk by chunk; a different loss function can't be
                   walked and is refused.
  iterate_batches  yields `(batch, lengths)` as mlx-lm's does; each batch row becomes a window
                   labelled exactly as `default_loss` masks it (from its offset to its length), in
                   the generator's order: with mlx-lm's own, the data order and the labels are
                   mlx-lm's for the same seed. One window per rank per step: `batch_size` must
                   be 1, or under `mlx.launch` the number of ranks (mlx-lm gives each rank its
                   row); the step's gradient is then the mean over every rank's labelled tokens
                   (mlxwalk/training/ranks.py), where mlx-lm's averages the ranks' means.
  grad_checkpoint  the walk's recompute (each chunk's graph layer by layer).
  clear_cache_threshold  as in mlx-lm, after each window.
"""

from __future__ import annotations

import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .._blas import first_use
from ..errors import ConfigError, DataError, RanksError, Refusal
from ..training.mlx_framework import MLXFramework, WindowStep
from ..training.ranks import Ranks
from ..walk import WalkConfig, Window, window_loss
from ..walk.guards import NonFinite, check_ids

NO_CUT = 1 << 31  # a max_seq_length that cuts nothing


def window_of(batch, lengths) -> Window | None:
    """One row of an mlx-lm batch as a window, labelled as `default_loss` masks it: target j
    (token j + 1) counts when offset <= j + 1 <= length. None when nothing is labelled."""
    tokens = np.asarray(batch[0])  # (L,)
    offset, length = (int(v) for v in np.asarray(lengths[0]))
    steps = np.arange(1, len(tokens))  # (L - 1,)
    weights = ((steps >= offset) & (steps <= length)).astype(np.float32)
    if len(tokens) < 2 or not weights.any():
        return None
    end = int(np.flatnonzero(weights).max()) + 1  # positions past the last label change nothing
    return Window.of(tokens[:-1][:end], tokens[1:][:end], weights[:end])


def named(fn, where: str) -> None:
    try:
        fn()
    except Refusal as e:
        raise DataError(f"{where}: {e}") from None


def check(args, loss=None, ranks: int = 1) -> None:
    from mlx_lm.tuner.trainer import default_loss

    if args.batch_size != ranks:
        each = "per step" if ranks == 1 else f"per rank per step ({ranks} ranks)"
        raise ConfigError(
            f"batch_size {args.batch_size}: the walk trains one window {each}; use {ranks}"
        )
    if getattr(args, "grad_accumulation_steps", 1) != 1:
        raise ConfigError(
            "grad_accumulation_steps: the exact walk already takes one step per window"
        )
    if loss is not None and loss is not default_loss:
        if hasattr(loss, "on_train_loss_report"):
            raise ConfigError(
                "loss: got a TrainingCallback; mlx-lm's order is (model, optimizer, "
                "train_dataset, val_dataset, args, loss, iterate_batches, "
                "training_callback): pass it as training_callback="
            )
        raise ConfigError(
            "loss: the walk computes mlx-lm's default_loss (mean cross-entropy over the labelled "
            "tokens) chunk by chunk; a custom loss can't be walked"
        )


def evaluate(
    model, dataset, args, walk: WalkConfig, batches: int, iterate_batches=None, ranks=None
) -> float:
    """mlx-lm's `evaluate`: the token-weighted mean loss over `batches` batches (-1: all) in the
    generator's order, each window decoded chunk by chunk with no gradient (under mlx.launch,
    each rank its row of each batch, the sums reduced)."""
    if iterate_batches is None:
        from mlx_lm.tuner.trainer import iterate_batches
    ranks = ranks or Ranks(None)
    total, weight = 0.0, 0.0
    model.eval()
    try:
        for i, (batch, lengths) in enumerate(iterate_batches(**batching(dataset, args, ranks))):
            if batches not in (-1, None) and i >= batches:
                break
            window = window_of(batch, lengths)
            if window is not None:
                total += window_loss(model, window, walk) * window.total
                weight += window.total
    finally:
        model.train()
    if ranks.size > 1:
        total, weight = (float(v) for v in ranks.all_sum(mx.array([total, weight], mx.float32)))
    return total / weight if weight else float("nan")


def batching(dataset, args, ranks: Ranks, loop: bool = False) -> dict:
    """iterate_batches' arguments: a row per rank (its group given only under mlx.launch, so a
    caller's own generator needn't take one)."""
    kw = dict(dataset=dataset, batch_size=ranks.size, max_seq_length=args.max_seq_length)
    if loop:
        kw["loop"] = True
    if ranks.size > 1:
        kw["comm_group"] = ranks.group
    return kw


@first_use
def train(
    model,
    optimizer,
    train_dataset,
    val_dataset=None,
    args=None,
    loss=None,
    iterate_batches=None,
    training_callback=None,
    *,
    walk: str = "exact",
    walk_config: WalkConfig | None = None,
    adapter_config: dict | None = None,
) -> None:
    """Train `model`'s trainable parameters for `args.iters` windows (see the module doc).
    With `adapter_config`, adapter_config.json is written beside every save of the adapter, so
    the folder mlx-lm loads from is complete whenever it holds an adapter. A NaN or infinite loss
    or gradient stops before its step (NonFinite), naming the iteration."""
    from mlx_lm.tuner import trainer as mlx_trainer

    args = args or mlx_trainer.TrainingArgs()
    ranks = Ranks.init()
    check(args, loss, ranks.size)
    if walk != "exact" and ranks.size > 1:
        raise RanksError(
            "walk plain steps once per chunk; across ranks only the exact walk's steps combine"
        )
    iterate_batches = iterate_batches or mlx_trainer.iterate_batches
    base = walk_config or WalkConfig(chunk=512, recompute=args.grad_checkpoint)
    fw = MLXFramework.around(model, optimizer, ranks)
    tally = Tally(training_callback if ranks.leader else None, optimizer)
    model.train()
    batches = iterate_batches(**batching(train_dataset, args, ranks, loop=True))
    for it, (batch, lengths) in zip(range(1, args.iters + 1), batches):
        if val_dataset and (it == 1 or it % args.steps_per_eval == 0 or it == args.iters):
            tic = time.perf_counter()
            val_loss = evaluate(
                model, val_dataset, args, base, args.val_batches, iterate_batches, ranks
            )
            tally.validated(it - 1, val_loss, time.perf_counter() - tic)
        tic = time.perf_counter()
        try:
            loss_value, weight = step(fw, batch, lengths, it, args, WindowStep(base, walk))
        except NonFinite as e:
            kept = Path(args.adapter_file)
            last = f"{kept} is as saved" if kept.exists() else "nothing was saved"
            raise NonFinite(f"iteration {it}: {e}; stopped before its step ({last})") from None
        clear_cache(getattr(args, "clear_cache_threshold", 0))
        tally.add(loss_value, weight, time.perf_counter() - tic)
        if it % args.steps_per_report == 0 or it == args.iters:
            tally.report(it)
        if ranks.leader and (it % args.steps_per_save == 0 or it == args.iters):
            numbered = it if it % args.steps_per_save == 0 else None
            save(model, Path(args.adapter_file), numbered, adapter_config)


class Tally:
    """The training report's sums since the last report, told to mlx-lm's `TrainingCallback`
    (None: no rank but the leader speaks) under its keys; an objective's metrics (DPO's rewards,
    accuracy, margin) as train_<name> and val_<name>, mlx-lm-lora's keys."""

    def __init__(self, callback, optimizer):
        self.callback, self.optimizer = callback, optimizer
        self.trained = 0
        self.losses, self.tokens, self.steps, self.elapsed = 0.0, 0, 0, 0.0
        self.metrics: dict[str, float] = {}

    def add(self, loss: float, weight: float, seconds: float, metrics: dict | None = None) -> None:
        self.losses += loss
        self.tokens += int(weight)
        self.steps += 1
        self.elapsed += seconds
        for k, v in (metrics or {}).items():
            self.metrics[k] = self.metrics.get(k, 0.0) + v

    def validated(self, it: int, val_loss: float, seconds: float, metrics=None) -> None:
        if self.callback is not None:
            report = {"iteration": it, "val_loss": val_loss, "val_time": seconds}
            report.update({f"val_{k}": v for k, v in (metrics or {}).items()})
            self.callback.on_val_loss_report(report)

    def report(self, it: int) -> None:
        self.trained += self.tokens
        if self.callback is not None:
            self.callback.on_train_loss_report(
                {
                    "iteration": it,
                    "train_loss": self.losses / self.steps,
                    "learning_rate": float(self.optimizer.learning_rate),
                    "iterations_per_second": self.steps / self.elapsed,
                    "tokens_per_second": self.tokens / self.elapsed,
                    "trained_tokens": self.trained,
                    "peak_memory": mx.get_peak_memory() / 1e9,
                    **{f"train_{k}": v / self.steps for k, v in self.metrics.items()},
                }
            )
        self.losses, self.tokens, self.steps, self.elapsed = 0.0, 0, 0, 0.0
        self.metrics = {}


def step(fw: MLXFramework, batch, lengths, it: int, args, config: WindowStep):
    """One iteration: this rank's row as a window, walked and stepped by the training loop's
    step (its gradient combined with the other ranks' in one all_sum). Returns the step's loss
    and labelled weight."""
    ranks, error, window = fw.ranks, None, None
    try:
        window = window_of(batch, lengths)
        if window is None:  # mlx-lm's loss would be 0/0 here
            raise DataError(
                f"iteration {it}: the batch has no labelled token within "
                f"max_seq_length ({args.max_seq_length})"
            )
        named(lambda w=window: check_ids(w, fw.layout.vocab), f"iteration {it}")
    except Exception as e:
        if ranks.size == 1:
            raise
        error, window = e, None
    stepped = fw.step_window(window, config, it, error)
    if not stepped.finite:
        where = "" if ranks.size == 1 else " on one of the ranks"
        raise NonFinite(f"{stepped.error or 'a NaN or infinite loss or gradient'}{where}")
    weights = stepped.weights
    weight = float(weights.sum())
    return float((stepped.losses * weights).sum() / weight), weight


def clear_cache(threshold: int) -> None:
    if threshold and mx.get_cache_memory() > threshold:
        mx.clear_cache()


def save(model, file: Path, iteration: int | None, config: dict | None = None) -> None:
    import json

    from ..training.files import save_safetensors, write_text

    weights = dict(tree_flatten(model.trainable_parameters()))
    if config is not None:  # first, so an adapter is never without its config
        write_text(file.parent / "adapter_config.json", json.dumps(config, indent=4))
    save_safetensors(file, weights)
    if iteration is not None:
        step = file.parent / f"{iteration:07d}_adapters.safetensors"
        save_safetensors(step, weights)
