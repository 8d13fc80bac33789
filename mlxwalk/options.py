"""`mlxwalk train`'s options: flags, a YAML config (-c), and their merge into a TrainConfig.
A flag given on the command line overrides the config file, which overrides the defaults."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

from .config import TrainConfig
from .plan import PlanError

FLAGS = {  # name: (type, help); booleans are store_true
    "model": (str, "a model folder, a bundled model, or a hub id in the local cache"),
    "data": (str, "a folder with train.jsonl and optionally valid.jsonl (default: a sample)"),
    "walk": (str, "exact (one step per window) or plain (one step per chunk)"),
    "window": (int, "positions per window (default: the longest example, rounded to chunk)"),
    "chunk": (int, "positions per chunk"),
    "horizon": (int, "prefix positions each chunk sends gradient to (0 = the whole window)"),
    "cache_type": (str, "K/V store: float32, float16, bfloat16 or q8"),
    "host_budget_mib": (float, "accumulators + checkpoints"),
    "memory_budget_mib": (float, "all the run holds in MLX's memory: refused or held to it"),
    "recompute": (bool, "activation checkpointing inside each chunk's graph"),
    "epochs": (int, "passes over the training windows"),
    "iters": (int, "stop after this many windows"),
    "lr": (float, "learning rate"),
    "optimizer": (str, "adam, adamw or sgd"),
    "rank": (int, "LoRA rank"),
    "scale": (float, "LoRA scale"),
    "dropout": (float, "LoRA dropout"),
    "num_layers": (int, "layers (from the last) that get adapters; -1 = all"),
    "targets": (list, "module keys within a layer to adapt (default: mlx-lm's choice)"),
    "seed": (int, "random seed"),
    "adapter_path": (str, "folder for the adapter, checkpoints and report"),
    "save_every": (int, "windows between checkpoints (0 = each epoch's end)"),
    "resume": (bool, "continue the run in the adapter path from its newest checkpoint"),
    "overwrite": (bool, "replace another run in the adapter path"),
    "on_nan": (str, "a NaN or infinite loss or gradient: stop (default) or skip the window"),
    "val_split": (float, "fraction of train.jsonl held out when there is no valid.jsonl"),
    "fit": (str, "an over-long example keeps its left part, or its start and end (middle)"),
    "follow_runs": (bool, "no chunk crosses a change of label (the plan's strict rule)"),
}


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", help="a YAML file of these options")
    for name, (kind, text) in FLAGS.items():
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            p.add_argument(flag, action="store_true", default=None, help=text)
        elif kind is list:
            p.add_argument(flag, nargs="+", default=None, help=text)
        else:
            p.add_argument(flag, type=kind, default=None, help=text)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def read_mapping(path: str, known: set[str]) -> dict:
    """A YAML file of options; a key not in `known` is refused (dashes read as underscores)."""
    import yaml

    file = Path(path)
    if not file.exists():
        raise PlanError(f"config file {file} does not exist")
    try:
        values = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as e:
        raise PlanError(f"{file}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(values, dict):
        raise PlanError(f"{file}: expected a mapping of options")
    values = {str(k).replace("-", "_"): v for k, v in values.items()}
    for key in values:
        if key not in known:
            raise PlanError(f"{file}: unknown key {key!r}")
    return values


def read_yaml(path: str) -> dict:
    return read_mapping(path, {f.name for f in fields(TrainConfig)})


def config_from(args: argparse.Namespace) -> TrainConfig:
    values = read_yaml(args.config) if args.config else {}
    values.update({k: v for k in FLAGS if (v := getattr(args, k)) is not None})
    if args.no_progress:
        values["progress"] = False
    return TrainConfig(**values)
