"""A run's data folder as its windows: train.jsonl (and valid.jsonl, or a held-out share of the
training examples), the window size (the longest example rounded up to the chunk, unless given,
within the model's positions), every example fitted to it; every skip and cut announced."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import DataError
from . import data


@dataclass
class Windows:
    train: data.Dataset
    valid: data.Dataset
    window: int  # positions per window
    window_asked: int  # what --window (or the longest example) asked for


def load(cfg, folder: Path, tokenizer, vocab: int, limit: int | None, echo) -> Windows:
    whole = data.load(folder, "train", tokenizer, None, mask_prompt=cfg.mask_prompt)
    if not whole.examples:
        raise DataError(
            f"no training example has a labelled token ({whole.source}: "
            f"{whole.skipped} rows, each skipped)"
        )
    whole.check_ids(vocab)
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
    if (folder / "valid.jsonl").exists():
        valid = data.load(folder, "valid", tokenizer, window, cfg.fit, cfg.mask_prompt)
        valid.check_ids(vocab)
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
    return Windows(train, valid, window, cfg.window or longest)


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
