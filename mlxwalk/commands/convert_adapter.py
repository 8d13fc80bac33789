"""`mlxwalk convert-adapter SRC DST`: a LoRA adapter from PEFT's format to mlx-lm's, or back
(training/convert.py)."""

from __future__ import annotations

import argparse

HELP = "a LoRA adapter from PEFT to mlx-lm or back"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="a folder holding adapter_model.safetensors or adapters.safetensors")
    p.add_argument("dst", help="a new or empty folder for the other format")
    p.add_argument("--model", help="the base model's folder (its layer count, PEFT to mlx-lm)")


def run(args: argparse.Namespace) -> int:
    from ..training.convert import convert

    written = convert(args.src, args.dst, args.model)
    print(f"{args.dst}: the adapter in {'mlx-lm' if written == 'mlx' else 'PEFT'}'s format")
    return 0
