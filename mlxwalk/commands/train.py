"""`mlxwalk train`: a training run over a data folder (no arguments: the bundled sample), on MLX
(training/run.py) or, with --backend torch, on transformers + PEFT (torch_backend/train.py)."""

from __future__ import annotations

import argparse

from ..training.options import add_flags, config_from
from . import torch_module

HELP = "train an adapter (no arguments: the bundled sample)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_flags(p)


def run(args: argparse.Namespace) -> int:
    cfg = config_from(args)
    if cfg.backend == "torch":
        train_run = torch_module("train").train_run
    else:
        from ..training.run import train_run
    train_run(cfg)
    return 0
