"""The drop-in's preference objectives: `python -m mlxwalk.lora --objective dpo|simpo` (with
--beta, --gamma, or their YAML keys).

mlx-lm's loaders know no pairs, so {train, valid, test}.jsonl are read as `mlxwalk train` reads
them (preference/objective.py: mlx-lm-lora's formats, only the answers labelled), a pair cut to
max_seq_length keeping its start and end (the answer). Each iteration is one pair per rank, drawn
in a fresh permutation of the pairs on every pass (NumPy's global seed, as mlx-lm draws its
batches), stepped through the training loop's step and objective (the same walks, reference and
weights as `mlxwalk train`); mlx-lm's iterations, evaluations, reports and saves go around it,
the reports with the objective's metrics under mlx-lm-lora's keys (train_chosen_reward, ...).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from ..errors import DataError, NonFinite
from ..preference.objective import METRICS
from ..training.mlx_framework import MLXFramework, WindowStep
from ..training.ranks import Ranks
from ..training.step import Walker
from .trainer import Tally, clear_cache, save


def load(o, tokenizer, objective, vocab: int) -> tuple:
    """The train, valid and test pairs the run asks for (None where not asked or absent)."""
    folder = Path(o.data)

    def split(name: str, wanted: bool):
        if not wanted or not (folder / f"{name}.jsonl").is_file():
            return None
        pairs = objective.load(folder, name, tokenizer, o.max_seq_length, "middle")
        pairs.check_ids(vocab)
        if pairs.truncated:
            print(
                f"[WARNING] {pairs.truncated} {name} pair(s) longer than max_seq_length "
                f"({o.max_seq_length}) are cut to it, keeping their start and end (the answer); "
                "the walk needs no cut: drop --max-seq-length to keep them whole",
                flush=True,
            )
        if pairs.cut_away:
            print(
                f"[WARNING] {pairs.cut_away} {name} pair(s) dropped: max_seq_length "
                f"({o.max_seq_length}) cut an answer away",
                flush=True,
            )
        return pairs if pairs.examples else None

    sets = split("train", o.train), split("valid", o.train), split("test", o.test)
    for name, wanted, pairs in (("train", o.train, sets[0]), ("test", o.test, sets[2])):
        if wanted and pairs is None:
            raise DataError(
                f"{folder / f'{name}.jsonl'}: no preference pair to {name} on for --objective "
                f"{objective.name} (the file is missing, or every pair in it was skipped)"
            )
    return sets


def order(n: int, size: int):
    """Each iteration's pairs, a pair per rank: passes over a fresh permutation, a short last
    batch dropped (as mlx-lm's iterate_batches drops it)."""
    if n < size:
        raise DataError(f"{n} training pair(s) for {size} ranks: each rank needs its own pair")
    while True:
        perm = np.random.permutation(n)
        for start in range(0, n - size + 1, size):
            yield [int(i) for i in perm[start : start + size]]


def evaluate(fw, pairs, objective, cfg, batches: int | None) -> tuple[float, dict]:
    """The pairs' mean loss and metrics (the first `batches` pairs per rank; -1: all), each rank
    its share, the sums reduced."""
    ranks, names = fw.ranks, list(objective.metrics)
    items = pairs.examples
    if batches not in (-1, None):
        items = items[: batches * ranks.size]
    sums = np.zeros(2 + len(names), np.float64)  # (loss, count, each metric)
    fw.train_mode(False)
    try:
        for item in items[ranks.rank :: ranks.size]:
            walker = Walker(fw, cfg, 0, None)
            loss = objective.evaluate(item, walker)
            sums += [loss, 1.0, *(walker.noted[k] for k in names)]
    finally:
        fw.train_mode(True)
    sums = ranks.sum_numpy(sums)
    return float(sums[0] / sums[1]), dict(zip(names, (sums[2:] / sums[1]).tolist()))


def train(
    model,
    optimizer,
    train_set,
    valid_set,
    args,
    objective,
    training_callback=None,
    *,
    walk_config,
    adapter_config: dict | None = None,
) -> None:
    """`args.iters` iterations of one pair per rank through `objective` (see the module doc)."""
    ranks = Ranks.init()
    fw = MLXFramework.around(model, optimizer, ranks)
    cfg = WindowStep(walk_config)
    tally = Tally(training_callback if ranks.leader else None, optimizer)
    model.train()
    batches = order(len(train_set.examples), ranks.size)
    for it, batch in zip(range(1, args.iters + 1), batches):
        due = it == 1 or it % args.steps_per_eval == 0 or it == args.iters  # as mlx-lm's
        if valid_set is not None and due:
            tic = time.perf_counter()
            loss, means = evaluate(fw, valid_set, objective, cfg, args.val_batches)
            tally.validated(it - 1, loss, time.perf_counter() - tic, means)
        tic = time.perf_counter()
        items = [train_set.examples[i] for i in batch]
        slots = [None] * ranks.size
        slots[ranks.rank] = items[ranks.rank]
        stepped = fw.step(slots, cfg, it - ranks.rank, None, objective)  # each item seeded `it`
        if not stepped.finite:
            kept = Path(args.adapter_file)
            last = f"{kept} is as saved" if kept.exists() else "nothing was saved"
            raise NonFinite(
                f"iteration {it}: {stepped.error or 'a NaN or infinite loss or gradient'}; "
                f"stopped before its step ({last})"
            )
        clear_cache(getattr(args, "clear_cache_threshold", 0))
        tokens = sum(len(w) for item in items for w in objective.windows(item))
        means = {k: float(v.mean()) for k, v in stepped.metrics.items()}  # each pair counts once
        tally.add(float(stepped.losses.mean()), tokens, time.perf_counter() - tic, means)
        if it % args.steps_per_report == 0 or it == args.iters:
            tally.report(it)
        if ranks.leader and (it % args.steps_per_save == 0 or it == args.iters):
            numbered = it if it % args.steps_per_save == 0 else None
            save(model, Path(args.adapter_file), numbered, adapter_config)


def metrics_said(info: dict, side: str) -> str:
    """An objective's metrics in a report (`side`_<name>) as `mlxwalk train`'s lines say them:
    ", chosen_r 0.012, rejected_r -0.034, acc 0.750, margin 0.046" ("" for token loss)."""
    said = [(label, info.get(f"{side}_{k}")) for k, label in METRICS.items()]
    return "".join(f", {label} {v:.3f}" for label, v in said if v is not None)


def test(model, pairs, objective, walk_config, batches: int, ranks: Ranks) -> None:
    """--test on pairs: their mean loss and metrics, said as mlx-lm says its test loss."""
    fw = MLXFramework.around(model, None, ranks)
    loss, means = evaluate(fw, pairs, objective, WindowStep(walk_config), batches)
    if ranks.leader:
        said = metrics_said({f"test_{k}": v for k, v in means.items()}, "test")
        print(f"Test loss {loss:.3f}{said}.", flush=True)
