"""`mlxwalk train`'s options: flags, a YAML config (-c), and their merge into a TrainConfig.
A flag given on the command line overrides the config file, which overrides the defaults."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from pathlib import Path

from ..errors import ConfigError
from .config import TrainConfig, option


@dataclass
class PlanOptions:
    """`mlxwalk plan`'s options of its own, beside the TrainConfig fields it takes."""

    macs: bool = option(
        False,
        "for each Mac memory size (16 to 128 GB) at macOS's default GPU working set: whether "
        "the window trains exactly, and the longest window that does",
    )


def flags(plan: bool = False) -> dict[str, tuple[str, str]]:
    """TrainConfig's fields that are flags: name -> (its type as text, its help); `plan`: those
    `mlxwalk plan` takes."""
    out = {}
    for f in fields(TrainConfig):
        meta = f.metadata
        if meta.get("flag", True) and (meta.get("plan") or not plan):
            own = plan and isinstance(meta.get("plan"), str)  # a help of its own under plan
            out[f.name] = (str(f.type), meta["plan"] if own else meta["help"])
    return out


def with_default(text: str, default) -> str:
    """An option's help with its default, where it has one (an off switch: "default off")."""
    if default is None or "(default" in text:  # (None: the help says what happens instead)
        return text
    return f"{text} (default {'off' if default is False else default})"


def add_flags(p: argparse.ArgumentParser, plan: bool = False) -> None:
    """One flag per option (no default here: an unset flag leaves the YAML's value or the
    dataclass's default in place)."""
    if not plan:
        p.add_argument("-c", "--config", help="a YAML file of these options")
    defaults = TrainConfig()
    for name, (kind, text) in flags(plan).items():
        add_flag(p, name, kind, with_default(text, getattr(defaults, name)))
    if plan:
        for f in fields(PlanOptions):
            add_flag(p, f.name, str(f.type), with_default(f.metadata["help"], f.default))
    if not plan:
        p.add_argument(
            "--no-progress",
            action="store_true",
            help="no progress bar (default: a bar on a terminal, else a line per window)",
        )


def add_flag(p: argparse.ArgumentParser, name: str, kind: str, text: str) -> None:
    """`--name` of a field's type (as text) with its help; unset, it is None."""
    flag = "--" + name.replace("_", "-")
    if kind == "bool":
        p.add_argument(flag, action="store_true", default=None, help=text)
    elif kind.startswith("list"):
        p.add_argument(flag, nargs="+", default=None, help=text)
    else:
        base = {"int": int, "float": float}.get(kind.split("|")[0].strip(), str)
        p.add_argument(flag, type=base, default=None, help=text)


def read_mapping(path: str, known: set[str]) -> dict:
    """A YAML file of options, numbers read as mlx-lm reads them (1e-5 is a float, not a
    string); a key not in `known` is refused (dashes read as underscores)."""
    import yaml
    from mlx_lm.lora import yaml_loader

    file = Path(path)
    if not file.exists():
        raise ConfigError(f"config file {file} does not exist")
    try:
        values = yaml.load(file.read_text(), yaml_loader) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)  # where the parser stopped, counted from 0
        at = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{file}{at}: not valid YAML ({what})") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{file}: expected a mapping of options")
    values = {str(k).replace("-", "_"): v for k, v in values.items()}
    for key in values:
        if key not in known:
            raise ConfigError(f"{file}: unknown key {key!r}")
    return values


def read_yaml(path: str) -> dict:
    return read_mapping(path, {f.name for f in fields(TrainConfig)})


def config_from(args: argparse.Namespace) -> TrainConfig:
    values = read_yaml(args.config) if args.config else {}
    values.update({k: v for k in flags() if (v := getattr(args, k)) is not None})
    if args.no_progress:
        values["progress"] = False
    return TrainConfig(**values)
