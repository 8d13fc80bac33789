"""A run's data folder as its windows: train.jsonl (and valid.jsonl, or a held-out share of the
training examples), the window size (the longest example rounded up to the chunk, unless given,
within the model's positions), every example fitted to it, every skip and cut announced; and how
many windows and optimizer steps the run takes over them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ConfigError, DataError
from . import data
from .objective import TOKENS


@dataclass
class Windows:
    train: data.Dataset
    valid: data.Dataset
    window: int  # positions per window
    window_asked: int  # what --window (or the longest example) asked for
    total: int = 0  # windows the run trains, over --iters or every epoch
    steps: int = 0  # optimizer steps it takes over them (the schedule's length)


def load(cfg, folder: Path, loaded, ranks: int, echo, objective=TOKENS) -> Windows:
    """`folder`'s windows for a model (`loaded`: its tokenizer, vocabulary and positions), its
    steps counted for `ranks` processes; its items as `objective` reads them (a window each, or
    a preference pair)."""
    tokenizer, vocab, limit = loaded.tokenizer, loaded.vocab, loaded.limit
    if cfg.window is not None and limit is not None and cfg.window > limit:
        raise ConfigError(f"--window {cfg.window} exceeds the model's maximum positions ({limit})")
    whole = objective.load(folder, "train", tokenizer, None, mask_prompt=cfg.mask_prompt)
    if not whole.examples:
        raise DataError(
            f"no training example has a labelled token ({whole.source}: "
            f"{whole.skipped} rows, each skipped)"
        )
    whole.check_ids(vocab)
    held_out = None  # valid.jsonl, read whole beside train and cut to the same window below
    if (folder / "valid.jsonl").exists():
        held_out = objective.load(folder, "valid", tokenizer, None, mask_prompt=cfg.mask_prompt)
        held_out.check_ids(vocab)
    longest = max(len(e) for e in whole.examples)
    asked = cfg.window or cfg.chunk * math.ceil(longest / cfg.chunk)
    window = min(asked, limit) if limit else asked
    train = whole.fitted(window, cfg.fit)  # tokenized once, then cut
    if not train.examples:
        raise DataError(
            f"every training example lost its labelled tokens when cut to the window of "
            f"{window} tokens ({train.cut_away} cut away, --fit {cfg.fit}); raise "
            "--window" + (" or try --fit middle" if cfg.fit == "left" else "")
        )
    if held_out is not None:
        valid = held_out.fitted(window, cfg.fit)
    else:
        order = np.random.default_rng(cfg.seed).permutation(len(train.examples))
        n_valid = int(round(len(order) * cfg.val_split))
        valid = data.Dataset([train.examples[i] for i in order[:n_valid]])
        train.examples = [train.examples[i] for i in sorted(order[n_valid:])]
    if not train.examples:
        raise DataError(
            f"no training example is left after --val-split {cfg.val_split} ({train.source})"
        )
    announce(train, "training", window, cfg.fit, echo)
    if valid.source:
        announce(valid, "validation", window, cfg.fit, echo)
    every = cfg.epochs * len(train.examples)
    total = every if cfg.iters is None else min(cfg.iters, every)
    return Windows(train, valid, window, cfg.window or longest, total, steps(cfg, train, ranks))


def steps(cfg, train: data.Dataset, ranks: int) -> int:
    """The optimizer steps a run takes: one per `windows_per_step x ranks` windows (the exact
    walk), or each labelled chunk's (the plain walk), over --iters or every epoch."""
    examples = train.examples
    if cfg.walk == "exact":
        per_step = cfg.windows_per_step * ranks
        per_epoch = math.ceil(len(examples) / per_step)
        if cfg.iters is None:
            return cfg.epochs * per_epoch
        return min(cfg.epochs * per_epoch, math.ceil(cfg.iters / per_step))
    per = [max(1, len({int(i) // cfg.chunk for i in np.flatnonzero(e.weights)})) for e in examples]
    every = cfg.epochs * sum(per)
    if cfg.iters is None:
        return every
    return min(every, round(cfg.iters * sum(per) / len(per)))


def announce(ds: data.Dataset, what: str, window: int, fit: str, echo) -> None:
    """Every skip and cut, counted and placed, on the console."""
    if ds.skipped:
        echo(
            f"data: {ds.skipped} {what} row(s) skipped, no labelled token: {few(ds.skipped_where)}"
        )
    if ds.truncated:
        echo(
            f"data: {ds.truncated} {what} example(s) longer than the window of {window} tokens "
            f"cut (--fit {fit})"
        )
    if ds.cut_away:
        echo(
            f"data: {ds.cut_away} {what} example(s) dropped, every label cut away: "
            f"{few(ds.cut_away_where)}"
        )


def few(places: list[str], n: int = 3) -> str:
    shown = ", ".join(places[:n])
    return shown + (f" and {len(places) - n} more" if len(places) > n else "")
