"""`mlxwalk.train`: mlx-lm's `tuner.trainer.train`, with each iteration one window trained by the
walk. It takes the same arguments (mlx-lm's `TrainingArgs`, datasets whose items are
`(tokens, offset)` as `CacheDataset` gives them, a `TrainingCallback`) and reports through the
callback with mlx-lm's keys. One window per iteration: `batch_size` must be 1.
"""

from __future__ import annotations

import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from . import arch
from .guards import NonFinite, check_ids
from .plan import PlanError
from .walk import WalkConfig, Window, train_window, window_loss


def window_of(item, max_length: int) -> Window | None:
    """(tokens, offset) -> a window labelled from `offset` on, cut to `max_length`; None if the
    cut leaves nothing labelled."""
    tokens, offset = item if isinstance(item, tuple) else (item, 0)
    tokens = list(tokens)[: max_length + 1]
    if len(tokens) < 2:
        return None
    weights = (np.arange(1, len(tokens)) >= offset).astype(np.float32)
    if not weights.any():
        return None
    return Window.of(tokens[:-1], tokens[1:], weights)


def named(fn, where: str) -> None:
    try:
        fn()
    except PlanError as e:
        raise PlanError(f"{where}: {e}") from None


def check(args) -> None:
    if args.batch_size != 1:
        raise PlanError(f"batch_size {args.batch_size}: the walk trains one window per step; use 1")
    if getattr(args, "grad_accumulation_steps", 1) != 1:
        raise PlanError("grad_accumulation_steps: the exact walk already takes one step per window")


def evaluate(model, dataset, args, walk: WalkConfig, batches: int) -> float:
    total, weight = 0.0, 0.0
    n = len(dataset) if batches in (-1, None) else min(batches, len(dataset))
    model.eval()
    try:
        for i in range(n):
            window = window_of(dataset[i], args.max_seq_length)
            if window is not None:
                total += window_loss(model, window, walk) * window.total
                weight += window.total
    finally:
        model.train()
    return total / weight if weight else float("nan")


def train(
    model,
    optimizer,
    train_dataset,
    val_dataset=None,
    args=None,
    training_callback=None,
    *,
    walk: str = "exact",
    walk_config: WalkConfig | None = None,
    adapter_config: dict | None = None,
) -> None:
    """Train `model`'s trainable parameters for `args.iters` windows (see the module doc).
    With `adapter_config`, adapter_config.json is written beside every save of the adapter, so
    the folder mlx-lm loads from is complete whenever it holds an adapter. A NaN or infinite loss
    or gradient stops before its step (NonFinite), naming the iteration; nothing is saved."""
    from mlx_lm.tuner.trainer import TrainingArgs

    args = args or TrainingArgs()
    check(args)
    base = walk_config or WalkConfig(chunk=512, recompute=args.grad_checkpoint)
    layout = arch.inspect(model)
    vocab = layout.vocab
    order: list[int] = []
    losses, tokens, trained, steps, elapsed = 0.0, 0, 0, 0, 0.0
    model.train()
    for it in range(1, args.iters + 1):
        if (
            val_dataset is not None
            and len(val_dataset)
            and (it == 1 or it % args.steps_per_eval == 0 or it == args.iters)
        ):
            tic = time.perf_counter()
            val_loss = evaluate(model, val_dataset, args, base, args.val_batches)
            if training_callback is not None:
                training_callback.on_val_loss_report(
                    {"iteration": it - 1, "val_loss": val_loss,
                     "val_time": time.perf_counter() - tic}
                )  # fmt: skip
        window, tried = None, 0
        while window is None:
            if tried == 2 * len(train_dataset):  # a whole permutation has been seen
                raise PlanError(
                    "no training item has a labelled token within max_seq_length "
                    f"({args.max_seq_length})"
                )
            if not order:
                order = list(np.random.permutation(len(train_dataset)))  # seeded as mlx-lm's
            item = int(order.pop())
            window = window_of(train_dataset[item], args.max_seq_length)
            tried += 1
            if window is not None:
                named(lambda w=window: check_ids(w, vocab), f"training item {item}")
        tic = time.perf_counter()
        config = WalkConfig(**{**base.__dict__, "seed": it})
        try:
            run = train_window(model, optimizer, window, config, walk, layout=layout)
        except NonFinite as e:
            last = (
                f"{args.adapter_file} is as saved"
                if Path(args.adapter_file).exists()
                else ("nothing was saved")
            )
            raise NonFinite(f"iteration {it}: {e}; stopped before its step ({last})") from None
        elapsed += time.perf_counter() - tic
        losses += run.loss
        tokens += int(window.total)
        steps += 1
        if it % args.steps_per_report == 0 or it == args.iters:
            trained += tokens
            if training_callback is not None:
                training_callback.on_train_loss_report({
                    "iteration": it,
                    "train_loss": losses / steps,
                    "learning_rate": float(optimizer.learning_rate),
                    "iterations_per_second": steps / elapsed,
                    "tokens_per_second": tokens / elapsed,
                    "trained_tokens": trained,
                    "peak_memory": mx.get_peak_memory() / 1e9,
                })  # fmt: skip
            losses, tokens, steps, elapsed = 0.0, 0, 0, 0.0
        if it % args.steps_per_save == 0 or it == args.iters:
            step = it if it % args.steps_per_save == 0 else None
            save(model, Path(args.adapter_file), step, adapter_config)


def save(model, file: Path, iteration: int | None, config: dict | None = None) -> None:
    import json

    from .files import atomic_write, write_text

    weights = dict(tree_flatten(model.trainable_parameters()))
    if config is not None:  # first, so an adapter is never without its config
        write_text(file.parent / "adapter_config.json", json.dumps(config, indent=4))
    atomic_write(file, lambda p: mx.save_safetensors(p, weights))
    if iteration is not None:
        step = file.parent / f"{iteration:07d}_adapters.safetensors"
        atomic_write(step, lambda p: mx.save_safetensors(p, weights))
